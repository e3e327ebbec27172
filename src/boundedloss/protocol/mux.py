"""TransferMux: every send and receive of one endpoint, demultiplexed by header.

Sans-I/O: an adapter (real UDP socket, FakeNetwork, simulator) feeds it datagrams with
``datagram_received(data, peer, now)``, calls ``timer_fired(now)`` at ``next_deadline()``,
and sends what ``poll(now)`` hands back. It validates every datagram (``wire.parse``),
routes it to its MessageSender or MessageReceiver by ``(peer, round, message)``, and
counts - never raises - anything it drops. Datagrams for messages nobody posted
allocate nothing; a receive must be posted (``start_receive``) to be accepted.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque

import numpy as np

from .. import wire
from ..policy.base import Policy
from ..wire import HEADER_BYTES, STOP_PAYLOAD, DropReason, Kind, MalformedDatagram
from .receiver import RUN_MAX, MessageReceiver
from .sender import MessageSender
from .types import TooManyReceives, TransportConfig, TransportError

#: delivery-rate samples kept per peer (a few messages' passes)
RATE_SAMPLES = 8
#: how long the loss a receive from a peer saw stands for the way back of sends to it
#: (a microburst lasts a round or so)
LOSS_MEMORY = 0.5
#: a run shorter than this goes datagram by datagram: the whole-array steps cost about
#: as much as 16 datagrams one by one (8,192-byte chunks make runs of 7)
RUN_MIN = 16
#: a run's header words that every datagram of a pass shares (all but the flags, the
#: chunk index and the transmission sequence), as masks of its six little-endian u64s
_ALL = (1 << 64) - 1
_RUN_SAME = np.array([0xFFFF_0000_FFFF_FFFF, _ALL, _ALL, 0xFFFF_FFFF_0000_0000, _ALL,
                      0x0000_0000_FFFF_FFFF], dtype="<u8")


class _Closed:
    """What is kept of a closed receive: its STOP, to be sent again when asked."""

    __slots__ = ("stop", "last_sent")

    def __init__(self, stop: bytes | None, now: float):
        self.stop = stop
        self.last_sent = now


class TransferMux:
    def __init__(self, session: int, config: TransportConfig | None = None):
        if not 0 <= session < 1 << 64:
            raise ValueError("session token must be a 64-bit unsigned integer")
        self.session = session
        self.config = config or TransportConfig()
        self._senders: dict[tuple, MessageSender] = {}
        self._receivers: dict[tuple, MessageReceiver] = {}
        self._closed: OrderedDict[tuple, _Closed] = OrderedDict()
        self._outbox: list = []  # control datagrams waiting for poll
        self.run_min = RUN_MIN  # (a tuning; the tests lower it to try every run length)
        self._loss_from: dict = {}  # peer -> (loss our last receive from it saw, when)
        self._finished: list = []  # senders/receivers that finished since pop_finished
        self._rtt: dict = {}  # peer -> (srtt, rttvar) learned by finished sends
        # peer -> the delivery-rate samples of its latest passes (the best one paces
        # the next message's retransmissions; old ones age out)
        self._rates: dict = {}
        self._turn = 0  # rotates which sender polls first, so none always goes first
        self.drops: Counter[DropReason] = Counter()
        self.datagrams_in = 0

    # ---------------------------------------------------------------- posting
    def start_send(self, peer, round_id: int, message_id: int, payload, now: float, *,
                   critical: np.ndarray | None = None) -> MessageSender:
        key = (peer, round_id, message_id)
        if key in self._senders:
            raise TransportError(f"message {key} is already being sent")
        sender = MessageSender(
            peer=peer, session=self.session, round_id=round_id, message_id=message_id,
            payload=payload, config=self.config, now=now, critical=critical,
            rtt=self._rtt.get(peer),
            delivery_rate=max(self._rates[peer]) if self._rates.get(peer) else None,
            reverse_loss=self._loss_from_peer(peer, now),
        )
        self._senders[key] = sender
        return sender

    def start_receive(self, peer, round_id: int, message_id: int, now: float, *,
                      policy: Policy, out: np.ndarray | None = None,
                      nbytes: int | None = None,
                      critical: np.ndarray | None = None) -> MessageReceiver:
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
        self._closed.pop(key, None)
        receiver = MessageReceiver(
            peer=peer, session=self.session, round_id=round_id, message_id=message_id,
            policy=policy, config=self.config, now=now, out=out, nbytes=nbytes,
            critical=critical,
        )
        self._receivers[key] = receiver
        receiver._check_done(now, self._outbox)  # a plan that needs nothing is met at once
        self._reap(receiver, now)
        return receiver

    def cancel(self, transfer, now: float) -> None:
        if isinstance(transfer, MessageReceiver):
            transfer.cancel(now, self._outbox)
        else:
            transfer.cancel(now)
        self._reap(transfer, now)

    # --------------------------------------------------------------- incoming
    def datagram_received(self, data, peer, now: float) -> None:
        self.datagrams_in += 1
        try:
            kind, flags, plen, session, rnd, msg, idx, cnt, mbytes, cbytes, tseq = wire.parse(data)
        except MalformedDatagram as e:
            self.drops[e.reason] += 1
            return
        if session != self.session:
            self.drops[DropReason.FOREIGN_SESSION] += 1
            return
        key = (peer, rnd, msg)
        if kind == 1 or kind == 2:  # DATA / PROBE: for one of our receives
            rx = self._receivers.get(key)
            if rx is None:
                self._answer_closed(key, kind, now)
                return
            if (mbytes != rx.nbytes or cbytes != rx.chunk_bytes) and not rx.geometry_matches(
                mbytes, cbytes, now, self._outbox
            ):
                self.drops[DropReason.GEOMETRY_MISMATCH] += 1
                return
            if rx.result is None:
                if kind == 1:
                    rx.data_received(idx, plen, tseq, data, now, self._outbox)
                else:
                    rx.probe_received(idx, flags, now, self._outbox)
            if rx.result is not None:
                self._reap(rx, now)
        else:  # BITMAP / STOP / ACK: for one of our sends
            tx = self._senders.get(key)
            if tx is None:
                self.drops[DropReason.STALE] += 1
                return
            if mbytes != tx.nbytes or cbytes != tx.chunk_bytes:
                self.drops[DropReason.GEOMETRY_MISMATCH] += 1
                return
            payload = memoryview(data)[HEADER_BYTES:]
            if kind == 3:
                tx.bitmap_received(flags, idx, payload, now)
            elif kind == 5:
                tx.ack_received(tseq, STOP_PAYLOAD.unpack_from(payload)[0], now)
            else:
                tx.stop_received(idx, STOP_PAYLOAD.unpack_from(payload)[0], now)
                self._reap(tx, now)

    def _loss_from_peer(self, peer, now: float) -> float | None:
        """The loss our last receive from ``peer`` saw, if it closed lately: a send to
        that peer gets its answers back along that way (a microburst at our receiver
        loses them), which its own ACKs may not show in time for its first PROBE."""
        seen = self._loss_from.get(peer)
        if seen is None or now - seen[1] > LOSS_MEMORY:
            return None
        return seen[0]

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
        if n and not self._take_run(rows, peer, now):
            for row in rows:
                self.datagram_received(row.data, peer, now)

    def _take_run(self, rows: np.ndarray, peer, now: float) -> bool:
        """Take ``rows`` as one run of DATA if that is what they are; False if not (nothing
        done). Every row shares its header with the first but for flags, index and tseq
        (a sender's pass), so checking the first checks them all but those."""
        n, size = rows.shape
        if n < max(2, self.run_min) or size <= HEADER_BYTES:
            return False
        heads = np.ascontiguousarray(rows[:, :HEADER_BYTES]).view("<u8")  # 6 words a row
        if ((heads[1:] ^ heads[0]) & _RUN_SAME).any():
            return False
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
        index, tseq = words[:, 6], words[:, 11]
        full = mbytes // cbytes  # chunks that are a whole cbytes long
        if int(index.max()) >= full:
            return False  # not a chunk of full length: parse() says why, one by one
        self.datagrams_in += n
        for lo in range(0, n, RUN_MAX):
            if rx.result is None:
                rx.data_run(index[lo:lo + RUN_MAX], tseq[lo:lo + RUN_MAX], rows[lo:lo + RUN_MAX],
                            now, self._outbox)
            else:  # closed part-way: the rest is what one by one would find (stale)
                for row in rows[lo:]:
                    self.datagram_received(row.data, peer, now)
                break
        if rx.result is not None:
            self._reap(rx, now)
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
            kind == 2 or now - closed.last_sent >= self.config.min_rto
        ):
            closed.last_sent = now
            self._outbox.append(((closed.stop,), key[0]))

    # ----------------------------------------------------------------- timers
    def next_deadline(self) -> float | None:
        best = None
        for t in self._receivers.values():
            d = t.next_deadline()
            if d is not None and (best is None or d < best):
                best = d
        for t in self._senders.values():
            d = t.next_deadline()
            if d is not None and (best is None or d < best):
                best = d
        return best

    def timer_fired(self, now: float) -> None:
        for rx in list(self._receivers.values()):
            d = rx.next_deadline()
            if d is not None and d <= now:
                rx.timer_fired(now, self._outbox)
                self._reap(rx, now)
        for tx in list(self._senders.values()):
            d = tx.next_deadline()
            if d is not None and d <= now:
                tx.timer_fired(now)
                self._reap(tx, now)

    # --------------------------------------------------------------- outgoing
    def has_output(self) -> bool:
        return bool(self._outbox) or any(tx.has_data() for tx in self._senders.values())

    def poll(self, now: float, limit: int = 1024) -> list:
        """Datagrams to send now, as ``(parts, peer)`` with ``parts`` a tuple of buffers
        to be sent as one datagram (``socket.sendmsg`` gathers them without a copy)."""
        out = self._outbox
        self._outbox = []
        if len(out) >= limit:
            return out
        senders = list(self._senders.values())
        if not senders:
            return out
        self._turn = (self._turn + 1) % len(senders)
        senders = senders[self._turn :] + senders[: self._turn]
        batch = self.config.send_batch
        progressed = True
        while progressed and len(out) < limit:
            progressed = False
            for tx in senders:
                room = min(batch, limit - len(out))
                if room <= 0:
                    break
                if tx.poll(now, room, out):
                    progressed = True
        return out

    # ------------------------------------------------------------- completion
    def _reap(self, transfer, now: float) -> None:
        if transfer.result is None:
            return
        key = (transfer.peer, transfer.round_id, transfer.message_id)
        if isinstance(transfer, MessageReceiver):
            if self._receivers.get(key) is transfer:
                del self._receivers[key]
                if self.config.closed_memory:
                    self._closed[key] = _Closed(transfer.stop, now)
                    self._closed.move_to_end(key)
                    while len(self._closed) > self.config.closed_memory:
                        self._closed.popitem(last=False)
                self._finished.append(transfer)
                loss = transfer.loss_seen()
                if loss is not None:
                    self._loss_from[transfer.peer] = (loss, now)
        elif self._senders.get(key) is transfer:
            del self._senders[key]
            if transfer.rtt_estimate is not None:
                self._rtt[transfer.peer] = transfer.rtt_estimate
            if transfer.rate_samples:
                self._rates.setdefault(transfer.peer, deque(maxlen=RATE_SAMPLES)).extend(
                    transfer.rate_samples)
            self._finished.append(transfer)

    def pop_finished(self) -> list:
        """Senders and receivers whose ``result`` became available since the last call."""
        done, self._finished = self._finished, []
        return done

    @property
    def open_receives(self) -> int:
        return len(self._receivers)

    @property
    def open_sends(self) -> int:
        return len(self._senders)

    def counters(self) -> dict[str, int]:
        d = {r.value: n for r, n in self.drops.items()}
        d["datagrams_in"] = self.datagrams_in
        return d

