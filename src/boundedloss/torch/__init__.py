"""PyTorch integration: ``boundedloss.torch.register(ddp_model, policy="dblp")``, or an
FSDP2 model in its place (``register(fully_shard(model), policy="dblp")``); on Lightning,
``Trainer(callbacks=[boundedloss.torch.BoundedLossCallback(policy="dblp")])``."""

from typing import Any

from .every_rank import EVERY_RANK_FORMAT, EveryRankState
from .hook import (
    HOOK_MAX_OPEN_RECEIVES,
    STATE_DICT_FORMAT,
    BoundedLossState,
    LossGuard,
    UnauthenticatedWarning,
    comm_hook,
    default_guard,
    hook_transport,
    register,
)

# (BoundedLossCallback is left out: a star import must not need Lightning)
__all__ = ["EVERY_RANK_FORMAT", "HOOK_MAX_OPEN_RECEIVES", "STATE_DICT_FORMAT",
           "BoundedLossState", "EveryRankState", "LossGuard", "UnauthenticatedWarning",
           "comm_hook", "default_guard", "hook_transport", "register"]


def __getattr__(name: str) -> Any:
    # (Lightning is imported only when its callback is asked for: the core install lacks it)
    if name == "BoundedLossCallback":
        from .lightning import BoundedLossCallback
        return BoundedLossCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
