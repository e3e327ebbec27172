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

#: the largest world the transpose allreduce is the default for; above it, two levels
TRANSPOSE_UP_TO = 8


def default_topology(world_size: int) -> str:
    """The topology a job of ``world_size`` ranks takes unless it names one: the
    transpose allreduce up to ``TRANSPOSE_UP_TO`` ranks, two levels above (fewer
    messages a rank). Not the parameter server: its server takes every rank's whole
    gradient in through one link, so its round grows with the world (BENCHMARKS.md,
    "The default topology", and the test that holds this choice to the simulator)."""
    return "allreduce" if world_size <= TRANSPOSE_UP_TO else "two-level"

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
    "TRANSPOSE_UP_TO",
    "TransposeAllreduce",
    "TwoLevelAllreduce",
    "default_group_size",
    "default_topology",
    "message_id",
    "shard_bounds",
]
