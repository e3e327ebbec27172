"""Collectives among ranks on a simulated network - SimEndpoint hosts of a FakeNetwork,
each rank a program on its virtual clock (``net/simulated.py``) - so that a lossy round,
a dead peer or a hard deadline is deterministic and timed in virtual seconds; and, per
topology, end to end on real UDP endpoints on loopback, a thread per rank (the real
driver: its socket, compiled path and I/O thread serving callers on several threads)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from boundedloss import wire
from boundedloss.aggregate import UnbiasedRescale
from boundedloss.collective import (
    LossGuard,
    LossGuards,
    ParameterServer,
    PeerFailure,
    TransposeAllreduce,
    TwoLevelAllreduce,
    default_group_size,
    default_topology,
    shard_bounds,
)
from boundedloss.net.fake import Datagram, FakeNetwork, NodeProfile, PathProfile
from boundedloss.net.loss import Bernoulli, LossModel, Microburst
from boundedloss.net.simulated import SimEndpoint, SimRuntime
from boundedloss.net.udp import UdpEndpoint
from boundedloss.policy import FixedBoundPolicy, ReliablePolicy
from boundedloss.protocol import SendStatus, TransportConfig

SESSION = 0xC011_EC71_0E00_0001


class _Simulated:
    """Hosts of one FakeNetwork (10 Gb/s links, 20 us paths) and programs taking turns
    on its virtual clock."""

    def __init__(self, seed: int = 1):
        self.network = FakeNetwork(seed=seed, path=PathProfile(delay=20e-6))
        self.runtime = SimRuntime(self.network)

    def endpoint(self, rank: int, config: TransportConfig,
                 loss: LossModel | None = None) -> SimEndpoint:
        """Rank ``rank``'s host; ``loss`` applies to every datagram arriving there, as a
        UDP endpoint's ``loss=`` does to every one it receives."""
        return SimEndpoint(self.runtime, (f"10.0.0.{rank + 1}", 9000), session=SESSION,
                           config=config,
                           profile=NodeProfile(up_bps=10e9, down_bps=10e9, loss=loss))

    def spawn(self, fn: Callable[[], Any]):
        return self.runtime.spawn(fn)

    def run(self) -> None:
        try:
            self.runtime.run()
        finally:
            self.runtime.close()


