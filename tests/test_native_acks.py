"""The compiled path's ACKs against the Python reference.

Two sending cores, one with the compiled data path attached (which then takes the ACKs
that call for no decision), are fed the same answers - ACKs of every tseq and delivered
count (plausible, huge, wrapped), duplicated, mutated, another message's, another
geometry's, another job's, forged; BITMAPs that answer a PROBE; STOPs - with the same
polls and the same clock. They must send the same datagrams, count the same, end with
the same result, and hold the same ACK state, recovery and window at every step. The
PROBE-copy decision an ACK may call for (``AckState.check_loss``) is driven across its
boundary: a pass that loses nothing, a little, or most of its datagrams.

Skipped, with the reason, where the extension is not built.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundedloss import wire
from boundedloss.net import native
from boundedloss.protocol import TransferMux, TransportConfig
from boundedloss.protocol.acks import ACK_FIELDS
from boundedloss.protocol.auth import TRAILER_BYTES, DatagramAuth, job_key
from boundedloss.protocol.types import DataRun
from boundedloss.wire import BITMAP_PREFIX, HEADER_BYTES, STOP_PAYLOAD, Flag, Kind
from conftest import PROPERTY, SESSION, source_bytes

# (the reference's tags through ctypes, not the compiled module: conftest.ctypes_gmac)
pytestmark = [pytest.mark.skipif(native.status().startswith("python ("),
                                 reason=f"compiled data path: {native.status()}"),
              pytest.mark.usefixtures("ctypes_gmac")]

PEER = ("10.1.2.3", 4000)  # the receiver
LOCAL = ("10.1.2.4", 5000)  # the sender, whose cores are under test
KEY = job_key(b"test secret", SESSION)


def _twin(nbytes: int, chunk_bytes: int, window: int, auth: bool, credit: int | None = None):
    datagram = chunk_bytes + 48
    cfg = TransportConfig(chunk_bytes=chunk_bytes, window_bytes=window * datagram,
                          credit_bytes=None if credit is None else credit * datagram)
    payload = source_bytes(nbytes, 5)
    side = []
    for use_native in (False, True):
        mux = TransferMux(SESSION, cfg, auth=DatagramAuth(KEY, LOCAL) if auth else None)
        if use_native:
            native.NativeDataPath(mux)
        tx = mux.start_send(PEER, 3, 7, payload, 0.0)
        side.append((mux, tx))
    return side


def _state(mux: TransferMux, tx) -> tuple:
    """Everything the ACKs may move, and what follows from it."""
    # (not in_python, check_loss and loss_limit: only a shared state keeps them)
    acks = tuple(getattr(tx.acks, name) for name in ACK_FIELDS
                 if name not in ("in_python", "check_loss", "loss_limit"))
    rec = tx.recovery
    return (acks, tx.state, tx.has_data(), tx.next_deadline(), rec.more_copies_due,
            rec.unanswered, rec.rto, rec.srtt, rec.reverse_loss(), tx.counts,
            mux.counters(), tx.result)


def _sent(mux: TransferMux, now: float, limit: int, auth: bool) -> list[bytes]:
    """What a poll hands out, DATA runs as their datagrams (the bodies, when sealed: the
    two cores seal under nonces of their own)."""
    out = []
    opener = DatagramAuth(KEY, PEER)
    for item in mux.poll(now, limit, runs=True):
        datagrams = item.datagrams() if isinstance(item, DataRun) else [item]
        for parts, _ in datagrams:
            d = b"".join(bytes(p) for p in parts)
            if auth and len(d) >= HEADER_BYTES and d[wire.OFFSET["kind"]] != Kind.DATA:
                body = opener.open(d, LOCAL)
                assert body is not None
                d = bytes(body)
            out.append(d)
    return out


def _answer(tx, op: str, a: int, b: int, rng: np.random.Generator) -> bytes:
    """One answer from the receiver (or from elsewhere) to the send ``tx``."""
    m = tx.message
    count, next_tseq = m.count, tx.acks.next_tseq
    if op == "ack":  # plausible: a tseq sent, a delivered count up to it
        tseq = a % (next_tseq + 2)
        delivered = b % (min(tseq, count) + 2)
        return wire.control_datagram(m, Kind.ACK, 0, STOP_PAYLOAD.pack(delivered), tseq=tseq)
    if op == "grant":  # an ACK with the receiver's credit, none (parked) to plenty
        tseq = a % (next_tseq + 2)
        return wire.control_datagram(m, Kind.ACK, b % 9 if b % 4 else 0,
                                     STOP_PAYLOAD.pack(b % (min(tseq, count) + 2)),
                                     Flag.CREDIT, tseq)
    if op == "ack_raw":  # any 32-bit words at all
        return wire.control_datagram(m, Kind.ACK, (a * 2654435761) & 0xFFFFFFFF,
                                     STOP_PAYLOAD.pack(b & 0xFFFFFFFF),
                                     Flag((b >> 28) & 0xF), a & 0xFFFFFFFF)
    if op == "ack_other":  # another message's, or another geometry's
        h = wire.Header(Kind.ACK, m.session, m.round_id, m.message_id ^ (1 + a % 3), 0,
                        m.count, m.message_bytes, m.chunk_bytes)
        if b % 2:
            h = wire.Header(Kind.ACK, m.session, m.round_id, m.message_id, 0,
                            wire.chunk_count(m.message_bytes + m.chunk_bytes, m.chunk_bytes),
                            m.message_bytes + m.chunk_bytes, m.chunk_bytes)
        return wire.control_datagram(h, Kind.ACK, 0, STOP_PAYLOAD.pack(b % (count + 1)),
                                     tseq=a % (next_tseq + 1))
    if op == "ack_foreign":  # another job's
        d = bytearray(wire.control_datagram(m, Kind.ACK, 0, STOP_PAYLOAD.pack(1), tseq=a % 50))
        d[wire.OFFSET["session"]] ^= 1
        return bytes(d)
    if op == "ack_mutated":
        d = bytearray(wire.control_datagram(m, Kind.ACK, 0, STOP_PAYLOAD.pack(b % (count + 1)),
                                            tseq=a % (next_tseq + 1)))
        i = int(rng.integers(len(d)))
        d[i] ^= 1 << int(rng.integers(8))
        return bytes(d[: len(d) - (a % 3 == 0)])  # (sometimes a byte short as well)
    if op == "bitmap":  # the whole answer to the latest PROBE (its seq: the PROBEs sent)
        missing = rng.random(count) < (a % 5) / 8
        bits = np.packbits(~missing, bitorder="little").tobytes()
        prefix = BITMAP_PREFIX.pack(tx.counts.probes, int((~missing).sum()))
        return wire.control_datagram(m, Kind.BITMAP, 0, prefix + bits, Flag.FINAL)
    assert op == "stop"
    return wire.stop_datagram(m, wire.CloseReason(1 + a % 3), b % (count + 1))


OPS = ["ack", "ack", "ack", "grant", "grant", "ack_raw", "ack_other", "ack_foreign",
       "ack_mutated", "bitmap", "stop", "dup", "poll", "poll", "time"]


@settings(PROPERTY, max_examples=300)
@given(
    nbytes=st.integers(1, 6000),
    chunk_bytes=st.sampled_from([7, 64, 250]),
    window=st.integers(1, 200),
    auth=st.booleans() if native.authenticates() else st.just(False),
    seed=st.integers(0, 2**16),
    ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2**33), st.integers(0, 2**33)),
                 max_size=60),
    credit=st.sampled_from([None, 2, 6]),
)
def test_native_acks_match_python_step_for_step(nbytes, chunk_bytes, window, auth, seed,
                                                ops, credit) -> None:
    side = _twin(nbytes, chunk_bytes, window, auth, credit)
    (m0, t0), (m1, t1) = side
    seal = DatagramAuth(KEY, PEER)
    now = 0.0
    last: bytes | None = None
    assert _sent(m0, now, 1 << 20, auth) == _sent(m1, now, 1 << 20, auth)  # (first pass)
    for op, a, b in ops:
        if op in ("poll", "time"):
            if op == "time":
                now += [0.0005, 0.05, 0.3, 11.0][a % 4]
                for mux in (m0, m1):
                    deadline = mux.next_deadline()
                    if deadline is not None and deadline <= now:
                        mux.timer_fired(now)
            assert _sent(m0, now, 1 + a % 400, auth) == _sent(m1, now, 1 + a % 400, auth)
        else:
            if op == "dup":
                if last is None:
                    continue
                d = last
            else:
                rng = np.random.default_rng(seed + a)
                d = _answer(t0, op, a, b, rng)
                if auth:
                    d = b"".join(seal.seal((d,), LOCAL))
                    if op == "ack_mutated" and b % 2:  # (a forger's: no tag)
                        d = d[:-TRAILER_BYTES]
                last = d
            now += 1e-4
            m0.datagram_received(d, PEER, now)
            m1.data_path.take(d, PEER, now)  # type: ignore[union-attr]
        assert _state(m0, t0) == _state(m1, t1)
    now += 0.001
    assert _sent(m0, now, 1 << 20, auth) == _sent(m1, now, 1 << 20, auth)
    assert _state(m0, t0) == _state(m1, t1)


def test_the_compiled_path_takes_the_acks_of_a_lossless_pass() -> None:
    """What it is for: the ACKs of a pass that lost nothing never reach the Python core,
    before the PROBE or after it - and one that calls for more PROBE copies does."""
    (m0, t0), (m1, t1) = _twin(64 * 100, 64, 1000, auth=False)
    handed: list[int] = []
    real = m1.datagram_received
    m1.datagram_received = lambda d, p, n: (handed.append(d[3]), real(d, p, n))  # type: ignore
    every = t1.acks.ack_every
    _sent(m1, 0.0, 1 << 20, False)  # the whole pass, and its PROBE
    for k in range(1, 5):
        m1.data_path.take(wire.control_datagram(  # type: ignore[union-attr]
            t1.message, Kind.ACK, 0, STOP_PAYLOAD.pack(k * every - 1), tseq=k * every - 1),
            PEER, 0.001 * k)
    assert handed == [] and t1.acks.acks_heard == 4 and t1.acks.last_heard == 0.004
    # half the pass lost: that needs recovery's decision (more copies of the PROBE)
    m1.data_path.take(wire.control_datagram(  # type: ignore[union-attr]
        t1.message, Kind.ACK, 0, STOP_PAYLOAD.pack(3 * every), tseq=6 * every),
        PEER, 0.005)
    assert handed == [Kind.ACK] and t1.recovery.more_copies_due


def test_the_compiled_path_takes_a_stop_and_the_core_ends_the_send() -> None:
    """A STOP for an open send is parsed and routed by the compiled path, which hands the
    core only what it says (reason, delivered count): the send ends as on the Python
    path, counted the same; one of another geometry still goes to the core whole."""
    (m0, t0), (m1, t1) = _twin(64 * 100, 64, 1000, auth=False)
    handed: list[int] = []
    real = m1.datagram_received
    m1.datagram_received = lambda d, p, n: (handed.append(d[3]), real(d, p, n))  # type: ignore
    for mux in (m0, m1):
        _sent(mux, 0.0, 1 << 20, False)
    m = t0.message
    other = wire.Header(Kind.STOP, m.session, m.round_id, m.message_id, 0, m.count + 1,
                        m.message_bytes + 64, m.chunk_bytes)
    for d in (wire.stop_datagram(other, wire.CloseReason.COMPLETE, 3),
              wire.stop_datagram(m, wire.CloseReason.BOUND_MET, 97)):
        m0.datagram_received(d, PEER, 0.01)
        m1.data_path.take(d, PEER, 0.01)  # type: ignore[union-attr]
    assert handed == [Kind.STOP]  # (the other geometry's: the core counts it)
    assert t1.result is not None and t1.result == t0.result
    assert t1.result.close_reason == wire.CloseReason.BOUND_MET and t1.result.stats.delivered == 97
    assert m0.counters() == m1.counters() and m1.counters()["geometry_mismatch"] == 1
    assert m1.pop_finished() == [t1.result]


def test_answers_for_finished_sends_are_stale_on_both_paths() -> None:
    """An ACK, STOP or BITMAP for a send that finished is counted stale - by the compiled
    path for the sends it still keeps (the latest 1,024 to close), by the core for those
    before them - exactly as the Python core counts every one."""
    cfg = TransportConfig(chunk_bytes=64)
    side = []
    for use_native in (False, True):
        mux = TransferMux(SESSION, cfg)
        if use_native:
            native.NativeDataPath(mux)
        sends = [mux.start_send(PEER, 1, msg, source_bytes(640, msg), 0.0)
                 for msg in range(1100)]
        for tx in sends:
            mux.cancel_send(tx, 0.0)
        side.append((mux, sends))
    (m0, s0), (m1, _) = side
    handed: list[int] = []
    real = m1.datagram_received
    m1.datagram_received = lambda d, p, n: (handed.append(d[3]), real(d, p, n))  # type: ignore
    for msg in (0, 50, 75, 76, 500, 1099):
        m = s0[msg].message
        for d in (wire.control_datagram(m, Kind.ACK, 0, STOP_PAYLOAD.pack(3), tseq=4),
                  wire.stop_datagram(m, wire.CloseReason.COMPLETE, 10),
                  wire.control_datagram(m, Kind.BITMAP, 0, BITMAP_PREFIX.pack(1, 10) + b"\xff",
                                        Flag.FINAL)):
            m0.datagram_received(d, PEER, 1.0)
            m1.data_path.take(d, PEER, 1.0)  # type: ignore[union-attr]
    assert m0.counters() == m1.counters() and m1.counters()["stale"] == 18
    assert len(handed) == 9  # (messages 0 to 75 closed before the latest 1,024)


def test_a_send_s_ack_state_starts_in_the_compiled_paths_send_as_in_python():
    """A send keeps what its ACKs move in the compiled path's Send from the start: set up
    there, every field the ACKs move (ACK_FIELDS) starts as an AckState's does - also
    where a fresh Send's own initial value differs (its credit, say), and after the Send
    was used."""
    from boundedloss.protocol.acks import AckState, start

    def fields(acks) -> dict:
        return {name: getattr(acks, name) for name in ACK_FIELDS}

    expected = fields(AckState(ack_every=7, reverse_hint=0.25, loss_limit=0.125))
    shared = native.module().Send()
    assert fields(shared) != expected  # (so the test sees what start sets)
    for name, value in {"last_heard": 1.5, "acked": 15, "blocked_since": 2.5,
                        "in_python": True, "granted_least": 19}.items():
        setattr(shared, name, value)
    start(shared, ack_every=7, reverse_hint=0.25, loss_limit=0.125)
    assert fields(shared) == expected
