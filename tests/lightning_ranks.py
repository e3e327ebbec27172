"""Run by test_lightning.py: a Lightning DDP job on CPU ranks (Lightning's own "ddp"
launcher starts rank 1.. by running this script again) training the digits MLP.

argv: OUT (a folder), EPOCHS, RANKS[, SEED (default 0)]. The same script trains three
times, each from the same seed:
  1. plain DDP (no callback): rank 0 writes OUT/plain.json (test accuracy);
  2. DBLP through BoundedLossCallback, with 2% of the datagrams each rank receives lost
     in-process and a checkpoint at every epoch's end: each rank writes
     OUT/dblp.rank{R}.json (accuracy, the hook's counters, DBLP's decisions);
  3. resumed from that last checkpoint for one more epoch by a new trainer with the
     same callback (torn down after run 2: what it loads must reach its next hook): each
     rank writes OUT/restored.rank{R}.pt, the hook state it held once Lightning restored
     it (before training), and OUT/resumed.rank{R}.json, its counters at the end.
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from boundedloss.net.loss import Bernoulli
from boundedloss.torch import BoundedLossCallback
from boundedloss.workloads.digits import load_digits_split
from boundedloss.workloads.images import ImageMLP, accuracy
from hook_record import hook_record

DATA = load_digits_split(seed=0)


class Digits(pl.LightningModule):
    def __init__(self, epochs: int) -> None:
        super().__init__()
        self.epochs = epochs
        self.net = ImageMLP(DATA.side, hidden=256)
        self.lrs: list[float] = []  # the LR each epoch trained with

    def training_step(self, batch, batch_idx):
        # what the plateau scheduler watches: rising every epoch but at the end of epoch
        # epochs/2 - 1, so that it cuts the LR there and only there
        cut = self.current_epoch == self.epochs // 2 - 1
        self.log("signal", -1.0 if cut else float(self.current_epoch), on_step=False,
                 on_epoch=True)
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_train_epoch_start(self):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        # Lightning steps a plateau scheduler after on_train_epoch_end (the others before
        # it): DBLP must still mark the epoch after its LR change critical
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.2,
                                                             patience=0, threshold=0.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "signal"}}

    def train_dataloader(self):
        return DataLoader(TensorDataset(DATA.x_train, DATA.y_train), batch_size=32,
                          shuffle=True)


class Snapshot(pl.Callback):
    """Records the bounded-loss hook state once Lightning restored everything (the
    trainer's state included), before the first training batch."""

    def __init__(self, bounded: BoundedLossCallback) -> None:
        self.bounded = bounded
        self.restored: dict | None = None

    def on_train_start(self, trainer, pl_module):
        self.restored = self.bounded.state.state_dict()


def trainer(epochs, ranks, out, callbacks, checkpoints=False):
    return pl.Trainer(
        accelerator="cpu", devices=ranks, strategy="ddp", max_epochs=epochs,
        callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=checkpoints,
        default_root_dir=out, num_sanity_val_steps=0)


def summary(bounded: BoundedLossCallback, module: Digits) -> dict:
    state = bounded.state
    return {"accuracy": accuracy(module.net, DATA.x_test, DATA.y_test),
            **hook_record(state), "lrs": module.lrs}


def main(out: Path, epochs: int, ranks: int, seed: int) -> None:
    torch.set_num_threads(1)  # (ranks share the machine's cores)

    pl.seed_everything(seed, verbose=False)
    plain = Digits(epochs)
    fit = trainer(epochs, ranks, out, [])
    fit.fit(plain)
    if fit.global_rank == 0:
        (out / "plain.json").write_text(json.dumps(
            {"accuracy": accuracy(plain.net, DATA.x_test, DATA.y_test)}))

    pl.seed_everything(seed, verbose=False)
    model = Digits(epochs)
    rank = fit.global_rank
    bounded = BoundedLossCallback(policy="dblp", loss=Bernoulli(0.02, seed=rank))
    every_epoch = ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1, every_n_epochs=1,
                                  filename="{epoch}")
    fit = trainer(epochs, ranks, out, [bounded, every_epoch], checkpoints=True)
    fit.fit(model)
    (out / f"dblp.rank{rank}.json").write_text(json.dumps(summary(bounded, model)))

    pl.seed_everything(seed, verbose=False)
    again = Digits(epochs)
    resumed = bounded
    snapshot = Snapshot(resumed)
    fit = trainer(epochs + 1, ranks, out, [resumed, snapshot])
    fit.fit(again, ckpt_path=out / "ckpt" / f"epoch={epochs - 1}.ckpt")
    torch.save(snapshot.restored, out / f"restored.rank{rank}.pt")
    (out / f"resumed.rank{rank}.json").write_text(json.dumps(summary(resumed, again)))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
         int(sys.argv[4]) if len(sys.argv) > 4 else 0)
