"""What a simulated host's CPU spends, and the cores it spends it on.

A host of a :class:`~.fake.FakeNetwork` with :class:`CpuCosts` does its work on two
threads, as a rank does: its I/O thread (taking in each datagram, sending each one)
and its main thread (posting and finishing each message). Each thread does one thing
at a time; both run on cores that the host has to itself or shares with other hosts
(:class:`Cores`: on a machine with fewer cores than ranks, the ranks wait for each
other's work). Without costs a host computes in no time. Cores may also lose time to
what the simulation does not run (:class:`Interference`): other processes, the
kernel's own work, the scheduler's slices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CpuCosts:
    """Seconds of CPU per unit of work."""

    #: the I/O thread, per datagram taken in and per byte of it (system calls, checks,
    #: the tag, the copy)
    datagram_in: float = 0.0
    byte_in: float = 0.0
    #: the I/O thread, per datagram sent and per byte of it (sealing, the system call,
    #: the kernel's path to the wire)
    datagram_out: float = 0.0
    byte_out: float = 0.0
    #: per message posted: the main thread's share (posting, waiting, aggregating) and
    #: the I/O thread's (its timers, its result, the loop's passes for it)
    message_main: float = 0.0
    message_io: float = 0.0
    #: per posting call (a batch of a round's receives or sends, however many): what a
    #: round costs whatever the world's size - the lock, the wake, the loop's passes
    post_main: float = 0.0
    post_io: float = 0.0
    #: the I/O thread, per datagram the Python core handles itself, after taking it in:
    #: what the compiled data path hands it (a receive's closing DATA, a send's STOP; under
    #: loss the BITMAPs that decide retransmissions, PROBEs that change a receive's
    #: state) - every datagram where there is no compiled path. Loss shows here: it
    #: hands the core more of them.
    datagram_core: float = 0.0

    def receive(self, nbytes: int) -> float:
        return self.datagram_in + nbytes * self.byte_in

    def send(self, nbytes: int) -> float:
        return self.datagram_out + nbytes * self.byte_out


@dataclass(frozen=True)
class Interference:
    """Time each core loses to work the simulation does not run: spells of it arrive at
    random (a Poisson process, ``rate_hz`` a second on each core) and each lasts a random
    time (exponential, ``mean_s`` on average). On a machine that runs a job's every rank
    on a few cores, round times spread even where nothing is random (a bare loop with no
    Python spreads as much); this is the simulation's stand-in for that spread."""

    rate_hz: float
    mean_s: float

    def __post_init__(self) -> None:
        if not (0 <= self.rate_hz < math.inf and 0 <= self.mean_s < math.inf):
            raise ValueError(f"interference needs a finite rate and mean duration, 0 or "
                             f"more, not {self.rate_hz} Hz and {self.mean_s} s")

    @property
    def active(self) -> bool:
        return self.rate_hz > 0 and self.mean_s > 0

    @classmethod
    def parse(cls, text: str) -> Interference:
        """``RATE,MEAN_MS`` (spells a second on each core, their mean length in ms), or
        ``off``."""
        if text.strip() == "off":
            return cls(0.0, 0.0)
        parts = text.split(",")
        try:
            rate, mean_ms = (float(v) for v in parts)
        except ValueError:
            raise ValueError(f"{text!r}: give RATE,MEAN_MS (spells a second on each core, "
                             "their mean length in ms), e.g. 5,4, or off") from None
        return cls(rate, mean_ms * 1e-3)

    def describe(self) -> str:
        return f"{self.rate_hz:g}/s x {self.mean_s * 1e3:g} ms"

    @property
    def share(self) -> float:
        """The share of a core's time it takes, in the long run."""
        return self.rate_hz * self.mean_s / (1 + self.rate_hz * self.mean_s)


def parse_wake_ms(text: str) -> float:
    """A woken thread's wait (``NodeProfile.wake_s``) given in ms, as seconds."""
    try:
        ms = float(text)
    except ValueError:
        ms = math.nan
    if not 0 <= ms < math.inf:
        raise ValueError(f"{text!r}: give a time in ms, 0 or more")
    return ms * 1e-3


