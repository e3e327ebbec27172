"""Authenticated datagrams (protocol/auth.py): what a forger or a replayer can do to a job.

The forger knows the session token and every header field (it has sniffed a datagram)
but not the job's key. Forged DATA, STOP, PROBE, BITMAP and ACK are counted
(``bad_auth``) and change nothing; a datagram replayed from an earlier round, from a
closed message or toward another receiver is dropped; real UDP endpoints move a message
intact while forged datagrams pour in. Both data paths, where the compiled one is built
with OpenSSL.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from boundedloss import wire
from boundedloss.net import native
from boundedloss.net.udp import UdpEndpoint, largest_chunk
from boundedloss.policy import ReliablePolicy
from boundedloss.protocol import SendStatus, TransferMux, TransportConfig
from boundedloss.protocol.auth import (
    TRAILER_BYTES,
    AuthenticationError,
    DatagramAuth,
    Gmac,
    NonceSequence,
    hkdf_sha256,
    identity,
    job_key,
    key_check,
)
from boundedloss.wire import HEADER_BYTES, CloseReason, Flag, Header, Kind
from conftest import SENTINEL, SESSION, source_bytes

KEY = job_key(b"the job's secret", SESSION)
WRONG = job_key(b"a guess", SESSION)
A, B = ("10.0.0.1", 4001), ("10.0.0.2", 4002)
CB = 64
CFG = TransportConfig(chunk_bytes=CB, peer_timeout=5.0, receive_deadline=20.0)
PATHS = [False] + ([True] if native.authenticates() else [])


# ----------------------------------------------------------------------- the MAC
def test_a_sealed_datagram_opens_only_untouched_between_the_same_two_addresses() -> None:
    body = bytes(range(200))
    sealed = b"".join(DatagramAuth(KEY, A).seal((body[:48], body[48:]), B))
    assert len(sealed) == len(body) + TRAILER_BYTES
    at_b = DatagramAuth(KEY, B)
    assert bytes(at_b.open(sealed, A)) == body
    for i in range(len(sealed)):  # any one bit anywhere
        bad = bytearray(sealed)
        bad[i] ^= 1 << (i % 8)
        assert at_b.open(bytes(bad), A) is None
    assert at_b.open(sealed, ("10.0.0.3", 4001)) is None  # from elsewhere
    assert DatagramAuth(KEY, ("10.0.0.3", 4002)).open(sealed, A) is None  # to elsewhere
    assert DatagramAuth(WRONG, B).open(sealed, A) is None
    assert at_b.open(sealed[:TRAILER_BYTES - 1], A) is None


def test_gmac_is_aes_gcm_and_no_nonce_repeats() -> None:
    # NIST's GCM test case 13 (AES-256, zero key and IV, nothing else): the tag alone
    # (its first 96 bits: our tags are truncated to those)
    assert Gmac(bytes(32)).tag(bytes(12), b"").hex() == "530f8afbc74536b9a963b4f1"
    # test case 14's tag covers a ciphertext: with it as associated data the tag differs
    assert Gmac(bytes(32)).tag(bytes(12), bytes(16)) != Gmac(bytes(32)).tag(bytes(12), b"")
    seq = NonceSequence(b"\xab" * 4 + b"\xff" * 8)
    first = seq.next()
    assert first[:4] == b"\xab" * 4 and int.from_bytes(first[4:], "big") == (1 << 62) - 1
    assert int.from_bytes(seq.next()[4:], "big") == 1 << 62  # counts up; 2^64 is far away
    auth = DatagramAuth(KEY, A)
    nonces = {auth.seal((b"x",), B)[-1][:12] for _ in range(1000)}
    assert len(nonces) == 1000
    assert DatagramAuth(KEY, A).nonces.prefix != auth.nonces.prefix  # (2^-32 to fail)


def test_keys_differ_per_secret_and_per_session_and_the_check_reveals_neither() -> None:
    assert job_key(b"s", 1) != job_key(b"s", 2) != job_key(b"t", 2)
    assert len(job_key(b"s", 1)) == 32 and job_key(b"s", 1) == job_key(b"s", 1)
    assert key_check(KEY) != key_check(WRONG) and KEY.hex() not in key_check(KEY)
    with pytest.raises(AuthenticationError):
        job_key(b"", 1)
    # RFC 5869 test case 3 (no salt = 32 zero bytes, no info), its first 32 bytes
    assert hkdf_sha256(bytes([0x0B] * 22), b"", salt=bytes(32))[:32].hex() == (
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d")
    assert identity(("1.2.3.4", 258)) == b"\x04\x01\x02\x03\x04\x01\x02"
    assert identity("fake-peer")[0] == 0


# ------------------------------------------------------------------- the core
def _pair(use_native: bool):
    """Sender core at A, receiver core at B (the compiled path under B's, or not)."""
    a = TransferMux(SESSION, CFG, auth=DatagramAuth(KEY, A))
    b = TransferMux(SESSION, CFG, auth=DatagramAuth(KEY, B))
    feed_b = b.datagram_received
    if use_native:
        feed_b = native.NativeDataPath(b).take
    return a, b, feed_b


def _deliver(src: TransferMux, feed, src_addr, now: float, keep=lambda d: True) -> list[bytes]:
    """Everything ``src`` has to send now, fed to ``feed`` as from ``src_addr``."""
    sent = [b"".join(bytes(p) for p in parts) for parts, _ in src.poll(now, 1 << 20)]
    for d in sent:
        if keep(d):
            feed(d, src_addr, now)
    return sent


def _kind(d: bytes) -> Kind:
    return Kind(d[wire.OFFSET["kind"]])


def _forge(kind: Kind, *, round_id: int = 3, message_id: int = 7, nbytes: int = 50 * CB,
           key: bytes | None = None, src=B, dst=A) -> bytes:
    """A datagram of ``kind`` with the right session and a plausible header: unsealed
    with a random tag, or sealed under ``key`` (a wrong one)."""
    count = wire.chunk_count(nbytes, CB)
    h = Header(kind, SESSION, round_id, message_id, 0, count, nbytes, CB)
    payload = {
        Kind.DATA: np.full(CB // 4, np.nan, np.float32).tobytes(),
        Kind.PROBE: b"",
        Kind.BITMAP: wire.BITMAP_PREFIX.pack(0, count) + b"\xff" * ((count + 7) // 8),
        Kind.STOP: wire.STOP_PAYLOAD.pack(count),
        Kind.ACK: wire.STOP_PAYLOAD.pack(count),
    }[kind]
    index = int(CloseReason.COMPLETE) if kind == Kind.STOP else 0
    flags = Flag.FINAL if kind in (Kind.BITMAP, Kind.PROBE) else Flag.NONE
    body = wire.control_datagram(h, kind, index, payload, flags=flags, tseq=10**6)
    if key is None:
        return body + np.random.default_rng(len(body)).bytes(TRAILER_BYTES)
    return b"".join(DatagramAuth(key, src).seal((body,), dst))


@pytest.mark.parametrize("use_native", PATHS)
@pytest.mark.parametrize("sealed_wrong", [False, True])
def test_forged_datagrams_of_every_kind_are_counted_and_change_nothing(use_native,
                                                                      sealed_wrong) -> None:
    nbytes = 50 * CB
    data = source_bytes(nbytes, 1)
    a, b, feed_b = _pair(use_native)
    dest = np.full(nbytes, SENTINEL, np.uint8)
    rx = b.start_receive(A, 3, 7, 0.0, policy=ReliablePolicy(), out=dest)
    tx = a.start_send(B, 3, 7, data, 0.0)
    key = WRONG if sealed_wrong else None
    # before any real datagram, and again halfway
    for when in ("before", "halfway"):
        if when == "halfway":
            first = [0]

            def half(d, n=first):
                n[0] += 1
                return n[0] <= 25
            _deliver(a, feed_b, A, 0.001, half)
        for kind in (Kind.DATA, Kind.PROBE):  # toward the receiver, as from the sender
            feed_b(_forge(kind, key=key, src=A, dst=B), A, 0.002)
        assert not b.outbox  # no BITMAP went out for the forged PROBE
        for kind in (Kind.STOP, Kind.BITMAP, Kind.ACK):  # toward the sender
            a.datagram_received(_forge(kind, key=key, src=B, dst=A), B, 0.002)
        assert tx.result is None and rx.result is None  # a forged STOP ended nothing
        if when == "before":
            assert (dest == SENTINEL).all()  # the forged DATA wrote nothing
    counters = b.counters()
    assert counters.get("bad_auth", 0) == 4 and a.counters().get("bad_auth", 0) == 6
    # then the real transfer: every chunk arrives intact, nothing of the forger's
    for t in np.arange(0.01, 2.0, 0.01):
        _deliver(a, feed_b, A, t)
        _deliver(b, a.datagram_received, B, t)
        for m in (a, b):
            d = m.next_deadline()
            if d is not None and d <= t:
                m.timer_fired(t)
        if tx.result is not None and rx.result is not None:
            break
    assert rx.result.complete and np.array_equal(dest, data)
    assert tx.result.status == SendStatus.STOPPED and tx.result.close_reason == CloseReason.COMPLETE


@pytest.mark.parametrize("use_native", PATHS)
def test_a_replayed_round_and_a_closed_messages_datagrams_are_rejected(use_native) -> None:
    nbytes = 30 * CB
    a, b, feed_b = _pair(use_native)
    first, second = source_bytes(nbytes, 1), source_bytes(nbytes, 2)

    def transfer(round_id: int, data: np.ndarray, before=()) -> tuple[np.ndarray, list[bytes]]:
        dest = np.full(nbytes, SENTINEL, np.uint8)
        rx = b.start_receive(A, round_id, 7, 0.0, policy=ReliablePolicy(), out=dest)
        a.start_send(B, round_id, 7, data, 0.0)
        for d in before:  # the replay, ahead of the round's own datagrams
            feed_b(d, A, 0.0005)
        wire_log: list[bytes] = []
        for t in np.arange(0.001, 1.0, 0.001):
            wire_log += _deliver(a, feed_b, A, t)
            _deliver(b, a.datagram_received, B, t)
            if rx.result is not None and not a.open_sends:
                break
        assert rx.result is not None and rx.result.complete
        return dest, wire_log

    dest1, round1 = transfer(1, first)
    assert np.array_equal(dest1, first)
    dropped = b.counters()
    for d in round1:  # replayed after round 1 closed: the closed message's
        feed_b(d, A, 1.5)
    after = b.counters()
    assert after.get("stale", 0) - dropped.get("stale", 0) == len(round1)
    dest2, _ = transfer(2, second, before=round1)  # and during round 2
    assert np.array_equal(dest2, second)  # not one byte of round 1's
    # a round-1 datagram re-addressed to look like round 2: its tag no longer verifies
    forged = bytearray(round1[0])
    forged[wire.OFFSET["round"]] = 2
    before = b.counters().get("bad_auth", 0)
    feed_b(bytes(forged), A, 2.0)
    assert b.counters().get("bad_auth", 0) == before + 1


@pytest.mark.parametrize("use_native", PATHS)
def test_a_datagram_replayed_from_another_peer_is_refused(use_native) -> None:
    """In a parameter server every worker sends the same round and message ids: A's
    datagram, replayed with C's source address, must not count as C's."""
    nbytes = 10 * CB
    a, b, feed_b = _pair(use_native)
    C = ("10.0.0.3", 4003)
    dest = np.full(nbytes, SENTINEL, np.uint8)
    rx = b.start_receive(C, 3, 7, 0.0, policy=ReliablePolicy(), out=dest)
    a.start_send(B, 3, 7, source_bytes(nbytes, 5), 0.0)
    sent = _deliver(a, lambda d, peer, now: feed_b(d, C, now), A, 0.001)
    assert sent and rx.result is None and (dest == SENTINEL).all()
    assert b.counters()["bad_auth"] == len(sent)


def test_an_unauthenticated_core_cannot_talk_to_an_authenticated_one() -> None:
    plain = TransferMux(SESSION, CFG)
    b = TransferMux(SESSION, CFG, auth=DatagramAuth(KEY, B))
    b.start_receive(A, 3, 7, 0.0, policy=ReliablePolicy(), nbytes=10 * CB)
    plain.start_send(B, 3, 7, source_bytes(10 * CB, 1), 0.0)
    sent = _deliver(plain, b.datagram_received, A, 0.0)
    assert b.counters()["bad_auth"] + b.counters().get("short", 0) == len(sent)
    # another job's datagram (another session) is counted as such, not as an attack
    other = TransferMux(SESSION + 1, CFG, auth=DatagramAuth(WRONG, A))
    other.start_send(B, 3, 7, source_bytes(10 * CB, 1), 0.0)
    n = len(_deliver(other, b.datagram_received, A, 0.0))
    assert b.counters()["foreign_session"] == n


# ------------------------------------------------------------------- real UDP
def _flood(target, stop: threading.Event, template: bytes, counter: list) -> None:
    """A forger without the key: the right session and headers, NaN payloads, every
    round id from the message's on, no valid tag."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    body = bytearray(template[:-TRAILER_BYTES])
    nan = np.full((len(body) - HEADER_BYTES) // 4, np.nan, np.float32).tobytes()
    body[HEADER_BYTES : HEADER_BYTES + len(nan)] = nan
    i = 0
    try:
        while not stop.is_set():
            body[wire.OFFSET["index"]] = i % 200
            s.sendto(bytes(body) + bytes(TRAILER_BYTES), target)
            counter[0] += 1
            i += 1
            if i % 64 == 0:
                time.sleep(0.0002)
    finally:
        s.close()


@pytest.mark.parametrize("use_native", PATHS)
def test_udp_endpoints_move_a_message_intact_under_a_forging_flood(use_native) -> None:
    key = job_key(b"udp test", 99)
    cfg = TransportConfig(peer_timeout=10.0, receive_deadline=30.0)
    data = np.random.default_rng(4).integers(0, 255, 4_000_000, dtype=np.uint8)
    with UdpEndpoint(session=99, config=cfg, auth_key=key, native_data_path=use_native) as a, \
            UdpEndpoint(session=99, config=cfg, auth_key=key, native_data_path=use_native) as b:
        assert (a.data_path is not None) == use_native
        h = Header(Kind.DATA, 99, 0, 1, 0, wire.chunk_count(data.nbytes, cfg.chunk_bytes),
                   data.nbytes, cfg.chunk_bytes)
        template = wire.encode(h, bytes(cfg.chunk_bytes)) + bytes(TRAILER_BYTES)
        stop, sent = threading.Event(), [0]
        flood = threading.Thread(target=_flood, args=(b.address, stop, template, sent))
        f = b.receive(a.address, message_id=1, nbytes=data.nbytes)
        flood.start()
        try:
            time.sleep(0.05)
            result = a.send(b.address, data, message_id=1).result(30)
            received = f.result(30)
        finally:
            stop.set()
            flood.join()
        assert result.ok and received.complete and np.array_equal(received.data, data)
        counters = b.counters()
        assert counters["authenticated"] == 1 and sent[0] > 100
        assert counters["bad_auth"] > 50  # (the kernel may drop some of the flood)


def test_an_authenticated_endpoint_leaves_room_for_its_tag_and_binds_one_address() -> None:
    assert largest_chunk(1500) - largest_chunk(1500, TRAILER_BYTES) == TRAILER_BYTES
    with pytest.raises(ValueError, match="binds one address"):
        UdpEndpoint("0.0.0.0", 0, session=1, auth_key=KEY)


_FALLBACK_SCRIPT = """
import logging, sys
import numpy as np
from boundedloss import native
from boundedloss.net.udp import UdpEndpoint
from boundedloss.protocol.auth import job_key
logging.basicConfig(level=logging.WARNING, format="%(message)s")
assert native.__file__.startswith(sys.argv[1]), native.__file__
assert native.enabled() and not native.authenticates()
key = job_key(b"s", 5)
data = np.arange(300_000, dtype=np.uint8)
with UdpEndpoint(session=5, auth_key=key) as a, UdpEndpoint(session=5, auth_key=key) as b:
    assert a.data_path is None and a.data_path_note == native.AUTH_FALLBACK
    f = b.receive(a.address, message_id=1, nbytes=data.nbytes)
    a.send(b.address, data, message_id=1).result(20)
    assert np.array_equal(f.result(20).data, data)
with UdpEndpoint(session=5) as c:  # unauthenticated endpoints keep the compiled path
    assert c.data_path is not None
print("ok")
"""


@pytest.mark.skipif(native.status().startswith("python ("),
                    reason=f"compiled data path: {native.status()}")
def test_built_without_openssl_authenticated_endpoints_take_the_python_path(tmp_path) -> None:
    """The extension built without OpenSSL (as where its headers are missing): an
    authenticated endpoint runs on the Python path, says why once, and works."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for name in ("src", "setup.py", "pyproject.toml", "README.md"):
        src = root / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    for so in (tmp_path / "src" / "boundedloss").glob("_native*.so"):
        so.unlink()
    env = {**os.environ, "BOUNDEDLOSS_NATIVE_OPENSSL": "0"}
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT, str(tmp_path)],
                         env={**env, "PYTHONPATH": str(tmp_path / "src")},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "ok"
    assert run.stderr.count("authenticated datagrams take the Python path") == 1


# ------------------------------------------------------------- a DDP job under attack
def _can_forge() -> str | None:
    """Why this process cannot sniff loopback and forge source addresses, or None."""
    if os.geteuid() != 0:
        return "sniffing loopback and forging source addresses needs root (CAP_NET_RAW)"
    try:
        from forger import Forger
        Forger().stop()
    except (OSError, AttributeError) as e:
        return f"no raw sockets here: {e}"
    return None


@pytest.mark.skipif(_can_forge() is not None, reason=str(_can_forge()))
def test_a_ddp_job_under_a_forging_attacker_keeps_its_accuracy(tmp_path) -> None:
    """`boundedloss train` (digits, 2 ranks over loopback, reliable) three times with the
    same seed: clean; with an attacker on the host that sniffs the job's DATA and sends
    NaN-filled DATA for the same and the next round with the real senders' addresses
    (tests/forger.py); and the same attack with --no-auth. Authenticated, the attacked
    run ends with the clean run's accuracy (within 1 point) and rank 0 counted the
    forgeries as bad_auth; without authentication the same attack wrecks it (which is
    what shows the attacker reaches the job)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from forger import Forger

    base = ["--policy", "reliable", "--workers", "2", "--epochs", "3", "--seed", "0",
            "--deadline", "10"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("BOUNDEDLOSS_SECRET", "BOUNDEDLOSS_SECRET_FILE")}

    def train(name: str, *extra: str, attack: bool) -> tuple[dict, Forger | None]:
        forger = Forger().start() if attack else None
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "boundedloss.cli", "train", *base, *extra,
                 "--out", str(tmp_path / name)], capture_output=True, text=True,
                timeout=300, env=env)
        finally:
            if forger is not None:
                forger.stop()
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(Path(tmp_path / name / "summary.json").read_text()), forger

    clean, _ = train("clean", attack=False)
    attacked, forger = train("attacked", attack=True)
    assert forger is not None and forger.sent > 100
    assert attacked["auth"] == "random"
    assert attacked["datagrams_dropped"].get("bad_auth", 0) > 50
    assert clean["datagrams_dropped"].get("bad_auth", 0) == 0
    assert abs(attacked["final_metric"] - clean["final_metric"]) <= 0.01
    unprotected, forger = train("unprotected", "--no-auth", attack=True)
    assert forger is not None and forger.sent > 0
    assert unprotected["final_metric"] < clean["final_metric"] - 0.2
