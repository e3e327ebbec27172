"""The IDX file format (MNIST's and Fashion-MNIST's), gzip-compressed, read with numpy.

An IDX file is a 4-byte magic - two zero bytes, a type code, the number of dimensions -
then each dimension as a big-endian uint32, then the values, big-endian, row-major. A
file whose header or length does not add up is an :class:`IdxError` naming the file,
never a short or misshapen array.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

#: the type code -> the big-endian numpy dtype of the values
IDX_TYPES: dict[int, np.dtype] = {
    code: np.dtype(name) for code, name in (
        (0x08, ">u1"), (0x09, ">i1"), (0x0B, ">i2"), (0x0C, ">i4"), (0x0D, ">f4"),
        (0x0E, ">f8"))
}
#: the most dimensions a header may claim (the format's byte allows 255; none has more)
MAX_DIMENSIONS = 8


class IdxError(ValueError):
    """A file that is not a whole IDX file."""


def parse_idx(raw: bytes, name: str = "IDX data") -> np.ndarray:
    """The array ``raw`` (an uncompressed IDX file) holds, in native byte order."""
    if len(raw) < 4:
        raise IdxError(f"{name}: {len(raw)} bytes, shorter than an IDX header")
    zeros, code, ndim = struct.unpack_from(">HBB", raw)
    if zeros != 0 or code not in IDX_TYPES or not 1 <= ndim <= MAX_DIMENSIONS:
        raise IdxError(f"{name}: not an IDX file (magic {raw[:4].hex()})")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxError(f"{name}: truncated in its header ({len(raw)} of {header} bytes)")
    shape = struct.unpack_from(f">{ndim}I", raw, 4)
    dtype = IDX_TYPES[code]
    expected = header + int(np.prod(shape, dtype=object)) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "longer than its header says"
        raise IdxError(f"{name}: {what} ({len(raw)} bytes; a {'x'.join(map(str, shape))} "
                       f"{dtype.name} IDX file is {expected})")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(
        dtype.newbyteorder("="))


def read_idx_gz(path: Path) -> np.ndarray:
    """The array in the gzip-compressed IDX file at ``path``."""
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise IdxError(f"{path}: not a whole gzip file ({e})") from None
    return parse_idx(raw, str(path))
