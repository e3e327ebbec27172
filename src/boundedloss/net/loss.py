"""Packet-loss models applied to datagrams on receive.

A model is asked once per received datagram, ``model.drop(now, round_id)``, and says
whether that datagram is lost. The same models run inside the in-memory fake network
(virtual clock) and inside the real UDP endpoint (wall clock), so ``now`` is in seconds
of whatever clock the caller uses and the models never read a clock themselves.

``drop`` sits on the per-packet path, so random numbers are drawn from numpy in blocks
of :data:`BLOCK` and kept as a Python list: a call is one list index and a comparison,
not a numpy call. Every model is seeded and replays the same decisions for the same
seed and the same sequence of calls.

Models:

- :class:`NoLoss` - never drops.
- :class:`Bernoulli` - independent loss with probability ``p``.
- :class:`GilbertElliott` - two-state Markov chain: bursty loss.
- :class:`Microburst` - heavy loss during chosen rounds or time windows, a base model
  elsewhere.
- :class:`Bottleneck` - deterministic tail drop of a shallow queue drained at a fixed
  rate: the drops of an overloaded link (incast).
- :class:`Combined` - a datagram is lost if any component loses it.

:func:`parse_loss_spec` builds a model from a CLI string such as
``"bernoulli:0.01+burst:rate=0.8,every=20,rank=1"``.
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "BLOCK",
    "Bernoulli",
    "Bottleneck",
    "Combined",
    "GilbertElliott",
    "LossModel",
    "Microburst",
    "NoLoss",
    "SPEC_FORMS",
    "derive_seed",
    "parse_loss_spec",
]

BLOCK = 4096
"""Random numbers drawn per refill; large enough that the numpy call is amortised."""

_SEED_STRIDE = 1000


def derive_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th component of a composite model seeded with ``seed``.

    numpy's ``default_rng`` hashes its seed through ``SeedSequence``, so nearby seeds
    still give independent streams; the stride only keeps the numbers readable.
    """
    return seed + _SEED_STRIDE * index


def _check_prob(name: str, value: float) -> float:
    value = float(value)
    # Written so that NaN fails too.
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
    return value


def _fmt(x: float) -> str:
    return f"{x:g}"


class LossModel(abc.ABC):
    """Decides, one datagram at a time, whether a received datagram is lost."""

    __slots__ = ()

    @abc.abstractmethod
    def drop(self, now: float, round_id: int) -> bool:
        """True if the datagram arriving at ``now`` (seconds, any clock) for training
        round ``round_id`` (-1 if unknown) is lost."""

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> None:
        """Restart the random stream; with ``seed``, reseed (and keep that seed)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Short human-readable text, e.g. ``bernoulli(p=0.05)``."""

    @property
    def needs_round(self) -> bool:
        """Whether ``drop`` looks at ``round_id`` (else callers may pass -1 and skip
        reading it from the header on the per-datagram path)."""
        return False

    @abc.abstractmethod
    def to_spec(self) -> str:
        """A string that :func:`parse_loss_spec` turns back into an equal model
        (``ValueError`` for a model that the spec language cannot express)."""

    def for_rank(self, rank: int) -> LossModel:
        """The model receiver ``rank`` should apply.

        Only :class:`Microburst` and :class:`Bottleneck` (and composites holding one)
        can be rank-specific; everything else applies on every rank. The result
        shares state with ``self`` (no copy), so give each receiver its own parsed
        model if their streams must be independent.
        """
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


class NoLoss(LossModel):
    """Never drops."""

    __slots__ = ()

    def drop(self, now: float, round_id: int) -> bool:
        return False

    def reset(self, seed: int | None = None) -> None:
        pass

    def describe(self) -> str:
        return "none"

    def to_spec(self) -> str:
        return "none"


class Bernoulli(LossModel):
    """Drops each datagram independently with probability ``p``."""

    __slots__ = ("p", "seed", "_rng", "_block", "_i")

    def __init__(self, p: float, *, seed: int = 0) -> None:
        self.p = _check_prob("bernoulli p", p)
        self.seed = seed
        self.reset()

    def reset(self, seed: int | None = None) -> None:
        if seed is not None:
            self.seed = seed
        self._rng = np.random.default_rng(self.seed)
        self._block: list[bool] = []
        self._i = 0

    def drop(self, now: float, round_id: int) -> bool:
        i = self._i
        block = self._block
        if i >= len(block):
            # The decision itself is precomputed per block: one index per call.
            block = self._block = (self._rng.random(BLOCK) < self.p).tolist()
            i = 0
        self._i = i + 1
        return block[i]

    def describe(self) -> str:
        return f"bernoulli(p={_fmt(self.p)})"

    def to_spec(self) -> str:
        return f"bernoulli:p={self.p!r}"


