"""End-to-end transfers through FakeNetwork (virtual clock, seeded loss, jitter,
duplication, shallow queues): the properties the issue asks of the transport; and the
network's own route hook (a test's route loses, delays, reorders or duplicates)."""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from boundedloss import wire
from boundedloss.net.buffer import SharedBuffer
from boundedloss.net.fake import Datagram, FakeNetwork, NodeProfile, PathProfile
from boundedloss.net.loss import Bernoulli, Combined, GilbertElliott, Microburst
from boundedloss.policy import FixedBoundPolicy, ReliablePolicy
from boundedloss.protocol import CloseReason, SendStatus, TransferMux, TransportConfig
from boundedloss.wire import HEADER_BYTES, DropReason, Kind
from conftest import PROPERTY, SENTINEL, SESSION, chunks_equal, source_bytes

PATIENT = dict(peer_timeout=1e4, receive_deadline=1e4)  # "a loss pattern that eventually delivers"


def setup(cfg: TransportConfig, seed: int = 0, path: PathProfile | None = None,
          reverse: PathProfile | None = None, tx_profile: NodeProfile | None = None,
          rx_profile: NodeProfile | None = None):
    net = FakeNetwork(seed=seed, path=path)
    a = net.attach("a", TransferMux(SESSION, cfg), tx_profile)
    b = net.attach("b", TransferMux(SESSION, cfg), rx_profile)
    if reverse is not None:
        net.set_path("b", "a", reverse)
    return net, a, b


def loss_model(kind: str, p: float, seed: int):
    if kind == "bernoulli":
        return Bernoulli(p, seed=seed)
    if kind == "ge":  # bursts of 4 datagrams on average
        return GilbertElliott.from_rate(p, 4.0, seed=seed)
    # a burst window early in the transfer on top of background loss
    return Combined([Bernoulli(p / 2, seed=seed),
                     Microburst(0.9, windows=[(0.0, 2e-4)], seed=seed + 1)])


CHUNK_COUNTS = st.one_of(st.integers(0, 4), st.integers(5, 60), st.integers(61, 400))


def message_bytes(draw, chunk_bytes: int) -> int:
    """A size spread over few / some / many chunks, often not a multiple of the chunk
    (0 chunks: an empty message; 1 chunk less chunk_bytes - 1: a 1-byte one)."""
    count = draw(CHUNK_COUNTS)
    if count == 0:
        return draw(st.sampled_from([0, 1]))
    return count * chunk_bytes - draw(st.integers(0, chunk_bytes - 1))


@st.composite
def messages(draw, chunk_bytes: int) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from([np.float32, np.int8, np.float64])))
    n = message_bytes(draw, chunk_bytes) // dtype.itemsize
    return source_bytes(n * dtype.itemsize, seed=draw(st.integers(0, 2**16))).view(dtype)


# ------------------------------------------------------- reliable: bit-exact


@settings(PROPERTY, max_examples=200)
@given(
    data=st.data(),
    chunk_bytes=st.sampled_from([8, 16, 61, 256, 1400]),
    model=st.sampled_from(["bernoulli", "ge", "burst"]),
    p=st.sampled_from([0.0, 0.05, 0.2, 0.35, 0.5]),
    control_only=st.booleans(),
    duplicate=st.sampled_from([0.0, 0.05, 0.3]),
    jitter=st.sampled_from([0.0, 2e-5, 5e-4]),
    seed=st.integers(0, 2**16),
)
def test_reliable_is_bit_exact_under_loss_duplication_and_reorder(
    data, chunk_bytes, model, p, control_only, duplicate, jitter, seed
) -> None:
    msg = data.draw(messages(chunk_bytes))
    cfg = TransportConfig(chunk_bytes=chunk_bytes, **PATIENT)
    lossy = PathProfile(delay=50e-6, jitter=jitter, duplicate=duplicate,
                        loss=loss_model(model, p, seed) if p else None)
    if control_only:  # DATA goes through cleanly; every answer (BITMAP/STOP/ACK) is lossy
        path = PathProfile(delay=50e-6, jitter=jitter, duplicate=duplicate)
        net, a, b = setup(cfg, seed, path=path, reverse=lossy)
    else:  # DATA and control alike, both ways
        net, a, b = setup(cfg, seed, path=lossy, tx_profile=NodeProfile(up_bps=1e9))
    out = np.zeros_like(msg)
    out.view(np.uint8)[:] = SENTINEL
    rx = b.start_receive("a", 1, 2, net.now, policy=ReliablePolicy(), out=out)
    tx = a.start_send("b", 1, 2, msg, net.now)
    net.run_until_done([rx, tx], timeout=5e3)
    r = rx.result
    event(f"bytes {'0' if not msg.nbytes else '1' if msg.nbytes == 1 else '>1'}")
    event(f"chunks {'<=8' if r.stats.chunks <= 8 else '<=64' if r.stats.chunks <= 64 else '>64'}")
    event(f"retransmit rounds {'0' if not tx.result.stats.retransmit_rounds else '>0'}")
    assert r.close_reason == CloseReason.COMPLETE
    assert out.view(np.uint8).tobytes() == msg.view(np.uint8).tobytes()
    assert r.delivered.all() and r.stats.delivered == wire.chunk_count(msg.nbytes, chunk_bytes)
    assert tx.result.status == SendStatus.STOPPED
    assert tx.result.close_reason == CloseReason.COMPLETE


