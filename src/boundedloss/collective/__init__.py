"""Collectives: who sends what to whom. Parameter server, transpose allreduce, and the
transpose allreduce in two levels (groups, then across them)."""

from .base import (
    BFLOAT16,
    Collective,
    MemoryKey,
    PeerFailure,
    RoundStats,
    message_id,
    narrow,
    widen,
)
from .guard import DEFAULT_GUARD_ROUNDS, NO_GUARD, LossGuard, LossGuards
from .parameter_server import ParameterServer, PendingBroadcast
from .transpose import TransposeAllreduce, shard_bounds
from .two_level import TwoLevelAllreduce, default_group_size

#: topology names (``--topology``, ``register(topology=...)``) and their collectives
TOPOLOGIES: dict[str, type[Collective]] = {
    "ps": ParameterServer, "allreduce": TransposeAllreduce, "two-level": TwoLevelAllreduce}

__all__ = [
    "BFLOAT16",
    "narrow",
    "widen",
    "Collective",
    "DEFAULT_GUARD_ROUNDS",
    "LossGuard",
    "LossGuards",
    "NO_GUARD",
    "MemoryKey",
    "ParameterServer",
    "PeerFailure",
    "PendingBroadcast",
    "RoundStats",
    "TOPOLOGIES",
    "TransposeAllreduce",
    "TwoLevelAllreduce",
    "default_group_size",
    "message_id",
    "shard_bounds",
]
