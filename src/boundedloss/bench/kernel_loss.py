"""`boundedloss bench kernel-loss`: gradient-exchange round latency under real kernel loss.

A kernel testbed (network namespaces: root, or a user namespace of its own) with 4
ranks: rank 0 in the server namespace, ranks 1-3 in worker namespaces. The switch drops
packets toward every namespace at random (nf_tables ``numgen random``), one wire packet
at a time (TCP and UDP alike, so Gloo's TCP sees the same loss as our UDP). Each rank
exchanges a gradient-sized float32 vector for ``rounds`` rounds - Gloo allreduce (TCP),
a parameter server over TCP (``tcp-ps``: gloo's point-to-point send and receive through
rank 0) or a boundedloss collective (the parameter server or the transpose allreduce,
``--topology``) under reliable, MLT (p = 1%) and DBLP (relaxed phase: P_low + k) - and
times every round. A round starts after a Gloo barrier; its latency runs from the moment
the last rank entered it to the moment the last rank left it (every rank logs both on
the monotonic clock the host's namespaces share). The barrier crosses the same lossy
links over TCP, so one rank may leave it a TCP retransmission timeout after the others:
timing each rank from its own start would charge that timeout - the harness's, not the
exchange's - to whichever system waits for that rank's data. The testbed's links have
the MTU ``--mtu`` (9,000: jumbo frames, as in data centres); boundedloss's chunks follow
it (one packet each, as ``register()`` picks them). Like ``register()``, boundedloss
authenticates every datagram by default (the key from BOUNDEDLOSS_SECRET[_FILE], else a
random one handed out at rendezvous); ``--auth on,off`` measures both, and each row says
how (``auth``). Gloo authenticates nothing.

``--repeats N`` runs every system N times, interleaved (every other repeat in reverse
order), and each row pools the rounds of its N runs: on a machine whose speed drifts,
one run's figures move by a few milliseconds from run to run.

On the lossless network a ``bare-udp`` row gives the machine's own limit
(:mod:`.bare_udp`): the transpose allreduce's datagrams with the same offloads and
nothing else - no acknowledgement, recovery, tag or aggregation.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..aggregate import UnbiasedRescale
from ..collective import TOPOLOGIES, Collective
from ..heap import freeze_heap
from ..net.udp import UdpEndpoint
from ..policy import TCP_PS, TCP_TOPOLOGIES, parse_policies, parse_policy
from ..protocol.credit import CREDIT_OFF, CreditSetting
from .bare_udp import BareExchange

#: what a run measures unless told otherwise (``boundedloss bench kernel-loss``'s defaults)
DEFAULT_SYSTEMS = ("gloo", "reliable", "mlt", "dblp")  # as parse_policy reads them
DEFAULT_LOSSES = (0.0, 0.01, 0.05)
DEFAULT_ELEMENTS = 1 << 20  # float32 values per round: 4 MB
DEFAULT_ROUNDS = 30
DEFAULT_TOPOLOGIES = ("ps", "allreduce")  # the published topologies (two-level on request)
DEFAULT_MTU = 1500  # Ethernet
DEFAULT_AUTHS = (True,)  # as a training job runs
#: the machine's own limit (lossless only): the transpose allreduce's datagrams alone
BARE_UDP = "bare-udp"


@dataclass(frozen=True)
class KernelLossRow:
    system: str
    topology: str  # a collective ("ps" for tcp-ps too), or "gloo" for gloo's allreduce
    mtu: int
    loss: float
    rounds: int
    elements: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    delivered_fraction: float
    #: how the datagrams were authenticated: "secret", "random" or "off" (gloo: "off",
    #: it authenticates nothing)
    auth: str = "off"
    #: runs of the arm, interleaved with the others'; the figures pool their rounds
    #: (``rounds`` each)
    repeats: int = 1
    #: the world: rank 0 in the server's namespace, one worker namespace per other rank
    ranks: int = 4
    #: our transport's receiver-driven credit per receiver, bytes (None: off)
    credit_bytes: int | None = None
    #: each receiver sized that budget from the overflows it saw, credit_bytes its floor
    credit_adaptive: bool = False
    #: what the nodes' TCP did, per round run (warm-up rounds included): retransmission
    #: timeouts, tail loss probes, segments retransmitted and, of those, the ones the
    #: receiver had already (D-SACK: not needed) - Linux's own counters, summed over the
    #: nodes (a TCP system's gradients; for ours, their barrier's)
    tcp_timeouts_per_round: float = 0.0
    tcp_loss_probes_per_round: float = 0.0
    tcp_retrans_segs_per_round: float = 0.0
    tcp_dsack_segs_per_round: float = 0.0
    #: of our sends (warm-up round included), the share whose last DATA carried their
    #: first PROBE (on warm paths that lose nothing); None for gloo, tcp-ps, bare-udp
    probes_carried_fraction: float | None = None
    #: between rounds (p50, ms): from when the last rank left a round to when the last
    #: entered the next - the Gloo barrier's time
    between_rounds_ms: float = 0.0
    #: how far apart the ranks entered a round (p50, ms): the first one's head start on
    #: the last, whose entry starts the round's time
    entry_spread_ms: float = 0.0
    #: the ranks' entries into a round in the order they came (p50 of each, ms after the
    #: first): the first is 0, the last the entry spread
    entry_order_ms: tuple[float, ...] = ()
    #: the ranks' processes' CPU a round (every thread, user and system; ms, all ranks
    #: together): from entering the round's barrier to leaving the round - what ``sim``
    #: rows' ``cpu_ms_per_round`` is charged as - and of it the barrier's part, each rank
    #: from its own entry (a parameter server's server, which leaves its round once its
    #: broadcast is posted, is still sending there). (The kernel's work outside the
    #: ranks' system calls, the switch's softirqs, is not in it.)
    cpu_ms_per_round: float = 0.0
    barrier_cpu_ms_per_round: float = 0.0


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


# ------------------------------------------------------------ one rank, in a namespace
def rank_main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--system", required=True, help="a policy as parse_policy reads it")
    ap.add_argument("--topology", choices=list(TOPOLOGIES), default="ps")
    ap.add_argument("--elements", type=int, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-auth", dest="auth", action="store_false")
    ap.add_argument("--credit", default="off", help="off, auto, or bytes")
    a = ap.parse_args(argv)

    from datetime import timedelta

    import numpy as np
    import torch
    import torch.distributed as dist

    from ..torch.tcp_ps import average_through_server

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = a.master
    os.environ["MASTER_PORT"] = str(a.port)
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=120))
    x = np.random.default_rng(a.rank).standard_normal(a.elements).astype(np.float32)
    starts, ends, fractions = [], [], []
    # (this process's CPU, every thread, at each round's barrier, start and end)
    cpu_marks: list[tuple[float, float, float]] = []
    spec = None if a.system == BARE_UDP else parse_policy(a.system)
    coll: Collective | None = None
    endpoint: UdpEndpoint | None = None
    loop: BareExchange | None = None
    auth = "off"
    from ..torch.rendezvous import (
        agree_chunk_bytes,
        agree_session,
        default_store,
        exchange_addresses,
        local_ip,
        rendezvous_auth,
    )

    if spec is None:
        from ..wire import HEADER_BYTES

        store = default_store()
        chunk = agree_chunk_bytes(store, "bench", a.rank, a.world, local_ip())
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((local_ip(), 0))
        peers = exchange_addresses(store, "bench", a.rank, a.world, sock.getsockname())
        loop = BareExchange(sock, a.rank, peers, x.nbytes, chunk, chunk + HEADER_BYTES)
    elif spec.uses_transport:
        from ..protocol.auth import TRAILER_BYTES
        from ..torch import hook_transport

        store = default_store()
        session = agree_session(store, "bench", a.rank)
        # as register() runs a job: authenticated chunks leave room for the tag
        chunk = agree_chunk_bytes(store, "bench", a.rank, a.world, local_ip(),
                                  trailer=TRAILER_BYTES if a.auth else 0)
        job_auth = rendezvous_auth(store, "bench", a.rank, a.world, session, enabled=a.auth)
        auth = job_auth.mode
        endpoint = UdpEndpoint(local_ip(), 0, session=session,
                               config=hook_transport(chunk_bytes=chunk,
                                                     **CreditSetting.from_str(a.credit).transport()),
                               auth_key=job_auth.key)
        peers = exchange_addresses(store, "bench", a.rank, a.world, endpoint.address)
        policy = spec.make()
        # steady gradient norms after warm-up: DBLP in its relaxed phase (the other
        # policies take no notice of epoch ends)
        policy.epoch_end(1.0)
        policy.epoch_end(1.0)
        coll = TOPOLOGIES[a.topology](endpoint, a.rank, peers, policy=policy,
                                      aggregator=UnbiasedRescale(), session=session)
    tensor = torch.from_numpy(x.copy())
    freeze_heap()  # (every system alike: no full collection of torch's objects mid-round)
    for t in range(a.rounds + 1):  # round 0 warms up (connections, first receives)
        cpu_barrier = time.process_time()
        dist.barrier()
        t0 = time.monotonic()
        cpu_start = time.process_time()
        if loop is not None:
            frac = loop.exchange(t)
        elif coll is None:
            tensor.copy_(torch.from_numpy(x))
            if spec is not None and spec.name == TCP_PS:
                average_through_server(tensor)
            else:
                dist.all_reduce(tensor)
            frac = 1.0
        else:
            _, st = coll.allreduce_mean(x, t, 0)
            frac = st.min_delivered_fraction
        if t:
            starts.append(t0)
            ends.append(time.monotonic())
            fractions.append(frac)
            cpu_marks.append((cpu_barrier, cpu_start, time.process_time()))
    # (our sends: how many finished, and how many carried their first PROBE)
    counted = {} if endpoint is None else endpoint.counters()
    Path(a.out, f"rank{a.rank}.json").write_text(
        json.dumps({"start": starts, "end": ends, "frac": fractions, "cpu": cpu_marks,
                    "auth": auth,
                    "sends": counted.get("sends_finished", 0),
                    "probes_carried": counted.get("probes_carried", 0)}))
    dist.barrier()
    if coll is not None:
        coll.close()
    if endpoint is not None:
        endpoint.close()
    if loop is not None:
        loop.sock.close()
    dist.destroy_process_group()


def round_latencies_ms(per_rank: list[dict]) -> list[float]:
    """Each round's latency (ms) from every rank's ``start``/``end`` times: from when the
    last rank entered the round to when the last rank left it."""
    rounds = len(per_rank[0]["start"])
    return [(max(rk["end"][i] for rk in per_rank) - max(rk["start"][i] for rk in per_rank))
            * 1e3 for i in range(rounds)]


def between_rounds_ms(per_rank: list[dict]) -> list[float]:
    """The time (ms) from when the last rank left each round to when the last rank
    entered the next: the barrier's, as the rounds see it."""
    rounds = len(per_rank[0]["start"])
    return [(max(rk["start"][i + 1] for rk in per_rank) - max(rk["end"][i] for rk in per_rank))
            * 1e3 for i in range(rounds - 1)]


