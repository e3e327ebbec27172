"""Background traffic (``net/background.py``): other tenants' datagrams on the simulated
network's links and queues, and ``boundedloss sim --background``."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from boundedloss.net.background import (
    BackgroundSource,
    BackgroundTraffic,
    parse_background,
    start_background,
)
from boundedloss.net.fake import FakeNetwork, NodeProfile, PathProfile
from boundedloss.net.simulated import SimDeadlock, SimEndpoint, SimFuture, SimRuntime
from boundedloss.sim import SimJob, run_job
from conftest import spawn_transfer, two_racks_with_a_narrow_spine

SESSION = 0xB6_0001
GBPS10 = 10e9
PACKET = 8972  # a full packet of MTU 9,000, as the simulator counts our datagrams


def _address(rank: int) -> tuple[str, int]:
    return (f"10.0.0.{rank + 1}", 9000)


# ------------------------------------------------------------------ the spec


@pytest.mark.parametrize("spec, traffic", [
    ("0.3", BackgroundTraffic(0.3)),
    ("0.3:poisson,to=0", BackgroundTraffic(0.3, toward=0)),
    ("0.25:onoff", BackgroundTraffic(0.25, "onoff")),
    (" 0.5 : onoff , on_us=40 ", BackgroundTraffic(0.5, "onoff", on_us=40.0)),
    ("0.1:pareto,shape=1.2,on_us=300,to=2",
     BackgroundTraffic(0.1, "pareto", on_us=300.0, shape=1.2, toward=2)),
    ("0", BackgroundTraffic(0.0)),
])
def test_a_spec_reads_as_its_traffic_and_prints_back_to_itself(spec, traffic):
    assert parse_background(spec) == traffic
    assert parse_background(str(traffic)) == traffic


@pytest.mark.parametrize("spec, message", [
    ("1", "the rate is a fraction of the link's rate in [0, 1), not 1"),
    ("-0.1", "in [0, 1)"),
    ("nan", "in [0, 1)"),
    ("lots", "the rate is a number, not 'lots'"),
    ("0.3:bursty", "'bursty' is no pattern"),
    ("0.3:onoff,on_us=0", "on_us must be positive"),
    ("0.3:on_us=50", "on_us= sets the ON periods of onoff or pareto"),
    ("0.3:onoff,shape=1.5", "shape= sets pareto's periods"),
    ("0.3:pareto,shape=1", "shape must be in (1, 2]"),
    ("0.3:to=server", "to= is a rank, not 'server'"),
    ("0.3:to=-1", "to must be a rank"),
    ("0.3:onoff,every=5", "'every=5' is not on_us=, shape= or to="),
])
def test_a_bad_spec_is_refused_in_one_line_with_the_form(spec, message):
    with pytest.raises(ValueError) as e:
        parse_background(spec)
    text = str(e.value)
    assert message in text and "Form: RATE[:poisson|onoff|pareto]" in text
    assert "\n" not in text


# ------------------------------------------------------------------ the sources


def _emissions(traffic: BackgroundTraffic, seconds: float, seed: int = 3,
               destinations=("b", "c", "d")) -> tuple[np.ndarray, list]:
    source = BackgroundSource(traffic, peak_bps=GBPS10, datagram_bytes=PACKET,
                              destinations=destinations, seed=[seed])
    times, where = [], []
    while True:
        t, dst, size = source.next()
        assert size == PACKET
        if t > seconds:
            return np.array(times), where
        times.append(t)
        where.append(dst)


@pytest.mark.parametrize("traffic, seconds, tolerance", [
    (BackgroundTraffic(0.3), 1.0, 0.02),
    (BackgroundTraffic(0.3, "onoff"), 1.0, 0.05),
    (BackgroundTraffic(0.6, "onoff", on_us=20.0), 1.0, 0.05),
    (BackgroundTraffic(0.3, "pareto"), 4.0, 0.12),  # (heavy tails: the mean settles slowly)
])
def test_each_pattern_s_long_run_load_is_its_rate(traffic, seconds, tolerance):
    times, _ = _emissions(traffic, seconds)
    load = len(times) * PACKET * 8 / GBPS10 / seconds
    assert load == pytest.approx(traffic.rate, rel=tolerance)
    assert np.all(np.diff(times) >= 0)


def test_on_off_sources_are_burstier_than_poisson_and_pareto_burstiest():
    """The index of dispersion of datagrams counted in 1 ms windows: 1 for a Poisson
    process, far above it for on/off periods, and more with Pareto's heavy tails."""

    def dispersion(traffic: BackgroundTraffic) -> float:
        times, _ = _emissions(traffic, 2.0)
        counts = np.bincount((times / 1e-3).astype(int), minlength=2000)
        return float(counts.var() / counts.mean())

    poisson = dispersion(BackgroundTraffic(0.3))
    onoff = dispersion(BackgroundTraffic(0.3, "onoff"))
    pareto = dispersion(BackgroundTraffic(0.3, "pareto"))
    assert 0.8 < poisson < 1.2
    assert onoff > 5 * poisson
    assert pareto > onoff


