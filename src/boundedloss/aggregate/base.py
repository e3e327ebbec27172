"""The aggregator interface and the one masked-sum kernel every aggregator shares.

An aggregator decides *what a hole in a message becomes*. It is handed, per worker, the
float array as received and a bool mask per element (True = every byte of the element
arrived; see :func:`~boundedloss.aggregate.masks.element_mask`), and returns its
estimate of the mean over the workers. It knows nothing about policies, sockets or who
sent what: the collective gathers the arrays, the aggregator only does arithmetic.

Holes may hold anything (zeros, last round's bytes, half a float, NaN): no result may
depend on them. The kernel below never lets a hole's bits into the arithmetic.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

__all__ = ["Aggregator", "Prepared", "masked_mean", "prepare"]

#: Elements per cache block of the kernel: every contribution's block is folded into
#: the running total while that block of the total is still in cache, so N
#: contributions cost about one pass over memory instead of ~4N whole-array passes.
#: Read at call time (tests shrink it).
CACHE_BLOCK = 1 << 17


class Aggregator(abc.ABC):
    """What a hole becomes. Subclasses are small frozen dataclasses, stateless: any
    memory (the previous aggregate for stale fill) is the caller's and comes in as
    ``previous``."""

    name: ClassVar[str] = "aggregator"

    @abc.abstractmethod
    def aggregate(
        self,
        contributions: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
        *,
        previous: np.ndarray | None = None,
    ) -> np.ndarray:
        """Estimate of the mean over the N = len(contributions) workers.

        ``contributions[i]``: worker i's float array as received (holes are never
        read); ``masks[i]``: bool per element, same shape, True = arrived;
        ``previous``: the caller's last result for this tensor (used only by the
        aggregators that fall back to it). Returns a new array of the contributions'
        shape and dtype.
        """


@dataclass(frozen=True, slots=True)
class Prepared:
    """Validated, flattened inputs of one aggregate call."""

    values: list[np.ndarray]  # 1-D views (or copies, if the input was not contiguous)
    masks: list[np.ndarray]  # 1-D bool
    previous: np.ndarray | None  # 1-D, or None
    shape: tuple[int, ...]
    dtype: np.dtype


def prepare(
    contributions: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    previous: np.ndarray | None = None,
) -> Prepared:
    """Check the inputs agree (count, shape, one float dtype) and flatten them.

    Mixed dtypes are an error, not a silent copy: the transport hands every worker's
    buffer in the tensor's own dtype, and float32 must stay float32.
    """
    if len(contributions) == 0:
        raise ValueError("need at least one contribution")
    if len(contributions) != len(masks):
        raise ValueError(f"{len(contributions)} contributions but {len(masks)} masks")
    first = np.asarray(contributions[0])
    dtype, shape = first.dtype, first.shape
    if not np.issubdtype(dtype, np.floating):
        raise TypeError(f"contributions must be floating point, got {dtype}")
    values, flat_masks = [], []
    for i, (x, m) in enumerate(zip(contributions, masks)):
        x = np.asarray(x)
        m = np.asarray(m, dtype=bool)
        if x.dtype != dtype:
            raise TypeError(f"contribution {i} is {x.dtype}, contribution 0 is {dtype}")
        if x.shape != shape or m.shape != shape:
            raise ValueError(
                f"contribution {i} has shape {x.shape} and mask {m.shape}; expected {shape}"
            )
        values.append(x.reshape(-1))
        flat_masks.append(m.reshape(-1))
    prev = None
    if previous is not None:
        prev = np.asarray(previous)
        if prev.shape != shape:
            raise ValueError(f"previous has shape {prev.shape}; expected {shape}")
        prev = prev.reshape(-1)
    return Prepared(values, flat_masks, prev, shape, dtype)


def _accumulator_dtype(dtype: np.dtype) -> np.dtype:
    """Accumulate in the input dtype (float32 stays float32); float16 in float32, whose
    range and precision a sum of N half floats needs."""
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def _count_dtype(n: int) -> np.dtype:
    # uint8/uint16 so that float32 / count stays float32 (int32 would promote to float64)
    return np.dtype(np.uint8 if n < 256 else np.uint16 if n < 65536 else np.uint32)


def masked_mean(
    p: Prepared, *, per_arrived: bool, fallback: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """The shared kernel: (estimate, number of elements that no worker delivered).

    The count of all-lost elements is only taken with ``per_arrived`` (0 otherwise).

    With k = contributions arrived for an element and s = their sum, the estimate is
    ``s / N`` (``per_arrived=False``) or ``s / k`` (``per_arrived=True``); where k = 0 it
    is ``fallback`` if given, else 0. The estimate is flat and in the input dtype.

    Holes are removed by bits, not arithmetic: the IEEE bits of each element are ANDed
    with all-ones (arrived) or all-zeros (hole), so a hole becomes exactly +0.0 whatever
    it held - NaN and Inf included - and never enters a sum. This is ~3x faster than a
    masked ufunc (``np.add(..., where=)``), and a multiply by the mask would let
    NaN * 0 = NaN through. A fully delivered contribution (common: the collective's own
    one, and every contribution of a lossless round) is added as is.
    """
    values, masks = p.values, p.masks
    n_workers, n = len(values), values[0].size
    acc = _accumulator_dtype(p.dtype)
    word = np.dtype(f"u{p.dtype.itemsize}")
    all_ones = word.type(np.iinfo(word).max)  # every bit set
    full = [bool(m.all()) for m in masks]
    count_needed = per_arrived and not all(full)
    block = max(1, int(CACHE_BLOCK))

    total = np.empty(n, dtype=acc)
    count = np.empty(min(n, block), dtype=_count_dtype(n_workers)) if count_needed else None
    wide = np.empty(min(n, block), dtype=word)  # the mask widened to the element's width
    kept = np.empty(min(n, block), dtype=word)  # the element's bits, holes zeroed
    all_lost = 0
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        size = hi - lo
        tot = total[lo:hi]
        for i, (x, m, f) in enumerate(zip(values, masks, full)):
            if f:
                src = x[lo:hi]
            else:
                np.multiply(m[lo:hi], all_ones, out=wide[:size], casting="unsafe")
                np.bitwise_and(x[lo:hi].view(word), wide[:size], out=kept[:size])
                src = kept[:size].view(p.dtype)
            if i == 0:
                np.copyto(tot, src)
            else:
                np.add(tot, src, out=tot)
            if count is not None:
                cnt = count[:size]
                if i == 0:
                    np.copyto(cnt, m[lo:hi])
                elif f:
                    np.add(cnt, 1, out=cnt)
                else:
                    np.add(cnt, m[lo:hi], out=cnt)
        if count is None:
            np.divide(tot, n_workers, out=tot)  # s / N (or s / k with k = N everywhere)
            continue
        cnt = count[:size]
        none = cnt == 0
        lost_here = int(np.count_nonzero(none))
        if lost_here:
            all_lost += lost_here
            np.maximum(cnt, 1, out=cnt)  # s = 0 there: 0 / 1 = 0, no masked divide
        np.divide(tot, cnt, out=tot, dtype=acc)
        if lost_here and fallback is not None:
            np.copyto(tot, fallback[lo:hi], where=none, casting="same_kind")
    if acc != p.dtype:
        total = total.astype(p.dtype)
    return total, all_lost
