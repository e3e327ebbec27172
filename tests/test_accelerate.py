"""Accelerate in one line: ``register(model, policy="dblp")`` on what
``accelerator.prepare`` returned, on a real job of 3 CPU ranks (Gloo, launched by
torchrun) training the digits MLP (tests/accelerate_ranks.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from conftest import same_state_dict

HERE = Path(__file__).parent
EPOCHS, RANKS = 12, 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    find_spec("accelerate") is None,
    reason="Accelerate is not installed (pip install -c constraints.txt -e '.[test]')")
def test_an_accelerate_job_runs_the_hook_ends_epochs_and_checkpoints_it(tmp_path):
    """DBLP with 2% of every rank's datagrams lost in-process: the hook carries every
    step, ``state.epoch_end`` after the scheduler marks the epoch after each LR change
    critical, accuracy stays within 1 point of the same script's plain DDP, and
    ``accelerator.save_state`` / ``load_state`` carry every rank's hook state whole."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
         "--master-addr", "127.0.0.1", "--master-port", str(_port()),
         str(HERE / "accelerate_ranks.py"), str(tmp_path), str(EPOCHS)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads((tmp_path / f"dblp.rank{r}.json").read_text()) for r in range(RANKS)]
    plain = json.loads((tmp_path / "plain.json").read_text())["accuracy"]
    for run in runs:
        # our hook carried every step's only bucket, and logged each round
        assert run["steps"] > 0 and run["steps"] == runs[0]["steps"]
        assert run["rounds"] == {"0": run["steps"]} and run["logged_rounds"] == run["steps"]
        assert run["world_size"] == RANKS
        assert run["epoch"] == EPOCHS and run["history"] == runs[0]["history"]
        assert run["accuracy"] == runs[0]["accuracy"]  # (DDP replicas stay equal)
    reasons = [h["reason"] for h in runs[0]["history"]]
    half = EPOCHS // 2  # StepLR's step: the LR changes at the ends of epochs half-1, 2*half-1
    assert [i for i, r in enumerate(reasons) if r == "lr_change"] == [half - 1, 2 * half - 1]
    assert runs[0]["partial_rounds"] > 0  # the loss was real, and DBLP let some of it be
    assert abs(runs[0]["accuracy"] - plain) <= 0.01, (runs[0]["accuracy"], plain)

    held = torch.load(tmp_path / "state" / "custom_checkpoint_0.pkl")  # (weights_only)
    assert held["format"] == "boundedloss.every_rank/1"
    assert sorted(held["ranks"]) == list(range(RANKS))
    for r in range(RANKS):
        saved = torch.load(tmp_path / f"saved.rank{r}.pt")
        assert saved["rank"] == r and saved["epoch"] == EPOCHS
        assert same_state_dict(held["ranks"][r], saved)
        assert same_state_dict(torch.load(tmp_path / f"loaded.rank{r}.pt"), saved), r
