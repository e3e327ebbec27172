"""What a simulated host's CPU spends, and the cores it spends it on.

A host of a :class:`~.fake.FakeNetwork` with :class:`CpuCosts` does its work on two
threads, as a rank does: its I/O thread (taking in each datagram, sending each one)
and its main thread (posting and finishing each message). Each thread does one thing
at a time; both run on cores that the host has to itself or shares with other hosts
(:class:`Cores`: on a machine with fewer cores than ranks, the ranks wait for each
other's work). Without costs a host computes in no time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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


class Cores:
    """``count`` cores, each with the intervals it is busy: a piece of work runs on
    the core where it can start first once ready, in the first idle gap long enough
    (work is placed in the order the simulation meets it; a piece is not split)."""

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"a host needs at least one core, not {count}")
        # per core, its busy intervals (start, end), in order, none touching another
        self._busy: list[list[tuple[float, float]]] = [[] for _ in range(count)]
        #: seconds of work run on these cores so far (all of them together)
        self.charged = 0.0

    def run(self, ready: float, seconds: float, now: float) -> float:
        """Run ``seconds`` of work that is ready at ``ready`` (>= ``now``, the virtual
        clock, before which nothing is placed any more); when it is done."""
        best, best_start, best_at = 0, math.inf, 0
        for core, busy in enumerate(self._busy):
            while busy and busy[0][1] <= now:
                busy.pop(0)
            start, at = ready, len(busy)
            for i, (s, e) in enumerate(busy):
                if start + seconds <= s:
                    at = i
                    break
                start = max(start, e)
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
