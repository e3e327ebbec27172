"""Datagram header: pack, unpack, validate.

Every datagram starts with one fixed 48-byte little-endian header::

    magic     u16   0x4C42 ("BL")
    version   u8
    kind      u8    Kind
    flags     u16   Flag
    plen      u16   payload length (must equal datagram length - 48)
    session   u64   random per job, from rendezvous
    round     u32   training round / iteration
    message   u32   message id within the round (e.g. a DDP bucket)
    index     u32   DATA: chunk index; PROBE: probe sequence; BITMAP: first chunk covered
    count     u32   number of chunks in the message
    mbytes    u64   message length in bytes
    cbytes    u32   nominal chunk payload size (chunk i starts at i * cbytes)
    tseq      u32   DATA: transmission sequence (counts every DATA datagram of the
                    message, retransmissions included); ACK: highest tseq seen

Geometry (``count``, ``mbytes``, ``cbytes``) travels in every datagram so that every
datagram can be checked on its own: a datagram whose geometry is impossible, or whose
payload length does not match what its kind and index require, is rejected here before
anything is written anywhere.

Payloads per kind:

- DATA:   the chunk's bytes (``cbytes`` for every chunk but the last). With
  ``PROBE_CARRIED`` set it is also the send's first PROBE (sequence 1, ``FINAL``): on a
  warm path that loses nothing (``Recovery.may_carry_probe``) the last DATA of the
  first pass asks "what is missing?" itself - half the datagrams of a lossless
  one-datagram message.
- PROBE:  empty. The sender asks "what is missing?".
- BITMAP: ``<II`` (echoed probe sequence, chunks delivered so far), then a bitmap of the
  chunks ``index ..`` (bit set = delivered, little bit order, ``index`` a multiple of 8).
- STOP:   ``<I`` chunks delivered; ``index`` holds the CloseReason.
- ACK:    ``<I`` chunks delivered; ``tseq`` the highest transmission sequence seen.
  Sent every few DATA datagrams, it is the sender's flow-control window feedback. With
  ``CREDIT`` set, ``index`` is the receiver's grant: the DATA datagrams the sender may
  have in flight beyond ``tseq``.
"""

from __future__ import annotations

import enum
import functools
import itertools
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = 0x4C42
VERSION = 2  # (2: DATA may carry the first PROBE - a version-1 peer would not answer it)

#: the header's fields in order, as (name, struct code): the one definition of the
#: layout - the struct, its numpy twin and every field offset derive from it
HEADER_FIELDS: tuple[tuple[str, str], ...] = (
    ("magic", "H"),
    ("version", "B"),
    ("kind", "B"),
    ("flags", "H"),
    ("plen", "H"),
    ("session", "Q"),
    ("round", "I"),
    ("message", "I"),
    ("index", "I"),
    ("count", "I"),
    ("mbytes", "Q"),
    ("cbytes", "I"),
    ("tseq", "I"),
)
_NUMPY_TYPE = {"B": "u1", "H": "<u2", "I": "<u4", "Q": "<u8"}
HEADER = struct.Struct("<" + "".join(code for _, code in HEADER_FIELDS))
HEADER_BYTES = HEADER.size
#: numpy twin of HEADER, used to build every DATA header of a message at once
HEADER_DTYPE = np.dtype([(name, _NUMPY_TYPE[code]) for name, code in HEADER_FIELDS])
#: size and byte offset of each header field (the layout has no padding)
FIELD_BYTES: dict[str, int] = {name: struct.calcsize(code) for name, code in HEADER_FIELDS}
OFFSET: dict[str, int] = dict(
    zip(FIELD_BYTES, itertools.accumulate(FIELD_BYTES.values(), initial=0)))
assert HEADER_DTYPE.itemsize == HEADER_BYTES == 48

DEFAULT_CHUNK_BYTES = 1400  # fits a 1,500-byte MTU with IP/UDP headers and ours
MAX_CHUNK_BYTES = 65_000  # a single UDP datagram on loopback (65,507 minus our header)
MAX_MESSAGE_BYTES = 1 << 40
MAX_CHUNKS = (1 << 32) - 1

TSEQ_OFFSET = OFFSET["tseq"]
FLAGS_SLICE = slice(OFFSET["flags"], OFFSET["flags"] + FIELD_BYTES["flags"])
ROUND_SLICE = slice(OFFSET["round"], OFFSET["round"] + FIELD_BYTES["round"])

