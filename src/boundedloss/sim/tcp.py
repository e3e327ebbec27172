"""A TCP model for the simulator's baselines (gloo, tcp-ps): one host's stack as a
core of a :class:`~..net.fake.FakeNetwork` node, so that its segments cross the same
links, queues and loss as our datagrams - each as many bytes on the link as the
packet it stands for, less the 28 bytes of IPv4 and UDP headers our datagrams' sizes
leave out too.

What it models, after Linux's defaults: a byte stream per peer cut into segments of
one packet (the MTU less 52 bytes of IP and TCP headers with timestamps); an initial
window of 10 segments; slow start, then one segment more per window of data
acknowledged (Reno's growth: CUBIC, Linux's default, grows as Reno does where the
bandwidth-delay product is a few segments, as in a rack), and on loss the window cut
to 0.7 of itself as CUBIC cuts it, once per window of data - brought down to that in
step with what is delivered (proportional rate reduction, RFC 6937, as Linux does); an
ACK for every segment, carrying the cumulative acknowledgement and the segment it
answers (the sender keeps the SACK scoreboard); a hole lost once 3 segments above it
are SACKed, or, as RACK has it, once a segment sent more than SRTT/4 after it has been
delivered (a segment sent just before a delivered one, once a round trip and that
window have passed: the reordering timer); one tail loss probe per tail (the last
segment again, 2 x SRTT + 2 ms after the last send, + 200 ms with a single segment
out, and never later than the retransmission timeout would fire: the probe goes then
instead, and the timeout starts again from it), not in recovery; the retransmission
timeout at max(200 ms, SRTT + 4 x RTTVAR), doubled on each expiry, with the window
back to one segment; slow start again after an idle RTO. Not modelled: delayed ACKs,
the receive window (it never limits) and Nagle. The CPU a host spends (its profile's
costs: per byte and segment on the kernel's side, per message sent or received on the
caller's) is the network's and ``SimTcp``'s to charge.
"""

from __future__ import annotations

import math
import struct
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future

from ..net.udp import IPV4_UDP_OVERHEAD  # (our datagrams' sizes leave it out: a segment's too)

#: IPv4 and TCP headers with the timestamp option: what a segment carries besides data
TCP_OVERHEAD = 52
INITIAL_WINDOW = 10
MIN_RTO = 0.2
INITIAL_RTO = 1.0
MAX_RTO = 120.0
DUP_THRESHOLD = 3
#: CUBIC's multiplicative decrease
BETA = 0.7
#: a tail loss probe waits 2 x SRTT and this (Linux's two jiffies), or the minimum
#: RTO when a single segment is outstanding
PTO_EXTRA = 0.002

# a segment: 48 bytes of zeros where our header keeps its round (loss models that look
# for one find round 0), then kind, segment index, cumulative ACK, payload bytes, and
# the echo of when it was sent (time, transmission number); then zeros to its size
_PAD = bytes(48)
_HEAD = struct.Struct("<BIIIdQ")
_HEAD_BYTES = len(_PAD) + _HEAD.size
_DATA, _ACK = 1, 2
_ZEROS = bytes(65536)


_KIND_AT = len(_PAD)
_ZERO_MAGIC = bytes(4)  # (where our datagrams keep their magic, a segment has zeros)


def is_data_segment(data: bytes) -> bool:
    """Whether ``data`` is one of this model's segments carrying data (not an ACK)."""
    return len(data) > _HEAD_BYTES and data[_KIND_AT] == _DATA and data[:4] == _ZERO_MAGIC