def entry_offsets_ms(starts) -> np.ndarray:
    """From each rank's entry into each round (``starts[rank][round]``, seconds): each
    round's entries (row i: round i's), ms after its first, in the order the ranks
    entered - the last, how far apart they entered. (The simulator's rows read theirs
    with this too.)"""
    starts = np.asarray(starts, dtype=float)
    return np.sort(starts - starts.min(axis=0), axis=0).T * 1e3


def ranks_cpu_ms(per_rank: list[dict]) -> tuple[float, float]:
    """The ranks' processes' CPU (every thread, user and system; ms, all ranks
    together, the mean a round): from entering a round's barrier to leaving the round,
    and of that the part in the barrier."""
    rounds = len(per_rank[0]["cpu"])
    whole = sum(rk["cpu"][i][2] - rk["cpu"][i][0] for rk in per_rank for i in range(rounds))
    barrier = sum(rk["cpu"][i][1] - rk["cpu"][i][0] for rk in per_rank for i in range(rounds))
    return 1e3 * whole / rounds, 1e3 * barrier / rounds


# ------------------------------------------------------------------- driver (root)
#: (system, topology, authenticated, credit)
Arm = tuple[str, str, bool, CreditSetting]
DEFAULT_RANKS = 4
#: the most ranks this bench runs (each rank a process: 2 cores hold no more)
MAX_RANKS = 16


