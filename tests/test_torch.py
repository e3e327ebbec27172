"""PyTorch integration: the DDP hook against Gloo, and `boundedloss train` end to end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boundedloss import native
from conftest import run_behind_a_narrow_path

HERE = Path(__file__).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("topology", "dtype", "world"), [
    ("ps", "float32", 3), ("allreduce", "float32", 3), ("ps", "float16", 3),
    ("allreduce", "bfloat16", 3), ("two-level", "float32", 4)])
def test_reliable_hook_equals_gloo_allreduce(topology, dtype, world):
    """float32 exactly; float16 and bfloat16 buckets travel in their own dtype (half the
    bytes) and are averaged in float32, within a rounding of Gloo's. (Two levels need a
    world with a divisor: 4 ranks in groups of 2.)"""
    proc = subprocess.run(
        [sys.executable, str(HERE / "dist_equality.py"), str(world), str(_port()), topology,
         dtype],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == world


def test_the_guard_and_the_state_dict_on_a_live_job():
    """A bucket losing more than its bound is guarded by default and shows it in the round
    log; state_dict() applies to a live registered state (tests/hook_state.py)."""
    proc = subprocess.run([sys.executable, str(HERE / "hook_state.py"), str(_port())],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 2
    assert "rank 0, bucket 0: loss " in proc.stderr  # the guard's two warnings
    assert "bounded again" in proc.stderr


def _train(tmp_path, *args, timeout=240):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "boundedloss.cli", "train", "--out", str(out), *args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "COLUMNS": "120"},
    )
    return proc, out


@pytest.mark.parametrize(
    "policy,topology",
    [("gloo", "ps"), ("reliable", "ps"), ("mlt", "allreduce"), ("ltp", "ps"),
     ("dblp", "ps"), ("dblp", "allreduce")],
)
def test_short_training_runs_for_every_policy(tmp_path, policy, topology):
    args = ["--policy", policy, "--topology", topology, "--workers", "2", "--epochs", "2",
            "--steps-per-epoch", "6", "--deadline", "10"]
    if policy != "gloo":
        args += ["--loss", "bernoulli:0.02"]
    proc, out = _train(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 12 and summary["metric_name"] == "accuracy"
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 12
    if policy != "gloo":
        assert all("comm_ms" in r and "delivered_fraction" in r and "closed" in r for r in rounds)
    epochs = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    assert len(epochs) == 2
    if policy == "dblp":
        assert epochs[0]["phase"] in ("critical", "relaxed") and epochs[0]["bound"] is not None


_TCP_PS_RANK = """
import sys, numpy as np, torch, torch.distributed as dist
from boundedloss.torch.tcp_ps import average_through_server
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
xs = [np.random.default_rng(r).standard_normal(100_003).astype(np.float32)
      for r in range(world)]
got = average_through_server(torch.from_numpy(xs[rank].copy())).numpy()
want = xs[0].copy()
for x in xs[1:]:  # the server's order: its own, then rank 1, 2, ...
    want += x