class _Loopback:
    """Real UDP endpoints on loopback, a thread per program."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def endpoint(self, rank: int, config: TransportConfig,
                 loss: LossModel | None = None) -> UdpEndpoint:
        return UdpEndpoint(session=SESSION, config=config, loss=loss)

    def spawn(self, fn: Callable[[], Any]) -> threading.Thread:
        thread = threading.Thread(target=fn)
        thread.start()
        self.threads.append(thread)
        return thread

    def run(self) -> None:
        for thread in list(self.threads):
            thread.join(timeout=120)


@dataclass(frozen=True)
class _World:
    """What a world's rounds left, by (rank, round, bucket): inputs, outputs and
    RoundStats; by rank: the error a rank failed with, and when (its endpoint's clock -
    virtual seconds on the simulated network)."""

    inputs: dict
    outputs: dict
    stats: dict
    errors: dict
    failed_at: dict


def _run_world(cls, world, make_policy, aggregator, rounds, buckets, losses=None,
               deadline=10.0, absent=(), size=1000, setup=None, network=None, **kw) -> _World:
    """``size`` floats in bucket 0 (777 more per further bucket); ``losses[r]``: what
    rank r's host loses of what reaches it; ``setup(collective)`` runs on each rank's
    collective before its first round; ``deadline``: one for every rank, or one per
    rank; ``network``: a ``_Loopback()`` or ``_Simulated()`` (by default a fresh
    simulated one)."""
    network = network or _Simulated()
    deadlines = deadline if isinstance(deadline, tuple) else (deadline,) * world
    eps = [network.endpoint(r, TransportConfig(chunk_bytes=1400, receive_deadline=deadlines[r],
                                               peer_timeout=deadlines[r]),
                            loss=losses[r] if losses else None)
           for r in range(world)]
    peers = [ep.address for ep in eps]
    rng = np.random.default_rng(0)
    inputs = {(r, t, b): rng.standard_normal(size + 777 * b).astype(np.float32)
              for r in range(world) for t in range(rounds) for b in range(buckets)}
    outputs: dict = {}
    stats: dict = {}
    errors: dict = {}
    failed_at: dict = {}

    def rank_main(r):
        coll = cls(eps[r], r, peers, policy=make_policy(), aggregator=aggregator,
                   session=SESSION, **kw)
        if setup is not None:
            setup(coll)

        def one(t, b):
            try:
                out, st = coll.allreduce_mean(inputs[(r, t, b)], t, b)
            except Exception as e:  # noqa: BLE001
                errors[r], failed_at[r] = e, eps[r].clock()
                return
            outputs[(r, t, b)] = out
            stats[(r, t, b)] = st

        try:
            for t in range(rounds):
                # several buckets in flight at once
                in_flight = [network.spawn(lambda t=t, b=b: one(t, b)) for b in range(buckets)]
                for program in in_flight:
                    program.join()
                if r in errors:
                    return
        finally:
            coll.close()

    for r in range(world):
        if r not in absent:
            network.spawn(lambda r=r: rank_main(r))
    try:
        network.run()
    finally:
        for ep in eps:
            ep.close()
    return _World(inputs, outputs, stats, errors, failed_at)


def _assert_the_exact_mean(run: _World, world: int) -> None:
    assert not run.errors, run.errors
    assert len(run.outputs) == len(run.inputs)
    for (r, t, b), out in run.outputs.items():
        expected = np.mean([run.inputs[(q, t, b)] for q in range(world)], axis=0)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        assert run.stats[(r, t, b)].delivered_fraction == 1.0


@pytest.mark.parametrize("cls", [ParameterServer, TransposeAllreduce])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_reliable_collective_is_the_exact_mean(cls, world):
    _assert_the_exact_mean(_run_world(cls, world, ReliablePolicy, UnbiasedRescale(),
                                      rounds=3, buckets=2), world)


@pytest.mark.parametrize(("cls", "world"), [(ParameterServer, 3), (TransposeAllreduce, 3),
                                            (TwoLevelAllreduce, 4)])
def test_a_collective_on_real_udp_endpoints_under_loss_is_the_exact_mean(cls, world):
    """Each topology end to end on the real driver: two buckets in flight at once on
    every rank (callers on several threads), 5% of what each endpoint receives lost and
    recovered."""
    losses = [Bernoulli(0.05, seed=r) for r in range(world)]
    _assert_the_exact_mean(_run_world(cls, world, ReliablePolicy, UnbiasedRescale(), rounds=3,
                                      buckets=2, losses=losses, network=_Loopback()), world)


@pytest.mark.parametrize(("cls", "world"), [(ParameterServer, 3), (TransposeAllreduce, 3),
                                            (TwoLevelAllreduce, 8)])
def test_bounded_collective_under_loss_meets_the_bound(cls, world):
    """(Two levels, 8 ranks in groups of 4: the bound holds at each level.)"""
    losses = [Bernoulli(0.1, seed=r) for r in range(world)]
    run = _run_world(cls, world, lambda: FixedBoundPolicy(0.25), UnbiasedRescale(), rounds=3,
                     buckets=2, losses=losses, stale_broadcast=True, size=20_000)
    assert not run.errors, run.errors
    assert len(run.stats) == len(run.inputs)
    for key, st in run.stats.items():
        assert st.min_delivered_fraction >= 0.75 - 1e-9, key
    # the loss met the rounds: some handed on part of a message (a shard of a few
    # chunks could not lose one within the bound)
    assert any(st.delivered_fraction < 1.0 for st in run.stats.values())
    # every rank agrees closely with the true mean despite the loss
    for (r, t, b), out in run.outputs.items():
        expected = np.mean([run.inputs[(q, t, b)] for q in range(world)], axis=0)
        rel = np.linalg.norm(out - expected) / np.linalg.norm(expected)
        assert rel < 0.9, (r, t, b, rel)


@pytest.mark.parametrize("cls", [ParameterServer, TransposeAllreduce])
def test_dead_peer_fails_the_round_within_the_deadline(cls):
    """Rank 2 never runs: every other rank's round fails with PeerFailure once its
    1 s receive deadline has passed (virtual seconds, counted from the round's start
    at 0) - not before, and not long after."""
    run = _run_world(cls, 3, ReliablePolicy, UnbiasedRescale(), rounds=1, buckets=1,
                     deadline=1.0, absent=(2,))
    assert set(run.errors) == {0, 1}, "ranks waiting for a dead peer must fail"
    assert all(isinstance(e, PeerFailure) for e in run.errors.values())
    assert all("is the peer alive?" in str(e) for e in run.errors.values()), run.errors
    assert "from rank 2 (round 0" in str(run.errors[0])
    assert all(1.0 <= t <= 1.01 for t in run.failed_at.values()), run.failed_at
    assert not run.outputs


class _AfterFirst(LossModel):
    """Delivers the first ``keep`` datagrams, then nothing: a peer gone mid-message."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.seen = 0

    def drop(self, now: float, round_id: int) -> bool:
        self.seen += 1
        return self.seen > self.keep

    def reset(self, seed: int | None = None) -> None:
        self.seen = 0

    def describe(self) -> str:
        return f"after-first({self.keep})"

    def to_spec(self) -> str:
        return "none"


def test_a_reliable_round_never_hands_on_part_of_a_message():
    """Under ReliablePolicy a receive that reaches its hard deadline with part of the
    message (here: the server hears 2 of a worker's 3 chunks, then nothing) fails the
    round, naming the peer - it does not aggregate what arrived. (Every rank posts its
    receives at virtual time 0, before the first datagram arrives, so the loss model
    counts the push's first datagrams.)"""
    run = _run_world(ParameterServer, 2, ReliablePolicy, UnbiasedRescale(), rounds=1,
                     buckets=1, deadline=1.0, losses=[_AfterFirst(2), _AfterFirst(2)])
    assert run.errors and all(isinstance(e, PeerFailure) for e in run.errors.values())
    assert re.search(r"push from rank 1 .* 2 of 3 chunks arrived within the 1 s "
                     r"receive deadline, and this receive tolerates no loss - is the peer "
                     r"alive, and can the path carry it in that time\?$",
                     str(run.errors[0])), run.errors
    assert not run.outputs


