"""Collectives over real UDP endpoints on loopback, one thread per rank."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from boundedloss.aggregate import UnbiasedRescale
from boundedloss.collective import ParameterServer, PeerFailure, TransposeAllreduce, shard_bounds
from boundedloss.net.loss import Bernoulli, LossModel
from boundedloss.net.udp import UdpEndpoint
from boundedloss.policy import FixedBoundPolicy, ReliablePolicy
from boundedloss.protocol import TransportConfig

SESSION = 0xC011_EC71_0E00_0001


def _run_world(cls, world, make_policy, aggregator, rounds, buckets, losses=None,
               deadline=10.0, absent=(), **kw):
    cfg = TransportConfig(chunk_bytes=1400, receive_deadline=deadline, peer_timeout=deadline)
    eps = [UdpEndpoint(session=SESSION, config=cfg,
                       loss=(losses[r] if losses else None)) for r in range(world)]
    peers = [ep.address for ep in eps]
    rng = np.random.default_rng(0)
    inputs = {(r, t, b): rng.standard_normal(1000 + 777 * b).astype(np.float32)
              for r in range(world) for t in range(rounds) for b in range(buckets)}
    outputs, stats, errors = {}, {}, {}

    def rank_main(r):
        coll = cls(eps[r], r, peers, policy=make_policy(), aggregator=aggregator,
                   session=SESSION, **kw)
        try:
            for t in range(rounds):
                threads = []
                for b in range(buckets):  # several buckets in flight at once
                    def one(b=b, t=t):
                        try:
                            out, st = coll.allreduce_mean(inputs[(r, t, b)], t, b)
                        except Exception as e:  # noqa: BLE001
                            errors[r] = e
                            return
                        outputs[(r, t, b)] = out
                        stats[(r, t, b)] = st
                    th = threading.Thread(target=one)
                    th.start()
                    threads.append(th)
                for th in threads:
                    th.join()
                if r in errors:
                    return
        finally:
            coll.close()

    threads = [threading.Thread(target=rank_main, args=(r,))
               for r in range(world) if r not in absent]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    for ep in eps:
        ep.close()
    return inputs, outputs, stats, errors


@pytest.mark.parametrize("cls", [ParameterServer, TransposeAllreduce])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_reliable_collective_is_the_exact_mean(cls, world):
    inputs, outputs, stats, errors = _run_world(cls, world, ReliablePolicy, UnbiasedRescale(),
                                                rounds=3, buckets=2)
    assert not errors
    for (r, t, b), out in outputs.items():
        expected = np.mean([inputs[(q, t, b)] for q in range(world)], axis=0)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
        assert stats[(r, t, b)].delivered_fraction == 1.0


@pytest.mark.parametrize("cls", [ParameterServer, TransposeAllreduce])
def test_bounded_collective_under_loss_meets_the_bound(cls):
    world = 3
    losses = [Bernoulli(0.1, seed=r) for r in range(world)]
    inputs, outputs, stats, errors = _run_world(
        cls, world, lambda: FixedBoundPolicy(0.25), UnbiasedRescale(), rounds=3, buckets=2,
        losses=losses, stale_broadcast=True,
    )
    assert not errors
    for key, st in stats.items():
        assert st.min_delivered_fraction >= 0.75 - 1e-9, key
    # every rank agrees closely with the true mean despite the loss
    for (r, t, b), out in outputs.items():
        expected = np.mean([inputs[(q, t, b)] for q in range(world)], axis=0)
        rel = np.linalg.norm(out - expected) / np.linalg.norm(expected)
        assert rel < 0.9, (r, t, b, rel)


def test_dead_peer_fails_the_round_within_the_deadline():
    import time

    t0 = time.monotonic()
    _, outputs, _, errors = _run_world(ParameterServer, 3, ReliablePolicy, UnbiasedRescale(),
                                       rounds=1, buckets=1, deadline=1.0, absent=(2,))
    assert time.monotonic() - t0 < 15
    assert errors, "ranks waiting for a dead peer must fail"
    assert set(errors) == {0, 1}
    assert all(isinstance(e, PeerFailure) for e in errors.values())
    assert "peer alive" in str(errors[0]) or "stopped answering" in str(errors[0])


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
    round, naming the peer - it does not aggregate what arrived."""
    _, outputs, _, errors = _run_world(
        ParameterServer, 2, ReliablePolicy, UnbiasedRescale(), rounds=1, buckets=1,
        deadline=1.0, losses=[_AfterFirst(2), _AfterFirst(2)])
    assert errors and all(isinstance(e, PeerFailure) for e in errors.values())
    assert any(re.search(r"from rank \d.* [12] of \d+ chunks arrived within the 1 s "
                         r"receive deadline, and this receive tolerates no loss", str(e))
               for e in errors.values()), errors
    assert not outputs