#: the fields that differ between the DATA datagrams of one sender's pass; every other
#: header byte is the same in all of them
PASS_VARYING_FIELDS = ("flags", "index", "tseq")


def _pass_invariant_mask() -> np.ndarray:
    """The header as little-endian u64 words, with bits set where every DATA datagram of
    one pass carries the same bytes (a run of them is checked against its first)."""
    mask = np.full(HEADER_BYTES, 0xFF, dtype=np.uint8)
    for name in PASS_VARYING_FIELDS:
        start = OFFSET[name]
        mask[start : start + FIELD_BYTES[name]] = 0
    return mask.view("<u8")


PASS_INVARIANT_MASK = _pass_invariant_mask()
#: the index and tseq fields as u32 words of a header (for a run viewed as ``<u4``)
INDEX_WORD = OFFSET["index"] // 4
TSEQ_WORD = OFFSET["tseq"] // 4
assert HEADER_BYTES % 8 == 0 and OFFSET["index"] % 4 == 0 and OFFSET["tseq"] % 4 == 0

BITMAP_PREFIX = struct.Struct("<II")
TSEQ = struct.Struct("<I")
STOP_PAYLOAD = struct.Struct("<I")


class Kind(enum.IntEnum):
    DATA = 1
    PROBE = 2
    BITMAP = 3
    STOP = 4
    ACK = 5


# plain ints of the kinds, for the per-datagram comparisons in parse()
_DATA, _PROBE, _BITMAP, _STOP, _ACK = (
    int(Kind.DATA), int(Kind.PROBE), int(Kind.BITMAP), int(Kind.STOP), int(Kind.ACK))


class Flag(enum.IntFlag):
    NONE = 0
    CRITICAL = 1  # DATA: the chunk must be delivered whatever the bound
    PROBE_CARRIED = 2  # DATA: it is also the send's first PROBE (sequence 1, FINAL)
    FINAL = 4  # BITMAP: the last segment of one answer; PROBE: every chunk was sent once
    CREDIT = 8  # ACK: ``index`` is the receiver's credit (protocol/credit.py)


#: the PROBE a DATA datagram flagged PROBE_CARRIED stands for: always a send's first
CARRIED_PROBE_SEQ = 1


class CloseReason(enum.IntEnum):
    """Why a receive closed (carried in the STOP datagram's index field)."""

    COMPLETE = 1  # every chunk arrived
    BOUND_MET = 2  # the policy's bound was met with chunks still missing
    ACCEPT_DEADLINE = 3  # the policy's acceptance deadline passed
    DEADLINE = 4  # the hard deadline passed: closed with whatever had arrived
    CANCELLED = 5  # the application cancelled it


#: a STOP's reason by its value on the wire (a plain lookup: CloseReason(value) goes
#: through enum's Python code)
CLOSE_REASONS: dict[int, CloseReason] = {r.value: r for r in CloseReason}


class DropReason(enum.Enum):
    """Why an incoming datagram was counted and dropped."""

    SHORT = "short"  # shorter than the header
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    BAD_KIND = "bad_kind"
    BAD_LENGTH = "bad_length"  # plen disagrees with the datagram or with the geometry
    BAD_GEOMETRY = "bad_geometry"  # impossible count / mbytes / cbytes / index
    FOREIGN_SESSION = "foreign_session"
    UNKNOWN_MESSAGE = "unknown_message"  # nobody posted a send/receive for it
    GEOMETRY_MISMATCH = "geometry_mismatch"  # disagrees with the posted buffer
    STALE = "stale"  # for a message that has already closed
    DUPLICATE = "duplicate"  # a chunk that was already delivered
    INJECTED_LOSS = "injected_loss"  # dropped on purpose by a loss model
    BAD_AUTH = "bad_auth"  # its tag does not verify under the job's key (protocol.auth)


class MalformedDatagram(ValueError):
    def __init__(self, reason: DropReason, detail: str = ""):
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Header:
    kind: Kind
    session: int
    round_id: int
    message_id: int
    index: int
    count: int
    message_bytes: int
    chunk_bytes: int
    flags: Flag = Flag.NONE
    payload_len: int = 0
    tseq: int = 0


