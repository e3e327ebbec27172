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


#: Hole runs a contribution may have in one cache block for the kernel to add around
#: them (a slice each); with more (holes scattered finely, not whole chunks at a time)
#: its holes are zeroed bitwise instead, at a cost that does not depend on them.
MAX_HOLE_RUNS = 24


def masked_mean(
    p: Prepared, *, per_arrived: bool, fallback: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """The shared kernel: (estimate, number of elements that no worker delivered).

    The count of all-lost elements is only taken with ``per_arrived`` (0 otherwise).

    With k = contributions arrived for an element and s = their sum, the estimate is
    ``s / N`` (``per_arrived=False``) or ``s / k`` (``per_arrived=True``); where k = 0 it
    is ``fallback`` if given, else 0. The estimate is flat and in the input dtype.

    A hole never enters a sum: it counts as exactly +0.0, whatever it held - NaN and
    Inf included. The sum runs in contribution order, every element the same way, so
    the result is one definite float whichever way a block was computed:

    - a fully delivered contribution (common: the collective's own one, and every
      contribution of a lossless round) is added as is;
    - holes come whole chunks at a time, so where a contribution has a few runs of them
      in a block it is added around them, slice by slice, and the runs say which
      elements to divide by their own k (the rest by N) - a lossy round's
      contributions cost about what a lossless round's do;
    - where its holes in a block are many runs, they are zeroed bitwise first: the
      IEEE bits of each element ANDed with all-ones (arrived) or all-zeros (hole), ~3x
      faster than a masked ufunc (``np.add(..., where=)``), where a multiply by the
      mask would let NaN * 0 = NaN through; that block's k is then counted element by
      element.

    (``tools/aggregate_cost.py`` times it by chunk size and loss against the element-by-
    element kernel: ``benchmarks/aggregate-cost.json``, BENCHMARKS.md "A lossy round's
    aggregation at a lossless one's cost".)
    """
    values, masks = p.values, p.masks
    n_workers, n = len(values), values[0].size
    acc = _accumulator_dtype(p.dtype)
    full = [bool(m.all()) for m in masks]
    count_needed = per_arrived and not all(full)
    block = max(1, int(CACHE_BLOCK))
    word = np.dtype(f"u{p.dtype.itemsize}")
    all_ones = word.type(np.iinfo(word).max)  # every bit set

    total = np.empty(n, dtype=acc)
    size = min(n, block)
    count = np.empty(size, dtype=_count_dtype(n_workers)) if count_needed else None
    wide = kept = None  # (the bitwise zeroing's scratch: the mask at the element's
    # width, the element's bits with holes zeroed)
    all_lost = 0
    dense = [0] * n_workers
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        tot = total[lo:hi]
        # (a contribution whose holes were too many in two blocks running is taken to
        # be so in the rest: looking costs more than it finds)
        runs = [() if f else None if dense[i] >= 2 else _hole_runs(m[lo:hi])
                for i, (m, f) in enumerate(zip(masks, full))]
        dense = [d + 1 if r is None else 0 for d, r in zip(dense, runs)]
        described = all(r is not None for r in runs)  # (every hole of the block in runs)
        cnt = None if count is None or described else count[:hi - lo]
        holes: list[tuple[int, int]] = []  # (every contribution's runs, where described)
        for i, (x, m, f, r) in enumerate(zip(values, masks, full, runs)):
            src = x[lo:hi]
            if r is None:  # (many: zeroed bitwise, then added as a whole)
                if wide is None or kept is None:
                    wide, kept = np.empty(size, dtype=word), np.empty(size, dtype=word)
                w, k = wide[:hi - lo], kept[:hi - lo]
                np.multiply(m[lo:hi], all_ones, out=w, casting="unsafe")
                np.bitwise_and(src.view(word), w, out=k)
                src, r = k.view(p.dtype), ()
            if i == 0:
                np.copyto(tot, src)
                for a, b in r:
                    tot[a:b] = 0
            elif not r:
                np.add(tot, src, out=tot)
            else:
                at = 0
                for a, b in r:
                    if a > at:
                        np.add(tot[at:a], src[at:a], out=tot[at:a])
                    # (+0.0 added, as zeroed bits add it: a -0.0 sum becomes +0.0)
                    np.add(tot[a:b], 0.0, out=tot[a:b])
                    at = b
                if at < hi - lo:
                    np.add(tot[at:], src[at:], out=tot[at:])
            if cnt is not None:  # (k element by element, while the mask is in cache)
                if i == 0:
                    np.copyto(cnt, m[lo:hi])
                elif f:
                    np.add(cnt, 1, out=cnt)
                else:
                    np.add(cnt, m[lo:hi], out=cnt)
            holes.extend(r)
        if count is None or (described and not holes):
            np.divide(tot, n_workers, out=tot)  # s / N (or s / k with k = N everywhere)
        elif cnt is None:
            all_lost += _divide_around(tot, holes, n_workers, fallback, lo)
        else:
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


def _hole_runs(mask: np.ndarray) -> list[tuple[int, int]] | None:
    """The (start, stop) of each run of False in ``mask``, in order; None where they
    are more than ``MAX_HOLE_RUNS``. (Found run by run: a bool argmin or argmax stops at
    the first element it looks for, so this reads the mask about once.)"""
    if mask.all():
        return []
    sample = mask[::64]  # (too many runs is seen in every 64th element, and cheaply)
    if np.count_nonzero(sample[1:] != sample[:-1]) > 2 * MAX_HOLE_RUNS:
        return None
    runs: list[tuple[int, int]] = []
    at, size = 0, mask.size
    while at < size:
        rest = mask[at:]
        a = int(rest.argmin())
        if rest[a]:  # (no hole left)
            break
        if len(runs) == MAX_HOLE_RUNS:
            return None
        a += at
        tail = mask[a:]
        b = int(tail.argmax())
        b = a + b if tail[b] else size
        runs.append((a, b))
        at = b
    return runs


def _divide_around(tot: np.ndarray, holes: list[tuple[int, int]], n_workers: int,
                   fallback: np.ndarray | None, lo: int) -> int:
    """``tot`` (a block's sums, from ``lo``) divided by k: N, but across ``holes`` (every
    contribution's runs of them) N less the contributions missing there - ``fallback``
    (else 0) where none arrived. Returns how many elements none arrived for."""
    # (a sweep over the runs' ends: the stretches where the same contributions miss)
    ends: dict[int, int] = {}
    for a, b in holes:
        ends[a] = ends.get(a, 0) + 1
        ends[b] = ends.get(b, 0) - 1
    lost = 0
    at, missing = 0, 0
    for x in sorted(ends):
        if x > at:
            piece = tot[at:x]
            k = n_workers - missing
            if k > 0:
                np.divide(piece, k, out=piece)
            else:
                lost += x - at
                if fallback is None:
                    piece[:] = 0
                else:
                    np.copyto(piece, fallback[lo + at:lo + x], casting="same_kind")
            at = x
        missing += ends[x]
    if at < tot.size:
        np.divide(tot[at:], n_workers, out=tot[at:])
    return lost
