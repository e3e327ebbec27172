"""The endpoint on a simulated network: programs taking turns on the virtual clock
(``net/simulated.py``), and the real collectives running unchanged on it."""

from __future__ import annotations

import dataclasses
import functools
import json
from concurrent import futures
from concurrent.futures import Future

import numpy as np
import pytest

from boundedloss.aggregate import UnbiasedRescale
from boundedloss.collective import TOPOLOGIES, PeerFailure
from boundedloss.net.cpu import CpuCosts
from boundedloss.net.fake import FakeNetwork, NodeProfile, PathProfile
from boundedloss.net.loss import Bernoulli
from boundedloss.net.simulated import SimDeadlock, SimEndpoint, SimFuture, SimRuntime
from boundedloss.policy import parse_policy
from boundedloss.protocol import TransportConfig
from boundedloss.protocol.types import CloseReason, SendStatus
from boundedloss.wire import Kind
from conftest import spawn_transfer, two_racks_with_a_narrow_spine

SESSION = 0x51_3E7D
KEY = bytes(range(32))


def _address(rank: int) -> tuple[str, int]:
    return (f"10.0.0.{rank + 1}", 9000)


def _world(topology: str, world: int, *, loss: float = 0.0, seed: int = 1, rounds: int = 3,
           policy: str = "reliable", elements: int = 20_000, absent: tuple[int, ...] = (),
           deadline: float = 2.0, clock: list | None = None):
    """Run ``rounds`` rounds of ``topology`` among ``world`` simulated ranks (those in
    ``absent`` never run). Returns (virtual end, inputs, per-rank Program); ``clock``
    gets the virtual time the run ended at, however it ended."""
    net = FakeNetwork(seed=seed, path=PathProfile(
        delay=20e-6, loss=Bernoulli(loss, seed=seed) if loss else None))
    rt = SimRuntime(net)
    config = TransportConfig(receive_deadline=deadline, peer_timeout=deadline)
    peers = [_address(r) for r in range(world)]
    eps = [SimEndpoint(rt, peers[r], session=SESSION, auth_key=KEY, config=config,
                       profile=NodeProfile(up_bps=10e9, down_bps=10e9, queue_datagrams=4096))
           for r in range(world)]
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((rounds, world, elements)).astype(np.float32)

    def rank_main(r: int) -> list:
        coll = TOPOLOGIES[topology](eps[r], r, peers, policy=parse_policy(policy).make(),
                                    aggregator=UnbiasedRescale(), session=SESSION)
        try:
            return [coll.allreduce_mean(inputs[t, r], t) for t in range(rounds)]
        finally:
            coll.close()

    programs = [rt.spawn(lambda r=r: rank_main(r), name=f"rank {r}")
                for r in range(world) if r not in absent]
    try:
        end = rt.run()
    finally:
        rt.close()
        if clock is not None:
            clock.append(net.now)
    return end, inputs, programs


@pytest.mark.parametrize("topology", ["ps", "allreduce", "two-level"])
def test_a_reliable_collective_on_the_simulated_network_is_the_exact_mean(topology):
    _, inputs, programs = _world(topology, 4, loss=0.05, policy="reliable")
    for p in programs:
        for t, (out, stats) in enumerate(p.result()):
            np.testing.assert_allclose(out, inputs[t].mean(axis=0), rtol=1e-5, atol=1e-6)
            assert stats.latency_s > 0


@pytest.mark.parametrize("topology", ["ps", "allreduce", "two-level"])
def test_the_same_seed_gives_the_same_run_to_the_bit(topology):
    def run():
        end, _, programs = _world(topology, 4, loss=0.05, policy="dblp")
        return end, [[(out.tobytes(), stats.latency_s, stats.first_pass_loss)
                      for out, stats in p.result()] for p in programs]

    first, again = run(), run()
    assert first == again
    # the run is not trivially lossless: 5% loss met the first passes
    assert any(loss for rank in first[1] for _, _, loss in rank)
    other_end, _, _ = _world(topology, 4, loss=0.05, policy="dblp", seed=2)
    assert other_end != first[0]


def test_a_bounded_round_under_loss_hands_on_what_arrived_within_the_bound():
    _, inputs, programs = _world("allreduce", 4, loss=0.05, policy="mlt:0.2")
    losses = [stats.first_pass_loss for p in programs for _, stats in p.result()]
    assert max(losses) <= 0.2 and max(losses) > 0  # (5% loss met the first passes)


@pytest.mark.parametrize("topology", ["ps", "allreduce"])
def test_a_dead_peer_fails_the_round_within_the_deadline_of_virtual_time(topology):
    clock: list = []
    with pytest.raises(PeerFailure, match="rank 3"):
        _world(topology, 4, absent=(3,), deadline=2.0, clock=clock)
    # the receive deadline, counted from when the round began (t = 0), ended it
    assert 2.0 <= clock[0] <= 2.5


def _pair(loss: float = 0.0, seed: int = 3):
    net = FakeNetwork(seed=seed, path=PathProfile(
        delay=50e-6, loss=Bernoulli(loss, seed=seed) if loss else None))
    rt = SimRuntime(net)
    a = SimEndpoint(rt, _address(0), session=SESSION, auth_key=KEY)
    b = SimEndpoint(rt, _address(1), session=SESSION, auth_key=KEY)
    return net, rt, a, b


def test_a_message_crosses_a_lossy_simulated_network_whole_in_virtual_time():
    net, rt, a, b = _pair(loss=0.05)
    payload = np.arange(1 << 18, dtype=np.float32)
    sent, got = spawn_transfer(rt, a, b, payload)
    end = rt.run()
    res = got.result()
    assert res.complete and res.close_reason == CloseReason.COMPLETE
    assert np.array_equal(res.data.view(np.float32), payload)
    assert sent.result().status == SendStatus.STOPPED
    assert net.counts["path_loss"] > 0 and 0 < end < 1.0
    assert b.counters()["authenticated"] == 1


def test_a_wait_times_out_on_the_virtual_clock():
    net, rt, a, b = _pair()

    def wait_for_nothing():
        fut = b.receive(a.address, message_id=9, nbytes=100)
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.25)
        return rt.now

    p = rt.spawn(wait_for_nothing)
    rt.run(until=10.0)
    assert p.result() == pytest.approx(0.25)


def test_every_program_waiting_on_nothing_is_a_deadlock_not_a_hang():
    _, rt, _, _ = _pair()
    never: SimFuture = SimFuture(rt)
    rt.spawn(never.result, name="stuck")
    with pytest.raises(SimDeadlock, match="stuck"):
        rt.run()
    rt.close()


def test_a_program_that_raises_ends_the_run_with_its_error_and_unwinds_the_others():
    _, rt, a, b = _pair()
    never: SimFuture = SimFuture(rt)
    waiting = rt.spawn(never.result)

    def fail():
        raise ValueError("a bug in a program")

    rt.spawn(fail)
    with pytest.raises(ValueError, match="a bug"):
        rt.run()
    assert waiting.done and waiting.ended  # unwound


def test_programs_spawn_and_join_programs_in_virtual_time():
    net, rt, a, b = _pair()
    order = []

    def child(tag):
        fut = SimFuture(rt)
        net.call_at(rt.now + 0.1 * tag, lambda: fut.set_result(tag))
        order.append(("child", tag, fut.result(), rt.now))

    def parent():
        kids = [rt.spawn(lambda t=t: child(t)) for t in (2, 1)]
        for k in kids:
            k.join()
        order.append(("parent", rt.now))

    rt.spawn(parent)
    rt.run()
    assert order == [("child", 1, 1, pytest.approx(0.1)), ("child", 2, 2, pytest.approx(0.2)),
                     ("parent", pytest.approx(0.2))]


