"""Sender-side congestion control (protocol/congestion.py): the delay loop's decisions,
the samples the ACKs give it, and flows through one simulated bottleneck
(sim/shared_link.py) - random loss, a queue shared with another sender, a TCP bulk flow
beside it - on the virtual clock; and "off" sends exactly what it sent before."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import numpy as np
import pytest

from boundedloss import wire
from boundedloss.net import native
from boundedloss.net.fake import FakeNetwork, NodeProfile, PathProfile
from boundedloss.net.loss import Bernoulli
from boundedloss.policy import FixedBoundPolicy, ReliablePolicy
from boundedloss.protocol import TransferMux, TransportConfig
from boundedloss.protocol.congestion import (
    CONGESTION_MODES,
    TCP_FAIR,
    AckSamples,
    DelayLoopConfig,
    DelayRateControl,
    parse_congestion,
)
from boundedloss.protocol.types import CONGESTION_ACK_EVERY, DataRun
from boundedloss.sim.shared_link import SharedLink, run_shared_link
from boundedloss.wire import STOP_PAYLOAD, Kind
from conftest import SESSION

LOOP = DelayLoopConfig()
BASE = 100e-6  # the path's own round trip in the unit tests
DATAGRAM = 1448


def _control(delivered: float = 1e7) -> DelayRateControl:
    """A loop that has seen the path's round trip and a delivery rate."""
    control = DelayRateControl(LOOP)
    control.delivery_sample(delivered)
    control.rtt_sample(BASE, 0.0)
    return control


# ------------------------------------------------------------- its decisions
def test_unpaced_until_a_sample_calls_for_a_cut() -> None:
    control = _control()
    for i in range(1, 50):  # (all at the path's round trip: no queueing)
        control.rtt_sample(BASE, i * BASE, 16 * DATAGRAM)
    assert control.rate is None and control.send_rate() is None and control.cuts == 0


def test_queueing_above_the_target_cuts_in_proportion_to_the_excess() -> None:
    small, large = _control(), _control()
    small.rtt_sample(BASE + LOOP.target_queue_delay + 100e-6, 1e-3)
    large.rtt_sample(BASE + LOOP.target_queue_delay + 400e-6, 1e-3)
    # (Swift's cut: the excess's share of the round trip times the gain - from the
    # delivery rate, as nothing was paced before)
    rtt = BASE + LOOP.target_queue_delay + 100e-6
    assert small.rate == pytest.approx(1e7 * (1 - LOOP.decrease_gain * 100e-6 / rtt))
    # a larger excess cuts more, but never more than max_decrease at once
    assert large.rate == pytest.approx(1e7 * (1 - LOOP.max_decrease))
    assert large.rate < small.rate < 1e7


def test_at_most_one_cut_per_round_trip() -> None:
    control = _control()
    rtt = BASE + 2 * LOOP.target_queue_delay
    control.rtt_sample(rtt, 1e-3)
    once = control.rate
    control.rtt_sample(rtt, 1e-3 + 0.9 * rtt)  # (the cut cannot have shown yet)
    assert control.rate == once and control.cuts == 1
    control.rtt_sample(rtt, 1e-3 + rtt)
    assert control.cuts == 2 and control.rate is not None and once is not None
    assert control.rate < once


def test_under_the_target_the_rate_grows_a_packet_per_round_trip_of_data() -> None:
    control = _control()
    control.rtt_sample(BASE + 2 * LOOP.target_queue_delay, 1e-3)  # (a cut: now paced)
    rate = control.rate
    assert rate is not None
    window = rate * BASE
    control.rtt_sample(BASE, 2e-3, 0.1 * window)  # a tenth of a window acknowledged
    assert control.rate == pytest.approx(rate + LOOP.packet_bytes / BASE * 0.1)
    # growth is clocked by data, not time: a sample after an idle spell acknowledging
    # nothing grows nothing
    before = control.rate
    control.rtt_sample(BASE, 5.0, 0.0)
    assert control.rate == before
    # and never past probe_gain times what the ACKs showed the path taking
    for i in range(200):
        control.delivery_sample(1e7)
        control.rtt_sample(BASE, 5.0 + i * BASE, 16 * DATAGRAM)
    assert control.rate == pytest.approx(LOOP.probe_gain * 1e7)


