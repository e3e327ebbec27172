"""PyTorch integration: ``boundedloss.torch.register(ddp_model, policy="dblp")``, or an
FSDP2 model in its place (``register(fully_shard(model), policy="dblp")``)."""

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

__all__ = ["HOOK_MAX_OPEN_RECEIVES", "STATE_DICT_FORMAT", "BoundedLossState", "LossGuard",
           "UnauthenticatedWarning", "comm_hook", "default_guard", "hook_transport", "register"]
