"""Authenticated datagrams at rendezvous (issue 20): every rank of a job agrees on one
datagram key over torch.distributed's store - derived from the user's secret, or from a
random one rank 0 hands out - or fails with one line naming the ranks that differ.

The ranks here are threads, each with its own client of one real TCPStore (as ranks
have), and each with its own environment (``environ=``): threads share os.environ."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from boundedloss.cli import main
from boundedloss.protocol.auth import KEY_BYTES, TRAILER_BYTES, AuthenticationError, job_key
from boundedloss.secret import SECRET_ENV, SECRET_FILE_ENV, read_secret_file, secret_from_env

torch_dist = pytest.importorskip("torch.distributed")

from boundedloss.torch.rendezvous import (  # noqa: E402 - after the skip
    AUTO_CHUNK_MAX,
    JobAuth,
    agree_chunk_bytes,
    rendezvous_auth,
)

TIMEOUT = timedelta(seconds=20)  # a rank that waits on a key never set fails, not hangs


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(job, world: int) -> list:
    """``job(store, rank)`` on ``world`` threads, each with its own store client; what
    each returned, or the AuthenticationError it raised."""
    master = torch_dist.TCPStore("127.0.0.1", _port(), world, True, timeout=TIMEOUT,
                                 wait_for_workers=False)
    results: list = [None] * world

    def rank(r: int) -> None:
        store = torch_dist.TCPStore("127.0.0.1", master.port, world, False, timeout=TIMEOUT)
        try:
            results[r] = job(store, r)
        except AuthenticationError as e:
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _agree(envs: list[dict], *, session: int = 7, enabled: list[bool] | None = None) -> list:
    """rendezvous_auth on len(envs) ranks, rank r with environment envs[r]."""
    on = enabled or [True] * len(envs)
    return _ranks(lambda store, r: rendezvous_auth(store, "job", r, len(envs), session,
                                                   enabled=on[r], environ=envs[r]), len(envs))


def _one_line_errors(results: list) -> list[str]:
    assert all(isinstance(e, AuthenticationError) for e in results), results
    messages = [str(e) for e in results]
    assert all("\n" not in m and m for m in messages), messages
    return messages


def test_the_same_secret_on_every_rank_gives_every_rank_the_jobs_key():
    env = {SECRET_ENV: "correct horse"}
    first = _agree([env] * 3, session=11)
    assert all(isinstance(a, JobAuth) and a.mode == "secret" for a in first), first
    assert {a.key for a in first} == {job_key(b"correct horse", 11)}
    assert len(first[0].key) == KEY_BYTES
    second = _agree([env] * 3, session=12)  # another job (session): another key
    assert {a.key for a in second} == {job_key(b"correct horse", 12)} != {first[0].key}
    assert "correct horse" not in repr(first[0]) and first[0].key.hex() not in repr(first[0])


def test_without_a_secret_rank_0_hands_out_a_random_key():
    first = _agree([{}] * 3)
    assert [a.mode for a in first] == ["random"] * 3
    assert len({a.key for a in first}) == 1 and len(first[0].key) == KEY_BYTES
    second = _agree([{}] * 3)
    assert second[0].key != first[0].key  # drawn afresh for every job


def test_off_on_every_rank_is_no_key():
    # (a secret in the environment of a job that does not authenticate is not read)
    results = _agree([{SECRET_ENV: "x"}, {SECRET_FILE_ENV: "/nonexistent"}],
                     enabled=[False, False])
    assert results == [JobAuth("off", None)] * 2
    keys = _ranks(lambda store, r: rendezvous_auth(store, "job", r, 2, 1, enabled=False,
                                                   environ={}).key, 2)
    assert keys == [None, None]


def test_a_rank_with_another_secret_fails_rendezvous_on_every_rank():
    good, bad = {SECRET_ENV: "the job's secret"}, {SECRET_ENV: "a typo"}
    messages = _one_line_errors(_agree([good, bad, good]))
    assert messages[0].startswith("the secret (BOUNDEDLOSS_SECRET or BOUNDEDLOSS_SECRET_FILE) "
                                  "of rank 1 differs from that of this rank (rank 0)")
    assert "rank 1 differs" in messages[2] and "(rank 2)" in messages[2]
    assert "of ranks 0 and 2 differs from that of this rank (rank 1)" in messages[1]
    assert all("every rank of a job needs the same secret" in m for m in messages)
    assert not any("typo" in m or "job's secret" in m for m in messages)  # never the secret


@pytest.mark.parametrize(("envs", "enabled", "says"), [
    # rank 2 without authentication
    ([{}, {}, {}], [True, True, False],
     ["rank 2 runs without authentication while this rank (rank 0) authenticates",
      "rank 2 runs without authentication while this rank (rank 1) authenticates",
      "ranks 0 and 1 authenticate datagrams while this rank (rank 2) runs without"]),
    # rank 1 has no secret (it would wait for a random key rank 0 never hands out)
    ([{SECRET_ENV: "s"}, {}, {SECRET_ENV: "s"}], [True] * 3,
     ["rank 1 has no secret", "ranks 0 and 2 have a secret", "rank 1 has no secret"]),
    # rank 0 has no secret (it hands out a random key the others do not take)
    ([{}, {SECRET_ENV: "s"}], [True] * 2,
     ["rank 1 has a secret", "rank 0 has no secret"]),
])
def test_ranks_that_authenticate_differently_fail_rendezvous_on_every_rank(envs, enabled, says):
    messages = _one_line_errors(_agree(envs, enabled=enabled))
    for message, said in zip(messages, says, strict=True):
        assert said in message, messages


def test_the_secret_file_is_read_less_its_trailing_newline(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"s3cret\n")
    results = _agree([{SECRET_FILE_ENV: str(path)}, {SECRET_ENV: "s3cret"}], session=5)
    assert [a.mode for a in results] == ["secret", "secret"]
    assert {a.key for a in results} == {job_key(b"s3cret", 5)}
    path.write_bytes(b"\x00binary\xff\r\n")
    assert read_secret_file(str(path)) == b"\x00binary\xff"


def test_a_secret_that_cannot_be_had_is_one_line_naming_where(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    assert secret_from_env() is None
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.write_text("\n")
    for env, says in (({SECRET_FILE_ENV: str(missing)}, f"cannot read {missing}"),
                      ({SECRET_FILE_ENV: str(empty)}, f"{empty} is empty"),
                      ({SECRET_FILE_ENV: str(tmp_path)}, f"cannot read {tmp_path}"),
                      ({SECRET_ENV: ""}, "BOUNDEDLOSS_SECRET is set but empty"),
                      ({SECRET_ENV: "a", SECRET_FILE_ENV: str(empty)},
                       "both BOUNDEDLOSS_SECRET and BOUNDEDLOSS_SECRET_FILE are set")):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(AuthenticationError) as caught:
            secret_from_env()
        assert says in str(caught.value) and "\n" not in str(caught.value)
        for k in env:
            monkeypatch.delenv(k)
    monkeypatch.setenv(SECRET_ENV, "from the environment")
    assert secret_from_env() == b"from the environment"


def test_a_rank_whose_secret_cannot_be_read_stops_the_others_at_once(tmp_path):
    """Its own error says why; the others do not wait for it until the store's timeout."""
    both = {SECRET_ENV: "a", SECRET_FILE_ENV: str(tmp_path / "f")}
    messages = _one_line_errors(_agree([{SECRET_ENV: "a"}, both, {SECRET_ENV: "a"}]))
    assert "both BOUNDEDLOSS_SECRET and BOUNDEDLOSS_SECRET_FILE are set" in messages[1]
    assert messages[0] == messages[2] == ("rank 1 could not set up authentication (its own "
                                          "error says why)")