def test_shard_bounds_cover_everything():
    for n in (0, 1, 5, 1000):
        for w in (2, 3, 7):
            b = shard_bounds(n, w)
            assert b[0][0] == 0 and b[-1][1] == n
            assert all(lo <= hi for lo, hi in b)
            assert all(b[i][1] == b[i + 1][0] for i in range(w - 1))


def test_server_does_not_wait_for_its_broadcast_to_be_acknowledged():
    """Every STOP the worker sends the server is lost (a microburst on the server's
    downlink, made permanent): the server's round still ends once the pushes are in
    and its broadcast is out; the worker gets the exact mean; the unacknowledged send
    surfaces as PeerFailure two rounds later (never a hang), and close() waits for
    outstanding broadcasts instead of cutting them off."""
    from boundedloss import wire

    cfg = TransportConfig(chunk_bytes=1400, receive_deadline=5.0, peer_timeout=1.0)
    eps = [UdpEndpoint(session=SESSION, config=cfg) for _ in range(2)]
    deliver = eps[0].mux.datagram_received

    def no_stops(data, peer, now):
        if wire.decode(bytes(data))[0].kind != wire.Kind.STOP:
            deliver(data, peer, now)

    eps[0].mux.datagram_received = no_stops
    peers = [ep.address for ep in eps]
    colls = [ParameterServer(eps[r], r, peers, policy=ReliablePolicy(),
                             aggregator=UnbiasedRescale(), session=SESSION) for r in range(2)]
    x = [np.arange(5000, dtype=np.float32) * (r + 1) for r in range(2)]
    worker_out, worker_err = [], []

    def worker():
        try:
            for t in range(3):
                worker_out.append(colls[1].allreduce_mean(x[1], t)[0])
        except Exception as e:  # noqa: BLE001
            worker_err.append(e)

    th = threading.Thread(target=worker)
    th.start()
    try:
        out0, _ = colls[0].allreduce_mean(x[0], 0)
        [pending] = colls[0].unacknowledged_broadcasts(0)
        assert (pending.round_id, pending.worker) == (0, 1)
        assert not pending.future.done()  # returned with the STOP outstanding
        np.testing.assert_allclose(out0, (x[0] + x[1]) / 2)
        colls[0].allreduce_mean(x[0], 1)  # round 0's send may still be probing
        with pytest.raises(PeerFailure, match="rank 1"):
            colls[0].allreduce_mean(x[0], 2)  # ... but not forever
    finally:
        th.join(timeout=30)
        for c in colls:
            c.close()  # waits for the outstanding broadcast (it fails: swallowed)
        for ep in eps:
            ep.close()
    assert not th.is_alive()
    assert len(worker_out) >= 2
    np.testing.assert_allclose(worker_out[0], (x[0] + x[1]) / 2)


def test_a_round_closed_by_a_deadline_says_so():
    from boundedloss.collective import RoundStats

    def stats(*reasons: str) -> RoundStats:
        return RoundStats(round_id=0, bucket=0, latency_s=0.1, delivered_fraction=0.9,
                          min_delivered_fraction=0.8, retransmit_rounds=1, bound=0.1,
                          close_reasons=reasons)

    assert stats("bound_met", "deadline").deadline_closed
    assert not stats("bound_met", "complete", "accept_deadline").deadline_closed