def nodes_for(ranks: int) -> list[str]:
    """The testbed nodes of ``ranks`` ranks, rank 0 (a parameter server's) first."""
    return ["server", *(f"w{i}" for i in range(ranks - 1))]


def interleaved(arms: list[Arm], repeats: int) -> list[Arm]:
    """The order the arms run in: each once per repeat, every other repeat in reverse, so
    that a drift in the machine's speed over the run weighs on every arm alike."""
    return [arm for rep in range(repeats) for arm in (arms if rep % 2 == 0 else arms[::-1])]


def _run_arm(tb, arm: Arm, loss: float, port: int, elements: int, rounds: int,
             master: str, nodes: list[str]) -> tuple[list[dict], dict[str, int]]:
    """One run of ``arm``: a rank in each of ``nodes``; each rank's log, and what the
    nodes' TCP counted meanwhile (``tcp_counters``)."""
    from ..emulate import tcp_counters

    system, topology, auth, credit = arm
    world = len(nodes)
    tcp_before = tb.tcp_counters()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp, f"rank{r}.log"), "w") for r in range(world)]
        procs = [
            tb.run(node, [sys.executable, "-m", "boundedloss.bench.kernel_loss",
                          "--rank", str(r), "--world", str(world), "--master", master,
                          "--port", str(port), "--system", system,
                          "--elements", str(elements), "--rounds", str(rounds),
                          *(["--topology", topology] if topology in TOPOLOGIES else []),
                          *([] if auth else ["--no-auth"]),
                          "--credit", str(credit),
                          "--out", tmp],
                   stdout=logs[r], stderr=subprocess.STDOUT)
            for r, node in enumerate(nodes)
        ]
        deadline = time.monotonic() + 600
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # a hung rank must not hang us
                for q in procs:
                    q.kill()
                raise RuntimeError(f"{system} at {loss * 100:g}% loss did not finish "
                                   "within 600 s") from None
        for f in logs:
            f.close()
        if any(p.returncode for p in procs):
            bad = next(r for r, p in enumerate(procs) if p.returncode)
            tail = Path(tmp, f"rank{bad}.log").read_text().strip().splitlines()[-3:]
            raise RuntimeError(f"{system} at {loss * 100:g}% loss: rank {bad} failed "
                               f"(exit {procs[bad].returncode}): {' | '.join(tail)}")
        ranks_logs = [json.loads(Path(tmp, f"rank{r}.json").read_text())
                      for r in range(world)]
    return ranks_logs, tcp_counters.difference(tcp_before, tb.tcp_counters())