def test_chunks_leave_room_for_the_tag():
    got = _ranks(lambda store, r: agree_chunk_bytes(store, "job", r, 2, "127.0.0.1",
                                                    trailer=TRAILER_BYTES), 2)
    assert got == [AUTO_CHUNK_MAX - TRAILER_BYTES] * 2


# ------------------------------------------------------------------ the command line
@pytest.fixture
def no_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


@pytest.mark.parametrize(("args", "env", "says"), [
    (["--secret-file", "{tmp}/missing"], {}, "--secret-file: cannot read {tmp}/missing"),
    (["--secret-file", "{tmp}/empty"], {}, "--secret-file: {tmp}/empty is empty"),
    (["--no-auth", "--secret-file", "{tmp}/secret"], {}, "a secret with --no-auth"),
    (["--secret-file", "{tmp}/secret"], {SECRET_ENV: "x"}, "BOUNDEDLOSS_SECRET is set too"),
    ([], {SECRET_FILE_ENV: "{tmp}/missing"}, "BOUNDEDLOSS_SECRET_FILE: cannot read"),
])
def test_train_checks_its_secret_before_anything_starts(tmp_path, capsys, monkeypatch,
                                                        no_secret, args, env, says):
    (tmp_path / "empty").write_text("")
    (tmp_path / "secret").write_text("s\n")
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(tmp=tmp_path))
    rc = main(["train", "--out", str(tmp_path / "out"),
               *(a.format(tmp=tmp_path) for a in args)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and says.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ end to end
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    return {**env, "COLUMNS": "120", **extra}


_TINY = ["--policy", "reliable", "--workers", "2", "--epochs", "1", "--steps-per-epoch", "3",
         "--deadline", "10"]


def test_a_rank_with_a_wrong_secret_fails_train_with_one_line(tmp_path):
    """`boundedloss train` once per rank (torchrun's environment), rank 1 with another
    secret: both ranks exit 1, each saying why in one line, before any training."""
    env = _env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    cmd = [sys.executable, "-m", "boundedloss.cli", "train", *_TINY, "--out", str(tmp_path)]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), SECRET_ENV: secret},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, secret in enumerate(("the job's", "another"))]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outputs
    for r, (_, err) in enumerate(outputs):
        lines = [line for line in err.splitlines() if "AuthenticationError" in line]
        assert len(lines) == 1, err
        assert lines[0].startswith(f"boundedloss train: rank {r}: AuthenticationError: "), err
        assert f"rank {1 - r} differs from that of this rank (rank {r})" in lines[0], err
        assert "Traceback" not in err, err
    assert not (tmp_path / "rounds.jsonl").exists()


def test_train_authenticates_with_a_secret_file_and_says_so(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "boundedloss.cli", "train", *_TINY,
                           "--secret-file", str(secret), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["auth"] == "secret" and summary["config"]["auth"] is True
    assert "not authenticated" not in proc.stderr


def test_train_without_authentication_warns_once(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "boundedloss.cli", "train", *_TINY,
                           "--no-auth", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "datagrams are not authenticated" in ln]
    assert len(lines) == 1, proc.stderr  # once, on one line (no source line under it)
    assert lines[0].startswith("boundedloss: ") and "register(" not in proc.stderr
    summary = json.loads(Path(out, "summary.json").read_text())
    assert summary["auth"] == "off" and summary["config"]["auth"] is False