def test_reliable_under_heavy_loss_needs_retransmission_rounds() -> None:
    """The property above is not vacuous: with 50% loss the first pass misses chunks."""
    cfg = TransportConfig(chunk_bytes=16, **PATIENT)
    net, a, b = setup(cfg, 3, path=PathProfile(jitter=1e-4, duplicate=0.1,
                                                loss=Bernoulli(0.5, seed=3)))
    msg = source_bytes(4000, 3)
    rx = b.start_receive("a", 1, 2, 0.0, policy=ReliablePolicy())
    tx = a.start_send("b", 1, 2, msg, 0.0)
    net.run_until_done([rx, tx], timeout=5e3)
    assert rx.result.complete and rx.result.data.tobytes() == msg.tobytes()
    assert tx.result.stats.retransmit_rounds >= 3
    assert tx.result.stats.retransmitted >= 250
    assert net.counts["path_loss"] > 0.4 * net.counts["sent"]
    assert net.counts["duplicated"] > 0


# -------------------------------------------------------------- bounded loss


@settings(PROPERTY, max_examples=200)
@given(
    data=st.data(),
    chunk_bytes=st.sampled_from([8, 16, 100, 1400]),
    p=st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.3, 0.5, 0.9]),
    q=st.sampled_from([0.0, 0.05, 0.2, 0.5]),
    with_critical=st.booleans(),
    jitter=st.sampled_from([0.0, 1e-4]),
    seed=st.integers(0, 2**16),
)
def test_bounded_delivers_the_bound_and_the_mask_is_exact(
    data, chunk_bytes, p, q, with_critical, jitter, seed
) -> None:
    nbytes = max(1, message_bytes(data.draw, chunk_bytes))
    cfg = TransportConfig(chunk_bytes=chunk_bytes, peer_timeout=1e4, receive_deadline=3.0)
    path = PathProfile(jitter=jitter, duplicate=0.05, loss=Bernoulli(q, seed=seed) if q else None)
    net, a, b = setup(cfg, seed, path=path)
    src = source_bytes(nbytes, seed)
    count = wire.chunk_count(nbytes, chunk_bytes)
    critical = None
    if with_critical:
        critical = np.random.default_rng(seed).random(count) < 0.15
    out = np.full(nbytes, SENTINEL, np.uint8)
    rx = b.start_receive("a", 4, 0, 0.0, policy=FixedBoundPolicy(p), out=out, critical=critical)
    tx = a.start_send("b", 4, 0, src, 0.0, critical=critical)
    net.run_until_done([rx], timeout=10.0)
    r = rx.result
    event(f"closed {r.close_reason.name}")
    event(f"missing {'none' if r.delivered.all() else 'some'}")
    # whatever the reason it closed: the mask says exactly which chunks hold the source
    assert r.delivered.shape == (count,)
    assert (chunks_equal(src, out, chunk_bytes) == r.delivered).all()
    assert (out[~r.delivered_bytes_mask()] == SENTINEL).all(), "wrote an undelivered chunk"
    assert r.stats.delivered == int(r.delivered.sum())
    if r.close_reason in (CloseReason.BOUND_MET, CloseReason.COMPLETE):
        need = math.ceil((1 - Fraction(str(p))) * count)
        assert r.delivered.sum() >= need
        if critical is not None:
            assert r.delivered[critical].all()
        assert (r.close_reason == CloseReason.COMPLETE) == bool(r.delivered.all())
    else:
        assert r.close_reason == CloseReason.DEADLINE
    net.run_until_done([tx], timeout=100.0)
    assert tx.result.status == SendStatus.STOPPED
    assert tx.result.close_reason == r.close_reason