def test_waiting_on_a_simulated_future_outside_a_program_is_refused():
    _, rt, _, _ = _pair()
    with pytest.raises(RuntimeError, match="outside the simulation"):
        SimFuture(rt).result()


def test_a_simulated_future_is_a_future_to_its_callers_without_a_condition_of_its_own():
    _, rt, _, _ = _pair()
    done, failed, cancelled = SimFuture(rt), SimFuture(rt), SimFuture(rt)
    seen = []
    done.add_done_callback(lambda f: seen.append(f.result()))
    assert isinstance(done, Future) and not done.done() and not done.running()
    done.set_result(5)
    failed.set_exception(ValueError("lost"))
    assert cancelled.cancel() and cancelled.cancelled()
    done.add_done_callback(lambda f: seen.append(-f.result()))  # (called at once)
    assert seen == [5, -5] and done.result() == 5 and done.exception() is None
    assert isinstance(failed.exception(), ValueError)
    with pytest.raises(ValueError, match="lost"):
        failed.result()
    assert futures.wait([done, failed], timeout=0).not_done == set()
    assert set(futures.as_completed([done, failed])) == {done, failed}
    assert "finished returned int" in repr(done)


def test_a_closed_endpoint_is_detached_and_what_reaches_it_is_counted_lost():
    net, rt, a, b = _pair()
    b.close()
    payload = np.zeros(5000, dtype=np.uint8)
    sent = rt.spawn(lambda: a.send(b.address, payload, message_id=1).result(timeout=30))
    rt.run()
    assert sent.result().status != SendStatus.STOPPED  # nobody answered
    assert net.counts["no_route"] > 0


def test_boundedloss_sim_prints_rows_and_the_same_seed_writes_the_same_json(tmp_path):
    from boundedloss.cli import main

    def run(seed: int) -> list:
        path = tmp_path / f"sim{seed}.json"
        assert main(["sim", "--workers", "3,5", "--systems", "reliable,mlt:0.05",
                     "--topology", "ps,allreduce", "--losses", "0,0.05", "--elements",
                     "30000", "--rounds", "2", "--seed", str(seed), "--json", str(path)]) == 0
        rows = json.loads(path.read_text())
        for row in rows:
            row.pop("wall_s")  # (the host's time: the one figure that may differ)
        return rows

    rows = run(1)
    assert len(rows) == 2 * 2 * 2 * 2
    assert {(r["workers"], r["system"], r["topology"], r["loss"]) for r in rows} == {
        (w, s, t, p) for w in (3, 5) for s in ("reliable", "mlt:p=0.05")
        for t in ("ps", "allreduce") for p in (0.0, 0.05)}
    assert all(r["p50_ms"] > 0 and r["sim_datagrams"] > 0 for r in rows)
    assert all(r["path_losses"] > 0 for r in rows if r["loss"] > 0)
    assert run(1) == rows
    assert run(2) != rows


