"""Collectives: who sends what to whom. Parameter server and transpose allreduce."""

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

#: topology names (``--topology``, ``register(topology=...)``) and their collectives
TOPOLOGIES: dict[str, type[Collective]] = {"ps": ParameterServer, "allreduce": TransposeAllreduce}

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
    "message_id",
    "shard_bounds",
]