def test_bounded_transfer_really_stops_short() -> None:
    """FixedBoundPolicy closes with chunks missing (no retransmission to completion)."""
    cfg = TransportConfig(chunk_bytes=100, **PATIENT)
    net, a, b = setup(cfg, 5, path=PathProfile(loss=Bernoulli(0.05, seed=5)))
    src = source_bytes(100_000, 5)
    rx = b.start_receive("a", 0, 0, 0.0, policy=FixedBoundPolicy(0.1))
    tx = a.start_send("b", 0, 0, src, 0.0)
    net.run_until_done([rx, tx], timeout=100.0)
    assert rx.result.close_reason == CloseReason.BOUND_MET
    assert 900 <= rx.result.stats.delivered < 1000
    assert tx.result.stats.retransmitted == 0  # the first pass was enough


@pytest.mark.parametrize("seed", range(4))
def test_critical_chunks_always_arrive_under_heavy_loss(seed: int) -> None:
    cfg = TransportConfig(chunk_bytes=64, **PATIENT)
    src = source_bytes(64 * 200, seed)
    critical = np.random.default_rng(seed).random(200) < 0.1

    def run(crit):
        net, a, b = setup(cfg, seed, path=PathProfile(loss=Bernoulli(0.4, seed=seed)))
        out = np.full(src.nbytes, SENTINEL, np.uint8)
        rx = b.start_receive("a", 0, 0, 0.0, policy=FixedBoundPolicy(0.8), out=out,
                             critical=crit)
        tx = a.start_send("b", 0, 0, src, 0.0, critical=crit)
        net.run_until_done([rx, tx], timeout=1e3)
        assert (chunks_equal(src, out, 64) == rx.result.delivered).all()
        return rx.result

    r = run(critical)
    # (the passes that fetch the critical chunks also re-send every other missing one,
    # so a seed may see the whole message arrive first)
    assert r.close_reason in (CloseReason.BOUND_MET, CloseReason.COMPLETE)
    assert r.delivered[critical].all()
    # without the mask, the same losses leave some of those chunks missing
    plain = run(None)
    assert not plain.delivered[critical].all()


def test_a_lossy_bounded_transfer_needs_no_retransmission() -> None:
    """30% of the DATA is lost on the way; FixedBoundPolicy(0.5) closes at the sender's
    final probe: one pass, no retransmission round."""
    from boundedloss.net.loss import Bernoulli

    cfg = TransportConfig(chunk_bytes=1400, **PATIENT)
    net = FakeNetwork(seed=3, path=PathProfile(delay=20e-6))
    a = net.attach("a", TransferMux(SESSION, cfg), NodeProfile(up_bps=1e8))
    b = net.attach("b", TransferMux(SESSION, cfg), NodeProfile(loss=Bernoulli(0.3, seed=5)))
    src = source_bytes(1400 * 1000, 6)
    rx = b.start_receive("a", 0, 0, 0.0, policy=FixedBoundPolicy(0.5))
    tx = a.start_send("b", 0, 0, src, 0.0)
    net.run_until_done([rx, tx], timeout=10.0)
    assert rx.result.close_reason == CloseReason.BOUND_MET
    assert 0.5 <= rx.result.stats.delivered_fraction < 0.8
    assert tx.result.status == SendStatus.STOPPED
    assert tx.result.stats.retransmitted == 0 and tx.result.stats.datagrams == 1000


# ------------------------------------------------------------------- incast


def test_incast_into_a_shallow_queue_completes_bit_exact() -> None:
    cfg = TransportConfig(chunk_bytes=1400, **PATIENT)
    net = FakeNetwork(seed=7, path=PathProfile(delay=20e-6, jitter=5e-6))
    sink = net.attach("sink", TransferMux(SESSION, cfg),
                      NodeProfile(down_bps=1e9, queue_datagrams=16))
    msgs, rxs, txs = {}, [], []
    for i in range(8):
        name = f"w{i}"
        mux = net.attach(name, TransferMux(SESSION, cfg), NodeProfile(up_bps=1e9))
        msgs[name] = source_bytes(100_000 + 37 * i, seed=100 + i).view(np.uint8)
        rxs.append(sink.start_receive(name, 0, 0, 0.0, policy=ReliablePolicy()))
        txs.append(mux.start_send("sink", 0, 0, msgs[name], 0.0))
    t = net.run_until_done(rxs + txs, timeout=60.0)
    assert net.counts["queue_drop"] > 0, "the incast must overflow the queue"
    for rx in rxs:
        assert rx.result.complete
        assert rx.result.data.tobytes() == msgs[rx.peer].tobytes()
    assert all(tx.result.status == SendStatus.STOPPED for tx in txs)
    # 8 x ~100 kB through a 1 Gb/s downlink is ~7 ms; recovery must not take ages
    assert t < 2.0, t


