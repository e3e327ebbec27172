"""Background traffic: other tenants' datagrams on a FakeNetwork's links and queues.

A cluster's links and switch buffers are not one job's alone. Here every host carries
an open-loop source (it sends on whatever the network does) whose long-run load is
``rate`` times its link's rate, in datagrams that fill one packet of the MTU:

- ``poisson``: datagrams as a Poisson process (exponential gaps), each to a host drawn
  uniformly among the others;
- ``onoff``: the classic on/off source - ON periods at the link's full rate, OFF periods
  silent, both exponential, the mean ON period ``on_us`` and the mean OFF period
  ``on_us x (1 - rate) / rate``, so that the load is ``rate``; each ON period is one
  flow, to one host drawn uniformly;
- ``pareto``: the same with Pareto periods of ``shape`` (1 < shape <= 2: a finite mean,
  an infinite variance) - superposed, such sources make the self-similar traffic
  measured on real LANs (Willinger, Taqqu, Sherman and Wilson, 1997).

With ``toward``, every host's source sends to that rank's host (which sends none):
another tenant's incast on one switch port. A source starts ON with the probability
``rate`` (its long-run share of time ON; exact for exponential periods, which have no
memory). Each source draws from its own stream of the seed, so a run is deterministic.

What the network does with the datagrams (``FakeNetwork.add_background``): they take
their host's uplink in turn with what the job sends (one FIFO, as a NIC's), the path's
delay, the spine's links, and the switch's queue toward their destination (and its
shared buffer) - where a full queue drops them, as it drops the job's. They meet no
path loss (their drops come only from queues), cost no CPU, and are counted apart.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from .fake import FakeNetwork

PATTERNS = ("poisson", "onoff", "pareto")
FORM = "RATE[:poisson|onoff|pareto][,on_us=US][,shape=A][,to=RANK]"
#: a stream of the seed that only background sources draw from
_STREAM = 0xB6


@dataclass(frozen=True)
class BackgroundTraffic:
    #: each host's mean load, a fraction of its link's rate (0: none)
    rate: float
    pattern: str = "poisson"
    #: the mean ON period, microseconds (onoff, pareto)
    on_us: float = 100.0
    #: the Pareto periods' shape (pareto)
    shape: float = 1.5
    #: every source sends to this rank's host (None: each to hosts drawn uniformly)
    toward: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rate < 1:
            raise ValueError(f"the rate is a fraction of the link's rate in [0, 1), not "
                             f"{self.rate:g}")
        if self.pattern not in PATTERNS:
            raise ValueError(f"{self.pattern!r} is no pattern: {', '.join(PATTERNS)}")
        if not (0 < self.on_us < math.inf):
            raise ValueError(f"on_us must be positive, not {self.on_us:g}")
        if not 1 < self.shape <= 2:
            raise ValueError(f"shape must be in (1, 2] (a finite mean), not {self.shape:g}")
        if self.toward is not None and self.toward < 0:
            raise ValueError(f"to must be a rank, not {self.toward}")

    def __str__(self) -> str:
        """The spec, as parse_background reads it (every setting that matters)."""
        text = f"{self.rate:g}:{self.pattern}"
        if self.pattern != "poisson":
            text += f",on_us={self.on_us:g}"
        if self.pattern == "pareto":
            text += f",shape={self.shape:g}"
        if self.toward is not None:
            text += f",to={self.toward}"
        return text


def parse_background(spec: str) -> BackgroundTraffic:
    """``RATE[:PATTERN][,on_us=US][,shape=A][,to=RANK]`` (e.g. ``0.3:onoff,to=0``);
    ValueError, one line, if it is not one."""
    try:
        rate_text, _, rest = spec.strip().partition(":")
        items = [item.strip() for item in rest.split(",") if item.strip()]
        pattern = "poisson"
        if items and "=" not in items[0]:
            pattern = items.pop(0)
        settings: dict[str, str] = {}
        for item in items:
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in ("on_us", "shape", "to"):
                raise ValueError(f"{item!r} is not on_us=, shape= or to=")
            settings[key.strip()] = value.strip()
        if "on_us" in settings and pattern == "poisson":
            raise ValueError("on_us= sets the ON periods of onoff or pareto")
        if "shape" in settings and pattern != "pareto":
            raise ValueError("shape= sets pareto's periods")
        return BackgroundTraffic(
            rate=_number(rate_text, "the rate"), pattern=pattern,
            on_us=_number(settings.get("on_us", "100"), "on_us"),
            shape=_number(settings.get("shape", "1.5"), "shape"),
            toward=_rank(settings["to"]) if "to" in settings else None)
    except ValueError as e:
        raise ValueError(f"bad background {spec!r}: {e}. Form: {FORM}") from None


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what} is a number, not {text!r}") from None


def _rank(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"to= is a rank, not {text!r}") from None


class BackgroundSource:
    """One host's source: its datagrams in time order, as the network asks for them."""

    def __init__(self, traffic: BackgroundTraffic, *, peak_bps: float, datagram_bytes: int,
                 destinations: Sequence[Hashable], seed: Sequence[int]):
        if not traffic.rate > 0 or not destinations:
            raise ValueError("a source needs a rate above 0 and somewhere to send")
        self.traffic = traffic
        self.datagram_bytes = datagram_bytes
        self._destinations = list(destinations)
        self._rng = np.random.default_rng(seed)
        self._gap = datagram_bytes * 8 / peak_bps  # one datagram at the link's rate
        self._on_s = traffic.on_us * 1e-6
        self._off_s = self._on_s * (1 - traffic.rate) / traffic.rate
        self._t = 0.0  # when the next datagram goes
        self._left = 0  # datagrams left in this ON period
        self._dst: Hashable = None
        self._starts_on = bool(self._rng.random() < traffic.rate)

    def next(self) -> tuple[float, Hashable, int]:
        """The next datagram: when it goes, where, and its bytes."""
        rng = self._rng
        if self.traffic.pattern == "poisson":
            self._t += rng.exponential(self._gap / self.traffic.rate)
            return self._t, self._pick(), self.datagram_bytes
        while self._left == 0:  # (an ON period may round to no datagram at all)
            if not self._starts_on:
                self._t += self._period(self._off_s)
            self._starts_on = False
            self._left = self._datagrams(self._period(self._on_s))
            self._dst = self._pick()
        when = self._t
        self._t += self._gap
        self._left -= 1
        return when, self._dst, self.datagram_bytes

    def _pick(self) -> Hashable:
        return self._destinations[int(self._rng.integers(len(self._destinations)))]

    def _period(self, mean: float) -> float:
        if self.traffic.pattern == "onoff":
            return float(self._rng.exponential(mean))
        shape = self.traffic.shape  # (Pareto of scale x_m has the mean shape x_m/(shape-1))
        return float((self._rng.pareto(shape) + 1) * mean * (shape - 1) / shape)

    def _datagrams(self, seconds: float) -> int:
        """An ON period's datagrams at the link's rate, rounded at random so that the
        mean is exact (a period's last datagram is not always a whole one)."""
        whole = seconds / self._gap
        return int(whole) + int(self._rng.random() < whole - int(whole))


def start_background(network: FakeNetwork, traffic: BackgroundTraffic,
                     hosts: Sequence[Hashable], *, peak_bps: float, datagram_bytes: int,
                     seed: int) -> list[BackgroundSource]:
    """A source of ``traffic`` on each of ``hosts`` (ranks in order; attached to
    ``network``), sending toward the others; none at a rate of 0."""
    if traffic.rate == 0:
        return []
    if traffic.toward is not None and traffic.toward >= len(hosts):
        raise ValueError(f"background to={traffic.toward}: there are {len(hosts)} hosts")
    sources = []
    for i, host in enumerate(hosts):
        if traffic.toward is not None:
            if i == traffic.toward:
                continue
            destinations = [hosts[traffic.toward]]
        else:
            destinations = [h for h in hosts if h != host]
        source = BackgroundSource(traffic, peak_bps=peak_bps, datagram_bytes=datagram_bytes,
                                  destinations=destinations, seed=[seed, _STREAM, i])
        network.add_background(host, source)
        sources.append(source)
    return sources