class _Connection:
    """The sending half toward one peer, and the receiving half from it."""

    def __init__(self, peer: Hashable, mss: int):
        self.peer = peer
        self.mss = mss
        # sending
        self.sizes: list[int] = []  # every segment's payload bytes, in stream order
        self.una = 0  # first segment not yet acknowledged
        self.nxt = 0  # next new segment to send
        self.sacked: set[int] = set()
        self.lost: deque[int] = deque()  # marked lost, to be sent again
        self.lost_set: set[int] = set()
        self.retransmitted: set[int] = set()  # sent again and not yet acknowledged
        #: when each unacknowledged segment last went: (time, transmission number - the
        #: order among copies sent at one instant)
        self.sent_at: dict[int, tuple[float, int]] = {}
        self.sent_order: deque[tuple[float, int, int]] = deque()  # (time, number, segment)
        self.transmissions = 0
        self.cwnd = float(INITIAL_WINDOW)
        self.ssthresh = math.inf
        self.recover: int | None = None  # in fast recovery until this is acknowledged
        # proportional rate reduction (RFC 6937, as Linux's tcp_cwnd_reduction) during a
        # recovery: the window when it began, and the segments delivered and sent since
        self.prior_cwnd = 0.0
        self.prr_delivered = 0
        self.prr_out = 0
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.rto = INITIAL_RTO
        self.backoff = 1
        self.rto_at: float | None = None
        self.pto_at: float | None = None
        self.reo_at: float | None = None  # RACK's reordering timer
        self.probe_out: int | None = None  # a tail loss probe went: until this is ACKed
        self.rack_sent = (-math.inf, -1)  # the latest delivered segment's sent_at
        self.last_sent = 0.0
        self.sends: deque[tuple[int, Future]] = deque()  # (end segment, future)
        # receiving
        self.rcv_nxt = 0
        self.ooo: set[int] = set()
        self.received_bytes = 0
        self.rcv_sizes: dict[int, int] = {}
        self.recvs: deque[tuple[int, Future]] = deque()  # (bytes received by then, future)
        self.wanted = 0  # bytes the posted receives add up to

    # ------------------------------------------------------------- sending side
    def pipe(self) -> int:
        """Segments thought to be in the network (RFC 6675's estimate)."""
        return (self.nxt - self.una) - len(self.sacked) - len(self.lost_set)

    def reduce_window(self, delivered: int) -> None:
        """Proportional rate reduction (RFC 6937), as Linux's ``tcp_cwnd_reduction``: in
        a recovery the window comes down to ssthresh in step with what is delivered -
        ssthresh / prior window segments sent per segment ``delivered`` while more than
        ssthresh is in flight, then up to ssthresh again no faster than slow start."""
        self.prr_delivered += delivered
        pipe = self.pipe()
        if pipe > self.ssthresh:
            sndcnt = math.ceil(self.prr_delivered * self.ssthresh / self.prior_cwnd) - self.prr_out
        else:
            sndcnt = min(math.ceil(self.ssthresh) - pipe,
                         max(self.prr_delivered - self.prr_out, delivered) + 1)
        self.cwnd = float(pipe + max(sndcnt, 0))

    def next_segment(self) -> int | None:
        if self.lost:
            return self.lost[0]
        if self.nxt < len(self.sizes):
            return self.nxt
        return None

    def deadline(self) -> float | None:
        ds = [d for d in (self.rto_at, self.pto_at, self.reo_at) if d is not None]
        return min(ds) if ds else None

    def pto(self) -> float:
        assert self.srtt is not None
        return 2 * self.srtt + (MIN_RTO if self.nxt - self.una == 1 else PTO_EXTRA)


