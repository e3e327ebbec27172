"""MLT's gradient priorities: which chunks of a message are *critical*.

A critical chunk is always delivered - whatever the bound, the receiver does not close
before it has arrived - and the sender sends it first (:func:`priority_order`, the
order ``MessageSender`` uses). The mask is one bool per chunk and is given to both
``start_send(critical=...)`` and ``start_receive(critical=...)``, so **both ends must
compute the same mask**:

- :func:`critical_by_layer` depends only on the message's layout (which tensors lie
  where, e.g. a DDP bucket: the gradients of several parameters back to back), which
  both ends know before a byte is sent - derive it on each end independently.
- :func:`critical_by_magnitude` depends on the *sender's values*. The receiver cannot
  compute it: either ship the mask to the receiver ahead of the data (reliably - a
  lost critical chunk's flag is never seen, so the DATA header's CRITICAL flag cannot
  tell the receiver what it is missing), or use it only on the sender side, for send
  order (``start_send(critical=mask)`` with the receive posted without a mask: those
  chunks go first and are the least likely to be cut off by the bound, but the
  receiver does not wait for them).

:func:`combine` ORs masks (e.g. layer-critical chunks plus the sender's top
magnitudes, when both ends have the latter).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..wire import chunk_count

__all__ = [
    "DEFAULT_CRITICAL_PATTERNS",
    "TensorLayout",
    "TensorLike",
    "TensorSpec",
    "combine",
    "critical_by_layer",
    "critical_by_magnitude",
    "priority_order",
]

#: Parameter names that mark a tensor critical (regular expressions, case-insensitive,
#: searched anywhere in the name): biases and normalisation layers (BatchNorm,
#: LayerNorm, GroupNorm... and the usual ``bn1`` / ``.bn.`` abbreviation).
DEFAULT_CRITICAL_PATTERNS: tuple[str, ...] = ("bias", "norm", r"(^|[._])bn\d*([._]|$)")


@runtime_checkable
class TensorLike(Protocol):
    """What :meth:`TensorLayout.from_named` reads of a torch tensor."""

    def numel(self) -> int: ...

    def element_size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor in a message: ``numel`` elements of ``itemsize`` bytes at byte
    ``offset``."""

    name: str
    numel: int
    itemsize: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class TensorLayout:
    """Where the tensors of a message lie, in bytes.

    ``TensorLayout([(name, numel, itemsize), ...])`` lays them back to back in order
    (a DDP bucket); ``(name, numel, itemsize, offset)`` entries give explicit byte
    offsets instead (every entry then needs one; tensors must not overlap, gaps are
    allowed). ``nbytes`` is the message size (default: the end of the last tensor; a
    larger value adds trailing padding).
    """

    __slots__ = ("specs", "nbytes")

    def __init__(self, tensors: Iterable[Sequence | TensorSpec], *, nbytes: int | None = None):
        specs: list[TensorSpec] = []
        pos = 0
        explicit: bool | None = None
        for t in tensors:
            if isinstance(t, TensorSpec):
                t = (t.name, t.numel, t.itemsize, t.offset)
            t = tuple(t)
            if len(t) not in (3, 4):
                raise ValueError(f"a tensor is (name, numel, itemsize[, offset]), got {t!r}")
            if explicit is None:
                explicit = len(t) == 4
            elif explicit != (len(t) == 4):
                raise ValueError("give byte offsets for every tensor or for none")
            name, numel, itemsize = str(t[0]), _int(t[1], "numel"), _int(t[2], "itemsize")
            if numel < 0 or itemsize < 1:
                raise ValueError(f"tensor {name!r}: need numel >= 0 and itemsize >= 1")
            offset = _int(t[3], "offset") if explicit else pos
            if offset < 0:
                raise ValueError(f"tensor {name!r}: offset must be >= 0")
            spec = TensorSpec(name, numel, itemsize, offset)
            specs.append(spec)
            pos = spec.end
        ordered = sorted((s for s in specs if s.nbytes), key=lambda s: s.offset)
        for a, b in zip(ordered, ordered[1:]):
            if b.offset < a.end:
                raise ValueError(f"tensors {a.name!r} and {b.name!r} overlap")
        end = max((s.end for s in specs), default=0)
        if nbytes is None:
            nbytes = end
        elif _int(nbytes, "nbytes") < end:
            raise ValueError(f"nbytes {nbytes} is smaller than the tensors' extent {end}")
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.nbytes = int(nbytes)

    @classmethod
    def from_named(cls, named: Iterable[tuple[str, TensorLike | np.ndarray]], *,
                   nbytes: int | None = None) -> TensorLayout:
        """Back-to-back layout of ``(name, tensor)`` pairs: numpy arrays (``size``,
        ``itemsize``) or torch tensors (``numel()``, ``element_size()``)."""
        rows = []
        for name, t in named:
            if isinstance(t, TensorLike):
                rows.append((name, int(t.numel()), int(t.element_size())))
            else:
                a = np.asarray(t)
                rows.append((name, int(a.size), int(a.itemsize)))
        return cls(rows, nbytes=nbytes)

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self):
        return iter(self.specs)

    def chunk_count(self, chunk_bytes: int) -> int:
        return chunk_count(self.nbytes, chunk_bytes)

    def __repr__(self) -> str:
        return f"TensorLayout({len(self.specs)} tensors, {self.nbytes} bytes)"


