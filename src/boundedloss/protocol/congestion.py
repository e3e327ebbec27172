"""DelayRateControl: how fast one endpoint may send to one peer on a shared link, decided
from delay - a lost datagram alone never lowers it.

Why not loss: the links this transport is for lose datagrams at random (the policies
exist because of it), and a loss-based controller reads every such loss as congestion
and cuts its rate for nothing. As MLT and DBLP's prototype (a TIMELY-like delay loop)
and LTP (a BBR-like rate control) do, the rate follows the queueing delay the round
trips show (a Swift-like loop):

- the least round trip seen lately is the path's own (``min_rtt``); what a sample has
  above it is queueing;
- while the queueing stays under ``target_queue_delay`` the rate grows additively (a
  packet's worth per round trip of data acknowledged, as TCP's window grows), to at
  most ``probe_gain`` times the delivery rate the ACKs show (as BBR probes: faster than
  the path takes only fills its queue); above it, it is cut in proportion to the
  excess, at most once per round trip - a cut takes a round trip to show in the
  samples, and cutting again before would count the same excess twice.

A delay loop alone gives way to any loss-based flow (TCP) that shares its bottleneck:
such a flow fills the queue until it drops, so the queueing never falls under the
target and the loop cuts until it starves. So the rate never goes under a *TCP-fair
floor* (after TFRC): what a TCP flow (Linux's: a packet more per round trip, cut to
0.7 at a drop) gets at the same round trip and the same rate of congestion events. An
event is the queue filling up - its queueing at ``near_full`` of the deepest seen
lately, and well above the target - which is where a drop-tail queue drops and a
loss-based flow cuts; a paced flow seldom meets those drops itself, but sees every
fill in its round trips. (Losses are not read at all: random loss looks the same.)
The floor lapses once the fills stop coming (``floor_lapse``): alone on a path, the
loop keeps the queue short, nothing fills it, and the floor is gone. (Not always: a
floor started by the first pass's burst into a queue as shallow as 64 KB can keep
itself up on the fills it makes - design.md, "Congestion control".)

Its samples (``AckSamples`` below, one per send): an ACK names the highest
transmission sequence the receiver saw; the sender knows when that datagram went, and
the ACK's arrival time is what ``AckState.last_heard`` holds after it - fields both the
Python path and the compiled data path keep, so no new sample comes from C. They come
an ACK cadence apart, which congestion control shortens (``TransportConfig.ack_every_for``).

The rate it sets is what the ``Pacer`` paces DATA at - first passes too - split evenly
among the sends to the peer open at once. Until a sample first calls for a cut, the
rate is None: unpaced, as with no congestion control (an uncongested link is never
slowed). Sans-I/O: times are whatever clock drives the core.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

#: AIMD(1, 0.3)'s throughput, packets per round trip, is sqrt(TCP_FAIR / p) at a
#: congestion-event rate p: (1 + 0.7) / (2 * 0.3), the sim's TCP model's growth and cut
#: (CUBIC's cut, Reno's growth), from the AIMD response function a(2 - b) / (2b p)
TCP_FAIR = 1.7 / 0.6
#: intervals between congestion events the event rate is averaged over (TFRC averages
#: eight loss intervals)
EVENT_INTERVALS = 8


@dataclass(frozen=True, slots=True)
class DelayLoopConfig:
    """The delay loop's tunables (seconds, bytes)."""

    #: queueing delay the loop steers to: above it, the rate is cut. Above what a
    #: pacing bucket and the receiver's ACK cadence add to a sample by themselves, and
    #: small beside a shallow switch queue (64 KB at 100 Mbit/s is 5 ms)
    target_queue_delay: float = 500e-6
    #: the rate grows by this many bytes per round trip per round trip: one MTU-sized
    #: packet's worth of window, as TCP's congestion avoidance (and the TCP-fair floor's
    #: packet)
    packet_bytes: int = 1500
    #: the most one sample grows the rate by, as a share of it: a slow sender's ACKs
    #: come round trips apart, and growing by all of them at once overshoots the target
    #: before the next sample can say so
    max_increase: float = 0.5
    #: a cut is this times the excess delay's share of the round trip (Swift's beta)...
    decrease_gain: float = 0.8
    #: ...and at most this fraction of the rate
    max_decrease: float = 0.25
    #: the rate goes at most this far above the delivery rate the ACKs showed lately
    #: (as BBR's probing gain): beyond it, sending faster only fills the queue
    probe_gain: float = 1.25
    #: "lately", for the delivery rate: this many round trips (two spans of them)
    delivery_rtts: int = 8
    #: the floor is this share of the TCP-fair rate (under 1: yield a little more)
    floor_gain: float = 1.0
    #: a congestion event: the queueing reaches this share of the deepest seen within
    #: min_rtt_window (a drop-tail queue drops when full: a paced flow seldom meets the
    #: drops themselves, but sees the queue full). Lower, the loop's own swings read as
    #: fills and keep the floor up alone (0.7 took the link from TCP at 50 us delays in
    #: the simulator); higher, samples a little short of a fill miss it
    near_full: float = 0.8
    #: ...and is this many targets at least: the delay loop's own swings about its
    #: target are not a full queue (a queue this shallow leaves no room for a floor)
    full_above: float = 2.0
    #: the TCP-fair floor lapses once this many average intervals' worth of data went
    #: with no congestion event: nobody fills the queue any more (measured in data, not
    #: time: a flow held low sends little between fills)
    floor_lapse: float = 4.0
    #: how long the least round trip stands before a newer sample replaces it (as BBR's
    #: min-RTT filter): a route change must not leave a stale floor for ever
    min_rtt_window: float = 10.0
    #: the rate never goes under this (bytes/s): a stalled pacer would stall the send
    min_rate: float = 125_000.0
    #: what a paced send may let out at once: this long at the rate (at least two
    #: datagrams) - a burst is queueing the samples would read as congestion
    bucket_time: float = 100e-6

    def __post_init__(self) -> None:
        if self.target_queue_delay <= 0 or self.bucket_time <= 0:
            raise ValueError("target_queue_delay and bucket_time must be > 0")
        if self.max_increase <= 0 or not 0 < self.max_decrease < 1:
            raise ValueError("max_increase must be > 0 and max_decrease in (0, 1)")
        if self.decrease_gain <= 0 or self.probe_gain <= 1:
            raise ValueError("decrease_gain must be > 0 and probe_gain > 1")
        if not 0 < self.floor_gain <= 1 or not 0 < self.near_full <= 1:
            raise ValueError("floor_gain and near_full must be in (0, 1]")
        if min(self.packet_bytes, self.min_rate, self.delivery_rtts, self.floor_lapse,
               self.min_rtt_window) <= 0:
            raise ValueError("packet_bytes, min_rate, delivery_rtts, floor_lapse and "
                             "min_rtt_window must be > 0")