want /= world
assert np.array_equal(got, want), float(np.abs(got - want).max())
dist.destroy_process_group()
"""


def test_the_tcp_parameter_server_averages_exactly():
    """tcp-ps (LTP's incast baseline): every rank ends with the mean, bit for bit as the
    server sums it."""
    port = str(_port())
    procs = [subprocess.Popen([sys.executable, "-c", _TCP_PS_RANK, str(r), "3", port],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs


def test_tcp_ps_trains_as_gloo_does(tmp_path):
    """`train --policy tcp-ps` moves the same mean gradient as DDP's allreduce: the same
    losses (to float rounding: the sums run in another order) and accuracy."""
    runs = {}
    for policy in ("gloo", "tcp-ps"):
        proc, out = _train(tmp_path / policy, "--policy", policy, "--workers", "3",
                           "--epochs", "2", "--steps-per-epoch", "6")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[policy] = (_lines(out / "rounds.jsonl"), _lines(out / "epochs.jsonl"))
    (gloo_rounds, gloo_epochs), (ps_rounds, ps_epochs) = runs["gloo"], runs["tcp-ps"]
    assert [r["loss"] for r in ps_rounds] == pytest.approx([r["loss"] for r in gloo_rounds],
                                                          abs=1e-4)
    assert [e["accuracy"] for e in ps_epochs] == pytest.approx(
        [e["accuracy"] for e in gloo_epochs], abs=0.01)


def _run_training_in_a_process(cfg):
    """``run_training(cfg)`` in a fresh interpreter (its ranks fork from a server there)."""
    from dataclasses import asdict

    code = ("import json, sys\n"
            "from boundedloss.experiments.train import TrainConfig, run_training\n"
            "print(json.dumps(run_training(TrainConfig(**json.loads(sys.argv[1])))))\n")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(asdict(cfg))],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_killed_after_a_checkpoint_resumes_as_if_it_had_never_stopped(tmp_path):
    """DBLP on the digits over Gloo and the hook on UDP loopback, 2 ranks, 6 epochs (the
    LR drops after epochs 2 and 3). One run goes through; another checkpoints every
    epoch (torch.save: model, optimizer, scheduler, the hook's state_dict) and every
    rank is SIGKILLed after epoch 3's. A new run resumed from those files starts where
    the first stood after epoch 3 - same phase, bound and round counters - and goes on
    as it did: each later epoch's phase, bound, LR change (the first epoch end after the
    restart needs the LRs the checkpoint kept) and round counters are the same. Its
    gradient norms and accuracy agree closely, not bit for bit: the first round a process
    runs may miss what a peer sent before its receive was posted, up to the bound (as the
    uninterrupted run's round 0 does)."""
    import torch

    from boundedloss.experiments.train import TrainConfig, checkpoint_path
    from boundedloss.policy import make_policy

    job = dict(policy="dblp", topology="ps", workers=2, epochs=6, steps_per_epoch=4,
               receive_deadline=10.0)
    full = TrainConfig(**job, out=str(tmp_path / "full"), checkpoint_every=1)
    _run_training_in_a_process(full)
    through = _lines(tmp_path / "full" / "epochs.jsonl")

    out = tmp_path / "killed"
    killed = TrainConfig(**job, out=str(out), checkpoint_every=1)
    from dataclasses import asdict

    proc = subprocess.run([sys.executable, str(HERE / "killed_training.py"),
                           json.dumps(asdict(killed)), "3", str(_port())],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [-9, -9], proc.stderr  # SIGKILL

    for rank in (0, 1):  # what the killed run left: plain values torch.load reads as they are
        saved = torch.load(checkpoint_path(out, rank))
        hook = saved["hook"]
        assert (saved["epoch"], saved["round"], hook["rank"], hook["rounds"]) == (3, 16, rank,
                                                                                {0: 16})
        policy = make_policy("dblp")
        policy.load_state_dict(hook["policy"])
        assert (policy.phase.value, policy.bound) == (through[3]["phase"], through[3]["bound"])
        assert through[3]["round_counters"] == {"0": 16}
    assert len(_lines(out / "epochs.jsonl")) == 4

    # (resumed without --topology: on its checkpoint's, not the world's default)
    summary = _run_training_in_a_process(
        TrainConfig(**{**job, "topology": None}, out=str(out), checkpoint_every=1,
                    resume=str(out)))
    assert summary["resumed_from_epoch"] == 3 and summary["rounds"] == 24
    assert summary["config"]["topology"] == "ps"
    resumed = _lines(out / "epochs.jsonl")
    assert [e["epoch"] for e in resumed] == list(range(6))
    assert [e["lr_changed"] for e in through] == [False, False, True, True, False, False]
    for was, now in zip(through, resumed):
        for key in ("phase", "bound", "lr", "lr_changed", "round_counters"):
            assert now[key] == was[key], (key, was, now)
        assert now["grad_norm"] == pytest.approx(was["grad_norm"], rel=0.05)
        # (near chance after 24 steps, a few test images either way: the resumed first
        # round may miss up to the bound, and on a loaded machine it does)
        assert now["accuracy"] == pytest.approx(was["accuracy"], abs=0.03)
    for rank in (0, 1):  # where both ended: the policy's whole history, the counters
        ended = [torch.load(checkpoint_path(d, rank))["hook"] for d in (full.out, out)]
        assert ended[0]["rounds"] == ended[1]["rounds"] == {0: 24}
        assert ended[0]["epoch"] == ended[1]["epoch"] == 6
        histories = [h["policy"]["history"] for h in ended]
        assert len(histories[0]) == len(histories[1]) == 6
        for was, now in zip(*histories):
            assert (now["epoch"], now["phase"], now["bound"], now["reason"]) == (
                was["epoch"], was["phase"], was["bound"], was["reason"])
            assert now["grad_norm"] == pytest.approx(was["grad_norm"], rel=0.05)
    rounds = _lines(out / "rounds.jsonl")
    assert [r["round"] for r in rounds] == list(range(24))
    losses = [r["loss"] for r in rounds]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05  # (it trained on)


def test_train_checks_its_checkpoint_and_guard_options(tmp_path):
    from boundedloss.experiments.train import TrainConfig
    from boundedloss.torch import LossGuard

    for bad, says in ((dict(checkpoint_every=-1), "--checkpoint-every must be >= 0"),
                      (dict(resume=str(tmp_path / "nowhere")), "is not a directory"),
                      (dict(guard_rounds=-2), "--guard-rounds must be >= 0")):
        with pytest.raises(ValueError, match=says):
            TrainConfig(**bad).validate()
    assert TrainConfig().guard() is None  # the hook's default
    assert TrainConfig(guard_rounds=0).guard() == LossGuard(rounds=0)
    TrainConfig(resume=str(tmp_path), checkpoint_every=2).validate()


def test_train_checkpoints_and_resumes_from_the_command_line(tmp_path):
    """`train --checkpoint-every` then `train --resume`: the second run goes on from the
    first one's last checkpoint; the guard is set from the command line too."""
    first = tmp_path / "first"
    proc = subprocess.run(
        [sys.executable, "-m", "boundedloss.cli", "train", "--policy", "dblp", "--workers", "2",
         "--epochs", "2", "--steps-per-epoch", "3", "--checkpoint-every", "1",
         "--guard-rounds", "0", "--out", str(first)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {p.name for p in first.glob("checkpoint.rank*.pt")} == {"checkpoint.rank0.pt",
                                                                  "checkpoint.rank1.pt"}
    rounds = [json.loads(line) for line in (first / "rounds.jsonl").read_text().splitlines()]
    assert not any(r.get("guarded") for r in rounds)
    proc = subprocess.run(
        [sys.executable, "-m", "boundedloss.cli", "train", "--policy", "dblp", "--workers", "2",
         "--epochs", "4", "--steps-per-epoch", "3", "--resume", str(first),
         "--out", str(tmp_path / "second")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["resumed_from_epoch"] == 1 and summary["rounds"] == 12


def test_digits_mlp_learns_under_ten_percent_loss(tmp_path):
    proc, out = _train(tmp_path, "--policy", "mlt", "--topology", "ps", "--workers", "3",
                       "--epochs", "6", "--loss", "bernoulli:0.10", "--aggregator", "unbiased",
                       "--deadline", "10", timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_metric"] >= 0.85, summary


def test_a_dead_worker_fails_the_run_cleanly(tmp_path):
    out = tmp_path / "run"
    code = (
        "import sys; from boundedloss.experiments.train import TrainConfig, run_training\n"
        f"cfg = TrainConfig(policy='reliable', workers=3, epochs=2, steps_per_epoch=10, "
        f"receive_deadline=2.0, out={str(out)!r}, die_at_round=4)\n"
        "try:\n    run_training(cfg)\nexcept RuntimeError as e:\n    print(e); sys.exit(9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    assert "rank 1 (exit 17)" in proc.stdout
    assert "PeerFailure" in proc.stderr  # the survivors say why they stopped


def test_state_pickles_without_runtime_and_keeps_memory():
    import pickle

    import numpy as np

    from boundedloss.aggregate import StaleFill
    from boundedloss.policy import PhaseAwarePolicy
    from boundedloss.torch import BoundedLossState, hook_transport

    policy = PhaseAwarePolicy()
    policy.epoch_end(1.0)
    state = BoundedLossState(policy=policy, aggregator=StaleFill(), topology="allreduce",
                             transport=hook_transport(chunk_bytes=8192))
    state.rounds[0] = 7
    state.memory[(0, "shard")] = np.arange(5, dtype=np.float32)
    state.executor = object()  # runtime parts must not travel
    clone = pickle.loads(pickle.dumps(state))
    assert clone.executor is None and clone.endpoint is None and clone.collective is None
    assert clone.rounds == {0: 7} and clone.topology == "allreduce"
    assert clone.transport == state.transport and clone.transport.chunk_bytes == 8192
    assert np.array_equal(clone.memory[(0, "shard")], np.arange(5, dtype=np.float32))
    assert clone.policy.bound == policy.bound and clone.phase == state.phase


def _a_state_to_checkpoint():
    import numpy as np
    import torch

    from boundedloss.aggregate import StaleFill
    from boundedloss.collective import BFLOAT16
    from boundedloss.policy import PhaseAwarePolicy
    from boundedloss.torch import BoundedLossState

    policy = PhaseAwarePolicy(p_low=0.01)
    for norm in (2.0, 2.05, 2.1):
        policy.epoch_end(norm)
    state = BoundedLossState(policy=policy, aggregator=StaleFill(), topology="allreduce",
                             rank=1, world_size=3)
    # an epoch end with an optimizer: the LRs it saw are kept (and the policy told of an
    # epoch whose gradient norm, with no rounds recorded, is 0: critical from here)
    state.epoch_end(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01))
    state.rounds = {0: 40, 1: 40}
    state.memory = {(0, "shard"): np.arange(5, dtype=np.float32),
                    (0, "gather0"): np.arange(3, dtype=np.float16),
                    (1, "shard"): np.array([0x3F80, 0xC000], dtype=np.uint16).view(BFLOAT16)}
    state.guards = {1: {"above": 0, "guarded": True}}
    state.paths = {0: {"srtt": 2e-4, "rttvar": 1e-4, "rates": [3e8]},
                   2: {"srtt": None, "rttvar": None, "rates": []}}
    return state


def _saved_and_loaded(state_dict):
    import io

    import torch

    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only (torch's default): plain values only


def test_a_state_dict_goes_through_torch_save_and_restores_everything():
    """state_dict() is what torch.load's default (weights_only) loader reads back; loaded
    into a fresh state of the same job it restores the policy (phase, bound, history),
    counters, LR memory, the collective's memory in its dtypes (bfloat16 words too),
    the guard's state and the paths by peer rank."""
    import numpy as np
    import torch

    from boundedloss.aggregate import StaleFill
    from boundedloss.collective.base import is_bfloat16
    from boundedloss.policy import make_policy
    from boundedloss.torch import STATE_DICT_FORMAT, BoundedLossState

    state = _a_state_to_checkpoint()
    saved = _saved_and_loaded(state.state_dict())
    assert saved["format"] == STATE_DICT_FORMAT
    assert saved["memory"][1]["shard"].dtype == torch.bfloat16
    assert saved["memory"][1]["shard"].tolist() == [1.0, -2.0]
    fresh = BoundedLossState(policy=make_policy("dblp"), aggregator=StaleFill(),
                             topology="allreduce")
    fresh.load_state_dict(saved)
    assert (fresh.phase, fresh.bound) == (state.phase, state.bound) == ("critical", 0.01)
    assert fresh.policy.history == state.policy.history and len(fresh.policy.history) == 4
    assert (fresh.rounds, fresh.epoch) == ({0: 40, 1: 40}, 1)
    assert fresh.state_dict()["last_lrs"] == [0.01]
    assert (fresh.rank, fresh.world_size) == (1, 3)  # (register checks them)
    assert fresh.memory.keys() == state.memory.keys()
    for key, values in state.memory.items():
        assert fresh.memory[key].dtype == values.dtype and np.array_equal(fresh.memory[key],
                                                                          values)
    assert is_bfloat16(fresh.memory[(1, "shard")].dtype)
    assert fresh.guards == state.guards and fresh.paths == state.paths
    assert fresh.state_dict().keys() == saved.keys()


@pytest.mark.parametrize(("change", "says"), [
    (lambda sd: sd.update(topology="ps"), "topology 'ps' cannot be loaded into one on 'allreduce'"),
    (lambda sd: sd.update(rank=0), "state_dict of rank 0 cannot be loaded into rank 1"),
    (lambda sd: sd.update(world_size=4), "world of 4 ranks cannot be loaded into a world of 3"),
    (lambda sd: sd.update(hadamard=True), "hadamard=True"),
    (lambda sd: sd.update(policy={"policy": "mlt", "p": 0.01}), "policy 'mlt' cannot be loaded"),
    (lambda sd: sd["policy"]["detector"].update(phase="calm"), "dblp state_dict: 'calm'"),
    (lambda sd: sd.update(format="powersgd/1"), "not a boundedloss hook state_dict"),
    (lambda sd: sd.pop("paths"), "hook state_dict: missing paths"),
    (lambda sd: sd.update(sockets=[]), "hook state_dict: unknown sockets"),
    (lambda sd: sd["rounds"].update({0: -1}), "round must be an integer >= 0"),
    (lambda sd: sd["memory"][0].update(shard=[1.0]), "memory values must be float tensors"),
    (lambda sd: sd["paths"].update({1: sd["paths"][0]}), "a path to rank 1 from rank 1"),
    (lambda sd: sd["paths"][0].update(srtt=-1.0), "srtt must be finite and >= 0"),
    (lambda sd: sd["guard"][1].update(guarded="yes"), "guard of bucket 1"),
])
def test_a_state_dict_that_does_not_fit_is_one_line_and_changes_nothing(change, says):
    """Another job's state_dict (policy, topology, world, rank) or a value refused: one
    ValueError line, and the state keeps what it had (no partial load)."""
    import re

    state = _a_state_to_checkpoint()
    before = state.state_dict()
    bad = _saved_and_loaded(state.state_dict())
    change(bad)
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        state.load_state_dict(bad)
    assert "\n" not in str(refused.value)
    after = state.state_dict()
    memory = after.pop("memory")
    assert {k: v for k, v in before.items() if k != "memory"} == after
    assert all(memory[b][r].equal(t) for b, roles in before["memory"].items()
               for r, t in roles.items())


def test_the_guard_is_on_by_default_for_bounded_policies_only():
    from boundedloss.policy import make_policy
    from boundedloss.torch import LossGuard, default_guard

    for name in ("mlt", "ltp", "dblp"):
        assert default_guard(make_policy(name)) == LossGuard() and LossGuard().rounds == 3
    assert not default_guard(make_policy("reliable")).enabled


def test_the_hook_runs_on_one_transport_config():
    """The hook's transport is TransportConfig's defaults (its chunk size too) with the
    hook's own two, unless given; the state holds it; register() refuses the old
    keywords with a message that names transport=."""
    import dataclasses

    from boundedloss.aggregate import ZeroFill
    from boundedloss.policy import ReliablePolicy
    from boundedloss.protocol import TransportConfig
    from boundedloss.torch import HOOK_MAX_OPEN_RECEIVES, BoundedLossState, hook_transport, register

    plain = TransportConfig()
    hook = hook_transport()
    assert hook.chunk_bytes == plain.chunk_bytes == 1400
    assert (hook.peer_timeout, hook.max_open_receives) == (plain.receive_deadline,
                                                             HOOK_MAX_OPEN_RECEIVES)
    assert dataclasses.replace(hook, peer_timeout=plain.peer_timeout,
                               max_open_receives=plain.max_open_receives) == plain
    short = hook_transport(receive_deadline=5.0, chunk_bytes=8192)
    assert (short.peer_timeout, short.chunk_bytes) == (5.0, 8192)  # follows the deadline
    assert hook_transport(receive_deadline=5.0, peer_timeout=1.0).peer_timeout == 1.0
    assert BoundedLossState(policy=ReliablePolicy(), aggregator=ZeroFill()).transport == hook
    with pytest.raises(TypeError, match=r"chunk_bytes in transport="):
        register(None, "reliable", chunk_bytes=8192)
    with pytest.raises(TypeError, match="configure the object"):
        register(None, ReliablePolicy(), p=0.1)
    with pytest.raises(ValueError, match="ps, allreduce"):
        register(None, "reliable", topology="ring")


def test_digits_are_scikit_learns_load_digits_without_importing_it(monkeypatch):
    """The bundled CSV read directly is exactly ``load_digits()`` (images, labels); and
    should the file move, the loader falls back to ``load_digits`` itself."""
    import numpy as np
    from sklearn.datasets import load_digits

    from boundedloss.workloads import digits

    ref = load_digits()
    images, target = digits.bundled_digits()
    np.testing.assert_array_equal(images, ref.images)
    np.testing.assert_array_equal(target, ref.target)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    images, target = digits.bundled_digits()
    np.testing.assert_array_equal(images, ref.images)
    np.testing.assert_array_equal(target, ref.target)


def test_local_ranks_see_the_launching_processs_environment_now(tmp_path):
    """Ranks fork from a server that imported torch once; they must still run with the
    launching process's environment at each launch, not the server's at its start:
    a second run of one process with BOUNDEDLOSS_UDP_GSO=0 runs without offload, and
    with BOUNDEDLOSS_NATIVE=0 on the Python data path - as its summary.json says."""
    code = (
        "import json, os, sys\n"
        "from boundedloss.experiments.train import TrainConfig, run_training\n"
        "def run(name):\n"
        f"    cfg = TrainConfig(policy='reliable', workers=2, epochs=1, steps_per_epoch=3, "
        f"out=os.path.join({str(tmp_path)!r}, name))\n"
        "    s = run_training(cfg)\n"
        "    return s['udp_segmentation_offload'], s['data_path']\n"
        "first = run('a')\n"
        "os.environ['BOUNDEDLOSS_UDP_GSO'] = '0'\n"
        "os.environ['BOUNDEDLOSS_NATIVE'] = '0'\n"
        "print(json.dumps([first, run('b')]))\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("BOUNDEDLOSS_UDP_GSO", "BOUNDEDLOSS_NATIVE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (offload1, path1), (offload2, path2) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert offload1 in (True, False) and offload2 is False
    assert path1 == ("native" if native.enabled() else f"python ({native.status()})")
    assert path2.startswith("python (")


def test_a_rank_still_running_after_the_others_ended_is_stopped_and_reported():
    """A rank that never exits (a hang in teardown, say) must not hang the run once
    another rank has ended: it is stopped after the grace period and named."""
    import multiprocessing as mp
    import time

    from boundedloss.experiments.train import failure_report, supervise

    ctx = mp.get_context("spawn")
    # (30 s, not forever: a supervisor that waits for it fails this test, not the suite)
    ranks = [ctx.Process(target=time.sleep, args=(0,)), ctx.Process(target=time.sleep, args=(30,))]
    for p in ranks:
        p.start()
    t0 = time.monotonic()
    run = supervise(ranks, grace=1.0)
    assert time.monotonic() - t0 < 20
    assert run.stopped == {1} and ranks[0].exitcode == 0 and not ranks[1].is_alive()
    assert failure_report(ranks, run, 1.0) == (
        "rank 1 (stopped: still running 1 s after another ended)")


def test_the_report_names_the_rank_that_failed_first(tmp_path):
    """When one rank dies the others fail after it (PeerFailure): the run's last line
    names the one that ended first, then the rest."""
    import multiprocessing as mp

    from boundedloss.experiments.train import failure_report, supervise

    ctx = mp.get_context("spawn")
    # the others end only once the supervisor has reaped the first (its pid is gone), so
    # the order is fixed however slowly the interpreters start (timed sleeps raced that)
    dead = tmp_path / "dying"
    later = [sys.executable, "-c",
             "import os, sys, time\n"
             f"while not os.path.exists({str(dead)!r}): time.sleep(0.01)\n"
             f"pid = int(open({str(dead)!r}).read())\n"
             "while True:\n"
             "    try: os.kill(pid, 0)\n"
             "    except ProcessLookupError: sys.exit(1)\n"
             "    time.sleep(0.01)"]
    dies = [sys.executable, "-c",
            f"import os, signal; open({str(dead)!r} + '.tmp', 'w').write(str(os.getpid())); "
            f"os.rename({str(dead)!r} + '.tmp', {str(dead)!r}); "
            "os.kill(os.getpid(), signal.SIGKILL)"]
    ranks = [ctx.Process(target=os.execv, args=(sys.executable, argv))
             for argv in (later, dies, later)]
    for p in ranks:
        p.start()
    run = supervise(ranks, grace=10.0)
    assert run.ended[0] == 1 and not run.stopped
    head, rest = failure_report(ranks, run, 10.0).split("; then ")
    assert head == "rank 1 (killed by SIGKILL) ended first"
    assert sorted(rest.split(", ")) == ["rank 0 (exit 1)", "rank 2 (exit 1)"]  # any order


def test_a_failed_ranks_last_line_is_its_exception(tmp_path):
    """A testbed run's error quotes the first failed rank's last line of output: a
    traceback's exception, past the blank lines after it."""
    from boundedloss.experiments.train import last_line

    log = tmp_path / "rank1.log"
    log.write_text("[W socket.cpp] a warning\nTraceback (most recent call last):\n"
                   "  File \"x\", line 1\nRuntimeError: Connection closed by peer\n\n  \n")
    assert last_line(log) == "RuntimeError: Connection closed by peer"
    (tmp_path / "empty.log").write_text("\n")
    assert last_line(tmp_path / "empty.log") == last_line(tmp_path / "absent.log") == ""


class _EndingRank:
    """A rank for supervise() that ends ``after`` seconds from now: its sentinel becomes
    readable then; with ``lag``, the first poll after that still finds it running - as a
    dying process's sentinel (its closed files) is ready a moment before it is a zombie."""

    def __init__(self, after: float, lag: bool = False):
        import threading

        self.sentinel, self._w = os.pipe()
        self._end, self._lag, self._code = time.monotonic() + after, lag, None
        threading.Timer(after, os.close, args=(self._w,)).start()

    @property
    def exitcode(self):
        if self._code is None and time.monotonic() >= self._end:
            if self._lag:
                self._lag = False
            else:
                self._code = 1
        return self._code

    def terminate(self):
        pass

    def join(self):
        os.close(self.sentinel)


def test_a_rank_seen_dying_a_moment_early_is_still_named_first():
    """The race CI met: rank 1's sentinel is ready a poll before its exit code, and rank
    0 ends 0.3 s later; rank 1 must still be recorded first."""
    from boundedloss.experiments.train import supervise

    ranks = [_EndingRank(0.3), _EndingRank(0.05, lag=True), _EndingRank(0.3)]
    assert supervise(ranks, grace=10.0).ended[0] == 1


def test_train_runs_as_one_rank_per_process_under_torchrun(tmp_path):
    """`boundedloss train` started once per rank with torchrun's environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT): each process runs its rank and exits 0, rank 0
    reports and writes the logs; a bad argument is still one line, exit 2."""
    out = tmp_path / "run"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port()), "COLUMNS": "120"}
    cmd = [sys.executable, "-m", "boundedloss.cli", "train", "--policy", "dblp", "--workers", "2",
           "--epochs", "1", "--steps-per-epoch", "4", "--loss", "bernoulli:0.05", "--out", str(out)]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "final accuracy" in outputs[0] and "final accuracy" not in outputs[1]
    rounds = (out / "rounds.jsonl").read_text().splitlines()
    assert len(rounds) == 4 and json.loads((out / "summary.json").read_text())["world_size"] == 2
    bad = subprocess.run(cmd[:-2] + ["--epochs", "0"], env={**env, "RANK": "0"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_probe_copies_reach_the_transport(tmp_path):
    """`--probe-copies-max 1` (a what-if: recovery by timeouts) is what the endpoints
    run with, and summary.json says so; without it, the transport's default."""
    from boundedloss.protocol import TransportConfig

    for flag, want in ((["--probe-copies-max", "1"], 1), ([], TransportConfig().probe_copies_max)):
        proc, out = _train(tmp_path / str(want), "--policy", "dblp", "--workers", "2",
                           "--epochs", "1", "--steps-per-epoch", "3", *flag)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert json.loads((out / "summary.json").read_text())["probe_copies_max"] == want


_CHUNK_SCRIPT = (
    "import socket, threading\n"
    "from torch.distributed import TCPStore\n"
    "from boundedloss.torch.rendezvous import agree_chunk_bytes\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
    "master = TCPStore('127.0.0.1', port, 2, True, wait_for_workers=False)\n"
    "got = [None, None]\n"
    "def rank(r):  # a store client each, as ranks have\n"
    "    store = TCPStore('127.0.0.1', port, 2, False)\n"
    "    got[r] = agree_chunk_bytes(store, 'job', r, 2, '127.0.0.1')\n"
    "threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]\n"
    "[t.start() for t in threads]; [t.join() for t in threads]\n"
    "print(got[0], got[1])\n"
)


def test_a_job_that_sets_no_chunk_size_takes_the_largest_one_packet_carries():
    """register() without a transport agrees on chunks that fit one packet of the path
    MTU between the ranks: 1,424 B on a 1,500-byte path (a network namespace of its
    own), a jumbo frame's 8,924 B on loopback's 65,536."""
    from boundedloss.torch.rendezvous import AUTO_CHUNK_MAX

    plain = subprocess.run([sys.executable, "-c", _CHUNK_SCRIPT], capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == [str(AUTO_CHUNK_MAX)] * 2 == ["8924", "8924"]
    narrow = run_behind_a_narrow_path(_CHUNK_SCRIPT, mtu=1500)
    assert narrow.stdout.split() == ["1424", "1424"]


def test_bfloat16_words_round_as_torch_rounds():
    """The collective widens bfloat16 words to float32 and narrows its float32 mean back
    with the rounding torch uses (to nearest, ties to even), NaN kept."""
    import numpy as np
    import torch

    from boundedloss.collective import BFLOAT16, narrow, widen

    rng = np.random.default_rng(4)
    values = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 100,
                             np.array([0.0, -0.0, 1e-40, 3.0e38, np.inf, -np.inf, np.nan],
                                      dtype=np.float32)])
    ours = narrow(values, BFLOAT16)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
    assert ours.dtype == BFLOAT16
    same = ours.view(np.int16) == theirs
    assert same[:-1].all() and np.isnan(widen(ours)[-1])
    back = torch.from_numpy(theirs).view(torch.bfloat16).float().numpy()
    assert np.array_equal(widen(ours)[:-1], back[:-1])
    with np.errstate(over="ignore"):  # (3e38 is beyond float16: inf, as numpy rounds)
        half = narrow(values, np.dtype(np.float16))
    assert half.dtype == np.float16
    assert np.array_equal(widen(half), half.astype(np.float32), equal_nan=True)
