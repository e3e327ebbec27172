"""The Lightning callback: the bounded-loss hook on a Lightning DDP job in one line.

    trainer = Trainer(strategy="ddp", callbacks=[BoundedLossCallback(policy="dblp")])

Lightning wraps the model in DDP only once fit starts, so the callback registers then;
it calls the epoch-end step DBLP needs, and keeps every rank's hook state in Lightning's
checkpoints (which rank 0 writes alone). Lightning is imported here only: ``import
boundedloss.torch`` does not need it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

try:  # the unified package first; the standalone pytorch-lightning is the same API
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # pragma: no cover - depends on which is installed
    try:
        from pytorch_lightning import (  # type: ignore[assignment]
            Callback,
            LightningModule,
            Trainer,
        )
    except ImportError:
        raise ImportError("boundedloss.torch.BoundedLossCallback needs Lightning: "
                          "pip install lightning") from None

from ..policy import Policy
from .every_rank import EveryRankState, own_state_dict
from .hook import BoundedLossState, register


class BoundedLossCallback(Callback):
    """``register(ddp_model, policy, **register_kw)`` on every rank when fit starts, on
    the model Lightning's DDP strategy wrapped; ``state.epoch_end(optimizer)`` once per
    training epoch; the hook's state in checkpoints; the endpoint closed at teardown.
    The live :class:`BoundedLossState` is ``self.state`` (None before fit starts).

    The epoch-end step runs at the boundary after Lightning stepped all the epoch's LR
    schedulers - when the next epoch starts, or training ends - as ``scheduler.step();
    state.epoch_end(optimizer)`` in a plain loop, so that DBLP marks the epoch after an
    LR change critical: Lightning steps a ``ReduceLROnPlateau`` after
    ``on_train_epoch_end`` (the others before it). It runs only if gradients were
    exchanged since the last one (``state.epoch_rounds``, which checkpoints keep): a job
    resumed from a checkpoint taken before that boundary (at validation's or the
    epoch's end, where ``ModelCheckpoint`` saves) ends that epoch when it starts the
    next, and one resumed mid-epoch goes on with it.

    Checkpoints: ``state_dict()`` holds every rank's hook state (gathered on rank 0,
    which writes Lightning's checkpoint); on a resume (``fit(ckpt_path=...)``) each
    rank loads its own once registered. Each fit registers afresh: a callback used for a
    second fit starts a new hook state unless that fit resumes a checkpoint (a policy
    given as an object, not a name, keeps what it learned)."""

    def __init__(self, policy: str | Policy = "dblp", **register_kw: Any) -> None:
        self.policy = policy
        self.register_kw = register_kw
        self.state: BoundedLossState | None = None
        self._live = False  # registered in the fit that runs now (not yet torn down)
        #: every rank's hook state from a checkpoint, until fit start registers
        self._loaded: Mapping[str, Any] | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                "BoundedLossCallback needs a DDP strategy (Trainer(strategy=\"ddp\"), "
                "\"ddp_spawn\" or \"ddp_notebook\"), whose model is DistributedDataParallel; "
                f"this trainer runs {type(trainer.strategy).__name__} on a "
                f"{type(model).__name__}")
        self.state = register(model, self.policy, **self.register_kw)
        self._live = True
        if self._loaded:
            self.state.load_state_dict(own_state_dict(self._loaded, self.state.rank))
            self._loaded = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_epoch(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end_epoch(trainer)

    def _end_epoch(self, trainer: Trainer) -> None:
        state = self.state
        # (every rank exchanged the same rounds: all of them call this collective, or none)
        if state is not None and state.epoch_rounds:
            state.epoch_end(trainer.optimizers[0] if trainer.optimizers else None)

    def state_dict(self) -> dict[str, Any]:
        if self.state is None:  # (no fit yet: what was loaded, if anything)
            return dict(self._loaded or {})
        return EveryRankState(self.state).state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before it wraps the model: kept until fit start
        if self._live and self.state is not None:
            EveryRankState(self.state).load_state_dict(state_dict)
        else:
            self._loaded = state_dict

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self.state is not None:
            # a rank closing while a peer still waits for its last STOP fails that peer
            if dist.is_initialized():
                dist.barrier(group=self.state.process_group)
            self.state.close()
            self._live = False

    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        if self.state is not None:  # (no barrier: the other ranks may be gone)
            self.state.close()
            self._live = False
