"""Pacer: how fast one send lets its DATA out, and the delivery rate it measures.

DATA is paced by a token bucket when the configuration sets a fixed rate
(``rate_bps``), or - with ``retransmit_pacing_gain`` - retransmission passes go out at
that many times the best delivery rate the peer has shown lately: under incast every
sender's missing chunks otherwise go out at once into the queue that just dropped them.
With congestion control on (``congestion``, the peer's ``DelayRateControl``), every pass
- the first too - goes at most at the rate that loop sets for the peer, split among its
open sends (the lower of the two where both pace a retransmission). Each answered pass
gives a delivery-rate sample: what it got through over the time from its first DATA to
the answer. Sans-I/O: the sender feeds it ``now``.
"""

from __future__ import annotations

from .congestion import DelayRateControl
from .types import TransportConfig

#: an adaptive pacing rate (bytes/s) above this is no pacing at all: 10 Gbit/s is beyond
#: what one Python sender can put out, and timers at such rates only cost
UNPACED_ABOVE = 1.25e9


class Pacer:
    __slots__ = ("_best_rate", "_config", "_congestion", "_datagram_bytes", "_floor",
                 "_tokens", "_tokens_at", "paced_until", "rate_samples")

    def __init__(self, config: TransportConfig, datagram_bytes: int, now: float,
                 best_rate: float | None = None,
                 congestion: DelayRateControl | None = None):
        self._config = config
        self._congestion = congestion  # the peer's rate (None: no congestion control)
        self._datagram_bytes = datagram_bytes  # a full DATA datagram, header included
        self._tokens = 0.0
        self._tokens_at = now
        #: with the bucket empty, when it will let the next datagram out (a timer)
        self.paced_until: float | None = None
        # the best delivery rate (bytes/s) of recent messages to this peer and this
        # send's own passes: a lossy pass alone would pace a burst of random loss as if
        # it were congestion
        self._best_rate = best_rate or 0.0
        #: this send's delivery-rate samples, one per answered pass
        self.rate_samples: list[float] = []
        self._floor = 0.0  # the least rate pacing may use (see pass_answered)

    @property
    def best_rate(self) -> float:
        return self._best_rate

    def allow(self, now: float, k: int, first_pass: bool) -> int:
        """How many of ``k`` datagrams may go now. When none may, ``paced_until`` says
        when one will, and until then the sender has no data to offer (a driver would
        otherwise poll it in a loop)."""
        pacing = self._rate_and_bucket(first_pass)
        if pacing is None:
            return k
        rate, burst = pacing
        self._tokens = min(burst, self._tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        size = self._datagram_bytes
        # (a hundredth of a datagram of slack: at the instant the timer named, float
        # rounding can leave the bucket a hair short, and a virtual clock would spin
        # there forever)
        k = min(k, int((self._tokens + 0.01 * size) // size))
        self._tokens -= k * size
        self.paced_until = None if k else now + (size - self._tokens) / rate
        return k

    def timer_fired(self, now: float) -> None:
        if self.paced_until is not None and now >= self.paced_until:
            self.paced_until = None  # the bucket has a datagram's worth again

    def pass_answered(self, now: float, got: int, started_at: float | None, unrepeated: bool,
                      still_queued: int, rto_base: float) -> None:
        """A pass's PROBE was answered at ``now``: ``got`` of its datagrams arrived since
        ``started_at``; ``unrepeated``: its first PROBE was the one answered (a repeated
        one's time holds timeouts); ``still_queued``: datagrams the next pass will send."""
        size = self._datagram_bytes
        if got > 0 and unrepeated and started_at is not None and now > started_at:
            sample = got * size / (now - started_at)
            self.rate_samples.append(sample)
            self._best_rate = max(self._best_rate, sample)
        # however slow the samples say the peer is, pacing never stretches the pass this
        # answer starts beyond two RTOs
        self._floor = still_queued * size / (2 * rto_base)

    def _rate_and_bucket(self, first_pass: bool) -> tuple[float, float] | None:
        """(rate in bytes/s, bucket in bytes) DATA is paced at now, or None."""
        cfg = self._config
        if cfg.rate_bps is not None:
            return cfg.rate_bps / 8.0, max(self._datagram_bytes, 64 * 1024)
        retransmit = self._retransmit_rate(first_pass)
        congestion = self._congestion
        limit = None if congestion is None else congestion.send_rate()
        if congestion is not None and limit is not None and limit < UNPACED_ABOVE:
            rate = limit if retransmit is None else min(limit, retransmit)
            return rate, congestion.bucket(rate, self._datagram_bytes)
        if retransmit is None:
            return None
        rate = retransmit
        # a millisecond's worth at once, at least 8 datagrams: small enough that the
        # senders of an incast do not refill the queue in one go, large enough that a
        # fast path is not slowed by a timer per datagram
        return rate, max(8 * self._datagram_bytes, rate * 1e-3)

    def _retransmit_rate(self, first_pass: bool) -> float | None:
        """The rate ``retransmit_pacing_gain`` paces this pass at (None: unpaced)."""
        cfg = self._config
        if first_pass or cfg.retransmit_pacing_gain is None:
            return None
        if self._best_rate <= 0.0:
            return None  # nothing measured yet
        rate = max(self._best_rate * cfg.retransmit_pacing_gain, self._floor)
        if rate >= UNPACED_ABOVE:
            return None  # faster than pacing could matter
        return rate
