"""The four ways a hole can be filled, and the registry that names them.

Notation, per element: N workers, k of whose values arrived, s = the sum of those k.

=============  ==================  ===============================  ====================
name           k > 0               k = 0                            from
=============  ==================  ===============================  ====================
``zero``       s / N               0                                MLT, DBLP gradients
``unbiased``   s / k               0                                arXiv 2507.07114
``bubble``     s / k               ``previous`` if given, else 0    LTP bubble filling
``stale``      s / k               ``previous`` (required there)    2507.07114 broadcast,
                                                                    MLT parameters
=============  ==================  ===============================  ====================

Which one to use: ``zero`` shrinks the mean by the delivered fraction (a loss of p
scales the gradient by about 1 - p: an unplanned learning-rate cut that grows with the
loss); ``unbiased`` does not. ``bubble`` is ``unbiased`` plus per-worker filled tensors
and a ``previous`` fallback; ``stale`` is the receiver of a lossy broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .base import Aggregator, masked_mean, prepare

__all__ = [
    "AGGREGATORS",
    "BubbleFill",
    "StaleFill",
    "UnbiasedRescale",
    "ZeroFill",
    "apply_broadcast",
    "make_aggregator",
]


@dataclass(frozen=True, slots=True)
class ZeroFill(Aggregator):
    """A missing value counts as zero: ``s / N`` (MLT and DBLP for gradients).

    Cheapest and what the papers do, but biased: with each value lost independently
    with probability p, E[estimate] = (1 - p) * mean. ``previous`` is ignored.
    """

    name = "zero"

    def aggregate(
        self,
        contributions: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
        *,
        previous: np.ndarray | None = None,
    ) -> np.ndarray:
        p = prepare(contributions, masks)  # previous is not read (nor checked)
        est, _ = masked_mean(p, per_arrived=False)
        return est.reshape(p.shape)


@dataclass(frozen=True, slots=True)
class UnbiasedRescale(Aggregator):
    """Divide by the contributions that arrived, not by the world size: ``s / k``, and 0
    where nothing arrived (arXiv 2507.07114's reduce-scatter).

    Why unbiased: whatever subset S of workers arrived for an element, if which workers
    arrive does not depend on their values, then

    - as an estimate of the *true gradient* (each worker's value an independent unbiased
      sample of it), the mean over S is unbiased for every non-empty S;
    - as an estimate of the *N workers' mean*, it is unbiased given k > 0 when every
      worker is equally likely to be lost (exchangeable loss): S is then a uniformly
      random k-subset. (If one contribution never gets lost - the collective's own -
      the estimate leans toward it; the true-gradient statement still holds.)

    The k = 0 elements (probability p^N under independent loss) are set to 0, so the
    unconditional expectation is (1 - p^N) * mean. ``previous`` is ignored; use
    :class:`BubbleFill` to fall back to it there.
    """

    name = "unbiased"

    def aggregate(
        self,
        contributions: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
        *,
        previous: np.ndarray | None = None,
    ) -> np.ndarray:
        p = prepare(contributions, masks)  # previous is not read (nor checked)
        est, _ = masked_mean(p, per_arrived=True)
        return est.reshape(p.shape)


@dataclass(frozen=True, slots=True)
class BubbleFill(Aggregator):
    """LTP's bubble filling: rebuild every worker's contribution as a full, well-formed
    tensor, then average.

    Worker i's hole at element j is filled with the mean of the values that did arrive
    for j (``s_j / k_j``) - the neutral value for the mean: a filled hole neither pulls
    the mean toward zero (as zero fill does) nor carries garbage (half floats at chunk
    edges are holes too; see :func:`~boundedloss.aggregate.masks.element_mask`). Where
    no worker's value arrived (k_j = 0) every worker's hole gets ``previous[j]`` if
    given, else 0.

    The aggregate is the mean of the filled tensors, which is exactly
    (s + (N - k) * s / k) / N = s / k where k > 0: **the same as**
    :class:`UnbiasedRescale` **wherever k > 0** (computed by the same kernel, so equal to
    the bit). It differs in two ways: the filled per-worker tensors are available
    (:meth:`fill`, e.g. for per-worker error feedback), and all-lost elements fall back
    to ``previous`` instead of 0. :meth:`aggregate` uses the closed form, without
    materialising the N filled tensors.
    """

    name = "bubble"

    def aggregate(
        self,
        contributions: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
        *,
        previous: np.ndarray | None = None,
    ) -> np.ndarray:
        p = prepare(contributions, masks, previous)
        est, _ = masked_mean(p, per_arrived=True, fallback=p.previous)
        return est.reshape(p.shape)

    def fill(
        self,
        contributions: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
        previous: np.ndarray | None = None,
    ) -> list[np.ndarray]:
        """The N filled tensors: worker i's arrived values, and the bubble value
        (:meth:`aggregate`'s result) in its holes. New arrays, inputs' shape and dtype."""
        p = prepare(contributions, masks, previous)
        bubble, _ = masked_mean(p, per_arrived=True, fallback=p.previous)
        # np.where selects, it does no arithmetic on a hole: garbage never gets through
        return [np.where(m, x, bubble).reshape(p.shape) for x, m in zip(p.values, p.masks)]


@dataclass(frozen=True, slots=True)
class StaleFill(Aggregator):
    """``s / k`` where anything arrived; where nothing did, last round's value.

    The receiver of a lossy broadcast (2507.07114's bounded-drift all-gather; MLT's
    "lost parameters keep last iteration's value"): with N = 1 it is exactly
    ``where(mask, received, previous)`` (:func:`apply_broadcast`). A replica that keeps
    stale values drifts from the sender by a bounded amount - each stale value is
    refreshed with probability 1 - p every round - instead of being reset to zero.

    ``previous`` is required wherever k = 0: a ValueError is raised if it is None and
    some element has no contribution. It is not demanded when every element got at
    least one value, because collectives legitimately have no previous in their first
    round and there the owner's own (always complete) contribution guarantees k >= 1.
    Silently using 0 instead would be zero fill's bias in disguise.
    """

    name = "stale"

    def aggregate(
        self,
        contributions: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
        *,
        previous: np.ndarray | None = None,
    ) -> np.ndarray:
        p = prepare(contributions, masks, previous)
        est, all_lost = masked_mean(p, per_arrived=True, fallback=p.previous)
        if all_lost and p.previous is None:
            raise ValueError(
                f"StaleFill: {all_lost} element(s) arrived from no worker and no `previous` "
                "was given to keep them at; pass last round's result (or use 'bubble', "
                "which falls back to 0)"
            )
        return est.reshape(p.shape)


def apply_broadcast(received: np.ndarray, mask: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """A lossy broadcast's receiver: the received value where it arrived, else the
    previous one. StaleFill with N = 1, for callers holding one message. New array in
    ``received``'s dtype and shape."""
    received = np.asarray(received)
    mask = np.asarray(mask, dtype=bool)
    if previous is None:
        raise ValueError("apply_broadcast needs `previous` (last round's values)")
    previous = np.asarray(previous)
    if mask.shape != received.shape or previous.shape != received.shape:
        raise ValueError(
            f"received {received.shape}, mask {mask.shape}, previous {previous.shape} differ"
        )
    return fill_holes(received.copy(), mask, previous)


def fill_holes(received: np.ndarray, mask: np.ndarray,
               previous: np.ndarray | None) -> np.ndarray:
    """``received`` itself, its holes (``mask`` False) overwritten with ``previous``'s
    values there (0 where there is none): ``apply_broadcast`` in place, for a caller that
    owns ``received`` (a collective, its receive's buffer) - a masked copy of the holes
    and no new array (``tools/aggregate_cost.py`` times it)."""
    np.copyto(received, 0 if previous is None else previous, where=~mask,
              casting="same_kind")
    return received


AGGREGATORS: dict[str, type[Aggregator]] = {
    "zero": ZeroFill,
    "unbiased": UnbiasedRescale,
    "bubble": BubbleFill,
    "stale": StaleFill,
}


def make_aggregator(name: str) -> Aggregator:
    """The aggregator registered as ``name`` (see :data:`AGGREGATORS`)."""
    try:
        cls = AGGREGATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown aggregator {name!r}; choose one of: {', '.join(AGGREGATORS)}"
        ) from None
    return cls()