#: ``TransportConfig.congestion``: the choices, and the loop each stands for (None: no
#: congestion control - the first pass unpaced, as the window and any credit allow)
CONGESTION_MODES: dict[str, DelayLoopConfig | None] = {"off": None, "delay": DelayLoopConfig()}


def parse_congestion(name: str) -> str:
    """``name`` if it is one of CONGESTION_MODES (ValueError, one line, if not)."""
    if name not in CONGESTION_MODES:
        raise ValueError(f"unknown congestion control {name!r}; choose from "
                         f"{', '.join(CONGESTION_MODES)}")
    return name


class AckSamples:
    """The samples one send's ACKs give its peer's ``DelayRateControl``.

    An ACK names the highest transmission sequence its receiver saw (``ack_tseq``) and
    leaves ``last_heard`` at its arrival: with when that datagram went (kept here per
    DATA run - a run goes at one poll), that is a round trip, queueing included; and
    how far ``ack_tseq`` moved since the last reading, over the time between, is the
    rate the path takes this send's DATA at (datagrams lost on the way included: random
    loss is no slower path). ``read`` looks at the send's ``AckState`` (or the compiled
    path's ``Send``: the same fields) whenever the core
    has the send in hand - after an ACK the Python core takes, and before anything else
    moves ``last_heard`` (a BITMAP, a STOP); an ACK the compiled path took is read at
    the next poll or timer, and of several taken between two readings only the latest
    is a sample."""

    __slots__ = ("_control", "_datagram_bytes", "_heard", "_runs", "_tseq")

    def __init__(self, control: DelayRateControl, datagram_bytes: int):
        self._control = control
        self._datagram_bytes = datagram_bytes
        self._runs: deque[tuple[int, float]] = deque()  # (first tseq, when it went)
        self._tseq = -1  # the ack_tseq last read
        self._heard: float | None = None  # and when its ACK came (first: the first DATA)

    def sent(self, first_tseq: int, now: float) -> None:
        """A run of DATA from ``first_tseq`` on went at ``now``."""
        self._runs.append((first_tseq, now))
        if self._heard is None:
            self._heard = now

    def sent_at(self, tseq: int) -> float | None:
        """When the datagram ``tseq`` went (None: not one this send knows of). Runs an
        ACK has passed are let go (tseqs only grow)."""
        runs = self._runs
        while len(runs) > 1 and runs[1][0] <= tseq:
            runs.popleft()
        if not runs or runs[0][0] > tseq:
            return None
        return runs[0][1]

    def read(self, acks) -> None:
        """Sample what the ACKs moved since the last reading, if anything."""
        tseq = acks.ack_tseq
        if tseq <= self._tseq:
            return
        heard = acks.last_heard
        control = self._control
        moved = tseq - self._tseq  # datagrams the receiver's word moved past
        if self._heard is not None and heard > self._heard:
            # (datagrams passed, arrived or lost, not chunks delivered: random loss
            # must not read as a slower path, which would pull the rate down with it)
            control.delivery_sample(moved * self._datagram_bytes / (heard - self._heard))
        sent_at = self.sent_at(tseq)
        if sent_at is not None:
            control.rtt_sample(heard - sent_at, heard, moved * self._datagram_bytes)
        self._tseq, self._heard = tseq, heard