class TcpHost:
    """One host's TCP stack: connections by peer, driven by a FakeNetwork as its core.
    ``send``/``recv`` return futures (a send's resolves once all of it is
    acknowledged; a receive's once that many more bytes have arrived in order);
    ``serviced`` is called after the network has run the stack."""

    def __init__(self, mtu: int, make_future: Callable[[], Future]):
        self.mss = mtu - TCP_OVERHEAD
        self._make_future = make_future
        self._conns: dict[Hashable, _Connection] = {}
        self._acks: list = []  # ACKs to send, as (parts, peer)
        self.core_datagrams = 0  # segments taken in (FakeNetwork reads a core's count)
        self.retransmits = 0
        self.timeouts = 0
        self.probes = 0
        self.now = 0.0  # (the network's clock, as of the last call)

    def connection(self, peer: Hashable) -> _Connection:
        conn = self._conns.get(peer)
        if conn is None:
            conn = self._conns[peer] = _Connection(peer, self.mss)
        return conn

    # ---------------------------------------------------------------- the API
    def send(self, peer: Hashable, nbytes: int) -> Future:
        conn = self.connection(peer)
        if conn.una == conn.nxt and not conn.lost and self.now - conn.last_sent > conn.rto:
            conn.cwnd = min(conn.cwnd, float(INITIAL_WINDOW))  # slow start after idle
        whole, rest = divmod(nbytes, self.mss)
        conn.sizes.extend([self.mss] * whole + ([rest] if rest else []))
        fut = self._make_future()
        conn.sends.append((len(conn.sizes), fut))
        self._settle_sends(conn)
        return fut

    def recv(self, peer: Hashable, nbytes: int) -> Future:
        conn = self.connection(peer)
        conn.wanted += nbytes
        fut = self._make_future()
        conn.recvs.append((conn.wanted, fut))
        self._settle_recvs(conn)
        return fut

    # ------------------------------------------------ the core, for the network
    def datagram_received(self, data: bytes, peer: Hashable, now: float) -> None:
        self.now = now
        self.core_datagrams += 1
        kind, index, ack, size, echo, number = _HEAD.unpack_from(data, len(_PAD))
        conn = self.connection(peer)
        if kind == _DATA:
            self._data(conn, index, size, (echo, number))
        else:
            self._ack(conn, index, ack, (echo, number), now)

    def poll(self, now: float, limit: int = 64) -> list:
        self.now = now
        out, self._acks = self._acks[:limit], self._acks[limit:]
        for conn in self._conns.values():
            while len(out) < limit and conn.pipe() < int(conn.cwnd):
                i = conn.next_segment()
                if i is None:
                    break
                self._transmit(conn, i, now, out)
        return out

    def has_output(self) -> bool:
        return bool(self._acks) or any(
            c.next_segment() is not None and c.pipe() < int(c.cwnd) for c in self._conns.values())

    def next_deadline(self) -> float | None:
        ds = [d for d in (c.deadline() for c in self._conns.values()) if d is not None]
        return min(ds) if ds else None

    def timer_fired(self, now: float) -> None:
        self.now = now
        for conn in self._conns.values():
            # (a probe due no later than the timeout goes instead of it, as Linux's
            # loss-probe timer stands in for its retransmission timer)
            if (conn.pto_at is not None and now >= conn.pto_at
                    and (conn.rto_at is None or conn.pto_at <= conn.rto_at)):
                self._probe(conn, now)
            elif conn.rto_at is not None and now >= conn.rto_at:
                self._timeout(conn, now)
            elif conn.reo_at is not None and now >= conn.reo_at:
                conn.reo_at = None
                self._rack(conn, conn.rack_sent, reordering_waited=True)

    # -------------------------------------------------------------- internals
    def _transmit(self, conn: _Connection, i: int, now: float, out: list) -> None:
        if conn.recover is not None:
            conn.prr_out += 1
        if conn.lost and conn.lost[0] == i:
            conn.lost.popleft()
            conn.lost_set.discard(i)
            conn.retransmitted.add(i)
            self.retransmits += 1
        else:
            conn.nxt += 1
        size = conn.sizes[i]
        conn.transmissions += 1
        conn.sent_at[i] = (now, conn.transmissions)
        conn.sent_order.append((now, conn.transmissions, i))
        pad = max(0, size + TCP_OVERHEAD - IPV4_UDP_OVERHEAD - _HEAD_BYTES)
        out.append(((_PAD, _HEAD.pack(_DATA, i, 0, size, now, conn.transmissions),
                     _ZEROS[:pad]), conn.peer))
        conn.last_sent = now
        if conn.rto_at is None:
            conn.rto_at = now + conn.rto * conn.backoff
        self._arm_probe(conn, now)

    def _data(self, conn: _Connection, i: int, size: int, echo: tuple[float, int]) -> None:
        if i >= conn.rcv_nxt and i not in conn.ooo:
            conn.ooo.add(i)
            conn.rcv_sizes[i] = size
            while conn.rcv_nxt in conn.ooo:
                conn.ooo.discard(conn.rcv_nxt)
                conn.received_bytes += conn.rcv_sizes.pop(conn.rcv_nxt)
                conn.rcv_nxt += 1
            self._settle_recvs(conn)
        self._acks.append(((_PAD, _HEAD.pack(_ACK, i, conn.rcv_nxt, 0, *echo)), conn.peer))

    def _ack(self, conn: _Connection, sacked: int, cumulative: int,
             echo: tuple[float, int], now: float) -> None:
        delivered = 0  # segments this ACK newly acknowledges or SACKs
        if cumulative > conn.una:
            newly = cumulative - conn.una
            delivered += newly  # (less those SACKed before, below)
            for j in range(conn.una, cumulative):
                if j in conn.sacked:
                    delivered -= 1
                conn.sacked.discard(j)
                conn.retransmitted.discard(j)
                conn.sent_at.pop(j, None)
                if j in conn.lost_set:
                    conn.lost_set.discard(j)
                    conn.lost.remove(j)
            conn.una = cumulative
            self._rtt_sample(conn, now - echo[0])
            conn.backoff = 1
            if conn.recover is not None and conn.una >= conn.recover:
                conn.recover = None
                conn.cwnd = conn.ssthresh
            elif conn.recover is None:
                if conn.cwnd < conn.ssthresh:
                    conn.cwnd += newly
                else:
                    conn.cwnd += newly / conn.cwnd
            if conn.probe_out is not None and conn.una >= conn.probe_out:
                conn.probe_out = None  # (the tail it probed is answered)
            outstanding = conn.una < conn.nxt
            conn.rto_at = now + conn.rto if outstanding else None
            conn.pto_at = None
            self._arm_probe(conn, now)
            self._settle_sends(conn)
        if conn.una <= sacked < conn.nxt and sacked not in conn.sacked:
            delivered += 1
            conn.sacked.add(sacked)
            conn.retransmitted.discard(sacked)
            if sacked in conn.lost_set:
                conn.lost_set.discard(sacked)
                conn.lost.remove(sacked)
        self._detect_loss(conn)
        self._rack(conn, echo)
        if conn.recover is not None:
            conn.reduce_window(delivered)

    def _detect_loss(self, conn: _Connection) -> None:
        """A hole with DUP_THRESHOLD SACKed segments above it is lost."""
        if len(conn.sacked) < DUP_THRESHOLD:
            return
        above = sorted(conn.sacked)[-DUP_THRESHOLD]  # the third-highest SACKed segment
        newly_lost = [j for j in range(conn.una, above) if j not in conn.sacked
                      and j not in conn.lost_set and j not in conn.retransmitted]
        if newly_lost:
            self._mark_lost(conn, newly_lost)

    def _rack(self, conn: _Connection, delivered: tuple[float, int], *,
              reordering_waited: bool = False) -> None:
        """RACK: a segment is lost once one sent more than a reordering window
        (SRTT/4) after it has been delivered - a first transmission or a retransmission
        alike, so a lost tail or a lost retransmission is found without the timeout.
        One sent before the delivered one but within the window is lost once a round
        trip and the window have passed (the reordering timer)."""
        if conn.srtt is None:
            return
        conn.rack_sent = max(conn.rack_sent, delivered)
        window = conn.srtt / 4
        latest_time, latest_number = conn.rack_sent
        order = conn.sent_order
        lost = []
        while order and order[0][1] < latest_number and (
                reordering_waited or order[0][0] + window < latest_time):
            sent, number, i = order.popleft()
            if self._outstanding(conn, i, (sent, number)):
                lost.append(i)
        if lost:
            self._mark_lost(conn, lost)
        while order and not self._outstanding(conn, order[0][2], order[0][:2]):
            order.popleft()
        if order and order[0][1] < latest_number:
            conn.reo_at = order[0][0] + conn.srtt + window
        else:
            conn.reo_at = None

    @staticmethod
    def _outstanding(conn: _Connection, i: int, sent: tuple[float, int]) -> bool:
        """Is segment ``i``'s copy sent at ``sent`` neither delivered nor given up?"""
        return (i >= conn.una and i not in conn.sacked and i not in conn.lost_set
                and conn.sent_at.get(i) == sent)

    def _arm_probe(self, conn: _Connection, now: float) -> None:
        """The tail loss probe's timer, from the last send or ACK: while data is out,
        not in recovery or after a timeout, and no probe of this tail is out yet - and
        no later than the retransmission timeout would fire (Linux's rule: then the
        probe goes at the timeout's time, instead of the timeout)."""
        if (conn.srtt is not None and conn.una < conn.nxt and conn.recover is None
                and conn.probe_out is None and conn.backoff == 1):
            conn.pto_at = now + conn.pto()
            if conn.rto_at is not None and conn.rto_at < conn.pto_at:
                conn.pto_at = conn.rto_at

    def _mark_lost(self, conn: _Connection, segments: list[int]) -> None:
        if conn.recover is None:  # the window is cut once per window of data
            conn.pto_at = None
            conn.ssthresh = max(conn.cwnd * BETA, 2.0)
            conn.prior_cwnd = max(conn.cwnd, 1.0)
            conn.prr_delivered = conn.prr_out = 0
            conn.recover = conn.nxt
        for i in segments:
            conn.retransmitted.discard(i)
        conn.lost.extend(segments)
        conn.lost_set.update(segments)

    def _timeout(self, conn: _Connection, now: float) -> None:
        if conn.una >= conn.nxt:
            conn.rto_at = conn.pto_at = None
            return
        self.timeouts += 1
        conn.ssthresh = max(conn.cwnd * BETA, 2.0)
        conn.cwnd = 1.0
        conn.recover = None
        conn.backoff = min(conn.backoff * 2, int(MAX_RTO / MIN_RTO))
        conn.retransmitted.clear()
        conn.lost = deque(j for j in range(conn.una, conn.nxt) if j not in conn.sacked)
        conn.lost_set = set(conn.lost)
        conn.rto_at = now + min(MAX_RTO, conn.rto * conn.backoff)
        conn.pto_at = None

    def _probe(self, conn: _Connection, now: float) -> None:
        """A tail loss probe: the last segment sent goes again (its ACK, or the SACKs
        it brings, starts recovery without waiting for the timeout)."""
        conn.pto_at = None
        if conn.una >= conn.nxt:
            return
        self.probes += 1
        conn.probe_out = conn.nxt
        conn.rto_at = now + conn.rto * conn.backoff  # (restarted from the probe, as Linux)
        last = conn.nxt - 1
        if last not in conn.sacked and last not in conn.lost_set:
            conn.lost.appendleft(last)
            conn.lost_set.add(last)

    def _rtt_sample(self, conn: _Connection, rtt: float) -> None:
        if conn.srtt is None:
            conn.srtt, conn.rttvar = rtt, rtt / 2
        else:
            conn.rttvar = 0.75 * conn.rttvar + 0.25 * abs(conn.srtt - rtt)
            conn.srtt = 0.875 * conn.srtt + 0.125 * rtt
        conn.rto = min(MAX_RTO, max(MIN_RTO, conn.srtt + 4 * conn.rttvar))

    def _settle_sends(self, conn: _Connection) -> None:
        while conn.sends and conn.sends[0][0] <= conn.una:
            conn.sends.popleft()[1].set_result(None)

    def _settle_recvs(self, conn: _Connection) -> None:
        while conn.recvs and conn.recvs[0][0] <= conn.received_bytes:
            conn.recvs.popleft()[1].set_result(None)


def segment_index(data: bytes) -> int:
    """The index of the segment a DATA segment's bytes carry (for routes and tests)."""
    return _HEAD.unpack_from(data, len(_PAD))[1]