# --------------------------------------------------------------- dead peers


def test_dead_link_both_ends_give_up_on_time() -> None:
    cfg = TransportConfig(chunk_bytes=512, peer_timeout=3.0, receive_deadline=7.0)
    net, a, b = setup(cfg, rx_profile=NodeProfile(loss=Bernoulli(1.0)))
    src = source_bytes(5000, 1)
    rx = b.start_receive("a", 0, 0, 0.0, policy=ReliablePolicy())
    tx = a.start_send("b", 0, 0, src, 0.0)
    net.run_until_done([tx], timeout=100.0)
    assert tx.result.status == SendStatus.PEER_SILENT
    assert tx.result.stats.elapsed == pytest.approx(3.0, abs=1e-9)
    net.run_until_done([rx], timeout=100.0)
    assert rx.result.close_reason == CloseReason.DEADLINE
    assert rx.result.stats.elapsed == pytest.approx(7.0, abs=1e-9)
    assert net.counts["node_loss"] == net.counts["sent"]


def test_sender_to_an_address_nobody_holds() -> None:
    cfg = TransportConfig(chunk_bytes=512, peer_timeout=2.0)
    net, a, _ = setup(cfg)
    tx = a.start_send("nowhere", 0, 0, source_bytes(3000, 1), 0.0)
    net.run_until_done([tx], timeout=100.0)
    assert tx.result.status == SendStatus.PEER_SILENT
    assert tx.result.stats.elapsed == pytest.approx(2.0, abs=1e-9)
    assert net.counts["no_route"] == net.counts["sent"] > 0


def test_receive_posted_late_through_the_network() -> None:
    cfg = TransportConfig(chunk_bytes=256, **PATIENT)
    net, a, b = setup(cfg, 2, path=PathProfile(loss=Bernoulli(0.1, seed=2)))
    src = source_bytes(20_000, 2)
    tx = a.start_send("b", 0, 0, src, 0.0)
    net.run(until=0.5)
    assert tx.result is None and b.drops
    rx = b.start_receive("a", 0, 0, net.now, policy=ReliablePolicy())  # and without a size
    net.run_until_done([rx, tx], timeout=100.0)
    assert rx.result.complete and rx.result.data.tobytes() == src.tobytes()


# ---------------------------------------------------------- the fake itself


def _scenario(seed: int, route=None):
    """A lossy, duplicating, reordering transfer; ``route(net, datagram)``, if given,
    is the network's route."""
    cfg = TransportConfig(chunk_bytes=100, **PATIENT)
    net, a, b = setup(cfg, seed, path=PathProfile(jitter=1e-4, duplicate=0.1,
                                                   loss=Bernoulli(0.2, seed=seed)))
    if route is not None:
        net.route = lambda d: route(net, d)
    src = source_bytes(20_000, 0)
    rx = b.start_receive("a", 0, 0, 0.0, policy=ReliablePolicy())
    tx = a.start_send("b", 0, 0, src, 0.0)
    t = net.run_until_done([rx, tx], timeout=100.0)
    return t, dict(net.counts), rx.result.stats, tx.result.stats, dict(b.drops)


def test_same_seed_same_run() -> None:
    assert _scenario(11) == _scenario(11)
    assert _scenario(11)[1] != _scenario(12)[1]


# ------------------------------------------------------------------ the route


class Recording(TransferMux):
    """A core that notes when each datagram reaches it, and its header."""

    def __init__(self, cfg: TransportConfig):
        super().__init__(SESSION, cfg)
        self.arrivals: list[tuple[float, wire.Header]] = []

    def datagram_received(self, data, peer, now: float) -> None:
        self.arrivals.append((now, wire.decode(data)[0]))
        super().datagram_received(data, peer, now)


