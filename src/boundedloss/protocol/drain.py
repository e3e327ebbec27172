"""DrainBudget: a receiver's credit budget from its measured drain rate and round trip.

A fixed credit budget (``TransportConfig.credit_bytes``) must be sized by hand: under a
shallow queue it must fit the queue, and where nothing overflows it must be large
enough not to hold the senders back - on a CPU-bound host the round trip is the ranks'
turns, milliseconds, and a budget of a few hundred KB slows a round by a third
(BENCHMARKS.md). With ``credit_adaptive`` the receiver sizes it itself, as BBR sizes a
window: twice the best drain rate of its recent first passes times the least round
trip its paths to the senders have shown.

A *phase* is a spell in which this receiver's budget is shared - from the first heard
receive to the moment none is left (each first pass over, or closed): a round of a
collective's pushes into a parameter server, or of its N - 1 shards into an owner. A
drain-rate sample is the DATA datagrams the receives took over the phases' lengths,
phases added up until they hold ``SAMPLE_DATAGRAMS`` (a short one's length is mostly a
round trip). The round trip is the smoothed one of the latest finished send to each
sender (``PeerPath.rtt``), the least over recent phases: on a CPU-bound host it holds
the ranks' turns, which is what a budget there must cover. It also holds what queues in
front of the receiver - the budget's own queue - which is why the gain stays at 2:
more widens the queue it fills (a simulated rack incast: 1.01x the ideal round at gain
1, 1.37x at 2, 1.45x at 3), less leaves no room to grow a budget that holds senders
back (lossless rounds simulated as on the kernel testbed: 4% over no credit at gain 1,
2% at 2).

The budget starts unbounded (``UNMEASURED``): where nothing overflows, nothing changes.
Where an incast overflows a queue, the first phase pays: as soon as its first receive
is done the budget drops - to the floor while no round trip is known (no send to these
peers has finished yet) - so that its senders' next messages start from a small grant,
and the phases after it fit. It never drops below ``floor``. Sans-I/O: the credit
grants feed it as each receive's first pass ends.
"""

from __future__ import annotations

import math
from collections import deque

#: the budget before any phase has been measured: no bound
UNMEASURED = 1 << 30  # (a share is stamped in a 32-bit field)
#: the budget over the bandwidth-delay product it is read from (room for the
#: self-clock's ACKs in flight, and to see a faster path)
GAIN = 2.0
#: drain-rate samples remembered: the budget reads the best of these
SAMPLES = 8
#: round trips remembered (one a phase): the budget reads the least of these
PHASES = 8
#: a drain-rate sample spans phases until they have taken this many datagrams (a short
#: phase's length is mostly a round trip, not the drain)
SAMPLE_DATAGRAMS = 64


class DrainBudget:
    """The budget, in DATA datagrams, that the latest phases' drain rates and round
    trips call for (``budget``); ``floor`` the least it may be."""

    __slots__ = ("_rates", "_rtts", "_taken", "_took", "budget", "floor")

    def __init__(self, floor: int):
        if floor < 1:
            raise ValueError("a budget's floor holds at least one datagram")
        self.floor = floor
        self.budget = UNMEASURED
        self._rates: deque[float] = deque(maxlen=SAMPLES)  # datagrams/s
        self._rtts: deque[float] = deque(maxlen=PHASES)  # seconds
        # the phases since the last rate sample: datagrams taken, seconds they took
        self._taken = 0
        self._took = 0.0

    def phase_ended(self, datagrams: int, seconds: float, rtt: float | None) -> int:
        """A phase took ``datagrams`` over ``seconds``, its senders' least round trip
        ``rtt`` (None: none known yet); the budget from now on."""
        budget = self.phase_so_far(datagrams, seconds, rtt)
        self._taken += datagrams
        self._took += max(0.0, seconds)
        if self._taken >= SAMPLE_DATAGRAMS and self._took > 0:
            self._rates.append(self._taken / self._took)
            self._taken, self._took = 0, 0.0
        if rtt is not None and rtt > 0:
            self._rtts.append(rtt)
        return budget

    def phase_so_far(self, datagrams: int, seconds: float, rtt: float | None) -> int:
        """The phase under way has taken ``datagrams`` in ``seconds`` so far (its
        senders' least round trip ``rtt``): the budget for the rest of it, from those
        and the phases before - so that a first phase that overflowed does not hand its
        senders an unbounded grant to start their next messages from."""
        rates = list(self._rates)
        taken, took = self._taken + datagrams, self._took + max(0.0, seconds)
        if taken >= SAMPLE_DATAGRAMS and took > 0:
            rates.append(taken / took)
        rtts = list(self._rtts)
        if rtt is not None and rtt > 0:
            rtts.append(rtt)
        if rates:
            # (no round trip known yet - no send to these peers has finished - the floor:
            # an unbounded grant now would be where the senders' next messages start)
            self.budget = (max(self.floor, math.ceil(GAIN * max(rates) * min(rtts))) if rtts
                           else self.floor)
        return self.budget
