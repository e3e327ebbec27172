"""MessageSender: the sending half of one message, sans-I/O.

It never touches a socket or a clock: the owner feeds it ``now`` and the datagrams that
concern it, asks it for datagrams to send (``poll``) and for its next deadline.

Life of a send:
1. every chunk goes out once (critical chunks first);
2. with nothing new to send, the sender PROBEs and waits for the receiver's BITMAP;
3. chunks the BITMAP reports missing are queued again and sent; go to 2;
4. a STOP from the receiver ends the send - whenever it arrives, even mid-burst.

The sender keeps the send queue, the flow-control window and its state (``SendState``,
every transition in ``_TRANSITIONS``); the round trip, the timeouts and the PROBE copies
are its ``recovery``'s (``recovery.py``), pacing and delivery-rate samples its
``pacer``'s (``pacing.py``). A receiver silent for ``peer_timeout`` fails the send.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from .. import wire
from ..wire import BITMAP_PREFIX, CLOSE_REASONS, HEADER_BYTES, Flag, Kind
from .acks import AckState
from .congestion import AckSamples
from .loss_prior import LossPrior
from .pacing import Pacer
from .path import PeerPath
from .recovery import Recovery
from .rtt_prior import RttPrior
from .types import (
    CloseReason,
    DataRun,
    SendResult,
    SendStatus,
    TransferStats,
    TransitionEnum,
    TransportConfig,
    make_frozen,
)


class SendState(TransitionEnum):
    SENDING = "sending"  # no PROBE awaits an answer: DATA goes as window and pacing allow
    PROBE_DUE = "probe_due"  # a PROBE goes out at the next poll
    AWAITING_REPLY = "awaiting_reply"  # a PROBE is out: its answer, or its timeout
    DONE = "done"  # the send has its result


class SendEvent(TransitionEnum):
    PROBE_SENT = "probe_sent"
    PROBE_DEFERRED = "probe_deferred"  # the queue drained with no room left in this poll
    WINDOW_STUCK = "window_stuck"  # the window stayed shut for an RTO: ACKs were lost
    REPLY = "reply"  # the whole answer came and queued chunks to send again
    REPLY_NOTHING_QUEUED = "reply_nothing_queued"  # it asked for nothing not yet queued
    PROBE_TIMEOUT = "probe_timeout"
    FINISHED = "finished"  # STOP, a silent peer or a cancel


_S, _E = SendState, SendEvent
#: every state a send can move to, from where, on what
_TRANSITIONS: dict[tuple[SendState, SendEvent], SendState] = {
    (_S.SENDING, _E.PROBE_SENT): _S.AWAITING_REPLY,
    (_S.PROBE_DUE, _E.PROBE_SENT): _S.AWAITING_REPLY,
    (_S.SENDING, _E.PROBE_DEFERRED): _S.PROBE_DUE,
    (_S.SENDING, _E.WINDOW_STUCK): _S.PROBE_DUE,
    (_S.PROBE_DUE, _E.WINDOW_STUCK): _S.PROBE_DUE,
    (_S.AWAITING_REPLY, _E.REPLY): _S.SENDING,
    (_S.AWAITING_REPLY, _E.REPLY_NOTHING_QUEUED): _S.PROBE_DUE,
    (_S.AWAITING_REPLY, _E.PROBE_TIMEOUT): _S.PROBE_DUE,
    **{(s, _E.FINISHED): _S.DONE for s in (_S.SENDING, _S.PROBE_DUE, _S.AWAITING_REPLY)},
}


_NOTHING_QUEUED = np.empty(0, dtype=np.int64)
_NOTHING_QUEUED.flags.writeable = False


@functools.lru_cache(maxsize=16)
def _in_order(count: int) -> np.ndarray:
    """Chunks 0 to count - 1, read-only: a queue's order is never written in place (a
    requeue makes a new one), so the sends of one size share it."""
    order = np.arange(count, dtype=np.int64)
    order.flags.writeable = False
    return order


class SendQueue:
    """Chunk indices waiting to be sent, in order, and a read position; ``queued`` marks
    the chunks waiting, so that repeated BITMAPs do not queue a chunk twice."""

    __slots__ = ("count", "first_pass", "order", "pos", "queued", "sorted")

    def __init__(self, count: int, critical: np.ndarray | None):
        self.count = count
        #: the order is 0 to count - 1 (a batch taken is a run of chunks, in order)
        self.sorted = critical is None or not critical.any()
        if self.sorted:
            self.order: np.ndarray = _in_order(count)
        else:
            assert critical is not None
            order = np.concatenate([np.flatnonzero(critical), np.flatnonzero(~critical)])
            self.order = order.astype(np.int64)
        self.pos = 0
        #: bool per chunk, made by the first requeue (None until then: the chunks
        #: waiting are exactly ``order[pos:]`` - most sends never requeue, and a first
        #: pass then marks nothing)
        self.queued: np.ndarray | None = None
        #: every chunk is still going out for the first time
        self.first_pass = True

    def __len__(self) -> int:
        return len(self.order) - self.pos

    def take(self, k: int) -> np.ndarray:
        batch = self.order[self.pos : self.pos + k]
        self.pos += k
        if self.queued is not None:
            self.queued[batch] = False
        return batch

    def holds_last(self, batch: np.ndarray) -> bool:
        """Whether ``batch`` (just taken) holds the message's last chunk."""
        last = self.count - 1
        return int(batch[-1]) == last if self.sorted else bool((batch == last).any())

    def requeue(self, missing: np.ndarray) -> int:
        """Queue the ``missing`` chunks not queued already; how many that is."""
        queued = self.queued
        if queued is None:
            queued = self.queued = np.zeros(self.count, dtype=bool)
            queued[self.order[self.pos :]] = True
        fresh = missing[~queued[missing]]
        if fresh.size:
            queued[fresh] = True
            self.order = np.concatenate([self.order[self.pos :], fresh.astype(np.int64)])
            self.pos = 0
            self.sorted = False
        return int(fresh.size)

    def drained(self) -> None:
        """Everything queued went out: the next chunks are retransmissions."""
        if self.order.size:  # (a poll of a drained queue allocates nothing)
            self.order = _NOTHING_QUEUED
        self.pos = 0
        self.first_pass = False


