"""PeerPath: what one endpoint has learned about the path to and from one peer.

The mux keeps one per peer and hands it to every send and receive with that peer. A new
send starts from it (the round trip and delivery rate earlier sends measured, and the
loss a receive from that peer saw lately); a finished send or receive adds what it
measured. With congestion control on, it keeps the rate sends to the peer may go at
(``congestion``): it is learned across messages, as the round trip is. Sans-I/O: times
are whatever clock drives the core.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .congestion import DelayLoopConfig, DelayRateControl

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
    __slots__ = ("_loss_seen", "_rates", "congestion", "granted", "peer", "rtt")

    def __init__(self, peer: Hashable, delay_loop: DelayLoopConfig | None = None):
        """``delay_loop``: the congestion control's (TransportConfig.delay_loop; None:
        off)."""
        self.peer = peer
        #: the round trip the latest finished send to this peer had measured
        self.rtt: RttEstimate | None = None
        # the delivery-rate samples of the latest passes to this peer (old ones age out;
        # a tuple: a simulated job keeps a path per pair of ranks, an empty deque 600 B)
        self._rates: tuple[float, ...] = ()
        # (loss, when): what the latest closed receive from this peer saw
        self._loss_seen: tuple[float, float] | None = None
        #: the credit the peer granted the latest finished send to it (credit.py): the
        #: next send's first pass goes that far ahead of its own first grant
        self.granted: int | None = None
        #: the rate sends to this peer may go at, and the delay loop that sets it (None:
        #: no congestion control)
        self.congestion = None if delay_loop is None else DelayRateControl(delay_loop)

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

    def send_finished(self, rtt: RttEstimate | None, rate_samples: Iterable[float],
                      granted: int | None = None) -> None:
        if rtt is not None:
            self.rtt = rtt
        samples = tuple(rate_samples)
        if samples:
            self._rates = (self._rates + samples)[-RATE_SAMPLES:]
        if granted is not None:
            self.granted = granted

    def receive_closed(self, loss: float | None, now: float) -> None:
        if loss is not None:
            self._loss_seen = (loss, now)

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What is worth keeping across a restart, as plain values: the round trip
        (the RTO follows from it) and the recent delivery rates. Not the loss a receive
        saw lately: it stands for half a second of a clock the next process does not
        share."""
        rtt = self.rtt
        return {"srtt": None if rtt is None else rtt.srtt,
                "rttvar": None if rtt is None else rtt.rttvar,
                "rates": list(self._rates)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values; ``ValueError`` (nothing changed) for a
        round trip or a rate that is not a finite number >= 0."""
        srtt, rttvar = state["srtt"], state["rttvar"]
        rtt = None if srtt is None else RttEstimate(_non_negative("srtt", srtt),
                                                     _non_negative("rttvar", rttvar))
        rates = [_non_negative("rate", r) for r in state["rates"]][-RATE_SAMPLES:]
        self.rtt = rtt
        self._rates = tuple(rates)


def _non_negative(name: str, value: Any) -> float:
    """A learned non-negative, finite number (a time, a rate)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    x = float(value)
    if not 0.0 <= x < math.inf:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return x