def test_a_route_that_hands_on_to_the_default_changes_nothing() -> None:
    """Every datagram that leaves a node passes through the route, once, with its
    source, destination, bytes and departure time; handed on to the default route it
    meets the same fate, random draws included, as with no route set."""
    seen = []

    def inspect(net: FakeNetwork, d: Datagram):
        assert d.departed == net.now  # no uplink limit: it leaves when polled
        assert (d.src, d.dst) == ("a", "b") or (d.src, d.dst) == ("b", "a")
        assert d.header == wire.decode(d.data)[0] and d.round_id == 0
        seen.append(d.kind)
        return net.default_route(d)

    got = _scenario(11, inspect)
    assert got == _scenario(11)
    assert len(seen) == got[1]["sent"]
    assert set(seen) == {Kind.DATA, Kind.PROBE, Kind.BITMAP, Kind.STOP, Kind.ACK}


def test_a_route_given_to_the_constructor_sees_datagrams_to_nowhere_too() -> None:
    routed = []

    def route(d: Datagram):
        routed.append(d)
        return (1e-3,)

    net = FakeNetwork(route=route)
    assert net.route is route
    a = net.attach("a", TransferMux(SESSION, TransportConfig(chunk_bytes=100)))
    a.start_send("b", 0, 0, source_bytes(100, 0), 0.0)
    net.run(until=1e-4)
    assert [(d.dst, d.kind) for d in routed] == [("b", Kind.DATA), ("b", Kind.PROBE)]
    assert net.counts["no_route"] == net.counts["sent"] == 2  # nobody holds "b"


def test_a_route_loses_datagrams_by_kind() -> None:
    """Losing the 3rd DATA datagram (so that the receive waits for a PROBE), every ACK
    and the first 5 PROBEs (the path loses nothing else): the transfer still
    completes, and the network counts what the route lost as lost on the path."""
    cfg = TransportConfig(chunk_bytes=100, **PATIENT)
    net, a, b = setup(cfg, 1, path=PathProfile(delay=1e-4))
    lost = {Kind.DATA: 0, Kind.ACK: 0, Kind.PROBE: 0}
    data_sent = [0]

    def route(d: Datagram):
        if d.kind == Kind.DATA:
            data_sent[0] += 1
        if ((d.kind == Kind.DATA and data_sent[0] == 3) or d.kind == Kind.ACK
                or (d.kind == Kind.PROBE and lost[Kind.PROBE] < 5)):
            lost[d.kind] += 1
            return ()
        return net.default_route(d)

    net.route = route
    src = source_bytes(20_000, 1)
    rx = b.start_receive("a", 0, 0, 0.0, policy=ReliablePolicy())
    tx = a.start_send("b", 0, 0, src, 0.0)
    net.run_until_done([rx, tx], timeout=100.0)
    assert rx.result.complete and rx.result.data.tobytes() == src.tobytes()
    assert lost[Kind.DATA] == 1 and lost[Kind.ACK] > 0 and lost[Kind.PROBE] == 5
    assert tx.result.stats.probes >= 2  # the first went unanswered
    assert tx.result.stats.retransmitted == 1
    assert net.counts["path_loss"] == sum(lost.values())
    assert net.counts["sent"] == net.counts["path_loss"] + net.counts["delivered"]


def test_a_route_delays_and_reorders() -> None:
    """Each DATA datagram is held back the longer the earlier it left, and the PROBE
    behind them longer still: they reach the receiver in reverse, each exactly when
    the route said, and the message is whole without a retransmission."""
    cfg = TransportConfig(chunk_bytes=100, **PATIENT)
    net = FakeNetwork(path=PathProfile(delay=1e-4))
    a = net.attach("a", TransferMux(SESSION, cfg))
    b = net.attach("b", Recording(cfg))
    count = 20

    def route(d: Datagram):
        if d.kind == Kind.DATA:
            return (1e-3 * (count - d.header.index),)
        return (1e-3 * (count + 1),)

    net.route = route
    src = source_bytes(count * 100, 2)
    rx = b.start_receive("a", 0, 0, 0.0, policy=ReliablePolicy())
    tx = a.start_send("b", 0, 0, src, 0.0)
    net.run_until_done([rx, tx], timeout=10.0)
    assert rx.result.complete and rx.result.data.tobytes() == src.tobytes()
    data = [(t, h.index) for t, h in b.arrivals if h.kind == Kind.DATA]
    assert [i for _, i in data] == list(range(count - 1, -1, -1))
    assert [t for t, _ in data] == [pytest.approx(1e-3 * (count - i)) for _, i in data]
    assert tx.result.stats.retransmitted == 0


