"""Small typed values shared by the protocol state machines and their adapters."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ..wire import (
    DEFAULT_CHUNK_BYTES,
    FLAGS_SLICE,
    HEADER_BYTES,
    MAX_MESSAGE_BYTES,
    CloseReason,
    check_chunk_bytes,
)
from .congestion import CONGESTION_MODES, DelayLoopConfig, parse_congestion

#: ACKs a receiver sends over one pass of a long message (see ack_every_for)
ACKS_PER_MESSAGE = 8
#: DATA datagrams per ACK of a message too short for ACKS_PER_MESSAGE to be fewer
ACK_EVERY_SHORT = 32
#: with congestion control on, DATA datagrams per ACK at most: each ACK is a round-trip
#: sample for the delay loop, which sees a queue build no sooner than its next one
CONGESTION_ACK_EVERY = 16


class TransitionEnum(enum.Enum):
    """A state or event of a transition table: hashed by identity, in C (Enum hashes
    the name in Python, and each transition looks up two)."""

    __hash__ = object.__hash__


class SendStatus(enum.Enum):
    STOPPED = "stopped"  # the receiver said STOP
    PEER_SILENT = "peer_silent"  # the receiver never answered within peer_timeout
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """Tunables of one endpoint. Times are seconds on whatever clock drives the core."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: retransmission timeout before any round trip was measured, and its clamp
    initial_rto: float = 0.05
    min_rto: float = 0.002
    max_rto: float = 0.5
    #: an unanswered PROBE is re-sent with its timeout doubled, but to at most this many
    #: times the RTO the round trips set: a PROBE is one header, so re-sending it costs
    #: the network nothing, while unbounded doubling turns a burst of random loss into
    #: seconds of idle waiting (a dead peer is caught by peer_timeout, not by backoff)
    probe_backoff_limit: float = 2.0
    #: each unanswered PROBE doubles the copies of the next one, up to this many: under
    #: heavy random loss (a microburst) one more copy is far cheaper than one more RTO
    #: (32: the miss target below holds up to 87% loss)
    probe_copies_max: int = 32
    #: after a pass that lost a fraction q, the next PROBE goes in enough copies that
    #: all of them (or all their answers) are lost with at most this chance (a copy is
    #: 48 bytes; a miss costs an RTO, at least min_rto - many round trips in a LAN)
    probe_miss_target: float = 0.01
    #: a sender that hears nothing from its receiver for this long gives up
    peer_timeout: float = 10.0
    #: a receive closes with whatever it has this long after it was posted
    receive_deadline: float = 30.0
    #: at most this many receives open at once (each holds a destination buffer)
    max_open_receives: int = 256
    #: closed receives remembered, so that a late PROBE is answered with STOP again
    closed_memory: int = 4096
    #: largest message a receive posted without a size may allocate
    max_message_bytes: int = 1 << 32
    #: flow control: DATA bytes a sender may have in flight beyond the receiver's last
    #: ACK (keep it under the receiver's socket buffer, or the kernel drops the rest; a
    #: UdpEndpoint caps it at a quarter of its own). 8 MB covers a few ms of ACK delay at
    #: tens of Gb/s: a smaller window leaves a fast sender waiting on the receiver's loop
    window_bytes: int = 8 << 20
    #: pacing of DATA per sender in bits/s (None: as fast as the window allows)
    rate_bps: float | None = None
    #: pace retransmission passes at this many times the best delivery rate the peer
    #: has shown lately (None: unpaced; the first pass is never paced by it). Under
    #: incast every sender's missing chunks otherwise go out at once into the queue that
    #: just dropped them. Off by default: the samples include the round trip, so on a
    #: fast CPU-bound path they pace below what the path can take, and the passes it
    #: saves under incast save no time (BENCHMARKS.md has the measurements).
    retransmit_pacing_gain: float | None = None
    #: datagrams one sender hands out per poll before the next sender's turn
    send_batch: int = 64
    #: receiver-driven first pass (protocol/credit.py): a receiver lets all its senders
    #: together have at most this many DATA bytes in flight toward it - its share to
    #: each in every ACK - so that an incast fits the queue in front of it (keep it under
    #: that queue, and over the bandwidth-delay product). None: no credit, each sender
    #: as its window allows
    credit_bytes: int | None = None
    #: with credit, each receiver sizes the budget from the overflows it sees and its
    #: drain rate and round trip (protocol/drain.py), ``credit_bytes`` the least it may
    #: be; False: the budget is ``credit_bytes``
    credit_adaptive: bool = False
    #: with credit, what a send may have in flight before its receiver's first grant,
    #: when no earlier message to that peer heard one: about a bandwidth-delay product
    #: (10 Gb/s over a rack's ~12 us round trip) - every sender of an incast sends it
    #: at once, before the receiver knows of them
    unscheduled_bytes: int = 16 * 1024
    #: sender-side congestion control (protocol/congestion.py), one of
    #: CONGESTION_MODES: "off" (each send's first pass unpaced, as the window and any
    #: credit allow) or "delay" (every pass paced at a rate per peer that a delay loop
    #: sets - random loss alone never lowers it). Off by default
    congestion: str = "off"

    def __post_init__(self) -> None:
        check_chunk_bytes(self.chunk_bytes)
        parse_congestion(self.congestion)
        if not 0 < self.min_rto <= self.initial_rto <= self.max_rto:
            raise ValueError("need 0 < min_rto <= initial_rto <= max_rto")
        if self.retransmit_pacing_gain is not None and self.retransmit_pacing_gain <= 0:
            raise ValueError("retransmit_pacing_gain must be > 0 (or None for unpaced)")
        if self.probe_backoff_limit < 1 or self.probe_copies_max < 1:
            raise ValueError("probe_backoff_limit and probe_copies_max must be >= 1")
        if not 0 < self.probe_miss_target < 1:
            raise ValueError("probe_miss_target must be in (0, 1)")
        if self.peer_timeout <= 0 or self.receive_deadline <= 0:
            raise ValueError("peer_timeout and receive_deadline must be > 0")
        if self.max_open_receives < 1 or self.closed_memory < 0 or self.send_batch < 1:
            raise ValueError("max_open_receives and send_batch must be >= 1")
        if not 0 < self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be 1..{MAX_MESSAGE_BYTES}")
        if self.window_bytes < self.chunk_bytes:
            raise ValueError("window_bytes must hold at least one chunk")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError("rate_bps must be > 0 (or None for unpaced)")
        datagram = self.chunk_bytes + HEADER_BYTES
        if self.credit_bytes is not None and self.credit_bytes < 2 * datagram:
            raise ValueError("credit_bytes must hold at least two datagrams (or None)")
        if self.credit_adaptive and self.credit_bytes is None:
            raise ValueError("an adaptive credit budget needs credit_bytes (its floor)")
        if self.unscheduled_bytes < datagram:
            raise ValueError("unscheduled_bytes must hold at least one datagram")

    @property
    def delay_loop(self) -> DelayLoopConfig | None:
        """The congestion control's delay loop (None: off)."""
        return CONGESTION_MODES[self.congestion]

    @property
    def window_datagrams(self) -> int:
        return max(1, self.window_bytes // (self.chunk_bytes + HEADER_BYTES))

    @property
    def credit_datagrams(self) -> int | None:
        """``credit_bytes`` in full DATA datagrams (None: no credit)."""
        if self.credit_bytes is None:
            return None
        return self.credit_bytes // (self.chunk_bytes + HEADER_BYTES)

    @property
    def unscheduled_datagrams(self) -> int:
        return min(self.window_datagrams,
                   self.unscheduled_bytes // (self.chunk_bytes + HEADER_BYTES))

    def ack_every_for(self, count: int) -> int:
        """A receiver of a message of ``count`` chunks ACKs every this many DATA
        datagrams: at least 8 ACKs per window (flow control), one per 32 datagrams of
        a short message, and 8 over a long message's pass - enough for the sender to
        read how much of the pass (and of the ACKs) is being lost before it PROBEs.
        Every ACK is a packet of its own, which the network forwards and the sender's
        core handles one at a time, so a long message is not ACKed more often than that. Sender and
        receiver both know ``count``: the sender reads reverse loss from how many ACKs
        the receiver owed it."""
        per_message = max(ACK_EVERY_SHORT, count // ACKS_PER_MESSAGE)
        if self.delay_loop is not None:
            # (the delay loop's samples are ACKs: a long message's few would leave it
            # blind for many round trips - and the receiver's config must say so too)
            per_message = min(per_message, CONGESTION_ACK_EVERY)
        return max(1, min(per_message, self.window_datagrams // 8))


_NEW = object.__new__
_R = TypeVar("_R")


def make_frozen(cls: type[_R], **fields: Any) -> _R:
    """An instance of the frozen dataclass ``cls`` (one with an instance dict: not
    slots) holding ``fields`` - every field, as no default applies - built without the
    generated ``__init__``, which sets each field through ``object.__setattr__``: 0.9 us
    for a ReceiveResult this way, 2.2 through the class. For the results every message
    ends in; the same object the class would make (tests/test_protocol.py)."""
    obj = _NEW(cls)
    obj.__dict__.update(fields)
    return obj


# (slots, built through the class: a simulated job holds millions until their round
# ends, and an instance dict would cost a 1,024-worker round 1.4 GB more)
@dataclass(frozen=True, slots=True)
class TransferStats:
    datagrams: int  # DATA datagrams sent (sender) or received (receiver), duplicates included
    payload_bytes: int  # DATA payload bytes in those datagrams
    chunks: int  # chunks in the message
    delivered: int  # chunks that arrived (receiver) / that the receiver reported (sender)
    retransmit_rounds: int  # probe answers that asked for missing chunks
    retransmitted: int  # DATA datagrams sent again (sender) / duplicates received (receiver)
    probes: int
    elapsed: float
    rtt: float | None = None
    started: float = 0.0  # when the send/receive was posted, on the core's clock
    #: receiver: chunks that had arrived when the sender had sent every chunk once (its
    #: first FINAL PROBE), or at the close if that came first - what the network let
    #: through before any recovery; None for a sender
    first_pass_delivered: int | None = None

    @property
    def finished(self) -> float:
        return self.started + self.elapsed

    @property
    def first_pass_loss(self) -> float | None:
        """The fraction of the message the sender's first pass lost (receiver): the
        network's loss before any retransmission, whatever the policy then asked for
        (a bounded receive retransmits up to its bound, a reliable one to the end, so
        neither's delivered fraction shows how lossy the way was)."""
        if self.first_pass_delivered is None:
            return None
        return 1.0 - self.first_pass_delivered / self.chunks if self.chunks else 0.0

    @property
    def delivered_fraction(self) -> float:
        return self.delivered / self.chunks if self.chunks else 1.0

    @property
    def retransmitted_fraction(self) -> float:
        return self.retransmitted / self.chunks if self.chunks else 0.0


@dataclass(frozen=True)
class ReceiveResult:
    """A closed receive: the buffer, which chunks arrived, and why it closed."""

    peer: object
    round_id: int
    message_id: int
    data: np.ndarray  # the destination (the caller's array, or a fresh uint8 array)
    delivered: np.ndarray = field(repr=False)  # bool per chunk
    chunk_bytes: int
    close_reason: CloseReason
    bound: float
    stats: TransferStats
    transfer_id: int = 0  # the mux's number for the receive this is the result of

    @property
    def complete(self) -> bool:
        return self.close_reason == CloseReason.COMPLETE

    def delivered_bytes_mask(self) -> np.ndarray:
        """Bool per byte of the message: True where the byte arrived."""
        n = self.data.nbytes
        return np.repeat(self.delivered, self.chunk_bytes)[:n]


@dataclass(frozen=True)
class SendResult:
    peer: object
    round_id: int
    message_id: int
    status: SendStatus
    close_reason: CloseReason | None  # from the receiver's STOP
    stats: TransferStats
    transfer_id: int = 0  # the mux's number for the send this is the result of

    @property
    def ok(self) -> bool:
        return self.status == SendStatus.STOPPED


@dataclass(frozen=True, slots=True)
class DataRun:
    """DATA datagrams of one message to one peer, as the sender's buffers hold them: the
    datagram of chunk ``i`` (for ``i`` in ``indices``) is the header
    ``headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]`` then the payload
    ``payload[i * chunk_bytes : (i + 1) * chunk_bytes]`` (the last chunk may be shorter),
    but that the last datagram's flags also have ``last_flags`` set (the first PROBE it
    carries: wire.Flag.PROBE_CARRIED). A data path sends them without building each
    datagram in Python."""

    peer: Hashable
    headers: memoryview
    payload: memoryview
    chunk_bytes: int
    indices: np.ndarray  # int64, C-contiguous
    last_flags: int = 0

    def datagrams(self) -> list[tuple[tuple, Hashable]]:
        """The same datagrams one by one, as ``(parts, peer)`` (memoryview slices clamp
        at the end, so the short last chunk needs no min())."""
        hb, cb = HEADER_BYTES, self.chunk_bytes
        out: list[tuple[tuple, Hashable]] = [
            ((self.headers[i * hb : (i + 1) * hb], self.payload[i * cb : (i + 1) * cb]),
             self.peer) for i in self.indices.tolist()]
        if self.last_flags and out:
            (head, body), peer = out[-1]
            flagged = bytearray(head)  # (a copy: the sender's headers stay as they are)
            flags = int.from_bytes(flagged[FLAGS_SLICE], "little") | self.last_flags
            flagged[FLAGS_SLICE] = flags.to_bytes(2, "little")
            out[-1] = ((bytes(flagged), body), peer)
        return out


class TransportError(RuntimeError):
    """A transfer could not finish (dead peer, cancelled, misuse)."""


class TooManyReceives(TransportError):
    pass
