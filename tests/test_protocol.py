"""The sans-I/O core (TransferMux, MessageSender, MessageReceiver) driven by hand.

Datagrams are built with ``wire`` and fed to a core directly, or carried by a
FakeNetwork with a fixed delay and nothing else (no rate limits, jitter or random
loss) whose route is a ``Tap`` that sees each datagram's kind and loses the ones a
test picks; so every test controls exactly which datagram is lost, when a timer fires,
and what the destination buffer holds.
"""

from __future__ import annotations

import gc
import math
import struct
import tracemalloc
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundedloss import wire
from boundedloss.net.fake import FakeNetwork, PathProfile
from boundedloss.policy import (
    ClosePlan,
    EarlyClosePolicy,
    FixedBoundPolicy,
    MessageInfo,
    Policy,
    ReliablePolicy,
)
from boundedloss.protocol import (
    CloseReason,
    SendStatus,
    TooManyReceives,
    TransferMux,
    TransportConfig,
    TransportError,
)
from boundedloss.wire import HEADER_BYTES, DropReason, Flag, Header, Kind, MalformedDatagram
from conftest import PROPERTY, SENTINEL, SESSION, Tap, chunk_slices, chunks_equal, source_bytes

ACK = getattr(Kind, "ACK", None)
CONTROL_KINDS = [Kind.PROBE, Kind.BITMAP, Kind.STOP] + ([ACK] if ACK is not None else [])

CB = 64
CFG = TransportConfig(chunk_bytes=CB, peer_timeout=5.0, receive_deadline=20.0)
ROUND, MSG = 3, 5


def pair(cfg: TransportConfig = CFG, drop=None, delay: float = 1e-4):
    """Cores "a" and "b" on a FakeNetwork where every datagram takes ``delay`` seconds,
    in order, and the Tap that loses those ``drop(datagram, nth)`` picks."""
    net = FakeNetwork(path=PathProfile(delay=delay))
    a = net.attach("a", TransferMux(SESSION, cfg))
    b = net.attach("b", TransferMux(SESSION, cfg))
    return net, Tap(net, drop), a, b


def data_datagrams(src, cb: int = CB, round_id: int = ROUND, message_id: int = MSG,
                   session: int = SESSION, critical=None) -> list[bytes]:
    """Every DATA datagram of a message, as a well-behaved sender would build it."""
    b = np.asarray(src).reshape(-1).view(np.uint8)
    hdrs = wire.build_data_headers(session=session, round_id=round_id, message_id=message_id,
                                   message_bytes=b.nbytes, chunk_bytes=cb, critical=critical)
    return [hdrs[i].tobytes() + b[sl].tobytes()
            for i, sl in enumerate(chunk_slices(b.nbytes, cb))]


def control(kind: Kind, nbytes: int, cb: int = CB, index: int = 0, payload: bytes = b"",
            round_id: int = ROUND, message_id: int = MSG, session: int = SESSION,
            flags: Flag = Flag.NONE) -> bytes:
    count = wire.chunk_count(nbytes, cb)
    return wire.encode(Header(kind, session, round_id, message_id, index, count, nbytes, cb,
                              flags), payload)


def drain(mux: TransferMux, now: float) -> list[tuple[Header, bytes, object]]:
    out = []
    while True:
        batch = mux.poll(now, 4096)
        if not batch:
            return out
        for parts, peer in batch:
            data = b"".join(bytes(p) for p in parts)
            out.append((wire.decode(data)[0], data, peer))


def rto_budget(cfg: TransportConfig, losses: int) -> float:
    """Upper bound on the time ``losses`` consecutive lost probe exchanges can cost:
    each waits one RTO, doubling from the initial value up to max_rto."""
    return sum(min(cfg.max_rto, cfg.initial_rto * 2**k) for k in range(losses))


class PlanPolicy(Policy):
    """A policy with a fixed close rule, for testing the receiver's plan handling."""

    name = "plan"

    def __init__(self, min_delivered=None, accept_after=None):
        self.min_delivered = min_delivered
        self.accept_after = accept_after
        self.outcomes = []

    def plan(self, info: MessageInfo) -> ClosePlan:
        need = info.chunk_count if self.min_delivered is None else self.min_delivered
        return ClosePlan(min_delivered=need, bound=0.0, accept_after=self.accept_after)

    def observe(self, outcome) -> None:
        self.outcomes.append(outcome)


# ------------------------------------------------------------ basic transfers


@pytest.mark.parametrize("nbytes", [0, 1, CB - 1, CB, CB + 1, 10 * CB, 10 * CB + 7])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.float32, np.float64])
def test_lossless_transfer_is_exact(nbytes: int, dtype) -> None:
    n = nbytes // np.dtype(dtype).itemsize
    src = source_bytes(n * np.dtype(dtype).itemsize, seed=n).view(dtype)
    out = np.full_like(src, 0)
    out.view(np.uint8)[:] = SENTINEL
    net, _, a, b = pair()
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy(), out=out)
    tx = a.start_send("b", ROUND, MSG, src, net.now)
    net.run_until_done([tx, rx], timeout=1.0)
    r = rx.result
    assert r is not None and r.close_reason == CloseReason.COMPLETE and r.complete
    assert r.data is out and out.view(np.uint8).tobytes() == src.view(np.uint8).tobytes()
    count = wire.chunk_count(src.nbytes, CB)
    assert r.delivered.shape == (count,) and r.delivered.all()
    assert r.stats.chunks == count and r.stats.delivered == count
    assert r.delivered_bytes_mask().all() and r.delivered_bytes_mask().shape == (src.nbytes,)
    assert tx.result.status == SendStatus.STOPPED and tx.result.ok
    assert tx.result.close_reason == CloseReason.COMPLETE
    assert tx.result.stats.delivered == count
    assert a.open_sends == 0 and b.open_receives == 0
    # the only drops: the PROBE sent behind the data, and the second STOP it draws
    assert set(a.drops) <= {DropReason.STALE} and set(b.drops) <= {DropReason.STALE}
    assert a.pop_finished() == [tx.result] and b.pop_finished() == [rx.result]
    assert a.pop_finished() == []


@pytest.mark.parametrize(
    "payload",
    [b"", b"x", b"hello world" * 20, bytearray(b"abc" * 50), bytearray(),
     memoryview(b"0123456789" * 13), np.arange(37, dtype=np.int16).reshape(37, 1)],
    ids=["bytes0", "bytes1", "bytes220", "bytearray150", "bytearray0", "memoryview130",
         "int16_2d"],
)
def test_payload_buffer_types(payload) -> None:
    """bytes, bytearray, memoryview and n-d arrays send exactly their bytes."""
    expect = bytes(memoryview(payload).cast("B")) if not isinstance(payload, np.ndarray) \
        else payload.tobytes()
    net, _, a, b = pair()
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy())
    tx = a.start_send("b", ROUND, MSG, payload, net.now)
    assert tx.nbytes == len(expect)
    net.run_until_done([tx, rx], timeout=1.0)
    assert rx.result.complete
    assert rx.result.data.tobytes() == expect


def test_posting_misuse_raises() -> None:
    mux = TransferMux(SESSION, CFG)
    mux.start_receive("a", 1, 1, 0.0, policy=ReliablePolicy(), nbytes=10)
    with pytest.raises(TransportError):
        mux.start_receive("a", 1, 1, 0.0, policy=ReliablePolicy(), nbytes=10)
    mux.start_send("a", 1, 1, b"x" * 10, 0.0)  # a send of the same key is separate
    with pytest.raises(TransportError):
        mux.start_send("a", 1, 1, b"x" * 10, 0.0)
    with pytest.raises(ValueError):
        mux.start_receive("a", 1, 2, 0.0, policy=ReliablePolicy(), nbytes=10,
                          out=np.zeros(11, np.uint8))
    with pytest.raises(ValueError):  # critical mask without a size
        mux.start_receive("a", 1, 3, 0.0, policy=ReliablePolicy(), critical=np.ones(1, bool))
    with pytest.raises(ValueError):  # wrong critical length
        mux.start_receive("a", 1, 4, 0.0, policy=ReliablePolicy(), nbytes=200,
                          critical=np.ones(3, bool))
    with pytest.raises(ValueError):
        mux.start_send("b", 1, 4, b"x" * 200, 0.0, critical=np.ones(3, bool))
    with pytest.raises(ValueError):  # non-contiguous destination
        mux.start_receive("a", 1, 5, 0.0, policy=ReliablePolicy(),
                          out=np.zeros(20, np.uint8)[::2])
    with pytest.raises(ValueError):
        mux.start_receive("a", 1, 6, 0.0, policy=ReliablePolicy(),
                          nbytes=CFG.max_message_bytes + 1)
    with pytest.raises(ValueError):
        TransferMux(1 << 64)
    # nothing half-registered by the failures
    assert mux.open_receives == 1 and mux.open_sends == 1


# ------------------------------------------------------- lost control datagrams


def drop_first(kind: Kind, n: int, also_data=(1, 4)):
    """Lose the first ``n`` datagrams of ``kind`` (counted in ``drop.lost``) and, so that
    BITMAPs matter, the first-pass DATA datagrams numbered ``also_data``. The DATA that
    carries the first PROBE is a PROBE too: the first of them."""
    seen = 0

    def drop(d, nth):
        nonlocal seen
        if d.kind == kind or (kind == Kind.PROBE and d.probe_seq is not None):
            seen += 1
            lose = seen <= n
            drop.lost += lose  # type: ignore[attr-defined]
            return lose
        return d.kind == Kind.DATA and nth in also_data

    drop.lost = 0  # type: ignore[attr-defined]
    return drop


@pytest.mark.parametrize("n", [1, 3, 6])
@pytest.mark.parametrize("kind", CONTROL_KINDS, ids=lambda k: k.name)
def test_lost_control_datagrams_do_not_hang(kind: Kind, n: int) -> None:
    cfg = CFG
    if kind == ACK:  # a window of 4 datagrams with an ACK after every one
        cfg = TransportConfig(chunk_bytes=CB, peer_timeout=5.0, receive_deadline=20.0,
                              window_bytes=4 * (CB + HEADER_BYTES))
    src = source_bytes(20 * CB + 5, seed=n)
    drop = drop_first(kind, n)
    net, tap, a, b = pair(cfg, drop=drop)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy())
    tx = a.start_send("b", ROUND, MSG, src, net.now)
    t = net.run_until_done([tx, rx], timeout=60.0)
    assert drop.lost == n, "the scenario must really lose those datagrams"
    assert rx.result is not None and rx.result.complete
    assert rx.result.data.tobytes() == src.tobytes()
    assert tx.result is not None and tx.result.status == SendStatus.STOPPED
    # every lost exchange costs at most one (backed-off) RTO, plus a few round trips
    assert t <= rto_budget(cfg, n) + 0.01, t