def test_a_route_duplicates() -> None:
    """Every DATA datagram delivered twice, its copy 1 us behind it and before the
    next chunk (and all before the PROBE behind them): the receive counts each copy
    as a duplicate (but the last chunk's: it closed on the first, and the copy is
    stale), and the network counts them as duplicated."""
    cfg = TransportConfig(chunk_bytes=100, **PATIENT)
    net, a, b = setup(cfg, path=PathProfile(delay=1e-4))

    def route(d: Datagram):
        if d.kind != Kind.DATA:
            return net.default_route(d)
        first = 1e-6 + 2e-6 * d.header.index
        return (first, first + 1e-6)

    net.route = route
    count = 30
    src = source_bytes(count * 100, 3)
    rx = b.start_receive("a", 0, 0, 0.0, policy=ReliablePolicy())
    tx = a.start_send("b", 0, 0, src, 0.0)
    net.run_until_done([rx, tx], timeout=10.0)
    net.run()  # the copies still in flight land
    assert rx.result.complete and rx.result.data.tobytes() == src.tobytes()
    assert net.counts["duplicated"] == tx.result.stats.datagrams == count
    assert rx.result.stats.retransmitted == count - 1  # the duplicates it received
    assert b.drops[DropReason.STALE] >= 1
    assert net.counts["sent"] + net.counts["duplicated"] == net.counts["delivered"]


def test_a_route_cannot_deliver_before_departure() -> None:
    cfg = TransportConfig(chunk_bytes=100, **PATIENT)
    net, a, _ = setup(cfg)
    net.route = lambda d: (1e-4, -1e-6)
    a.start_send("b", 0, 0, source_bytes(100, 0), 0.0)
    with pytest.raises(ValueError, match="before it left"):
        net.run()


def test_uplink_serialises_datagrams() -> None:
    cfg = TransportConfig(chunk_bytes=1000, **PATIENT)
    net, a, b = setup(cfg, path=PathProfile(delay=1e-4), tx_profile=NodeProfile(up_bps=1e8))
    src = source_bytes(1_000_000, 0)
    rx = b.start_receive("a", 0, 0, 0.0, policy=ReliablePolicy())
    tx = a.start_send("b", 0, 0, src, 0.0)
    t = net.run_until_done([rx, tx], timeout=10.0)
    wire_time = 1000 * (1000 + wire.HEADER_BYTES) * 8 / 1e8  # ~84 ms
    assert wire_time <= rx.result.stats.elapsed <= wire_time * 1.1 + 1e-3
    assert t <= wire_time * 1.1 + 2e-3


def test_downlink_queue_drops_are_counted() -> None:
    cfg = TransportConfig(chunk_bytes=1000, **PATIENT)
    net, a, b = setup(cfg, tx_profile=NodeProfile(up_bps=1e10),
                      rx_profile=NodeProfile(down_bps=1e9, queue_datagrams=4))
    src = source_bytes(200_000, 0)
    rx = b.start_receive("a", 0, 0, 0.0, policy=ReliablePolicy())
    tx = a.start_send("b", 0, 0, src, 0.0)
    net.run_until_done([rx, tx], timeout=10.0)
    assert net.counts["queue_drop"] > 0
    assert rx.result.complete and rx.result.data.tobytes() == src.tobytes()
    net.run()  # let what is still in flight land
    assert net.counts["sent"] + net.counts["duplicated"] == (
        net.counts["delivered"] + net.counts["queue_drop"] + net.counts["path_loss"]
        + net.counts["node_loss"] + net.counts["no_route"])


def _peak_queue(net: FakeNetwork, name: str) -> list[int]:
    """Every byte count the downlink queue of ``name`` reaches, as datagrams join it."""
    seen: list[int] = []
    arrive = net._arrive  # noqa: SLF001 - the test watches the queue it limits

    def watched(node, src, data):
        arrive(node, src, data)
        if node.address == name:
            seen.append(node.queued_bytes)

    net._arrive = watched  # type: ignore[method-assign]  # noqa: SLF001
    return seen


def test_a_queue_in_bytes_holds_no_more_than_its_bytes() -> None:
    """queue_bytes: a 1 MB message at 10x the downlink's rate overflows a 5,000-byte
    queue (1,048-byte datagrams: four fit, a fifth does not), and every datagram
    the queue took it delivers; the transfer completes over the retransmissions."""
    cfg = TransportConfig(chunk_bytes=1000, **PATIENT)
    net, a, b = setup(cfg, tx_profile=NodeProfile(up_bps=1e10),
                      rx_profile=NodeProfile(down_bps=1e9, queue_bytes=5000))
    seen = _peak_queue(net, "b")
    src = source_bytes(1_000_000, 0)
    rx = b.start_receive("a", 0, 0, 0.0, policy=ReliablePolicy())
    tx = a.start_send("b", 0, 0, src, 0.0)
    net.run_until_done([rx, tx], timeout=10.0)
    assert net.counts["queue_drop"] > 0
    # (four DATA fill it but for 808 bytes, which PROBEs of 48 may take)
    assert 4 * (1000 + HEADER_BYTES) <= max(seen) <= 5000
    assert rx.result.complete and rx.result.data.tobytes() == src.tobytes()