class GilbertElliott(LossModel):
    """Bursty loss from a two-state (good/bad) Markov chain stepped once per datagram.

    Each datagram is dropped with probability ``loss_good`` or ``loss_bad`` according to
    the current state; then the chain moves good->bad with probability ``p_gb`` and
    bad->good with probability ``p_bg``. The stationary share of bad state is
    ``p_gb / (p_gb + p_bg)``, the long-run loss is :attr:`stationary_loss`, and a stay in
    the bad state lasts ``1 / p_bg`` datagrams on average (geometric), which with
    ``loss_bad=1, loss_good=0`` is the mean burst length.

    The initial state is drawn from the stationary distribution, so the loss rate has no
    start-up bias however short the run.
    """

    __slots__ = (
        "p_gb",
        "p_bg",
        "loss_good",
        "loss_bad",
        "seed",
        "_rng",
        "_u",
        "_i",
        "_bad",
    )

    def __init__(
        self,
        p_gb: float,
        p_bg: float,
        loss_good: float = 0.0,
        loss_bad: float = 1.0,
        *,
        seed: int = 0,
    ) -> None:
        self.p_gb = _check_prob("ge p_gb", p_gb)
        self.p_bg = _check_prob("ge p_bg", p_bg)
        self.loss_good = _check_prob("ge loss_good", loss_good)
        self.loss_bad = _check_prob("ge loss_bad", loss_bad)
        self.seed = seed
        self.reset()

    @classmethod
    def from_rate(
        cls, rate: float, burst_len: float, *, seed: int = 0
    ) -> GilbertElliott:
        """Chain with stationary loss ``rate`` and mean burst ``burst_len`` datagrams.

        ``loss_good=0, loss_bad=1``, ``p_bg = 1/burst_len`` and ``p_gb`` solves
        ``p_gb / (p_gb + p_bg) = rate``. Bursts are separated by at least one delivered
        datagram, so ``rate`` can be at most ``burst_len / (burst_len + 1)``.
        """
        rate = float(rate)
        burst_len = float(burst_len)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"ge rate must be in [0, 1), got {rate!r}")
        if not (burst_len >= 1.0 and math.isfinite(burst_len)):
            raise ValueError(f"ge burst length must be >= 1, got {burst_len!r}")
        p_bg = 1.0 / burst_len
        p_gb = rate * p_bg / (1.0 - rate)
        if p_gb > 1.0:
            raise ValueError(
                f"ge rate={rate!r} is unreachable with burst={burst_len!r}: "
                f"need rate <= {burst_len / (burst_len + 1.0):g}"
            )
        return cls(p_gb, p_bg, 0.0, 1.0, seed=seed)

    @property
    def stationary_bad(self) -> float:
        """Long-run fraction of datagrams seen in the bad state."""
        total = self.p_gb + self.p_bg
        # A chain that never moves stays where it starts, which is the good state.
        return self.p_gb / total if total > 0.0 else 0.0

    @property
    def stationary_loss(self) -> float:
        """Long-run loss rate: (p_gb*loss_bad + p_bg*loss_good) / (p_gb + p_bg)."""
        total = self.p_gb + self.p_bg
        if total == 0.0:
            return self.loss_good
        return (self.p_gb * self.loss_bad + self.p_bg * self.loss_good) / total

    @property
    def mean_burst_len(self) -> float:
        """Mean stay in the bad state, in datagrams (1 / p_bg)."""
        return 1.0 / self.p_bg if self.p_bg > 0.0 else math.inf

    def reset(self, seed: int | None = None) -> None:
        if seed is not None:
            self.seed = seed
        self._rng = np.random.default_rng(self.seed)
        self._u: list[float] = self._rng.random(BLOCK).tolist()
        self._bad = self._u[0] < self.stationary_bad
        self._i = 1

    def drop(self, now: float, round_id: int) -> bool:
        u = self._u
        i = self._i
        if i + 2 > BLOCK:
            # A call needs at most two numbers; the leftover one is skipped, which is
            # still the same for every replay of the stream.
            u = self._u = self._rng.random(BLOCK).tolist()
            i = 0
        bad = self._bad
        loss = self.loss_bad if bad else self.loss_good
        # Loss 0 or 1 (the usual case) needs no random number.
        if loss >= 1.0:
            dropped = True
        elif loss <= 0.0:
            dropped = False
        else:
            dropped = u[i] < loss
            i += 1
        if bad:
            self._bad = not (u[i] < self.p_bg)
        else:
            self._bad = u[i] < self.p_gb
        self._i = i + 1
        return dropped

    def describe(self) -> str:
        return (
            f"ge(p_gb={_fmt(self.p_gb)}, p_bg={_fmt(self.p_bg)}, "
            f"loss_good={_fmt(self.loss_good)}, loss_bad={_fmt(self.loss_bad)}; "
            f"rate={_fmt(self.stationary_loss)}, burst={_fmt(self.mean_burst_len)})"
        )

    def to_spec(self) -> str:
        return (
            f"ge:p_gb={self.p_gb!r},p_bg={self.p_bg!r},"
            f"loss_good={self.loss_good!r},loss_bad={self.loss_bad!r}"
        )


