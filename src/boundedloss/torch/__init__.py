"""PyTorch integration: ``boundedloss.torch.register(ddp_model, policy="dblp")``."""

from .hook import (
    HOOK_MAX_OPEN_RECEIVES,
    BoundedLossState,
    comm_hook,
    hook_transport,
    register,
)

__all__ = ["HOOK_MAX_OPEN_RECEIVES", "BoundedLossState", "comm_hook", "hook_transport",
           "register"]