def test_an_on_period_goes_back_to_back_at_the_link_rate_to_one_host():
    times, where = _emissions(BackgroundTraffic(0.3, "onoff"), 0.2)
    gap = PACKET * 8 / GBPS10
    back_to_back = np.isclose(np.diff(times), gap, rtol=1e-9, atol=1e-15)
    assert back_to_back.mean() > 0.8  # (mean ON period 100 us: about 14 datagrams)
    assert all(where[i] == where[i + 1] for i in np.flatnonzero(back_to_back))
    assert set(where) == {"b", "c", "d"}  # (each ON period to one host, drawn uniformly)


def test_a_poisson_source_spreads_its_datagrams_over_the_other_hosts():
    _, where = _emissions(BackgroundTraffic(0.3), 0.5)
    shares = [where.count(h) / len(where) for h in ("b", "c", "d")]
    assert shares == pytest.approx([1 / 3] * 3, abs=0.02)


def test_each_host_s_source_draws_its_own_stream_of_the_seed():
    def first_times(seed: int) -> list[list[float]]:
        net = FakeNetwork(seed=0)
        rt = SimRuntime(net)
        hosts = [_address(r) for r in range(3)]
        for h in hosts:
            SimEndpoint(rt, h, session=SESSION)
        sources = start_background(net, BackgroundTraffic(0.3), hosts, peak_bps=GBPS10,
                                   datagram_bytes=PACKET, seed=seed)
        return [[s.next()[0] for _ in range(5)] for s in sources]

    a = first_times(7)
    assert a == first_times(7)
    assert a != first_times(8)
    assert a[0] != a[1] != a[2]


# ------------------------------------------------------------------ on the network


class _Script:
    """A source that sends ``count`` datagrams of ``size`` toward ``dst`` every ``gap``
    seconds from ``start``, then nothing more within any run here."""

    def __init__(self, dst, count: int, size: int = 1000, start: float = 0.0,
                 gap: float = 0.0):
        self._next = [(start + i * gap, dst, size) for i in range(count)]
        self._dst, self._size = dst, size

    def next(self) -> tuple[float, object, int]:
        return self._next.pop(0) if self._next else (math.inf, self._dst, self._size)


def _pair(queue: int = 4096, up_bps: float = 1e9, down_bps: float = 1e9):
    net = FakeNetwork(seed=0, path=PathProfile(delay=10e-6))
    rt = SimRuntime(net)
    profile = NodeProfile(up_bps=up_bps, down_bps=down_bps, queue_datagrams=queue)
    a = SimEndpoint(rt, _address(0), session=SESSION, profile=profile)
    b = SimEndpoint(rt, _address(1), session=SESSION, profile=profile)
    return net, rt, a, b