def run_kernel_loss_bench(
    *,
    losses: tuple[float, ...] = DEFAULT_LOSSES,
    systems: tuple[str, ...] = DEFAULT_SYSTEMS,
    elements: int = DEFAULT_ELEMENTS,
    rounds: int = DEFAULT_ROUNDS,
    topologies: tuple[str, ...] = DEFAULT_TOPOLOGIES,
    mtu: int = DEFAULT_MTU,
    auths: tuple[bool, ...] = DEFAULT_AUTHS,
    bare: bool = True,
    repeats: int = 1,
    ranks: int = DEFAULT_RANKS,
    credits: tuple[CreditSetting, ...] = (CREDIT_OFF,),
    progress: Callable[[str], None] | None = None,
) -> list[KernelLossRow]:
    """One row per loss rate, system (each as :func:`~boundedloss.policy.parse_policy`
    reads it; ``ValueError`` for a bad one, before the testbed comes up), topology and
    authentication (gloo: one row, its own allreduce, unauthenticated); with ``bare``,
    first at 0% loss the machine's own limit (:data:`BARE_UDP`). With ``repeats``, every
    arm runs that many times, interleaved (:func:`interleaved`), and its row's figures
    pool the rounds of all of them. ``ranks``: the world (2 to :data:`MAX_RANKS`);
    ``credits``: our transport's receiver-driven credit, an arm each."""
    from ..emulate import Testbed, TestbedConfig

    specs = parse_policies(systems)
    unknown = [t for t in topologies if t not in TOPOLOGIES]
    if unknown:
        raise ValueError(f"unknown topology {unknown[0]!r}; choose from "
                         f"{', '.join(TOPOLOGIES)}")
    if not auths or len(set(auths)) != len(auths):
        raise ValueError("auths: on and/or off, each once")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    if not 2 <= ranks <= MAX_RANKS:
        raise ValueError(f"ranks must be 2 to {MAX_RANKS}, got {ranks}")
    nodes = nodes_for(ranks)
    if not credits or len(set(credits)) != len(credits):
        raise ValueError("credits: each once")
    arms: list[Arm] = [(str(spec), topology, auth, credit) for spec in specs
                       for topology in (topologies if spec.uses_transport
                                        else (TCP_TOPOLOGIES[spec.name],))
                       for auth in (auths if spec.uses_transport else (False,))
                       for credit in (credits if spec.uses_transport else (CREDIT_OFF,))]
    rows = []
    with Testbed(TestbedConfig(workers=ranks - 1, mtu=mtu)) as tb:
        master = tb.addresses["server"]
        port = 29500
        for loss in losses:
            for node in nodes:
                tb.set_loss(loss, node, protocol="all")
            these = ([(BARE_UDP, "allreduce", False, CREDIT_OFF)] if bare and not loss
                     else []) + arms
            runs: dict[Arm, list[list[dict]]] = {arm: [] for arm in these}  # per-rank logs
            tcp: dict[Arm, Counter[str]] = {arm: Counter() for arm in these}
            for arm in interleaved(these, repeats):
                port += 1
                ranks_logs, counted = _run_arm(tb, arm, loss, port, elements, rounds,
                                               master, nodes)
                runs[arm].append(ranks_logs)
                tcp[arm].update(counted)
                if progress:
                    p50 = _percentile(round_latencies_ms(runs[arm][-1]), 0.5)
                    progress(f"{arm[0]} ({arm[1]}) at {loss * 100:g}% loss, run {len(runs[arm])} "
                             f"of {repeats}: p50 {p50:.1f} ms")
            for arm, logs in runs.items():
                system, topology, _, credit = arm
                run_rounds = (rounds + 1) * len(logs)  # (round 0, the warm-up, too)
                lat = [ms for per_rank in logs for ms in round_latencies_ms(per_rank)]
                frac = [min(rk["frac"][i] for rk in per_rank)
                        for per_rank in logs for i in range(rounds)]
                gaps = [ms for per_rank in logs for ms in between_rounds_ms(per_rank)]
                entries = [o for per_rank in logs
                           for o in entry_offsets_ms([rk["start"] for rk in per_rank]).tolist()]
                spreads = [o[-1] for o in entries]
                cpu = [ranks_cpu_ms(per_rank) for per_rank in logs]
                sends = sum(rk.get("sends", 0) for per_rank in logs for rk in per_rank)
                carried = sum(rk.get("probes_carried", 0) for per_rank in logs for rk in per_rank)
                rows.append(KernelLossRow(
                    system=system, topology=topology, mtu=mtu, loss=loss, rounds=rounds,
                    elements=elements,
                    p50_ms=round(_percentile(lat, 0.5), 2), p99_ms=round(_percentile(lat, 0.99), 2),
                    max_ms=round(max(lat), 2), mean_ms=round(statistics.mean(lat), 2),
                    delivered_fraction=round(statistics.mean(frac), 5),
                    auth=logs[0][0]["auth"], repeats=repeats, ranks=ranks,
                    credit_bytes=credit.budget_bytes, credit_adaptive=credit.adaptive,
                    tcp_timeouts_per_round=round(tcp[arm]["tcp_timeouts"] / run_rounds, 4),
                    tcp_loss_probes_per_round=round(
                        tcp[arm]["tcp_loss_probes"] / run_rounds, 4),
                    tcp_retrans_segs_per_round=round(
                        tcp[arm]["tcp_retrans_segs"] / run_rounds, 4),
                    tcp_dsack_segs_per_round=round(tcp[arm]["tcp_dsack_segs"] / run_rounds, 4),
                    probes_carried_fraction=round(carried / sends, 4) if sends else None,
                    between_rounds_ms=round(_percentile(gaps, 0.5), 2) if gaps else 0.0,
                    entry_spread_ms=round(_percentile(spreads, 0.5), 2),
                    entry_order_ms=tuple(round(_percentile([o[k] for o in entries], 0.5), 2)
                                         for k in range(ranks)),
                    cpu_ms_per_round=round(statistics.mean(c for c, _ in cpu), 2),
                    barrier_cpu_ms_per_round=round(statistics.mean(b for _, b in cpu), 2),
                ))
    return rows


if __name__ == "__main__":
    rank_main()
