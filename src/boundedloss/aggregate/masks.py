"""From the transport's per-chunk delivered mask to a per-element mask, and back.

The transport loses whole chunks (``chunk_bytes`` bytes each); an aggregator works on
elements (floats). An element counts as delivered only if *every* one of its bytes
arrived: when ``chunk_bytes`` is not a multiple of the item size, an element can
straddle two chunks, and if one of them was lost the element holds half a float -
garbage that must be treated as a hole, never read (LTP's "no half floats at packet
edges").

Also here: loss-pattern generators for tests and simulations (independent chunk loss,
bursty chunk loss), and the inverse map from an element mask to the chunks that must
be lost to produce it.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "burst_chunk_mask",
    "chunk_count",
    "chunk_mask_from_elements",
    "element_mask",
    "random_chunk_mask",
]


def _check_sizes(chunk_bytes: int, itemsize: int) -> None:
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if itemsize < 1:
        raise ValueError(f"itemsize must be >= 1, got {itemsize}")


def chunk_count(n_elements: int, chunk_bytes: int, itemsize: int) -> int:
    """Chunks that carry ``n_elements`` items of ``itemsize`` bytes (the last may be short)."""
    _check_sizes(chunk_bytes, itemsize)
    return -(-n_elements * itemsize // chunk_bytes)


def _element_chunks(
    index: np.ndarray, chunk_bytes: int, itemsize: int
) -> tuple[np.ndarray, np.ndarray]:
    """First and last chunk holding a byte of each element in ``index`` (int64 arithmetic)."""
    start = index.astype(np.int64, copy=False) * itemsize
    return start // chunk_bytes, (start + (itemsize - 1)) // chunk_bytes


def element_mask(
    chunk_mask: np.ndarray, chunk_bytes: int, n_elements: int, itemsize: int
) -> np.ndarray:
    """Bool per element: True where all ``itemsize`` bytes of the element arrived.

    ``chunk_mask`` is ``ReceiveResult.delivered`` (bool per chunk of ``chunk_bytes``
    bytes); it must cover at least ``n_elements * itemsize`` bytes (extra chunks, e.g.
    a padded tail, are ignored).

    Vectorised without expanding to bytes: when ``chunk_bytes`` is a multiple of
    ``itemsize`` (the default 1,400-byte chunk and 2/4/8-byte floats) no element
    straddles a chunk edge and the mask is the chunk mask repeated. Otherwise each
    element's first and last chunk come from integer arithmetic, and the element is
    delivered iff every chunk in that range was - counted with a prefix sum over the
    (few) chunks, so an element wider than a chunk is handled too.
    """
    _check_sizes(chunk_bytes, itemsize)
    if n_elements < 0:
        raise ValueError(f"n_elements must be >= 0, got {n_elements}")
    chunk_mask = np.asarray(chunk_mask, dtype=bool).reshape(-1)
    needed = chunk_count(n_elements, chunk_bytes, itemsize)
    if chunk_mask.size < needed:
        raise ValueError(
            f"chunk mask has {chunk_mask.size} chunks; {n_elements} elements of {itemsize} "
            f"bytes in {chunk_bytes}-byte chunks need {needed}"
        )
    chunk_mask = chunk_mask[:needed]
    if chunk_bytes % itemsize == 0:
        return np.repeat(chunk_mask, chunk_bytes // itemsize)[:n_elements]
    first, last = _element_chunks(np.arange(n_elements), chunk_bytes, itemsize)
    delivered_before = np.zeros(needed + 1, dtype=np.int64)
    np.cumsum(chunk_mask, out=delivered_before[1:])
    return (delivered_before[last + 1] - delivered_before[first]) == (last - first + 1)


def chunk_mask_from_elements(
    element_mask: np.ndarray, chunk_bytes: int, itemsize: int
) -> np.ndarray:
    """Bool per chunk: the chunks that may arrive if exactly the lost elements must be lost.

    A chunk is lost iff it holds a byte of some lost element. So
    ``element_mask(chunk_mask_from_elements(m, ...), ...)`` never marks a lost element
    delivered; it can lose more than ``m`` (delivered elements sharing a chunk with a
    lost one), and is exactly ``m`` when ``m`` is constant over every chunk - as it is
    whenever ``m`` came from a chunk mask with ``chunk_bytes % itemsize == 0``.
    For tests and simulations: "lose these elements" -> the transport-level pattern.
    """
    _check_sizes(chunk_bytes, itemsize)
    em = np.asarray(element_mask, dtype=bool).reshape(-1)
    n_chunks = chunk_count(em.size, chunk_bytes, itemsize)
    lost = np.flatnonzero(~em)
    if lost.size == 0:
        return np.ones(n_chunks, dtype=bool)
    first, last = _element_chunks(lost, chunk_bytes, itemsize)
    # +1 at the first lost chunk of each range, -1 after its last: a prefix sum > 0
    # marks every chunk covered by some lost element.
    size = n_chunks + 1
    edges = np.bincount(first, minlength=size) - np.bincount(last + 1, minlength=size)
    return np.cumsum(edges[:n_chunks]) == 0


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"loss probability must be in [0, 1], got {p}")


def random_chunk_mask(n_chunks: int, p: float, rng: np.random.Generator) -> np.ndarray:
    """Bool per chunk, True = delivered: each chunk lost independently with probability p."""
    _check_p(p)
    return rng.random(n_chunks) >= p


def burst_chunk_mask(
    n_chunks: int, p: float, mean_burst: float, rng: np.random.Generator
) -> np.ndarray:
    """Bool per chunk, True = delivered: bursty loss (Gilbert model, stationary start).

    Lost chunks come in runs of geometric length with mean ``mean_burst`` (a queue
    overflowing drops consecutive datagrams), delivered runs are geometric with mean
    ``mean_burst * (1 - p) / p``, so the long-run loss fraction is ``p``. Runs are
    drawn in batches and expanded with ``np.repeat`` - no loop per chunk.

    A delivered run is at least one chunk, so ``p`` can be at most
    ``mean_burst / (mean_burst + 1)``; ``mean_burst = 1`` gives independent-looking
    isolated losses.
    """
    _check_p(p)
    if mean_burst < 1.0:
        raise ValueError(f"mean_burst must be >= 1 chunk, got {mean_burst}")
    if n_chunks <= 0 or p == 0.0:
        return np.ones(max(n_chunks, 0), dtype=bool)
    if p == 1.0:
        return np.zeros(n_chunks, dtype=bool)
    mean_good = mean_burst * (1.0 - p) / p
    if mean_good < 1.0:
        raise ValueError(
            f"loss {p} with bursts of {mean_burst} chunks needs delivered runs shorter than "
            f"one chunk; use p <= {mean_burst / (mean_burst + 1):.3f} or longer bursts"
        )
    start_lost = bool(rng.random() < p)
    pairs = 2 * int(np.ceil(n_chunks / (mean_good + mean_burst))) + 16
    lengths: list[np.ndarray] = []
    covered = 0
    while covered < n_chunks:
        good = rng.geometric(1.0 / mean_good, size=pairs)
        bad = rng.geometric(1.0 / mean_burst, size=pairs)
        runs = np.empty(2 * pairs, dtype=np.int64)
        runs[0::2], runs[1::2] = (bad, good) if start_lost else (good, bad)
        lengths.append(runs)
        covered += int(runs.sum())
    runs = np.concatenate(lengths)
    values = np.empty(runs.size, dtype=bool)
    values[0::2] = not start_lost  # True = delivered
    values[1::2] = start_lost
    return np.repeat(values, runs)[:n_chunks]