def test_a_token_bucket_downlink_lets_its_burst_through_at_once_then_the_rate() -> None:
    """down_burst_bytes (tc's tbf): after a quiet spell a 32 KB bucket lets 32 datagrams
    of 1,024 bytes leave at once; from then on one leaves every 1,024 bytes' time at 100
    Mbit/s (82 us); a pause refills the bucket at that rate, never past its size."""
    net = FakeNetwork(seed=0)
    net.attach("b", TransferMux(SESSION), NodeProfile(down_bps=100e6,
                                                      down_burst_bytes=32 * 1024))
    node = net._nodes["b"]  # noqa: SLF001 - the test reads the downlink's own schedule
    gap = 1024 * 8 / 100e6
    left = [net._enqueue(node, 1024) for _ in range(40)]  # noqa: SLF001
    at = functools.partial(pytest.approx, abs=1e-12)
    assert left[:32] == at([0.0] * 32)
    assert left[32:] == at([gap * k for k in range(1, 9)])
    net.now = left[-1] + 10 * gap  # ten datagrams' worth of tokens
    again = [net._enqueue(node, 1024) for _ in range(12)]  # noqa: SLF001
    assert again == at([net.now] * 10 + [net.now + gap, net.now + 2 * gap])
    net.now += 1.0  # a long pause: the bucket holds 32 datagrams again, not more
    assert [net._enqueue(node, 1024) for _ in range(33)][31:] == at(  # noqa: SLF001
        [net.now, net.now + gap])


def test_a_message_through_a_token_bucket_takes_its_bytes_less_the_burst_at_the_rate() -> None:
    """A 1 MB message from a fast sender into a 100 Mbit/s tbf with a 128 KB burst (and a
    queue that holds it all) arrives in (1 MB - 128 KB) of wire time; a plain link of
    the same rate takes the whole megabyte's."""
    elapsed = {}
    for burst in (0, 128 * 1024):
        cfg = TransportConfig(chunk_bytes=1000, **PATIENT)
        net, a, b = setup(cfg, path=PathProfile(delay=1e-5),
                          tx_profile=NodeProfile(up_bps=1e11),
                          rx_profile=NodeProfile(down_bps=1e8, down_burst_bytes=burst,
                                                 queue_bytes=4 << 20))
        src = source_bytes(1_000_000, 0)
        rx = b.start_receive("a", 0, 0, 0.0, policy=ReliablePolicy())
        tx = a.start_send("b", 0, 0, src, 0.0)
        net.run_until_done([rx, tx], timeout=10.0)
        assert net.counts["queue_drop"] == 0
        assert rx.result.complete and rx.result.data.tobytes() == src.tobytes()
        elapsed[burst] = rx.result.stats.elapsed
    wire_s = 1000 * (1000 + wire.HEADER_BYTES) * 8 / 1e8
    assert elapsed[0] == pytest.approx(wire_s, rel=0.02)
    assert elapsed[128 * 1024] == pytest.approx(wire_s - 128 * 1024 * 8 / 1e8, rel=0.02)