def _transfer(background: _Script | None) -> tuple[FakeNetwork, float]:
    """A message from host 0 to host 1, with ``background`` from host 0 (to a third
    host: only host 0's uplink is shared): the network, and when the receive ended."""
    net, rt, a, b = _pair()
    SimEndpoint(rt, _address(2), session=SESSION)
    if background is not None:
        net.add_background(a.address, background)
    payload = np.zeros(200_000, dtype=np.uint8)
    rt.spawn(lambda: a.send(b.address, payload, message_id=1).result())
    got = rt.spawn(lambda: (b.receive(a.address, message_id=1, nbytes=payload.nbytes).result(),
                            rt.now))
    rt.run()
    result, done = got.result()
    assert result.complete
    return net, done


def test_background_takes_the_sender_s_uplink_in_turn_with_the_job():
    _, alone = _transfer(None)
    # 100 datagrams of 10,000 bytes on host 0's 1 Gb/s uplink at 0: 8 ms before the job's
    net, shared = _transfer(_Script(_address(2), 100, size=10_000))
    assert shared == pytest.approx(alone + 8e-3, rel=0.05)
    assert net.counts["background_delivered"] == 100 and net.counts["sent"] > 0


def test_background_fills_the_switch_queue_and_the_job_s_datagrams_are_dropped_there():
    net, rt, a, b = _pair(queue=32)
    c = SimEndpoint(rt, _address(2), session=SESSION,
                    profile=NodeProfile(up_bps=10e9, down_bps=10e9))
    # a third host's 10 Gb/s toward b's 1 Gb/s port, as the job's DATA crosses it: the
    # port's queue stays full for the 2.4 ms the background lasts
    net.add_background(c.address, _Script(b.address, 3000, size=1000, gap=0.8e-6))
    payload = np.zeros(200_000, dtype=np.uint8)
    _, got = spawn_transfer(rt, a, b, payload)
    rt.run()
    net.run(until=net.now + 1.0)  # (what is still on its way arrives)
    c_ = net.counts
    assert got.result().complete
    assert c_["queue_drop"] > 0 and c_["background_queue_drop"] > 0
    # the job's counts balance without the background's, and the background's apart
    assert c_["sent"] + c_["duplicated"] == (c_["no_route"] + c_["path_loss"]
                                             + c_["fabric_drop"] + c_["queue_drop"]
                                             + c_["node_loss"] + c_["delivered"])
    assert c_["background_sent"] == 3000 == (c_["background_no_route"]
                                             + c_["background_fabric_drop"]
                                             + c_["background_queue_drop"]
                                             + c_["background_delivered"])
    assert c_["background_bytes"] == 3000 * 1000


def test_background_meets_no_path_loss_only_the_queues():
    from boundedloss.net.loss import Bernoulli

    net = FakeNetwork(seed=0, path=PathProfile(delay=1e-6, loss=Bernoulli(0.5, seed=1)))
    rt = SimRuntime(net)
    a = SimEndpoint(rt, _address(0), session=SESSION)
    b = SimEndpoint(rt, _address(1), session=SESSION)
    net.add_background(a.address, _Script(b.address, 500))
    net.run(until=0.01)
    assert net.counts["background_delivered"] == 500 and net.counts["path_loss"] == 0


def test_background_crosses_the_spine_and_its_queues_drop_it():
    net = FakeNetwork(seed=0, path=PathProfile(delay=1e-6))
    rt, a, b = two_racks_with_a_narrow_spine(net, SESSION, _address)
    net.add_background(a.address, _Script(b.address, 50))
    net.run(until=1.0)
    c = net.counts
    assert c["background_fabric_drop"] > 0 and c["background_delivered"] > 0
    assert c["background_fabric_drop"] + c["background_delivered"] == 50


