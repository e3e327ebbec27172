"""MessageReceiver: the receiving half of one message, sans-I/O.

Chunks land out of order straight into the destination buffer at ``index *
chunk_bytes``; a per-chunk delivered flag and a running count decide, with two integer
comparisons per datagram, whether the policy's plan is met. A PROBE is answered with
the BITMAP segments that still hold missing chunks. When the plan is met (or its
acceptance deadline, or the hard deadline, passes) the receiver closes and sends STOP;
the owner remembers closed messages so that a late PROBE gets the STOP again.

The receiver's state (``ReceiveState``, every transition in ``_TRANSITIONS``) says what
may close it: before the sender has sent everything once a met bound waits for the rest
of the first pass; once the sender says so (a FINAL PROBE), or the acceptance deadline
passes, a met bound closes it. The per-datagram counters (``ReceiveCounts``) live apart,
since the compiled data path shares them (a receive keeps them in its ``Receive``).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Hashable

import numpy as np

from .. import wire
from ..policy.base import ClosePlan, MessageInfo, Outcome, Policy, learns
from ..wire import BITMAP_PREFIX, HEADER_BYTES, STOP_PAYLOAD, Flag, Kind
from .credit import CreditGrants, ack_cadence
from .path import PeerPath
from .types import (
    CloseReason,
    ReceiveResult,
    TransferStats,
    TransitionEnum,
    TransportConfig,
    make_frozen,
)

#: the most datagrams ``data_run`` takes at once (its duplicate marks are uint8 > 1)
RUN_MAX = 250
_MARKS = np.arange(2, 2 + RUN_MAX, dtype=np.uint8)


class ReceiveState(TransitionEnum):
    SIZELESS = "sizeless"  # posted without a size: no plan until the first datagram
    FIRST_PASS = "first_pass"  # the sender is still sending its first pass
    SENDER_DONE = "sender_done"  # a FINAL PROBE: every chunk was sent once
    ACCEPTING = "accepting"  # the acceptance deadline passed: what arrived is taken
    CLOSED = "closed"  # the receive has its result


class ReceiveEvent(TransitionEnum):
    SIZED = "sized"  # the message's size is known: its plan is set
    SENDER_DONE = "sender_done"  # a PROBE flagged FINAL
    ACCEPT_DEADLINE = "accept_deadline"
    CLOSED = "closed"  # the plan met, the hard deadline, or a cancel


_S, _E = ReceiveState, ReceiveEvent
#: every state a receive can move to, from where, on what
_TRANSITIONS: dict[tuple[ReceiveState, ReceiveEvent], ReceiveState] = {
    (_S.SIZELESS, _E.SIZED): _S.FIRST_PASS,
    (_S.FIRST_PASS, _E.SENDER_DONE): _S.SENDER_DONE,
    (_S.SENDER_DONE, _E.SENDER_DONE): _S.SENDER_DONE,  # (later passes' PROBEs are FINAL)
    (_S.ACCEPTING, _E.SENDER_DONE): _S.ACCEPTING,
    (_S.FIRST_PASS, _E.ACCEPT_DEADLINE): _S.ACCEPTING,
    (_S.SENDER_DONE, _E.ACCEPT_DEADLINE): _S.ACCEPTING,
    **{(s, _E.CLOSED): _S.CLOSED
       for s in (_S.SIZELESS, _S.FIRST_PASS, _S.SENDER_DONE, _S.ACCEPTING)},
}
#: the states in which a met bound may end the transfer before every chunk is in
_EARLY_STOP = frozenset({_S.SENDER_DONE, _S.ACCEPTING})


class ReceiveCounts:
    """What a receive counts per datagram (DATA and PROBEs), when it first heard of the
    message, and the facts its close check and its PROBE answers need.

    The compiled data path (``boundedloss._native.Receive``) has the same fields; a
    receive whose DATA it takes keeps its counters in one from the start (``counts=``),
    and both sides then read and write one set. ``early_stop``, ``accepting`` and
    ``final_seen`` mirror the receive's state (``_EARLY_STOP``; ACCEPTING; the first FINAL
    PROBE came) for the compiled path, which reads no Python object."""

    __slots__ = ("accepting", "answered_seq", "clock_on_first", "critical_missing", "datagrams",
                 "delivered_count", "duplicates", "early_stop", "final_seen", "first_heard",
                 "granted", "heard", "max_tseq", "need", "parked", "payload_bytes", "probes",
                 "retransmit_rounds", "unacked")

    def __init__(self) -> None:
        self.datagrams = 0  # DATA datagrams, duplicates included
        self.payload_bytes = 0
        self.duplicates = 0
        self.delivered_count = 0
        self.max_tseq = -1  # the highest transmission sequence seen
        self.unacked = 0  # DATA datagrams since the last ACK
        self.critical_missing = 0
        self.need = 0  # chunks the plan needs
        #: a met bound may stop the transfer before every chunk is in (the sender sent
        #: everything once, or the acceptance deadline passed)
        self.early_stop = False
        self.accepting = False  # the acceptance deadline passed: a met plan closes for it
        self.heard = False  # a DATA or PROBE of the message has arrived
        self.first_heard = 0.0  # when (once heard)
        #: the first datagram starts a clock of the plan's (accept_from_first): the
        #: receive's, which the Python core arms
        self.clock_on_first = False
        # PROBEs: how many came, the passes they found chunks missing after, the seq of
        # the last one answered, and whether a FINAL one came (every chunk sent once)
        self.probes = 0
        self.retransmit_rounds = 0
        self.answered_seq = -1
        self.final_seen = False
        #: under credit: waiting for a share of the budget, its ACKs grant nothing
        #: (CreditGrants)
        self.parked = False
        #: under credit: what the latest ACK granted the sender, which its ACKs keep
        #: pace with (credit.ack_cadence; -1: none yet - the first DATA is ACKed at once)
        self.granted = -1


@functools.lru_cache(maxsize=16)
def _chunk_dtypes(cb: int) -> tuple[np.dtype, np.dtype]:
    """A chunk of ``cb`` bytes as one numpy item, and a datagram's payload as the field
    ``p`` of an item a datagram long (its header skipped)."""
    return np.dtype(f"V{cb}"), np.dtype({"names": ["p"], "formats": [f"V{cb}"],
                                         "offsets": [HEADER_BYTES],
                                         "itemsize": HEADER_BYTES + cb})


@functools.lru_cache(maxsize=64)
def _ack_template(session: int, count: int, nbytes: int, chunk_bytes: int,
                  credit: bool) -> bytes:
    """MessageReceiver.ack_template's bytes for round and message 0 (the receives of one
    size share them, every round: each writes its own ids into a copy)."""
    header = wire.Header(Kind.ACK, session, 0, 0, 0, count, nbytes, chunk_bytes)
    return wire.control_datagram(header, Kind.ACK, 0, STOP_PAYLOAD.pack(0),
                                 Flag.CREDIT if credit else Flag.NONE)


class ReceiveGeometry:
    """What a receive's size alone decides, once the size is known: its chunks, its ACK
    cadence, what its policy is told and plans, and the headers of its control datagrams
    (the BITMAP header the others are built from, and its ACK's bytes, ids included).
    Receives posted together - one message from many peers at one instant - share one
    per size (``ReceiveBatch``)."""

    __slots__ = ("ack", "ack_every", "config", "count", "header", "info", "plan", "policy")

    def __init__(self, receiver: MessageReceiver, count: int, nbytes: int,
                 critical_count: int):
        cb, config = receiver.chunk_bytes, receiver.config
        self.config = config
        self.count = count
        self.ack_every = config.ack_every_for(count)
        self.info = MessageInfo(receiver.round_id, receiver.message_id, count, nbytes, cb,
                                critical_count)
        self.policy = receiver.policy
        self.plan = receiver.policy.plan(self.info)
        self.header = wire.Header(Kind.BITMAP, receiver.session, receiver.round_id,
                                  receiver.message_id, 0, count, nbytes, cb)
        ack = bytearray(_ack_template(receiver.session, count, nbytes, cb,
                                      receiver.grants is not None))
        _ROUND_MESSAGE.pack_into(ack, _ROUND_AT, receiver.round_id, receiver.message_id)
        self.ack = bytes(ack)


class ReceiveBatch:
    """Receives posted at one instant share their ``ReceiveGeometry`` by size: the policy
    plans once per size and batch - a round's decision, not a message's. That is the plan
    each would have had: nothing happens between the posts of a batch, and a policy's
    plan is a function of the message's info and of the policy's state, which moves
    only between rounds for a policy that does not learn from outcomes. A policy that
    does (``observe``) plans each receive itself, as do receives with a critical mask
    (their info differs by it)."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[tuple, ReceiveGeometry] = {}

    def geometry(self, receiver: MessageReceiver, count: int, nbytes: int) -> ReceiveGeometry:
        """The geometry of ``receiver``'s size (one with no critical mask, of a policy
        that does not learn), shared with the batch's others of that size."""
        # (one config: one chunk size, credit or not)
        key = (receiver.session, receiver.round_id, receiver.message_id, nbytes)
        shared = self._by_key.get(key)
        if (shared is None or shared.policy is not receiver.policy
                or shared.config is not receiver.config):
            shared = self._by_key[key] = ReceiveGeometry(receiver, count, nbytes, 0)
        return shared


#: a header's round and message fields, which lie side by side
_ROUND_MESSAGE = struct.Struct("<II")
_ROUND_AT = wire.OFFSET["round"]
assert wire.OFFSET["message"] == _ROUND_AT + 4


class MessageReceiver:
    # (slots: a dict of this many attributes was 1.7 KB a receive, and a simulated job
    # holds millions of them open)
    __slots__ = (
        "peer", "path", "grants", "transfer_id", "session", "round_id", "message_id",
        "policy", "config", "opened", "hard_deadline", "chunk_bytes", "_critical_arg",
        "_out", "nbytes", "count", "plan", "result", "_state", "counts", "ack_every",
        "accept_deadline", "first_pass_delivered", "stop", "_delivered", "_run_views",
        "info", "_header", "_dest", "_critical", "_ack_bytes",
    )

    def __init__(
        self,
        *,
        peer: Hashable,
        session: int,
        round_id: int,
        message_id: int,
        policy: Policy,
        config: TransportConfig,
        now: float,
        out: np.ndarray | None = None,
        nbytes: int | None = None,
        critical: np.ndarray | None = None,
        path: PeerPath | None = None,
        transfer_id: int = 0,
        grants: CreditGrants | None = None,
        counts=None,
        batch: ReceiveBatch | None = None,
    ):
        """``counts``: a fresh object with ``ReceiveCounts``' fields and initial values to
        keep them in (a compiled data path's ``Receive``, which takes the receive's DATA
        with them); a ReceiveCounts by default. ``batch``: the receives
        posted with this one, whose geometry and plan it shares (``ReceiveBatch``)."""
        self.peer = peer
        self.path = path if path is not None else PeerPath(peer)
        #: the endpoint's credit budget this receive shares once heard (None: no credit)
        self.grants = grants
        self.transfer_id = transfer_id
        self.session = session
        self.round_id = round_id
        self.message_id = message_id
        self.policy = policy
        self.config = config
        self.opened = now
        self.hard_deadline = now + config.receive_deadline
        self.chunk_bytes = config.chunk_bytes
        self._critical_arg = critical
        self._out = out
        if out is not None:
            if (not isinstance(out, np.ndarray) or not out.flags.c_contiguous
                    or not out.flags.writeable):
                raise ValueError("out must be a writeable C-contiguous numpy array")
            if nbytes is not None and nbytes != out.nbytes:
                raise ValueError(f"nbytes {nbytes} != out.nbytes {out.nbytes}")
            nbytes = out.nbytes
        elif critical is not None and nbytes is None:
            raise ValueError("a critical mask needs the message size (nbytes or out)")
        self.nbytes: int | None = nbytes
        self.count = 0
        self.plan: ClosePlan | None = None
        self.result: ReceiveResult | None = None
        self._state = ReceiveState.SIZELESS
        #: the per-datagram counters (shared with the compiled data path when it takes
        #: this receive's DATA)
        self.counts: ReceiveCounts = ReceiveCounts() if counts is None else counts
        #: DATA datagrams per ACK (TransportConfig.ack_every_for the message's chunks)
        self.ack_every: int
        self.accept_deadline: float | None = None
        #: chunks in when the sender had sent every chunk once (see TransferStats)
        self.first_pass_delivered: int | None = None
        self.stop: bytes | None = None
        if nbytes is not None:
            self._open(nbytes, batch)
        else:
            self.ack_every = config.ack_every_for(0)  # (until the size is known)

    # ------------------------------------------------------------------- state
    @property
    def state(self) -> ReceiveState:
        return self._state

    def _transition(self, event: ReceiveEvent) -> None:
        try:
            self._state = _TRANSITIONS[(self._state, event)]
        except KeyError:
            raise AssertionError(f"receive: no transition from {self._state} on {event}") \
                from None
        counts = self.counts
        counts.early_stop = self._state in _EARLY_STOP
        counts.accepting = self._state is ReceiveState.ACCEPTING

    # ---------------------------------------------------------------- geometry
    def _open(self, nbytes: int, batch: ReceiveBatch | None = None) -> None:
        """Fix the geometry, allocate the destination if needed, ask the policy (or take
        the plan ``batch`` holds for this size)."""
        cb = self.chunk_bytes
        self.nbytes = nbytes
        self.count = count = wire.chunk_count(nbytes, cb)
        if self._out is None:
            self._out = np.empty(nbytes, dtype=np.uint8)
            self._dest = self._out.data  # (flat bytes already)
        else:
            self._dest = wire.as_bytes_view(self._out)
        self._delivered = bytearray(count)
        #: numpy twins of the two, for runs of datagrams taken at once (data_run): made
        #: by its first run (a compiled data path takes the runs instead)
        self._run_views: tuple[np.ndarray, np.ndarray, np.dtype] | None = None
        crit = self._critical_arg
        if crit is not None:
            crit = np.asarray(crit, dtype=bool)
            if crit.shape != (count,):
                raise ValueError(f"critical mask must have one entry per chunk ({count})")
            self._critical: bytearray | None = bytearray(crit.astype(np.uint8).tobytes())
            self.counts.critical_missing = int(crit.sum())
        else:
            self._critical = None
            self.counts.critical_missing = 0
        if batch is None or crit is not None or learns(self.policy):
            geometry = ReceiveGeometry(self, count, nbytes, self.counts.critical_missing)
        else:
            geometry = batch.geometry(self, count, nbytes)
        self.ack_every = geometry.ack_every
        self.info = geometry.info
        self.plan = plan = geometry.plan
        self._header = geometry.header
        self._ack_bytes = geometry.ack
        self.counts.need = min(plan.min_delivered, count)
        self.counts.clock_on_first = plan.accept_after is not None and plan.accept_from_first
        self.accept_deadline = (
            None if plan.accept_after is None or plan.accept_from_first
            else self.opened + plan.accept_after
        )  # (accept_from_first: armed by _heard when the first datagram arrives)
        self._transition(ReceiveEvent.SIZED)


    def geometry_matches(self, mbytes: int, cbytes: int, now: float, out: list) -> bool:
        """Check (or, for a receive posted without a size, adopt) a datagram's geometry."""
        if self.nbytes is None:
            if cbytes != self.chunk_bytes or mbytes > self.config.max_message_bytes:
                return False
            self._open(mbytes)
            self.close_if_done(now, out)  # a zero-chunk plan is met at once
            return True
        return mbytes == self.nbytes and cbytes == self.chunk_bytes

    # ---------------------------------------------------------------- incoming
    def data_received(self, index: int, plen: int, tseq: int, data, now: float,
                      out: list) -> None:
        """One validated DATA datagram (``data`` is the whole datagram)."""
        n = self.counts
        if not n.heard:
            self._heard(now)
        n.datagrams += 1
        n.payload_bytes += plen
        if tseq > n.max_tseq:
            n.max_tseq = tseq
        n.unacked += 1
        if n.unacked >= self._ack_cadence():
            n.unacked = 0
            out.append(((self._ack(n.delivered_count),), self.peer))
        delivered = self._delivered
        if delivered[index]:
            n.duplicates += 1
            return
        off = index * self.chunk_bytes
        # Bounds are exact: wire.parse checked plen against index and geometry, and
        # geometry_matches checked the geometry against this buffer.
        self._dest[off : off + plen] = data[HEADER_BYTES : HEADER_BYTES + plen]
        delivered[index] = 1
        n.delivered_count += 1
        crit = self._critical
        if crit is not None and crit[index]:
            n.critical_missing -= 1
        if n.delivered_count >= n.need and not n.critical_missing and self._may_stop():
            self._close(self._reason_when_met(), now, out)

    def data_run(self, index: np.ndarray, tseq: np.ndarray, rows: np.ndarray, now: float,
                 out: list) -> None:
        """A run of validated DATA datagrams of full chunks at once (``rows[i]`` is the
        whole datagram of chunk ``index[i]``, at most RUN_MAX of them): the same outcome
        as ``data_received`` on each in turn, in whole-array steps - except that a met
        plan is checked once, at the end of the run, the ACKs the run is due go out
        together behind it, and of a chunk repeated within the run the last copy is
        kept (a sender's copies are the same bytes)."""
        n = self.counts
        if not n.heard:
            self._heard(now)
        k = index.size
        cb = self.chunk_bytes
        n.datagrams += k
        n.payload_bytes += k * cb
        top = int(tseq.max())
        if top > n.max_tseq:
            n.max_tseq = top
        if self._run_views is None:
            # (as items of cb bytes: numpy copies a uint8 row byte by byte, an item at once)
            chunk, payload_item = _chunk_dtypes(cb)
            self._run_views = (np.frombuffer(self._delivered, dtype=np.uint8),
                               np.frombuffer(self._dest, dtype=chunk,
                                             count=self._dest.nbytes // cb), payload_item)
        flags, full_chunks, payload_item = self._run_views
        pos = np.flatnonzero(flags[index] == 0)  # datagrams of chunks not yet delivered
        if pos.size:
            # A chunk twice in the run: mark each datagram's chunk with its position;
            # the last mark written survives, once per chunk.
            marks = _MARKS[: pos.size]
            flags[index[pos]] = marks
            pos = pos[flags[index[pos]] == marks]
            new = index[pos]
            full_chunks[new] = rows.view(payload_item)["p"][pos, 0]
            flags[new] = 1
            n.delivered_count += new.size
            if self._critical is not None:
                n.critical_missing -= int(
                    np.frombuffer(self._critical, dtype=np.uint8)[new].sum())
        n.duplicates += k - pos.size
        acks, n.unacked = divmod(n.unacked + k, self._ack_cadence())
        if acks and n.granted < 0:  # (the first grant: one ACK, and the pace from it)
            acks, n.unacked = 1, 0
        if acks:
            # (an ACK holds what was delivered before the datagram that drew it: the
            # sender reads forward loss from it, and reverse loss from how many came)
            last_new = bool(pos.size) and pos[-1] == k - 1
            out.extend([((self._ack(n.delivered_count - last_new),), self.peer)] * acks)
        self.close_if_done(now, out)

    def _ack_cadence(self) -> int:
        """DATA per ACK: the message's own, or under credit, as the sender's latest grant
        calls for (its next ACK may grant another share)."""
        if self.grants is None:
            return self.ack_every
        return ack_cadence(self.ack_every, self.counts.granted)

    def _ack(self, delivered: int) -> bytes:
        """An ACK: the highest transmission sequence seen, ``delivered`` and, under
        credit, the sender's share."""
        grants = self.grants
        if grants is None:
            return wire.control_datagram(self._header, Kind.ACK, 0,
                                         STOP_PAYLOAD.pack(delivered), tseq=self.counts.max_tseq)
        credit = self.counts.granted = grants.credit(self)
        # (a PROBE's answer may come before any DATA: what was sent before it is lost)
        return wire.control_datagram(self._header, Kind.ACK, credit,
                                     STOP_PAYLOAD.pack(delivered), Flag.CREDIT,
                                     max(0, self.counts.max_tseq))

    def _credit_done(self, out: list, now: float) -> None:
        """This receive needs no more credit: tell each receive it passes to, by an ACK."""
        if self.grants is not None:
            for granted in self.grants.receive_done(self, now):
                granted.send_grant(out)

    def send_grant(self, out: list) -> None:
        """Tell the sender what it may send now: an ACK, with its credit."""
        out.append(((self._ack(self.counts.delivered_count),), self.peer))

    def ack_template(self) -> bytes:
        """An ACK of this receive with tseq, the delivered count and any credit zero (the
        compiled data path writes them into a copy)."""
        return self._ack_bytes

    def buffers(self) -> tuple[memoryview, bytearray, bytearray | None]:
        """What a data path writes and reads: the destination's bytes, a flag byte per
        chunk (1: delivered) and, with a critical mask, a flag byte per chunk (1:
        critical). Only once the size is known."""
        if self.nbytes is None:
            raise ValueError("the receive's size is not known yet")
        return self._dest, self._delivered, self._critical

    def delivered_mask(self) -> np.ndarray:
        """Bool per chunk: which chunks have arrived so far (empty before the size is known)."""
        if self.nbytes is None:
            return np.zeros(0, dtype=bool)
        # (a flag is 0 or 1 between datagrams: its bytes are bools already)
        return np.frombuffer(self._delivered, dtype=np.bool_).copy()

    def loss_seen(self) -> float | None:
        """The fraction of the sender's DATA transmissions that never arrived, as far as
        their sequence numbers tell (None: too few to tell). It is the loss on the way
        from that peer - the way *our* answers to its PROBEs take when we send to it."""
        n = self.counts
        sent = n.max_tseq + 1
        if sent < 2 * self.ack_every:
            return None
        return max(0.0, 1.0 - n.datagrams / sent)

    def probe_received(self, seq: int, flags: int, now: float, out: list) -> None:
        """Answer with the BITMAP segments that still hold missing chunks - or, once the
        sender has sent everything once and the plan is met, with STOP."""
        n = self.counts
        if not n.heard:
            self._heard(now)
        n.probes += 1
        if flags & Flag.FINAL:
            if self.first_pass_delivered is None:  # (later passes' PROBEs are FINAL too)
                self.first_pass_delivered = n.delivered_count
                n.final_seen = True
                self._credit_done(out, now)
            self._transition(ReceiveEvent.SENDER_DONE)
            self.close_if_done(now, out)
            if self._state is ReceiveState.CLOSED:
                return
        if self.grants is not None:
            # (the grant again: a sender whose window stays shut PROBEs - its grant, or
            # the ACK that would have freed it, may have been lost)
            out.append(((self._ack(n.delivered_count),), self.peer))
        packed = np.packbits(np.frombuffer(self._delivered, dtype=np.uint8), bitorder="little")
        if self.count & 7:  # bits past the last chunk read as delivered
            packed[-1] |= np.uint8((0xFF << (self.count & 7)) & 0xFF)
        seg = max(8, self.chunk_bytes - BITMAP_PREFIX.size)
        n_seg = -(-packed.size // seg)
        padded = np.full(n_seg * seg, 0xFF, dtype=np.uint8)
        padded[: packed.size] = packed
        has_missing = np.flatnonzero((padded.reshape(n_seg, seg) != 0xFF).any(axis=1))
        if seq != n.answered_seq and has_missing.size:
            n.retransmit_rounds += 1
        n.answered_seq = seq
        prefix = BITMAP_PREFIX.pack(seq, n.delivered_count)
        last = int(has_missing[-1]) if has_missing.size else -1
        for s in has_missing.tolist():
            lo = s * seg
            hi = min(lo + seg, packed.size)
            out.append(((wire.control_datagram(
                self._header, Kind.BITMAP, s * seg * 8, prefix + packed[lo:hi].tobytes(),
                Flag.FINAL if s == last else Flag.NONE),), self.peer))

    @property
    def probes(self) -> int:
        """PROBEs received for the message."""
        return self.counts.probes

    @property
    def retransmit_rounds(self) -> int:
        """Passes after which a PROBE's answer reported chunks missing."""
        return self.counts.retransmit_rounds

    @property
    def first_heard(self) -> float | None:
        """When the message's first DATA or PROBE arrived (None: not yet)."""
        return self.counts.first_heard if self.counts.heard else None

    def _heard(self, now: float) -> None:
        """The first datagram of the message: start a plan's arrival-relative clock."""
        self.counts.first_heard = now
        self.counts.heard = True
        if self.grants is not None:
            self.grants.receive_heard(self)
        plan = self.plan
        if plan is not None and plan.accept_after is not None and plan.accept_from_first:
            self.accept_deadline = now + plan.accept_after

    # ------------------------------------------------------------------ timers
    def next_deadline(self) -> float | None:
        if self._state is ReceiveState.CLOSED:
            return None
        t = self.hard_deadline
        if self.accept_deadline is not None and self.accept_deadline < t:
            t = self.accept_deadline
        return t

    def timer_fired(self, now: float, out: list) -> None:
        if self._state is ReceiveState.CLOSED:
            return
        if now >= self.hard_deadline:
            self._close(CloseReason.DEADLINE, now, out)
        elif self.accept_deadline is not None and now >= self.accept_deadline:
            # Accept what has arrived - once every critical chunk is among it.
            self.accept_deadline = None
            self._transition(ReceiveEvent.ACCEPT_DEADLINE)
            self.counts.need = 0
            self.close_if_done(now, out)

    def cancel(self, now: float, out: list) -> None:
        if self._state is not ReceiveState.CLOSED:
            self._close(CloseReason.CANCELLED, now, out)

    # ------------------------------------------------------------------- close
    @property
    def delivered_count(self) -> int:
        return self.counts.delivered_count

    def _reason_when_met(self) -> CloseReason:
        if self.counts.delivered_count == self.count:
            return CloseReason.COMPLETE
        return (CloseReason.ACCEPT_DEADLINE if self._state is ReceiveState.ACCEPTING
                else CloseReason.BOUND_MET)

    def _may_stop(self) -> bool:
        """A met bound stops the transfer only once nothing more is on its way: every
        chunk is in, or the sender has sent everything once (its PROBE says so), or the
        acceptance deadline passed. Cutting a first pass short would throw away data
        that costs nothing to receive; the bound is there to skip *retransmissions*."""
        n = self.counts
        return n.delivered_count == self.count or n.early_stop or n.need == 0

    def close_if_done(self, now: float, out: list) -> None:
        """Close (and say STOP) if the plan is met and nothing more is on its way."""
        if self._state in (ReceiveState.SIZELESS, ReceiveState.CLOSED):
            return  # (sizeless: no plan until the first datagram)
        n = self.counts
        if (
            n.delivered_count >= n.need
            and not n.critical_missing
            and self._may_stop()
        ):
            self._close(self._reason_when_met(), now, out)

    def close_is_routine(self) -> bool:
        """Whether closing this receive when a DATA meets its plan decides nothing: no
        credit to pass on, a policy that learns nothing from the outcome. A data path may
        then close it itself (``Receive.close_here``), and the core only records it
        (``closed_by_data_path``)."""
        return self.grants is None and not learns(self.policy)

    def closed_by_data_path(self, reason: CloseReason, stop: bytes, now: float) -> None:
        """A data path took the DATA that met the plan of this receive (one whose close is
        routine) and closed it itself, saying ``stop``: the result, as ``_close`` makes it."""
        self._transition(ReceiveEvent.CLOSED)
        self._record(reason, now)
        self.stop = stop

    def _close(self, reason: CloseReason, now: float, out: list) -> None:
        self._transition(ReceiveEvent.CLOSED)
        self._credit_done(out, now)
        self._record(reason, now)
        if self.nbytes is not None and reason != CloseReason.CANCELLED:
            # (a cancelled receive says nothing: its sender is not done, a receive
            # posted again for the same message will take over)
            n = self.counts
            self.stop = wire.stop_datagram(self._header, reason, n.delivered_count)
            out.append(((self.stop,), self.peer))
            if learns(self.policy):
                self.policy.observe(Outcome(
                    info=self.info,
                    delivered=n.delivered_count,
                    elapsed=now - self.opened,
                    close_reason=reason,
                    retransmit_rounds=n.retransmit_rounds,
                    active=None if self.first_heard is None else now - self.first_heard,
                ))

    def _record(self, reason: CloseReason, now: float) -> None:
        """The result of the receive, closed now for ``reason``, and what the path learns."""
        count = self.count
        delivered = self.delivered_mask()
        n = self.counts
        stats = TransferStats(
            datagrams=n.datagrams,
            payload_bytes=n.payload_bytes,
            chunks=count,
            delivered=n.delivered_count,
            retransmit_rounds=n.retransmit_rounds,
            retransmitted=n.duplicates,
            probes=n.probes,
            elapsed=now - self.opened,
            started=self.opened,
            first_pass_delivered=(n.delivered_count if self.first_pass_delivered is None
                                  else self.first_pass_delivered),
        )
        data = self._out if self._out is not None else np.empty(0, dtype=np.uint8)
        self.result = make_frozen(
            ReceiveResult,
            peer=self.peer,
            round_id=self.round_id,
            message_id=self.message_id,
            data=data,
            delivered=delivered,
            chunk_bytes=self.chunk_bytes,
            close_reason=reason,
            bound=self.plan.bound if self.plan is not None else 0.0,
            stats=stats,
            transfer_id=self.transfer_id,
        )
        self.path.receive_closed(self.loss_seen(), now)