def test_all_control_lost_for_a_while_then_recovers() -> None:
    """Every control datagram either way is lost for the first 0.4 s."""

    def drop(d, nth):
        if d.kind == Kind.DATA:
            return nth % 3 == 0 and nth < 40  # some first-pass DATA too
        return d.departed < 0.4

    src = source_bytes(30 * CB, seed=9)
    net, _, a, b = pair(drop=drop)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy())
    tx = a.start_send("b", ROUND, MSG, src, net.now)
    t = net.run_until_done([tx, rx], timeout=60.0)
    assert rx.result.complete and rx.result.data.tobytes() == src.tobytes()
    assert tx.result.ok
    # the first probe after the outage goes at most one (backed-off) RTO later
    assert 0.4 <= t <= 0.4 + CFG.max_rto + 0.01


# --------------------------------------------------------------- dead peers


def test_sender_to_silent_receiver_fails_after_peer_timeout() -> None:
    """Nobody posted the receive: the peer drops everything and never answers."""
    net, tap, a, b = pair()
    tx = a.start_send("b", ROUND, MSG, source_bytes(500, 1), net.now)
    net.run_until_done([tx], timeout=100.0)
    r = tx.result
    assert r.status == SendStatus.PEER_SILENT and not r.ok and r.close_reason is None
    assert r.stats.elapsed == pytest.approx(CFG.peer_timeout, abs=1e-9)
    assert net.now == pytest.approx(CFG.peer_timeout, abs=1e-9)
    # it re-probed with backoff (to probe_backoff_limit x the RTO), not in a tight loop,
    # each PROBE in more copies, up to probe_copies_max
    top = min(CFG.max_rto, CFG.initial_rto * CFG.probe_backoff_limit)
    assert 2 <= r.stats.probes <= math.log2(top / CFG.initial_rto) + 2 + CFG.peer_timeout / top
    assert r.stats.probes < tap.sent[("a", wire.Kind.PROBE)] <= \
        CFG.probe_copies_max * r.stats.probes
    assert b.drops[DropReason.UNKNOWN_MESSAGE] == sum(
        n for (src, _), n in tap.sent.items() if src == "a")
    assert a.open_sends == 0


def test_sender_whose_receiver_dies_fails_peer_timeout_after_last_word() -> None:
    heard = []

    def drop(d, nth):
        if d.src == "b":
            if heard:  # the receiver dies after its first answer
                return True
            heard.append(d.departed)
            return False
        return d.kind == Kind.DATA and nth == 3  # so that a BITMAP is needed

    net, _, a, b = pair(drop=drop)
    b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy())
    tx = a.start_send("b", ROUND, MSG, source_bytes(10 * CB, 2), net.now)
    net.run_until_done([tx], timeout=100.0)
    assert tx.result.status == SendStatus.PEER_SILENT
    last_heard = heard[0] + net.path("b", "a").delay
    assert tx.result.stats.elapsed == pytest.approx(last_heard + CFG.peer_timeout, abs=1e-9)


@pytest.mark.parametrize("policy", [ReliablePolicy(), FixedBoundPolicy(0.1)],
                         ids=["reliable", "mlt0.1"])
def test_receiver_whose_sender_dies_closes_at_deadline_with_what_it_has(policy) -> None:
    k = 4  # the sender dies after its 4th DATA datagram

    def drop(d, nth):
        return d.src == "a" and (d.kind != Kind.DATA or nth > k)

    src = source_bytes(10 * CB + 3, seed=3)
    out = np.full(src.nbytes, SENTINEL, np.uint8)
    net, _, a, b = pair(drop=drop)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=policy, out=out)
    a.start_send("b", ROUND, MSG, src, net.now)
    net.run_until_done([rx], timeout=100.0)
    r = rx.result
    assert r.close_reason == CloseReason.DEADLINE and not r.complete
    assert r.stats.elapsed == pytest.approx(CFG.receive_deadline, abs=1e-9)
    expect = np.zeros(wire.chunk_count(src.nbytes, CB), bool)
    expect[:k] = True
    assert (r.delivered == expect).all()
    assert (chunks_equal(src, out, CB) == expect).all()
    assert (out[k * CB:] == SENTINEL).all()
    assert r.stats.delivered == k


def test_receive_without_size_that_never_hears_closes_empty_at_deadline() -> None:
    mux = TransferMux(SESSION, CFG)
    rx = mux.start_receive("a", ROUND, MSG, 1.0, policy=ReliablePolicy())
    assert mux.next_deadline() == pytest.approx(1.0 + CFG.receive_deadline)
    mux.timer_fired(1.0 + CFG.receive_deadline - 1e-6)
    assert rx.result is None
    mux.timer_fired(1.0 + CFG.receive_deadline)
    r = rx.result
    assert r.close_reason == CloseReason.DEADLINE
    assert r.data.nbytes == 0 and r.delivered.size == 0 and r.stats.delivered == 0
    assert mux.poll(100.0) == []  # no geometry, nothing to say
    assert mux.open_receives == 0 and mux.next_deadline() is None


# ------------------------------------------------------------------- memory


def test_max_open_receives_is_enforced() -> None:
    cfg = TransportConfig(chunk_bytes=CB, max_open_receives=4)
    mux = TransferMux(SESSION, cfg)
    rxs = [mux.start_receive("a", 0, m, 0.0, policy=ReliablePolicy(), nbytes=100)
           for m in range(4)]
    with pytest.raises(TooManyReceives):
        mux.start_receive("a", 0, 4, 0.0, policy=ReliablePolicy(), nbytes=100)
    with pytest.raises(TransportError):  # TooManyReceives is a TransportError
        mux.start_receive("b", 9, 9, 0.0, policy=ReliablePolicy())
    assert mux.open_receives == 4
    mux.cancel_receive(rxs[0], 0.1)
    assert rxs[0].result.close_reason == CloseReason.CANCELLED
    assert mux.open_receives == 3
    mux.start_receive("a", 0, 4, 0.1, policy=ReliablePolicy(), nbytes=100)
    with pytest.raises(TooManyReceives):
        mux.start_receive("a", 0, 5, 0.1, policy=ReliablePolicy(), nbytes=100)
    # a receive that closes on its own frees its slot too
    for dg in data_datagrams(source_bytes(100, 0), round_id=0, message_id=1):
        mux.datagram_received(dg, "a", 0.2)
    assert rxs[1].result.complete and mux.open_receives == 3
    mux.start_receive("a", 0, 5, 0.2, policy=ReliablePolicy(), nbytes=100)


def test_flood_of_unknown_datagrams_allocates_nothing_lasting() -> None:
    n = 100_000
    mux = TransferMux(SESSION, CFG)
    rx = mux.start_receive("peer", ROUND, MSG, 0.0, policy=ReliablePolicy(), nbytes=1000)
    tx = mux.start_send("peer", ROUND, MSG + 1, source_bytes(1000, 0), 0.0)
    drain(mux, 0.0)
    chunk = bytes(CB)
    datagrams = []
    peers = [(f"10.0.0.{i % 250}", 1000 + i) for i in range(1000)]
    for i in range(n):
        peer = peers[i % len(peers)]
        j = i % 4
        if j == 0:  # foreign session, otherwise exactly our open receive
            dg = wire.encode(Header(Kind.DATA, SESSION ^ (i + 1), ROUND, MSG, 0, 16, 1000, CB),
                             chunk)
            peer = "peer"
        elif j == 1:  # our session, a message nobody posted
            dg = wire.encode(Header(Kind.DATA, SESSION, 1000 + i, i, 0, 2, 2 * CB, CB), chunk)
        elif j == 2:  # a probe for a message nobody posted
            dg = wire.encode(Header(Kind.PROBE, SESSION, 7, i, i, 1, 10, CB))
        else:  # answers for sends we never made
            dg = wire.encode(Header(Kind.STOP, SESSION, 7, i, 1, 1, 10, CB), b"\0\0\0\0")
        datagrams.append((dg, peer))
    feed = mux.datagram_received
    # warm up: first-time allocations (counter keys, caches) are not a leak
    for dg, peer in datagrams[:8]:
        feed(dg, peer, 0.0)
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for dg, peer in datagrams[8:]:
            feed(dg, peer, 0.5)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 50_000, f"{after - before} bytes kept after {n} datagrams"
    assert mux.drops[DropReason.FOREIGN_SESSION] == n // 4
    assert mux.drops[DropReason.UNKNOWN_MESSAGE] == n // 2
    assert mux.drops[DropReason.STALE] == n // 4
    assert sum(mux.drops.values()) == n == mux.datagrams_in
    assert mux.open_receives == 1 and mux.open_sends == 1
    assert rx.result is None and rx.delivered_count == 0 and tx.result is None
    assert mux.poll(0.5) == []  # and the flood was answered with nothing


def test_closed_receives_are_remembered_up_to_closed_memory() -> None:
    cfg = TransportConfig(chunk_bytes=CB, closed_memory=3)
    mux = TransferMux(SESSION, cfg)
    for m in range(5):
        rx = mux.start_receive("a", 0, m, 0.0, policy=ReliablePolicy(), nbytes=10)
        mux.datagram_received(data_datagrams(b"0123456789", message_id=m, round_id=0)[0],
                              "a", 0.0)
        assert rx.result.complete
    drain(mux, 0.0)
    # the 3 newest answer a late PROBE with STOP again; the 2 oldest are forgotten
    for m in range(5):
        mux.datagram_received(control(Kind.PROBE, 10, round_id=0, message_id=m, index=1),
                              "a", 1.0)
    assert mux.drops[DropReason.STALE] == 3
    assert mux.drops[DropReason.UNKNOWN_MESSAGE] == 2
    stops = drain(mux, 1.0)
    assert sorted(h.message_id for h, _, _ in stops) == [2, 3, 4]
    assert all(h.kind == Kind.STOP and h.index == CloseReason.COMPLETE for h, _, _ in stops)


# -------------------------------------------------------------- fuzzing


G = 4096  # guard bytes on each side of the destination
NB = 1000  # 16 chunks of 64, the last one 40 bytes