def test_loss_alone_changes_no_decision() -> None:
    """The samples a send's ACKs give, at the path's own round trip, whether its
    receiver got every datagram or lost half of them: the same rate, never a cut."""

    class Acks:  # the AckState fields the samples read
        def __init__(self) -> None:
            self.ack_tseq, self.ack_delivered, self.last_heard = -1, 0, 0.0

    rates = []
    for loss in (0.0, 0.5):
        control = _control()
        control.rtt_sample(BASE + 2 * LOOP.target_queue_delay, 1e-3)  # (paced from here)
        samples, acks = AckSamples(control, DATAGRAM), Acks()
        delivered = 0
        for i in range(200):
            t = 2e-3 + i * 100e-6  # (232 MB/s passing: the probe cap binds)
            samples.sent(i * 16, t)
            acks.ack_tseq = i * 16 + 15  # (the ACK for the run's last datagram)
            delivered += round(16 * (1 - loss))
            acks.ack_delivered = delivered
            acks.last_heard = t + BASE
            samples.read(acks)
        assert control.cuts == 1
        rates.append(control.rate)
    # (grown to what the path takes, lost datagrams included, and no further)
    assert rates[0] == rates[1] == pytest.approx(LOOP.probe_gain * 16 * DATAGRAM / 100e-6)


def test_the_samples_are_round_trips_of_the_datagrams_the_acks_name() -> None:
    seen = []

    class Recording(DelayRateControl):
        def rtt_sample(self, rtt: float, now: float, acked_bytes: float = 0.0) -> None:
            seen.append((rtt, now, acked_bytes))

    samples = AckSamples(Recording(LOOP), DATAGRAM)
    samples.sent(0, 1.0)  # tseqs 0..9 at 1.0
    samples.sent(10, 2.0)  # 10.. at 2.0

    class Acks:
        ack_tseq, ack_delivered, last_heard = 12, 13, 2.5

    samples.read(Acks)
    samples.read(Acks)  # (nothing moved: no second sample)
    assert seen == [(0.5, 2.5, 13 * DATAGRAM)]
    assert samples.sent_at(11) == 2.0 and samples.sent_at(3) is None  # (let go)


def test_the_fair_floor_follows_the_fills_and_lapses_when_they_stop() -> None:
    control = _control(delivered=2e6)
    full = BASE + 5e-3  # a queue a loss-based flow fills to 5 ms
    per_fill = 64 * DATAGRAM
    t = 1e-3
    for _ in range(6):  # drain, fill, drain, ...: 64 datagrams between fills
        control.rtt_sample(BASE + LOOP.target_queue_delay, t, per_fill / 2)
        t += full
        control.rtt_sample(full, t, per_fill / 2)
        t += full
    srtt = control.srtt
    assert srtt is not None
    interval = per_fill / LOOP.packet_bytes
    floor = LOOP.floor_gain * LOOP.packet_bytes / srtt * math.sqrt(TCP_FAIR * interval)
    assert control.fair_floor() == pytest.approx(floor)
    assert control.rate is not None and control.rate < floor  # (the loop alone: cut)
    assert control.pacing_rate() == pytest.approx(floor)
    # two open sends share it
    control.senders = 2
    assert control.send_rate() == pytest.approx(floor / 2)
    # no fill for floor_lapse intervals' worth of data: nobody fills the queue any more
    for _ in range(int(LOOP.floor_lapse) + 1):
        control.rtt_sample(BASE, t, per_fill)
        t += BASE
    assert control.fair_floor() == 0.0
    assert control.pacing_rate() == control.rate


def test_the_choice_is_parsed_once_with_one_clear_line() -> None:
    assert TransportConfig().congestion == "off" and TransportConfig().delay_loop is None
    assert TransportConfig(congestion="delay").delay_loop is CONGESTION_MODES["delay"]
    with pytest.raises(ValueError,
                       match=r"unknown congestion control 'bbr'; choose from off, delay"):
        TransportConfig(congestion="bbr")
    assert parse_congestion("delay") == "delay"


def test_with_congestion_control_acks_come_often_enough_to_steer_by() -> None:
    off, on = TransportConfig(), TransportConfig(congestion="delay")
    assert off.ack_every_for(4000) == 4000 // 8
    assert on.ack_every_for(4000) == CONGESTION_ACK_EVERY
    assert on.ack_every_for(0) == off.ack_every_for(0) // 2  # (32 -> 16)


