"""Microbursts as loss-probability steps on a testbed's nf_tables loss rule, applied by
one background thread: a schedule of given windows (:class:`LossSchedule`), or bursts
that recur in time for as long as they run (:class:`TimedBursts`). (The other kind of
microburst, real cross-traffic through the bottleneck, is ``Testbed.cross_traffic``.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import TestbedError
from .loss_rules import check_probability
from .topology import SERVER

if TYPE_CHECKING:  # pragma: no cover
    from .loss_rules import LossRuleWriter
    from .testbed import Testbed

#: A schedule may not run longer than this (every loop in the testbed is bounded).
MAX_SCHEDULE_S = 3600.0


class LossSchedule:
    """Loss windows ``[(t_start, t_end, p), ...]`` in seconds relative to ``start()``.

    At any instant the loss is the largest ``p`` of the windows that contain it, else
    ``base``; the thread sets it (``Testbed.set_loss``) at each change point only, and
    restores ``base`` when the last window ends or on ``stop()``. ``applied`` logs
    ``(t_relative, p)`` for every change actually made.

        with tb.loss_schedule([(0.2, 0.3, 0.5)]) as sched:   # 50 % loss for 100 ms
            ...
            sched.wait()
    """

    def __init__(self, windows: Iterable[tuple[float, float, float]], *, base: float = 0.0,
                 node: str | int = SERVER, protocol: str = "udp"):
        self.windows = sorted((float(a), float(b), check_probability(p)) for a, b, p in windows)
        for a, b, _ in self.windows:
            if not 0 <= a < b <= MAX_SCHEDULE_S:
                raise ValueError(f"window ({a}, {b}) must satisfy 0 <= start < end <= "
                                 f"{MAX_SCHEDULE_S:g} s")
        self.base = check_probability(base)
        self.node = node
        self.protocol = protocol
        self.applied: list[tuple[float, float]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._testbed: Testbed | None = None
        self._t0 = 0.0

    @property
    def duration(self) -> float:
        return max((b for _, b, _ in self.windows), default=0.0)

    def loss_at(self, t: float) -> float:
        """The loss probability the schedule asks for at ``t`` s after start."""
        active = [p for a, b, p in self.windows if a <= t < b]
        return max(active) if active else self.base

    def change_points(self) -> list[tuple[float, float]]:
        """``(t, p)`` at every instant the asked-for loss changes, starting at 0."""
        times = sorted({0.0, *(a for a, _, _ in self.windows), *(b for _, b, _ in self.windows)})
        out: list[tuple[float, float]] = []
        for t in times:
            p = self.loss_at(t)
            if not out or out[-1][1] != p:
                out.append((t, p))
        return out

    def start(self, testbed: Testbed) -> LossSchedule:
        if self._thread is not None:
            raise TestbedError("a LossSchedule runs once; make a new one")
        if not testbed.is_up:
            raise TestbedError("the testbed is not up")
        testbed.node(self.node)  # fail now on a bad node, not in the thread
        self._testbed = testbed
        testbed.register_schedule(self)
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="bl-loss-schedule", daemon=True)
        self._thread.start()
        return self

    def _set(self, p: float) -> float:
        assert self._testbed is not None
        t = time.monotonic()
        self._testbed.set_loss(p, self.node, protocol=self.protocol)
        done = time.monotonic()
        self.applied.append((done - self._t0, p))
        return done - t

    def _run(self) -> None:
        current = None
        lead = 0.0  # a change takes effect this long after it is started: start it early
        try:
            for t, p in self.change_points():
                if self._stop.wait(max(0.0, self._t0 + t - lead - time.monotonic())):
                    return
                if p != current:
                    took = self._set(p)
                    lead = min(0.05, took if lead == 0.0 else 0.5 * lead + 0.5 * took)
                    current = p
        except BaseException as e:  # surfaced by wait()/stop()
            self.error = e
        finally:
            if self._testbed is not None and not self._stop.is_set():
                self._testbed.unregister_schedule(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the schedule has run out (True) or ``timeout`` passed (False);
        re-raises an error the thread met."""
        if self._thread is None:
            raise TestbedError("the schedule was never started")
        if timeout is None:
            timeout = max(0.0, self._t0 + self.duration - time.monotonic()) + 5.0
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, restore: bool = True) -> None:
        """End the schedule now; with ``restore``, set the loss back to ``base``."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(10.0)
        tb = self._testbed
        if tb is not None:
            tb.unregister_schedule(self)
            if restore and tb.is_up and (not self.applied or self.applied[-1][1] != self.base):
                self._set(self.base)

    def __enter__(self) -> LossSchedule:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def rounds_overlapping(windows: Sequence[tuple[float, float]],
                       rounds: Sequence[dict]) -> set[int]:
    """The ids of the rounds (``{"round", "start_mono_s", "end_mono_s"}``, as rank 0 of
    a training run logs them) that overlap any ``(start, end)`` window."""
    hit: set[int] = set()
    for r in rounds:
        a, b = r.get("start_mono_s"), r.get("end_mono_s")
        if a is not None and b is not None and any(w0 < b and w1 > a for w0, w1 in windows):
            hit.add(int(r["round"]))
    return hit


@dataclass(frozen=True)
class TimedBursts:
    """Microbursts that recur in time, as congestion does: loss ``rate`` on everything
    arriving at ``node`` for ``length_s`` seconds every ``every_s`` seconds (the first
    ``every_s`` after the start), the node's random loss in between. The network does
    not know a job's rounds: a slower job meets more bursts, as it would on a real
    network."""

    rate: float
    every_s: float
    length_s: float
    node: str = SERVER

    def __post_init__(self):
        check_probability(self.rate)
        if not 0 < self.length_s < self.every_s <= MAX_SCHEDULE_S:
            raise ValueError(f"bursts need 0 < length ({self.length_s} s) < period "
                             f"({self.every_s} s) <= {MAX_SCHEDULE_S:g} s")

    def describe(self) -> str:
        return (f"{self.rate:.0%} loss at {self.node} for {self.length_s * 1e3:g} ms every "
                f"{self.every_s * 1e3:g} ms")

    def start(self, testbed: Testbed, *, base: float = 0.0) -> BurstRunner:
        """Apply them to ``testbed`` from now until ``stop()``; ``base``: the node's loss
        between bursts."""
        return BurstRunner(self, testbed.loss_writer(self.node, protocol="all"), base)


class BurstRunner:
    """:class:`TimedBursts` being applied: one thread sets the burst's loss at each
    start and ``base`` at each end through a :class:`~.testbed.LossRuleWriter`, and
    records when each change was made (``windows``: ``(start, end)`` in
    ``time.monotonic()`` seconds - the clock every namespace of the host shares)."""

    def __init__(self, bursts: TimedBursts, writer: LossRuleWriter, base: float):
        self.bursts = bursts
        self.base = check_probability(base)
        self.windows: list[tuple[float, float]] = []
        self.error: BaseException | None = None
        self._writer = writer
        self._stop = threading.Event()
        self._lock = threading.Lock()
        writer.prepare(bursts.rate, self.base)
        writer.set(self.base)
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="bl-bursts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        b = self.bursts
        k = 0
        try:
            while True:
                k += 1
                # on a schedule from the start, so that a late change does not shift
                # every later burst
                start_at = self._t0 + k * b.every_s
                if self._stop.wait(max(0.0, start_at - time.monotonic())):
                    return
                self._writer.set(b.rate)
                on = time.monotonic()
                stopped = self._stop.wait(max(0.0, start_at + b.length_s - on))
                self._writer.set(self.base)
                with self._lock:
                    self.windows.append((on, time.monotonic()))
                if stopped:
                    return
        except BaseException as e:  # surfaced by stop()
            self.error = e

    def windows_between(self, start: float, end: float) -> list[tuple[float, float]]:
        """The bursts that overlapped ``[start, end]`` (monotonic seconds)."""
        with self._lock:
            return [(a, b) for a, b in self.windows if a < end and b > start]

    def rounds_in_bursts(self, rounds: Sequence[dict]) -> set[int]:
        """The rounds that a burst so far overlapped (see :func:`rounds_overlapping`)."""
        with self._lock:
            windows = list(self.windows)
        return rounds_overlapping(windows, rounds)

    def stop(self) -> None:
        """End the bursts, leave ``base`` in force, and re-raise an error the thread met."""
        self._stop.set()
        self._thread.join(10.0)
        try:
            self._writer.close()
        finally:
            if self.error is not None:
                raise self.error

    def __enter__(self) -> BurstRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
