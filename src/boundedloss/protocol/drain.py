"""DrainBudget: a receiver's credit budget, from the overflows it sees and its measured
drain rate and round trip (``--credit auto``).

A fixed credit budget (``TransportConfig.credit_bytes``) must be sized by hand: under a
shallow queue it must fit the queue, and where nothing overflows it must be large
enough not to hold the senders back - on a CPU-bound host the round trip is the ranks'
turns, milliseconds, and a budget of a few hundred KB slows a round by a third
(BENCHMARKS.md). With ``credit_adaptive`` each receiver sizes its own.

A *phase* is a spell in which the receiver's budget is shared: from the first heard
receive to the moment none is left (each first pass over, or closed) - a round of a
collective's pushes into a parameter server, or of its N - 1 shards into an owner. At
its end the receiver knows what its senders' first passes sent (the highest sequence
number each showed) and what arrived of it. Random loss is in every phase alike; a
queue's overflow only in the phases the budget overfills. So a phase *overflowed* when
it lost more than the least loss of the recent phases by ``OVERFLOW_MARGIN`` and three
standard deviations of that least loss over its datagrams (the first phase, with
nothing to compare with, when it lost a quarter).

The budget starts unbounded: where nothing overflows it stays so, and costs nothing but
the credit's own ACKs. An overflow cuts it - to at most ``CAP_CUT`` of what the drain
rate and the round trip call for (twice the best recent drain rate times the least
recent round trip: the smoothed one of the latest finished send to each sender; the
floor while none is known), deeper where more was lost. Each phase that does not
overflow grows it by ``CAP_GROWTH`` while an overflow is in recent memory, and doubles
it once none is: slowly near a queue's edge, so that overflows stay rare, and back to
no bound after a lone one (a burst of random loss, say). The round trip sets where a
cut starts, never how far the budget grows back: at a full queue it holds the queue's
own delay.

The first phase of an incast overflows before any round trip is known: the cut comes
as soon as one of its receives is done, so that its senders' next messages start from
a small grant, not an unbounded one. Sans-I/O: the credit grants feed it as each
receive's first pass ends.
"""

from __future__ import annotations

import math
from collections import deque

#: the budget before any phase has been measured: no bound
UNMEASURED = 1 << 30  # (a share is stamped in a 32-bit field)
#: a cut starts from this times the bandwidth-delay product (room for the self-clock's
#: ACKs in flight)
GAIN = 2.0
#: drain-rate samples remembered: a cut reads the best of these
SAMPLES = 8
#: round trips and first-pass losses remembered (one each a phase)
PHASES = 8
#: a drain-rate sample spans phases until they have taken this many datagrams (a short
#: phase's length is mostly a round trip, not the drain), and a loss read until they
#: have sent this many
SAMPLE_DATAGRAMS = 64
#: a phase overflowed a queue when its first passes lost more than the least of the
#: recent phases by this and three standard deviations of that least loss over the
#: phase's datagrams: random loss is in every phase alike, a queue's only in those the
#: budget overfills
OVERFLOW_MARGIN = 0.02
#: the first phase, with nothing to compare with, overflowed when it lost this much (an
#: incast's first round loses half or more; random loss, a few percent)
FIRST_OVERFLOW = 0.25
#: an overflow cuts the budget to at most this of itself (CUBIC's cut), deeper where
#: more was lost
CAP_CUT = 0.7
#: a phase that did not overflow grows the budget by this while an overflow is among
#: the last OVERFLOW_MEMORY phases, and doubles it once none is - slowly near a queue's
#: edge, so that overflows stay rare, and back to no bound after a lone one
CAP_GROWTH = 1.06
OVERFLOW_MEMORY = 32