class FlowWindow:
    """Every DATA datagram gets the next transmission sequence; the receiver's ACKs (and
    PROBE answers) say how far it has seen, so that at most ``size`` datagrams - or the
    receiver's credit, if less - are ever in flight. A window that stays shut for an RTO
    (its ACKs lost) calls for a PROBE, whose answer reopens it."""

    __slots__ = ("acks", "parked_probes", "probe_mark", "size")

    def __init__(self, size: int, acks: AckState):
        self.size = size
        #: PROBEs in a row the window stayed shut for with no credit granted (a receiver
        #: with more senders than credit parks some): each waits twice the one before
        self.parked_probes = 0
        #: ``acked`` (every tseq below it has arrived or is lost), ``next_tseq`` and
        #: ``blocked_since`` (None: open), which the ACKs move
        self.acks = acks
        self.probe_mark = 0  # next_tseq when the latest PROBE went

    def room(self) -> int:
        acks = self.acks
        return min(self.size, acks.credit) - (acks.next_tseq - acks.acked)

    def shut(self, now: float) -> None:
        if self.acks.blocked_since is None:
            self.acks.blocked_since = now

    def stuck_after(self, rto: float, max_rto: float) -> float:
        """How long the window may stay shut before a PROBE asks why: an RTO (its ACKs
        were lost) - or, with no credit granted, twice as long as the last time, to at
        most ``max_rto``: a parked sender waits for the grant its receiver sends, and
        PROBEs only in case that was lost."""
        if self.acks.credit > 0:
            self.parked_probes = 0  # (here: the compiled path takes the grants' ACKs)
            return rto
        return max(rto, min(max_rto, rto * (1 << min(self.parked_probes, 16))))

    def acked_through(self, tseq_seen: int) -> None:
        acks = self.acks
        if tseq_seen + 1 > acks.acked:
            acks.acked = min(tseq_seen + 1, acks.next_tseq)
            acks.blocked_since = None

    def probe_answered(self) -> None:
        # Everything sent before the PROBE has arrived or is lost by now (the answer
        # came back behind it), so none of it is in flight any more.
        acks = self.acks
        if self.probe_mark > acks.acked:
            acks.acked = self.probe_mark
            acks.blocked_since = None


