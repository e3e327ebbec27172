"""What a send with no round trip of its own waits for its PROBE's answer.

A send's PROBE times out after the RTO its path's round trips call for (RFC 6298's
SRTT + 4 RTTVAR, within ``min_rto`` and ``max_rto``), read from the latest finished send
to the same peer. A path nothing has crossed yet - every path, in a job's first round -
has no round trip to read, and ``initial_rto`` (50 ms) stands for one. In a datacenter
that is hundreds of round trips: a first round's lost PROBE or STOP then costs the whole
round 50 ms (a cold 128-worker transpose allreduce round at 1% loss took 52.5 ms; with
the endpoint's round trips, below, 3.5).

But an endpoint's paths are alike - its peers are the job's other ranks, across the
same network - and its other sends measure round trips within microseconds of its first
datagrams going out. So a send whose path has no round trip of its own yet takes the
endpoint's: every round trip its sends have measured, over every peer, smoothed as one
path's are (:class:`RttPrior`), read when its PROBE goes - never longer than
``initial_rto``, and only while none of its PROBEs has timed out (then it backs off from
there as from its own). In a first round most PROBEs go before any answer has come back
(each rank's first pass to every peer at once), so when the endpoint's first round trip
is measured, the PROBEs then awaiting answers on paths of none are given the same
timeout, counted from when each went (``TransferMux``, once). A path whose round trips
run longer than the endpoint's (a receiver's queue filling under an incast) may see a
PROBE time out early: a PROBE again, one datagram, and the backoff.
"""

from __future__ import annotations

from .types import TransportConfig


class RttPrior:
    """The round trips an endpoint's sends have measured, over every peer, smoothed as
    one path's (RFC 6298's gains)."""

    __slots__ = ("_srtt", "_rttvar")

    def __init__(self) -> None:
        self._srtt: float | None = None
        self._rttvar = 0.0

    def sample(self, rtt: float) -> None:
        self._srtt, self._rttvar = smoothed(self._srtt, self._rttvar, rtt)

    @property
    def known(self) -> bool:
        """Whether any round trip has been measured."""
        return self._srtt is not None

    def rto(self, config: TransportConfig) -> float | None:
        """The RTO the endpoint's round trips call for (None: none measured yet)."""
        return None if self._srtt is None else rto_for(self._srtt, self._rttvar, config)


def smoothed(srtt: float | None, rttvar: float, sample: float) -> tuple[float, float]:
    """SRTT and RTTVAR after a round-trip ``sample`` (RFC 6298; with no SRTT yet: the
    sample and half of it)."""
    if srtt is None:
        return sample, sample / 2
    return 0.875 * srtt + 0.125 * sample, 0.75 * rttvar + 0.25 * abs(srtt - sample)


def rto_for(srtt: float, rttvar: float, config: TransportConfig) -> float:
    """The retransmission timeout they call for: SRTT + 4 RTTVAR, within ``min_rto`` and
    ``max_rto``."""
    return min(config.max_rto, max(config.min_rto, srtt + 4 * rttvar))
