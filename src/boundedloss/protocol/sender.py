"""MessageSender: the sending half of one message, sans-I/O.

It never touches a socket or a clock: the owner feeds it ``now`` and the datagrams that
concern it, asks it for datagrams to send (``poll``) and for its next deadline.

Life of a send:
1. every chunk goes out once (critical chunks first);
2. with nothing new to send, the sender PROBEs and waits for the receiver's BITMAP;
3. chunks the BITMAP reports missing are queued again and sent; go to 2;
4. a STOP from the receiver ends the send - whenever it arrives, even mid-burst.
A PROBE that gets no answer is re-sent with exponential backoff from an RTO learned
from probe round trips, capped at ``probe_backoff_limit`` times that RTO, and in
more copies each time (up to ``probe_copies_max``); a receiver silent for
``peer_timeout`` fails the send.
"""

from __future__ import annotations

import math

import numpy as np

from .. import wire
from ..wire import BITMAP_PREFIX, HEADER_BYTES, STOP_PAYLOAD, Flag, Kind
from .types import CloseReason, SendResult, SendStatus, TransferStats, TransportConfig


def as_bytes_view(array) -> memoryview:
    """A flat byte view of a C-contiguous buffer (numpy array, bytes, bytearray...)."""
    if isinstance(array, bytes):  # np.asarray(b"") is one NUL byte of dtype S1
        array = np.frombuffer(array, dtype=np.uint8)
    arr = np.asarray(array)
    if not arr.flags.c_contiguous:
        raise ValueError("message buffers must be C-contiguous")
    return memoryview(arr.reshape(-1).view(np.uint8))


#: an adaptive pacing rate (bytes/s) above this is no pacing at all: 10 Gbit/s is beyond
#: what one Python sender can put out, and timers at such rates only cost
UNPACED_ABOVE = 1.25e9