class Guarded:
    """A mux with one open receive whose destination sits between two guard regions,
    and one open send, both for peer "a"; ``expect(data)`` predicts the drop reason."""

    def __init__(self, nbytes: int | None = NB, cfg: TransportConfig = CFG):
        self.mux = TransferMux(SESSION, cfg)
        self.big = np.full(G + NB + G, SENTINEL, np.uint8)
        self.dest = self.big[G : G + NB]
        self.rx = self.mux.start_receive(
            "a", ROUND, MSG, 0.0, policy=ReliablePolicy(),
            out=self.dest if nbytes is not None else None,
        )
        self.src = source_bytes(NB, seed=1)
        self.tx = self.mux.start_send("a", ROUND, MSG + 1, self.src, 0.0)
        drain(self.mux, 0.0)  # the send's first burst

    def expect(self, data) -> DropReason | None:
        """The reason the mux must count ``data`` under, or None if it must accept it."""
        try:
            h, _ = wire.decode(data)
        except MalformedDatagram as e:
            return e.reason
        if h.session != SESSION:
            return DropReason.FOREIGN_SESSION
        if h.kind in (Kind.DATA, Kind.PROBE):
            if (h.round_id, h.message_id) != (ROUND, MSG):
                return DropReason.UNKNOWN_MESSAGE
            if self.rx.result is not None:
                return DropReason.STALE
            if self.rx.nbytes is None:
                ok = h.chunk_bytes == CB and h.message_bytes <= self.mux.config.max_message_bytes
            else:
                ok = (h.message_bytes, h.chunk_bytes) == (self.rx.nbytes, CB)
            return None if ok else DropReason.GEOMETRY_MISMATCH
        if (h.round_id, h.message_id) != (ROUND, MSG + 1) or self.tx.result is not None:
            return DropReason.STALE
        if (h.message_bytes, h.chunk_bytes) != (NB, CB):
            return DropReason.GEOMETRY_MISMATCH
        return None

    def feed(self, data, now: float = 0.001) -> None:
        """Feed one datagram; check it was counted (or accepted) as predicted."""
        expected = self.expect(data)
        before = self.mux.drops.copy()
        self.mux.datagram_received(data, "a", now)  # must never raise
        delta = self.mux.drops - before
        if expected is None:
            assert not delta, f"a valid datagram was dropped: {dict(delta)}"
        else:
            assert delta == {expected: 1}, f"expected {expected}, counted {dict(delta)}"
        self.check_guards()

    def check_guards(self) -> None:
        assert (self.big[:G] == SENTINEL).all(), "wrote before the destination"
        assert (self.big[G + NB :] == SENTINEL).all(), "wrote past the destination"


