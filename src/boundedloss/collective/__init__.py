"""Collectives: who sends what to whom. Parameter server and transpose allreduce."""

from .base import Collective, PeerFailure, RoundStats, message_id
from .parameter_server import ParameterServer
from .transpose import TransposeAllreduce, shard_bounds

TOPOLOGIES = {"ps": ParameterServer, "allreduce": TransposeAllreduce}

__all__ = [
    "Collective",
    "ParameterServer",
    "PeerFailure",
    "RoundStats",
    "TOPOLOGIES",
    "TransposeAllreduce",
    "message_id",
    "shard_bounds",
]