@dataclass(slots=True)
class SendCounts:
    datagrams: int = 0
    payload_bytes: int = 0
    retransmitted: int = 0
    retransmit_rounds: int = 0
    probes: int = 0
    #: 1 where the first pass's last DATA carried the first PROBE
    probe_carried: int = 0


@dataclass(slots=True)
class OutstandingProbe:
    """The latest PROBE: its sequence, bytes, when it went and when it times out."""

    seq: int = 0
    datagram: bytes = b""
    sent_at: float = 0.0
    deadline: float | None = None


class SendGeometry:
    """What a send's size alone decides: its chunks, the header its control datagrams are
    built from, its DATA headers (each send writes its tseqs into a copy of them) and
    the ACK cadence its receiver keeps. Sends posted together - one message to many
    peers at one instant - share one per size (``SendBatch``)."""

    __slots__ = ("ack_every", "config", "count", "data_headers", "header", "window")

    def __init__(self, session: int, round_id: int, message_id: int, nbytes: int,
                 config: TransportConfig, critical: np.ndarray | None):
        self.config = config
        cb = config.chunk_bytes
        self.count = count = wire.chunk_count(nbytes, cb)
        self.header = wire.Header(Kind.PROBE, session, round_id, message_id, 0, count,
                                  nbytes, cb)
        self.data_headers = wire.build_data_headers(
            session=session, round_id=round_id, message_id=message_id, message_bytes=nbytes,
            chunk_bytes=cb, critical=critical,
        )
        self.ack_every = config.ack_every_for(count)
        self.window = config.window_datagrams