def field_patch(data: bytes, **fields) -> bytes:
    buf = bytearray(data)
    for name, value in fields.items():
        off = wire.HEADER_DTYPE.fields[name][1]
        size = wire.HEADER_DTYPE.fields[name][0].itemsize
        buf[off : off + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    return bytes(buf)


def good_datagrams(g: Guarded) -> dict[str, bytes]:
    datas = data_datagrams(g.src)
    out = {
        "data0": datas[0],
        "data_last": datas[-1],
        "probe": control(Kind.PROBE, NB, index=7),
        "bitmap": control(Kind.BITMAP, NB, message_id=MSG + 1,
                          payload=struct.pack("<II", 1, 0) + b"\x0f\x00", flags=Flag.FINAL),
        "stop": control(Kind.STOP, NB, message_id=MSG + 1, index=2, payload=b"\x05\0\0\0"),
    }
    if ACK is not None:
        out["ack"] = control(ACK, NB, message_id=MSG + 1, payload=b"\x05\0\0\0")
    return out


COUNT = wire.chunk_count(NB, CB)
MUTATIONS = [
    # (label, base datagram, mutation, expected reason)
    ("index_eq_count", "data_last", lambda d: field_patch(d, index=COUNT),
     DropReason.BAD_GEOMETRY),
    ("index_huge", "data0", lambda d: field_patch(d, index=2**32 - 1), DropReason.BAD_GEOMETRY),
    ("plen_field_wrong", "data0", lambda d: field_patch(d, plen=CB - 1), DropReason.BAD_LENGTH),
    ("datagram_truncated", "data0", lambda d: d[:-1], DropReason.BAD_LENGTH),
    ("datagram_extended", "data0", lambda d: d + b"\0", DropReason.BAD_LENGTH),
    ("truncated_and_plen", "data0",
     lambda d: field_patch(d[:-1], plen=CB - 1), DropReason.BAD_LENGTH),
    ("short", "data0", lambda d: d[: HEADER_BYTES - 1], DropReason.SHORT),
    ("count_wrong", "data0", lambda d: field_patch(d, count=COUNT + 1), DropReason.BAD_GEOMETRY),
    ("cbytes_zero", "data0", lambda d: field_patch(d, cbytes=0), DropReason.BAD_GEOMETRY),
    # consistent geometry that is not the posted buffer's: a write there would overflow
    ("bigger_message", "data0",
     lambda d: field_patch(d, mbytes=NB + 100 * CB, count=COUNT + 100,
                           index=COUNT + 50), DropReason.GEOMETRY_MISMATCH),
    ("bigger_message_chunk0", "data0",
     lambda d: field_patch(d, mbytes=2 * NB, count=wire.chunk_count(2 * NB, CB)),
     DropReason.GEOMETRY_MISMATCH),
    ("other_chunk_size", "data0",
     lambda d: field_patch(d[: HEADER_BYTES + 50], plen=50, cbytes=50,
                           count=wire.chunk_count(NB, 50)), DropReason.GEOMETRY_MISMATCH),
    ("probe_other_geometry", "probe", lambda d: field_patch(d, mbytes=NB + 1),
     DropReason.GEOMETRY_MISMATCH),
    ("bitmap_other_geometry", "bitmap",
     lambda d: field_patch(d, mbytes=NB + CB, count=COUNT + 1), DropReason.GEOMETRY_MISMATCH),
    ("stop_other_geometry", "stop", lambda d: field_patch(d, cbytes=CB * 2,
                                                          count=wire.chunk_count(NB, 2 * CB)),
     DropReason.GEOMETRY_MISMATCH),
    ("bitmap_index_4", "bitmap", lambda d: field_patch(d, index=4), DropReason.BAD_GEOMETRY),
    ("bitmap_beyond", "bitmap", lambda d: field_patch(d, index=COUNT + 7 & ~7),
     DropReason.BAD_GEOMETRY),
    ("bitmap_too_long", "bitmap", lambda d: field_patch(d + b"\0", plen=len(d) + 1 - HEADER_BYTES),
     DropReason.BAD_LENGTH),
    ("stop_payload_short", "stop", lambda d: field_patch(d[:-1], plen=3), DropReason.BAD_LENGTH),
    ("probe_with_payload", "probe", lambda d: field_patch(d + b"x", plen=1),
     DropReason.BAD_LENGTH),
    ("kind_0", "data0", lambda d: field_patch(d, kind=0), DropReason.BAD_KIND),
    ("kind_unknown", "probe", lambda d: field_patch(d, kind=max(Kind) + 1), DropReason.BAD_KIND),
    ("kind_255", "stop", lambda d: field_patch(d, kind=255), DropReason.BAD_KIND),
    ("magic", "data0", lambda d: field_patch(d, magic=0x4C43), DropReason.BAD_MAGIC),
    ("version", "data0", lambda d: field_patch(d, version=wire.VERSION + 1),
     DropReason.BAD_VERSION),
    ("session", "data0", lambda d: field_patch(d, session=SESSION + 1),
     DropReason.FOREIGN_SESSION),
    ("session_on_stop", "stop", lambda d: field_patch(d, session=0), DropReason.FOREIGN_SESSION),
    ("round", "data0", lambda d: field_patch(d, round=ROUND + 1), DropReason.UNKNOWN_MESSAGE),
    ("message", "probe", lambda d: field_patch(d, message=MSG + 7), DropReason.UNKNOWN_MESSAGE),
    ("stop_for_unknown_send", "stop", lambda d: field_patch(d, message=MSG + 9),
     DropReason.STALE),
    ("data_as_stop_for_receive", "data0", lambda d: field_patch(
        d[: HEADER_BYTES + 4], kind=Kind.STOP, plen=4), DropReason.STALE),
]


@pytest.mark.parametrize("label,base,mutate,reason", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutated_datagram_is_counted_and_dropped(label, base, mutate, reason) -> None:
    g = Guarded()
    data = mutate(good_datagrams(g)[base])
    assert g.expect(data) == reason, "the mutation must produce the case it names"
    g.feed(data)
    assert g.rx.result is None and g.tx.result is None
    assert g.rx.delivered_count == 0


def test_unmutated_datagrams_are_accepted() -> None:
    """The oracle's other half: the bases of the mutations above are all accepted."""
    g = Guarded()
    good = good_datagrams(g)
    for name in ["data0", "data_last", "probe", "bitmap"] + (["ack"] if ACK else []) + ["stop"]:
        g.feed(good[name])
    assert g.rx.delivered_count == 2
    assert (g.dest[:CB] == g.src[:CB]).all() and (g.dest[-(NB % CB):] == g.src[-(NB % CB):]).all()
    assert g.tx.result.status == SendStatus.STOPPED
    # once closed: further answers are stale, and a late DATA for a closed receive too
    g.feed(good["stop"])
    g.mux.cancel_receive(g.rx, 0.002)
    assert g.rx.result.close_reason == CloseReason.CANCELLED
    g.feed(good["data0"])
    assert g.mux.drops[DropReason.STALE] == 2


@settings(PROPERTY, max_examples=300)
@given(st.binary(max_size=HEADER_BYTES + 3 * CB))
def test_fuzz_random_bytes(data: bytes) -> None:
    g = Guarded()
    g.feed(data)


@settings(PROPERTY, max_examples=300)
@given(st.data())
def test_fuzz_random_bytes_with_valid_prefix(data) -> None:
    """Random bytes behind a real header prefix reach the deeper checks."""
    g = Guarded()
    good = good_datagrams(g)
    base = good[data.draw(st.sampled_from(sorted(good)))]
    keep = data.draw(st.integers(0, HEADER_BYTES))
    tail = data.draw(st.binary(max_size=HEADER_BYTES + 2 * CB))
    g.feed(base[:keep] + tail)


@settings(PROPERTY, max_examples=250)
@given(st.data())
def test_fuzz_mutated_valid_datagrams(data) -> None:
    """A sequence of valid datagrams, each possibly with a header field overwritten,
    bytes flipped, or its length changed: never raises, never writes outside the
    destination, and every datagram is counted exactly as predicted."""
    sized = data.draw(st.booleans())
    cfg = CFG if sized else TransportConfig(chunk_bytes=CB, max_message_bytes=1 << 16)
    g = Guarded(nbytes=NB if sized else None, cfg=cfg)
    good = good_datagrams(g)
    datas = data_datagrams(g.src)
    names = sorted(good)
    for step in range(data.draw(st.integers(1, 12))):
        if data.draw(st.booleans()):
            d = datas[data.draw(st.integers(0, len(datas) - 1))]
        else:
            d = good[data.draw(st.sampled_from(names))]
        how = data.draw(st.sampled_from(["none", "field", "flip", "length"]))
        if how == "field":
            field = data.draw(st.sampled_from(wire.HEADER_DTYPE.names))
            value = data.draw(st.one_of(
                st.integers(0, 2**64 - 1), st.integers(0, 70_000),
                st.sampled_from([0, 1, 7, 8, COUNT - 1, COUNT, NB, NB + 1, CB, CB + 1])))
            d = field_patch(d, **{field: value})
        elif how == "flip":
            buf = bytearray(d)
            for _ in range(data.draw(st.integers(1, 4))):
                pos = data.draw(st.integers(0, len(buf) - 1))
                buf[pos] ^= data.draw(st.integers(1, 255))
            d = bytes(buf)
        elif how == "length":
            n = data.draw(st.integers(0, len(d) + 70))
            d = (d + bytes(70))[:n]
        g.feed(d, now=0.001 * (step + 1))
    g.mux.timer_fired(1e9)  # whatever is left open closes without raising
    g.check_guards()
    if g.rx.result is not None and g.rx.nbytes is not None:
        assert g.rx.result.delivered.sum() == g.rx.result.stats.delivered


def test_receive_without_size_refuses_oversized_geometry() -> None:
    cfg = TransportConfig(chunk_bytes=CB, max_message_bytes=4096)
    mux = TransferMux(SESSION, cfg)
    rx = mux.start_receive("a", ROUND, MSG, 0.0, policy=ReliablePolicy())
    big = control(Kind.PROBE, 1 << 30)
    mux.datagram_received(big, "a", 0.0)
    other_cb = wire.encode(Header(Kind.PROBE, SESSION, ROUND, MSG, 0, 1, 10, CB + 1))
    mux.datagram_received(other_cb, "a", 0.0)
    assert mux.drops == {DropReason.GEOMETRY_MISMATCH: 2}
    assert rx.nbytes is None and rx.result is None
    # the first acceptable datagram fixes the size, and later ones must agree
    mux.datagram_received(control(Kind.PROBE, 4096), "a", 0.0)
    assert rx.nbytes == 4096
    mux.datagram_received(control(Kind.PROBE, 4000), "a", 0.0)
    assert mux.drops[DropReason.GEOMETRY_MISMATCH] == 3


# ---------------------------------------------------------- policy behaviour


def test_a_met_bound_does_not_cut_the_first_pass_short() -> None:
    """The bound is there to skip retransmissions, not data already on its way: on a
    lossless link a bounded receive still takes every chunk of the first pass."""
    src = source_bytes(200 * CB, seed=4)
    a = TransferMux(SESSION, CFG)
    b = TransferMux(SESSION, CFG)
    rx = b.start_receive("a", ROUND, MSG, 0.0, policy=FixedBoundPolicy(0.5))
    tx = a.start_send("b", ROUND, MSG, src, 0.0)
    now = 0.0
    while tx.result is None:
        now += 1e-5
        for parts, _ in a.poll(now, 4):  # a slow link: 4 datagrams per step
            b.datagram_received(b"".join(bytes(p) for p in parts), "a", now)
        for parts, _ in b.poll(now):
            a.datagram_received(b"".join(bytes(p) for p in parts), "b", now)
        assert now < 1.0
    assert rx.result.close_reason == CloseReason.COMPLETE
    assert rx.result.stats.delivered == 200
    assert tx.result.status == SendStatus.STOPPED and tx.result.stats.datagrams == 200


def test_a_met_bound_stops_at_the_final_probe_without_retransmitting() -> None:
    """Half the DATA is lost; FixedBoundPolicy(0.5) closes with BOUND_MET when the
    sender's PROBE says everything was sent once - no retransmission round."""
    src = source_bytes(200 * CB, seed=4)
    a = TransferMux(SESSION, CFG)
    b = TransferMux(SESSION, CFG)
    rx = b.start_receive("a", ROUND, MSG, 0.0, policy=FixedBoundPolicy(0.5))
    tx = a.start_send("b", ROUND, MSG, src, 0.0)
    now, n_data = 0.0, 0
    while tx.result is None:
        now += 1e-5
        for parts, _ in a.poll(now, 4):
            datagram = b"".join(bytes(p) for p in parts)
            if wire.decode(datagram)[0].kind == Kind.DATA:
                n_data += 1
                if n_data % 2 == 0:
                    continue  # lost
            b.datagram_received(datagram, "a", now)
        for parts, _ in b.poll(now):
            a.datagram_received(b"".join(bytes(p) for p in parts), "b", now)
        assert now < 1.0
    assert rx.result.close_reason == CloseReason.BOUND_MET
    assert rx.result.stats.delivered == 100
    assert rx.result.stats.retransmit_rounds == 0
    assert tx.result.status == SendStatus.STOPPED
    assert tx.result.close_reason == CloseReason.BOUND_MET
    assert tx.result.stats.datagrams == 200  # the first pass, nothing more
    assert a.poll(now + 1) == [] and not a.has_output() and a.open_sends == 0
    assert a.next_deadline() is None


def test_stop_after_one_datagram() -> None:
    """A STOP that arrives before the sender finished its first burst."""
    a = TransferMux(SESSION, CFG)
    tx = a.start_send("b", ROUND, MSG, source_bytes(50 * CB, 0), 0.0)
    assert len(a.poll(0.0, 1)) == 1
    stop = control(Kind.STOP, 50 * CB, index=CloseReason.BOUND_MET, payload=b"\x01\0\0\0")
    a.datagram_received(stop, "b", 0.001)
    assert tx.result.status == SendStatus.STOPPED and tx.result.stats.datagrams == 1
    assert tx.result.close_reason == CloseReason.BOUND_MET
    assert a.poll(0.002) == []
    # an unknown close reason in a STOP still stops the send
    tx2 = a.start_send("b", ROUND, MSG + 1, source_bytes(50 * CB, 0), 0.0)
    a.datagram_received(control(Kind.STOP, 50 * CB, index=99, message_id=MSG + 1,
                                payload=b"\0\0\0\0"), "b", 0.003)
    assert tx2.result.status == SendStatus.STOPPED and tx2.result.close_reason is None


@settings(PROPERTY, max_examples=60)
@given(
    nchunks=st.integers(1, 40),
    missing=st.integers(0, 39),
    seed=st.integers(0, 2**16),
    times=st.lists(st.floats(0.0, CFG.receive_deadline * 0.999), max_size=6),
)
def test_reliable_never_closes_with_a_missing_chunk(nchunks, missing, seed, times) -> None:
    missing %= nchunks
    src = source_bytes(nchunks * CB - seed % CB, seed)
    mux = TransferMux(SESSION, CFG)
    rx = mux.start_receive("a", ROUND, MSG, 0.0, policy=ReliablePolicy(), nbytes=src.nbytes)
    dgs = data_datagrams(src)
    rng = np.random.default_rng(seed)
    order = [i for i in rng.permutation(len(dgs)) if i != missing]
    order += list(rng.choice(order, size=min(len(order), 5))) if order else []  # duplicates
    events = [(float(t), "timer", None) for t in times]
    events += [(float(t), "data", i) for t, i in zip(np.sort(rng.random(len(order))), order)]
    events.append((0.5, "probe", None))
    for t, what, i in sorted(events, key=lambda e: e[0]):
        if what == "timer":
            mux.timer_fired(t)
        elif what == "data":
            mux.datagram_received(dgs[i], "a", t)
        else:
            mux.datagram_received(control(Kind.PROBE, src.nbytes, index=1), "a", t)
        assert rx.result is None, "closed with a chunk missing"
    answer = [h for h, _, _ in drain(mux, 1.0) if h.kind == Kind.BITMAP]
    assert answer and answer[-1].flags & Flag.FINAL
    mux.datagram_received(dgs[missing], "a", 1.0)
    assert rx.result.close_reason == CloseReason.COMPLETE
    assert rx.result.data.tobytes() == src.tobytes()


def test_accept_after_closes_with_what_arrived() -> None:
    policy = PlanPolicy(accept_after=0.2)
    src = source_bytes(10 * CB, 5)
    mux = TransferMux(SESSION, CFG)
    rx = mux.start_receive("a", ROUND, MSG, 1.0, policy=policy, nbytes=src.nbytes)
    assert mux.next_deadline() == pytest.approx(1.2)
    dgs = data_datagrams(src)
    for i in (0, 2, 4, 6, 8):
        mux.datagram_received(dgs[i], "a", 1.05)
    mux.timer_fired(1.1999)
    assert rx.result is None
    mux.timer_fired(1.2)
    r = rx.result
    assert r.close_reason == CloseReason.ACCEPT_DEADLINE
    assert r.stats.elapsed == pytest.approx(0.2)
    assert r.delivered.tolist() == [True, False] * 5
    stops = [h for h, _, _ in drain(mux, 1.2) if h.kind == Kind.STOP]
    assert [h.index for h in stops] == [CloseReason.ACCEPT_DEADLINE]
    assert len(policy.outcomes) == 1 and policy.outcomes[0].delivered == 5
    assert policy.outcomes[0].close_reason == CloseReason.ACCEPT_DEADLINE


def test_accept_after_waits_for_critical_chunks() -> None:
    policy = PlanPolicy(accept_after=0.2)
    src = source_bytes(10 * CB, 6)
    critical = np.zeros(10, bool)
    critical[[3, 7]] = True
    mux = TransferMux(SESSION, CFG)
    rx = mux.start_receive("a", ROUND, MSG, 0.0, policy=policy, nbytes=src.nbytes,
                           critical=critical)
    dgs = data_datagrams(src, critical=critical)
    for i in (0, 1, 3):
        mux.datagram_received(dgs[i], "a", 0.1)
    mux.timer_fired(0.2)
    assert rx.result is None, "accepted with a critical chunk missing"
    assert mux.next_deadline() == pytest.approx(CFG.receive_deadline)
    mux.datagram_received(dgs[5], "a", 0.25)
    assert rx.result is None
    mux.datagram_received(dgs[7], "a", 0.3)  # the last critical chunk: accept now
    r = rx.result
    assert r.close_reason == CloseReason.ACCEPT_DEADLINE
    assert r.stats.elapsed == pytest.approx(0.3)
    assert np.flatnonzero(r.delivered).tolist() == [0, 1, 3, 5, 7]


def test_accept_after_with_everything_delivered_is_complete() -> None:
    src = source_bytes(3 * CB, 7)
    mux = TransferMux(SESSION, CFG)
    rx = mux.start_receive("a", ROUND, MSG, 0.0, policy=PlanPolicy(accept_after=0.2),
                           nbytes=src.nbytes)
    for d in data_datagrams(src):
        mux.datagram_received(d, "a", 0.1)
    assert rx.result.close_reason == CloseReason.COMPLETE


def test_plan_that_needs_nothing_is_met_at_once() -> None:
    mux = TransferMux(SESSION, CFG)
    policy = PlanPolicy(min_delivered=0)
    rx = mux.start_receive("a", ROUND, MSG, 0.0, policy=policy, nbytes=5 * CB)
    assert rx.result is not None and rx.result.close_reason == CloseReason.BOUND_MET
    assert mux.open_receives == 0
    [(h, _, peer)] = drain(mux, 0.0)
    assert h.kind == Kind.STOP and peer == "a" and h.index == CloseReason.BOUND_MET
    # posted without a size: met as soon as the size is known
    rx = mux.start_receive("a", ROUND, MSG + 1, 0.0, policy=policy)
    assert rx.result is None
    mux.datagram_received(control(Kind.PROBE, 5 * CB, message_id=MSG + 1), "a", 0.1)
    assert rx.result.close_reason == CloseReason.BOUND_MET


@pytest.mark.parametrize("p", [0.0, 0.01, 0.1, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("nchunks", [1, 2, 7, 10, 33, 100])
def test_fixed_bound_closes_exactly_at_the_bound(p: float, nchunks: int) -> None:
    need = math.ceil((1 - Fraction(str(p))) * nchunks)
    src = source_bytes(nchunks * CB, nchunks)
    mux = TransferMux(SESSION, CFG)
    rx = mux.start_receive("a", ROUND, MSG, 0.0, policy=FixedBoundPolicy(p), nbytes=src.nbytes)
    dgs = data_datagrams(src)
    for k, i in enumerate(np.random.default_rng(nchunks).permutation(nchunks)):
        if k == need:
            break
        assert rx.result is None, f"closed with {k} < {need} chunks"
        mux.datagram_received(dgs[i], "a", 0.001)
    if need < nchunks:  # a met bound waits for the sender's final probe
        assert rx.result is None
        final = control(Kind.PROBE, src.nbytes, index=1, flags=Flag.FINAL)
        mux.datagram_received(final, "a", 0.002)
    assert rx.result.stats.delivered == need
    assert rx.result.close_reason == (
        CloseReason.COMPLETE if need == nchunks else CloseReason.BOUND_MET)


def test_critical_chunks_go_first_and_are_flagged() -> None:
    critical = np.zeros(12, bool)
    critical[[5, 9, 11]] = True
    mux = TransferMux(SESSION, CFG)
    mux.start_send("b", ROUND, MSG, source_bytes(12 * CB - 3, 0), 0.0, critical=critical)
    sent = [h for h, _, _ in drain(mux, 0.0) if h.kind == Kind.DATA]
    assert [h.index for h in sent[:3]] == [5, 9, 11]
    assert sorted(h.index for h in sent) == list(range(12))
    assert all(bool(h.flags & Flag.CRITICAL) == critical[h.index] for h in sent)


def test_critical_chunk_lost_repeatedly_is_still_delivered() -> None:
    """FixedBoundPolicy(0.9) would close after 2 of 12 chunks, but chunk 7 is critical
    and its first 4 transmissions are lost."""
    critical = np.zeros(12, bool)
    critical[7] = True
    losses = {"n": 0}

    def drop(d, nth):
        if d.kind == Kind.DATA and d.header.index == 7 and losses["n"] < 4:
            losses["n"] += 1
            return True
        return False

    src = source_bytes(12 * CB, 8)
    out = np.full(src.nbytes, SENTINEL, np.uint8)
    net, _, a, b = pair(drop=drop)
    rx = b.start_receive("a", ROUND, MSG, 0.0, policy=FixedBoundPolicy(0.9), out=out,
                         critical=critical)
    tx = a.start_send("b", ROUND, MSG, src, 0.0, critical=critical)
    net.run_until_done([rx, tx], timeout=30.0)
    assert losses["n"] == 4
    r = rx.result
    assert r.close_reason in (CloseReason.BOUND_MET, CloseReason.COMPLETE)
    assert r.delivered[7]
    assert (chunks_equal(src, out, CB) == r.delivered).all()


@pytest.mark.parametrize(
    "missing,segments",
    [([3], [0]), ([70], [64]), ([129], [128]), ([3, 129], [0, 128]), ([0, 64, 128], [0, 64, 128]),
     ([63, 64], [0, 64])],
)
def test_probe_answer_lists_exactly_the_missing_chunks(missing, segments) -> None:
    """chunk_bytes 8: one BITMAP segment covers 64 chunks; 130 chunks need 3 segments.
    Only segments holding a missing chunk are sent, the last one flagged FINAL, and the
    bits past the last chunk read as delivered."""
    cfg = TransportConfig(chunk_bytes=8, peer_timeout=CFG.peer_timeout,
                          receive_deadline=CFG.receive_deadline)
    src = source_bytes(130 * 8 - 3, 13)
    mux = TransferMux(SESSION, cfg)
    rx = mux.start_receive("a", ROUND, MSG, 0.0, policy=ReliablePolicy(), nbytes=src.nbytes)
    for i, d in enumerate(data_datagrams(src, cb=8)):
        if i not in missing:
            mux.datagram_received(d, "a", 0.0)
    drain(mux, 0.0)  # ACKs, if any
    mux.datagram_received(control(Kind.PROBE, src.nbytes, cb=8, index=42), "a", 0.1)
    answer = [(h, data) for h, data, _ in drain(mux, 0.1)]
    assert all(h.kind == Kind.BITMAP for h, _ in answer)
    assert [h.index for h, _ in answer] == segments
    assert [bool(h.flags & Flag.FINAL) for h, _ in answer] == [
        i == len(segments) - 1 for i in range(len(segments))]
    reported = []
    for h, data in answer:
        echo, delivered = struct.unpack_from("<II", data, HEADER_BYTES)
        assert echo == 42 and delivered == 130 - len(missing)
        bits = np.unpackbits(np.frombuffer(data[HEADER_BYTES + 8 :], np.uint8), bitorder="little")
        assert bits.size <= 64
        reported += [h.index + int(j) for j in np.flatnonzero(bits == 0)]
    assert reported == missing
    assert rx.result is None


# ------------------------------------------------- receive posted late / no size


def test_receive_without_size_learns_it_from_the_first_datagram() -> None:
    src = source_bytes(7 * CB + 11, 10)
    net, _, a, b = pair(drop=lambda d, nth: d.kind == Kind.DATA and nth == 2)
    rx = b.start_receive("a", ROUND, MSG, 0.0, policy=ReliablePolicy())
    assert rx.nbytes is None
    tx = a.start_send("b", ROUND, MSG, src, 0.0)
    net.run_until_done([rx, tx], timeout=10.0)
    r = rx.result
    assert rx.nbytes == src.nbytes
    assert r.complete and r.data.dtype == np.uint8 and r.data.tobytes() == src.tobytes()
    assert r.delivered.shape == (8,)


def test_receive_posted_after_the_sender_started_completes() -> None:
    src = source_bytes(30 * CB, 11)
    out = np.full(src.nbytes, SENTINEL, np.uint8)
    net, _, a, b = pair()
    tx = a.start_send("b", ROUND, MSG, src, 0.0)
    net.run(until=0.3)
    assert tx.result is None
    assert b.drops[DropReason.UNKNOWN_MESSAGE] >= 31  # the first burst and a probe
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy(), out=out)
    t = net.run_until_done([rx, tx], timeout=10.0)
    assert rx.result.complete and out.tobytes() == src.tobytes()
    assert tx.result.ok
    assert t <= 0.3 + 2 * CFG.max_rto  # the sender's next probe finds the receive


def test_receive_without_size_posted_late_completes() -> None:
    src = source_bytes(5 * CB, 12)
    net, _, a, b = pair()
    tx = a.start_send("b", ROUND, MSG, src, 0.0)
    net.run(until=0.2)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=FixedBoundPolicy(0.2))
    net.run_until_done([rx, tx], timeout=10.0)
    r = rx.result
    assert r.close_reason in (CloseReason.BOUND_MET, CloseReason.COMPLETE)
    assert r.stats.delivered >= 4
    assert (chunks_equal(src, r.data, CB)[r.delivered]).all()


# ------------------------------------------- the PROBE that ends the first pass


# paced, so that the ACKs of a pass come back while it is being sent (unpaced, a whole
# pass would leave at one instant, before any ACK could arrive)
PACED = TransportConfig(chunk_bytes=CB, peer_timeout=5.0, receive_deadline=20.0, rate_bps=2e6)


def _first_probe_copies(drop_fn, chunks: int = 300, cfg: TransportConfig = PACED):
    """Send ``chunks`` chunks under ``drop_fn(datagram, nth)``; return (copies of the
    first PROBE, the sender's result, the finish time)."""
    probes = []

    def drop(d, nth):
        if d.probe_seq is not None:  # (a PROBE, or the DATA that carries the first)
            probes.append(d.probe_seq)
        return drop_fn(d, nth)

    src = source_bytes(chunks * CB, seed=21)
    net, _, a, b = pair(cfg, drop=drop)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy())
    tx = a.start_send("b", ROUND, MSG, src, net.now)
    t = net.run_until_done([tx, rx], timeout=60.0)
    assert rx.result.complete and rx.result.data.tobytes() == src.tobytes()
    return probes.count(1), tx.result, t


def test_first_pass_probe_goes_in_copies_when_the_acks_show_heavy_forward_loss() -> None:
    # a microburst: 4 DATA datagrams in 5 lost on the first pass; the ACKs get through
    copies, res, _ = _first_probe_copies(
        lambda d, nth: d.src == "a" and d.kind == Kind.DATA and nth <= 300 and nth % 5)
    # 1 - 0.8^21 = 99% that one of the copies gets through, instead of an RTO
    assert copies >= 12  # ceil(log 0.01 / log 0.8) = 21
    assert res.ok


def test_a_silent_first_pass_probes_in_copies_once_the_round_trip_is_known() -> None:
    """Every ACK of a long first pass lost (or too few datagrams arriving to draw one):
    with a measured round trip, the silence itself says the path is lossy, and the
    PROBE goes in copies instead of one copy and RTO after RTO. A repeated PROBE then
    doubles the copies of the one that went unanswered."""
    burst = [False]
    probes = []

    def drop(d, nth):
        if d.probe_seq is not None and d.src == "a" and d.round_id == ROUND + 1:
            probes.append(d.probe_seq)
        if not burst[0]:
            return False
        if d.probe_seq is not None:
            return d.probe_seq == 1  # every copy of the first PROBE (the DATA one rides on)
        # every ACK, and a tenth of the DATA (so the receive waits for a PROBE)
        return (d.src == "b" and d.kind == ACK) or (d.kind == Kind.DATA and nth % 10 == 0)

    # paced, so that the first pass lasts longer than a round trip
    net, _, a, b = pair(PACED, drop=drop, delay=1e-3)
    for rnd in (ROUND, ROUND + 1):
        burst[0] = rnd == ROUND + 1
        rx = b.start_receive("a", rnd, MSG, net.now, policy=FixedBoundPolicy(0.5))
        tx = a.start_send("b", rnd, MSG, source_bytes(64 * CB, rnd), net.now)
        net.run_until_done([tx, rx], timeout=60.0)
        assert tx.result.ok
    # no ACK for 64 datagrams: at least 1 - every/64 of them (or of the ACKs) lost
    assert CFG.ack_every_for(64) == 32
    assert probes.count(1) == tx.recovery.copies_for(1 - 32 / 64) == 7
    assert probes.count(2) == 14  # the repeat: twice the copies


def test_probes_after_an_answer_count_the_loss_on_the_way_back() -> None:
    """DATA crosses with 2% loss but 4 ACKs in 5 are lost on the way back (a microburst
    at the sender's own receiver: a broadcast's answers): the PROBE after the
    retransmission pass goes in enough copies for the way back too."""
    probes = []

    def drop(d, nth):
        if d.kind == Kind.PROBE and d.src == "a":
            probes.append(d.header.index)
        return ((d.src == "b" and d.kind == ACK and nth % 5 != 1)
                or (d.src == "a" and d.kind == Kind.DATA and nth % 50 == 0))

    net, _, a, b = pair(PACED, drop=drop)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy())
    tx = a.start_send("b", ROUND, MSG, source_bytes(300 * CB, 9), net.now)
    net.run_until_done([tx, rx], timeout=60.0)
    assert rx.result.complete and tx.result.ok and tx.result.stats.retransmit_rounds >= 1
    # 2% lost forward alone would call for 2 copies; with ~80% lost back, 1% miss needs ~20
    assert probes.count(2) >= 10