# ------------------------------------------------------------ two levels
@pytest.mark.parametrize("world", [4, 6, 8, 9])
def test_the_two_level_allreduce_is_the_exact_mean(world):
    """Groups of 2 (4 ranks), 3 (6, 9) and 4 (8): every rank ends with the mean of every
    rank's vector, two buckets in flight at once, sizes that do not divide evenly."""
    _assert_the_exact_mean(_run_world(TwoLevelAllreduce, world, ReliablePolicy,
                                      UnbiasedRescale(), rounds=3, buckets=2), world)


def test_the_two_level_allreduce_sends_a_rank_fewer_messages():
    """16 ranks in groups of 4: each rank sends 2 x (3 + 3) = 12 messages a round where
    the transpose allreduce sends 2 x 15 = 30 - counted at the endpoints."""
    sent: dict[str, list[int]] = {"two": [], "one": []}

    def counting(into):
        def setup(coll):
            send_many = coll.endpoint.send_many

            def counted(messages, **kw):
                messages = list(messages)
                into.append(len(messages))
                return send_many(messages, **kw)

            coll.endpoint.send_many = counted
        return setup

    for cls, key in ((TwoLevelAllreduce, "two"), (TransposeAllreduce, "one")):
        _assert_the_exact_mean(_run_world(cls, 16, ReliablePolicy, UnbiasedRescale(),
                                          rounds=2, buckets=1, setup=counting(sent[key])), 16)
    assert sum(sent["two"]) == 16 * 2 * 12
    assert sum(sent["one"]) == 16 * 2 * 30


@pytest.mark.parametrize("world,group,messages", [
    (2, 2, 2), (3, 3, 4), (4, 2, 4), (6, 3, 6), (16, 4, 12), (17, 17, 32), (64, 8, 28),
    (1024, 32, 124)])