class SendBatch:
    """Sends posted at one instant share their ``SendGeometry`` by size (those without a
    critical mask: one with a mask has DATA headers of its own)."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[tuple, SendGeometry] = {}

    def geometry(self, session: int, round_id: int, message_id: int, nbytes: int,
                 config: TransportConfig) -> SendGeometry:
        key = (session, round_id, message_id, nbytes)
        shared = self._by_key.get(key)
        if shared is None or shared.config is not config:
            shared = self._by_key[key] = SendGeometry(session, round_id, message_id, nbytes,
                                                      config, None)
        return shared


class MessageSender:
    # (slots: a send's attributes in a dict cost a simulated job's millions of open sends
    # a kilobyte or more each)
    __slots__ = (
        "peer", "transfer_id", "config", "_payload", "message", "round_id", "message_id",
        "nbytes", "chunk_bytes", "count", "_tseq_field", "_headers", "_queue", "_state",
        "_probe", "path", "recovery", "acks", "_window", "_acks_shared", "pacer",
        "_samples", "started", "counts", "result",
    )

    def __init__(
        self,
        *,
        peer: Hashable,
        session: int,
        round_id: int,
        message_id: int,
        payload,
        config: TransportConfig,
        now: float,
        critical: np.ndarray | None = None,
        path: PeerPath | None = None,
        transfer_id: int = 0,
        loss_prior: LossPrior | None = None,
        shared_acks=None,
        rtt_prior: RttPrior | None = None,
        batch: SendBatch | None = None,
    ):
        """``shared_acks``: a fresh ``Send`` of the compiled data path to keep what the
        ACKs move in, which it then takes the ACKs with (``NativeDataPath.new_acks``);
        None: an AckState of its own. ``batch``: the sends posted with this one, whose
        geometry it shares (``SendBatch``)."""
        self.peer = peer
        self.transfer_id = transfer_id
        self.config = config
        self._payload = wire.as_bytes_view(payload)
        nbytes = self._payload.nbytes
        if nbytes > wire.MAX_MESSAGE_BYTES:
            raise ValueError(f"message of {nbytes} bytes exceeds {wire.MAX_MESSAGE_BYTES}")
        cb = config.chunk_bytes
        if critical is not None:
            critical = np.asarray(critical, dtype=bool)
            count = wire.chunk_count(nbytes, cb)
            if critical.shape != (count,):
                raise ValueError(f"critical mask must have one entry per chunk ({count})")
        if batch is None or critical is not None:
            geometry = SendGeometry(session, round_id, message_id, nbytes, config, critical)
            headers = geometry.data_headers
        else:
            geometry = batch.geometry(session, round_id, message_id, nbytes, config)
            headers = geometry.data_headers.copy()  # (its tseqs are written into it)
        #: the message as its control datagrams describe it
        self.message = geometry.header
        # (its identity and geometry, as the header holds them)
        self.round_id = round_id
        self.message_id = message_id
        self.nbytes = nbytes
        self.chunk_bytes = cb
        self.count = count = geometry.count
        self._tseq_field = headers.view("<u4")[:, wire.TSEQ_WORD]
        self._headers = headers.reshape(-1).data
        self._queue = SendQueue(count, critical)
        self._state = SendState.SENDING
        self._probe = OutstandingProbe()
        self.path = path if path is not None else PeerPath(peer, config.delay_loop)
        self.recovery = Recovery(config, self.path.rtt, self.path.reverse_loss(now),
                                 ack_every=geometry.ack_every, loss_prior=loss_prior,
                                 acks=shared_acks, rtt_prior=rtt_prior)
        #: what the ACKs move, for recovery, the window and this sender alike (the
        #: compiled data path's Send, where it takes them)
        self.acks = self.recovery.acks
        self.acks.last_heard = now
        if config.credit_bytes is not None:  # (the first pass's allowance until a grant)
            granted = self.path.granted
            self.acks.credit = (config.unscheduled_datagrams if granted is None
                                else max(1, granted))
        self._window = FlowWindow(geometry.window, self.acks)
        # (shared with the compiled path: the flags then follow every step)
        self._acks_shared = shared_acks is not None
        congestion = self.path.congestion
        self.pacer = Pacer(config, cb + HEADER_BYTES, now, self.path.best_rate(), congestion)
        #: the round trips and delivery rates the ACKs show, for the peer's congestion
        #: control (None: off)
        self._samples: AckSamples | None = None
        if congestion is not None:
            congestion.senders += 1  # (the peer's rate is split among its open sends)
            self._samples = AckSamples(congestion, cb + HEADER_BYTES)
        self.started = now
        self.counts = SendCounts()
        self.result: SendResult | None = None

    @property
    def state(self) -> SendState:
        return self._state

    @property
    def done(self) -> bool:
        return self.result is not None

    def _transition(self, event: SendEvent) -> None:
        try:
            self._state = _TRANSITIONS[(self._state, event)]
        except KeyError:
            raise AssertionError(f"send: no transition from {self._state} on {event}") from None

    def _share_ack_flags(self) -> None:
        """Say which ACKs need the Python core (see AckState): one heard with the PROBE
        that follows the whole first pass awaiting its answer, before any answer has
        measured the loss, may call for more copies of that PROBE (recovery's
        ack_received) - unless the loss it implies stays within what the copies sent
        cover (Recovery.loss_limit), where the answer is "no more", or more copies are
        due already (then it may be "fewer").
        (Nothing to say while the state is not shared.)"""
        if not self._acks_shared:
            return
        decides = (self._state is SendState.AWAITING_REPLY and not self._queue.first_pass
                   and self.recovery.acks_may_add_copies)
        self.acks.check_loss = decides
        self.acks.in_python = decides and self.recovery.more_copies_due
        if decides:
            self.acks.loss_limit = self.recovery.loss_limit()

    # ----------------------------------------------------------------- outgoing
    def quiescent(self) -> bool:
        """Nothing to send and nothing a poll would change until a datagram or a timer
        reaches this send through the core: its PROBE awaits an answer, with nothing
        queued and no more copies due (a window the compiled path's ACKs open has
        nothing to let out)."""
        return (self._state is SendState.AWAITING_REPLY and len(self._queue) == 0
                and not self.recovery.more_copies_due)

    def has_data(self) -> bool:
        state = self._state
        if state is SendState.DONE:
            return False
        return state is SendState.PROBE_DUE or self.recovery.more_copies_due or (
            len(self._queue) > 0 and self._window.room() > 0 and self.pacer.paced_until is None
        )

    def poll(self, now: float, limit: int, out: list, *, runs: bool = False) -> int:
        """Append up to ``limit`` datagrams ``(parts, peer)`` to ``out``; return how many.
        ``runs``: the DATA of this poll as one ``DataRun`` instead."""
        if self._state is SendState.DONE:
            return 0
        if self._samples is not None:  # (ACKs the compiled path took since)
            self._samples.read(self.acks)
        sent = self._poll(now, limit, out, runs)
        self._share_ack_flags()
        return sent

    def _poll(self, now: float, limit: int, out: list, runs: bool) -> int:
        sent = 0
        if self._state is SendState.PROBE_DUE:
            sent = self._send_probe(now, out)
        elif self.recovery.more_copies_due:
            more = self.recovery.take_more_copies()
            out.extend([((self._probe.datagram,), self.peer)] * more)
            sent = more
        queue = self._queue
        avail = len(queue)
        carries = False
        if avail > 0 and sent < limit:
            window = self._window
            room = window.room()
            k = min(avail, limit - sent, room)
            if k > 0:  # (waiting for tokens is not a shut window)
                k = self.pacer.allow(now, k, queue.first_pass)
            if room <= 0:
                window.shut(now)
            elif k > 0:
                # The first pass's last DATA carries the send's first PROBE on a warm path
                # that loses nothing: one datagram asks for what is missing, not two (and
                # the closed receive's second STOP is not drawn).
                carries = (k == avail and queue.first_pass and self._probe.seq == 0
                           and self._state is SendState.SENDING
                           and self.recovery.may_carry_probe())
                sent += self._send_data(now, k, out, runs,
                                        Flag.PROBE_CARRIED if carries else Flag.NONE)
        if len(queue) == 0:
            queue.drained()
            if self._state is SendState.SENDING:  # nothing new to send: ask what is missing
                if carries or sent < limit:
                    sent += self._send_probe(now, out, carried=carries)
                else:
                    self._transition(SendEvent.PROBE_DEFERRED)
        return sent

    def _send_data(self, now: float, k: int, out: list, runs: bool, last_flags: int) -> int:
        queue = self._queue
        first_pass = queue.first_pass
        batch = queue.take(k)
        window = self._window
        acks = window.acks
        tseq = acks.next_tseq
        tseqs = np.arange(tseq, tseq + k, dtype=np.uint32)
        if queue.sorted:  # (a run of chunks: a slice, not an index per chunk)
            lo = int(batch[0])
            self._tseq_field[lo : lo + k] = tseqs
        else:
            self._tseq_field[batch] = tseqs
        acks.next_tseq = tseq + k
        self.recovery.data_sent(now, k)
        if self._samples is not None:
            self._samples.sent(tseq, now)
        run = DataRun(self.peer, self._headers, self._payload, self.chunk_bytes, batch,
                      last_flags)
        if runs:
            out.append(run)
        else:
            out.extend(run.datagrams())
        cb = self.chunk_bytes
        counts = self.counts
        counts.datagrams += k
        counts.payload_bytes += k * cb
        if queue.holds_last(batch):  # the last chunk is short
            counts.payload_bytes -= self.count * cb - self.nbytes
        if not first_pass:
            counts.retransmitted += k
        return k

    def _send_probe(self, now: float, out: list, carried: bool = False) -> int:
        """A PROBE, in as many copies as recovery asks for; ``carried``: the first of them
        went already, carried by the DATA just sent (its sequence is 1: the send's first).
        The datagrams this puts into ``out``."""
        probe = self._probe
        probe.seq += 1
        probe.sent_at = now
        probe.deadline = now + self.recovery.probe_timeout()
        self.counts.probes += 1
        if carried:
            self.counts.probe_carried = 1
        self._window.probe_mark = self.acks.next_tseq
        first_pass = self._queue.first_pass
        self._transition(SendEvent.PROBE_SENT)
        # FINAL: every chunk has been sent once, so the receiver may stop on its bound
        # (a PROBE sent while the window is shut is not FINAL).
        probe.datagram = wire.control_datagram(
            self.message, Kind.PROBE, probe.seq, flags=Flag.NONE if first_pass else Flag.FINAL)
        copies = self.recovery.probe_copies(now, first_pass) - carried
        out.extend([((probe.datagram,), self.peer)] * copies)
        return copies

    # ----------------------------------------------------------------- incoming
    def bitmap_received(self, flags: int, start: int, payload, now: float) -> None:
        if self._state is SendState.DONE:
            return
        echo, delivered = BITMAP_PREFIX.unpack_from(payload)
        if self._samples is not None:  # (before last_heard moves past the ACKs')
            self._samples.read(self.acks)
        self._heard(delivered, now)
        if echo != self._probe.seq or self._state is not SendState.AWAITING_REPLY:
            # An answer to an earlier PROBE, or a second answer to this one (PROBEs go
            # out in copies): it would queue again chunks already re-sent since.
            return
        n_bits = min((len(payload) - BITMAP_PREFIX.size) * 8, self.count - start)
        bits = np.unpackbits(
            np.frombuffer(payload, dtype=np.uint8, offset=BITMAP_PREFIX.size),
            bitorder="little",
        )[:n_bits]
        missing = np.flatnonzero(bits == 0)
        lost = 0
        if missing.size:
            missing += start
            lost = self._queue.requeue(missing)
        # (what the pass lost: a chunk still queued - not sent yet, as when a shut window
        # or a grant of no credit called for this PROBE - was not lost)
        self.recovery.missing_reported(lost)
        if flags & Flag.FINAL:
            self._reply_received(now)
            self._share_ack_flags()

    def ack_received(self, tseq_seen: int, delivered: int, now: float,
                     credit: int | None = None) -> None:
        """An ACK; ``credit``: the grant it carries (Flag.CREDIT), if any."""
        if self._state is SendState.DONE:
            return
        if credit is not None:
            self._credited(credit)
        self._heard(delivered, now)
        self.recovery.ack_received(
            tseq_seen, delivered, now,
            self._state is SendState.AWAITING_REPLY and not self._queue.first_pass)
        self._window.acked_through(tseq_seen)
        if self._samples is not None:
            self._samples.read(self.acks)
        self._share_ack_flags()

    def _credited(self, credit: int) -> None:
        """The receiver grants ``credit``. (Its ACKs then come at the cadence that credit
        calls for, more often than ``acks.ack_every`` - which the loss is still read
        against: the cadence moves as the receiver's other senders come and go, so no
        count of the ACKs owed could follow it; counted against the message's own, the
        ACKs show no loss on the way back, and recovery reads it from the hint.)"""
        acks = self.acks
        acks.credit = credit
        if acks.granted_least < 0 or credit < acks.granted_least:
            acks.granted_least = credit

    def _heard(self, delivered: int, now: float) -> None:
        """The receiver is alive and says it has ``delivered`` chunks."""
        acks = self.acks
        acks.last_heard = now
        acks.reported_delivered = max(acks.reported_delivered, delivered)

    def _reply_received(self, now: float) -> None:
        self._window.probe_answered()
        recovery = self.recovery
        started_at = recovery.pass_started_at
        unrepeated, got = recovery.reply_received(now - self._probe.sent_at)
        self._probe.deadline = None
        self.pacer.pass_answered(now, got, started_at, unrepeated, len(self._queue),
                                 recovery.rto_base)
        if recovery.reply_missing:
            self.counts.retransmit_rounds += 1
        self._transition(SendEvent.REPLY if len(self._queue) else SendEvent.REPLY_NOTHING_QUEUED)

    def stop_received(self, reason: int, delivered: int, now: float) -> None:
        if self._state is SendState.DONE:
            return
        if self._samples is not None:  # (ACKs the compiled path took since)
            self._samples.read(self.acks)
        self.acks.reported_delivered = delivered
        close_reason = CLOSE_REASONS.get(reason)  # (None: a reason we do not know)
        if (self._state is SendState.AWAITING_REPLY and not self._queue.first_pass
                and self.recovery.unanswered == 0
                and close_reason in (CloseReason.BOUND_MET, CloseReason.COMPLETE)):
            # The answer to the FINAL PROBE when a bound was met (or, a hair early, the
            # STOP of a message that completed as the PROBE went out): a round trip for
            # the next message to this peer - bounded transfers may never see a BITMAP.
            # A STOP sent by a receiver's timer (an acceptance or hard deadline) answers
            # no PROBE: its wait is no round trip.
            self.recovery.rtt_sample(now - self._probe.sent_at)
        self.recovery.stop_received(max(0, self.count - delivered))
        self._finish(SendStatus.STOPPED, close_reason, now)

    # ------------------------------------------------------------------- timers
    def take_endpoint_rtt(self) -> bool:
        """The PROBE awaiting its answer times out as the endpoint's round trips call for,
        if that is sooner and the send has none of its own (Recovery.probe_timeout,
        counted from when the PROBE went). Whether its deadline moved."""
        probe = self._probe
        if self._state is SendState.DONE or probe.deadline is None:
            return False
        deadline = probe.sent_at + self.recovery.probe_timeout()
        if deadline >= probe.deadline:
            return False
        probe.deadline = deadline
        return True

    def next_deadline(self) -> float | None:
        if self._state is SendState.DONE:
            return None
        t = self.acks.last_heard + self.config.peer_timeout
        probe_deadline = self._probe.deadline
        if probe_deadline is not None and probe_deadline < t:
            t = probe_deadline
        blocked_since = self.acks.blocked_since
        if blocked_since is not None and self._state is not SendState.AWAITING_REPLY:
            t = min(t, blocked_since + self._stuck_after())
        paced_until = self.pacer.paced_until
        if paced_until is not None and paced_until < t:
            t = paced_until
        return t

    def timer_fired(self, now: float) -> None:
        if self._state is SendState.DONE:
            return
        if now >= self.acks.last_heard + self.config.peer_timeout:
            self._finish(SendStatus.PEER_SILENT, None, now)
            return
        if self._samples is not None:  # (ACKs the compiled path took since)
            self._samples.read(self.acks)
        self.pacer.timer_fired(now)
        acks = self.acks
        if (
            acks.blocked_since is not None
            and self._state is not SendState.AWAITING_REPLY
            and now >= acks.blocked_since + self._stuck_after()
        ):
            acks.blocked_since = None
            if acks.credit <= 0:
                self._window.parked_probes += 1
            self._transition(SendEvent.WINDOW_STUCK)
        probe = self._probe
        if probe.deadline is not None and now >= probe.deadline:
            # The PROBE or its answer was lost: ask again, backing off.
            self.recovery.probe_timed_out()
            probe.deadline = None
            self._transition(SendEvent.PROBE_TIMEOUT)
        self._share_ack_flags()

    def _stuck_after(self) -> float:
        return self._window.stuck_after(self.recovery.rto, self.config.max_rto)

    def cancel(self, now: float) -> None:
        if self._state is not SendState.DONE:
            self._finish(SendStatus.CANCELLED, None, now)

    def _finish(self, status: SendStatus, reason: CloseReason | None, now: float) -> None:
        self._queue.drained()
        self._transition(SendEvent.FINISHED)
        if self.path.congestion is not None:
            self.path.congestion.senders -= 1
        counts = self.counts
        recovery = self.recovery
        least = self.acks.granted_least
        self.path.send_finished(recovery.rtt_estimate, self.pacer.rate_samples,
                                least if least >= 0 else None)
        self.result = make_frozen(
            SendResult,
            peer=self.peer,
            round_id=self.round_id,
            message_id=self.message_id,
            status=status,
            close_reason=reason,
            stats=TransferStats(
                datagrams=counts.datagrams,
                payload_bytes=counts.payload_bytes,
                chunks=self.count,
                delivered=self.acks.reported_delivered,
                retransmit_rounds=counts.retransmit_rounds,
                retransmitted=counts.retransmitted,
                probes=counts.probes,
                elapsed=now - self.started,
                rtt=recovery.srtt,
                started=self.started,
            ),
            transfer_id=self.transfer_id,
        )