# ------------------------------------------------- "off" sends what it sent
def _datagram_digest(config: TransportConfig) -> tuple[str, int]:
    """Every datagram of an incast (three senders, two messages each, 5% loss, a
    64-datagram queue) - its bytes, when it left, from and to whom - in one digest."""
    net = FakeNetwork(seed=3, path=PathProfile(delay=50e-6, jitter=10e-6,
                                               loss=Bernoulli(0.05, seed=4)))
    digest = hashlib.sha256()
    then = net.route

    def route(d):
        digest.update(repr((d.departed, d.src, d.dst)).encode())
        digest.update(d.data)
        return then(d)

    net.route = route
    server = net.attach("s", TransferMux(SESSION, config),
                        NodeProfile(up_bps=1e9, down_bps=1e9, queue_datagrams=64))
    work: list = []
    for w in range(3):
        mux = net.attach(f"w{w}", TransferMux(SESSION, config), NodeProfile(up_bps=1e9))
        for m in range(2):
            data = np.random.default_rng(w * 10 + m).integers(0, 255, 200_000, dtype=np.uint8)
            policy = ReliablePolicy() if m == 0 else FixedBoundPolicy(0.9)
            work.append(server.start_receive(f"w{w}", 1, m, 0.0, policy=policy,
                                             nbytes=data.nbytes))
            work.append(mux.start_send("s", 1, m, data, 0.0))
    end = net.run_until_done(work, timeout=30.0)
    digest.update(repr(end).encode())
    return digest.hexdigest(), net.counts["sent"]


#: the digest of that run with no congestion control (first taken before it was
#: written). A change that means to change the datagrams (their layout, the ACK
#: cadence, pacing, PROBE copies or timeouts, the wire version) changes this on
#: purpose: check that change with its own tests, then take the new digest.
DIGEST_BEFORE = "3ee01b00618559175c1442f8391c804d38e9de99c71d4c16d7f1d84c94aa9a88"


def test_off_sends_exactly_the_datagrams_it_sent_before() -> None:
    assert _datagram_digest(TransportConfig()) == (DIGEST_BEFORE, 1567)
    assert _datagram_digest(TransportConfig(congestion="off"))[0] == DIGEST_BEFORE
    # (and the digest sees the difference congestion control makes)
    assert _datagram_digest(TransportConfig(congestion="delay"))[0] != DIGEST_BEFORE


# ------------------------------------------- flows through one bottleneck
def test_random_loss_on_an_uncongested_link_costs_no_rate() -> None:
    """5% random loss on a path with no queue to build (the sender's link as fast as
    the server's): congestion control makes no more cuts than on the same path without
    loss - the loss is read as nothing - and completes as many messages as without
    congestion control."""
    link = SharedLink(rate_bps=100e6, uplink_ratio=1.0, seconds=1.5, settle_s=0.5)
    lossy = run_shared_link(SharedLink(**{**link.__dict__, "loss": 0.05,
                                          "congestion": "delay"}))
    clean = run_shared_link(SharedLink(**{**link.__dict__, "congestion": "delay"}))
    blind = run_shared_link(SharedLink(**{**link.__dict__, "loss": 0.05}))
    assert lossy.cuts == clean.cuts <= 1  # (one: the first pass's unpaced burst)
    assert lossy.messages >= 0.9 * blind.messages > 0
    assert lossy.boundedloss_bps[0] >= 0.9 * blind.boundedloss_bps[0]


def test_a_shared_queue_stays_short_with_congestion_control() -> None:
    """Two senders into a 100 Mbit/s link with a 256 KB queue (21 ms): without
    congestion control each first pass fills it and most of it is dropped; with it,
    the queueing stays near the 0.5 ms target, the senders split the link, and about
    as many messages get through."""
    link = SharedLink(senders=2, queue_bytes=256 * 1024, seconds=2.0, settle_s=0.5)
    off = run_shared_link(link)
    on = run_shared_link(SharedLink(**{**link.__dict__, "congestion": "delay"}))
    assert off.queue_delay_mean > 8e-3
    assert on.queue_delay_mean < off.queue_delay_mean / 10
    assert on.queue_delay_p95 < 4 * LOOP.target_queue_delay
    assert on.queue_drops < off.queue_drops / 10
    assert on.messages >= 0.85 * off.messages
    low, high = sorted(on.boundedloss_bps)
    assert low > 0.8 * high  # (the two share it)


