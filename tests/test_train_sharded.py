"""`train --sharded`: FSDP2 (fully_shard) instead of DDP - gloo's own collectives and
ours through register(), bf16 as FSDP2's mixed precision, what it refuses, and which
submodules become FSDP units."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from boundedloss.cli import main
from boundedloss.experiments.train import _per_round

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard") or not hasattr(fsdp.FSDPModule, "set_custom_all_gather"):
    pytest.skip("this torch's FSDP2 takes no custom collectives (set_custom_all_gather)",
                allow_module_level=True)

STEPS = 30


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run once (by its arguments): its summary and rank 0's rounds.jsonl."""
    done: dict[tuple[str, ...], tuple[dict, list[dict]]] = {}
    base = tmp_path_factory.mktemp("sharded")

    def run(*args: str) -> tuple[dict, list[dict]]:
        if args not in done:
            out = base / ("-".join(args).replace("--", "") or "default")
            proc = subprocess.run(
                [sys.executable, "-m", "boundedloss.cli", "train", "--workers", "2",
                 "--epochs", "1", "--steps-per-epoch", str(STEPS), "--lr", "0.1",
                 "--out", str(out), *args],
                capture_output=True, text=True, timeout=120,
                env={**os.environ, "COLUMNS": "120"})
            assert proc.returncode == 0, proc.stdout + proc.stderr
            if "--sharded" in args:
                assert "FSDP2" in proc.stdout  # (the report line says so)
            rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
            done[args] = json.loads((out / "summary.json").read_text()), rounds
        return done[args]

    return run


def test_sharded_gloo_trains_as_ddp_and_says_sharded(runs):
    """FSDP2 over gloo's collectives: the same model, seed and batches as DDP's run give
    the same test accuracy (both reduce exactly); the summary says sharded."""
    ddp, _ = runs("--policy", "gloo")
    sharded, rounds = runs("--policy", "gloo", "--sharded")
    assert (ddp["sharded"], sharded["sharded"]) == (False, True)
    assert ddp["config"]["topology"] == "gloo"  # (gloo's own ring, not a topology of ours)
    assert sharded["config"]["topology"] == "fsdp"
    assert sharded["rounds"] == STEPS == len(rounds)
    assert sharded["final_metric"] > 0.5, sharded["final_metric"]  # (10 classes: 0.1)
    assert abs(sharded["final_metric"] - ddp["final_metric"]) < 1e-3, (sharded, ddp)
    assert sharded["parameters"] == ddp["parameters"]  # (the whole model's, not a shard's)
    assert sharded["datagrams_received"] is None and "comm_ms" not in rounds[0]


def test_sharded_dblp_runs_our_reduce_scatter_and_all_gather(runs):
    """Ours through register() on the FSDP2 model: rank 0's endpoint took datagrams in,
    every step's round has its reduce-scatters' figures, the all-gather is stale under
    the bound by default, and lossless it learns as gloo's FSDP2 does."""
    gloo, _ = runs("--policy", "gloo", "--sharded")
    ours, rounds = runs("--policy", "dblp", "--sharded")
    assert ours["sharded"] and ours["config"]["stale_broadcast"] is True
    assert ours["datagrams_received"] > 0 and ours["data_path"] is not None
    assert len(rounds) == STEPS
    for r in rounds:
        assert r["comm_ms"] > 0 and r["delivered_fraction"] >= 1 - r["bound"], r
    assert abs(ours["final_metric"] - gloo["final_metric"]) < 0.02, (ours, gloo)


def test_sharded_bf16_is_fsdp2s_mixed_precision_over_float32_parameters(runs):
    """bf16 under --sharded: float32 master parameters, gradients and gathered parameters
    crossing as bfloat16 - about half the datagrams of the float32 run's."""
    fp32, _ = runs("--policy", "dblp", "--sharded")
    bf16, rounds = runs("--policy", "dblp", "--sharded", "--precision", "bf16")
    assert (bf16["param_dtype"], bf16["grad_dtype"]) == ("float32", "bfloat16")
    assert (fp32["param_dtype"], fp32["grad_dtype"]) == ("float32", "float32")
    assert len(rounds) == STEPS and math.isfinite(bf16["final_metric"])
    assert bf16["final_metric"] > 0.5, bf16["final_metric"]

    def accepted(s: dict) -> int:
        return s["datagrams_received"] - sum(s["datagrams_dropped"].values())

    assert accepted(bf16) < 0.65 * accepted(fp32), (accepted(bf16), accepted(fp32))


@pytest.mark.parametrize("argv, hint", [
    (["--topology", "ps"], "--topology does not apply with --sharded"),
    (["--hadamard"], "--hadamard does not apply with --sharded"),
    (["--checkpoint-every", "1"], "--checkpoint-every does not apply with --sharded"),
    (["--policy", "tcp-ps"], "--policy tcp-ps is a DDP comm hook: not with --sharded"),
])
def test_sharded_refuses_what_does_not_apply_in_one_line(tmp_path, capsys, argv, hint):
    out = tmp_path / "run"
    rc = main(["train", "--sharded", *argv, "--workers", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and hint in err, err
    assert not (out / "summary.json").exists()


def test_sharded_refuses_resume_in_one_line(tmp_path, capsys):
    rc = main(["train", "--sharded", "--resume", str(tmp_path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--resume does not apply" in err, err


def test_the_units_are_the_layers_with_parameters_of_their_own():
    import torch

    from boundedloss.experiments.sharding import shard_units
    from boundedloss.workloads.charlm import CharLM
    from boundedloss.workloads.images import ImageCNN, ImageMLP

    def kinds(model: torch.nn.Module) -> list[str]:
        return [type(m).__name__ for m in shard_units(model)]

    assert kinds(ImageMLP(8, hidden=256)) == ["Linear", "Linear", "Linear"]
    # (the first convolution's 160 parameters and BatchNorm's few stay with the root)
    assert kinds(ImageCNN(8, 16)) == ["Conv2d", "Linear", "Linear"]
    assert kinds(CharLM()) == ["Embedding", "GRU", "Linear"]


def test_a_sharded_steps_round_is_its_reduce_scatters():
    """The round log of an FSDP2 job: a step's figures are its gradients' reduce-scatters
    (round r of each module); the all-gathers count their own calls and are left out."""
    def entry(kind: str, round_id: int, latency: float, delivered: float) -> dict:
        return {"collective": kind, "round": round_id, "latency_ms": latency,
                "min_delivered_fraction": delivered, "retransmit_rounds": 0, "bound": 0.1,
                "phase": "critical", "close_reasons": ["complete"]}

    log = [entry("all_gather", 0, 50.0, 0.5), entry("reduce_scatter", 0, 3.0, 1.0),
           entry("all_gather", 1, 60.0, 0.5), entry("all_gather", 2, 70.0, 0.5),
           entry("reduce_scatter", 1, 4.0, 0.95), entry("reduce_scatter", 1, 5.0, 1.0),
           entry("all_gather", 3, 80.0, 0.5)]
    step = _per_round(log, 1)
    assert (step["comm_ms"], step["delivered_fraction"]) == (5.0, 0.95), step
    assert _per_round(log, 0)["comm_ms"] == 3.0
    assert _per_round(log, 2) == {}