def test_first_pass_probe_goes_in_copies_when_the_acks_are_lost() -> None:
    # the receiver's way back is in a microburst: 4 ACKs in 5 lost; DATA arrives
    copies, res, _ = _first_probe_copies(
        lambda d, nth: d.src == "b" and d.kind == ACK and nth % 5 != 1)
    assert copies >= 8  # ceil(log 0.01 / log 0.8) = 21 (fewer when ACKs are in flight)
    assert res.ok


def test_first_pass_probe_goes_once_when_the_acks_show_little_loss() -> None:
    # 1 datagram in 200 lost (under the 1% miss target), every ACK heard: one PROBE
    copies, res, _ = _first_probe_copies(
        lambda d, nth: d.src == "a" and d.kind == Kind.DATA and nth % 200 == 0)
    assert copies == 1 and res.ok
    # and a message too short for an ACK (or whose ACKs are all lost) keeps one PROBE
    copies, res, _ = _first_probe_copies(
        lambda d, nth: d.src == "a" and d.kind == Kind.DATA and nth % 5 != 0, chunks=40)
    assert copies == 1 and res.ok
    copies, res, _ = _first_probe_copies(lambda d, nth: d.src == "b" and d.kind == ACK)
    assert copies == 1 and res.ok


def test_a_stop_answering_the_final_probe_measures_the_round_trip() -> None:
    """Under a loose bound a transfer can end at its first PROBE (answered by STOP,
    never by a BITMAP); the next message to that peer must still start from the
    measured round trip, not the conservative initial RTO (Karn: only an unrepeated
    PROBE gives a sample)."""
    net, _, a, b = pair(drop=lambda d, nth: d.kind == Kind.DATA and nth % 10 == 0,
                        delay=1e-3)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=FixedBoundPolicy(0.2))
    tx = a.start_send("b", ROUND, MSG, source_bytes(50 * CB, 4), net.now)
    net.run_until_done([tx, rx])
    assert rx.result.close_reason == CloseReason.BOUND_MET
    assert tx.result.stats.retransmit_rounds == 0 and tx.result.stats.rtt == pytest.approx(2e-3)
    tx2 = a.start_send("b", ROUND + 1, MSG, source_bytes(50 * CB, 5), net.now)
    assert tx2.recovery.rto == pytest.approx(2e-3 + 4 * 1e-3)  # srtt + 4 rttvar, not initial_rto


