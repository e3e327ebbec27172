"""LTP's Early Close: an acceptance ratio and an acceptance deadline, both adaptive."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from ..wire import CloseReason
from ._params import (
    Configurable,
    Param,
    all_or_nothing,
    fraction_open_closed,
    loading,
    non_negative,
    non_negative_int,
    optional_float,
    positive,
    positive_int,
)
from .base import ClosePlan, MessageInfo, Outcome, Policy, state_values


def _optional_ratio(name: str, value: object) -> float | None:
    return None if value is None else fraction_open_closed(name, value)


class EarlyClosePolicy(Configurable, Policy):
    """LTP's Early Close: a receive closes once an *acceptance ratio* of its chunks has
    arrived, or once an *acceptance deadline* passes with whatever arrived (critical
    chunks are always waited for - the receiver does that). Both adapt to the network,
    learned from the outcomes of recent receives (:meth:`observe`).

    **The plan** for a message of ``C`` chunks (``c`` of them critical)::

        min_delivered = max(c, ceil(ratio * C))
        accept_after  = deadline(C)
                      = clamp(margin * C / rate + floor, min_deadline, max_deadline)

    with the deadline counted from the first datagram of the message
    (``ClosePlan.accept_from_first``): a receive posted ahead of its sender does not
    burn its acceptance time waiting for the sender to start. ``bound`` (for logs) is
    ``1 - ratio``; a deadline close may of course miss more.

    **The estimates**, updated by each observed outcome. ``t`` is the outcome's time
    from its first datagram to its close (``Outcome.active``; ``elapsed`` when that is
    not known) and ``n`` the chunks delivered; ``g = gain``:

    - ``rate`` (chunks/s): EWMA of ``(n - 1) / t`` over outcomes with ``n >= 2`` and
      ``t > 0`` (the spacing of the arrivals: ``n`` chunks arrive over ``n - 1``
      gaps); the first sample replaces ``initial_rate``, later ones move it by
      ``rate += g * (sample - rate)``. For a receive closed by its deadline the sample
      is the goodput (loss and retransmission rounds included), so a lossy or slow
      network lowers ``rate`` and lengthens the deadline.
    - ``completion_time`` (s): EWMA of ``t`` (same gain), for logs.
    - ``floor`` (s): the smallest ``t`` among the last ``floor_window`` *small*
      messages (``C <= small_chunks``) that closed COMPLETE or BOUND_MET - the fixed
      cost of a message whatever its size (one-way spread, a probe/bitmap exchange
      when small messages need one); ``initial_floor`` until there is one. Messages
      closed by a deadline are left out: their time is the deadline itself.

    **The ratio**, ``ratio_min <= ratio <= ratio_max``, starts at ``initial_ratio``
    (default ``ratio_max``). Let ``D = deadline(C)`` computed *before* the outcome
    updates the estimates. Per outcome:

    - closed by ``ACCEPT_DEADLINE`` (the network did not deliver ``ratio`` in time):
      multiplicative decrease of the distance to the floor,
      ``ratio = ratio_min + (1 - ratio_decrease) * (ratio - ratio_min)``;
    - closed ``COMPLETE`` or ``BOUND_MET`` with ``t <= comfort * D`` (comfortably
      early): additive increase, ``ratio = min(ratio_max, ratio + ratio_increase)``;
    - otherwise (met the ratio, but late): unchanged.

    Outcomes closed by the hard ``DEADLINE`` (a silent or stalled peer, not a network
    measurement) change nothing. Why this AIMD shape: as in TCP, trouble is answered
    fast and recovery is slow. A microburst or a lossy spell makes the very next
    receives accept more loss (with ``ratio_decrease = 0.5``, three deadline closes
    move the ratio 7/8 of the way to ``ratio_min``), so they close on the ratio instead
    of each waiting out its deadline; when the network is clean again the ratio climbs
    back one small step per comfortable receive (0.90 -> 0.99 in 18 with the defaults),
    which does not oscillate on an isolated good message. The deadline needs no such
    rule: the rate sample of a receive cut short by it is exactly the goodput that the
    next deadline must allow for.

    All parameters are validated and may be changed at any time (``policy.margin =
    2.0``, or several together with :meth:`configure`); :meth:`reset` forgets what was
    learned. ``ratio``, ``bound``, ``deadline`` (the last planned), ``rate``,
    ``completion_time`` and ``floor`` are there for logs.
    """

    name = "ltp"

    ratio_max = Param(fraction_open_closed, "highest acceptance ratio (clean network)")
    ratio_min = Param(fraction_open_closed, "lowest acceptance ratio (lossy network)")
    initial_ratio = Param(_optional_ratio, "ratio before any outcome (None: ratio_max)")
    ratio_decrease = Param(fraction_open_closed,
                           "share of (ratio - ratio_min) removed by a deadline close")
    ratio_increase = Param(non_negative, "added to the ratio by a comfortable close")
    comfort = Param(fraction_open_closed, "a close within comfort * deadline is comfortable")
    margin = Param(positive, "deadline = margin * C / rate + floor (before clamping)")
    min_deadline = Param(positive, "shortest acceptance deadline, seconds")
    max_deadline = Param(positive, "longest acceptance deadline, seconds")
    initial_rate = Param(positive, "delivery rate before any sample, chunks/s")
    initial_floor = Param(non_negative, "floor term before any small message, seconds")
    gain = Param(fraction_open_closed, "EWMA weight of a new sample")
    floor_window = Param(positive_int, "small messages the floor is the minimum over")
    small_chunks = Param(positive_int, "a message of at most this many chunks is small")

    # what was learned (see reset)
    _ratio: float
    _rate: float | None
    _completion: float | None
    _floor_samples: deque[float]
    deadline: float | None  # the last planned acceptance deadline

    def __init__(
        self,
        *,
        ratio_max: float = 0.99,
        ratio_min: float = 0.90,
        initial_ratio: float | None = None,
        ratio_decrease: float = 0.5,
        ratio_increase: float = 0.005,
        comfort: float = 0.5,
        margin: float = 1.5,
        min_deadline: float = 0.002,
        max_deadline: float = 1.0,
        initial_rate: float = 10_000.0,
        initial_floor: float = 0.0,
        gain: float = 0.25,
        floor_window: int = 32,
        small_chunks: int = 8,
    ):
        self.ratio_max = ratio_max
        self.ratio_min = ratio_min
        self.initial_ratio = initial_ratio
        self.ratio_decrease = ratio_decrease
        self.ratio_increase = ratio_increase
        self.comfort = comfort
        self.margin = margin
        self.min_deadline = min_deadline
        self.max_deadline = max_deadline
        self.initial_rate = initial_rate
        self.initial_floor = initial_floor
        self.gain = gain
        self.floor_window = floor_window
        self.small_chunks = small_chunks
        self.reset()
        self._finish_params()

    # ------------------------------------------------------------ parameters
    def _check_params(self) -> None:
        if self.ratio_min > self.ratio_max:
            raise ValueError(f"ratio_min {self.ratio_min} > ratio_max {self.ratio_max}")
        if self.initial_ratio is not None and not (
            self.ratio_min <= self.initial_ratio <= self.ratio_max
        ):
            raise ValueError(f"initial_ratio {self.initial_ratio} outside "
                             f"[ratio_min, ratio_max] = [{self.ratio_min}, {self.ratio_max}]")
        if self.min_deadline > self.max_deadline:
            raise ValueError(f"min_deadline {self.min_deadline} > max_deadline {self.max_deadline}")

    def _params_changed(self) -> None:
        self._ratio = min(self.ratio_max, max(self.ratio_min, self._ratio))
        if self._floor_samples.maxlen != self.floor_window:
            self._floor_samples = deque(self._floor_samples, maxlen=self.floor_window)

    def reset(self) -> None:
        """Forget every outcome: back to the initial ratio, rate and floor."""
        self._ratio = self.ratio_max if self.initial_ratio is None else self.initial_ratio
        self._rate = None
        self._completion = None
        self._floor_samples = deque(maxlen=self.floor_window)
        self.deadline = None
        self.observed = 0
        self.deadline_closes = 0

    # ------------------------------------------------------------- estimates
    @property
    def ratio(self) -> float:
        """The acceptance ratio the next plan uses."""
        return self._ratio

    @property
    def bound(self) -> float:
        """``1 - ratio``: the missing fraction the next plan's ratio allows."""
        return 1.0 - self._ratio

    @property
    def rate(self) -> float:
        """Delivery rate estimate, chunks/s (``initial_rate`` before any sample)."""
        return self.initial_rate if self._rate is None else self._rate

    @property
    def completion_time(self) -> float | None:
        """EWMA of the receives' times from first datagram to close, seconds."""
        return self._completion

    @property
    def floor(self) -> float:
        """The size-independent term of the deadline, seconds."""
        return min(self._floor_samples) if self._floor_samples else self.initial_floor

    def deadline_for(self, chunk_count: int) -> float:
        """The acceptance deadline a message of ``chunk_count`` chunks would get now."""
        d = self.margin * chunk_count / self.rate + self.floor
        return min(self.max_deadline, max(self.min_deadline, d))

    # --------------------------------------------------------------- policy
    def plan(self, info: MessageInfo) -> ClosePlan:
        count = info.chunk_count
        need = min(count, max(info.critical_count, math.ceil(self._ratio * count - 1e-9)))
        self.deadline = deadline = self.deadline_for(count)
        return ClosePlan(min_delivered=need, bound=1.0 - self._ratio,
                         accept_after=deadline, accept_from_first=True)

    def observe(self, outcome: Outcome) -> None:
        reason = outcome.close_reason
        if reason not in (CloseReason.COMPLETE, CloseReason.BOUND_MET,
                          CloseReason.ACCEPT_DEADLINE):
            return  # hard deadline / cancel: says nothing about the network
        count = outcome.info.chunk_count
        t = outcome.active if outcome.active is not None else outcome.elapsed
        planned = self.deadline_for(count)  # before this outcome moves the estimates
        self.observed += 1

        # the ratio
        if reason == CloseReason.ACCEPT_DEADLINE:
            self.deadline_closes += 1
            self._ratio = self.ratio_min + (1.0 - self.ratio_decrease) * (
                self._ratio - self.ratio_min)
        elif t <= self.comfort * planned:
            self._ratio = min(self.ratio_max, self._ratio + self.ratio_increase)

        # the estimates
        g = self.gain
        n = outcome.delivered
        if n >= 2 and t > 0:
            sample = (n - 1) / t
            self._rate = sample if self._rate is None else self._rate + g * (sample - self._rate)
        c = self._completion
        self._completion = t if c is None else c + g * (t - c)
        if count <= self.small_chunks and reason != CloseReason.ACCEPT_DEADLINE:
            self._floor_samples.append(max(0.0, t))

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Its parameters and everything it learned: the ratio, the rate and completion
        time estimates, the floor's samples, the last planned deadline and its counts."""
        return {"policy": self.name, "params": self.params(),
                "learned": {"ratio": self._ratio, "rate": self._rate,
                            "completion_time": self._completion,
                            "floor_samples": list(self._floor_samples),
                            "deadline": self.deadline, "observed": self.observed,
                            "deadline_closes": self.deadline_closes}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        params, learned = state_values(self, state, "params", "learned")
        with loading(self.name), all_or_nothing(self):
            self.configure(**params)
            ratio = fraction_open_closed("ratio", learned["ratio"])
            if not self.ratio_min <= ratio <= self.ratio_max:
                raise ValueError(f"ratio {ratio} outside [ratio_min, ratio_max] = "
                                 f"[{self.ratio_min}, {self.ratio_max}]")
            self._ratio = ratio
            rate = learned["rate"]
            self._rate = None if rate is None else positive("rate", rate)
            self._completion = optional_float(learned["completion_time"])
            self._floor_samples = deque(
                (non_negative("floor sample", t) for t in learned["floor_samples"]),
                maxlen=self.floor_window)
            self.deadline = optional_float(learned["deadline"])
            self.observed = non_negative_int("observed", learned["observed"])
            self.deadline_closes = non_negative_int("deadline_closes",
                                                    learned["deadline_closes"])

    def describe(self) -> str:
        return (f"ltp(ratio={self._ratio:.4g} in [{self.ratio_min:g}, {self.ratio_max:g}], "
                f"rate={self.rate:.4g}/s, floor={self.floor:.3g}s)")