@pytest.mark.parametrize("argv, message", [
    (["--workers", "1"], "world sizes must be 2 to 1024"),
    (["--loss-model", "burst:rate=0.8,every=10"], "give them as time windows"),
    (["--loss-model", "bottleneck:rate=100,queue=4"], "a bottleneck is the simulator's"),
    (["--workers", "2,4", "--loss-model", "burst:rate=0.8,window=0.05-0.06,rank=3"],
     "a burst at rank 3, but 2 workers have ranks 0 to 1"),
    (["--loss-model", "burst:rate=0.8,every_s=0.1,len_s=0.2"], "len_s"),
    (["--loss-model", "nonsense:1"], "bad loss spec part"),
    (["--systems", "nccl"], "unknown"),
    (["--topology", "ring"], "'ring': choose from"),
    (["--losses", "1.5"], "loss rates must be in [0, 1)"),
    (["--bottleneck", "fast"], "bad rate 'fast'"),
    (["--bottleneck", "100mbit,32kb,64kb,1"], "give RATE[,BURST[,LIMIT]]"),
])
def test_boundedloss_sim_refuses_a_bad_argument_in_one_line(argv, message, capsys):
    from boundedloss.cli import main

    assert main(["sim", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_bottleneck_in_front_of_the_server_sets_an_incast_round_and_its_drops():
    """--bottleneck: rank 0's downlink becomes a 100 Mbit/s token bucket (32 KB burst,
    64 KB queue) and nothing else changes. Three workers' 100 KB pushes into it take
    their wire time less the burst (the broadcast back leaves through fast links); the
    synchronised first passes overflow its queue - unless the server hands out credit
    that fits it."""
    from boundedloss.emulate.qdisc import Bottleneck
    from boundedloss.sim import SimJob, run_job

    rows = {}
    for credit in (None, 48 * 1024):
        rows[credit] = run_job(SimJob(workers=4, system="reliable", topology="ps", loss=0.0,
                                      elements=25_000, rounds=4, link_gbps=10.0,
                                      bottleneck=Bottleneck("100mbit", "32kb", "64kb"),
                                      credit_bytes=credit, mtu=1500))
    from boundedloss.net.udp import IPV4_UDP_OVERHEAD, largest_chunk
    from boundedloss.protocol.auth import TRAILER_BYTES

    datagram = 1500 - IPV4_UDP_OVERHEAD  # (what the simulator's links carry: UDP payload)
    per_push = -(-25_000 * 4 // largest_chunk(1500, TRAILER_BYTES)) * datagram
    wire_s = (3 * per_push - 32 * 1024) * 8 / 100e6
    credited = rows[48 * 1024]
    assert credited.bottleneck == "tbf rate 100mbit burst 32768 B limit 65536 B"
    assert wire_s * 1e3 <= credited.p50_ms <= 1.25 * wire_s * 1e3
    assert credited.payload_drop_fraction < 0.05
    assert rows[None].queue_drops > 0 and rows[None].payload_drop_fraction > 0.2
    plain = run_job(SimJob(workers=4, system="reliable", topology="ps", loss=0.0,
                           elements=25_000, rounds=4, link_gbps=10.0, mtu=1500))
    assert plain.p50_ms < 0.2 * credited.p50_ms and plain.bottleneck == ""


def test_cores_place_work_in_the_first_gap_long_enough_on_the_core_free_first():
    from boundedloss.net.cpu import Cores

    cores = Cores(2)
    assert cores.run(0.0, 1.0, now=0.0) == 1.0  # core 0: [0, 1]
    assert cores.run(0.0, 1.0, now=0.0) == 1.0  # core 1: [0, 1]
    assert cores.run(0.5, 1.0, now=0.0) == 2.0  # both busy until 1
    assert cores.run(3.0, 1.0, now=0.0) == 4.0  # core 1 (free from 1): [3, 4]
    assert cores.run(1.0, 2.0, now=0.0) == 3.0  # fits before [3, 4] on core 1: [1, 3]
    assert cores.run(1.0, 0.5, now=0.0) == 2.5  # core 0's [1, 2] is taken: from 2
    assert cores.charged == 6.5  # (what ran, wherever and whenever it ran)
    with pytest.raises(ValueError):
        Cores(0)


def test_interference_takes_its_share_of_a_core_and_is_the_same_for_the_same_seed():
    from boundedloss.net.cpu import Cores, Interference

    spec = Interference(rate_hz=20.0, mean_s=5e-3)  # 9.1% of a core in the long run

    def back_to_back(seed: tuple[int, ...], pieces: int = 20_000) -> list[float]:
        cores, t, ends = Cores(1, spec, seed=seed), 0.0, []
        for _ in range(pieces):  # 1 ms pieces of work, each ready when the last is done
            t = cores.run(t, 1e-3, now=t)
            ends.append(t)
        assert cores.charged == pytest.approx(pieces * 1e-3)  # (lost time is not charged)
        return ends

    ends = back_to_back((1,))
    # 20 s of work takes 20 s / (1 - share), give or take the draw (about 0.7% here)
    assert ends[-1] == pytest.approx(20.0 / (1 - spec.share), rel=0.03)
    assert back_to_back((1,)) == ends
    assert back_to_back((2,)) != ends
    # none, or a rate of 0, loses nothing
    for off in (None, Interference(0.0, 0.0), Interference.parse("off")):
        cores = Cores(1, off)
        assert cores.run(0.0, 5.0, now=0.0) == 5.0 and cores.interfered == 0.0


def test_work_on_shared_cores_goes_to_the_core_that_interference_leaves_free():
    from boundedloss.net.cpu import Cores, Interference

    spec = Interference(rate_hz=20.0, mean_s=5e-3)
    cores = Cores(2, spec, seed=(7,))
    t = 0.0
    for _ in range(20_000):  # one thread's work, on whichever core is free first
        t = cores.run(t, 1e-3, now=t)
    # a spell holds one core at a time: the other takes the work (a spell on both at
    # once, or one in the middle of a piece, is what it still loses)
    assert 20.0 < t < 20.0 / (1 - spec.share ** 2 * 4)
    assert cores.interfered > 1.0


@pytest.mark.parametrize("text", ["20", "20,3,1", "a,b", "-1,3", "20,inf", ""])
def test_interference_refuses_what_is_not_a_rate_and_a_mean(text):
    from boundedloss.net.cpu import Interference

    with pytest.raises(ValueError):
        Interference.parse(text)


def test_a_job_s_rounds_spread_with_interference_and_stay_the_same_for_a_seed():
    """A lossless job on shared cores: with interference its rounds take longer and
    spread further (100 spells of 2 ms a second: 17% of each core) - the same for the
    same seed."""
    from boundedloss.net.cpu import Interference
    from boundedloss.sim import CPU_PRESETS, SimJob, run_job

    job = SimJob(workers=4, system="reliable", topology="allreduce", loss=0.0,
                 elements=50_000, rounds=40, mtu=1500, cpu="this-machine",
                 cpu_interference=Interference(0.0, 0.0))
    flat = run_job(job)
    assert flat.cpu_interference == ""
    noisy = dataclasses.replace(job, cpu_interference=Interference(100.0, 2e-3))
    a, b = run_job(noisy), run_job(noisy)
    assert a.cpu_interference == "100/s x 2 ms"
    assert a.p50_ms > 1.1 * flat.p50_ms and a.p99_ms > flat.p99_ms + 2.0
    assert (a.p50_ms, a.p99_ms, a.mean_ms) == (b.p50_ms, b.p99_ms, b.mean_ms)
    # the same CPU charged: interference takes time, not work (but for the few control
    # datagrams that other timings make: 92 of 36,880 here, a few microseconds each)
    assert abs(a.sim_datagrams - flat.sim_datagrams) < 0.01 * flat.sim_datagrams
    assert a.cpu_ms_per_round == pytest.approx(flat.cpu_ms_per_round, rel=1e-3)
    # the preset's, unless the job says otherwise; a preset without (cluster-node) has none
    preset = dataclasses.replace(job, cpu_interference=None)
    assert preset.interference() == CPU_PRESETS["this-machine"].interference
    assert dataclasses.replace(preset, cpu="cluster-node").interference() is None


def test_cores_say_when_every_one_of_them_is_busy():
    from boundedloss.net.cpu import Cores

    cores = Cores(2)
    cores.run(0.0, 1.0, now=0.0)  # core 0: [0, 1]
    assert not cores.all_busy(0.5)
    cores.run(0.5, 1.0, now=0.0)  # core 1: [0.5, 1.5]
    assert cores.all_busy(0.5) and cores.all_busy(0.99)
    assert not cores.all_busy(0.25) and not cores.all_busy(1.0) and not cores.all_busy(2.0)


def test_our_hosts_woken_on_busy_cores_run_later_and_tcp_hosts_take_no_notice():
    """``wake_s``: a rank's I/O thread, asleep when a datagram arrives on busy cores,
    runs that much later - a loss's recovery waits on such wakes. A TCP host's kernel
    takes its segments itself: its rows do not move."""
    from boundedloss.sim import SimJob, run_job

    def row(system: str, wake_s: float | None):
        return run_job(SimJob(workers=4, system=system, topology="allreduce", loss=0.01,
                              elements=50_000, rounds=10, mtu=1500, cpu="this-machine",
                              cpu_wake_s=wake_s))

    prompt, woken = row("reliable", 0.0), row("reliable", 2e-3)
    assert woken.p50_ms > prompt.p50_ms + 1.0 and woken.cpu_wake_ms == 2.0
    assert prompt.cpu_wake_ms == 0.0
    assert row("reliable", None).cpu_wake_ms == 0.0  # (the preset's: none)
    gloo = row("gloo", 0.0)
    assert dataclasses.replace(row("gloo", 2e-3), wall_s=0) == dataclasses.replace(gloo, wall_s=0)
    assert gloo.cpu_wake_ms == 0.0


def test_a_host_s_cpu_costs_set_its_pace_and_shared_cores_slow_every_host():

    costs = CpuCosts(byte_out=1e-9, byte_in=1e-9, message_main=1e-3, message_io=1e-3)
    payload = np.zeros(1 << 20, dtype=np.uint8)

    def exchange(cpu: CpuCosts | None, shared: int | None) -> float:
        net = FakeNetwork(seed=0, path=PathProfile(delay=1e-6), shared_cores=shared)
        rt = SimRuntime(net)
        eps = [SimEndpoint(rt, _address(r), session=SESSION, profile=NodeProfile(cpu=cpu))
               for r in range(4)]
        for r in range(4):  # each host sends to the next and receives from the one before
            ep, nxt, prev = eps[r], eps[(r + 1) % 4], eps[(r - 1) % 4]
            rt.spawn(lambda ep=ep, nxt=nxt: ep.send(nxt.address, payload,
                                                   message_id=1).result())
            rt.spawn(lambda ep=ep, prev=prev: ep.receive(prev.address, message_id=1,
                                                        nbytes=payload.nbytes).result())
        return rt.run()

    free = exchange(None, None)
    own = exchange(costs, None)
    shared = exchange(costs, 2)
    # each host sends and takes in 1 MB: at least ~2.1 ms of its own CPU, and 2 cores
    # for 4 hosts take about twice as long
    assert free < 1e-3 < 2.1e-3 < own < shared
    assert 1.6 < shared / own < 2.4


@pytest.mark.parametrize("compiled", [True, False])
def test_each_datagram_the_python_core_handles_costs_its_i_o_thread(compiled, monkeypatch):
    """``datagram_core`` is charged for each datagram that reaches the Python core: with
    the compiled path a message's closing DATA and its STOP, plus (under loss) the
    retransmissions' BITMAPs; without it, every datagram. Each costs its I/O thread
    that long before it goes on, so a transfer takes longer by about what they cost."""
    from boundedloss.net import native

    if compiled and not native.enabled():
        pytest.skip(f"compiled data path: {native.status()}")
    if not compiled:
        monkeypatch.setenv("BOUNDEDLOSS_NATIVE", "0")
    payload = np.zeros(100_000, dtype=np.uint8)  # 72 chunks of the default 1,400 bytes
    cost = 1e-3

    def transfer(datagram_core: float, loss: float) -> tuple[float, int]:
        net = FakeNetwork(seed=3, path=PathProfile(delay=1e-6))
        if loss:  # (chosen by chunk, not by a draw per datagram: the charges reorder
            # what the hosts send, and a draw could then take a PROBE and add a timeout)
            every = round(1 / loss)
            net.route = lambda d: () if (
                d.kind == Kind.DATA and d.header.tseq < 72 and d.header.index % every == 3
            ) else net.default_route(d)
        rt = SimRuntime(net)
        profile = NodeProfile(cpu=CpuCosts(datagram_core=datagram_core))
        a, b = (SimEndpoint(rt, _address(r), session=SESSION, profile=profile)
                for r in range(2))
        assert (a.data_path is not None) is compiled
        _, got = spawn_transfer(rt, a, b, payload)
        end = rt.run()
        assert got.result().complete
        return end, a.mux.core_datagrams + b.mux.core_datagrams

    for loss in (0.0, 0.1):
        free, _ = transfer(0.0, loss)
        charged, handed = transfer(cost, loss)
        assert handed >= 2  # (the closing DATA and the STOP at least)
        if compiled:
            assert handed < 72 if loss == 0 else handed >= 3
        else:
            assert handed > 72
        # (a charge the other host's thread waits out lengthens the transfer; one spent
        # while its own datagrams are on the way need not)
        # at least half of them hold up the transfer (the receiver's, before its STOP)
        assert cost * handed / 2 - 1e-9 <= charged - free <= cost * handed + 1e-4


def _tcp_world(world: int, loss: float = 0.0, seed: int = 0, rate: float = 10e9,
               cpu: CpuCosts | None = None):
    from boundedloss.sim.baselines import SimTcp

    net = FakeNetwork(seed=seed, path=PathProfile(
        delay=5e-6, loss=Bernoulli(loss, seed=seed) if loss else None))
    rt = SimRuntime(net)
    profile = NodeProfile(up_bps=rate, down_bps=rate, queue_datagrams=1024, cpu=cpu)
    return net, rt, [SimTcp(rt, _address(r), 9000, profile) for r in range(world)]


def _forty_segments(lose) -> tuple:
    """40 full segments from one host to another, each of the sender's DATA segments
    (by index) that ``lose(index, sender_stack)`` names lost: the sender's stack and the
    virtual time the stream ended."""
    from boundedloss.sim.tcp import segment_index

    net, rt, (a, b) = _tcp_world(2)

    def route(d):
        if d.src == a.address and len(d.data) > 1000 and lose(segment_index(d.data), a.stack):
            return ()
        return net.default_route(d)

    net.route = route
    nbytes = 40 * b.stack.mss
    rt.spawn(lambda: a.send(b.address, nbytes).result())
    rt.spawn(lambda: b.recv(a.address, nbytes).result())
    return a.stack, rt.run()


def test_the_tcp_model_carries_a_stream_at_the_link_rate_and_recovers_every_loss():
    net, rt, (a, b) = _tcp_world(2, loss=0.05)
    nbytes = 3_000_001  # (a short last segment)
    sent = rt.spawn(lambda: a.send(b.address, nbytes).result())
    got = rt.spawn(lambda: b.recv(a.address, nbytes).result())
    end = rt.run()
    sent.result(), got.result()
    conn = b.stack.connection(a.address)
    assert conn.received_bytes == nbytes and not conn.ooo
    assert a.stack.retransmits > 0 and net.counts["path_loss"] > 0
    assert end > nbytes * 8 / 10e9  # (no faster than the link)
    # lossless, it runs at the link's rate plus slow start's few round trips
    _, rt2, (a2, b2) = _tcp_world(2)
    rt2.spawn(lambda: a2.send(b2.address, nbytes).result())
    rt2.spawn(lambda: b2.recv(a2.address, nbytes).result())
    assert nbytes * 8 / 10e9 < rt2.run() < 1.2 * nbytes * 8 / 10e9 + 1e-3
    assert a2.stack.retransmits == 0 and a2.stack.timeouts == 0


def test_a_lost_tail_is_recovered_by_a_probe_before_the_retransmission_timeout():
    from boundedloss.sim.tcp import MIN_RTO

    dropped: list[int] = []

    def the_last_two_once(index, stack):
        if index in (38, 39) and index not in dropped:
            dropped.append(index)
            return True
        return False

    stack, end = _forty_segments(the_last_two_once)
    # no ACK comes back for either: the probe (segment 39 again) brings one, and RACK
    # then finds 38 lost - milliseconds, not the 200 ms timeout
    assert sorted(dropped) == [38, 39] and stack.probes == 1 and stack.timeouts == 0
    assert end < MIN_RTO / 10

def test_a_lone_lost_last_segment_waits_as_long_as_the_timeout_as_linux_s_does():
    from boundedloss.sim.tcp import MIN_RTO

    stack, end = _forty_segments(lambda index, stack: index == 39 and stack.retransmits == 0)
    # one segment outstanding: the probe would wait longer than the timeout, so it goes
    # when the timeout would have (Linux's loss-probe timer, capped at the RTO's), and its
    # copy of the segment ends the transfer - a probe, not a timeout, in the counts
    assert MIN_RTO < end < 1.1 * MIN_RTO
    assert (stack.probes, stack.timeouts) == (1, 0)
    # its copy lost too: the timeout, restarted from the probe, sends it again
    stack, end = _forty_segments(lambda index, stack: index == 39 and stack.timeouts == 0)
    assert (stack.probes, stack.timeouts) == (1, 1)
    assert 2 * MIN_RTO < end < 2.2 * MIN_RTO

def test_in_recovery_the_window_comes_down_in_step_with_what_is_delivered():
    """Proportional rate reduction (RFC 6937, Linux's tcp_cwnd_reduction): above
    ssthresh, ssthresh / prior window segments sent per segment delivered; at or below
    it, back up to ssthresh no faster than slow start would."""
    from boundedloss.sim.tcp import _Connection

    conn = _Connection(("10.0.0.2", 1), 1448)
    conn.sizes = [1448] * 40
    conn.una, conn.nxt = 0, 20
    conn.ssthresh, conn.prior_cwnd, conn.recover = 14.0, 20.0, 20
    conn.sacked, conn.lost_set = {3}, {2}
    conn.reduce_window(1)  # pipe 18 > 14: ceil(1 x 14 / 20) - 0 = 1 more
    assert conn.cwnd == 19
    conn.prr_out, conn.nxt = 1, 21  # (it sent that one)
    conn.sacked.add(4)
    conn.reduce_window(1)  # pipe 18: ceil(2 x 14 / 20) - 1 = 1 more
    assert conn.cwnd == 19
    conn.sacked.update(range(5, 13))
    conn.prr_delivered, conn.prr_out = 9, 7
    conn.reduce_window(1)  # pipe 10 <= 14: min(14 - 10, max(10 - 7, 1) + 1) = 4
    assert conn.cwnd == 14


def test_a_ring_allreduce_over_tcp_takes_2_n_minus_1_steps_of_a_chunk_each():
    from boundedloss.sim.baselines import ring_allreduce

    n, nbytes, rate = 4, 4 << 20, 10e9
    _, rt, tcp = _tcp_world(n, rate=rate)
    for r in range(n):
        rt.spawn(lambda r=r: ring_allreduce(tcp, r, nbytes))
    end = rt.run()
    ideal = 2 * (n - 1) * (nbytes / n) * 8 / rate  # each link busy every step
    assert ideal < end < 1.3 * ideal
    assert all(t.stack.retransmits == 0 for t in tcp)


def test_boundedloss_sim_runs_gloo_and_tcp_ps_on_their_own_topologies(tmp_path):
    from boundedloss.cli import main

    path, plot = tmp_path / "sim.json", tmp_path / "scaling.png"
    assert main(["sim", "--workers", "2,3", "--systems", "gloo,tcp-ps,reliable",
                 "--topology", "allreduce", "--losses", "0,0.02", "--elements", "100000",
                 "--rounds", "3", "--json", str(path), "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(path.read_text())
    assert {(r["workers"], r["system"], r["topology"], r["loss"]) for r in rows} == {
        (w, s, t, p) for s, t in (("gloo", "gloo"), ("tcp-ps", "ps"), ("reliable", "allreduce"))
        for p in (0.0, 0.02) for w in (2, 3)}
    assert all(r["p50_ms"] > 0 for r in rows)
    # the TCP model's recovery, per round, as bench kernel-loss reads Linux's: nothing to
    # recover without loss, retransmissions at 2% (of data segments or their ACKs: some
    # of the losses need none); ours have no TCP
    for r in rows:
        counts = [r[f"tcp_{c}_per_round"] for c in ("timeouts", "loss_probes", "retrans_segs")]
        if r["system"] == "reliable":
            assert counts == [None] * 3
        elif r["loss"] == 0:
            assert counts == [0, 0, 0]
        else:
            assert r["path_losses"] > 0 and r["tcp_retrans_segs_per_round"] > 0


def test_a_ring_allreduce_over_tcp_pays_its_hosts_cpu():
    from boundedloss.sim.baselines import ring_allreduce

    n, nbytes = 4, 4 << 20
    steps, chunk = 2 * (n - 1), nbytes // n
    costs = CpuCosts(byte_out=4e-9, byte_in=1e-9, message_main=1e-3)
    ends = []
    for cpu in (None, costs):
        _, rt, tcp = _tcp_world(n, cpu=cpu)
        for r in range(n):
            rt.spawn(functools.partial(ring_allreduce, tcp, r, nbytes))
        ends.append(rt.run())
    # each host's one core: its segments out and in, and a send and a receive a step
    work = steps * chunk * (costs.byte_out + costs.byte_in) + 2 * steps * costs.message_main
    assert work < ends[1] < ends[0] + 1.3 * work


def test_like_testbed_simulates_the_baselines_with_tcp_s_measured_costs(tmp_path):
    from boundedloss.cli import main
    from boundedloss.sim import SimJob, run_job
    from boundedloss.sim.job import MEASURED_TCP_COSTS

    path = tmp_path / "sim.json"
    assert main(["sim", "--like-testbed", "--workers", "4", "--systems", "gloo",
                 "--losses", "0", "--elements", "262144", "--rounds", "3",
                 "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())
    free = run_job(SimJob(workers=4, system="gloo", topology="allreduce", loss=0.0,
                          elements=262144, rounds=3, mtu=1500, link_gbps=100.0))
    assert row["cpu"] == "this-machine" and MEASURED_TCP_COSTS.message_main > 0
    # (at 100 Gb/s the wire takes 0.1 ms of the round: the rest is the CPU's)
    assert row["p50_ms"] > 10 * free.p50_ms
    # the row says what its hosts' CPU was charged a round: the round is that work on
    # the testbed's 2 shared cores, all but the wire's share of it
    assert free.cpu_ms_per_round is None
    assert 0.8 * 2 * row["mean_ms"] < row["cpu_ms_per_round"] <= 2 * row["mean_ms"]


def test_a_program_unwound_while_its_cleanup_waits_ends():
    _, rt, _, _ = _pair()
    never: SimFuture = SimFuture(rt)

    def waits_in_its_cleanup():
        try:
            never.result()
        finally:
            SimFuture(rt).result()  # (as a collective's close() waits on its sends)

    stuck = rt.spawn(waits_in_its_cleanup)

    def fail():
        raise ValueError("a bug in a program")

    rt.spawn(fail)
    with pytest.raises(ValueError):
        rt.run()
    assert stuck.done and stuck.ended


def test_a_lost_probe_leaves_the_tail_to_the_timeout_one_probe_a_tail():
    from boundedloss.sim.tcp import MIN_RTO

    stack, end = _forty_segments(lambda index, stack: index in (38, 39) and stack.timeouts == 0)
    assert stack.probes == 1 and stack.timeouts == 1
    assert MIN_RTO < end < 1.2 * MIN_RTO

def test_a_segment_takes_as_many_bytes_of_the_link_as_the_packet_it_stands_for():
    from boundedloss.net.udp import largest_chunk
    from boundedloss.wire import HEADER_BYTES

    net, rt, (a, b) = _tcp_world(2)
    sizes = []

    def measure(d):
        sizes.append(len(d.data))
        return net.default_route(d)

    net.route = measure
    rt.spawn(lambda: a.send(b.address, 3 * a.stack.mss).result())
    rt.spawn(lambda: b.recv(a.address, 3 * a.stack.mss).result())
    rt.run()
    # a full segment is an MTU-sized packet, counted as our datagrams are (no IP/UDP):
    # as many bytes as our full chunk's datagram at that MTU
    assert max(sizes) == largest_chunk(9000) + HEADER_BYTES


def test_a_detached_host_s_undelivered_datagrams_keep_the_counts_balanced():

    payload = np.zeros(200_000, dtype=np.uint8)
    for cpu in (None, CpuCosts(datagram_in=1e-3)):
        net = FakeNetwork(seed=0, path=PathProfile(delay=1e-6))
        rt = SimRuntime(net)
        a = SimEndpoint(rt, _address(0), session=SESSION,
                        config=TransportConfig(peer_timeout=0.05),
                        profile=NodeProfile(up_bps=1e8))  # (16 ms for the message)
        b = SimEndpoint(rt, _address(1), session=SESSION, profile=NodeProfile(cpu=cpu))
        sent = rt.spawn(functools.partial(
            lambda a, b: a.send(b.address, payload, message_id=1).result(), a, b))
        net.call_at(3e-3, b.close)  # (with datagrams still waiting for its I/O thread)
        rt.run()
        c = net.counts
        assert c["sent"] + c["duplicated"] == (c["no_route"] + c["path_loss"] + c["queue_drop"]
                                               + c["node_loss"] + c["delivered"])
        assert c["no_route"] > 0 and sent.result().status == SendStatus.PEER_SILENT


def test_a_closed_endpoint_with_cpu_costs_refuses_a_post_as_any_closed_one():
    from boundedloss.protocol import TransportError

    net = FakeNetwork(seed=0)
    rt = SimRuntime(net)
    a = SimEndpoint(rt, _address(0), session=SESSION,
                    profile=NodeProfile(cpu=CpuCosts(message_main=1e-3)))
    a.close()

    def post():
        with pytest.raises(TransportError, match="closed"):
            a.receive(_address(1), message_id=1, nbytes=10)

    rt.spawn(post)
    rt.run()


def test_a_wait_that_ended_leaves_no_timer_behind_to_hold_off_a_deadlock():
    _, rt, _, _ = _pair()
    done: SimFuture = SimFuture(rt)
    never: SimFuture = SimFuture(rt)

    def program():
        rt.network.call_at(0.001, lambda: done.set_result(None))
        done.result(timeout=1000.0)  # (its 1,000 s timeout must not linger)
        never.result()

    rt.spawn(program)
    with pytest.raises(SimDeadlock):
        rt.run()
    assert rt.now < 1.0
    rt.close()


def test_a_timeout_cancelled_after_it_fired_is_not_counted_as_a_call_to_come():
    """(the network counts cancelled calls to tell work to come from none: a timeout
    whose future resolves after it fired is cancelled too late to count)"""
    _, rt, _, _ = _pair()
    late: SimFuture = SimFuture(rt)

    def program() -> float:
        rt.network.call_at(0.002, lambda: late.set_result(None))
        with pytest.raises(TimeoutError):
            late.result(timeout=0.001)
        rt.sleep_until(0.005)  # (a call still to come when the timeout is cancelled)
        return rt.now

    done = rt.spawn(program)
    rt.run()
    assert done.result() == 0.005


def test_boundedloss_sim_runs_a_loss_model_on_every_path_for_every_system(tmp_path):
    from boundedloss.cli import main

    path = tmp_path / "sim.json"
    spec = "burst:rate=0.9,window=0.0005-0.004"
    assert main(["sim", "--workers", "3", "--systems", "gloo,reliable", "--topology",
                 "allreduce", "--losses", "0", "--loss-model", spec, "--elements", "100000",
                 "--rounds", "3", "--json", str(path)]) == 0
    rows = {(r["system"], r["loss_model"]): r for r in json.loads(path.read_text())}
    assert set(rows) == {(s, m) for s in ("gloo", "reliable") for m in ("", spec)}
    for system in ("gloo", "reliable"):  # the burst met both alike, and nothing else did
        assert rows[(system, spec)]["path_loss_fraction"] > 0
        assert rows[(system, "")]["path_loss_fraction"] == 0
        assert rows[(system, spec)]["p99_ms"] > rows[(system, "")]["p99_ms"]


def test_a_burst_at_one_rank_meets_what_arrives_at_its_host_alone(tmp_path):
    """``rank=`` on a burst in time: the kernel testbed's timed microbursts at a node (the
    demo's, at the server) - what arrives at that rank's host is lost there (counted
    ``node_losses``), for gloo's segments and our datagrams alike; the paths keep the
    rest of the spec. Recurring bursts do not phase-lock with TCP's timers: a round of
    the TCP baselines stays within a few retransmission timeouts. (40 rounds: one round
    of ours with a timeout under the 1% alone, as the first may have, outweighs what
    the bursts cost 20.)"""
    from boundedloss.cli import main

    path = tmp_path / "sim.json"
    at_server = "bernoulli:0.01+burst:rate=0.8,every_s=0.05,len_s=0.005,rank=0"
    on_paths = "bernoulli:0.01"
    assert main(["sim", "--workers", "3", "--systems", "gloo,tcp-ps,reliable", "--topology",
                 "ps", "--losses", "0", "--loss-model", at_server, "--loss-model", on_paths,
                 "--elements", "1000000", "--rounds", "40", "--link-gbps", "1",
                 "--json", str(path)]) == 0
    rows = {(r["system"], r["loss_model"]): r for r in json.loads(path.read_text())}
    for system in ("gloo", "tcp-ps", "reliable"):
        burst, plain = rows[(system, at_server)], rows[(system, on_paths)]
        assert burst["node_losses"] > 0 and plain["node_losses"] == 0
        assert burst["path_losses"] > 0  # (the 1% stays on every path)
        assert burst["mean_ms"] > plain["mean_ms"]
        assert burst["burst_rounds"] > 0  # (rounds this long meet one most times)
        assert plain["burst_rounds"] == 0 and plain["burst_over_normal_round"] is None
        # (phase-locked, TCP's retries met a burst every time: rounds of hours)
        assert burst["max_ms"] < 20_000
    assert rows[("reliable", at_server)]["max_ms"] < rows[("tcp-ps", at_server)]["max_ms"]


def test_a_row_sets_the_rounds_that_met_a_burst_against_the_others():
    """As compare reports a burst round against a normal one: the rounds whose span
    overlapped a burst in time (at a host or on the paths), their mean, the others'
    median, and the one over the other."""
    from boundedloss.sim import SimJob, run_job

    spec = "burst:rate=0.8,every_s=0.02,len_s=0.002,rank=0"
    rows = {system: run_job(SimJob(workers=4, system=system, topology="ps", loss=0.0,
                                   loss_model=spec, elements=50_000, rounds=80))
            for system in ("tcp-ps", "reliable")}
    for row in rows.values():
        assert 0 < row.burst_rounds < row.rounds
        assert row.burst_round_ms_mean > row.normal_round_ms_p50 > 0
        assert row.burst_over_normal_round == pytest.approx(
            row.burst_round_ms_mean / row.normal_round_ms_p50, rel=1e-3)
    # a burst costs TCP's stream its timeouts, ours a PROBE's round trip
    assert (rows["tcp-ps"].burst_over_normal_round
            > 5 * rows["reliable"].burst_over_normal_round)


def test_a_link_to_the_spine_serialises_and_drops_beyond_its_queue():
    from boundedloss.net.fabric import Link

    link = Link(bps=8e6, queue=2)  # (a 1,000-byte datagram takes 1 ms)
    assert link.offer(0.0, 1000) == pytest.approx(0.001)
    assert link.offer(0.0, 1000) == pytest.approx(0.002)
    assert link.offer(0.0, 1000) is None  # two wait already
    assert link.offer(0.0015, 1000) == pytest.approx(0.003)  # the first has left


def test_traffic_between_racks_shares_the_spine_and_traffic_within_does_not():
    from boundedloss.sim import SimJob, run_job

    def round_ms(racks: int, topology: str, system: str = "reliable") -> float:
        return run_job(SimJob(workers=8, system=system, topology=topology, loss=0.0,
                              elements=200_000, rounds=2, racks=racks,
                              oversubscription=4.0)).p50_ms

    one = round_ms(1, "allreduce")
    two = round_ms(2, "allreduce")
    # half of every rank's shards cross a spine link of 4 hosts' links over 4: slower
    assert two > 1.5 * one
    # gloo's ring crosses the spine at two links of eight: barely slower
    ring_one = round_ms(1, "gloo", "gloo")
    ring_two = round_ms(2, "gloo", "gloo")
    assert ring_two < 1.3 * ring_one


def test_the_counts_balance_with_drops_at_the_spine():
    net = FakeNetwork(seed=0)
    rt, a, b = two_racks_with_a_narrow_spine(net, SESSION, _address)
    payload = np.zeros(300_000, dtype=np.uint8)
    _, got = spawn_transfer(rt, a, b, payload)
    rt.run()
    net.run(until=net.now + 1.0)  # (what is still on its way arrives)
    c = net.counts
    assert got.result().complete and c["fabric_drop"] > 0
    assert c["sent"] + c["duplicated"] == (c["no_route"] + c["path_loss"] + c["fabric_drop"]
                                           + c["queue_drop"] + c["node_loss"] + c["delivered"])


def test_this_machine_s_cpu_preset_is_the_calibration_s_measurement():
    """The preset's figures are the ones benchmarks/ holds, as measured - not retyped."""
    import dataclasses
    from pathlib import Path

    from boundedloss.net.cpu import CpuCosts
    from boundedloss.sim.job import MEASURED_COSTS, MEASURED_TCP_COSTS, costs_across_mtus

    benchmarks = Path(__file__).parent.parent / "benchmarks"
    ours = costs_across_mtus(*(
        (mtu, CpuCosts(**json.loads(
            (benchmarks / f"sim-calibration-{mtu}-d.json").read_text())["costs"]))
        for mtu in (1500, 9000)))
    tcp_fit = json.loads((benchmarks / "tcp-costs-perf-both.json").read_text())
    for preset, measured in ((MEASURED_COSTS, dataclasses.asdict(ours)),
                             (MEASURED_TCP_COSTS, tcp_fit["tcp_costs"])):
        for name, value in dataclasses.asdict(preset).items():
            assert value == pytest.approx(measured[name], rel=0.005, abs=1e-12), name


@pytest.mark.parametrize(("topology", "system", "credit"), [
    ("allreduce", "dblp", None), ("ps", "reliable", 48 * 1024), ("ps", "ltp", None)])
def test_a_simulated_job_gives_the_same_rows_on_the_compiled_path_and_the_python_one(
        topology, system, credit, monkeypatch):
    """Every host runs the compiled data path where it is built: the same datagrams as
    the Python reference (test_native.py holds them to it message by message), so a
    whole lossy, authenticated job - incast, credit, early closes - gives the same rows
    either way, only faster."""
    import dataclasses

    from boundedloss.net import native
    from boundedloss.sim import SimJob, run_job

    if not native.enabled():
        pytest.skip(f"compiled data path: {native.status()}")
    job = SimJob(workers=6, system=system, topology=topology, loss=0.03, elements=150_000,
                 rounds=3, queue_datagrams=48, credit_bytes=credit)

    def row() -> dict:
        return {k: v for k, v in dataclasses.asdict(run_job(job)).items() if k != "wall_s"}

    compiled = row()
    monkeypatch.setenv("BOUNDEDLOSS_NATIVE", "0")
    python = row()
    assert compiled == python
    assert compiled["path_losses"] > 0  # (a lossy run: recovery took part)


def test_cancel_ends_that_receive_alone_and_forgets_every_future_it_resolved():
    _, rt, a, b = _pair()
    payload = np.arange(4096, dtype=np.float32)

    def program():
        posted = [b.receive(a.address, message_id=m, nbytes=payload.nbytes) for m in (1, 2, 3)]
        b.cancel(posted[1])
        assert posted[1].result().close_reason == CloseReason.CANCELLED
        assert not posted[0].done() and not posted[2].done()
        b.cancel(posted[1])  # (done already: nothing happens)
        for m in (1, 3):
            a.send(b.address, payload, message_id=m).result()
        return [f.result() for f in posted]

    p = rt.spawn(program)
    rt.run()
    first, _, third = p.result()
    assert first.complete and third.complete
    assert b._futures == {} and b._transfer_of == {}  # noqa: SLF001


def test_a_run_holds_off_full_collections_and_restores_the_thresholds():
    import gc

    _, rt, _, _ = _pair()
    before = gc.get_threshold()
    seen = rt.spawn(gc.get_threshold)
    rt.run()
    assert seen.result()[2] >= 10 ** 9 and gc.get_threshold() == before

    def fail():
        raise ValueError("a bug in a program")

    rt.spawn(fail)
    with pytest.raises(ValueError):
        rt.run()
    assert gc.get_threshold() == before


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_what_a_waited_future_held_is_freed_with_it_not_left_to_a_full_collection(timeout):
    # (a run holds off full collections: a future in a reference cycle would keep its
    # result - a receive's buffer - until the run ends, and memory would grow by a
    # round's receives every round)
    import gc
    import weakref

    class Payload:
        pass

    net, rt, _, _ = _pair()
    seen: list = []

    def wait_for_one():
        fut = SimFuture(rt)
        net.call_at(rt.now + 0.1, lambda: fut.set_result(Payload()))
        seen.append(weakref.ref(fut.result(timeout=timeout)))

    gc.disable()
    try:
        rt.spawn(wait_for_one)
        rt.run()
        assert seen and seen[0]() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("topology", ["ps", "allreduce", "two-level"])
def test_a_job_s_last_round_posts_no_next_round_where_posting_costs_nothing(topology,
                                                                            monkeypatch):
    # (what nothing would use: left out where it moves no virtual time - the rows the
    # same as with it - and kept where the hosts' CPU pays for posting)
    from boundedloss.collective.base import Collective
    from boundedloss.sim.job import SimJob, run_job

    posted_for: list[int] = []
    post_many = Collective._post_many  # noqa: SLF001 - counted where it is called

    def counting(self, nbytes, bucket, phase, round_id, *args, **kwargs):
        posted_for.append(round_id)
        return post_many(self, nbytes, bucket, phase, round_id, *args, **kwargs)

    monkeypatch.setattr(Collective, "_post_many", counting)
    job = SimJob(workers=6, system="dblp", topology=topology, loss=0.02, elements=20_000,
                 rounds=2)
    row = dataclasses.asdict(run_job(job))
    assert 1 in posted_for and 2 not in posted_for  # (round 1 posted ahead in round 0)

    monkeypatch.setattr(Collective, "post_ahead", property(lambda self: True,
                                                          lambda self, value: None),
                        raising=False)
    posted_for.clear()
    always = dataclasses.asdict(run_job(job))
    assert 2 in posted_for
    assert {k: v for k, v in row.items() if k != "wall_s"} == {
        k: v for k, v in always.items() if k != "wall_s"}

    posted_for.clear()
    run_job(dataclasses.replace(job, cpu="cluster-node"))
    assert 2 in posted_for


def test_a_row_says_what_share_of_the_sends_carried_their_first_probe():
    """Lossless, a rank's sends carry their first PROBE in their last DATA once its
    answered passes hold evidence enough (``loss_prior.QUIET_EVIDENCE`` DATA); under loss
    none do (a carried PROBE is lost with its DATA); a TCP baseline has no such share."""
    from boundedloss.sim import SimJob, run_job
    from boundedloss.sim.job import SimRow

    def row(system: str, loss: float, rounds: int) -> SimRow:
        # (1 MB shards at MTU 1,500: about 730 DATA a message, so a rank's first phase
        # answers about 2,200 - evidence enough for its second phase)
        return run_job(SimJob(workers=4, system=system, topology="allreduce", loss=loss,
                              elements=1 << 20, rounds=rounds, mtu=1500))

    lossless = row("reliable", 0.0, 2)
    # A rank sends 3 messages a phase, 12 in two rounds: the first phase's never carry
    # (cold), the second round's all do; the first round's second phase's do once the
    # sends before them were answered.
    assert 6 / 12 <= lossless.probes_carried_fraction <= 9 / 12
    assert row("reliable", 0.05, 2).probes_carried_fraction == 0.0
    assert row("gloo", 0.0, 1).probes_carried_fraction is None


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_gloo_s_barrier_lets_no_rank_go_before_the_last_arrives(world):
    """Gloo's dissemination barrier over the TCP model: ranks arriving one by one leave
    only after the last has arrived, and a few path delays later (its messages cross the
    network: ceil(log2 N) steps), whatever the world's size."""
    import math

    from boundedloss.sim.barrier import GlooBarrier

    _, rt, tcp = _tcp_world(world)
    barrier = GlooBarrier(tcp)
    left = [0.0] * world
    last_in = 1e-3 * (world - 1)

    def rank(r: int) -> None:
        rt.sleep_until(1e-3 * r)  # (rank r arrives at r ms)
        barrier.wait(r)
        left[r] = rt.now

    for r in range(world):
        rt.spawn(functools.partial(rank, r))
    rt.run()
    steps = math.ceil(math.log2(world))
    assert min(left) > last_in + 5e-6  # (one path's delay at least)
    assert max(left) < last_in + steps * 1e-3  # (and not a timeout's wait)


def test_rows_say_what_their_ranks_waited_at_and_for_how_long():
    """The same job with an instant barrier and with Gloo's: the rows say which, and
    how long the ranks waited between rounds - none, or Gloo's messages' time, in which
    each rank's CPU (on the testbed's shared cores) goes on with what its round left."""
    from boundedloss.sim import SimJob, run_job
    from boundedloss.sim.job import LIKE_TESTBED

    def row(barrier: str):
        return run_job(SimJob(workers=4, system="reliable", topology="allreduce", loss=0.0,
                              elements=1 << 16, rounds=4, mtu=1500, barrier=barrier,
                              **LIKE_TESTBED))

    instant, gloo = row("instant"), row("gloo")
    assert (instant.barrier, gloo.barrier) == ("instant", "gloo")
    assert instant.between_rounds_ms == 0.0 < gloo.between_rounds_ms < instant.p50_ms
    # (an instant barrier lets every rank in at once; Gloo's messages reach them in turn)
    assert instant.entry_spread_ms == 0.0 < gloo.entry_spread_ms < gloo.between_rounds_ms
    assert instant.entry_order_ms == (0.0,) * 4
    assert gloo.entry_order_ms[-1] == gloo.entry_spread_ms
    # (a world larger than the testbed's gives no order: a value a rank in every row)
    wide = run_job(SimJob(workers=17, system="reliable", topology="allreduce", loss=0.0,
                          elements=1 << 10, rounds=1))
    assert wide.entry_order_ms == ()
    # (the barrier's own messages are charged to the hosts too)
    assert gloo.cpu_ms_per_round > instant.cpu_ms_per_round


def test_a_long_job_says_how_far_it_has_got_and_its_row_is_the_same():
    """Told every few thousand events (no wall-clock wait): its round, the virtual time
    and the datagrams so far, growing; and the row is the row of the job run quietly."""
    from boundedloss.sim import SimJob, run_job

    job = SimJob(workers=8, system="dblp", topology="allreduce", loss=0.01,
                 elements=1 << 16, rounds=3, mtu=1500)
    said: list[str] = []
    told = dataclasses.asdict(run_job(job, said.append, progress_every_s=0.0))
    quiet = dataclasses.asdict(run_job(job))
    assert {k: v for k, v in told.items() if k != "wall_s"} == {
        k: v for k, v in quiet.items() if k != "wall_s"}
    assert said and all(m.startswith("round ") and " of 3, " in m and "datagrams" in m
                        for m in said)
    counts = [int(m.split(" ms simulated, ")[1].split(" datagrams")[0].replace(",", ""))
              for m in said]
    assert counts == sorted(counts) and counts[-1] <= told["sim_datagrams"]


def test_a_round_s_entries_come_in_the_order_the_ranks_came():
    """Each round's entries (bench kernel-loss's rows and the simulator's read them with
    one function): the first at 0, the rest after it in order, each a rank's own."""
    from boundedloss.bench.kernel_loss import entry_offsets_ms

    rng = np.random.default_rng(3)
    # round i's entries, ms after its first, known beforehand; the ranks enter in an
    # order of their own each round
    offsets = np.sort(rng.uniform(0.0, 4.0, size=(9, 4)), axis=1)
    offsets -= offsets[:, :1]
    order = np.array([rng.permutation(4) for _ in range(9)])
    starts = np.empty((4, 9))
    for i in range(9):
        starts[order[i], i] = i + 0.25 + offsets[i] * 1e-3
    entries = entry_offsets_ms(starts)
    assert entries.shape == (9, 4)
    assert (entries[:, 0] == 0.0).all() and (np.diff(entries, axis=1) > 0).all()
    assert np.allclose(entries, offsets, rtol=0.0, atol=1e-6)


def test_the_sim_command_s_barriers_are_the_simulator_s():
    from boundedloss.cli import SIM_BARRIERS
    from boundedloss.sim.barrier import BARRIERS

    assert tuple(BARRIERS) == SIM_BARRIERS


def test_costs_from_round_cpu_count_each_datagram_that_reached_the_python_core():
    """A datagram the compiled path took and handed the core the decision of (the DATA
    that meets a plan, a STOP) costs the core as one handed back does, and the simulator
    counts both (``TransferMux.core_datagrams``): its CPU is the core's, not the bytes'."""
    from boundedloss.sim.job import costs_from_round_cpu

    steps = {"I/O thread, all": 10.0, "receive (recvmmsg, take)": 4.0,
             "    core: handed back": 0.3, "    core: handed back (plain)": 0.0,
             "    core: a taken one's decision": 0.6, "send runs (tags, sendmsg)": 3.0,
             "collective call": 2.0}
    calls = {"    core: handed back": 3, "    core: a taken one's decision": 12,
             "  post receives": 2, "  post sends": 2}
    costs = costs_from_round_cpu({"topology": "allreduce", "ranks": 4, "elements": 1 << 20,
                                  "steps_ms": steps, "calls": calls})
    moved = 2 * 3 * 4 * (1 << 20) / 4
    assert costs.datagram_core == pytest.approx(0.9e-3 / 15)
    assert costs.byte_in == pytest.approx((4.0 - 0.9) * 1e-3 / moved)
    assert costs.message_io == pytest.approx((10.0 - 3.1 - 3.0 - 0.9) * 1e-3 / 12)


def test_costs_across_mtus_charge_each_mtu_s_datagrams_what_was_measured_there():
    """Costs per gradient byte measured at two MTUs split into a cost per datagram and
    one per byte of it, so that a DATA datagram of either MTU's chunk costs, per
    gradient byte, what was measured at that MTU - and a third MTU falls between."""
    from boundedloss.net.cpu import CpuCosts
    from boundedloss.net.udp import IPV4_UDP_OVERHEAD, largest_chunk
    from boundedloss.protocol.auth import TRAILER_BYTES
    from boundedloss.sim.job import costs_across_mtus

    at_1500 = CpuCosts(byte_out=0.8e-9, byte_in=0.56e-9, message_io=40e-6, post_io=300e-6)
    at_9000 = CpuCosts(byte_out=0.35e-9, byte_in=0.43e-9, message_io=36e-6, post_io=170e-6)
    costs = costs_across_mtus((1500, at_1500), (9000, at_9000))
    assert costs.datagram_out > 0 and costs.byte_out > 0 and costs.datagram_in > 0

    def per_gradient_byte(mtu: int) -> tuple[float, float]:
        chunk = largest_chunk(mtu, TRAILER_BYTES)
        length = mtu - IPV4_UDP_OVERHEAD
        return costs.send(length) / chunk, costs.receive(length) / chunk

    assert per_gradient_byte(1500) == pytest.approx((0.8e-9, 0.56e-9))
    assert per_gradient_byte(9000) == pytest.approx((0.35e-9, 0.43e-9))
    out_4000, in_4000 = per_gradient_byte(4000)
    assert 0.35e-9 < out_4000 < 0.8e-9 and 0.43e-9 < in_4000 < 0.56e-9
    assert costs.message_io == pytest.approx(38e-6) and costs.post_io == pytest.approx(235e-6)
    with pytest.raises(ValueError):
        costs_across_mtus((1500, at_1500), (1500, at_9000))