def test_a_cold_path_s_lost_answer_waits_the_endpoint_s_round_trips_not_the_initial_rto():
    """A job's first round: every path cold, each rank's first pass to every peer at
    once. A send whose STOP and answer to its PROBE are lost waits for its PROBE to time
    out: as long as the endpoint's other paths' round trips call for, once one is
    measured - not the initial RTO (50 ms, hundreds of round trips here). With no other
    path to measure one, it still waits that."""

    def finished_after(peers: list[str]) -> float:
        net = FakeNetwork(path=PathProfile(delay=1e-4))
        a = net.attach("a", TransferMux(SESSION, CFG))
        work = []
        for p in peers:
            core = net.attach(p, TransferMux(SESSION, CFG))
            work.append(core.start_receive("a", ROUND, MSG, 0.0, policy=ReliablePolicy(),
                                           nbytes=CB))
            work.append(a.start_send(p, ROUND, MSG, source_bytes(CB, 1), 0.0))
        tap = Tap(net, lambda d, nth: d.src == "b" and d.kind == Kind.STOP and nth <= 2)
        net.run_until_done(work)
        assert tap.lost[Kind.STOP] == 2
        assert all(t.result.complete for t in work[0::2]) and all(t.result.ok for t in work[1::2])
        return work[1].result.stats.finished

    assert finished_after(["b"]) > CFG.initial_rto
    alongside = finished_after(["b", "c"])
    assert alongside < CFG.min_rto + 10 * 2e-4 < CFG.initial_rto / 10


def test_a_stop_sent_by_the_acceptance_deadline_is_not_a_round_trip() -> None:
    """A receive closed by its acceptance deadline STOPs the sender whenever the timer
    fires, answering no PROBE; a sender waiting on a PROBE the queue dropped must not
    take that wait for a round trip (it taught LTP's senders 150 ms on a 3 ms path,
    hence RTOs of 0.5 s). Here every PROBE is lost: the STOP is all the sender hears."""
    net, _, a, b = pair(delay=1e-3, drop=lambda d, nth: (
        d.kind == Kind.PROBE or (d.kind == Kind.DATA and nth % 2 == 0)))
    deadline = 0.03  # inside the sender's 50 ms initial RTO: the PROBE is still awaited
    ltp = EarlyClosePolicy(min_deadline=deadline, max_deadline=deadline)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ltp)
    tx = a.start_send("b", ROUND, MSG, source_bytes(100 * CB, 6), net.now)
    net.run_until_done([tx, rx])
    assert rx.result.close_reason == CloseReason.ACCEPT_DEADLINE
    assert tx.result.close_reason == CloseReason.ACCEPT_DEADLINE
    assert tx.result.stats.probes == 1 and tx.result.stats.rtt is None  # not ~30 ms


def test_acks_arriving_behind_the_first_probe_send_more_copies_at_once() -> None:
    """Unpaced, the whole first pass (and its PROBE) leaves before any ACK is back; the
    ACKs that follow show 80% loss, and the missing copies go out then - not an RTO
    later (the first PROBE's one copy is lost here)."""
    first = []

    def drop(d, nth):
        if d.probe_seq == 1:  # (the first copy rides on the last DATA)
            first.append(d)
            return len(first) == 1
        return d.src == "a" and d.kind == Kind.DATA and nth <= 300 and nth % 5 != 0

    copies, res, t = _first_probe_copies(drop, cfg=CFG)
    assert copies == 21  # 1, then 20 more when the ACKs arrived: ceil(log 0.01 / log 0.8)
    assert res.ok and t < CFG.initial_rto  # no PROBE timeout on the way


# ------------------------------------------- pacing of retransmission passes


PACING = replace(CFG, retransmit_pacing_gain=1.25)


def _retransmission_times(cfg: TransportConfig, chunks: int = 200):
    """3 of every 4 first-pass DATA lost (an incast queue overflowing), nothing after;
    return the first pass's send times, the retransmissions' and the sender."""
    net, tap, a, b = pair(cfg, delay=1e-3, drop=lambda d, nth: (
        d.src == "a" and d.kind == Kind.DATA and nth <= chunks and nth % 4 != 0))
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy())
    tx = a.start_send("b", ROUND, MSG, source_bytes(chunks * CB, 7), net.now)
    net.run_until_done([tx, rx], timeout=10.0)
    assert rx.result.complete
    sent = tap.departures("a", Kind.DATA)
    return sent[:chunks], sent[chunks:], tx, a


def test_retransmissions_are_paced_at_the_delivery_rate_the_pass_showed() -> None:
    """The first pass goes at once; it got 50 of 200 datagrams through in the 2 ms from
    its first DATA to the answer, so the 150 missing go out at 1.25x that rate (a
    millisecond's worth at once) - not all at once into the queue that dropped them."""
    first, retx, tx, _ = _retransmission_times(PACING)
    size = CB + HEADER_BYTES
    assert max(first) == 0.0 and len(retx) == 150
    assert tx.pacer.rate_samples[0] == pytest.approx(50 * size / 2e-3)
    rate = 1.25 * 50 * size / 2e-3
    burst = int(rate * 1e-3 // size)  # 31 datagrams leave at once
    assert retx[burst - 1] == retx[0] == pytest.approx(2e-3)
    assert retx[-1] - retx[0] == pytest.approx((150 - burst) * size / rate, rel=0.02)
    # without pacing, the whole pass leaves at one instant
    _, retx, _, _ = _retransmission_times(CFG)  # (the default)
    assert len(retx) == 150 and retx[-1] == retx[0]


def test_the_next_message_to_a_peer_starts_from_its_best_recent_delivery_rate() -> None:
    """Each answered pass is a sample; the next message to the peer paces its
    retransmissions from the best of the recent ones, so one pass in a random-loss
    burst (7 of 8 lost) does not slow the messages after it."""
    lossy = {ROUND: 4, ROUND + 1: 8}  # round -> 1 in N first-pass DATA arrives
    counts: dict = {}

    def drop(d, nth):
        if d.src != "a" or d.kind != Kind.DATA or d.round_id not in lossy:
            return False
        counts[d.round_id] = counts.get(d.round_id, 0) + 1
        return counts[d.round_id] <= 200 and counts[d.round_id] % lossy[d.round_id] != 0

    net, _, a, b = pair(PACING, delay=1e-3, drop=drop)
    samples = []
    for r in (ROUND, ROUND + 1):
        rx = b.start_receive("a", r, MSG, net.now, policy=ReliablePolicy())
        tx = a.start_send("b", r, MSG, source_bytes(200 * CB, r), net.now)
        net.run_until_done([tx, rx], timeout=10.0)
        assert rx.result.complete
        samples.append(tx.pacer.rate_samples[0])
    size = CB + HEADER_BYTES
    assert samples == [pytest.approx(50 * size / 2e-3), pytest.approx(25 * size / 2e-3)]
    tx3 = a.start_send("b", ROUND + 2, MSG, source_bytes(10 * CB, 8), net.now)
    assert tx3.pacer.best_rate == samples[0]


def test_a_pass_answered_only_after_a_repeated_probe_gives_no_rate_sample() -> None:
    """Its time holds a timeout (here every copy of the first PROBE is lost), not how
    fast the path drained: pacing the retransmissions by it would crawl."""
    net, tap, a, b = pair(PACING, delay=1e-3, drop=lambda d, nth: (
        d.src == "a" and ((d.kind == Kind.DATA and nth <= 200 and nth % 4 != 0)
                          or d.probe_seq == 1)))
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy())
    tx = a.start_send("b", ROUND, MSG, source_bytes(200 * CB, 7), net.now)
    net.run_until_done([tx, rx], timeout=10.0)
    assert rx.result.complete and tx.pacer.rate_samples == []
    retx = tap.departures("a", Kind.DATA)[200:]
    assert len(retx) == 150 and retx[-1] == retx[0]  # nothing measured: not paced