class Microburst(LossModel):
    """Loss rate ``rate`` during burst rounds or time windows; ``base`` elsewhere.

    A datagram is in a burst when any of these holds:

    - ``round_id in rounds``;
    - ``every`` is set, ``round_id >= offset`` and ``(round_id - offset) % every <
      length`` (rounds ``offset .. offset+length-1``, then every ``every`` rounds);
    - ``start <= now < end`` for some ``(start, end)`` in ``windows``;
    - ``every_s`` is set and ``now`` lies in the burst of its period: one burst of
      ``length_s`` in every ``every_s`` from the clock's ``every_s`` on, each at a place
      in its period drawn from ``seed`` (bursts that recur in time, as the kernel
      testbed's timed microbursts, which know no rounds; drawn, because on a virtual
      clock a strictly periodic burst phase-locks with timers that are multiples of its
      period - a TCP retransmission timeout of 200 ms, doubled, would meet a burst of a
      100 ms period every time, which no real clock's drift allows).

    Round -1 (unknown) is never in a round burst. ``rank`` names the one receiver rank
    that applies the burst (None: every rank); see :meth:`for_rank`.

    ``base`` is consulted for every datagram, in bursts too (its answer is then
    ignored), so its stream - and a Gilbert-Elliott chain's state - advances once per
    datagram whatever the burst schedule.
    """

    __slots__ = (
        "rate",
        "rounds",
        "every",
        "length",
        "offset",
        "windows",
        "every_s",
        "length_s",
        "_period",
        "base",
        "rank",
        "seed",
        "_burst",
    )

    def __init__(
        self,
        rate: float,
        *,
        rounds: Iterable[int] | None = None,
        every: int | None = None,
        length: int = 1,
        offset: int = 0,
        windows: Iterable[tuple[float, float]] | None = None,
        every_s: float | None = None,
        length_s: float | None = None,
        base: LossModel | None = None,
        rank: int | None = None,
        seed: int = 0,
    ) -> None:
        self.rate = _check_prob("burst rate", rate)
        self.rounds = frozenset(_check_int("burst round", r, 0) for r in rounds or ())
        if every is not None:
            every = _check_int("burst every", every, 1)
            length = _check_int("burst len", length, 1)
            if length > every:
                raise ValueError(f"burst len ({length}) must be <= every ({every})")
            offset = _check_int("burst offset", offset, 0)
        elif length != 1 or offset != 0:
            raise ValueError("burst len/offset need every=")
        self.every = every
        self.length = length
        self.offset = offset
        self.windows = tuple(_check_window(w) for w in windows or ())
        if (every_s is None) != (length_s is None):
            raise ValueError("burst every_s= and len_s= go together")
        if every_s is not None and length_s is not None and not (
                0 < length_s < every_s < math.inf):
            raise ValueError(f"burst needs 0 < len_s ({length_s}) < every_s ({every_s})")
        self.every_s = every_s
        self.length_s = length_s
        self._period = (-1, 0.0)  # (the period now falls in, where its burst starts)
        if not self.rounds and every is None and not self.windows and every_s is None:
            raise ValueError("burst needs rounds=, every=, window= or every_s=")
        if base is not None and not isinstance(base, LossModel):
            raise TypeError(f"burst base must be a LossModel, got {type(base).__name__}")
        self.base = base
        self.rank = None if rank is None else _check_int("burst rank", rank, 0)
        self.seed = seed
        self._burst = Bernoulli(self.rate, seed=seed)

    def in_burst(self, now: float, round_id: int) -> bool:
        """Whether a datagram at ``now`` for ``round_id`` falls in a burst."""
        if round_id in self.rounds:
            return True
        every = self.every
        if (
            every is not None
            and round_id >= self.offset
            and (round_id - self.offset) % every < self.length
        ):
            return True
        for start, end in self.windows:
            if start <= now < end:
                return True
        every_s, length_s = self.every_s, self.length_s
        if every_s is not None and length_s is not None and now >= every_s:
            return 0.0 <= now - self._burst_start(int(now // every_s)) < length_s
        return False

    def time_windows(self, until: float) -> list[tuple[float, float]]:
        """The bursts in time (``windows``, and the recurring ones) that start before
        ``until``, as ``(start, end)``: what a round overlapping one met."""
        out = [w for w in self.windows if w[0] < until]
        every_s, length_s = self.every_s, self.length_s
        if every_s is not None and length_s is not None:
            for k in range(1, int(until // every_s) + 1):
                start = self._burst_start(k)
                if start < until:
                    out.append((start, start + length_s))
        return out

    def _burst_start(self, k: int) -> float:
        """Where period ``k``'s burst starts: a draw from the seed and ``k`` alone (the
        same whatever was asked before), remembered for the period the clock is in."""
        period, start = self._period
        if period != k:
            every_s, length_s = self.every_s, self.length_s
            assert every_s is not None and length_s is not None
            u = float(np.random.default_rng([self.seed, k]).random())
            start = k * every_s + u * (every_s - length_s)
            self._period = (k, start)
        return start

    @property
    def needs_round(self) -> bool:
        return bool(self.rounds) or self.every is not None or (
            self.base is not None and self.base.needs_round
        )

    def drop(self, now: float, round_id: int) -> bool:
        base = self.base
        base_drop = base.drop(now, round_id) if base is not None else False
        if self.in_burst(now, round_id):
            return self._burst.drop(now, round_id)
        return base_drop

    def reset(self, seed: int | None = None) -> None:
        if seed is not None:
            self.seed = seed
        self._period = (-1, 0.0)
        self._burst.reset(self.seed)
        if self.base is not None:
            self.base.reset(None if seed is None else derive_seed(seed, 1))

    def for_rank(self, rank: int) -> LossModel:
        if self.rank is None or self.rank == rank:
            return self
        # Not this rank's burst: what is left is the background loss.
        return self.base.for_rank(rank) if self.base is not None else NoLoss()

    def _schedule_parts(self) -> list[str]:
        parts: list[str] = []
        if self.every is not None:
            parts.append(f"every={self.every}")
            parts.append(f"len={self.length}")
            if self.offset:
                parts.append(f"offset={self.offset}")
        if self.rounds:
            parts.append("rounds=" + ";".join(str(r) for r in sorted(self.rounds)))
        if self.every_s is not None:
            parts.append(f"every_s={self.every_s!r}")
            parts.append(f"len_s={self.length_s!r}")
        return parts

    def describe(self) -> str:
        parts = [f"rate={_fmt(self.rate)}", *self._schedule_parts()]
        if self.windows:
            parts.append(
                "window=" + ";".join(f"{_fmt(s)}-{_fmt(e)}" for s, e in self.windows)
            )
        if self.rank is not None:
            parts.append(f"rank={self.rank}")
        text = f"burst({', '.join(parts)})"
        if self.base is not None:
            text += f" else {self.base.describe()}"
        return text

    def to_spec(self) -> str:
        if self.base is not None:
            # The spec language can only OR components ("+"), not "burst, else base";
            # a base= model is built in code and stays there.
            raise ValueError("a burst with base= has no spec form; write the base as "
                             "its own '+' component instead")
        parts = [f"rate={self.rate!r}", *self._schedule_parts()]
        if self.windows:
            parts.append("window=" + ";".join(f"{s!r}-{e!r}" for s, e in self.windows))
        if self.rank is not None:
            parts.append(f"rank={self.rank}")
        return "burst:" + ",".join(parts)


class Bottleneck(LossModel):
    """Tail drop at a shallow buffer drained at ``rate`` datagrams per second.

    Emulates the bottleneck link toward a receiver, e.g. the server's downlink when
    many workers send to it at once (incast). The model counts datagrams, not bytes
    (it never sees sizes): a queue of ``queue`` datagrams drains at ``rate`` datagrams
    per second, and each :meth:`drop` call is one datagram arriving at ``now``. The
    queue is first drained by ``(now - last) * rate`` (not below empty); then, if it
    holds ``queue`` datagrams, the arrival is dropped (tail drop), else it joins the
    queue and is kept. Arrivals slower than ``rate`` are never dropped; a burst at one
    instant keeps ``queue`` datagrams and drops the rest; a steady stream above the
    rate keeps about ``rate`` datagrams per second once the buffer has filled.

    Only the queue's *drops* are modelled, not its queueing *delay*: a kept datagram is
    delivered at once rather than after the ``level / rate`` seconds it would wait
    behind the queue, so the model does not slow the transfer down. That still gives
    the incast effect that matters here: synchronized senders fill a shallow buffer
    faster than the link drains it, and the overflow is lost in bursts, correlated
    across senders, at the moment they all send; that loss, not the at most
    ``queue / rate`` seconds of queueing, is what the protocol has to survive. Where
    the delay matters too, the fake network's ``NodeProfile(down_bps=,
    queue_datagrams=)`` models the whole queue; this model brings the drops to places
    without one, such as the real UDP endpoint on a fast local network.

    ``now`` must be the arrival time at the receiver, on one clock for every sender;
    share one model between all the receiver's senders, since they share its queue.
    A ``now`` earlier than the latest seen drains nothing. Deterministic: there is no
    randomness, and :meth:`reset` empties the queue and forgets the last arrival
    (its ``seed`` is accepted for the common interface and ignored). ``rank`` names
    the one receiver rank that applies the model (None: every rank); see
    :meth:`for_rank`.
    """

    __slots__ = ("_last", "_level", "queue", "rank", "rate")

    # Float slack, in datagrams, in the "queue is full" test: a pause of exactly k/rate
    # seconds must admit exactly k datagrams even if (now - last) * rate rounds to a
    # hair under k.
    _EPS = 1e-6

    def __init__(self, rate: float, queue: int, *, rank: int | None = None) -> None:
        self.rate = _check_positive("bottleneck rate", rate)
        self.queue = _check_int("bottleneck queue", queue, 1)
        self.rank = None if rank is None else _check_int("bottleneck rank", rank, 0)
        self.reset()

    def reset(self, seed: int | None = None) -> None:
        self._level = 0.0
        # -inf: the first arrival drains an (empty) queue by an infinite amount.
        self._last = -math.inf

    @property
    def level(self) -> float:
        """Datagrams queued just after the latest arrival (not drained to any later
        time)."""
        return self._level

    def drop(self, now: float, round_id: int) -> bool:
        level = self._level
        elapsed = now - self._last
        if elapsed > 0.0:
            level = max(level - elapsed * self.rate, 0.0)
            self._last = now
        if level >= self.queue - self._EPS:
            self._level = level
            return True
        self._level = level + 1.0
        return False

    def for_rank(self, rank: int) -> LossModel:
        if self.rank is None or self.rank == rank:
            return self
        return NoLoss()

    def describe(self) -> str:
        text = f"bottleneck(rate={_fmt(self.rate)}/s, queue={self.queue}"
        if self.rank is not None:
            text += f", rank={self.rank}"
        return text + ")"

    def to_spec(self) -> str:
        text = f"bottleneck:rate={self.rate!r},queue={self.queue}"
        if self.rank is not None:
            text += f",rank={self.rank}"
        return text


def components(model: LossModel) -> tuple[LossModel, ...]:
    """The models ``model`` joins (``+`` in a spec), or ``model`` alone."""
    return model.models if isinstance(model, Combined) else (model,)


class Combined(LossModel):
    """Drops a datagram if any component drops it.

    Every component is consulted for every datagram (no short-circuit), so each
    component's stream is the same as if it ran alone.
    """

    __slots__ = ("models",)

    def __init__(self, models: Iterable[LossModel]) -> None:
        self.models: tuple[LossModel, ...] = tuple(models)
        for m in self.models:
            if not isinstance(m, LossModel):
                raise TypeError(f"Combined takes LossModels, got {type(m).__name__}")

    @property
    def needs_round(self) -> bool:
        return any(m.needs_round for m in self.models)

    def drop(self, now: float, round_id: int) -> bool:
        dropped = False
        for m in self.models:
            if m.drop(now, round_id):
                dropped = True
        return dropped

    def reset(self, seed: int | None = None) -> None:
        # Same derivation as parse_loss_spec, so reset(s) replays parse(..., seed=s).
        for i, m in enumerate(self.models):
            m.reset(None if seed is None else derive_seed(seed, i))

    def for_rank(self, rank: int) -> LossModel:
        kept = [m.for_rank(rank) for m in self.models]
        kept = [m for m in kept if not isinstance(m, NoLoss)]
        if not kept:
            return NoLoss()
        if len(kept) == 1:
            return kept[0]
        return Combined(kept)

    def describe(self) -> str:
        return " + ".join(m.describe() for m in self.models) or "none"

    def to_spec(self) -> str:
        return "+".join(m.to_spec() for m in self.models) or "none"


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_positive(name: str, value: float) -> float:
    value = float(value)
    # Written so that NaN fails too.
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _check_window(window: Sequence[float]) -> tuple[float, float]:
    try:
        start, end = (float(x) for x in window)
    except (TypeError, ValueError):
        raise ValueError(f"burst window must be a (start, end) pair, got {window!r}") from None
    if not (math.isfinite(start) and end > start):
        raise ValueError(f"burst window needs finite start < end, got {window!r}")
    return start, end


# --------------------------------------------------------------------------- parser

SPEC_FORMS = (
    "none | bernoulli:P | ge:rate=R,burst=B | ge:p_gb=P,p_bg=P[,loss_good=P,loss_bad=P]"
    " | burst:rate=R,(every=N[,len=L][,offset=O] | rounds=A;B;... | window=S-E;..."
    " | every_s=S,len_s=S)"
    "[,rank=K] | bottleneck:rate=DATAGRAMS_PER_S,queue=N[,rank=K];"
    " join components with '+'"
)
"""The accepted spec forms, as shown in parse errors and CLI help."""

_FLOAT = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_WINDOW_RE = re.compile(rf"\s*({_FLOAT})\s*-\s*({_FLOAT})\s*")


class _SpecError(ValueError):
    """A problem inside one component; parse_loss_spec adds which one."""


def _num(key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise _SpecError(f"{key}={text!r} is not a number") from None


def _int(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _SpecError(f"{key}={text!r} is not an integer") from None


def _args(kind: str, text: str, positional: str | None) -> dict[str, str]:
    """``k=v,k=v`` into a dict; a lone bare value is taken as ``positional``."""
    args: dict[str, str] = {}
    items = [t.strip() for t in text.split(",")] if text.strip() else []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            if positional is None or len(items) != 1:
                raise _SpecError(f"expected key=value, got {item!r}")
            key, value = positional, item
        key, value = key.strip().lower(), value.strip()
        if not key or not value:
            raise _SpecError(f"empty key or value in {item!r}")
        if key in args:
            raise _SpecError(f"{key}= given twice")
        args[key] = value
    return args


def _only(args: dict[str, str], allowed: set[str], kind: str) -> None:
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise _SpecError(
            f"unknown {kind} parameter(s) {', '.join(unknown)}"
            f" (expected {', '.join(sorted(allowed))})"
        )


def _need(args: dict[str, str], key: str, kind: str) -> str:
    if key not in args:
        raise _SpecError(f"{kind} needs {key}=")
    return args[key]


def _parse_component(kind: str, text: str, seed: int) -> LossModel:
    if kind == "none":
        if text.strip():
            raise _SpecError("none takes no parameters")
        return NoLoss()
    if kind == "bernoulli":
        args = _args(kind, text, positional="p")
        _only(args, {"p"}, kind)
        return Bernoulli(_num("p", _need(args, "p", kind)), seed=seed)
    if kind == "ge":
        args = _args(kind, text, positional=None)
        if {"rate", "burst"} & set(args):
            _only(args, {"rate", "burst"}, kind)
            return GilbertElliott.from_rate(
                _num("rate", _need(args, "rate", kind)),
                _num("burst", _need(args, "burst", kind)),
                seed=seed,
            )
        _only(args, {"p_gb", "p_bg", "loss_good", "loss_bad"}, kind)
        return GilbertElliott(
            _num("p_gb", _need(args, "p_gb", kind)),
            _num("p_bg", _need(args, "p_bg", kind)),
            _num("loss_good", args.get("loss_good", "0")),
            _num("loss_bad", args.get("loss_bad", "1")),
            seed=seed,
        )
    if kind == "burst":
        args = _args(kind, text, positional=None)
        _only(args, {"rate", "every", "len", "offset", "rounds", "window", "every_s", "len_s",
                     "rank"}, kind)
        rate = _num("rate", _need(args, "rate", kind))
        rounds = None
        if "rounds" in args:
            rounds = [_int("rounds", r.strip()) for r in args["rounds"].split(";")]
        windows = None
        if "window" in args:
            windows = []
            for w in args["window"].split(";"):
                m = _WINDOW_RE.fullmatch(w)
                if m is None:
                    raise _SpecError(f"window {w!r} is not START-END in seconds")
                windows.append((float(m[1]), float(m[2])))
        return Microburst(
            rate,
            rounds=rounds,
            every=_int("every", args["every"]) if "every" in args else None,
            length=_int("len", args["len"]) if "len" in args else 1,
            offset=_int("offset", args["offset"]) if "offset" in args else 0,
            windows=windows,
            every_s=_num("every_s", args["every_s"]) if "every_s" in args else None,
            length_s=_num("len_s", args["len_s"]) if "len_s" in args else None,
            rank=_int("rank", args["rank"]) if "rank" in args else None,
            seed=seed,
        )
    if kind == "bottleneck":
        args = _args(kind, text, positional=None)
        _only(args, {"rate", "queue", "rank"}, kind)
        return Bottleneck(
            _num("rate", _need(args, "rate", kind)),
            _int("queue", _need(args, "queue", kind)),
            rank=_int("rank", args["rank"]) if "rank" in args else None,
        )
    raise _SpecError(f"unknown loss kind {kind!r}")


def parse_loss_spec(spec: str, *, seed: int = 0) -> LossModel:
    """Build a loss model from a CLI string; components are joined with ``+``.

    Forms (see :data:`SPEC_FORMS`)::

        none                                     (or an empty string)
        bernoulli:0.05                           bernoulli:p=0.05
        ge:rate=0.02,burst=8                     ge:p_gb=0.01,p_bg=0.3[,loss_good=0,loss_bad=1]
        burst:rate=0.8,every=20,len=1[,offset=0][,rank=0]
        burst:rate=0.8,rounds=5;9;13             burst:rate=0.7,window=1.0-1.5;3-3.2
        bottleneck:rate=20000,queue=64[,rank=0]  (datagrams/s, datagrams)

    Component ``i`` is seeded with ``derive_seed(seed, i)`` so that combined streams
    are independent (a :class:`Bottleneck` has no randomness and ignores it). A single
    component comes back as itself, several as :class:`Combined`. A bad spec raises
    ``ValueError`` with a one-line message naming the bad part and listing the
    accepted forms.
    """
    text = spec.strip()
    if not text or text.lower() == "none":
        return NoLoss()
    models: list[LossModel] = []
    for i, part in enumerate(text.split("+")):
        kind, _, rest = part.strip().partition(":")
        kind = kind.strip().lower()
        try:
            if not kind:
                raise _SpecError("empty component")
            models.append(_parse_component(kind, rest, derive_seed(seed, i)))
        except ValueError as exc:
            # Constructor checks (p out of range, ...) arrive here too.
            raise ValueError(
                f"bad loss spec part {part.strip()!r}: {exc}. Accepted: {SPEC_FORMS}"
            ) from None
    return models[0] if len(models) == 1 else Combined(models)
