"""Lightning in one line: ``BoundedLossCallback(policy="dblp")`` on a real Lightning DDP
job of 2 CPU ranks (Gloo) training the digits MLP (tests/lightning_ranks.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from boundedloss.workloads.digits import load_digits_split
from conftest import same_state_dict

HERE = Path(__file__).parent
EPOCHS, RANKS, BATCH = 8, 2, 32  # (the script's batch size)

needs_lightning = pytest.mark.skipif(
    find_spec("lightning") is None,
    reason="Lightning is not installed (pip install -c constraints.txt -e '.[test]')")


@needs_lightning
def test_a_lightning_ddp_job_runs_the_hook_ends_epochs_and_checkpoints_it(tmp_path):
    """DBLP with 2% of every rank's datagrams lost in-process: the hook carries every
    round, the epoch-end step runs once per epoch after the LR schedulers (the epoch
    after an LR change is critical), accuracy stays within 1 point of the same script's
    plain DDP, and a resume from Lightning's checkpoint restores every rank's hook state
    exactly and takes the same decision the uninterrupted run took."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "lightning_ranks.py"), str(tmp_path), str(EPOCHS),
         str(RANKS)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads((tmp_path / f"dblp.rank{r}.json").read_text()) for r in range(RANKS)]
    plain = json.loads((tmp_path / "plain.json").read_text())["accuracy"]

    train = len(load_digits_split(seed=0).y_train)
    steps = math.ceil(math.ceil(train / RANKS) / BATCH)  # (DistributedSampler pads)
    for run in runs:
        # our hook carried every step's only bucket, and logged each round
        assert run["rounds"] == {"0": EPOCHS * steps} and run["logged_rounds"] == EPOCHS * steps
        assert run["world_size"] == RANKS
        # the epoch-end step: once per epoch, the same decisions on every rank
        assert run["epoch"] == EPOCHS and run["history"] == runs[0]["history"]
        assert run["accuracy"] == runs[0]["accuracy"]  # (DDP replicas stay equal)
    # the plateau scheduler cut the LR after epoch 3 (and only there), after
    # on_train_epoch_end: DBLP saw it at that boundary, not one epoch late
    lrs = runs[0]["lrs"]
    assert [i for i in range(EPOCHS - 1) if lrs[i + 1] != lrs[i]] == [3], lrs
    reasons = [h["reason"] for h in runs[0]["history"]]
    assert [i for i, r in enumerate(reasons) if r == "lr_change"] == [3], reasons
    assert runs[0]["partial_rounds"] > 0  # the loss was real, and DBLP let some of it be
    assert abs(runs[0]["accuracy"] - plain) <= 0.01, (runs[0]["accuracy"], plain)

    # Lightning's checkpoint (rank 0 writes it) holds every rank's hook state, taken at
    # the last epoch's end - before that epoch's epoch-end step (the scheduler's is later)
    ckpt = torch.load(tmp_path / "ckpt" / f"epoch={EPOCHS - 1}.ckpt")  # (weights_only)
    held = ckpt["callbacks"]["BoundedLossCallback"]
    assert held["format"] == "boundedloss.every_rank/1" and sorted(held["ranks"]) == [0, 1]
    for r in range(RANKS):
        saved = held["ranks"][r]
        assert saved["rank"] == r and saved["epoch"] == EPOCHS - 1
        assert saved["rounds"] == {0: EPOCHS * steps} and len(saved["round_sq"]) == steps
        restored = torch.load(tmp_path / f"restored.rank{r}.pt")
        assert same_state_dict(restored, saved), r  # each rank got its own back, whole
        resumed = json.loads((tmp_path / f"resumed.rank{r}.json").read_text())
        # the resumed job ended the pending epoch as the uninterrupted one had, and went on
        assert resumed["history"][:EPOCHS] == runs[r]["history"]
        assert resumed["epoch"] == EPOCHS + 1
        assert resumed["rounds"] == {"0": (EPOCHS + 1) * steps}


@needs_lightning
def test_the_callback_refuses_a_trainer_without_ddp_in_one_line():
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from boundedloss.torch import BoundedLossCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[BoundedLossCallback()])
    with pytest.raises(TypeError, match=r'needs a DDP strategy \(Trainer\(strategy="ddp"\).* '
                                        r"runs SingleDeviceStrategy"):
        trainer.fit(Tiny(), data)


def test_boundedloss_torch_imports_without_lightning_and_says_what_to_install():
    code = (
        "import sys\n"
        "sys.modules['lightning'] = sys.modules['pytorch_lightning'] = None  # not installed\n"
        "import boundedloss.torch as bt\n"
        "from boundedloss.torch import *\n"
        "assert callable(bt.register)\n"
        "try:\n"
        "    bt.BoundedLossCallback\n"
        "except ImportError as e:\n"
        "    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("boundedloss.torch.BoundedLossCallback needs Lightning: "
                                   "pip install lightning")