def test_every_program_waiting_on_nothing_is_a_deadlock_under_background_too():
    net, rt, a, b = _pair()
    start_background(net, BackgroundTraffic(0.5), [a.address, b.address],
                     peak_bps=1e9, datagram_bytes=1000, seed=0)
    never: SimFuture = SimFuture(rt)

    def program():
        rt.sleep_until(0.002)
        never.result()

    rt.spawn(program)
    with pytest.raises(SimDeadlock):
        rt.run(until=10.0)  # (endless background must not stand in for work to come)
    assert rt.now < 0.01 and net.counts["background_sent"] > 0
    rt.close()


def test_a_host_that_has_left_sends_no_more_background():
    net, rt, a, b = _pair()
    start_background(net, BackgroundTraffic(0.5), [a.address, b.address],
                     peak_bps=1e9, datagram_bytes=1000, seed=0)
    net.call_at(0.001, a.close)
    net.call_at(0.001, b.close)
    net.run(until=0.01)
    sent = net.counts["background_sent"]
    assert 0 < sent < 2 * 0.5 * 1e9 * 0.0015 / 8000  # (a millisecond's and a little)
    net.run(until=0.1)
    assert net.counts["background_sent"] == sent


# ------------------------------------------------------------------ a simulated job


def _job(**settings) -> SimJob:
    base = dict(workers=4, system="reliable", topology="ps", loss=0.0, elements=50_000,
                rounds=3, queue_datagrams=128, seed=5)
    return SimJob(**{**base, **settings})


def _row(job: SimJob) -> dict:
    row = dataclasses.asdict(run_job(job))
    row.pop("wall_s")  # (the host's time: the one figure that may differ)
    return row


def test_the_same_seed_gives_the_same_rows_under_background():
    for spec in ("0.4:onoff,on_us=50", "0.3:pareto,to=0"):
        traffic = parse_background(spec)
        row = _row(_job(background=traffic))
        assert row["background"] == str(traffic)
        assert row["background_bytes"] > 0
        assert _row(_job(background=traffic)) == row
        assert _row(_job(background=traffic, seed=6))["background_bytes"] != row[
            "background_bytes"]


def test_background_at_a_rate_of_0_is_no_background_to_the_row():
    for topology, system in (("ps", "reliable"), ("allreduce", "dblp"), ("gloo", "gloo")):
        plain = _row(_job(topology=topology, system=system))
        assert _row(_job(topology=topology, system=system,
                         background=BackgroundTraffic(0.0, "onoff", toward=0))) == plain
        assert plain["background"] == "" and plain["background_bytes"] == 0


def test_the_job_s_rounds_slow_as_the_background_s_rate_rises():
    rows = [run_job(_job(background=BackgroundTraffic(rate))) for rate in (0, 0.15, 0.3, 0.45)]
    means = [r.mean_ms for r in rows]
    assert means == sorted(means) and means[-1] > 1.2 * means[0]
    sent = [r.background_bytes for r in rows]
    assert sent == sorted(sent) and sent[0] == 0
    assert all(r.queue_drops == 0 for r in rows)  # (the queues absorb it: delay alone)
    assert len({r.sim_datagrams for r in rows}) == 1  # (the job sent the same)


def test_background_toward_the_server_drops_the_job_s_datagrams_at_its_port():
    """Three hosts' background into the server's port - another tenant's incast -
    fills the queue the workers' pushes meet: the job's own drops rise with it, and
    payload_drop_fraction stays the job's payload's."""
    rows = [run_job(_job(background=BackgroundTraffic(rate, toward=0)))
            for rate in (0, 0.35, 0.45)]
    drops = [r.queue_drops for r in rows]
    assert drops[0] == 0 and 0 < drops[1] < drops[2]
    assert [r.payload_drop_fraction for r in rows] == sorted(
        r.payload_drop_fraction for r in rows)
    assert rows[2].payload_drop_fraction < 1 and rows[2].background_drops > drops[2]
    assert rows[2].mean_ms > 5 * rows[0].mean_ms