def _int(v, what: str) -> int:
    if isinstance(v, bool) or int(v) != v:
        raise ValueError(f"{what} must be an integer, got {v!r}")
    return int(v)


def _check_chunk_bytes(chunk_bytes: int) -> int:
    if isinstance(chunk_bytes, bool) or int(chunk_bytes) != chunk_bytes or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
    return int(chunk_bytes)


def critical_by_layer(
    layout: TensorLayout,
    chunk_bytes: int,
    *,
    small_numel: int = 1024,
    patterns: Iterable[str] = DEFAULT_CRITICAL_PATTERNS,
) -> np.ndarray:
    """Bool per chunk: True where the chunk holds any byte of a critical tensor.

    A tensor is critical when ``numel < small_numel`` (biases, norm scales and other
    small tensors: little traffic, large effect) or its name matches one of
    ``patterns`` (regular expressions, case-insensitive, ``re.search``). Empty tensors
    touch no chunk. Derived from the layout alone, so both ends compute the same mask.
    """
    cb = _check_chunk_bytes(chunk_bytes)
    if isinstance(small_numel, bool) or int(small_numel) != small_numel or small_numel < 0:
        raise ValueError(f"small_numel must be an integer >= 0, got {small_numel!r}")
    regex = [re.compile(p, re.IGNORECASE) for p in patterns]
    count = layout.chunk_count(cb)
    crit = [s for s in layout.specs
            if s.nbytes and (s.numel < small_numel or any(r.search(s.name) for r in regex))]
    mask = np.zeros(count, dtype=bool)
    if not crit:
        return mask
    offsets = np.array([s.offset for s in crit], dtype=np.int64)
    ends = np.array([s.end for s in crit], dtype=np.int64)
    first = offsets // cb
    last = (ends - 1) // cb
    # mark [first, last] of every critical tensor: +1 / -1 at the edges, then a cumsum
    edges = np.zeros(count + 1, dtype=np.int64)
    np.add.at(edges, first, 1)
    np.add.at(edges, last + 1, -1)
    return np.cumsum(edges[:count]) > 0


_SCORES = ("max", "l2")


def critical_by_magnitude(
    values: np.ndarray,
    chunk_bytes: int,
    top_fraction: float,
    *,
    score: str = "max",
) -> np.ndarray:
    """Bool per chunk of ``values``' bytes: True for the ``floor(top_fraction * C)``
    chunks with the largest score (``"max"``: largest ``|value|``; ``"l2"``: L2 norm of
    the chunk's values); ties go to the lower chunk index. Non-finite values score as
    infinity. An element that straddles a chunk boundary (``chunk_bytes`` not a
    multiple of the item size) counts in both chunks.

    Depends on the sender's values: see the module notes before using it on a receive.
    """
    cb = _check_chunk_bytes(chunk_bytes)
    if score not in _SCORES:
        raise ValueError(f"score must be one of {_SCORES}, got {score!r}")
    f = float(top_fraction)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"top_fraction must be in [0, 1], got {top_fraction!r}")
    arr = np.asarray(values)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"values must be numeric, got dtype {arr.dtype}")
    flat = np.ascontiguousarray(arr).reshape(-1)
    count = chunk_count(flat.nbytes, cb)
    mags = np.abs(flat if flat.dtype.kind == "f" else flat.astype(np.float64))
    size = flat.itemsize
    if cb % size == 0:  # whole elements per chunk: pad, reshape, reduce
        per = cb // size
        padded = np.zeros(count * per, dtype=mags.dtype)
        padded[: mags.size] = mags
        rows = padded.reshape(count, per)
        if score == "max":
            s = rows.max(axis=1).astype(np.float64)
        else:
            s = np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))
    else:  # elements straddle chunk edges: scatter each into its first and last chunk
        starts = np.arange(flat.size, dtype=np.int64) * size
        first, last = starts // cb, (starts + size - 1) // cb
        m = mags.astype(np.float64)
        s = np.zeros(count, dtype=np.float64)
        if score == "max":
            np.maximum.at(s, first, m)
            np.maximum.at(s, last, m)
        else:
            sq = m * m
            np.add.at(s, first, sq)
            straddle = last != first
            np.add.at(s, last[straddle], sq[straddle])
            s = np.sqrt(s)
    s[~np.isfinite(s)] = np.inf
    k = math.floor(f * count + 1e-9)
    mask = np.zeros(count, dtype=bool)
    if k:
        mask[np.argsort(-s, kind="stable")[:k]] = True
    return mask


def combine(*masks: np.ndarray | None) -> np.ndarray | None:
    """Logical OR of per-chunk masks of one message (``None`` entries are skipped;
    ``None`` if all are)."""
    present = [np.asarray(m, dtype=bool) for m in masks if m is not None]
    if not present:
        return None
    shape = present[0].shape
    if len(shape) != 1 or any(m.shape != shape for m in present):
        raise ValueError(f"masks must be 1-D and alike, got {[m.shape for m in present]}")
    return np.logical_or.reduce(present)


def priority_order(mask: np.ndarray) -> np.ndarray:
    """Chunk indices in send order: critical chunks first, then the rest, each in
    index order - the first pass of ``MessageSender``."""
    m = np.asarray(mask, dtype=bool)
    if m.ndim != 1:
        raise ValueError("mask must be 1-D")
    return np.concatenate([np.flatnonzero(m), np.flatnonzero(~m)])