#: how far ahead of the work placed a core's interference is drawn (virtual seconds):
#: drawn in steps, so that what is placed never reaches past what was drawn
_DRAW_AHEAD = 0.05
#: (in the seed of the cores' own random stream, apart from the network's)
_STREAM = 0xC0E5


class Cores:
    """``count`` cores, each with the intervals it is busy: a piece of work runs on
    the core where it can start first once ready, in the first idle gap long enough
    (work is placed in the order the simulation meets it; a piece is not split).
    ``interference``: spells the cores lose, drawn from a random stream of their own
    (seeded with ``seed``), so that they change nothing else a simulation draws."""

    def __init__(self, count: int, interference: Interference | None = None,
                 seed: Sequence[int] = ()):
        if count < 1:
            raise ValueError(f"a host needs at least one core, not {count}")
        # per core, its busy intervals (start, end), in order, none touching another
        self._busy: list[list[tuple[float, float]]] = [[] for _ in range(count)]
        #: seconds of work run on these cores so far (all of them together)
        self.charged = 0.0
        self._interference = interference if interference and interference.active else None
        # per core, up to when its interference has been drawn (every spell drawn ends
        # by then, and no work placed ends after it)
        self._drawn = [0.0] * count
        # (a stream per core: what a core loses does not depend on the work placed)
        self._rngs = ([np.random.default_rng([*seed, count, _STREAM, core])
                       for core in range(count)] if self._interference else [])
        #: seconds the cores have lost to interference, of what has been drawn
        self.interfered = 0.0

    def _draw(self, core: int, until: float) -> None:
        """Draw ``core``'s interference to ``until`` and beyond (a step ahead)."""
        spec, rng = self._interference, self._rngs[core]
        assert spec is not None
        busy, t = self._busy[core], self._drawn[core]
        until += _DRAW_AHEAD
        while t < until:
            t += rng.exponential(1 / spec.rate_hz)
            lasts = rng.exponential(spec.mean_s)
            busy.append((t, t + lasts))  # (after all placed so far, which end by _drawn)
            self.interfered += lasts
            t += lasts
        self._drawn[core] = t

    def _first_gap(self, core: int, ready: float, seconds: float) -> tuple[float, int]:
        """Where on ``core`` work of ``seconds`` ready at ``ready`` would start, and the
        index of the interval it would go before."""
        busy = self._busy[core]
        while True:
            start, at = ready, len(busy)
            for i, (s, e) in enumerate(busy):
                if start + seconds <= s:
                    at = i
                    break
                start = max(start, e)
            if self._interference is None or start + seconds <= self._drawn[core]:
                return start, at
            self._draw(core, start + seconds)

    def all_busy(self, t: float) -> bool:
        """Whether every core is busy at ``t`` (with work, or with interference drawn by
        then)."""
        for busy in self._busy:
            for s, e in busy:
                if s > t:
                    return False
                if t < e:
                    break
            else:
                return False
        return True

    def run(self, ready: float, seconds: float, now: float) -> float:
        """Run ``seconds`` of work that is ready at ``ready`` (>= ``now``, the virtual
        clock, before which nothing is placed any more); when it is done."""
        best, best_start, best_at = 0, math.inf, 0
        for core, busy in enumerate(self._busy):
            while busy and busy[0][1] <= now:
                busy.pop(0)
            start, at = self._first_gap(core, ready, seconds)
            if start < best_start:
                best, best_start, best_at = core, start, at
        self.charged += seconds
        busy = self._busy[best]
        end = best_start + seconds
        # merge with the neighbours it touches, so that a thread's run of work stays one
        # interval
        lo, hi = best_start, end
        if best_at > 0 and busy[best_at - 1][1] >= lo:
            best_at -= 1
            lo = busy[best_at][0]
            del busy[best_at]
        if best_at < len(busy) and busy[best_at][0] <= hi:
            hi = busy[best_at][1]
            del busy[best_at]
        busy.insert(best_at, (lo, hi))
        return end