class MessageSender:
    def __init__(
        self,
        *,
        peer,
        session: int,
        round_id: int,
        message_id: int,
        payload,
        config: TransportConfig,
        now: float,
        critical: np.ndarray | None = None,
        rtt: tuple[float, float] | None = None,
        delivery_rate: float | None = None,
        reverse_loss: float | None = None,
    ):
        self.peer = peer
        # the loss a receive from this peer saw lately: the way back of our PROBEs'
        # answers, before this send's own ACKs can tell
        self._reverse_hint = reverse_loss or 0.0
        self.round_id = round_id
        self.message_id = message_id
        self.config = config
        self._payload = as_bytes_view(payload)
        self.nbytes = nbytes = self._payload.nbytes
        if nbytes > wire.MAX_MESSAGE_BYTES:
            raise ValueError(f"message of {nbytes} bytes exceeds {wire.MAX_MESSAGE_BYTES}")
        self.chunk_bytes = cb = config.chunk_bytes
        self.count = count = wire.chunk_count(nbytes, cb)
        if critical is not None:
            critical = np.asarray(critical, dtype=bool)
            if critical.shape != (count,):
                raise ValueError(f"critical mask must have one entry per chunk ({count})")
        headers = wire.build_data_headers(
            session=session,
            round_id=round_id,
            message_id=message_id,
            message_bytes=nbytes,
            chunk_bytes=cb,
            critical=critical,
        )
        self._headers_array = headers
        self._tseq_field = headers.reshape(-1).view(wire.HEADER_DTYPE)["tseq"]
        self._headers = memoryview(headers.reshape(-1))
        self._control = wire.Header(
            Kind.PROBE, session, round_id, message_id, 0, count, nbytes, cb
        )

        # Send queue: a list of chunk indices and a read position. ``_queued`` marks
        # chunks waiting in it, so that repeated BITMAPs do not queue a chunk twice.
        if critical is not None and critical.any():
            order = np.concatenate([np.flatnonzero(critical), np.flatnonzero(~critical)])
        else:
            order = np.arange(count)
        self._pending: list[int] = order.tolist()
        self._pos = 0
        self._queued = np.ones(count, dtype=bool)
        self._first_pass = True

        self.started = now
        self._last_heard = now
        # Round-trip estimate: from earlier messages to this peer when there were any
        # (``rtt`` = (srtt, rttvar)), so that a new message does not start from the
        # conservative initial RTO.
        self._srtt: float | None = None
        self._rttvar = 0.0
        self._rto = config.initial_rto
        if rtt is not None:
            self._srtt, self._rttvar = rtt
            self._rto = min(config.max_rto, max(config.min_rto, self._srtt + 4 * self._rttvar))
        self._rto_base = self._rto  # what the round trips say; backoff starts from here
        self._probe_seq = 0
        self._unanswered = 0  # PROBEs in a row that got no answer
        self._pass_sent = 0  # DATA sent since the last answered PROBE
        self._min_copies = 1  # PROBE copies the loss of the last pass calls for
        # What the first pass's ACKs said: how many came, and the latest one's view
        self._acks_heard = 0
        self._ack_delivered = 0
        self._ack_tseq = -1
        self._probe_datagram = b""
        self._copies_sent = 0  # copies of the PROBE now awaiting its answer
        self._more_copies = 0  # copies of it still to send (ACKs came in behind it)
        self._probe_sent_at = 0.0
        self._awaiting_reply = False
        self._probe_due = False
        self._probe_deadline: float | None = None
        self._reply_missing = 0

        self._tokens = 0.0
        self._tokens_at = now
        self._paced_until: float | None = None
        # Delivery rate (bytes/s): each answered pass gives a sample - what it got
        # through over the time from its first DATA to the answer; ``delivery_rate`` is
        # the best sample of recent messages to this peer (a lossy pass alone would
        # pace a random-loss burst as if it were congestion).
        self._best_rate = delivery_rate or 0.0  # the best of those and this send's own
        self.rate_samples: list[float] = []
        self._pass_started_at: float | None = None
        self._pace_floor = 0.0

        # Flow control: every DATA datagram gets the next transmission sequence; the
        # receiver's ACKs (and probe answers) say how far it has seen, so at most
        # ``window`` datagrams are ever in flight. A window that stays shut for an RTO
        # (ACKs lost) triggers a PROBE, whose answer reopens it.
        self._tseq = 0
        self._acked_tseq = 0
        self._probe_tseq = 0
        self._window = config.window_datagrams
        self._blocked_since: float | None = None

        self.datagrams = 0
        self.payload_bytes = 0
        self.retransmitted = 0
        self.retransmit_rounds = 0
        self.probes = 0
        self.reported_delivered = 0
        self.result: SendResult | None = None
        self.rtt_estimate: tuple[float, float] | None = rtt

    # ----------------------------------------------------------------- outgoing
    @property
    def done(self) -> bool:
        return self.result is not None

    def has_data(self) -> bool:
        if self.result is not None:
            return False
        return self._probe_due or self._more_copies > 0 or (
            self._pos < len(self._pending) and self._tseq - self._acked_tseq < self._window
            and self._paced_until is None
        )

    def poll(self, now: float, limit: int, out: list) -> int:
        """Append up to ``limit`` datagrams ``(parts, peer)`` to ``out``; return how many."""
        if self.result is not None:
            return 0
        sent = 0
        if self._probe_due:
            sent = self._send_probe(now, out)
        elif self._more_copies > 0:
            out.extend([((self._probe_datagram,), self.peer)] * self._more_copies)
            sent, self._copies_sent, self._more_copies = (
                self._more_copies, self._copies_sent + self._more_copies, 0)
        pending = self._pending
        pos = self._pos
        avail = len(pending) - pos
        if avail > 0 and sent < limit:
            room = self._window - (self._tseq - self._acked_tseq)
            k = min(avail, limit - sent, room)
            pacing = self._pacing() if k > 0 else None
            if pacing is not None:
                k = self._paced(now, k, *pacing)  # (waiting for tokens is not a shut window)
            if room <= 0:
                if self._blocked_since is None:
                    self._blocked_since = now
            elif k > 0:
                if self._pass_started_at is None:
                    self._pass_started_at = now
                batch = pending[pos : pos + k]
                self._pos = pos + k
                self._queued[batch] = False
                tseq = self._tseq
                self._tseq_field[batch] = np.arange(tseq, tseq + k, dtype=np.uint32)
                self._tseq = tseq + k
                hdr = self._headers
                pay = self._payload
                cb = self.chunk_bytes
                peer = self.peer
                # memoryview slices clamp at the end, so the short last chunk needs no min()
                out.extend(
                    ((hdr[i * HEADER_BYTES : (i + 1) * HEADER_BYTES], pay[i * cb : (i + 1) * cb]), peer)
                    for i in batch
                )
                self.datagrams += k
                self._pass_sent += k
                self.payload_bytes += k * cb
                if self.count - 1 in batch:  # the last chunk is short
                    self.payload_bytes -= self.count * cb - self.nbytes
                if not self._first_pass:
                    self.retransmitted += k
                sent += k
        if self._pos >= len(self._pending):
            self._pending = []
            self._pos = 0
            self._first_pass = False
            if not self._awaiting_reply:  # nothing new to send: ask what is missing
                if sent < limit:
                    sent += self._send_probe(now, out)
                else:
                    self._probe_due = True
        return sent

    def _pacing(self) -> tuple[float, float] | None:
        """(rate in bytes/s, bucket in bytes) DATA is paced at now, or None."""
        cfg = self.config
        if cfg.rate_bps is not None:
            return cfg.rate_bps / 8.0, max(self.chunk_bytes + HEADER_BYTES, 64 * 1024)
        if self._first_pass or cfg.retransmit_pacing_gain is None:
            return None
        if self._best_rate <= 0.0:
            return None  # nothing measured yet
        rate = max(self._best_rate * cfg.retransmit_pacing_gain, self._pace_floor)
        if rate >= UNPACED_ABOVE:
            return None  # faster than pacing could matter
        # a millisecond's worth at once, at least 8 datagrams: small enough that the
        # senders of an incast do not refill the queue in one go, large enough that a
        # fast path is not slowed by a timer per datagram
        return rate, max(8 * (self.chunk_bytes + HEADER_BYTES), rate * 1e-3)

    def _paced(self, now: float, k: int, rate: float, burst: float) -> int:
        """How many of ``k`` datagrams a bucket of ``burst`` bytes filling at ``rate``
        lets out now; when none, the time it will let one out becomes a timer
        (``_paced_until``), and until then the sender has no data to offer (a driver
        would otherwise poll it in a loop)."""
        self._tokens = min(burst, self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        size = self.chunk_bytes + HEADER_BYTES
        # (a hundredth of a datagram of slack: at the instant next_deadline named, float
        # rounding can leave the bucket a hair short, and a virtual clock would spin
        # there forever)
        k = min(k, int((self._tokens + 0.01 * size) // size))
        self._tokens -= k * size
        self._paced_until = None if k else now + (size - self._tokens) / rate
        return k

    def _send_probe(self, now: float, out: list) -> int:
        self._probe_seq += 1
        self.probes += 1
        self._probe_sent_at = now
        self._probe_tseq = self._tseq
        self._awaiting_reply = True
        self._probe_due = False
        self._probe_deadline = now + self._rto
        self._reply_missing = 0
        # FINAL: every chunk has been sent once, so the receiver may stop on its bound
        # (a PROBE sent while the window is shut is not FINAL).
        flags = Flag.NONE if self._first_pass else Flag.FINAL
        datagram = wire.encode(_replace_index(self._control, Kind.PROBE, self._probe_seq, flags))
        if self._unmeasured():
            # No BITMAP has measured the loss yet, but the ACKs may have (a microburst
            # would otherwise cost an RTO right here).
            self._min_copies = max(self._min_copies, self._copies_from_acks(now))
        # a repeated PROBE goes in twice the copies of the one that went unanswered
        grow = 2 * self._copies_sent if self._unanswered else 1
        copies = min(self.config.probe_copies_max, max(self._min_copies, grow))
        out.extend([((datagram,), self.peer)] * copies)
        self._probe_datagram = datagram
        self._copies_sent = copies
        self._more_copies = 0
        return copies

    def _unmeasured(self) -> bool:
        """No BITMAP answer has told this send how lossy the path is yet."""
        return self.retransmit_rounds == 0 and self._pass_sent > 0

    # ----------------------------------------------------------------- incoming
    def bitmap_received(self, flags: int, start: int, payload, now: float) -> None:
        if self.result is not None:
            return
        self._last_heard = now
        echo, delivered = BITMAP_PREFIX.unpack_from(payload)
        self.reported_delivered = max(self.reported_delivered, delivered)
        if echo != self._probe_seq or not self._awaiting_reply:
            # An answer to an earlier PROBE, or a second answer to this one (PROBEs go
            # out in copies): it would queue again chunks already re-sent since.
            return
        n_bits = min((len(payload) - BITMAP_PREFIX.size) * 8, self.count - start)
        bits = np.unpackbits(
            np.frombuffer(payload, dtype=np.uint8, offset=BITMAP_PREFIX.size),
            bitorder="little",
        )[:n_bits]
        missing = np.flatnonzero(bits == 0)
        if missing.size:
            missing += start
            fresh = missing[~self._queued[missing]]
            if fresh.size:
                self._queued[fresh] = True
                self._pending.extend(fresh.tolist())
        self._reply_missing += int(missing.size)
        if flags & Flag.FINAL:
            self._on_reply(now)

    def ack_received(self, tseq_seen: int, delivered: int, now: float) -> None:
        if self.result is not None:
            return
        self._last_heard = now
        self.reported_delivered = max(self.reported_delivered, delivered)
        self._acks_heard += 1
        if tseq_seen > self._ack_tseq:
            self._ack_tseq = tseq_seen
            self._ack_delivered = delivered
        if self._awaiting_reply and not self._first_pass and self._unmeasured():
            # The pass was shorter than a round trip, so its PROBE went out before these
            # ACKs could say how lossy the path is; if they call for more copies, send
            # them now rather than wait an RTO for the one that was probably lost.
            self._more_copies = max(0, self._copies_from_acks(now) - self._copies_sent)
        if tseq_seen + 1 > self._acked_tseq:
            self._acked_tseq = min(tseq_seen + 1, self._tseq)
            self._blocked_since = None

    def _on_reply(self, now: float) -> None:
        # Everything sent before the PROBE has arrived or is lost by now (the answer
        # came back behind it), so none of it is in flight any more.
        if self._probe_tseq > self._acked_tseq:
            self._acked_tseq = self._probe_tseq
            self._blocked_since = None
        self._rtt_sample(now - self._probe_sent_at)
        # (Karn, as for the RTT: after a repeated PROBE the pass's time also holds the
        # timeouts - a receive posted late, the answers lost - not how fast it drained)
        unrepeated = self._unanswered == 0
        self._awaiting_reply = False
        self._more_copies = 0
        self._probe_deadline = None
        self._unanswered = 0
        # The pass just answered lost a fraction q of its DATA; the PROBEs that follow
        # cross the same path, and their answers the way back (a microburst at *our*
        # receiver loses them: the broadcast's answers from a worker), so send enough
        # copies that all or all their answers are lost with chance <= probe_miss_target
        # (0.8 either way: 21 copies of 48 bytes instead of an RTO - tens of ms when
        # the hosts are busy - every few passes).
        if self._pass_sent:
            q = self._reply_missing / self._pass_sent
            self._min_copies = self._copies_for(1.0 - (1.0 - q) * (1.0 - self._reverse_loss()))
        got = self._pass_sent - self._reply_missing
        size = self.chunk_bytes + HEADER_BYTES
        if (got > 0 and unrepeated and self._pass_started_at is not None
                and now > self._pass_started_at):
            sample = got * size / (now - self._pass_started_at)
            self.rate_samples.append(sample)
            self._best_rate = max(self._best_rate, sample)
        self._pass_started_at = None
        # however slow the samples say the peer is, pacing never stretches the pass this
        # answer starts beyond two RTOs
        self._pace_floor = (len(self._pending) - self._pos) * size / (2 * self._rto_base)
        self._pass_sent = 0
        if self._reply_missing:
            self.retransmit_rounds += 1
        if self._pos >= len(self._pending):
            self._probe_due = True  # the answer asked for nothing we have not queued

    def _rtt_sample(self, sample: float) -> None:
        if self._srtt is None:
            self._srtt, self._rttvar = sample, sample / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - sample)
            self._srtt = 0.875 * self._srtt + 0.125 * sample
        cfg = self.config
        self._rto = min(cfg.max_rto, max(cfg.min_rto, self._srtt + 4 * self._rttvar))
        self._rto_base = self._rto
        self.rtt_estimate = (self._srtt, self._rttvar)

    def _copies_for(self, q: float) -> int:
        """PROBE copies such that all of them (or all their answers) are lost with
        chance <= ``probe_miss_target`` when each is lost with chance ``q``."""
        target = self.config.probe_miss_target
        if q <= target:
            return 1
        if q >= 1.0:
            return self.config.probe_copies_max
        return min(self.config.probe_copies_max, math.ceil(math.log(target) / math.log(q)))

    def _copies_from_acks(self, now: float) -> int:
        """PROBE copies for the end of the first pass, from the ACKs it drew.

        The receiver ACKs every ``ack_every`` DATA datagrams, with the highest
        transmission sequence it saw and what it had delivered before that datagram.
        Forward loss: of the first ``tseq + 1`` datagrams, ``delivered + 1`` arrived.
        Reverse loss: up to that one the receiver sent ``(delivered + 1) // ack_every``
        ACKs, we heard ``acks_heard`` (ACKs still in flight come after it, so they do not
        count as lost). A PROBE is answered when it and its answer both get through."""
        if not self._acks_heard:
            every = self.config.ack_every
            copies = self._copies_for(self._reverse_loss())  # (no ACK: just the hint)
            if (not self._first_pass and self._srtt is not None
                    and self._pass_started_at is not None
                    and now - self._pass_started_at > self._srtt
                    and self._pass_sent >= 2 * every):
                # The whole pass is out, it lasted a round trip and owed us ACKs, yet
                # none came: fewer than ack_every of its datagrams (or none of the ACKs)
                # got through - a microburst of 90% loss, where one copy would cost RTO
                # after RTO. (Not so for a PROBE sent because the window is shut: there
                # the silence says the receiver is behind, and copies only load it.)
                copies = max(copies, self._copies_for(1.0 - every / self._pass_sent))
            # (else nothing to go on but the hint: a short message, or the ACKs are
            # still on their way - the pass took less than a round trip)
            return copies
        q_fwd = 1.0 - min(1.0, (self._ack_delivered + 1) / (self._ack_tseq + 1))
        return self._copies_for(1.0 - (1.0 - q_fwd) * (1.0 - self._reverse_loss()))

    def _reverse_loss(self) -> float:
        """The loss on the way back: from the ACKs heard so far (see _copies_from_acks),
        or what a receive from this peer saw lately, whichever is higher. (The ACKs
        alone read low when the one heard last came early in the pass.)"""
        hint = self._reverse_hint
        if not self._acks_heard:
            return hint
        sent = max(1, (self._ack_delivered + 1) // self.config.ack_every)
        return max(hint, 1.0 - min(1.0, self._acks_heard / sent))

    def stop_received(self, reason: int, delivered: int, now: float) -> None:
        if self.result is not None:
            return
        self.reported_delivered = delivered
        try:
            close_reason = CloseReason(reason)
        except ValueError:
            close_reason = None
        if (self._awaiting_reply and not self._first_pass and self._unanswered == 0
                and close_reason in (CloseReason.BOUND_MET, CloseReason.COMPLETE)):
            # The answer to the FINAL PROBE when a bound was met (or, a hair early, the
            # STOP of a message that completed as the PROBE went out): the round trip
            # for the next message to this peer - bounded transfers may never see a
            # BITMAP, and would keep the conservative initial RTO for good. Not a STOP
            # sent by a receiver's timer (an acceptance or hard deadline): it answers no
            # PROBE, and taken as one it made a round trip of the deadline's wait
            # (LTP under incast: 150 ms learned on a 3 ms path, so RTOs of 0.5 s).
            self._rtt_sample(now - self._probe_sent_at)
        self._finish(SendStatus.STOPPED, close_reason, now)

    # ------------------------------------------------------------------- timers
    def next_deadline(self) -> float | None:
        if self.result is not None:
            return None
        t = self._last_heard + self.config.peer_timeout
        if self._probe_deadline is not None and self._probe_deadline < t:
            t = self._probe_deadline
        if self._blocked_since is not None and not self._awaiting_reply:
            t = min(t, self._blocked_since + self._rto)
        if self._paced_until is not None and self._paced_until < t:
            t = self._paced_until
        return t

    def timer_fired(self, now: float) -> None:
        if self.result is not None:
            return
        if now >= self._last_heard + self.config.peer_timeout:
            self._finish(SendStatus.PEER_SILENT, None, now)
            return
        if self._paced_until is not None and now >= self._paced_until:
            self._paced_until = None  # the bucket has a datagram's worth again
        if (
            self._blocked_since is not None
            and not self._awaiting_reply
            and now >= self._blocked_since + self._rto
        ):
            # The window stayed shut: the ACKs were lost. A probe answer reopens it.
            self._blocked_since = None
            self._probe_due = True
        if self._probe_deadline is not None and now >= self._probe_deadline:
            # The PROBE or its answer was lost: ask again, backing off.
            cfg = self.config
            self._rto = min(cfg.max_rto, self._rto * 2, self._rto_base * cfg.probe_backoff_limit)
            self._unanswered += 1
            self._probe_deadline = None
            self._awaiting_reply = False
            self._probe_due = True

    def cancel(self, now: float) -> None:
        if self.result is None:
            self._finish(SendStatus.CANCELLED, None, now)

    def _finish(self, status: SendStatus, reason: CloseReason | None, now: float) -> None:
        self._pending = []
        self._pos = 0
        self._probe_due = False
        self.result = SendResult(
            peer=self.peer,
            round_id=self.round_id,
            message_id=self.message_id,
            status=status,
            close_reason=reason,
            stats=TransferStats(
                datagrams=self.datagrams,
                payload_bytes=self.payload_bytes,
                chunks=self.count,
                delivered=self.reported_delivered,
                retransmit_rounds=self.retransmit_rounds,
                retransmitted=self.retransmitted,
                probes=self.probes,
                elapsed=now - self.started,
                rtt=self._srtt,
                started=self.started,
            ),
        )


def _replace_index(h: wire.Header, kind: Kind, index: int, flags: Flag = Flag.NONE) -> wire.Header:
    return wire.Header(
        kind, h.session, h.round_id, h.message_id, index, h.count, h.message_bytes,
        h.chunk_bytes, flags,
    )


def stop_datagram(header: wire.Header, reason: CloseReason, delivered: int) -> bytes:
    return wire.encode(
        _replace_index(header, Kind.STOP, int(reason)), STOP_PAYLOAD.pack(delivered)
    )
