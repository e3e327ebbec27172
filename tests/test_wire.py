"""wire.py: header codec, DATA header builder, and validation of every malformed case."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundedloss import wire
from boundedloss.wire import (
    HEADER,
    HEADER_BYTES,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    MAX_MESSAGE_BYTES,
    DropReason,
    Flag,
    Header,
    Kind,
    MalformedDatagram,
)
from conftest import PROPERTY

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1

# Field offsets and struct formats, from the numpy twin of the header (so these tests
# follow the layout wherever wire.py puts a field).
OFF = {
    name: (
        wire.HEADER_DTYPE.fields[name][1],
        "<" + {1: "B", 2: "H", 4: "I", 8: "Q"}[wire.HEADER_DTYPE.fields[name][0].itemsize],
    )
    for name in wire.HEADER_DTYPE.names
}
HAS_TSEQ = "tseq" in {f.name for f in dataclasses.fields(Header)}
ACK = getattr(Kind, "ACK", None)
UNKNOWN_KIND = max(Kind) + 1


def patch(data: bytes, **fields) -> bytes:
    """The datagram with some header fields overwritten (no other change)."""
    buf = bytearray(data)
    for name, value in fields.items():
        off, fmt = OFF[name]
        struct.pack_into(fmt, buf, off, value)
    return bytes(buf)


def reason_of(data) -> DropReason | None:
    try:
        wire.parse(data)
    except MalformedDatagram as e:
        return e.reason
    return None


# ------------------------------------------------------------------ strategies


@st.composite
def geometries(draw, max_bytes: int = MAX_MESSAGE_BYTES):
    """(message_bytes, chunk_bytes, count) that a well-behaved peer can send."""
    cbytes = draw(st.one_of(st.integers(1, 64), st.integers(1, MAX_CHUNK_BYTES)))
    top = min(max_bytes, cbytes * MAX_CHUNKS)
    mbytes = draw(
        st.one_of(
            st.integers(0, min(top, 4 * cbytes + 3)),
            st.integers(0, top),
            st.just(top),
        )
    )
    return mbytes, cbytes, wire.chunk_count(mbytes, cbytes)


KNOWN_KINDS = {Kind.DATA, Kind.PROBE, Kind.BITMAP, Kind.STOP} | ({ACK} if ACK else set())


@st.composite
def valid_datagrams(draw, max_bytes: int = 1 << 20):
    """A well-formed (Header, payload) pair of any kind."""
    mbytes, cbytes, count = draw(geometries(max_bytes))
    kind = draw(st.sampled_from([k for k in Kind if k in KNOWN_KINDS]))
    flags = Flag.NONE
    if kind == Kind.DATA:
        index = draw(st.integers(0, count - 1))
        plen = wire.chunk_len(index, count, mbytes, cbytes)
        payload = np.random.default_rng(index).integers(0, 256, plen, dtype=np.uint8).tobytes()
        flags = draw(st.sampled_from([Flag.NONE, Flag.CRITICAL]))
    elif kind == Kind.PROBE:
        index = draw(st.integers(0, U32))
        payload = b""
    elif kind == Kind.BITMAP:
        index = draw(st.integers(0, (count - 1) // 8)) * 8
        nbits = draw(st.integers(0, (count - index + 7) // 8))
        payload = struct.pack("<II", draw(st.integers(0, U32)), draw(st.integers(0, count))) + draw(
            st.binary(min_size=nbits, max_size=nbits)
        )
        flags = draw(st.sampled_from([Flag.NONE, Flag.FINAL]))
    else:  # STOP / ACK: a u32 payload
        index = draw(st.integers(0, U32))
        payload = struct.pack("<I", draw(st.integers(0, count)))
    extra = {"tseq": draw(st.integers(0, U32))} if HAS_TSEQ else {}
    header = Header(
        kind=kind,
        session=draw(st.integers(0, U64)),
        round_id=draw(st.integers(0, U32)),
        message_id=draw(st.integers(0, U32)),
        index=index,
        count=count,
        message_bytes=mbytes,
        chunk_bytes=cbytes,
        flags=flags,
        payload_len=len(payload),
        **extra,
    )
    return header, payload


# ----------------------------------------------------------------- round trip


def test_header_layout_little_endian() -> None:
    h = Header(Kind.STOP, 0x0102030405060708, 9, 10, 3, 1, 0, 1400, Flag.NONE)
    data = wire.encode(h, b"\x05\x00\x00\x00")
    assert len(data) == HEADER_BYTES + 4 and HEADER_BYTES == wire.HEADER.size
    assert wire.HEADER_DTYPE.itemsize == HEADER_BYTES
    assert data[:2] == b"\x42\x4c"  # magic 0x4C42, little-endian
    assert data[2] == wire.VERSION and data[3] == Kind.STOP
    off = OFF["session"][0]
    assert data[off : off + 8] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    off = OFF["plen"][0]
    assert int.from_bytes(data[off : off + 2], "little") == 4
    assert data[HEADER_BYTES:] == b"\x05\x00\x00\x00"


@settings(PROPERTY, max_examples=300)
@given(valid_datagrams())
def test_encode_decode_round_trip(dg) -> None:
    header, payload = dg
    data = wire.encode(header, payload)
    assert len(data) == HEADER_BYTES + len(payload)
    got, view = wire.decode(data)
    assert got == header
    assert bytes(view) == payload
    # parse agrees with decode and accepts every buffer type an adapter may hand it
    fields = wire.parse(data)
    for buf in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert wire.parse(buf) == fields
    assert list(fields[:10]) == [
        header.kind, header.flags, header.payload_len, header.session, header.round_id,
        header.message_id, header.index, header.count, header.message_bytes,
        header.chunk_bytes,
    ]
    assert wire.peek_round(data) == header.round_id


@settings(PROPERTY, max_examples=150)
@given(
    geom=geometries(max_bytes=20_000).filter(lambda g: g[2] <= 600),
    session=st.integers(0, U64),
    round_id=st.integers(0, U32),
    message_id=st.integers(0, U32),
    seed=st.integers(0, 2**32 - 1),
    with_critical=st.booleans(),
)
def test_build_data_headers_agrees_with_encode(geom, session, round_id, message_id, seed,
                                                with_critical) -> None:
    mbytes, cbytes, count = geom
    rng = np.random.default_rng(seed)
    critical = rng.random(count) < 0.3 if with_critical else None
    headers = wire.build_data_headers(
        session=session, round_id=round_id, message_id=message_id,
        message_bytes=mbytes, chunk_bytes=cbytes, critical=critical,
    )
    assert headers.shape == (count, HEADER_BYTES) and headers.dtype == np.uint8
    total = 0
    for i in range(count):
        plen = wire.chunk_len(i, count, mbytes, cbytes)
        total += plen
        flags = Flag.CRITICAL if critical is not None and critical[i] else Flag.NONE
        expect = wire.encode(
            Header(Kind.DATA, session, round_id, message_id, i, count, mbytes, cbytes, flags),
            bytes(plen),
        )
        assert headers[i].tobytes() == expect[:HEADER_BYTES], f"chunk {i}"
        # and the built header plus its chunk is a datagram that validates
        got, _ = wire.decode(headers[i].tobytes() + bytes(plen))
        assert (got.index, got.payload_len, got.flags) == (i, plen, flags)
    assert total == mbytes


@pytest.mark.parametrize(
    "mbytes,cbytes,count,last",
    [(0, 1400, 1, 0), (1, 1400, 1, 1), (1400, 1400, 1, 1400), (1401, 1400, 2, 1),
     (2800, 1400, 2, 1400), (17, 8, 3, 1), (16, 8, 2, 8), (5, 1, 5, 1)],
)
def test_chunk_count_and_len(mbytes, cbytes, count, last) -> None:
    assert wire.chunk_count(mbytes, cbytes) == count
    assert wire.chunk_len(count - 1, count, mbytes, cbytes) == last
    assert all(wire.chunk_len(i, count, mbytes, cbytes) == cbytes for i in range(count - 1))


def test_extreme_field_values_round_trip() -> None:
    cb = MAX_CHUNK_BYTES
    mbytes = MAX_MESSAGE_BYTES
    count = wire.chunk_count(mbytes, cb)
    h = Header(Kind.PROBE, U64, U32, U32, U32, count, mbytes, cb, Flag(0xFFFF))
    got, _ = wire.decode(wire.encode(h))
    assert got == h
    # the largest chunk count: 1-byte chunks of a MAX_CHUNKS-byte message
    h = Header(Kind.STOP, 1, 0, 0, 0, MAX_CHUNKS, MAX_CHUNKS, 1, payload_len=4)
    assert wire.decode(wire.encode(h, b"\0\0\0\0"))[0] == h


def test_check_chunk_bytes() -> None:
    assert wire.check_chunk_bytes(1) == 1
    assert wire.check_chunk_bytes(MAX_CHUNK_BYTES) == MAX_CHUNK_BYTES
    for bad in (0, -1, MAX_CHUNK_BYTES + 1):
        with pytest.raises(ValueError):
            wire.check_chunk_bytes(bad)


def test_peek_round_short_datagram() -> None:
    assert wire.peek_round(b"") == -1
    assert wire.peek_round(bytes(HEADER_BYTES - 1)) == -1
    assert wire.peek_round(patch(bytes(HEADER_BYTES), round=7)) == 7
    assert wire.peek_round(patch(GOOD["probe"], round=0xDEADBEEF)) == 0xDEADBEEF


# ------------------------------------------------------------- rejection cases

CB = 100
MB = 1050  # 11 chunks, the last one 50 bytes
COUNT = 11


def make(kind: Kind, index: int = 0, payload: bytes | None = None, **kw) -> bytes:
    if payload is None:
        payload = {
            Kind.DATA: bytes(wire.chunk_len(index, COUNT, MB, CB)),
            Kind.PROBE: b"",
            Kind.BITMAP: struct.pack("<II", 1, 0) + b"\0\0",
            Kind.STOP: struct.pack("<I", 3),
        }[kind]
    return wire.encode(Header(kind, 42, 1, 2, index, COUNT, MB, CB), payload)


GOOD = {
    "data_first": make(Kind.DATA, 0),
    "data_last": make(Kind.DATA, COUNT - 1),
    "probe": make(Kind.PROBE, 5),
    "bitmap_from_0": make(Kind.BITMAP, 0),
    "bitmap_from_8": make(Kind.BITMAP, 8, struct.pack("<II", 1, 0) + b"\0"),
    "bitmap_empty": make(Kind.BITMAP, 8, struct.pack("<II", 1, 0)),
    "stop": make(Kind.STOP, 1),
}
if ACK is not None:
    GOOD["ack"] = make(ACK, 0, struct.pack("<I", 3))


@pytest.mark.parametrize("name", sorted(GOOD))
def test_parse_accepts_good_datagrams(name: str) -> None:
    assert reason_of(GOOD[name]) is None


BAD = [
    # (label, datagram, reason)
    ("empty", b"", DropReason.SHORT),
    ("one_byte", b"\x42", DropReason.SHORT),
    ("header_minus_one", GOOD["probe"][:-1], DropReason.SHORT),
    ("magic", patch(GOOD["probe"], magic=0x424C), DropReason.BAD_MAGIC),
    ("magic_zero", bytes(HEADER_BYTES), DropReason.BAD_MAGIC),
    ("version_0", patch(GOOD["probe"], version=0), DropReason.BAD_VERSION),
    ("version_1", patch(GOOD["probe"], version=1), DropReason.BAD_VERSION),  # (no carried PROBE)
    ("version_3", patch(GOOD["data_first"], version=3), DropReason.BAD_VERSION),
    ("version_255", patch(GOOD["stop"], version=255), DropReason.BAD_VERSION),
    ("plen_too_big", patch(GOOD["data_first"], plen=CB + 1), DropReason.BAD_LENGTH),
    ("plen_too_small", patch(GOOD["data_first"], plen=CB - 1), DropReason.BAD_LENGTH),
    ("truncated_payload", GOOD["data_first"][:-1], DropReason.BAD_LENGTH),
    ("trailing_byte", GOOD["data_first"] + b"\0", DropReason.BAD_LENGTH),
    ("cbytes_zero", patch(GOOD["probe"], cbytes=0), DropReason.BAD_GEOMETRY),
    ("cbytes_too_big", patch(GOOD["probe"], cbytes=MAX_CHUNK_BYTES + 1, count=1),
     DropReason.BAD_GEOMETRY),
    ("mbytes_too_big", patch(GOOD["probe"], mbytes=MAX_MESSAGE_BYTES + 1, cbytes=MAX_CHUNK_BYTES,
                             count=-(-(MAX_MESSAGE_BYTES + 1) // MAX_CHUNK_BYTES)),
     DropReason.BAD_GEOMETRY),
    ("mbytes_huge", patch(GOOD["probe"], mbytes=U64), DropReason.BAD_GEOMETRY),
    ("count_plus_one", patch(GOOD["probe"], count=COUNT + 1), DropReason.BAD_GEOMETRY),
    ("count_minus_one", patch(GOOD["probe"], count=COUNT - 1), DropReason.BAD_GEOMETRY),
    ("count_zero", patch(GOOD["probe"], count=0), DropReason.BAD_GEOMETRY),
    ("count_max", patch(GOOD["data_first"], count=U32), DropReason.BAD_GEOMETRY),
    ("empty_message_zero_count",
     patch(wire.encode(Header(Kind.PROBE, 42, 1, 2, 0, 1, 0, CB)), count=0),
     DropReason.BAD_GEOMETRY),
    ("data_index_eq_count", patch(GOOD["data_last"], index=COUNT), DropReason.BAD_GEOMETRY),
    ("data_index_beyond", patch(GOOD["data_first"], index=COUNT + 5), DropReason.BAD_GEOMETRY),
    ("data_index_max", patch(GOOD["data_first"], index=U32), DropReason.BAD_GEOMETRY),
    # a full chunk claiming to be the (short) last one, and the short one claiming
    # to be a middle one: plen disagrees with the index
    ("data_full_chunk_as_last", patch(GOOD["data_first"], index=COUNT - 1), DropReason.BAD_LENGTH),
    ("data_short_chunk_as_middle", patch(GOOD["data_last"], index=3), DropReason.BAD_LENGTH),
    ("data_geometry_grown", patch(GOOD["data_last"], mbytes=MB + 10), DropReason.BAD_LENGTH),
    ("probe_with_payload", make(Kind.PROBE, 0, b"x"), DropReason.BAD_LENGTH),
    ("bitmap_index_not_multiple_of_8", patch(GOOD["bitmap_from_8"], index=4),
     DropReason.BAD_GEOMETRY),
    ("bitmap_index_odd", patch(GOOD["bitmap_from_0"], index=1), DropReason.BAD_GEOMETRY),
    ("bitmap_index_beyond_count", make(Kind.BITMAP, 16, struct.pack("<II", 1, 0)),
     DropReason.BAD_GEOMETRY),
    ("bitmap_no_prefix", make(Kind.BITMAP, 0, b"\0" * 7), DropReason.BAD_LENGTH),
    ("bitmap_too_long_from_0", make(Kind.BITMAP, 0, struct.pack("<II", 1, 0) + b"\0" * 3),
     DropReason.BAD_LENGTH),
    ("bitmap_too_long_from_8", make(Kind.BITMAP, 8, struct.pack("<II", 1, 0) + b"\0\0"),
     DropReason.BAD_LENGTH),
    ("stop_empty", make(Kind.STOP, 1, b""), DropReason.BAD_LENGTH),
    ("stop_long", make(Kind.STOP, 1, b"\0" * 5), DropReason.BAD_LENGTH),
    *(
        [("ack_empty", make(ACK, 0, b""), DropReason.BAD_LENGTH),
         ("ack_long", make(ACK, 0, b"\0" * 5), DropReason.BAD_LENGTH)]
        if ACK is not None else []
    ),
    ("kind_0", patch(GOOD["probe"], kind=0), DropReason.BAD_KIND),
    ("kind_next_unused", patch(GOOD["probe"], kind=UNKNOWN_KIND), DropReason.BAD_KIND),
    ("kind_255", patch(GOOD["stop"], kind=255), DropReason.BAD_KIND),
]


@pytest.mark.parametrize("label,data,reason", BAD, ids=[b[0] for b in BAD])
def test_parse_rejects_with_reason(label: str, data: bytes, reason: DropReason) -> None:
    with pytest.raises(MalformedDatagram) as info:
        wire.parse(data)
    assert info.value.reason is reason
    assert isinstance(info.value, ValueError)
    with pytest.raises(MalformedDatagram):
        wire.decode(data)


def test_every_validation_reason_is_covered() -> None:
    """The table above exercises every reason parse itself can give."""
    parse_reasons = {DropReason.SHORT, DropReason.BAD_MAGIC, DropReason.BAD_VERSION,
                     DropReason.BAD_KIND, DropReason.BAD_LENGTH, DropReason.BAD_GEOMETRY}
    assert {r for _, _, r in BAD} == parse_reasons


@settings(PROPERTY, max_examples=400)
@given(st.binary(max_size=200))
def test_parse_never_raises_anything_but_malformed(data: bytes) -> None:
    try:
        wire.parse(data)
    except MalformedDatagram:
        pass


@settings(PROPERTY, max_examples=400)
@given(
    dg=valid_datagrams(max_bytes=4000),
    field=st.sampled_from(sorted(OFF)),
    value=st.integers(0, U64),
)
def test_parse_of_mutated_header_is_valid_or_rejected(dg, field, value) -> None:
    """Overwrite one header field with anything: parse either rejects it or returns
    fields that satisfy every invariant the receiver relies on for bounds."""
    header, payload = dg
    off, fmt = OFF[field]
    value &= (1 << (8 * struct.calcsize(fmt))) - 1
    data = patch(wire.encode(header, payload), **{field: value})
    try:
        h, _ = wire.decode(data)
    except MalformedDatagram:
        return
    kind, plen, idx, cnt, mbytes, cbytes = (
        h.kind, h.payload_len, h.index, h.count, h.message_bytes, h.chunk_bytes
    )
    assert plen == len(data) - HEADER_BYTES
    assert 0 < cbytes <= MAX_CHUNK_BYTES and mbytes <= MAX_MESSAGE_BYTES
    assert cnt == wire.chunk_count(mbytes, cbytes)
    if kind == Kind.DATA:
        assert idx < cnt
        assert idx * cbytes + plen <= mbytes  # never past the message's end
        assert plen == wire.chunk_len(idx, cnt, mbytes, cbytes)
    elif kind == Kind.BITMAP:
        assert idx % 8 == 0 and idx < cnt and 8 <= plen <= 8 + (cnt - idx + 7) // 8
    elif kind == Kind.PROBE:
        assert plen == 0
    else:
        assert kind in (Kind.STOP, ACK) and plen == 4


def test_header_struct_matches_numpy_dtype() -> None:
    names = wire.HEADER_DTYPE.names
    values = (wire.MAGIC, wire.VERSION) + tuple(range(1, len(names) - 1))
    packed = HEADER.pack(*values)
    arr = np.frombuffer(packed, dtype=wire.HEADER_DTYPE)
    assert tuple(int(arr[0][name]) for name in names) == values


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32),
    np.arange(12, dtype=np.float64).reshape(3, 4),
    np.zeros(0, dtype=np.float32),
    np.arange(6, dtype=np.uint16).view(np.dtype(np.uint16, metadata={"bfloat16": True})),
    np.arange(5).astype("datetime64[s]"),  # (no buffer format: numpy's own view)
    np.frombuffer(b"abc", dtype=np.uint8),  # (read-only)
    b"abcd", bytearray(b"abcd"),
])
def test_a_buffer_s_byte_view_is_its_bytes_flat_and_as_writable_as_it(array):
    view = wire.as_bytes_view(array)
    assert view.format == "B" and view.ndim == 1
    assert view.tobytes() == (bytes(array) if isinstance(array, (bytes, bytearray))
                              else array.tobytes())
    assert view.readonly == (isinstance(array, bytes)
                             or (isinstance(array, np.ndarray) and not array.flags.writeable))


def test_a_flat_byte_view_is_its_own_and_other_views_are_flattened():
    whole = wire.as_bytes_view(np.arange(8, dtype=np.float32))
    piece = whole[4:12]
    assert wire.as_bytes_view(piece) is piece  # (a collective's slice: no new object)
    with pytest.raises(ValueError, match="C-contiguous"):
        wire.as_bytes_view(whole[::2])
    floats = memoryview(np.arange(6, dtype=np.float32)).cast("B").cast("f")
    flat = wire.as_bytes_view(floats)
    assert flat.format == "B" and flat.tobytes() == np.arange(6, dtype=np.float32).tobytes()


def test_a_byte_view_of_a_strided_array_is_refused():
    with pytest.raises(ValueError, match="C-contiguous"):
        wire.as_bytes_view(np.arange(10, dtype=np.float32)[::2])