@pytest.mark.parametrize("uplink_ratio", [10.0, 2.0])
def test_beside_a_tcp_flow_each_keeps_a_fair_share(uplink_ratio: float) -> None:
    """A TCP bulk flow (the simulator's model of Linux's) and one boundedloss sender
    through a 100 Mbit/s link with a 64 KB queue, as bench fairness sets them up:
    without congestion control ours leaves TCP nothing; with it, each gets 40% or more
    (a pure delay loop alone would give way to TCP: its floor holds the share) - also
    where the senders' links are only twice the bottleneck's, and the first pass's
    burst waits in the sender's own link long enough to look like a fill."""
    link = SharedLink(tcp=True, seconds=3.0, settle_s=1.0, uplink_ratio=uplink_ratio)
    off = run_shared_link(link)
    on = run_shared_link(SharedLink(**{**link.__dict__, "congestion": "delay"}))
    assert off.tcp_share < 0.1
    assert on.tcp_share >= 0.4 and on.boundedloss_share >= 0.4
    assert sum(on.boundedloss_bps) + on.tcp_bps >= 0.9 * link.rate_bps  # (link used)


def _first_polls_after_a_congested_message(congestion: str) -> tuple[list[int], object, object]:
    """One 1 MB message through a 100 Mbit/s link with a 64 KB queue, then a second to
    the same peer: how many DATA its first polls let out (at once, then when its pacing
    says), and the congestion control of each send's peer path."""
    config = TransportConfig(congestion=congestion)
    net = FakeNetwork(seed=1, path=PathProfile(delay=100e-6))
    rx = net.attach("rx", TransferMux(SESSION, config),
                    NodeProfile(down_bps=100e6, queue_bytes=64 * 1024))
    tx = net.attach("tx", TransferMux(SESSION, config), NodeProfile(up_bps=1e9))
    data = np.zeros(1 << 20, dtype=np.uint8)
    first = [rx.start_receive("tx", 1, 0, 0.0, policy=ReliablePolicy(), nbytes=data.nbytes),
             tx.start_send("rx", 1, 0, data, 0.0)]
    net.run_until_done(first, timeout=10.0)
    second = tx.start_send("rx", 1, 1, data, net.now)
    polls = [len(tx.poll(net.now, 1024))]
    if second.pacer.paced_until is not None:
        polls.append(len(tx.poll(second.pacer.paced_until, 1024)))
    return polls, first[1].path.congestion, second.path.congestion


def test_the_rate_is_the_peers_and_paces_the_next_messages_first_pass() -> None:
    """What the delay loop learned over one message paces the first pass of the next
    one to that peer (a burst no larger than the pacing bucket); without congestion
    control a first pass goes out as fast as the poll takes it."""
    paced, before, after = _first_polls_after_a_congested_message("delay")
    unpaced, none, _ = _first_polls_after_a_congested_message("off")
    assert none is None and before is not None and after is before
    assert isinstance(after, DelayRateControl) and after.rate is not None and after.cuts > 0
    assert unpaced == [750]  # (the whole message at once: 1 MB in 1,400-byte chunks)
    # (an empty bucket at first, then what bucket_time holds at the peer's rate: two
    # datagrams or so at ~100 Mbit/s)
    assert paced[0] == 0 and 1 <= paced[1] <= 4


def test_boundedloss_sim_runs_our_systems_with_congestion_control(tmp_path) -> None:
    """``sim --congestion delay``: the rows say so, and the run is another one (its
    receivers ACK every 16 datagrams at most: more datagrams cross the network)."""
    from boundedloss.cli import main

    def rows(congestion: str) -> list:
        path = tmp_path / f"{congestion}.json"
        assert main(["sim", "--workers", "3", "--systems", "reliable", "--topology", "ps",
                     "--losses", "0.01", "--elements", "200000", "--rounds", "2",
                     "--congestion", congestion, "--json", str(path)]) == 0
        return json.loads(path.read_text())

    off, on = rows("off"), rows("delay")
    assert [r["congestion"] for r in off + on] == ["off", "delay"]
    assert on[0]["sim_datagrams"] > off[0]["sim_datagrams"]


