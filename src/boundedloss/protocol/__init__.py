"""Sans-I/O protocol core: state machines fed datagrams and ``now``, never sockets."""

from .mux import TransferMux
from .receiver import MessageReceiver
from .recovery import RECOVERY_MODES, probe_copies_for
from .sender import MessageSender
from .types import (
    CloseReason,
    ReceiveResult,
    SendResult,
    SendStatus,
    TooManyReceives,
    TransferStats,
    TransportConfig,
    TransportError,
)

__all__ = [
    "RECOVERY_MODES",
    "CloseReason",
    "MessageReceiver",
    "MessageSender",
    "ReceiveResult",
    "SendResult",
    "SendStatus",
    "TooManyReceives",
    "TransferMux",
    "TransferStats",
    "TransportConfig",
    "TransportError",
    "probe_copies_for",
]
