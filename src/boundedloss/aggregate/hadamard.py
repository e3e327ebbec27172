"""Randomized Hadamard dispersion (OptiReduce): spread a lost chunk's damage thinly.

Without it, a lost chunk of a gradient message loses ~350 consecutive float32 values
outright: each is wrong by its whole value. Every worker instead sends
``y = H D x / sqrt(m)``: D a random +/-1 diagonal, H the m x m Walsh-Hadamard matrix.
The map is orthonormal, so the aggregator works in the encoded domain as usual and the
result is decoded with ``x = D H y / sqrt(m)`` (H is symmetric and H H = m I). A lost
encoded coordinate now puts an error of about ``|y_j| / sqrt(m)`` on *every* coordinate
instead of a full-size error on one: the L2 error is unchanged (orthonormality), the
largest per-coordinate error shrinks by about sqrt(chunk elements / m) times the
ratio of typical to largest value. D is what makes this hold for *any* input (without
it, a constant vector would encode to one spike); it is drawn from a seed that every
rank derives identically per message (:func:`message_seed`), so D is never sent.

Encoded length: a vector of n elements is cut into blocks of ``block`` elements (a
power of two); the last, partial block is padded with zeros to its own next power of
two, so the padding is always shorter than that block (n <= block: one block of
next_pow2(n)). The padding is sent: it is the price of the transform (at most 2x for a
message just over a power of two below ``block``, a few percent for long ones).

Why blocks (``block``, default 2**16 elements = 256 KiB of float32): the transform's
cost per element grows with log2(block), its scratch memory is per call anyway, and -
the real trade-off - a lost chunk's error spreads over its own block only: a bigger
block spreads it thinner (max error ~ 1/sqrt(block)) but lets one lost chunk touch more
coordinates and gives a partial last block more padding. 2**16 makes a 1,400-byte
chunk (350 float32) about 0.5% of a block.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .. import native
from .base import Aggregator

__all__ = ["Dispersed", "HadamardDispersion", "message_seed"]

_U64 = (1 << 64) - 1


def message_seed(session: int, round_id: int, message_id: int) -> int:
    """The seed of one message's random signs, the same on every rank.

    From the session token (random per job, agreed at rendezvous), the round and the
    message id: every rank computes it without talking, and no two messages of a job
    share a D. BLAKE2b, not ``hash()``, which is salted per process.
    """
    packed = struct.pack("<QQQ", session & _U64, round_id & _U64, message_id & _U64)
    digest = hashlib.blake2b(packed, digest_size=8, person=b"boundedloss-rht").digest()
    return int.from_bytes(digest, "little")


_NATIVE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _sign_bits(seed: int, length: int) -> bytes:
    """D's random bits, most significant first: bit i set means D_ii = -1."""
    return np.random.default_rng(seed).bytes((length + 7) // 8)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def _butterflies(
    cur: np.ndarray, nxt: np.ndarray, h: int, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Stages h, 2h, ..., width/2 of the unnormalised transform, ping-ponging between
    two buffers; returns (holding the result, the other). Stage h pairs element i with
    i + h inside every group of 2h, on whole arrays through a (-1, 2, h) view: one add
    and one subtract per stage. Every block of ``width`` is a union of groups, so a
    flat array of many blocks needs no loop over blocks."""
    while h < width:
        a = cur.reshape(-1, 2, h)
        b = nxt.reshape(-1, 2, h)
        np.add(a[:, 0], a[:, 1], out=b[:, 0])
        np.subtract(a[:, 0], a[:, 1], out=b[:, 1])
        cur, nxt = nxt, cur
        h *= 2
    return cur, nxt


def _fwht(buf: np.ndarray, spare: np.ndarray, width: int) -> bool:
    """Normalised Walsh-Hadamard transform (Sylvester order, scaled by 1/sqrt(width)) of
    every ``width``-block of ``buf``; ``spare`` is scratch of the same size. Both are
    overwritten; returns True if the result ended in ``buf``, False if in ``spare``.

    A butterfly stage on a small half-width h (1, 2, 4...) is slow in numpy: its
    innermost runs are h elements long, so per-run overhead dominates. So each block is
    seen as an (A, B) matrix, B = 2**floor(log2(width) / 2) <= A: the stages on the
    row index (h >= B) run on rows of >= B contiguous elements; one transposing copy
    (which also applies the 1/sqrt(width) scale) makes the column index the slow one,
    its stages run on runs of A, and a second transposing copy restores the order.
    log2(width) + 2 whole-array passes, no BLAS (whose threads stall on a busy
    machine), no loop over elements or blocks.
    """
    if width == 1:
        return True
    log2 = width.bit_length() - 1
    b_len = 1 << (log2 // 2)
    a_len = width // b_len
    cur, nxt = _butterflies(buf, spare, b_len, width)  # row-index bits
    scale = cur.dtype.type(1.0 / math.sqrt(width))
    np.multiply(cur.reshape(-1, a_len, b_len).transpose(0, 2, 1), scale,
                out=nxt.reshape(-1, b_len, a_len))
    cur, nxt = _butterflies(nxt, cur, a_len, width)  # column-index bits, now rows
    np.copyto(nxt.reshape(-1, a_len, b_len), cur.reshape(-1, b_len, a_len).transpose(0, 2, 1))
    return nxt is buf


@dataclass(frozen=True, slots=True)
class HadamardDispersion:
    """Encode before sending, decode after aggregating. Stateless: D comes from a seed.

    ``encode(x, seed)`` returns the encoded vector (flattened, padded to
    :meth:`encoded_length`); ``decode(y, seed, n)`` inverts it and drops the padding.
    float32 and float64 are transformed in their own precision (round trip within a few
    ulps times log2(block)); float16 is transformed in float32 and returned as float16
    (the wire carries the tensor's dtype; note the encoded values can reach ||x||, so
    float16 only suits tensors whose norm fits it); other dtypes become float64.
    """

    block: int = 1 << 16

    def __post_init__(self) -> None:
        if self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two, got {self.block}")

    # ---------------------------------------------------------------- layout
    def _segments(self, n: int) -> list[tuple[int, int, int]]:
        """(offset, length, width): full blocks of ``block``, then the padded tail."""
        full, rest = divmod(n, self.block)
        segments = []
        if full:
            segments.append((0, full * self.block, self.block))
        if rest:
            tail = _next_pow2(rest)
            segments.append((full * self.block, tail, tail))
        return segments

    def encoded_length(self, n: int) -> int:
        """Elements on the wire for an n-element vector (n plus the tail's padding)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return sum(length for _, length, _ in self._segments(n))

    @staticmethod
    def signs(seed: int, length: int, dtype: np.dtype | type = np.float64) -> np.ndarray:
        """D's diagonal: ``length`` values of +/-1 from ``np.random.default_rng(seed)``
        (one random bit each, 1 for -1)."""
        bits = np.unpackbits(np.frombuffer(_sign_bits(seed, length), dtype=np.uint8),
                             count=length)
        return np.array([1, -1], dtype=dtype)[bits]

    def _times_signs(self, x: np.ndarray, seed: int, out: np.ndarray) -> None:
        """``out = x * D`` (``out`` of the work dtype, ``x`` may be ``out`` itself)."""
        if native.enabled() and out.dtype in _NATIVE_DTYPES and out.flags.c_contiguous:
            if x is not out:
                np.copyto(out, x, casting="same_kind")
            native.module().flip_signs(out, _sign_bits(seed, out.size), out.itemsize)
        else:
            np.multiply(x, self.signs(seed, out.size, out.dtype), out=out, casting="same_kind")

    @staticmethod
    def _work_dtype(dtype: np.dtype) -> tuple[np.dtype, np.dtype]:
        """(dtype computed in, dtype returned)."""
        if not np.issubdtype(dtype, np.floating):
            return np.dtype(np.float64), np.dtype(np.float64)
        return (np.dtype(np.float32) if dtype.itemsize < 4 else dtype), dtype

    def transform(self, buf: np.ndarray, n: int) -> np.ndarray:
        """The normalised transform of every block of the flat buffer ``buf`` (of
        ``encoded_length(n)`` elements, overwritten; no signs): returns the array holding
        the result (``buf``, or in numpy a scratch buffer)."""
        if native.enabled() and buf.dtype in _NATIVE_DTYPES:  # in place, no scratch
            fwht = native.module().fwht
            for off, length, width in self._segments(n):
                if width > 1:
                    fwht(buf[off : off + length], width, buf.itemsize)
            return buf
        spare = np.empty_like(buf)
        result = None
        for off, length, width in self._segments(n):
            seg = slice(off, off + length)
            in_buf = _fwht(buf[seg], spare[seg], width)
            if result is None:
                result = buf if in_buf else spare
            elif (result is buf) != in_buf:  # the tail ended in the other buffer: move it
                np.copyto(result[seg], (buf if in_buf else spare)[seg])
        return buf if result is None else result

    # ----------------------------------------------------------- the transform
    def encode(self, x: np.ndarray, seed: int) -> np.ndarray:
        """``H D x / sqrt(width)`` blockwise; x is flattened and zero-padded first."""
        x = np.asarray(x).reshape(-1)
        work, result = self._work_dtype(x.dtype)
        n = x.size
        m = self.encoded_length(n)
        signed = np.empty(m, dtype=work)
        signed[n:] = 0
        self._times_signs(x, seed, signed[:n])
        y = self.transform(signed, n)
        return y if result == work else y.astype(result)

    def decode(self, y: np.ndarray, seed: int, n: int) -> np.ndarray:
        """Inverse of :meth:`encode` for an original length ``n``: ``D H y / sqrt(width)``,
        padding dropped. Returns a flat array of n elements."""
        y = np.asarray(y).reshape(-1)
        m = self.encoded_length(n)
        if y.size != m:
            raise ValueError(f"an encoded {n}-element vector has {m} elements, got {y.size}")
        work, result = self._work_dtype(y.dtype)
        x = self.transform(y.astype(work), n)[:n]  # a copy: y is the caller's
        self._times_signs(x, seed, x)
        return x if result == work else x.astype(result)


@dataclass(frozen=True, slots=True)
class Dispersed(Aggregator):
    """Any aggregator, run in the Hadamard-encoded domain of one message.

    Every worker sent ``hadamard.encode(x_i, seed)``; the transport lost encoded
    coordinates; ``inner`` fills those holes in the encoded domain (where they are
    ordinary values, so zero / rescale / stale fill all keep their meaning - the
    encoding is linear), and the estimate is decoded back to ``n`` elements: the
    damage of a lost chunk lands spread thinly over every coordinate of its block.
    ``previous`` (original domain, n elements) is encoded with this message's seed
    before ``inner`` sees it.

    One instance per message (the seed changes every message); it is a cheap value.
    Unlike other aggregators its input (encoded length) and output (n) shapes differ.
    """

    inner: Aggregator
    seed: int
    n: int
    hadamard: HadamardDispersion = field(default_factory=HadamardDispersion)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.inner.name}+hadamard"

    def aggregate(
        self,
        contributions: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
        *,
        previous: np.ndarray | None = None,
    ) -> np.ndarray:
        enc_prev = None if previous is None else self.hadamard.encode(previous, self.seed)
        est = self.inner.aggregate(contributions, masks, previous=enc_prev)
        return self.hadamard.decode(est, self.seed, self.n)