class DelayRateControl:
    """The sending rate toward one peer (kept in its ``PeerPath``, so that it lives
    across messages), decided from round-trip samples."""

    __slots__ = (
        "_decreased_at", "_delivered_before", "_epoch_delivered", "_epoch_start",
        "_armed", "_deepest", "_deepest_at", "_intervals", "_min_rtt_at", "_paced_since",
        "_since_event",
        "config", "cuts",
        "min_rtt", "rate", "senders", "srtt",
    )

    def __init__(self, config: DelayLoopConfig):
        self.config = config
        #: bytes/s the delay loop lets the peer's sends go at together; None: nothing
        #: has called for a limit yet (unpaced)
        self.rate: float | None = None
        #: the least round trip seen within min_rtt_window: the path without queueing
        self.min_rtt: float | None = None
        self._min_rtt_at = 0.0
        #: the round trips, smoothed (RFC 6298's gain): the floor's round trip
        self.srtt: float | None = None
        self._decreased_at = -math.inf
        # the best delivery rate the ACKs showed this span of delivery_rtts round trips
        # and the last (bytes/s), and when this span began
        self._epoch_delivered = 0.0
        self._delivered_before = 0.0
        self._epoch_start: float | None = None
        # since when the sends are paced (the first cut)
        self._paced_since = math.inf
        # the deepest queueing seen within min_rtt_window, and when
        self._deepest = 0.0
        self._deepest_at = 0.0
        # congestion events (the queue near its deepest): packets sent since the latest,
        # whether the queue has left "near full" since (a new fill), and the packets
        # between the events before (TFRC's loss intervals)
        self._since_event = 0.0
        self._armed = True
        self._intervals: deque[float] = deque(maxlen=EVENT_INTERVALS)
        #: the sends to this peer open now: they share the rate
        self.senders = 0
        #: cuts the loop made (for tests and reports)
        self.cuts = 0

    # ------------------------------------------------------------- what it says
    @property
    def delivery_rate(self) -> float:
        """The best delivery rate (bytes/s) the ACKs showed lately (0: none yet)."""
        return max(self._epoch_delivered, self._delivered_before)

    def fair_floor(self) -> float:
        """The TCP-fair rate (bytes/s) at the congestion events seen lately; 0 before
        any, and once floor_lapse intervals' worth went by with none (nobody fills the
        queue any more)."""
        srtt = self.srtt
        if srtt is None or not self._intervals:
            return 0.0
        cfg = self.config
        # (not TFRC's open interval, which grows the floor while no loss comes: alone on
        # a path that would push the queue to the drop it then reads as congestion)
        interval = sum(self._intervals) / len(self._intervals)
        if self._since_event > cfg.floor_lapse * interval:
            return 0.0
        return cfg.floor_gain * cfg.packet_bytes / srtt * math.sqrt(TCP_FAIR * max(1.0, interval))

    def pacing_rate(self) -> float | None:
        """What the peer's sends together may go at now (bytes/s; None: unpaced)."""
        if self.rate is None:
            return None
        return max(self.rate, self.fair_floor())

    def send_rate(self) -> float | None:
        """What one open send to this peer may go at (bytes/s; None: unpaced)."""
        rate = self.pacing_rate()
        return None if rate is None else rate / max(1, self.senders)

    def bucket(self, rate: float, datagram_bytes: int) -> float:
        """The pacing bucket (bytes) at ``rate``: short bursts, as the samples read any
        burst's queueing as congestion."""
        return max(2.0 * datagram_bytes, rate * self.config.bucket_time)

    # ------------------------------------------------------------------ samples
    def delivery_sample(self, rate: float) -> None:
        """One send's ACKs show the receiver taking ``rate`` bytes/s of its DATA (the
        peer's open sends share the rate evenly: the peer takes about that many times
        as much)."""
        self._epoch_delivered = max(self._epoch_delivered, rate * max(1, self.senders))

    def rtt_sample(self, rtt: float, now: float, acked_bytes: float = 0.0) -> None:
        """A round trip of ``rtt`` seconds, measured at ``now``; ``acked_bytes`` of DATA
        the receiver's word moved past since the last sample (arrived, or lost on the
        way). The rate's decision."""
        if rtt <= 0:
            return
        cfg = self.config
        if (self.min_rtt is None or rtt <= self.min_rtt
                or now - self._min_rtt_at > cfg.min_rtt_window):
            self.min_rtt, self._min_rtt_at = rtt, now
        self.srtt = rtt if self.srtt is None else 0.875 * self.srtt + 0.125 * rtt
        self._delivery_span(now)
        queueing = rtt - self.min_rtt
        congested = queueing > cfg.target_queue_delay
        self._since_event += acked_bytes / cfg.packet_bytes  # (in packets, as TCP's p)
        if now - rtt >= self._paced_since and (
                queueing > self._deepest or now - self._deepest_at > cfg.min_rtt_window):
            # (only from datagrams sent paced: an unpaced burst of a whole poll's
            # datagrams waits in the sender's own link, and its samples would set the
            # deepest past any fill to come)
            self._deepest, self._deepest_at = queueing, now
        full = (queueing >= cfg.near_full * self._deepest
                and queueing >= cfg.full_above * cfg.target_queue_delay)
        if full and self._armed:
            # the queue is as full as it gets - where a drop-tail queue drops, and a
            # loss-based flow cuts: a congestion event (once per fill: it stays full for
            # round trips)
            self._intervals.append(self._since_event)
            self._since_event = 0.0
        self._armed = not full
        if congested:
            if now - self._decreased_at >= rtt:  # (once per round trip)
                excess = (queueing - cfg.target_queue_delay) / rtt
                self._cut(max(1.0 - cfg.decrease_gain * excess, 1.0 - cfg.max_decrease), now)
        elif self.rate is not None:
            # one packet's worth of window per round trip of data acknowledged (a
            # window's worth), as TCP's window grows: an idle spell grows it by nothing
            window = self.rate * rtt
            grow = cfg.packet_bytes / rtt * (acked_bytes / window)
            self.rate += min(grow, cfg.max_increase * self.rate)
            delivered = self.delivery_rate
            if delivered > 0:  # (no further ahead of what the path takes than a probe)
                self.rate = min(self.rate, cfg.probe_gain * delivered)

    def _cut(self, keep: float, now: float) -> None:
        # (a cut starts from what the receiver is taking, where that is less than the
        # rate: the rate of unpaced sends, or one the window held them under, is not
        # what went through)
        delivered = self.delivery_rate
        base = delivered if self.rate is None else min(self.rate, delivered or self.rate)
        if base <= 0:
            return  # nothing measured to cut from yet: the next sample will have it
        if self.rate is None:
            self._paced_since = now
        self.rate = max(self.config.min_rate, base * keep)
        self._decreased_at = now
        self.cuts += 1

    def _delivery_span(self, now: float) -> None:
        """Start a new span of delivery_rtts round trips for the delivery rate when the
        current one is over."""
        span = self.config.delivery_rtts * (self.srtt or 0.0)
        if self._epoch_start is None:
            self._epoch_start = now
        elif now - self._epoch_start >= span:
            self._delivered_before, self._epoch_delivered = self._epoch_delivered, 0.0
            self._epoch_start = now
