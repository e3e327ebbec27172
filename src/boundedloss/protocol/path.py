"""PeerPath: what one endpoint has learned about the path to and from one peer.

The mux keeps one per peer and hands it to every send and receive with that peer. A new
send starts from it (the round trip and delivery rate earlier sends measured, and the
loss a receive from that peer saw lately); a finished send or receive adds what it
measured. Sans-I/O: times are whatever clock drives the core.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

#: delivery-rate samples kept per peer (a few messages' passes)
RATE_SAMPLES = 8
#: how long the loss a receive from a peer saw stands for the way back of sends to it
#: (a microburst lasts a round or so)
LOSS_MEMORY = 0.5


@dataclass(frozen=True, slots=True)
class RttEstimate:
    """A smoothed round trip and its variation (RFC 6298's SRTT and RTTVAR), seconds."""

    srtt: float
    rttvar: float


class PeerPath:
    __slots__ = ("_loss_seen", "_rates", "peer", "rtt")

    def __init__(self, peer: Hashable):
        self.peer = peer
        #: the round trip the latest finished send to this peer had measured
        self.rtt: RttEstimate | None = None
        # the delivery-rate samples of the latest passes to this peer (old ones age out)
        self._rates: deque[float] = deque(maxlen=RATE_SAMPLES)
        # (loss, when): what the latest closed receive from this peer saw
        self._loss_seen: tuple[float, float] | None = None

    def best_rate(self) -> float | None:
        """The best delivery rate (bytes/s) of the recent passes, None before any."""
        return max(self._rates) if self._rates else None

    def reverse_loss(self, now: float) -> float | None:
        """The loss our latest receive from the peer saw, if it closed lately: a send to
        the peer gets its answers back along that way (a microburst at our receiver loses
        them), which the send's own ACKs may not show in time for its first PROBE."""
        seen = self._loss_seen
        if seen is None or now - seen[1] > LOSS_MEMORY:
            return None
        return seen[0]

    def send_finished(self, rtt: RttEstimate | None, rate_samples: Iterable[float]) -> None:
        if rtt is not None:
            self.rtt = rtt
        self._rates.extend(rate_samples)

    def receive_closed(self, loss: float | None, now: float) -> None:
        if loss is not None:
            self._loss_seen = (loss, now)
