"""`boundedloss bench burst`: one parameter-server round inside a microburst, simulated.

The same TransferMux cores as the real endpoints, driven by FakeNetwork on a virtual
clock: workers push a gradient to a server whose receiver loses ``rate`` of everything
(DBLP's microburst: 60-90% loss at one receiver for one round, on top of 1% random loss
everywhere), then the server broadcasts the result back reliably. The round ends when
every worker has the result and its push is acknowledged (what a worker waits for).
Each transfer takes its links' serialisation time and the path's delay, and *no CPU
time*: this is the protocol on a line-rate data path, where a retransmission pass costs
a round trip - unlike our loopback runs (`compare --scenario microburst`), where a
Python endpoint spends microseconds per datagram and the passes are bound by that.

A few lossless rounds come first so that every peer's round-trip estimate is learned,
as it is in training; only the burst round is measured. Arms: the fixed-bound baseline
(P = P_low) against DBLP outside a critical regime (P = P_low + k).

``probe_copies_max=1`` takes away the PROBE copies: a PROBE (or its answer) lost in the
burst then costs a retransmission timeout, as in a protocol that recovers by timeouts -
what the published baseline's burst rounds appear to have paid.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..net.fake import FakeNetwork, NodeProfile, PathProfile
from ..net.loss import Bernoulli, parse_loss_spec
from ..policy import FixedBoundPolicy, PhaseAwarePolicy, ReliablePolicy
from ..protocol import TransferMux, TransportConfig

SESSION = 0xB0B5
WARMUP_ROUNDS = 3
BASE_LOSS = 0.01


@dataclass(frozen=True)
class BurstRow:
    burst_loss: float
    message_mb: float
    link_gbps: float
    rtt_us: float
    workers: int
    seeds: int
    baseline_round_ms: float  # median over seeds
    dblp_round_ms: float
    speedup: float  # baseline / DBLP, of the medians
    baseline_push_ms: float  # the round's pushes alone: until the server closed them all
    dblp_push_ms: float
    push_speedup: float
    baseline_passes: float  # retransmission passes the server's receives took (median)
    dblp_passes: float
    baseline_datagrams: float  # DATA datagrams the workers sent in the round (median)
    dblp_datagrams: float
    normal_round_ms: float  # a round of the same arm outside the burst (1% loss), baseline
    probe_copies_max: int  # TransportConfig.probe_copies_max of both arms


def _round(net: FakeNetwork, server: TransferMux, workers: list[TransferMux], names: list[str],
           round_id: int, msg: np.ndarray, bound: float) -> tuple[float, float, int, int]:
    """One PS round from now: (its duration, the pushes' part of it - until the server
    has closed every push -, the most retransmission passes a push took, the DATA
    datagrams the pushes sent)."""
    t0 = net.now
    nbytes = msg.nbytes
    pushes_in = [server.start_receive(n, round_id, 0, t0, policy=FixedBoundPolicy(bound),
                                      nbytes=nbytes) for n in names]
    results = [w.start_receive("server", round_id, 1, t0, policy=ReliablePolicy(), nbytes=nbytes)
               for w in workers]
    pushes = [w.start_send("server", round_id, 0, msg, t0) for w in workers]
    t = net.run_until_done(pushes_in)
    for n in names:  # the server does not wait for its broadcasts to be acknowledged
        server.start_send(n, round_id, 1, msg, t)
    end = net.run_until_done(results + pushes)
    # (run_until_done returned: every one of them has its result)
    push_in_stats = [r.result.stats for r in pushes_in if r.result is not None]
    push_out_stats = [p.result.stats for p in pushes if p.result is not None]
    passes = max(s.retransmit_rounds for s in push_in_stats)
    sent = sum(s.datagrams for s in push_out_stats)
    return end - t0, t - t0, passes, sent


def simulate_round(burst_loss: float, bound: float, *, seed: int, message_bytes: int,
                   link_bps: float, rtt: float, workers: int,
                   config: TransportConfig | None = None) -> dict:
    """The burst round of one seed under one bound, after the warm-up rounds."""
    cfg = config or TransportConfig()
    net = FakeNetwork(seed=seed, path=PathProfile(delay=rtt / 2))
    burst_round = WARMUP_ROUNDS + 1
    server_loss = parse_loss_spec(
        f"bernoulli:{BASE_LOSS}+burst:rate={burst_loss},rounds={burst_round}", seed=seed)
    server = net.attach("server", TransferMux(SESSION, cfg),
                        NodeProfile(up_bps=link_bps, down_bps=link_bps, loss=server_loss))
    names = [f"w{i}" for i in range(workers)]
    muxes = [net.attach(n, TransferMux(SESSION, cfg),
                        NodeProfile(up_bps=link_bps, down_bps=link_bps,
                                    loss=Bernoulli(BASE_LOSS, seed=seed * 100 + i)))
             for i, n in enumerate(names)]
    msg = np.random.default_rng(seed).standard_normal(message_bytes // 4).astype(np.float32)
    normal = None
    for r in range(burst_round + 1):
        took, push, passes, sent = _round(net, server, muxes, names, r, msg, bound)
        if r == burst_round - 1:
            normal = took
        net.run(until=net.now + 10 * rtt)  # the gap between rounds (compute)
    return {"round_s": took, "push_s": push, "passes": passes, "datagrams": sent,
            "normal_s": normal}


def run_burst_bench(*, rates: list[float], message_mb: float, link_gbps: float, rtt_us: float,
                    workers: int, seeds: int, probe_copies_max: int | None = None,
                    progress: Callable[[str], None] | None = None) -> list[BurstRow]:
    config = TransportConfig() if probe_copies_max is None else TransportConfig(
        probe_copies_max=probe_copies_max)
    dblp = PhaseAwarePolicy()  # its defaults: P_low, and P_low + k outside a CLR
    low, high = dblp.p_low, dblp.p_high
    nbytes = int(message_mb * 1e6) // 4 * 4
    rows = []
    for q in rates:
        got: dict[float, list[dict]] = {low: [], high: []}
        for s in range(seeds):
            if progress:
                progress(f"burst loss {q:.0%}: seed {s + 1}/{seeds}")
            for bound in (low, high):
                got[bound].append(simulate_round(
                    q, bound, seed=s, message_bytes=nbytes, link_bps=link_gbps * 1e9,
                    rtt=rtt_us * 1e-6, workers=workers, config=config))
        rows.append(_row(got, low, high, q, message_mb=message_mb, link_gbps=link_gbps,
                         rtt_us=rtt_us, workers=workers, seeds=seeds,
                         probe_copies_max=config.probe_copies_max))
    return rows


def _row(got: dict[float, list[dict]], low: float, high: float, burst_loss: float,
         **setting: Any) -> BurstRow:
    """The medians over seeds of both arms: ``low`` (the baseline's bound) and ``high``
    (DBLP's outside a critical regime)."""

    def med(bound: float, key: str) -> float:
        return float(statistics.median(g[key] for g in got[bound]))

    base, dblp = med(low, "round_s"), med(high, "round_s")
    return BurstRow(
        burst_loss=burst_loss, baseline_round_ms=base * 1e3,
        dblp_round_ms=dblp * 1e3, speedup=base / dblp,
        baseline_push_ms=med(low, "push_s") * 1e3, dblp_push_ms=med(high, "push_s") * 1e3,
        push_speedup=med(low, "push_s") / med(high, "push_s"),
        baseline_passes=med(low, "passes"), dblp_passes=med(high, "passes"),
        baseline_datagrams=med(low, "datagrams"), dblp_datagrams=med(high, "datagrams"),
        normal_round_ms=med(low, "normal_s") * 1e3, **setting,
    )