# ------------------------------------------------- runs of datagrams (UDP GRO) at once
def _corrupt(d: bytes, how: int) -> bytes:
    """The same length, something wrong: what the run path must leave to the one-by-one
    path (which counts and drops it)."""
    b = bytearray(d)
    if how == 0:
        b[0] ^= 0xFF  # magic
    elif how == 1:
        struct.pack_into("<I", b, 24, 10_000)  # index past the message
    elif how == 2:
        struct.pack_into("<Q", b, 8, SESSION ^ 1)  # a foreign session
    elif how == 3:
        struct.pack_into("<I", b, 20, MSG + 1)  # a message nobody posted
    elif how == 5:  # a whole chunk's payload as the (short) last chunk
        count = struct.unpack_from("<I", b, 28)[0]
        struct.pack_into("<I", b, 24, count - 1)
    else:
        struct.pack_into("<H", b, 4, int(Flag.CRITICAL))  # flags differ: harmless
    return bytes(b)


def _receive(seq, nbytes, crit, runs=None):
    """Feed ``seq`` to a fresh receive one by one, or (``runs``: lengths to cut at) in
    runs of consecutive equal-sized datagrams with every fifth one marked lost; the
    receive's end state, and whether it wrote outside its destination."""
    mux = TransferMux(SESSION, CFG)
    mux.run_min = 2  # every run of two or more is taken at once if it can be
    big = np.full(G + nbytes + G, SENTINEL, np.uint8)
    out = big[G:G + nbytes]
    rx = mux.start_receive("a", ROUND, MSG, 0.0, policy=FixedBoundPolicy(0.5), out=out,
                           critical=crit)
    if runs is None:
        for d in seq:
            mux.datagram_received(d, "a", 1.0)
    else:
        i, c = 0, 0
        while i < len(seq):
            j = i + 1
            while j < len(seq) and j - i < runs[c % len(runs)] and len(seq[j]) == len(seq[i]):
                j += 1
            mux.run_received(b"".join(seq[i:j]), len(seq[i]), "a", 1.0,
                             [k % 5 != 4 for k in range(i, j)])
            i, c = j, c + 1
    # the sender's FINAL probe: a met bound (every critical chunk in) closes the receive
    mux.datagram_received(control(Kind.PROBE, nbytes, flags=Flag.FINAL), "a", 2.0)
    assert (big[:G] == SENTINEL).all() and (big[G + nbytes:] == SENTINEL).all()
    res = rx.result
    delivered = (res.delivered if res is not None
                 else rx.delivered_mask())
    return (res.close_reason if res is not None else None, delivered, out.copy(),
            {r: n for r, n in mux.drops.items() if r != DropReason.STALE})


@PROPERTY
@given(
    nbytes=st.integers(1, 40 * CB),
    seed=st.integers(0, 2**16),
    deliver=st.lists(st.tuples(st.integers(0, 39), st.sampled_from([-1] * 12 + [0, 1, 2, 3, 4, 5])),
                     min_size=1, max_size=120),
    runs=st.lists(st.integers(1, 12), min_size=1, max_size=40),
    critical=st.booleans(),
)
def test_a_run_taken_at_once_ends_where_one_by_one_does(nbytes, seed, deliver, runs, critical):
    """Any sequence of datagrams (lost, repeated, reordered, some malformed) taken in
    runs, then the sender's FINAL probe, ends as the same sequence taken one by one:
    the same chunks delivered, the same bytes in the same places, nothing written
    outside the destination, the same close (a bound of 50%, critical chunks waited
    for) and the same malformed datagrams counted. (Datagrams behind the one that
    completes a receive are a duplicate to the run and stale one by one.)"""
    src = source_bytes(nbytes, seed)
    count = wire.chunk_count(nbytes, CB)
    crit = (np.arange(count) == 1) if critical and count > 1 else None  # one, often in
    dgrams = data_datagrams(src, critical=crit)
    full = nbytes // CB
    seq = [_corrupt(dgrams[i % count], how) if how >= 0 and (how != 5 or i % count < full < count)
           else dgrams[i % count] for i, how in deliver]
    reason, delivered, out, drops = _receive(seq, nbytes, crit, runs)
    kept = [d for k, d in enumerate(seq) if k % 5 != 4]
    e_reason, e_delivered, e_out, e_drops = _receive(kept, nbytes, crit)
    assert reason == e_reason and drops == e_drops
    assert np.array_equal(delivered, e_delivered) and np.array_equal(out, e_out)
    assert chunks_equal(src, out, CB)[delivered].all()


def test_a_run_draws_the_acks_its_datagrams_would_have():
    """The sender reads reverse loss from how many ACKs come back: a run of n datagrams
    draws n // ack_every of them (carried over between runs), with the highest
    transmission sequence seen."""
    nbytes = 100 * CB
    dgrams = data_datagrams(source_bytes(nbytes, 3))
    every = CFG.ack_every_for(100)
    # transmission sequences 1000.. in sending order
    dgrams = [d[:44] + struct.pack("<I", 1000 + i) + d[48:] for i, d in enumerate(dgrams)]
    mux = TransferMux(SESSION, CFG)
    mux.start_receive("a", ROUND, MSG, 0.0, policy=ReliablePolicy(), nbytes=nbytes)
    acks = []
    mux.run_min = 2
    for lo, hi in ((0, 45), (45, 90)):
        mux.run_received(b"".join(dgrams[lo:hi]), len(dgrams[0]), "a", 1.0)
        acks += [wire.parse(b"".join(bytes(p) for p in parts))
                 for parts, _ in mux.poll(1.0, 1000)]
    acks = [a for a in acks if a[0] == Kind.ACK]
    assert len(acks) == 90 // every
    assert acks[-1][10] == 1089  # the highest tseq seen


def test_a_long_message_draws_a_few_acks_a_pass_and_its_sender_expects_that_many():
    """Every ACK is a small packet of its own: a long message's pass draws
    ACKS_PER_MESSAGE of them, not one per 32 datagrams - and its sender, which reads
    the loss on the way back from how many ACKs came, reads none from a lossless pass."""
    from boundedloss.protocol.types import ACK_EVERY_SHORT, ACKS_PER_MESSAGE

    count = 1000
    acks = []

    def drop(d, nth):
        if d.kind == ACK:
            acks.append(d)
        return False

    net, _, a, b = pair(drop=drop)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy(), nbytes=count * CB)
    tx = a.start_send("b", ROUND, MSG, source_bytes(count * CB, 1), net.now)
    net.run_until_done([tx, rx], timeout=10.0)
    assert tx.result.ok and rx.result.complete
    every = CFG.ack_every_for(count)
    assert every == count // ACKS_PER_MESSAGE > ACK_EVERY_SHORT
    assert len(acks) == count // every == ACKS_PER_MESSAGE
    assert tx.recovery.reverse_loss() == 0.0
    # a short message keeps one ACK per ACK_EVERY_SHORT datagrams; a small window, 8
    assert CFG.ack_every_for(100) == ACK_EVERY_SHORT
    small = TransportConfig(chunk_bytes=CB, window_bytes=40 * (CB + HEADER_BYTES))
    assert small.ack_every_for(count) == 5


def test_a_clean_run_is_taken_at_once_and_a_short_one_one_by_one(monkeypatch):
    from boundedloss.protocol.mux import RUN_MIN
    from boundedloss.protocol.receiver import MessageReceiver

    runs = []
    real = MessageReceiver.data_run
    monkeypatch.setattr(MessageReceiver, "data_run",
                        lambda self, index, *a: runs.append(index.size) or real(self, index, *a))
    nbytes = 100 * CB
    src = source_bytes(nbytes, 4)
    dgrams = data_datagrams(src)
    mux = TransferMux(SESSION, CFG)
    rx = mux.start_receive("a", ROUND, MSG, 0.0, policy=ReliablePolicy(), nbytes=nbytes)
    mux.run_received(b"".join(dgrams[:40]), len(dgrams[0]), "a", 1.0)
    mux.run_received(b"".join(dgrams[40:40 + RUN_MIN - 1]), len(dgrams[0]), "a", 1.0)
    assert runs == [40] and rx.delivered_count == 40 + RUN_MIN - 1
    for d in dgrams[40 + RUN_MIN - 1:]:
        mux.datagram_received(d, "a", 1.0)
    assert rx.result.complete and np.array_equal(rx.result.data, src)


@pytest.mark.parametrize("offset, fmt, value", [
    (0, "<H", 0x1234),  # magic
    (3, "<B", int(Kind.PROBE)),  # kind
    (6, "<H", CB - 1),  # payload length
    (8, "<Q", SESSION ^ 1),  # session
    (16, "<I", ROUND + 1),  # round
    (20, "<I", MSG + 1),  # message
    (28, "<I", 99),  # chunk count
    (32, "<Q", 99 * CB),  # message bytes
    (40, "<I", CB * 2),  # chunk bytes
])
def test_a_run_with_one_stranger_goes_one_by_one(offset, fmt, value):
    """Every header field but flags, index and tseq must match the run's first datagram
    for the run to be taken at once; a stranger in the middle is counted and dropped as
    one by one would."""
    nbytes = 40 * CB
    dgrams = data_datagrams(source_bytes(nbytes, 5))
    odd = bytearray(dgrams[5])
    struct.pack_into(fmt, odd, offset, value)
    seq = dgrams[:5] + [bytes(odd)] + dgrams[6:12]
    got = []
    for as_run in (True, False):
        mux = TransferMux(SESSION, CFG)
        mux.run_min = 2
        rx = mux.start_receive("a", ROUND, MSG, 0.0, policy=ReliablePolicy(), nbytes=nbytes)
        if as_run:
            mux.run_received(b"".join(seq), len(seq[0]), "a", 1.0)
        else:
            for d in seq:
                mux.datagram_received(d, "a", 1.0)
        got.append((dict(mux.drops), rx.delivered_count))
    assert got[0] == got[1] and got[0][1] == 11 and sum(got[0][0].values()) == 1


def test_a_send_takes_the_loss_its_receive_from_that_peer_saw() -> None:
    """A microburst at a's receiver loses 4 in 5 of b's datagrams; a's next send to b
    gets its PROBE answers back along that way. Too short to draw an ACK, it cannot see
    that for itself: its first PROBE goes in the copies the loss a's receive saw calls
    for, not one."""
    probes = []

    def drop(d, nth):
        if d.probe_seq is not None and d.src == "a":
            probes.append((d.round_id, d.probe_seq))
        return d.src == "b" and d.kind == Kind.DATA and nth % 5 != 0

    net, _, a, b = pair(drop=drop)
    rx = a.start_receive("b", ROUND, MSG, net.now, policy=FixedBoundPolicy(0.9))
    tx = b.start_send("a", ROUND, MSG, source_bytes(200 * CB, 1), net.now)
    net.run_until_done([tx, rx])
    seen = rx.loss_seen()
    assert seen == pytest.approx(0.8, abs=0.02)
    tx2 = a.start_send("b", ROUND + 1, MSG, source_bytes(20 * CB, 2), net.now)
    rx2 = b.start_receive("a", ROUND + 1, MSG, net.now, policy=ReliablePolicy())
    net.run_until_done([tx2, rx2])
    assert rx2.result.complete
    assert probes.count((ROUND + 1, 1)) == tx2.recovery.copies_for(seen) > 1