def chunk_count(message_bytes: int, chunk_bytes: int) -> int:
    """Chunks in a message; an empty message is one empty chunk."""
    return max(1, -(-message_bytes // chunk_bytes))


def chunk_len(index: int, count: int, message_bytes: int, chunk_bytes: int) -> int:
    return chunk_bytes if index < count - 1 else message_bytes - chunk_bytes * (count - 1)


def parse(data) -> tuple:
    """Validate one datagram and return its raw header fields.

    Returns ``(kind, flags, plen, session, round, message, index, count, mbytes,
    cbytes, tseq)``. Raises MalformedDatagram for anything a well-behaved peer cannot send.
    This is the per-packet path: plain integer checks, no allocation beyond the tuple.
    """
    n = len(data)
    if n < HEADER_BYTES:
        raise MalformedDatagram(DropReason.SHORT, f"{n} bytes")
    magic, version, kind, flags, plen, session, rnd, msg, idx, cnt, mbytes, cbytes, tseq = (
        HEADER.unpack_from(data)
    )
    if magic != MAGIC:
        raise MalformedDatagram(DropReason.BAD_MAGIC)
    if version != VERSION:
        raise MalformedDatagram(DropReason.BAD_VERSION, str(version))
    if plen != n - HEADER_BYTES:
        raise MalformedDatagram(DropReason.BAD_LENGTH, f"plen {plen} in {n} bytes")
    if (
        not 0 < cbytes <= MAX_CHUNK_BYTES
        or mbytes > MAX_MESSAGE_BYTES
        or cnt != (-(-mbytes // cbytes) or 1)
    ):
        raise MalformedDatagram(
            DropReason.BAD_GEOMETRY, f"count {cnt} mbytes {mbytes} cbytes {cbytes}")
    if kind == _DATA:
        if idx >= cnt:
            raise MalformedDatagram(DropReason.BAD_GEOMETRY, f"index {idx} of {cnt}")
        if plen != (cbytes if idx < cnt - 1 else mbytes - cbytes * (cnt - 1)):
            raise MalformedDatagram(DropReason.BAD_LENGTH, f"chunk {idx} with {plen} bytes")
    elif kind == _PROBE:
        if plen:
            raise MalformedDatagram(DropReason.BAD_LENGTH, "probe with payload")
    elif kind == _BITMAP:
        if idx >= cnt or idx & 7:
            raise MalformedDatagram(DropReason.BAD_GEOMETRY, f"bitmap from {idx} of {cnt}")
        if plen < 8 or plen - 8 > ((cnt - idx + 7) >> 3):
            raise MalformedDatagram(DropReason.BAD_LENGTH, f"bitmap of {plen} bytes")
    elif kind == _STOP or kind == _ACK:
        if plen != 4:
            raise MalformedDatagram(DropReason.BAD_LENGTH, "stop/ack payload")
    else:
        raise MalformedDatagram(DropReason.BAD_KIND, str(kind))
    return kind, flags, plen, session, rnd, msg, idx, cnt, mbytes, cbytes, tseq


def peek_round(data) -> int:
    """Round id of a datagram long enough to hold a header, else -1 (for loss models)."""
    if len(data) < HEADER_BYTES:
        return -1
    return int.from_bytes(data[ROUND_SLICE], "little")


#: the bytes every one of our datagrams starts with (a quick look: ``data[:2] ==``)
MAGIC_BYTES = MAGIC.to_bytes(2, "little")


SESSION_SLICE = slice(OFFSET["session"], OFFSET["session"] + FIELD_BYTES["session"])


def peek_session(data) -> int:
    """Session token of a datagram long enough to hold a header, else -1."""
    if len(data) < HEADER_BYTES:
        return -1
    return int.from_bytes(data[SESSION_SLICE], "little")


def encode(header: Header, payload=b"") -> bytes:
    """One whole datagram (control messages and tests; DATA uses build_data_headers)."""
    plen = len(payload)
    head = HEADER.pack(
        MAGIC,
        VERSION,
        int(header.kind),
        int(header.flags),
        plen,
        header.session,
        header.round_id,
        header.message_id,
        header.index,
        header.count,
        header.message_bytes,
        header.chunk_bytes,
        header.tseq,
    )
    return head + bytes(payload)


def control_datagram(message: Header, kind: Kind, index: int, payload=b"",
                     flags: Flag = Flag.NONE, tseq: int = 0) -> bytes:
    """A PROBE, BITMAP, STOP or ACK about the message ``message`` describes (its session,
    round, id and geometry), with this datagram's own kind, index, flags and tseq."""
    # (packed here rather than through a Header and encode: a fifth of the time, and
    # every message's STOP and PROBE is built here)
    return HEADER.pack(MAGIC, VERSION, kind, flags, len(payload), message.session,
                       message.round_id, message.message_id, index, message.count,
                       message.message_bytes, message.chunk_bytes, tseq) + bytes(payload)


def stop_datagram(message: Header, reason: CloseReason, delivered: int) -> bytes:
    """STOP: the receive closed for ``reason`` with ``delivered`` chunks."""
    return control_datagram(message, Kind.STOP, int(reason), STOP_PAYLOAD.pack(delivered))


def as_bytes_view(array) -> memoryview:
    """A flat byte view of a C-contiguous buffer (numpy array, bytes, bytearray...)."""
    if (type(array) is memoryview and array.format == "B" and array.ndim == 1
            and array.c_contiguous):
        return array  # (already one: a collective hands each send a slice of one view)
    if type(array) is np.ndarray and array.flags.c_contiguous:
        # (one view, where a numpy reshape and view kept two arrays alive under it: a
        # send and a receive each hold one, for as long as they are open)
        try:
            return array.data.cast("B")
        except (TypeError, ValueError):  # (a dtype with no buffer format: datetime64...)
            pass
    if isinstance(array, bytes):  # np.asarray(b"") is one NUL byte of dtype S1
        array = np.frombuffer(array, dtype=np.uint8)
    arr = np.asarray(array)
    if not arr.flags.c_contiguous:
        raise ValueError("message buffers must be C-contiguous")
    return arr.reshape(-1).view(np.uint8).data


def decode(data) -> tuple[Header, memoryview]:
    """Validated Header and payload view (tests, tools; the hot path uses parse)."""
    kind, flags, plen, session, rnd, msg, idx, cnt, mbytes, cbytes, tseq = parse(data)
    header = Header(
        Kind(kind), session, rnd, msg, idx, cnt, mbytes, cbytes, Flag(flags), plen, tseq
    )
    return header, memoryview(data)[HEADER_BYTES:]


def build_data_headers(
    *,
    session: int,
    round_id: int,
    message_id: int,
    message_bytes: int,
    chunk_bytes: int,
    critical: np.ndarray | None = None,
) -> np.ndarray:
    """Every DATA header of one message, built at once: a (count, 48) uint8 array.

    The sender writes each datagram's ``tseq`` (offset TSEQ_OFFSET) just before it goes.
    """
    # (a copy of the geometry's headers with the round and message written in: a
    # message per peer and round is posted, and these differ between them in two words)
    cached = chunk_count(message_bytes, chunk_bytes) * HEADER_BYTES <= _CACHED_HEADER_BYTES
    make = _data_header_words if cached else _data_header_words.__wrapped__
    words = make(session, message_bytes, chunk_bytes).copy()
    words[:, _ROUND_WORD] = round_id
    words[:, _MESSAGE_WORD] = message_id
    if critical is not None:
        h = words.reshape(-1).view(HEADER_DTYPE)
        h["flags"][np.asarray(critical, dtype=bool)] = Flag.CRITICAL
    return words.view(np.uint8)  # (count, 12) words as (count, 48) bytes


_ROUND_WORD, _MESSAGE_WORD = OFFSET["round"] // 4, OFFSET["message"] // 4
#: the most header bytes kept for the next message alike (a 48 MB message's at 1,400-byte
#: chunks; 16 geometries kept at most, 26 MB)
_CACHED_HEADER_BYTES = 1600 << 10


@functools.lru_cache(maxsize=16)
def _data_header_words(session: int, message_bytes: int, chunk_bytes: int) -> np.ndarray:
    """A message's DATA headers for round 0, message 0, as (count, 12) little-endian
    32-bit words (read-only: build_data_headers copies it)."""
    count = chunk_count(message_bytes, chunk_bytes)
    h = np.zeros(count, dtype=HEADER_DTYPE)
    h["magic"] = MAGIC
    h["version"] = VERSION
    h["kind"] = Kind.DATA
    h["plen"] = chunk_bytes
    h["plen"][-1] = chunk_len(count - 1, count, message_bytes, chunk_bytes)
    h["session"] = session
    h["index"] = np.arange(count, dtype=np.uint32)
    h["count"] = count
    h["mbytes"] = message_bytes
    h["cbytes"] = chunk_bytes
    words = h.view("<u4").reshape(count, HEADER_BYTES // 4)
    words.flags.writeable = False
    return words


def check_chunk_bytes(chunk_bytes: int) -> int:
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be 1..{MAX_CHUNK_BYTES} bytes, got {chunk_bytes}")
    return chunk_bytes
