"""TransferMux: every send and receive of one endpoint, demultiplexed by header.

Sans-I/O: an adapter (real UDP socket, FakeNetwork, simulator) feeds it datagrams with
``datagram_received(data, peer, now)``, calls ``timer_fired(now)`` at ``next_deadline()``,
and sends what ``poll(now)`` hands back. It validates every datagram (``wire.parse``),
routes it to its MessageSender or MessageReceiver by ``(peer, round, message)``, and
counts - never raises - anything it drops. Datagrams for messages nobody posted
allocate nothing; a receive must be posted (``start_receive``) to be accepted.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Hashable
from typing import Protocol

import numpy as np

from .. import wire
from ..policy.base import Policy
from ..wire import (
    CARRIED_PROBE_SEQ,
    CLOSE_REASONS,
    FLAGS_SLICE,
    HEADER_BYTES,
    INDEX_WORD,
    PASS_INVARIANT_MASK,
    STOP_PAYLOAD,
    TSEQ_WORD,
    DropReason,
    Flag,
    Kind,
    MalformedDatagram,
)
from .auth import TRAILER_BYTES, DatagramAuth
from .credit import CreditGrants
from .loss_prior import LossPrior
from .path import PeerPath
from .receiver import RUN_MAX, MessageReceiver, ReceiveBatch
from .rtt_prior import RttPrior
from .sender import MessageSender, SendBatch
from .types import (
    DataRun,
    ReceiveResult,
    SendResult,
    TooManyReceives,
    TransportConfig,
    TransportError,
)

#: datagrams one sender hands out per turn in a poll for runs: a DataRun costs one step
#: of Python whatever its length, and a turn of 512 full datagrams (0.7 MB) still lets
#: many senders share the socket fairly
RUN_TURN = 512
#: a run shorter than this goes datagram by datagram: the whole-array steps cost about
#: as much as 16 datagrams one by one
RUN_MIN = 16
#: the byte of a header whose low bits hold the flags DATA may carry
FLAGS_AT = FLAGS_SLICE.start
#: as a plain int: ``int & IntFlag`` goes through enum's Python code (0.5 us a DATA)
_PROBE_CARRIED = int(Flag.PROBE_CARRIED)


class DataPath(Protocol):
    """A compiled data path that takes DATA for open receives, and the ACKs for open
    sends, off the core's hands (``boundedloss.net.native``). The mux tells it which
    receives and sends are open; it tells the mux when a DATA it took met a receive's
    plan (``receive_met``) or carried its sender's first PROBE (``probe_carried``), and
    what a STOP for an open send said (``stop_arrived``) - or, for a receive whose close
    is routine, that it closed the receive itself (``closed_by_data_path``)."""

    def new_counts(self, peer) -> object | None:
        """A fresh counters object for a receive from ``peer`` to keep its counts in
        (MessageReceiver's ``counts``), one the data path can take the receive's DATA
        with; None: a ReceiveCounts."""
        ...

    def receive_opened(self, receiver: MessageReceiver) -> None: ...

    def receive_closed(self, receiver: MessageReceiver, remembered_at: float | None) -> None:
        """The receive closed; ``remembered_at``: the time from which the mux remembers it
        (its STOP to be said again to what still comes for it), or None if it does not."""
        ...

    def forget_closed(self, key: tuple) -> None:
        """The mux no longer remembers the closed receive ``(peer, round, message)``."""
        ...

    def new_acks(self, peer) -> object | None:
        """A fresh object for a send to ``peer`` to keep what its ACKs move in
        (MessageSender's ``shared_acks``), one the data path can take its ACKs with;
        None: an AckState."""
        ...

    def send_opened(self, sender: MessageSender) -> None: ...

    def send_closed(self, sender: MessageSender) -> None: ...

    def counters(self) -> dict[str, int]:
        """What it counted, by the mux's counter names (datagrams_in, drop reasons)."""
        ...

    def seal(self, parts: tuple, peer) -> tuple:
        """``parts`` with the trailer authentication puts on a datagram to ``peer`` (as
        ``DatagramAuth.seal``), when the mux authenticates."""
        ...


class _Closed:
    """What is kept of a closed receive: its STOP, to be sent again when asked."""

    __slots__ = ("stop", "last_sent")

    def __init__(self, stop: bytes | None, now: float):
        self.stop = stop
        self.last_sent = now


def in_turn(open_sends: dict[tuple, MessageSender], active: dict[int, MessageSender],
            turn: int) -> list[MessageSender]:
    """The open sends that are active (``active``: by transfer id), in turn from the one
    at position ``turn`` of ``open_sends`` (by (peer, round, message), in the order of
    their transfer ids: each new one has the next id and goes last). Found from the
    active ones' ids, not by walking every open send - a simulated rank of a large world
    has thousands, and polls at every datagram."""
    pivot = next(itertools.islice(open_sends.values(), turn, None)).transfer_id
    ids = sorted(active)
    at = bisect.bisect_left(ids, pivot)
    return [tx for tx in map(active.__getitem__, ids[at:] + ids[:at])
            if open_sends.get((tx.peer, tx.round_id, tx.message_id)) is tx]


class TransferMux:
    def __init__(self, session: int, config: TransportConfig | None = None, *,
                 auth: DatagramAuth | None = None):
        if not 0 <= session < 1 << 64:
            raise ValueError("session token must be a 64-bit unsigned integer")
        self.session = session
        self.config = config or TransportConfig()
        #: seals what goes out and opens what comes in (None: no authentication)
        self.auth = auth
        self._senders: dict[tuple, MessageSender] = {}
        self._receivers: dict[tuple, MessageReceiver] = {}
        self._closed: OrderedDict[tuple, _Closed] = OrderedDict()
        #: control datagrams waiting for poll, as ``(parts, peer)`` (one list for the
        #: endpoint's life: a data path appends the ACKs it builds to it - sealed
        #: already when authenticating, and then marked so: ``(parts, peer, True)``)
        self.outbox: list = []
        #: the compiled data path taking DATA for open receives, if one is attached
        self.data_path: DataPath | None = None
        self.run_min = RUN_MIN  # (a tuning; the tests lower it to try every run length)
        self._paths: dict[Hashable, PeerPath] = {}
        #: what the sends lost lately, over every peer: a short pass's loss is read
        #: against it (loss_prior.py)
        self.loss_prior = LossPrior()
        #: the round trips the sends measured, over every peer: what a send on a path
        #: with none of its own yet waits for a PROBE's answer (rtt_prior.py)
        self.rtt_prior = RttPrior()
        self._cold_probes_taken = False  # (the PROBEs out when it was first known, once)
        self._finished: list[SendResult | ReceiveResult] = []  # since pop_finished
        self._transfer_ids = itertools.count(1)
        self._turn = 0  # rotates which sender polls first, so none always goes first
        # Timers: a heap of (deadline, order, transfer), at most as late as each open
        # transfer's next deadline - a transfer's deadline moves earlier only in a call
        # through the mux, which pushes it again (_rearm); moved later (an ACK the
        # compiled path took), its entry is found stale at the top and pushed again.
        self._timers: list[tuple[float, int, MessageSender | MessageReceiver]] = []
        self._timer_order = itertools.count()
        self._armed: dict[int, float] = {}  # transfer_id -> the deadline pushed last
        #: the open sends a poll may change, by transfer_id: polls and has_output pass
        #: the others by - the finished and the quiet (MessageSender.quiescent). (Asked
        #: after every datagram a simulated host takes: open sends grow with the world.)
        self._active: dict[int, MessageSender] = {}
        self.drops: Counter[DropReason] = Counter()
        self.datagrams_in = 0
        #: datagrams a data path took and handed the core the decision of (receive_met,
        #: stop_arrived) or the result to record of (closed_by_data_path)
        self.decisions_in = 0
        #: sends finished, and of them those whose first PROBE their last DATA carried
        self.sends_finished = 0
        self.probes_carried = 0
        budget = self.config.credit_datagrams
        #: the receiver-driven first pass's budget and shares (None: no credit)
        self.grants = (None if budget is None
                       else CreditGrants(budget, adaptive=self.config.credit_adaptive))

    # ---------------------------------------------------------------- posting
    def path(self, peer: Hashable) -> PeerPath:
        """What this endpoint has learned about the path to and from ``peer``."""
        path = self._paths.get(peer)
        if path is None:
            path = self._paths[peer] = PeerPath(peer, self.config.delay_loop)
        return path

    def start_send(self, peer, round_id: int, message_id: int, payload, now: float, *,
                   critical: np.ndarray | None = None,
                   batch: SendBatch | None = None) -> MessageSender:
        """``batch``: the sends posted at this instant with this one, which share its
        geometry by size (``SendBatch``)."""
        key = (peer, round_id, message_id)
        if key in self._senders:
            raise TransportError(f"message {key} is already being sent")
        sender = MessageSender(
            peer=peer, session=self.session, round_id=round_id, message_id=message_id,
            payload=payload, config=self.config, now=now, critical=critical,
            path=self.path(peer), transfer_id=next(self._transfer_ids),
            loss_prior=self.loss_prior, rtt_prior=self.rtt_prior,
            shared_acks=None if self.data_path is None else self.data_path.new_acks(peer),
            batch=batch,
        )
        if self.data_path:  # (before the send is the mux's: it fails whole if this fails)
            try:
                self.data_path.send_opened(sender)
            except BaseException:
                sender.cancel(now)  # (it holds a share of its peer's rate until done)
                raise
        self._senders[key] = sender
        self._rearm(sender)
        return sender

    def start_receive(self, peer, round_id: int, message_id: int, now: float, *,
                      policy: Policy, out: np.ndarray | None = None,
                      nbytes: int | None = None,
                      critical: np.ndarray | None = None,
                      batch: ReceiveBatch | None = None) -> MessageReceiver:
        """``batch``: the receives posted at this instant with this one (of the same
        policy), which share its plan by size (``ReceiveBatch``)."""
        key = (peer, round_id, message_id)
        if key in self._receivers:
            raise TransportError(f"a receive for {key} is already open")
        if len(self._receivers) >= self.config.max_open_receives:
            raise TooManyReceives(
                f"{len(self._receivers)} receives already open "
                f"(max_open_receives={self.config.max_open_receives})"
            )
        if nbytes is not None and not 0 <= nbytes <= self.config.max_message_bytes:
            raise ValueError(f"nbytes must be 0..{self.config.max_message_bytes}")
        if self._closed.pop(key, None) is not None and self.data_path:
            self.data_path.forget_closed(key)
        receiver = MessageReceiver(
            peer=peer, session=self.session, round_id=round_id, message_id=message_id,
            policy=policy, config=self.config, now=now, out=out, nbytes=nbytes,
            critical=critical, path=self.path(peer), transfer_id=next(self._transfer_ids),
            grants=self.grants,
            counts=None if self.data_path is None else self.data_path.new_counts(peer),
            batch=batch,
        )
        self._receivers[key] = receiver
        try:
            receiver.close_if_done(now, self.outbox)  # a plan that needs nothing is met
            if receiver.result is None:
                if receiver.nbytes is not None and self.data_path:
                    self.data_path.receive_opened(receiver)
            else:
                self._reap_receive(receiver, now)
        finally:
            self._rearm(receiver)  # (its hard deadline, whatever happened)
        return receiver

    def cancel_send(self, sender: MessageSender, now: float) -> None:
        sender.cancel(now)
        self._reap_send(sender)
        self._rearm(sender)

    def cancel_receive(self, receiver: MessageReceiver, now: float) -> None:
        receiver.cancel(now, self.outbox)
        self._reap_receive(receiver, now)
        self._rearm(receiver)

    # --------------------------------------------------------------- incoming
    def datagram_received(self, data, peer, now: float) -> None:
        self.datagrams_in += 1
        if self.auth is not None:
            body = self._open(data, peer)
            if body is None:
                return
            data = body
        self._accept(data, peer, now)

    def authenticated_datagram_received(self, data, peer, now: float) -> None:
        """A datagram whose tag a data path has verified and removed already."""
        self.datagrams_in += 1
        self._accept(data, peer, now)

    def _open(self, data, peer):
        """``data`` without its trailer if its tag verifies; else None, the drop counted."""
        assert self.auth is not None
        body = self.auth.open(data, peer)
        if body is not None:
            return body
        if len(data) < HEADER_BYTES + TRAILER_BYTES:
            self.drops[DropReason.SHORT] += 1
        elif wire.peek_session(data) != self.session:
            self.drops[DropReason.FOREIGN_SESSION] += 1  # (another job's, most likely)
        else:
            self.drops[DropReason.BAD_AUTH] += 1
        return None

    def _accept(self, data, peer, now: float) -> None:
        try:
            kind, flags, plen, session, rnd, msg, idx, cnt, mbytes, cbytes, tseq = wire.parse(data)
        except MalformedDatagram as e:
            self.drops[e.reason] += 1
            return
        if session != self.session:
            self.drops[DropReason.FOREIGN_SESSION] += 1
            return
        key = (peer, rnd, msg)
        if kind == Kind.DATA or kind == Kind.PROBE:  # for one of our receives
            rx = self._receivers.get(key)
            if rx is None:  # (a DATA that carries a PROBE is answered as the PROBE)
                self._answer_closed(
                    key, Kind.PROBE if flags & _PROBE_CARRIED else kind, now)
                return
            if mbytes != rx.nbytes or cbytes != rx.chunk_bytes:
                sized = rx.nbytes is not None
                if not rx.geometry_matches(mbytes, cbytes, now, self.outbox):
                    self.drops[DropReason.GEOMETRY_MISMATCH] += 1
                    return
                if not sized and rx.result is None and self.data_path:
                    self.data_path.receive_opened(rx)  # it took the sender's size
            if rx.result is None:
                if kind == Kind.DATA:
                    rx.data_received(idx, plen, tseq, data, now, self.outbox)
                    if flags & _PROBE_CARRIED and rx.result is None:
                        rx.probe_received(CARRIED_PROBE_SEQ, Flag.FINAL, now, self.outbox)
                else:
                    rx.probe_received(idx, flags, now, self.outbox)
            if rx.result is not None:
                self._reap_receive(rx, now)
            self._rearm(rx)
        else:  # BITMAP / STOP / ACK: for one of our sends
            tx = self._senders.get(key)
            if tx is None:
                self.drops[DropReason.STALE] += 1
                return
            if mbytes != tx.nbytes or cbytes != tx.chunk_bytes:
                self.drops[DropReason.GEOMETRY_MISMATCH] += 1
                return
            payload = memoryview(data)[HEADER_BYTES:]
            if kind == Kind.BITMAP:
                tx.bitmap_received(flags, idx, payload, now)
            elif kind == Kind.ACK:
                tx.ack_received(tseq, STOP_PAYLOAD.unpack_from(payload)[0], now,
                                idx if flags & Flag.CREDIT else None)
            else:
                self._stopped(tx, idx, STOP_PAYLOAD.unpack_from(payload)[0], now)
                return
            self._rearm(tx)

    def _stopped(self, tx: MessageSender, reason: int, delivered: int, now: float) -> None:
        tx.stop_received(reason, delivered, now)
        self._reap_send(tx)
        self._rearm(tx)

    # (what a data path that parsed and routed a datagram already hands the core: the
    # decision its datagram would have called for, without the parse and routing)
    def stop_arrived(self, key: tuple, reason: int, delivered: int, now: float) -> None:
        """A valid STOP for the open send ``key`` (``(peer, round, message)``, of the
        send's geometry; counted in by the data path): as ``datagram_received`` would
        take it."""
        self.decisions_in += 1
        tx = self._senders.get(key)
        if tx is None:  # (a data path knows only the sends the mux opened)
            self.drops[DropReason.STALE] += 1
            return
        self._stopped(tx, reason, delivered, now)

    def probe_carried(self, key: tuple, now: float) -> None:
        """The open receive ``key`` took (through a data path that shares its counts) a
        DATA that carries its sender's first PROBE, and its plan is not met: the PROBE
        is answered, as ``datagram_received`` would answer it."""
        rx = self._decision_for(key)
        if rx is not None:
            rx.probe_received(CARRIED_PROBE_SEQ, Flag.FINAL, now, self.outbox)
            self._decided(rx, now)

    def receive_met(self, key: tuple, now: float) -> None:
        """The open receive ``key`` took (through a data path that shares its counts) the
        DATA that meets its plan: it closes, as ``datagram_received`` would close it."""
        rx = self._decision_for(key)
        if rx is not None:
            rx.close_if_done(now, self.outbox)
            self._decided(rx, now)

    def closed_by_data_path(self, closed: list[tuple], now: float) -> None:
        """Receives a data path closed itself, in order, each ``(peer, round, message,
        reason, stop)``: a DATA it took met the plan of a receive whose close is routine
        (``MessageReceiver.close_is_routine``), and it said ``stop``. Their results, as
        ``receive_met`` would have made them."""
        for peer, round_id, message_id, reason, stop in closed:
            rx = self._decision_for((peer, round_id, message_id))
            if rx is not None:
                rx.closed_by_data_path(CLOSE_REASONS[reason], stop, now)
                self._decided(rx, now)

    def _decision_for(self, key: tuple) -> MessageReceiver | None:
        """The open receive a data path handed a decision for (counted), or None."""
        self.decisions_in += 1
        rx = self._receivers.get(key)
        # (a data path takes DATA only for the receives the mux has open)
        return None if rx is None or rx.result is not None else rx

    def _decided(self, rx: MessageReceiver, now: float) -> None:
        if rx.result is not None:
            self._reap_receive(rx, now)
        self._rearm(rx)

    def run_received(self, data, size: int, peer, now: float, keep=None) -> None:
        """Datagrams that arrived back to back in ``data``, every one ``size`` bytes (a
        run coalesced by the kernel: UDP GRO); ``keep``: bool per datagram, False for
        those a loss model dropped. A run of DATA for one open receive - what a
        sender's pass is - is taken in whole-array steps; anything else datagram by
        datagram, exactly as ``datagram_received``."""
        n = len(data) // size
        rows = np.frombuffer(data, dtype=np.uint8, count=n * size).reshape(n, size)
        if keep is not None:
            rows = rows[np.asarray(keep, dtype=bool)]
            n = rows.shape[0]
        receive = self.datagram_received
        if self.auth is not None and n:
            rows = self._open_rows(rows, peer)
            receive = self.authenticated_datagram_received
        if rows.shape[0] and not self._take_run(rows, peer, now, receive):
            for row in rows:
                receive(row.data, peer, now)

    def _open_rows(self, rows: np.ndarray, peer) -> np.ndarray:
        """The rows whose tags verify, without their tags (the others counted)."""
        good = []
        for i, row in enumerate(rows):
            if self._open(row.data, peer) is None:
                self.datagrams_in += 1
            else:
                good.append(i)
        return rows[good, : rows.shape[1] - TRAILER_BYTES]  # (a copy, contiguous)

    def _take_run(self, rows: np.ndarray, peer, now: float, receive) -> bool:
        """Take ``rows`` as one run of DATA if that is what they are; False if not (nothing
        done). Every row shares its header with the first but for flags, index and tseq
        (a sender's pass), so checking the first checks them all but those."""
        n, size = rows.shape
        if n < max(2, self.run_min) or size <= HEADER_BYTES:
            return False
        heads = np.ascontiguousarray(rows[:, :HEADER_BYTES]).view("<u8")
        if ((heads[1:] ^ heads[0]) & PASS_INVARIANT_MASK).any():
            return False
        if (rows[:, FLAGS_AT] & _PROBE_CARRIED).any():
            return False  # (the PROBE one carries is answered in turn: one by one)
        head = rows[0]
        try:
            kind, _, plen, session, rnd, msg, _, cnt, mbytes, cbytes, _ = wire.parse(head.data)
        except MalformedDatagram:
            return False
        if kind != Kind.DATA or session != self.session or plen != cbytes:
            return False  # (a run of full chunks has every payload a whole chunk)
        rx = self._receivers.get((peer, rnd, msg))
        if rx is None or rx.result is not None or mbytes != rx.nbytes or cbytes != rx.chunk_bytes:
            return False
        words = heads.view("<u4")
        index, tseq = words[:, INDEX_WORD], words[:, TSEQ_WORD]
        full = mbytes // cbytes  # chunks that are a whole cbytes long
        if int(index.max()) >= full:
            return False  # not a chunk of full length: parse() says why, one by one
        self.datagrams_in += n
        for lo in range(0, n, RUN_MAX):
            if rx.result is None:
                rx.data_run(index[lo:lo + RUN_MAX], tseq[lo:lo + RUN_MAX], rows[lo:lo + RUN_MAX],
                            now, self.outbox)
            else:  # closed part-way: the rest is what one by one would find (stale)
                for row in rows[lo:]:
                    receive(row.data, peer, now)
                break
        if rx.result is not None:
            self._reap_receive(rx, now)
        self._rearm(rx)
        return True

    def _answer_closed(self, key, kind: int, now: float) -> None:
        closed = self._closed.get(key)
        if closed is None:
            self.drops[DropReason.UNKNOWN_MESSAGE] += 1
            return
        self.drops[DropReason.STALE] += 1
        # The sender has not heard our STOP: say it again - at once to a PROBE, at most
        # once per min_rto to the DATA still streaming in behind the first STOP.
        if closed.stop is not None and (
            kind == Kind.PROBE or now - closed.last_sent >= self.config.min_rto
        ):
            closed.last_sent = now
            self.outbox.append(((closed.stop,), key[0]))

    # ----------------------------------------------------------------- timers
    def next_deadline(self) -> float | None:
        if not self._cold_probes_taken and self.rtt_prior.known:
            self._take_endpoint_rtt()
        timers = self._timers
        while timers:
            at, _, transfer = timers[0]
            due = transfer.next_deadline()
            if due == at:
                return at
            heapq.heappop(timers)  # stale: moved later, or the transfer is done
            if due is None:
                self._armed.pop(transfer.transfer_id, None)
            elif self._armed.get(transfer.transfer_id) != due:
                self._push_timer(transfer, due)
        return None

    def _take_endpoint_rtt(self) -> None:
        """The endpoint's first round trip is known: the PROBEs out on paths of none time
        out as it calls for (rtt_prior.py) - their timers pulled in."""
        self._cold_probes_taken = True
        for sender in list(self._senders.values()):
            if sender.take_endpoint_rtt():
                self._rearm(sender)

    def timer_fired(self, now: float) -> None:
        timers = self._timers
        due: dict[int, MessageSender | MessageReceiver] = {}
        while timers and timers[0][0] <= now:
            _, _, transfer = heapq.heappop(timers)
            d = transfer.next_deadline()
            if d is None:
                self._armed.pop(transfer.transfer_id, None)
                continue
            if d <= now:
                due[transfer.transfer_id] = transfer
            elif self._armed.get(transfer.transfer_id) != d:
                self._push_timer(transfer, d)
        # (receives first, then sends, each in the order they were started)
        for _, transfer in sorted(due.items()):
            if isinstance(transfer, MessageReceiver):
                transfer.timer_fired(now, self.outbox)
                self._reap_receive(transfer, now)
                self._rearm(transfer)
        for _, transfer in sorted(due.items()):
            if isinstance(transfer, MessageSender):
                transfer.timer_fired(now)
                self._reap_send(transfer)
                self._rearm(transfer)

    def _rearm(self, transfer: MessageSender | MessageReceiver) -> None:
        """``transfer`` may have a new deadline, and a send may have fallen quiet or woken
        (a call through the mux changed it)."""
        if type(transfer) is MessageSender:
            if transfer.result is None and not transfer.quiescent():
                self._active[transfer.transfer_id] = transfer
            else:
                self._active.pop(transfer.transfer_id, None)
        d = transfer.next_deadline()
        if d is None:
            self._armed.pop(transfer.transfer_id, None)
        elif self._armed.get(transfer.transfer_id) != d:
            self._push_timer(transfer, d)

    def _push_timer(self, transfer: MessageSender | MessageReceiver, at: float) -> None:
        self._armed[transfer.transfer_id] = at
        heapq.heappush(self._timers, (at, next(self._timer_order), transfer))
        if len(self._timers) > 64 + 4 * (len(self._senders) + len(self._receivers)):
            self._rebuild_timers()

    def _rebuild_timers(self) -> None:
        """The heap again from the open transfers alone (its stale entries gone) - in
        place: a loop over it that pushed may go on with it."""
        self._armed.clear()
        timers = self._timers
        timers.clear()
        transfers: list[MessageSender | MessageReceiver] = [
            *self._receivers.values(), *self._senders.values()]
        for transfer in transfers:
            d = transfer.next_deadline()
            if d is not None:
                self._armed[transfer.transfer_id] = d
                timers.append((d, next(self._timer_order), transfer))
        heapq.heapify(timers)

    # --------------------------------------------------------------- outgoing
    def has_output(self) -> bool:
        return bool(self.outbox) or any(tx.has_data() for tx in self._active.values())

    def poll(self, now: float, limit: int = 1024, *, runs: bool = False,
             sealed: bool = True) -> list:
        """Up to ``limit`` datagrams to send now, as ``(parts, peer)`` with ``parts`` a
        tuple of buffers to be sent as one datagram (``socket.sendmsg`` gathers them
        without a copy). ``runs``: a sender's DATA comes as one ``DataRun`` per batch
        instead, for a data path that builds (and seals) the datagrams itself.
        ``sealed=False`` (authenticating): the control datagrams come as the core built
        them, for a data path that seals them as it sends them (its ``send_datagrams``
        with ``seal``) - those it sealed already (its ACKs) as ``(parts, peer, True)``."""
        out = self._poll(now, limit, runs)
        if self.auth is not None and sealed:
            # (a data path seals as the core would, without the core's per-call overhead)
            seal = self.auth.seal if self.data_path is None else self.data_path.seal
            out = [item if type(item) is DataRun
                   else (item[0], item[1]) if len(item) == 3  # (sealed by a data path)
                   else (seal(item[0], item[1]), item[1])
                   for item in out]
        return out

    def _poll(self, now: float, limit: int, runs: bool) -> list:
        out = self.outbox[:]
        self.outbox.clear()
        n = len(out)
        if n >= limit:
            return out
        if not self._senders:
            return out
        self._turn = (self._turn + 1) % len(self._senders)
        active = self._active
        if not active:  # (a poll of each open send would do nothing)
            return out
        senders = in_turn(self._senders, active, self._turn)
        batch = max(self.config.send_batch, RUN_TURN) if runs else self.config.send_batch
        progressed = True
        while progressed and n < limit:
            progressed = False
            for tx in senders:
                room = min(batch, limit - n)
                if room <= 0:
                    break
                sent = tx.poll(now, room, out, runs=runs)
                self._rearm(tx)  # (a probe's timer, a shut window's, pacing's)
                if sent:
                    n += sent
                    progressed = True
        return out

    # ------------------------------------------------------------- completion
    def _take_finished(self, table: dict, transfer: MessageSender | MessageReceiver) -> bool:
        """Move a finished transfer's result out of ``table``; False if it is not done."""
        key = (transfer.peer, transfer.round_id, transfer.message_id)
        if transfer.result is None or table.get(key) is not transfer:
            return False
        del table[key]
        self._finished.append(transfer.result)
        return True

    def _reap_send(self, sender: MessageSender) -> None:
        if sender.result is not None and self.data_path:
            self.data_path.send_closed(sender)
        if self._take_finished(self._senders, sender):
            self.sends_finished += 1
            self.probes_carried += sender.counts.probe_carried

    def _reap_receive(self, receiver: MessageReceiver, now: float) -> None:
        if not self._take_finished(self._receivers, receiver):
            return
        remember = self.config.closed_memory > 0
        if self.data_path:
            self.data_path.receive_closed(receiver, now if remember else None)
        if remember:
            key = (receiver.peer, receiver.round_id, receiver.message_id)
            self._closed[key] = _Closed(receiver.stop, now)
            self._closed.move_to_end(key)
            while len(self._closed) > self.config.closed_memory:
                forgotten, _ = self._closed.popitem(last=False)
                if self.data_path:
                    self.data_path.forget_closed(forgotten)

    @property
    def has_finished(self) -> bool:
        """Whether results wait to be popped (``pop_finished``)."""
        return bool(self._finished)

    def pop_finished(self) -> list[SendResult | ReceiveResult]:
        """The results of the sends and receives that finished since the last call (each
        carries the ``transfer_id`` of the MessageSender / MessageReceiver it ends)."""
        done, self._finished = self._finished, []
        return done

    @property
    def core_datagrams(self) -> int:
        """Datagrams whose handling reached the core: each it was handed, and each a data
        path handed it the decision of - what the simulator charges the core's CPU for."""
        return self.datagrams_in + self.decisions_in

    @property
    def open_receives(self) -> int:
        return len(self._receivers)

    @property
    def open_sends(self) -> int:
        return len(self._senders)

    def counters(self) -> dict[str, int]:
        """Datagrams in and dropped (by DropReason value), the data path's included; the
        sends finished, and how many of them carried their first PROBE."""
        d = {r.value: n for r, n in self.drops.items()}
        d["datagrams_in"] = self.datagrams_in
        d["sends_finished"] = self.sends_finished
        d["probes_carried"] = self.probes_carried
        if self.data_path:
            for name, n in self.data_path.counters().items():
                d[name] = d.get(name, 0) + n
        return d