def test_a_background_rank_beyond_the_world_is_refused():
    with pytest.raises(ValueError, match="to=4: there are 4 hosts"):
        run_job(_job(background=BackgroundTraffic(0.3, toward=4)))


# ------------------------------------------------------------------ the command line


def test_boundedloss_sim_runs_rows_of_each_background(tmp_path):
    from boundedloss.cli import main

    path = tmp_path / "sim.json"
    assert main(["sim", "--workers", "3", "--systems", "gloo,reliable", "--topology", "ps",
                 "--losses", "0", "--elements", "30000", "--rounds", "2",
                 "--background", "0", "--background", "0.3:onoff,to=0",
                 "--json", str(path)]) == 0
    rows = {(r["system"], r["background"]): r for r in json.loads(path.read_text())}
    spec = "0.3:onoff,on_us=100,to=0"
    assert set(rows) == {(s, b) for s in ("gloo", "reliable") for b in ("", spec)}
    for system in ("gloo", "reliable"):
        assert rows[(system, "")]["background_bytes"] == 0
        assert rows[(system, spec)]["background_bytes"] > 0
        assert rows[(system, spec)]["mean_ms"] > rows[(system, "")]["mean_ms"]


@pytest.mark.parametrize("argv, message", [
    (["--background", "1.5"], "the rate is a fraction of the link's rate in [0, 1)"),
    (["--background", "0.3:bursty"], "'bursty' is no pattern"),
    (["--background", "0.3:pareto,shape=4"], "shape must be in (1, 2]"),
    (["--workers", "4,8", "--background", "0.3:to=4"],
     "to=4, but 4 workers have ranks 0 to 3"),
])
def test_boundedloss_sim_refuses_a_bad_background_in_one_line(argv, message, capsys):
    from boundedloss.cli import main

    assert main(["sim", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "--background" in err and err.count("\n") == 1


def test_the_plot_draws_each_background_in_a_panel_of_its_own(tmp_path):
    import struct

    from boundedloss.sim import SimRow
    from boundedloss.sim.plot import LEGEND_WIDTH_IN, PANEL_WIDTH_IN, plot_scaling

    def row(workers: int, background: str) -> SimRow:
        return SimRow(workers=workers, system="reliable", topology="ps", loss=0.0, rounds=2,
                      elements=1000, p50_ms=1.0, p99_ms=2.0, mean_ms=1.5, max_ms=2.0,
                      sim_datagrams=10, queue_drops=0, path_losses=0, wall_s=0.1, seed=0,
                      background=background)

    def panels(rows: list[SimRow]) -> float:
        path = tmp_path / "sim.png"
        plot_scaling(rows, path)
        width = struct.unpack(">I", path.read_bytes()[16:20])[0]  # (the PNG's IHDR)
        return (width / 110 - LEGEND_WIDTH_IN) / PANEL_WIDTH_IN

    assert panels([row(4, ""), row(8, "")]) == pytest.approx(1, abs=0.05)
    assert panels([row(w, b) for w in (4, 8) for b in ("", "0.3:poisson")]) == pytest.approx(
        2, abs=0.05)


def test_the_plot_tells_systems_by_colour_and_topologies_by_marker():
    from boundedloss.sim.plot import arm_style

    systems = ["dblp", "gloo", "ltp", "mlt", "reliable", "tcp-ps"]
    arms = [(s, t) for s in systems for t in ("allreduce", "two-level", "ps")]
    styles = {arm: arm_style(systems, *arm) for arm in arms}
    # one colour a system, whatever its topology; a marker a topology, whatever its system
    assert len({styles[(s, t)]["color"] for s, t in arms}) == len(systems)
    for s in systems:
        assert len({styles[(s, t)]["color"] for t in ("allreduce", "two-level", "ps")}) == 1
        assert len({styles[(s, t)]["marker"] for t in ("allreduce", "two-level", "ps")}) == 3