def test_the_group_size_makes_a_ranks_messages_fewest(world, group, messages):
    assert default_group_size(world) == group
    ep = _Simulated().endpoint(0, TransportConfig())
    coll = TwoLevelAllreduce(ep, world - 1, [ep.address] * world, policy=ReliablePolicy(),
                             aggregator=UnbiasedRescale())
    assert coll.messages_per_round == messages
    divisors = [g for g in range(2, world) if world % g == 0]
    assert messages == min([2 * (world - 1)] + [2 * (g + world // g - 2) for g in divisors])
    ep.close()


def test_a_group_size_that_does_not_divide_the_world_is_refused():
    ep = _Simulated().endpoint(0, TransportConfig())
    with pytest.raises(ValueError, match="group size 4 does not divide a world of 6"):
        TwoLevelAllreduce(ep, 0, [ep.address] * 6, policy=ReliablePolicy(),
                          aggregator=UnbiasedRescale(), group_size=4)
    ep.close()


def test_the_two_level_allreduce_with_hadamard_dispersion_is_the_exact_mean():
    _assert_the_exact_mean(_run_world(TwoLevelAllreduce, 4, ReliablePolicy, UnbiasedRescale(),
                                      rounds=2, buckets=1, hadamard=True), 4)


def test_a_dead_peer_fails_every_two_level_round_within_the_deadline():
    """Rank 3 never runs. In groups of 2, rank 2 (its group) waits for its shard and
    rank 1 (its column) for its piece; rank 0, which hears neither from rank 3, waits
    for rank 2's piece. Each fails with PeerFailure at its 1 s receive deadline."""
    run = _run_world(TwoLevelAllreduce, 4, ReliablePolicy, UnbiasedRescale(), rounds=1,
                     buckets=1, deadline=1.0, absent=(3,))
    assert set(run.errors) == {0, 1, 2}
    assert all(isinstance(e, PeerFailure) for e in run.errors.values()), run.errors
    assert "from rank 3 (round 0" in str(run.errors[1])
    assert "from rank 3 (round 0" in str(run.errors[2])
    assert "from rank 2 (round 0" in str(run.errors[0])
    assert all(1.0 <= t <= 1.01 for t in run.failed_at.values()), run.failed_at
    assert not run.outputs


def test_shard_bounds_cover_everything():
    for n in (0, 1, 5, 1000):
        for w in (2, 3, 7):
            b = shard_bounds(n, w)
            assert b[0][0] == 0 and b[-1][1] == n
            assert all(lo <= hi for lo, hi in b)
            assert all(b[i][1] == b[i + 1][0] for i in range(w - 1))


@pytest.mark.parametrize("world", [2, 5, 16])
def test_at_every_step_of_a_batch_each_rank_sends_to_a_different_peer(world):
    """Each rank sends its batch in turn from the rank after its own: the k-th sends of
    all ranks go to every rank once (a permutation), so no receiver meets
    the whole world at once."""
    from boundedloss.collective.transpose import rotated

    orders = {r: rotated([p for p in range(world) if p != r], r) for r in range(world)}
    assert all(sorted(order) == [p for p in range(world) if p != r]
               for r, order in orders.items())
    for k in range(world - 1):
        assert sorted(order[k] for order in orders.values()) == list(range(world))
    assert rotated([9, 2, 5], 5) == [9, 2, 5] and rotated([9, 2, 5], 9) == [2, 5, 9]
    assert rotated([2, 9], 4) == [9, 2]


@pytest.mark.parametrize("topology", ["allreduce", "two-level"])
def test_an_allreduce_does_not_meet_at_one_receiver_after_another(topology):
    """32 ranks exchanging 4 KB shards through switch ports that queue 8 datagrams: with
    every rank sending in rank order, each receiver's port meets all its senders'
    datagrams at once in turn and the round waits out the drops' recovery (158 and 56
    ms); each rank in turn from the next, the round takes about 2 ms."""
    from boundedloss.sim import SimJob, run_job

    row = run_job(SimJob(workers=32, system="reliable", topology=topology, loss=0.0,
                         elements=32 * 1024, rounds=1, queue_datagrams=8))
    assert row.p50_ms < 5.0, row


def _server_and_worker(sim: _Simulated, config: TransportConfig,
                       lose_stop: Callable[[Datagram], bool]) -> list[ParameterServer]:
    """A parameter server (rank 0) and one worker on ``sim``, every STOP on its way to
    the server for which ``lose_stop(datagram)`` holds lost; their collectives."""
    eps = [sim.endpoint(r, config) for r in range(2)]

    def route(datagram: Datagram):
        if (datagram.dst == eps[0].address and datagram.kind == wire.Kind.STOP
                and lose_stop(datagram)):
            return ()
        return sim.network.default_route(datagram)

    sim.network.route = route
    peers = [ep.address for ep in eps]
    return [ParameterServer(eps[r], r, peers, policy=ReliablePolicy(),
                            aggregator=UnbiasedRescale(), session=SESSION) for r in range(2)]


def test_server_does_not_wait_for_its_broadcast_to_be_acknowledged():
    """Every STOP the worker sends the server is lost: the server's round still ends
    once the pushes are in and its broadcast is out; the worker gets the exact mean;
    the unacknowledged send surfaces as PeerFailure two rounds later, at its 1 s peer
    timeout (never a hang); the worker, whose third broadcast never comes, fails at its
    5 s receive deadline."""
    sim = _Simulated()
    colls = _server_and_worker(sim, TransportConfig(chunk_bytes=1400, receive_deadline=5.0,
                                                    peer_timeout=1.0), lambda _: True)
    x = [np.arange(5000, dtype=np.float32) * (r + 1) for r in range(2)]
    worker_out, worker_err, failed_at = [], [], {}

    def worker():
        try:
            for t in range(3):
                worker_out.append(colls[1].allreduce_mean(x[1], t)[0])
        except PeerFailure as e:
            worker_err.append(e)
            failed_at["worker"] = sim.network.now
        finally:
            colls[1].close()

    def server():
        try:
            out0, st0 = colls[0].allreduce_mean(x[0], 0)
            [pending] = colls[0].unacknowledged_broadcasts(0)
            assert (pending.round_id, pending.worker) == (0, 1)
            assert not pending.future.done()  # returned with the STOP outstanding
            assert st0.latency_s < 0.01  # (no RTO spent waiting for it)
            np.testing.assert_allclose(out0, (x[0] + x[1]) / 2)
            colls[0].allreduce_mean(x[0], 1)  # round 0's send may still be probing
            with pytest.raises(PeerFailure, match="rank 1"):
                colls[0].allreduce_mean(x[0], 2)  # ... but not forever
            failed_at["server"] = sim.network.now
        finally:
            colls[0].close()

    sim.spawn(server)
    sim.spawn(worker)
    sim.run()
    assert 1.0 <= failed_at["server"] <= 1.01, failed_at
    assert len(worker_out) == 2
    np.testing.assert_allclose(worker_out[0], (x[0] + x[1]) / 2)
    np.testing.assert_allclose(worker_out[1], (x[0] + x[1]) / 2)
    [e] = worker_err
    assert "broadcast from server rank 0 (round 2" in str(e)
    assert 5.0 <= failed_at["worker"] <= 5.01, failed_at


def test_close_lets_the_last_broadcast_be_acknowledged():
    """The worker's STOPs are lost for the first 50 ms: the server's close() right after
    its round waits for the outstanding broadcast to be acknowledged (a later PROBE
    draws a STOP that arrives) instead of cutting it off."""
    sim = _Simulated()
    colls = _server_and_worker(sim, TransportConfig(chunk_bytes=1400),
                               lambda datagram: datagram.departed < 0.05)
    x = np.ones(5000, dtype=np.float32)
    closed = {}

    def server():
        colls[0].allreduce_mean(x, 0)
        [pending] = colls[0].unacknowledged_broadcasts(0)
        assert not pending.future.done()
        colls[0].close()
        closed["at"], closed["status"] = sim.network.now, pending.future.result().status

    def worker():
        colls[1].allreduce_mean(x, 0)
        colls[1].close()

    sim.spawn(server)
    sim.spawn(worker)
    sim.run()
    assert closed["status"] == SendStatus.STOPPED
    assert 0.05 < closed["at"] < 1.0, closed


def test_a_round_closed_by_a_deadline_says_so():
    from boundedloss.collective import RoundStats

    def stats(*reasons: str) -> RoundStats:
        return RoundStats(round_id=0, bucket=0, latency_s=0.1, delivered_fraction=0.9,
                          min_delivered_fraction=0.8, retransmit_rounds=1, bound=0.1,
                          close_reasons=reasons)

    assert stats("bound_met", "deadline").deadline_closed
    assert not stats("bound_met", "complete", "accept_deadline").deadline_closed


# ------------------------------------------------------------------ the loss guard
GUARD_LOG = "boundedloss.collective.guard"


def test_the_guard_engages_after_k_rounds_above_the_bound_and_releases_within_it(caplog):
    """The rule, on measured losses: k rounds in a row above the bound engage it (one
    warning), it holds while the loss stays above, the first round within the bound
    releases it (one warning); a round within the bound starts the count again."""
    caplog.set_level(logging.WARNING, logger=GUARD_LOG)
    guards = LossGuards(LossGuard(rounds=3), "rank 0")
    held = []
    for t, loss in enumerate([0.2, 0.2, 0.0, 0.2, 0.3, 0.2, 0.5, 0.1, 0.01, 0.2]):
        guards.observe(0, t, loss, 0.05)
        held.append(guards.holds(0))
    assert held == [False, False, False, False, False, True, True, True, False, False]
    assert [r.getMessage() for r in caplog.records] == [
        "rank 0, bucket 0: loss 20.00% above the bound 5.00% for 3 rounds in a row (to round "
        "5): received reliably until it is back within the bound",
        "rank 0, bucket 0: loss 1.00% within the bound 5.00% at round 8: bounded again"]
    assert guards.state_dict() == {0: {"above": 1, "guarded": False}}
    assert not guards.holds(1)  # per bucket


def test_the_guard_off_or_without_a_bound_never_engages(caplog):
    caplog.set_level(logging.WARNING, logger=GUARD_LOG)
    for setting, bound in ((LossGuard(rounds=0), 0.05), (LossGuard(), 0.0), (LossGuard(), None)):
        guards = LossGuards(setting)
        for t in range(10):
            guards.observe(0, t, 0.9, bound)
        assert not guards.holds(0)
    assert not caplog.records
    with pytest.raises(ValueError, match="rounds must be an integer >= 0"):
        LossGuard(rounds=-1)


def test_the_guards_state_dict_round_trips_and_refuses_nonsense():
    guards = LossGuards(LossGuard(rounds=2))
    guards.observe(3, 0, 0.5, 0.1)
    guards.observe(3, 1, 0.5, 0.1)
    guards.observe(4, 0, 0.5, 0.1)
    again = LossGuards(LossGuard(rounds=2))
    again.load_state_dict(guards.state_dict())
    assert again.state_dict() == {3: {"above": 2, "guarded": True},
                                  4: {"above": 1, "guarded": False}}
    assert again.holds(3) and not again.holds(4)
    with pytest.raises(ValueError, match="bucket 3"):
        again.load_state_dict({3: {"above": -1, "guarded": True}})
    assert again.holds(3)  # unchanged


@pytest.mark.parametrize(("cls", "world"), [(ParameterServer, 3), (TransposeAllreduce, 3),
                                            (TwoLevelAllreduce, 4)])
def test_a_bucket_losing_more_than_its_bound_is_received_reliably_until_the_loss_falls(
        cls, world, caplog):
    """Rank 0 loses half of what reaches it in rounds 0-3 (bound 5%). Its watched
    receives' first-pass loss is above the bound in rounds 0 and 1: the guard (k=2)
    engages, and rounds 2-4 are reliable - every chunk delivered though the network
    still loses half in 2 and 3, which the first pass keeps measuring; round 4 is clean,
    so the guard releases and round 5 is bounded again. The other ranks lose nothing
    and are never guarded. (In two levels the guard watches the first and holds both.)"""
    caplog.set_level(logging.WARNING, logger=GUARD_LOG)
    rounds = 6
    losses = [Microburst(0.5, rounds=range(4), seed=1)] + [None] * (world - 1)
    run = _run_world(
        cls, world, lambda: FixedBoundPolicy(0.05), UnbiasedRescale(), rounds=rounds,
        buckets=1, losses=losses, size=50_000, guard=LossGuard(rounds=2))
    assert not run.errors, run.errors
    stats = run.stats
    mine = [stats[(0, t, 0)] for t in range(rounds)]
    assert [st.guarded for st in mine] == [False, False, True, True, True, False]
    assert all(st.first_pass_loss > 0.3 for st in mine[:4]), mine
    assert [st.first_pass_loss for st in mine[4:]] == [0.0, 0.0]
    for st in mine[2:5]:
        assert st.delivered_fraction == 1.0 and set(st.close_reasons) == {"complete"}
    assert all(not stats[(r, t, 0)].guarded for r in range(1, world) for t in range(rounds))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("rank 0, bucket 0: loss ")
    assert "for 2 rounds in a row (to round 1)" in said[0]
    assert said[1].startswith("rank 0, bucket 0: loss 0.00% within the bound 5.00% at round 4")


def test_a_receive_the_guard_made_reliable_still_hands_on_part_at_the_hard_deadline():
    """The job's policy tolerates loss: a guarded receive that reaches its hard deadline
    with part of the message hands it on as the bounded one would have (a reliable
    job's fails the round: test_a_reliable_round_never_hands_on_part_of_a_message)."""
    def guarded_from_the_start(coll):
        coll.guard.load_state_dict({0: {"above": 0, "guarded": True}})

    run = _run_world(
        ParameterServer, 2, lambda: FixedBoundPolicy(0.25), UnbiasedRescale(), rounds=1,
        buckets=1, deadline=(1.0, 10.0), losses=[_AfterFirst(2), None],
        setup=guarded_from_the_start, guard=LossGuard())  # (the worker waits longer)
    assert not run.errors, run.errors
    server = run.stats[(0, 0, 0)]
    assert server.guarded and server.close_reasons == ("deadline",)
    assert server.delivered_fraction == pytest.approx(2 / 3)
    assert 1.0 <= server.latency_s <= 1.01  # (its 1 s hard deadline, in virtual seconds)
    assert set(run.outputs) == {(0, 0, 0), (1, 0, 0)}


# ------------------------------------------------------- the transpose's two halves
def _run_ranks(world, make_policy, program, losses=None, cls=TransposeAllreduce,
               **kw) -> dict:
    """Each rank r runs ``program(coll, r, results)`` on its collective (``cls``, on a
    simulated world); ``losses[r]``: what rank r's host loses of what reaches it. The
    results, each rank's memory at the end as ``results[("memory", r)]``. A program's
    error ends the run, raised."""
    sim = _Simulated()
    config = TransportConfig(chunk_bytes=1202, receive_deadline=10.0, peer_timeout=10.0)
    eps = [sim.endpoint(r, config, loss=losses[r] if losses else None) for r in range(world)]
    peers = [ep.address for ep in eps]
    results: dict = {}

    def rank_main(r):
        coll = cls(eps[r], r, peers, policy=make_policy(), aggregator=UnbiasedRescale(),
                   session=SESSION, **kw)
        try:
            program(coll, r, results)
            results[("memory", r)] = dict(coll.memory)
        finally:
            coll.close()

    for r in range(world):
        sim.spawn(lambda r=r: rank_main(r))
    try:
        sim.run()
    finally:
        for ep in eps:
            ep.close()
    return results


def _run_halves(world, make_policy, rounds, piece, shard, losses=None,
                cls=TransposeAllreduce, **kw):
    """Each rank r runs ``rounds`` rounds of ``reduce_scatter_mean`` (bucket 0) on its
    pieces for every owner, ``piece(r, owner, t)`` in rank order, and of ``all_gather``
    (bucket 1) on ``shard(r, t)``; ``losses[r]``: what rank r's host loses of what
    reaches it."""
    def halves(coll, r, results):
        for t in range(rounds):
            pieces = [piece(r, q, t) for q in range(world)]
            x = np.concatenate(pieces).view(pieces[0].dtype)  # (bfloat16's marking)
            results[("rs", r, t)] = coll.reduce_scatter_mean(x, t, 0)
            results[("ag", r, t)] = coll.all_gather(shard(r, t), t, 1)

    return _run_ranks(world, make_policy, halves, losses, cls, **kw)


@pytest.mark.parametrize(("cls", "world"), [(TransposeAllreduce, 3), (TwoLevelAllreduce, 6),
                                            (TwoLevelAllreduce, 8)])
def test_the_reliable_halves_are_a_reduce_scatter_and_an_all_gather(cls, world):
    """Rank r's reduce-scatter result is shard r of the exact mean (uneven shards too);
    its all-gather result every rank's shard in rank order - in two levels too (6 ranks in
    groups of 3, 8 in groups of 4), where the shards travel packed by column."""
    rng = np.random.default_rng(0)
    sizes = [hi - lo for lo, hi in shard_bounds(2102, world)]  # (uneven: 701, 701, 700 at 3)
    pieces = {(s, q, t): rng.standard_normal(sizes[q]).astype(np.float32)
              for s in range(world) for q in range(world) for t in range(2)}
    shards = {(q, t): rng.standard_normal(500).astype(np.float32)
              for q in range(world) for t in range(2)}
    results = _run_halves(world, ReliablePolicy, 2, lambda s, q, t: pieces[(s, q, t)],
                          lambda q, t: shards[(q, t)], cls=cls)
    for r in range(world):
        for t in range(2):
            mean, st = results[("rs", r, t)]
            np.testing.assert_allclose(
                mean, np.mean([pieces[(s, r, t)] for s in range(world)], axis=0), rtol=1e-5,
                atol=1e-6)
            assert st.bucket == 0 and st.delivered_fraction == 1.0
            gathered, st = results[("ag", r, t)]
            assert np.array_equal(gathered, np.concatenate(
                [shards[(q, t)] for q in range(world)]))
            assert st.bucket == 1 and st.delivered_fraction == 1.0


def test_lossy_halves_average_what_arrived_and_keep_the_last_value():
    """10% loss under a 30% bound, 3 ranks whose every value says whose it is (1, 10,
    100): each reduce-scatter element is the mean of some set of contributions that
    holds the owner's own (divided by that set's size, not the world's); each gathered
    element is the current value or the last one that arrived, the first round's
    (nothing kept yet) all current."""
    world, n, rounds = 3, 6000, 4
    ranks_value = [1.0, 10.0, 100.0]

    def shard(q, t):
        return np.full(n, ranks_value[q] * (t + 1), dtype=np.float32)

    losses = [Bernoulli(0.1, seed=r + 1) for r in range(world)]
    results = _run_halves(world, lambda: FixedBoundPolicy(0.3), rounds,
                          lambda s, q, t: shard(s, t), shard, losses=losses,
                          stale_broadcast=True)
    partial = stale = 0
    for r in range(world):
        others = [q for q in range(world) if q != r]
        kept = None
        for t in range(rounds):
            mean, _ = results[("rs", r, t)]
            own = ranks_value[r] * (t + 1)
            everyone = sum(ranks_value) * (t + 1) / world
            means = {own, everyone} | {(own + ranks_value[q] * (t + 1)) / 2 for q in others}
            assert set(np.unique(mean)) <= {np.float32(m) for m in means}, (r, t)
            partial += int((mean != np.float32(everyone)).sum())
            gathered, st = results[("ag", r, t)]
            for q in range(world):
                piece = gathered[q * n:(q + 1) * n]
                now = piece == np.float32(ranks_value[q] * (t + 1))
                if q == r or kept is None:
                    assert now.all(), (r, t, q)
                    continue
                assert (now | (piece == kept[q * n:(q + 1) * n])).all(), (r, t, q)
                stale += int((~now).sum())
            kept = gathered.copy()
    assert partial > 0 and stale > 0, (partial, stale)


def test_lossy_two_level_halves_average_what_arrived_and_keep_the_last_value():
    """The halves in two levels (4 ranks in groups of 2) under 10% loss and a 30% bound:
    each reduce-scatter element lies among the contributions' values and some miss a
    contribution; each gathered element is the current value or an earlier round's (a
    value lost at either step keeps what that step had last, which may be older than
    what this rank had last), the first round's all current."""
    world, n, rounds = 4, 6000, 4
    ranks_value = [1.0, 10.0, 100.0, 1000.0]

    def shard(q, t):
        return np.full(n, ranks_value[q] * (t + 1), dtype=np.float32)

    losses = [Bernoulli(0.1, seed=r + 1) for r in range(world)]
    results = _run_halves(world, lambda: FixedBoundPolicy(0.3), rounds,
                          lambda s, q, t: shard(s, t), shard, losses=losses,
                          cls=TwoLevelAllreduce, stale_broadcast=True)
    partial = stale = 0
    for r in range(world):
        for t in range(rounds):
            mean, _ = results[("rs", r, t)]
            everyone = np.float32(sum(ranks_value) * (t + 1) / world)
            assert ((mean >= 1.0 * (t + 1)) & (mean <= 1000.0 * (t + 1))).all(), (r, t)
            partial += int((mean != everyone).sum())
            gathered, _ = results[("ag", r, t)]
            for q in range(world):
                piece = gathered[q * n:(q + 1) * n]
                now = piece == np.float32(ranks_value[q] * (t + 1))
                if q == r or t == 0:
                    assert now.all(), (r, t, q)
                    continue
                rounds_values = [np.float32(ranks_value[q] * (u + 1)) for u in range(t + 1)]
                assert np.isin(piece, rounds_values).all(), (r, t, q)
                stale += int((~now).sum())
    assert partial > 0 and stale > 0, (partial, stale)


def test_a_bfloat16_stale_fill_stays_bfloat16():
    """A lossy all-gather of bfloat16 words keeps them marked as bfloat16 in memory (so a
    checkpoint writes them as bfloat16), stale-filled pieces too."""
    from boundedloss.collective import BFLOAT16
    from boundedloss.collective.base import is_bfloat16

    def words(q, t):
        return np.full(6000, 0x3F80 + 16 * t + q, dtype=np.uint16).view(BFLOAT16)

    losses = [Bernoulli(0.2, seed=r + 1) for r in range(2)]
    results = _run_halves(2, lambda: FixedBoundPolicy(0.4), 3,
                          lambda s, q, t: words(s, t), words, losses=losses,
                          stale_broadcast=True)
    for r in range(2):
        memory = results[("memory", r)]
        assert memory and all(is_bfloat16(v.dtype) for v in memory.values()), memory
    assert any(st.delivered_fraction < 1.0 for key, (_, st) in results.items()
               if key[0] == "ag" and key[2] > 0)


def test_a_half_refuses_hadamard_dispersion():
    ep = _Simulated().endpoint(0, TransportConfig())
    try:
        coll = TransposeAllreduce(ep, 0, [ep.address, ("10.0.0.9", 9000)],
                                  policy=ReliablePolicy(), aggregator=UnbiasedRescale(),
                                  hadamard=True)
        with pytest.raises(ValueError, match="Hadamard"):
            coll.reduce_scatter_mean(np.zeros(8, np.float32), 0)
        with pytest.raises(ValueError, match="Hadamard"):
            coll.all_gather(np.zeros(4, np.float32), 0)
    finally:
        ep.close()


def test_a_failed_broadcast_leaves_the_later_ones_tracked_for_close():
    """One broadcast failed: settling raises for it, and the bucket's later pending
    broadcasts stay tracked, so that close() still waits for or cancels them."""
    from concurrent.futures import Future

    from boundedloss.collective.parameter_server import PendingBroadcast
    from boundedloss.protocol import TransportError

    sim = _Simulated()
    [server, _] = _server_and_worker(sim, TransportConfig(chunk_bytes=1400), lambda d: False)
    failed: Future = Future()
    failed.set_exception(TransportError("the worker stopped answering"))
    later: Future = Future()
    # (the bucket's bookkeeping as two rounds of one worker left it)
    server._broadcasts[0] = [PendingBroadcast(1, 1, failed),  # noqa: SLF001
                             PendingBroadcast(2, 1, later)]
    with pytest.raises(TransportError):
        server._settle_broadcasts(0, before=2)  # noqa: SLF001
    assert [p.future for p in server.unacknowledged_broadcasts(0)] == [later]


def _gathered_in_place(cls, world: int, sizes: list[tuple[int, np.dtype]], monkeypatch,
                       **kw) -> tuple[dict, dict, dict]:
    """Reliable rounds of ``cls`` on a simulated world, round t of ``sizes[t]`` (elements,
    dtype): each rank's inputs and outputs by (rank, round), and by (rank, round) the
    buffers its gathered results arrived in (every receive ``_accept_broadcast`` is
    handed)."""
    from boundedloss.collective.base import Collective

    arrived: dict = {}
    accept = Collective._accept_broadcast  # noqa: SLF001 - observed where it is called

    def observed(self, res, size, dtype, memory_key):
        arrived.setdefault((self.rank, res.round_id), []).append(res.data)
        return accept(self, res, size, dtype, memory_key)

    monkeypatch.setattr(Collective, "_accept_broadcast", observed)
    rng = np.random.default_rng(3)
    inputs = {(r, t): rng.standard_normal(n).astype(dtype)
              for r in range(world) for t, (n, dtype) in enumerate(sizes)}

    def rounds(coll, r, results):
        for t in range(len(sizes)):
            results[(r, t)] = coll.allreduce_mean(inputs[(r, t)], t)[0]

    outputs = _run_ranks(world, ReliablePolicy, rounds, cls=cls, **kw)
    return inputs, outputs, arrived


@pytest.mark.parametrize(("cls", "world"), [(TransposeAllreduce, 3), (TwoLevelAllreduce, 6)])
def test_a_reliable_gather_lands_in_the_result_in_place(cls, world, monkeypatch):
    """Without stale_broadcast every gathered piece is received reliably, straight into
    the round's result - posted ahead into next round's array, or posted in the round
    into its own - so nothing is copied, no last value is kept, and no round writes into
    an earlier one's result. A round of another size or type (DDP rebuilding its
    buckets) cancels what was posted ahead for it and posts into an array of its own:
    still the exact mean."""
    sizes = [(5000, np.float32), (5000, np.float32), (3001, np.float32),
             (3001, np.float16), (3001, np.float16)]
    inputs, outputs, arrived = _gathered_in_place(cls, world, sizes, monkeypatch)
    for r in range(world):
        for t, (_, dtype) in enumerate(sizes):
            out = outputs[(r, t)]
            expected = np.mean([inputs[(q, t)].astype(np.float64) for q in range(world)],
                               axis=0)
            tolerance = 1e-5 if dtype == np.float32 else 2e-3
            np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)
            assert out.dtype == dtype
            # (the last: the other ranks' shards - in two levels, the group's)
            gathered = arrived[(r, t)][-(world if cls is TransposeAllreduce
                                         else default_group_size(world)) + 1:]
            assert all(np.shares_memory(data, out) for data in gathered), (r, t)
            if t:
                assert not np.shares_memory(out, outputs[(r, t - 1)]), (r, t)
        kept = {role for _, role in outputs[("memory", r)]}
        assert not {role for role in kept if re.fullmatch(r"(gather|piece)\d+", role)}, kept


def test_with_stale_broadcast_the_gather_keeps_buffers_of_its_own(monkeypatch):
    """With stale_broadcast a piece may miss chunks and keep its last value: its receive
    lands in a buffer of its own, which memory keeps, apart from the result handed on."""
    inputs, outputs, arrived = _gathered_in_place(
        TransposeAllreduce, 3, [(5000, np.float32)] * 3, monkeypatch, stale_broadcast=True)
    for r in range(3):
        for t in range(3):
            assert not any(np.shares_memory(d, outputs[(r, t)]) for d in arrived[(r, t)])
        assert {role for _, role in outputs[("memory", r)]} == {
            "shard"} | {f"gather{q}" for q in range(3) if q != r}


@pytest.mark.parametrize("world", [2, 4, 8, 9, 16, 17, 64, 1024])
def test_the_default_topology_is_an_allreduce_in_as_few_messages_as_the_world_allows(world):
    """Up to 8 ranks the transpose allreduce; above, two levels, whose ranks handle no
    more messages than the transpose's 2(N - 1) (a prime world's two levels are one)."""
    from boundedloss.collective.two_level import messages_per_round

    topology = default_topology(world)
    assert topology == ("allreduce" if world <= 8 else "two-level")
    if topology == "two-level":
        assert messages_per_round(world) <= 2 * (world - 1)


@pytest.mark.parametrize("world", [8, 16])
def test_the_default_topology_is_faster_than_the_parameter_server_at_a_core_a_rank(world):
    """What the default rests on, simulated with a core per rank and 4 MB rounds (a DDP
    bucket is up to 25 MB): the parameter server's server takes every rank's whole
    vector through its one link, so its round is several of the default's, and the
    default's is no slower than the other allreduce's."""
    from boundedloss.sim import SimJob, run_job

    def p50(topology: str) -> float:
        return run_job(SimJob(workers=world, system="dblp", topology=topology, loss=0.0,
                              elements=1 << 20, rounds=2, cpu="cluster-node")).p50_ms

    chosen = default_topology(world)
    other = "two-level" if chosen == "allreduce" else "allreduce"
    assert 2 * p50(chosen) < p50("ps")
    assert p50(chosen) <= 1.1 * p50(other)
