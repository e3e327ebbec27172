"""PyTorch integration: ``boundedloss.torch.register(ddp_model, policy="dblp")``."""

from .hook import BoundedLossState, comm_hook, register

__all__ = ["BoundedLossState", "comm_hook", "register"]