@pytest.mark.skipif(native.status().startswith("python ("),
                    reason=f"compiled data path: {native.status()}")
def test_with_the_compiled_path_taking_the_acks_the_loop_sees_the_same_samples() -> None:
    """Two sending cores, one with the compiled data path attached (which takes the ACKs
    itself), fed the same ACKs - a poll after each - with round trips that grow, then
    shrink: the compiled path's ACKs never reach the Python core, yet its delay loop
    makes the same decisions from the fields the ACKs moved, and the two send the same
    datagrams."""
    config = TransportConfig(chunk_bytes=64, congestion="delay")
    peer, payload = ("10.1.2.3", 4000), np.arange(64 * 2000, dtype=np.int64).view(np.uint8)
    sides = []
    for use_native in (False, True):
        mux = TransferMux(SESSION, config)
        if use_native:
            native.NativeDataPath(mux)
        sides.append((mux, mux.start_send(peer, 3, 7, payload, 0.0)))
    (m0, t0), (m1, t1) = sides
    handed: list[int] = []
    real = m1.datagram_received
    m1.datagram_received = lambda d, p, n: (handed.append(d[3]), real(d, p, n))  # type: ignore

    def sent(mux: TransferMux, now: float) -> list[bytes]:
        out = []
        for item in mux.poll(now, 64, runs=True):
            for parts, _ in (item.datagrams() if isinstance(item, DataRun) else [item]):
                out.append(b"".join(bytes(p) for p in parts))
        return out

    assert sent(m0, 0.0) == sent(m1, 0.0)
    now, every = 0.0, t0.acks.ack_every
    for k in range(1, 40):
        rtt = 100e-6 + (k if k < 20 else 40 - k) * 200e-6  # (queueing builds, then drains)
        tseq = k * every - 1
        now = max(now, t0.pacer.paced_until or now, t1.pacer.paced_until or now) + 1e-4
        ack = wire.control_datagram(t0.message, Kind.ACK, 0, STOP_PAYLOAD.pack(tseq), tseq=tseq)
        m0.datagram_received(ack, peer, now + rtt)
        m1.data_path.take(ack, peer, now + rtt)  # type: ignore[union-attr]
        now += rtt
        assert sent(m0, now) == sent(m1, now)
        c0, c1 = t0.path.congestion, t1.path.congestion
        assert c0 is not None and c1 is not None
        assert (c0.rate, c0.srtt, c0.min_rtt, c0.cuts) == (c1.rate, c1.srtt, c1.min_rtt, c1.cuts)
    assert handed == [] and t1.acks.acks_heard == 39
    assert c0.cuts > 0 and c0.srtt is not None


def test_train_hands_its_congestion_control_to_the_hook_transport() -> None:
    """``train --congestion delay``: every rank's transport runs the delay loop (the
    config a rank is started with carries it); ``off`` by default."""
    from boundedloss.experiments.train import TrainConfig

    assert TrainConfig().transport().congestion == "off"
    cfg = TrainConfig(congestion="delay")
    cfg.validate()
    assert cfg.transport().congestion == "delay"
    assert TrainConfig(**json.loads(json.dumps(dataclasses.asdict(cfg)))).congestion == "delay"
    with pytest.raises(ValueError, match="--congestion: unknown congestion control 'bbr'"):
        TrainConfig(congestion="bbr").validate()


def test_a_send_that_never_opened_holds_no_share_of_the_peers_rate() -> None:
    """A data path that fails to take a new send fails it whole: the peer's rate is
    split among the sends really open, not one more."""

    class Refusing:
        def new_acks(self, peer) -> None:
            return None

        def send_opened(self, sender) -> None:
            raise OSError("refused")

    mux = TransferMux(SESSION, TransportConfig(congestion="delay"))
    mux.data_path = Refusing()  # type: ignore[assignment]
    with pytest.raises(OSError):
        mux.start_send("peer", 1, 1, np.zeros(100, dtype=np.uint8), 0.0)
    congestion = mux.path("peer").congestion
    assert congestion is not None and congestion.senders == 0
    mux.data_path = None
    tx = mux.start_send("peer", 1, 1, np.zeros(100, dtype=np.uint8), 0.0)
    assert congestion.senders == 1
    mux.cancel_send(tx, 0.0)
    assert congestion.senders == 0