@pytest.mark.parametrize("policy", [ReliablePolicy(), FixedBoundPolicy(0.5)])
def test_a_receive_says_what_the_first_pass_lost_whatever_its_policy(policy) -> None:
    """Whatever a receive's policy makes of it - a reliable one recovers every chunk, a
    bounded one closes at its bound - its stats say what the sender's first pass lost
    (what the loss guard measures): here the 1st, 4th, 7th ... DATA of 100 chunks, and
    only on the first pass. A clean first pass lost nothing; a sender is not a receive."""
    def drop(d, nth):
        return d.kind == Kind.DATA and d.src == "a" and nth <= 100 and nth % 3 == 1

    net, _, a, b = pair(drop=drop)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=policy, nbytes=100 * CB)
    tx = a.start_send("b", ROUND, MSG, source_bytes(100 * CB, 3), net.now)
    net.run_until_done([tx, rx])
    stats = rx.result.stats
    assert stats.first_pass_delivered == 66 and stats.first_pass_loss == pytest.approx(0.34)
    assert stats.delivered == (100 if isinstance(policy, ReliablePolicy) else 66)
    assert tx.result.stats.first_pass_loss is None
    clean = b.start_receive("a", ROUND + 1, MSG, net.now, policy=policy, nbytes=10 * CB)
    net.run_until_done([a.start_send("b", ROUND + 1, MSG, source_bytes(10 * CB, 4), net.now),
                        clean])
    assert clean.result.stats.first_pass_loss == 0.0


def test_a_peer_path_resumes_from_its_state_dict() -> None:
    """What a mux learned of a peer's path (round trip, delivery rates) comes back in
    another mux from the path's state_dict: a new send to that peer starts from the same
    timeout and rate there as here - not from the initial RTO."""
    net, _, a, b = pair()
    for r in range(3):
        rx = b.start_receive("a", r, MSG, net.now, policy=ReliablePolicy(), nbytes=50 * CB)
        net.run_until_done([a.start_send("b", r, MSG, source_bytes(50 * CB, r), net.now), rx])
    learned = a.path("b").state_dict()
    assert learned["srtt"] is not None and learned["srtt"] < CFG.initial_rto
    elsewhere = TransferMux(SESSION, CFG)
    elsewhere.path("b").load_state_dict(learned)
    assert elsewhere.path("b").state_dict() == learned
    here = a.start_send("b", 9, MSG, source_bytes(CB, 9), net.now)
    there = elsewhere.start_send("b", 9, MSG, source_bytes(CB, 9), net.now)
    assert there.recovery.rto == here.recovery.rto < CFG.initial_rto
    assert there.pacer.best_rate == here.pacer.best_rate
    with pytest.raises(ValueError, match="rttvar must be finite"):
        elsewhere.path("b").load_state_dict({**learned, "rttvar": math.inf})
    assert elsewhere.path("b").state_dict() == learned  # unchanged


def test_a_peer_path_keeps_only_its_latest_rate_samples() -> None:
    from boundedloss.protocol.path import RATE_SAMPLES, PeerPath

    path = PeerPath("b")
    assert path.best_rate() is None
    path.send_finished(None, [])  # (a send with no sample adds none)
    assert path.state_dict()["rates"] == []
    path.send_finished(None, [9e9] + [float(i) for i in range(RATE_SAMPLES)])
    assert path.state_dict()["rates"] == [float(i) for i in range(RATE_SAMPLES)]
    assert path.best_rate() == RATE_SAMPLES - 1  # (the 9e9 aged out)
    path.send_finished(None, iter([5e8]))  # (any iterable)
    assert path.best_rate() == 5e8 and len(path.state_dict()["rates"]) == RATE_SAMPLES


def test_the_mux_forgets_the_timers_of_finished_transfers():
    """A long job's mux keeps no timer bookkeeping for transfers that have finished."""
    import numpy as np

    from boundedloss.net.fake import FakeNetwork, PathProfile
    from boundedloss.policy import ReliablePolicy
    from boundedloss.protocol import TransportConfig
    from boundedloss.protocol.mux import TransferMux

    net = FakeNetwork(seed=0, path=PathProfile(delay=1e-5))
    a = net.attach("a", TransferMux(1, TransportConfig()))
    b = net.attach("b", TransferMux(1, TransportConfig()))
    payload = np.zeros(20_000, dtype=np.uint8)
    for round_id in range(50):
        tx = a.start_send("b", round_id, 1, payload, net.now)
        rx = b.start_receive("a", round_id, 1, net.now, policy=ReliablePolicy(),
                             nbytes=payload.nbytes)
        net.run_until_done([tx, rx])
        net.run(until=net.now + 1.0)
    for mux in (a, b):
        assert mux.open_sends == mux.open_receives == 0
        assert len(getattr(mux, "_armed")) == 0  # noqa: B009
        mux.next_deadline()
        assert len(getattr(mux, "_timers")) == 0  # noqa: B009


def test_the_mux_s_next_deadline_is_the_earliest_even_across_a_rebuild_of_its_heap():
    """Deadlines the compiled path moves later (its ACKs) while stale entries pile up,
    then a send ends and the heap is rebuilt in the middle of next_deadline: it still
    answers the earliest deadline of the open transfers, as a scan of them would."""
    from boundedloss.protocol import TransportConfig
    from boundedloss.protocol.mux import TransferMux

    mux = TransferMux(1, TransportConfig())
    a, b, c, d = (mux.start_send((f"10.0.0.{i}", 1), 0, 0, b"x" * 100, 0.0) for i in range(4))
    rearm = getattr(mux, "_rearm")  # noqa: B009 - (as a call through the mux does)
    c.acks.last_heard = 3.0
    rearm(c)
    b.acks.last_heard = 0.5
    rearm(b)
    t = 0.0
    while len(getattr(mux, "_timers")) < 64 + 4 * 4:  # noqa: B009 - (up to a rebuild)
        t += 0.001
        a.acks.last_heard = t
        rearm(a)
    mux.cancel_send(d, 0.0)  # (one fewer open send: the next push rebuilds the heap)
    a.acks.last_heard, b.acks.last_heard = 1.0, 0.7  # (the compiled path's ACKs)
    assert mux.next_deadline() == min(s.next_deadline() for s in (a, b, c))


def test_has_output_follows_which_sends_are_quiet() -> None:
    """has_output asks only the sends that are not quiet: two sends PROBE after their
    first pass and fall quiet (nothing to send until an answer); a BITMAP asking for a
    chunk again wakes the one it answers, and only that one has output."""
    src = source_bytes(8 * CB, seed=5)
    a = TransferMux(SESSION, CFG)
    b = TransferMux(SESSION, CFG)
    rx = {m: b.start_receive("a", ROUND, m, 0.0, policy=ReliablePolicy()) for m in (1, 2)}
    tx = {m: a.start_send("b", ROUND, m, src, 0.0) for m in (1, 2)}
    now, probes = 1e-5, {}
    assert a.has_output()
    for parts, _ in a.poll(now):
        head, _ = wire.decode(b"".join(bytes(p) for p in parts))
        if head.kind == Kind.PROBE or head.flags & Flag.PROBE_CARRIED:  # (held back)
            probes[head.message_id] = b"".join(bytes(p) for p in parts)
        elif not (head.message_id == 1 and head.index == 3):  # (chunk 3 of 1: lost)
            b.datagram_received(b"".join(bytes(p) for p in parts), "a", now)
    assert set(probes) == {1, 2}
    assert all(t.quiescent() for t in tx.values()) and not a.has_output()
    b.datagram_received(probes[1], "a", now)  # answered: chunk 3 is missing
    b.datagram_received(probes[2], "a", now)  # answered: complete, STOP
    for parts, _ in b.poll(now):
        a.datagram_received(b"".join(bytes(p) for p in parts), "b", now)
    assert tx[2].result is not None and tx[1].result is None and not tx[1].quiescent()
    assert a.has_output()
    sent = [wire.decode(b"".join(bytes(p) for p in parts))[0] for parts, _ in a.poll(now)]
    assert [(h.kind, h.message_id, h.index) for h in sent if h.kind == Kind.DATA] == [
        (Kind.DATA, 1, 3)]
    assert rx[2].result is not None


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_active_sends_are_polled_in_turn_as_a_walk_of_every_open_send_would(data):
    """``in_turn`` finds the active open sends from their ids; a walk of every open send
    from position ``turn``, keeping the active ones, gives the same sends in the same
    order - with sends finished (gone from the open ones, or still active) among them."""
    from types import SimpleNamespace

    from boundedloss.protocol.mux import in_turn

    count = data.draw(st.integers(1, 40))
    ids = sorted(data.draw(st.sets(st.integers(0, 10_000), min_size=count, max_size=count)))
    sends = [SimpleNamespace(transfer_id=i, peer=("10.0.0.1", i % 3), round_id=i // 7,
                             message_id=i) for i in ids]
    gone = data.draw(st.sets(st.sampled_from(ids)))
    open_sends = {(tx.peer, tx.round_id, tx.message_id): tx for tx in sends
                  if tx.transfer_id not in gone}
    if not open_sends:
        return
    active = {tx.transfer_id: tx for tx in sends if data.draw(st.booleans())}
    turn = data.draw(st.integers(0, len(open_sends) - 1))
    walk = list(open_sends.values())
    walk = [tx for tx in walk[turn:] + walk[:turn] if tx.transfer_id in active]
    assert in_turn(open_sends, active, turn) == walk


def test_results_hold_every_field_as_their_classes_would_make_them() -> None:
    """The results every message ends in are built without their classes' __init__
    (``types.make_frozen``): each holds every field, and equals and prints as the
    instance its class makes of the same values - and stays frozen."""
    import dataclasses

    net, _, a, b = pair()
    src = source_bytes(1000, 1)
    rx = b.start_receive("a", ROUND, MSG, net.now, policy=ReliablePolicy(), nbytes=1000)
    tx = a.start_send("b", ROUND, MSG, src, net.now)
    net.run_until_done([rx, tx])
    for result in (rx.result, tx.result):
        cls = type(result)
        values = {f.name: getattr(result, f.name) for f in dataclasses.fields(cls)}
        again = cls(**values)
        assert vars(result).keys() == vars(again).keys() and repr(result) == repr(again)
        with pytest.raises(dataclasses.FrozenInstanceError):
            result.peer = None  # type: ignore[misc]
    assert tx.result == type(tx.result)(**vars(tx.result))
