"""Sans-I/O protocol core: state machines fed datagrams and ``now``, never sockets."""

from .mux import TransferMux
from .receiver import MessageReceiver
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
]