class DrainBudget:
    """The budget, in DATA datagrams (``budget``): no bound until a phase overflows a
    queue, then cut - from what the drain rate and round trip measured call for - and
    grown back phase by phase; ``floor`` the least it may be."""

    __slots__ = ("_got", "_losses", "_overflows", "_rates", "_rtts", "_sent", "_taken",
                 "_took", "budget", "floor")

    def __init__(self, floor: int):
        if floor < 1:
            raise ValueError("a budget's floor holds at least one datagram")
        self.floor = floor
        self.budget = UNMEASURED
        self._rates: deque[float] = deque(maxlen=SAMPLES)  # datagrams/s
        self._rtts: deque[float] = deque(maxlen=PHASES)  # seconds
        self._losses: deque[float] = deque(maxlen=PHASES)  # of the first passes' datagrams
        self._overflows: deque[bool] = deque(maxlen=OVERFLOW_MEMORY)  # which overflowed
        # the phases since the last rate sample: datagrams taken, seconds they took
        self._taken = 0
        self._took = 0.0
        # the phases since the last loss read: datagrams got, of those sent
        self._got = 0
        self._sent = 0

    def measured(self, rtt: float | None = None) -> int:
        """The budget the drain rate and round trip call for: GAIN x the best recent rate
        x the least recent round trip, or ``rtt`` if less (the floor while either is
        unknown)."""
        rtts = [*self._rtts, *([rtt] if rtt is not None and rtt > 0 else [])]
        if not self._rates or not rtts:
            return self.floor
        return max(self.floor, math.ceil(GAIN * max(self._rates) * min(rtts)))

    def overflowed(self, taken: int, sent: int) -> bool:
        """Did a phase whose first passes got ``taken`` of ``sent`` datagrams overflow?"""
        loss = max(0.0, 1.0 - taken / sent)
        if not self._losses:
            return loss > FIRST_OVERFLOW
        least = min(self._losses)
        return loss > least + OVERFLOW_MARGIN + 3 * math.sqrt(least * (1 - least) / sent)

    def phase_ended(self, datagrams: int, sent: int, seconds: float,
                    rtt: float | None) -> int:
        """A phase took ``datagrams`` of the ``sent`` its senders sent (as far as the
        sequence numbers tell) over ``seconds``, its senders' least round trip ``rtt``
        (None: none known yet); the budget from now on."""
        self._taken += datagrams
        self._took += max(0.0, seconds)
        if self._taken >= SAMPLE_DATAGRAMS and self._took > 0:
            self._rates.append(self._taken / self._took)
            self._taken, self._took = 0, 0.0
        if rtt is not None and rtt > 0:
            self._rtts.append(rtt)
        # (short phases add up, as for the rate)
        self._got += datagrams
        self._sent += sent
        if self._sent < SAMPLE_DATAGRAMS:
            return self.budget
        got, sent = self._got, self._sent
        self._got = self._sent = 0
        over = self.overflowed(got, sent)
        if over:
            self._cut(got, sent)
        else:
            # (not up to what the round trip calls for: at a full queue it holds the
            # queue's delay, and would widen the budget that fills it)
            grown = self.budget * (CAP_GROWTH if any(self._overflows) else 2)
            self.budget = min(UNMEASURED, math.ceil(grown))
        self._overflows.append(over)
        self._losses.append(max(0.0, 1.0 - got / sent))
        return self.budget

    def phase_so_far(self, datagrams: int, sent: int, rtt: float | None) -> int:
        """The phase under way has got ``datagrams`` of ``sent`` so far: an overflow
        plain already (the first phase, with no round trip known, say) cuts the budget
        now, so that its senders' next messages do not start from an unbounded grant."""
        if (self.budget == UNMEASURED and sent >= SAMPLE_DATAGRAMS and not self._losses
                and self.overflowed(datagrams, sent)):
            self._cut(datagrams, sent, rtt)
        return self.budget

    def _cut(self, taken: int, sent: int, rtt: float | None = None) -> None:
        loss = max(0.0, 1.0 - taken / sent)
        base = min(self.budget, self.measured(rtt))
        self.budget = max(self.floor, int(base * min(CAP_CUT, 1.0 - loss)))