def test_a_shared_buffer_lends_a_busy_port_what_the_quiet_ones_leave() -> None:
    """Ports drawing from one 64 KB buffer (a dynamic threshold: a port may hold up to
    what is still free): one port alone under load fills half the pool - more than a
    fixed split among 4 ports would give it - a second then a quarter, and what leaves
    a port is free again."""
    buffer = SharedBuffer(64_000)

    def fill(now: float) -> int:
        """A port queueing 1,000-byte datagrams (each held until t = 1): what it got."""
        held = 0
        while buffer.admits(now, held, 1000):
            buffer.hold(1.0, 1000)
            held += 1000
        return held

    assert fill(0.0) == 32_000  # (then 32 KB is free: the port holds as much)
    assert fill(0.5) == 16_000
    assert buffer.admits(1.0, 0, 32_000)  # (all of it left its port at t = 1)
    with pytest.raises(ValueError):
        SharedBuffer(0)
    cfg = TransportConfig(chunk_bytes=1000, **PATIENT)
    net = FakeNetwork(seed=3, path=PathProfile(delay=20e-6))
    net.shared_buffer = SharedBuffer(64_000)
    sink = net.attach("sink", TransferMux(SESSION, cfg), NodeProfile(down_bps=1e9))
    seen = _peak_queue(net, "sink")
    rxs, txs = [], []
    for i in range(4):
        mux = net.attach(f"w{i}", TransferMux(SESSION, cfg), NodeProfile(up_bps=1e10))
        rxs.append(sink.start_receive(f"w{i}", 0, 0, 0.0, policy=ReliablePolicy()))
        txs.append(mux.start_send("sink", 0, 0, source_bytes(200_000, i), 0.0))
    net.run_until_done(rxs + txs, timeout=10.0)
    assert net.counts["queue_drop"] > 0 and all(rx.result.complete for rx in rxs)
    # (half the pool, and a datagram's worth: small PROBEs squeeze in at the edge)
    assert 64_000 // 4 < max(seen) <= 32_000 + 1000 + HEADER_BYTES


def test_run_until_done_times_out_and_attach_rejects_duplicates() -> None:
    cfg = TransportConfig(chunk_bytes=100, peer_timeout=50.0, receive_deadline=50.0)
    net, a, b = setup(cfg, rx_profile=NodeProfile(loss=Bernoulli(1.0)))
    tx = a.start_send("b", 0, 0, source_bytes(1000, 0), 0.0)
    with pytest.raises(TimeoutError):
        net.run_until_done([tx], timeout=5.0)
    assert net.now == pytest.approx(5.0) and tx.result is None
    with pytest.raises(ValueError):
        net.attach("a", TransferMux(SESSION, cfg))
    assert net.mux("b") is b


# ------------------------------------------------- bench burst: a PS round, simulated
def test_a_microburst_round_simulated_is_deterministic_and_dblp_recovers_in_fewer_passes():
    from boundedloss.bench.burst import run_burst_bench, simulate_round

    kw = dict(message_bytes=100_000, link_bps=10e9, rtt=100e-6, workers=2)
    base = [simulate_round(0.8, 0.008, seed=seed, **kw) for seed in range(1, 6)]
    assert base[0] == simulate_round(0.8, 0.008, seed=1, **kw)  # a virtual clock: no noise
    dblp = [simulate_round(0.8, 0.408, seed=seed, **kw) for seed in range(1, 6)]
    for b, d in zip(base, dblp):
        # P = 0.8% needs ~log(0.008)/log(0.8) = 22 passes at 80% loss, P = 40.8% about 4
        assert b["passes"] >= 15 and d["passes"] <= 6
        assert d["datagrams"] < b["datagrams"]
        assert b["normal_s"] < b["round_s"] and d["normal_s"] < d["round_s"]
    # (one seed's round may meet a timeout either side: the median over five)
    assert (np.median([d["round_s"] for d in dblp])
            < np.median([b["round_s"] for b in base]))
    (row,) = run_burst_bench(rates=[0.8], message_mb=0.1, link_gbps=10, rtt_us=100,
                             workers=2, seeds=2)
    assert row.speedup == pytest.approx(row.baseline_round_ms / row.dblp_round_ms)


def test_a_burst_round_without_probe_copies_pays_timeouts():
    """One PROBE copy (a protocol that recovers by timeouts): the PROBEs and answers the
    burst takes cost RTOs, so the baseline's burst round - many passes - slows far more
    than DBLP's few; with copies (the default) neither pays them."""
    from boundedloss.bench.burst import simulate_round
    from boundedloss.protocol.types import TransportConfig

    kw = dict(seed=3, message_bytes=100_000, link_bps=10e9, rtt=100e-6, workers=2)
    one = TransportConfig(probe_copies_max=1)
    base, base1 = (simulate_round(0.8, 0.008, **kw, config=c) for c in (None, one))
    dblp, dblp1 = (simulate_round(0.8, 0.408, **kw, config=c) for c in (None, one))
    assert base1["round_s"] > 2 * base["round_s"]
    assert base1["round_s"] - base["round_s"] > dblp1["round_s"] - dblp["round_s"]
    assert base1["round_s"] / dblp1["round_s"] > base["round_s"] / dblp["round_s"]


def test_bench_burst_rejects_a_loss_rate_of_one_or_more(capsys, tmp_path):
    from boundedloss.cli import main

    rc = main(["bench", "burst", "--json", str(tmp_path / "b.json"), "--rates", "0.8,1.5"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--rates" in err
