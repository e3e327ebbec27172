"""One simulated data-parallel exchange: ``workers`` ranks, each a program on a
:class:`~..net.simulated.SimRuntime`, run the product's own collective (the
parameter server or the transpose allreduce, under a policy of ours - DBLP in its
relaxed phase, as ``bench kernel-loss`` runs it) or a baseline over the TCP model
(``baselines.py``: gloo's ring allreduce, ``tcp-ps``) over a
:class:`~..net.fake.FakeNetwork`, for ``rounds`` rounds of an ``elements``-float
gradient.

The network: every host has an uplink and a downlink of ``link_gbps`` (a star through
one switch - a rack; or ``racks`` of them under a spine, each rack's uplink its hosts'
links together over ``oversubscription``), a drop-tail queue of ``queue_datagrams`` at
the switch's port toward each host (its downlink) and at each spine link, a one-way
delay of ``delay_us`` on every path, and
random loss of ``loss`` on every path. Computing takes no virtual time unless the job
names a CPU preset (``CPU_PRESETS``): then every host's work is charged to its cores.
With ``background``, every host also carries other tenants' open-loop traffic over
the same links and queues (``net/background.py``), counted apart from the job's.

Rounds are timed as ``bench kernel-loss`` times them: every rank waits at a barrier
before each round, and a round lasts from when the last rank entered it to when the
last rank left it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np

from .. import wire
from ..aggregate import make_aggregator
from ..bench.kernel_loss import MAX_RANKS as TESTBED_MAX_RANKS
from ..bench.kernel_loss import entry_offsets_ms
from ..collective import TOPOLOGIES
from ..emulate import qdisc
from ..net.background import BackgroundTraffic, start_background
from ..net.buffer import SharedBuffer
from ..net.cpu import CpuCosts, Interference
from ..net.fabric import Fabric, FabricProfile
from ..net.fake import FakeNetwork, NodeProfile, PathProfile
from ..net.loss import (
    Bernoulli,
    Bottleneck,
    Combined,
    LossModel,
    Microburst,
    components,
    parse_loss_spec,
)
from ..net.simulated import SimEndpoint, SimRuntime
from ..net.udp import IPV4_UDP_OVERHEAD, largest_chunk
from ..policy import TCP_TOPOLOGIES, parse_policy
from ..protocol import TransportConfig
from ..protocol.auth import TRAILER_BYTES
from .barrier import make_barrier
from .baselines import EXCHANGES, SimTcp
from .tcp import is_data_segment

#: the simulated job's session token and key (a simulation authenticates as a job does)
SESSION = 0x5EED_0000_0000_0001
KEY = bytes(range(32))


@dataclass(frozen=True)
class CpuPreset:
    """A host's CPU costs, and whether the hosts share one machine's cores."""

    costs: CpuCosts | None
    shared_cores: int | None  # None: every host has a core of its own
    #: the TCP baselines' hosts' (gloo, tcp-ps): the kernel's TCP path per byte, and
    #: per message the caller's
    tcp_costs: CpuCosts | None = None
    #: the time the cores lose to work the simulation does not run (None: none)
    interference: Interference | None = None
    #: how long our hosts' I/O thread takes to run once woken on busy cores
    #: (NodeProfile.wake_s; none of the presets has one: BENCHMARKS.md, "A woken
    #: thread's wait")
    wake_s: float = 0.0


#: What a rank's CPU spends on this machine (2 cores), per datagram and per byte at
#: any MTU: :func:`costs_across_mtus` of the costs two ``tools/round_cpu.py`` pairs
#: measured at MTU 1,500 and 9,000 the same day (reliable, transpose allreduce,
#: authenticated, 4 and 16 ranks, 4 MB; ``python tools/sim_calibrate.py``, read through
#: :func:`costs_from_round_cpu`: benchmarks/sim-calibration-{1500,9000}-d.json), the
#: same day as the TCP costs below - a preset's two costs are one day's, as this
#: machine's speed drifts by a fifth from day to day. (One MTU's per-byte costs alone
#: - 1,500's, before - charged a rank at 9,000 2.3x what it spent sending there.)
MEASURED_COSTS = CpuCosts(datagram_out=0.7567e-6, byte_out=0.2587e-9,
                          datagram_in=0.1966e-6, byte_in=0.4040e-9,
                          message_io=38.17e-6, message_main=42.11e-6,
                          post_io=231.8e-6, post_main=317.3e-6,
                          datagram_core=36.04e-6)


def costs_across_mtus(*measured: tuple[int, CpuCosts]) -> CpuCosts:
    """One rank's costs for every MTU, from costs measured at two (``(mtu, costs)``, as
    :func:`costs_from_round_cpu` reads them, authenticated): what sending and taking in
    cost per byte of gradient at each splits into a cost per datagram and one per byte
    of it, as the simulator charges them (a DATA datagram of the chunk the MTU allows:
    a cost per gradient byte c = (datagram + length * byte) / chunk at each MTU - two
    equations, two unknowns). What depends on no MTU (per message, per posting call,
    per datagram the core handles) is the two measurements' mean."""
    if len({mtu for mtu, _ in measured}) != 2 or len(measured) != 2:
        raise ValueError("costs across MTUs come from two measurements at two MTUs")
    chunks = [largest_chunk(mtu, TRAILER_BYTES) for mtu, _ in measured]
    lengths = [mtu - IPV4_UDP_OVERHEAD for mtu, _ in measured]
    a = np.array([[1.0 / c, n / c] for c, n in zip(chunks, lengths)])

    def split(name: str) -> tuple[float, float]:
        per_datagram, per_byte = np.linalg.solve(
            a, np.array([getattr(costs, name) for _, costs in measured]))
        return float(per_datagram), float(per_byte)

    def mean(name: str) -> float:
        return float(np.mean([getattr(costs, name) for _, costs in measured]))

    datagram_out, byte_out = split("byte_out")
    datagram_in, byte_in = split("byte_in")
    return CpuCosts(datagram_out=datagram_out, byte_out=byte_out,
                    datagram_in=datagram_in, byte_in=byte_in,
                    **{name: mean(name) for name in (
                        "message_io", "message_main", "post_io", "post_main",
                        "datagram_core")})


def costs_from_round_cpu(*figures: dict) -> CpuCosts:
    """A rank's costs from ``tools/round_cpu.py --json``'s figures for a transpose
    allreduce (its world, elements and per-step milliseconds a rank and round). From
    figures of two or more world sizes, what each thread spends beyond the bytes and the
    handed datagrams splits into a cost per posting call and one per message (least
    squares: a round posts four batches whatever the world, and 4(N-1) messages); from
    one world size, it is all per message."""
    if any(f["topology"] != "allreduce" for f in figures):
        raise ValueError("costs are read from a transpose allreduce's figures")
    per_byte, io_rest, main, counts = [], [], [], []
    for f in figures:
        n, steps, calls = f["ranks"], f["steps_ms"], f["calls"]
        moved = 2 * (n - 1) * 4 * f["elements"] / n  # bytes out, and in, a rank-round
        # (what reached the Python core: each datagram handed to it, and each one the
        # compiled path took and handed it the decision of - as the simulator counts
        # them, ``TransferMux.core_datagrams``)
        core_steps = ("    core: handed back", "    core: handed back (plain)",
                      "    core: a taken one's decision")
        core = sum(steps.get(step, 0.0) for step in core_steps)
        handed = sum(calls.get(step, 0) for step in core_steps)
        taking = steps["receive (recvmmsg, take)"] - core
        sending = steps["send runs (tags, sendmsg)"]
        per_byte.append((1e-3 * sending / moved, 1e-3 * taking / moved,
                         1e-3 * core / handed if handed else 0.0))
        io_rest.append(1e-3 * (steps["I/O thread, all"] - taking - sending - core))
        main.append(1e-3 * steps["collective call"])
        counts.append((calls["  post receives"] + calls["  post sends"],
                       2 * 2 * (n - 1)))  # (posting calls, receives and sends)
    byte_out, byte_in, datagram_core = (float(np.mean(c)) for c in zip(*per_byte))
    if len({m for _, m in counts}) > 1:
        a = np.array(counts, dtype=float)
        (post_io, message_io), *_ = np.linalg.lstsq(a, np.array(io_rest), rcond=None)
        (post_main, message_main), *_ = np.linalg.lstsq(a, np.array(main), rcond=None)
    else:
        messages = counts[0][1]
        post_io = post_main = 0.0
        message_io = float(np.mean(io_rest)) / messages
        message_main = float(np.mean(main)) / messages
    return CpuCosts(byte_out=byte_out, byte_in=byte_in, message_io=float(message_io),
                    message_main=float(message_main), post_io=float(post_io),
                    post_main=float(post_main), datagram_core=datagram_core)


#: What a TCP baseline's host spends on this machine: fitted to what a round of gloo's
#: ring (4 MB) cost the whole machine at 4, 8 and 16 ranks and at MTU 1,500 and 9,000,
#: every process together (``tools/round_perf.py``; the fit ``tools/tcp_fit.py``,
#: benchmarks/tcp-costs-perf-both.json): per byte, per segment (which the two MTUs tell
#: apart) and per message, a byte and a segment out and in split as one flow's bulk
#: transfer splits them (``tools/tcp_cpu.py``). (Fitted per byte and message at MTU
#: 1,500 alone, before - 1.63 ns a byte, 56.7 us a message, another day - they charged
#: the ring at MTU 9,000 about 1.3x more, against the testbed, than at 1,500.)
MEASURED_TCP_COSTS = CpuCosts(byte_out=0.8013e-9, byte_in=0.1791e-9,
                              datagram_out=0.1990e-6, datagram_in=0.0445e-6,
                              message_main=37.17e-6)

#: The time this machine's cores lose to work a simulation does not run, beside a job's
#: ranks (net.cpu.Interference): of a grid of spell rates and lengths, the one whose
#: simulated p50s and p99s came nearest the testbed's on the rows the costs were measured
#: on (gloo's lossless ring, reliable's lossless allreduce; within 11.4%):
#: ``python tools/sim_calibrate.py --again benchmarks/sim-calibration-1500.json
#: --fit-interference``. (A probe of the idle machine, ``tools/cpu_gaps.c``, reads the
#: same order: 1.1% and 2.0% of its two cores lost in 30 s, spells of 1 ms or more 1.6 a
#: second on one of them, 4.7 ms on average - benchmarks/cpu-gaps-idle.json.)
MEASURED_INTERFERENCE = Interference(rate_hz=5.0, mean_s=4e-3)

CPU_PRESETS = {
    #: computing takes no time: the network's and the protocol's figures alone
    "none": CpuPreset(None, None),
    #: every rank on this machine's 2 cores, as the kernel testbed runs them
    "this-machine": CpuPreset(MEASURED_COSTS, 2, MEASURED_TCP_COSTS, MEASURED_INTERFERENCE),
    #: a cluster node: a rank to itself on a core as fast as this machine's
    "cluster-node": CpuPreset(MEASURED_COSTS, None, MEASURED_TCP_COSTS),
}


class KernelTestbedSettings(TypedDict):
    """The SimJob settings that make its network and CPU the kernel testbed's."""

    link_gbps: float
    delay_us: float
    queue_datagrams: int
    cpu: str


#: ``boundedloss sim --like-testbed``: the kernel testbed as ``bench kernel-loss`` runs
#: it - veths with no rate limit (the CPU is the limit: the preset's costs include the
#: kernel's forwarding), the switch ports' pfifo of 1,000 packets, every rank on this
#: machine's 2 cores (and, unless --mtu says otherwise, its MTU of 1,500). (Not its
#: Gloo barrier between rounds: ``barrier="gloo"`` models it, and moves the calibrated
#: rows no nearer the testbed's - BENCHMARKS.md, "The barrier between rounds".)
LIKE_TESTBED: KernelTestbedSettings = {"link_gbps": 100.0, "delay_us": 10.0,
                                       "queue_datagrams": 1000, "cpu": "this-machine"}
LIKE_TESTBED_MTU = 1500


@dataclass(frozen=True)
class SimJob:
    workers: int
    system: str  # a policy of ours, as the command line writes it
    topology: str  # "ps" or "allreduce"
    loss: float
    elements: int
    rounds: int
    seed: int = 0
    #: a loss model for every path instead of ``loss``'s random loss, as a loss spec
    #: (net.loss.parse_loss_spec: Gilbert-Elliott bursts, time windows of heavy loss)
    loss_model: str = ""
    link_gbps: float = 10.0
    delay_us: float = 5.0
    queue_datagrams: int = 1024
    #: the links' MTU: a chunk's datagram fills one packet (9,000: the testbed's)
    mtu: int = 9000
    auth: bool = True
    cpu: str = "none"  # a CPU_PRESETS name
    #: racks under one spine (1: one switch), the workers spread evenly, and how far a
    #: rack's uplink falls short of its hosts' links together
    racks: int = 1
    oversubscription: float = 1.0
    #: costs that replace the preset's (a calibration's own measurement): our hosts',
    #: and the TCP baselines'
    cpu_costs: CpuCosts | None = None
    tcp_costs: CpuCosts | None = None
    #: the cores' interference, in place of the preset's (None: the preset's;
    #: ``Interference(0, 0)``: none)
    cpu_interference: Interference | None = None
    #: our hosts' I/O thread's wake on busy cores, seconds, in place of the preset's
    #: (None: the preset's)
    cpu_wake_s: float | None = None
    #: our systems' receiver-driven credit budget per receiver, bytes (None: no credit;
    #: TransportConfig.credit_bytes)
    credit_bytes: int | None = None
    #: each receiver sizes the budget from the overflows it sees, credit_bytes its floor
    #: (TransportConfig.credit_adaptive)
    credit_adaptive: bool = False
    #: our systems' sender-side congestion control (TransportConfig.congestion)
    congestion: str = "off"
    #: each switch queue toward a host also bounded in bytes (None: datagrams only)
    queue_bytes: int | None = None
    #: the switch's ports draw from one buffer of this many bytes (net/buffer.py; None:
    #: each its own queue)
    shared_buffer_bytes: int | None = None
    #: other tenants' traffic on every host's links and the switch's queues (None, or a
    #: rate of 0: none)
    background: BackgroundTraffic | None = None
    #: the server's (rank 0's) downlink as a token-bucket bottleneck, as the kernel
    #: testbed's incast puts a tbf on the switch port into it; its queue is the tbf's
    #: limit in bytes (None: a link like the others)
    bottleneck: qdisc.Bottleneck | None = None
    #: what the ranks wait at before each round (sim/barrier.py: ``instant``, or
    #: ``gloo``'s over the TCP model, as bench kernel-loss's ranks do)
    barrier: str = "instant"

    def host_costs(self) -> CpuCosts | None:
        """What our systems' hosts are charged (None: computing takes no time): the
        job's own costs, or its preset's."""
        return self.cpu_costs or CPU_PRESETS[self.cpu].costs

    def interference(self) -> Interference | None:
        """The time the hosts' cores lose (None: none): the job's own, or its preset's."""
        spec = self.cpu_interference or CPU_PRESETS[self.cpu].interference
        return spec if spec is not None and spec.active else None

    def wake_s(self) -> float:
        """How long our hosts' I/O thread takes to run once woken on busy cores: the
        job's own, or its preset's."""
        return CPU_PRESETS[self.cpu].wake_s if self.cpu_wake_s is None else self.cpu_wake_s

    def posts_ahead_in_last_round(self) -> bool:
        """Whether the last round posts a next round's receives, which nothing uses:
        only where posting costs the hosts' CPU virtual time (left out, the rows are the
        same, and a one-round job holds a third fewer messages)."""
        return self.host_costs() is not None


@dataclass(frozen=True)
class SimRow:
    workers: int
    system: str
    topology: str
    loss: float
    rounds: int
    elements: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    #: datagrams that left a host's uplink (the simulation's work)
    sim_datagrams: int
    #: datagrams lost at a full queue (incast), and on the paths (random loss)
    queue_drops: int
    path_losses: int
    #: the figures' source: virtual time; wall_s is what simulating it took here
    wall_s: float
    seed: int
    cpu: str = "none"
    #: the loss spec every path ran, if not ``loss``'s random loss; the share of the
    #: datagrams sent that the paths lost
    loss_model: str = ""
    path_loss_fraction: float = 0.0
    racks: int = 1
    oversubscription: float = 1.0
    #: datagrams lost at a full queue to or from the spine
    fabric_drops: int = 0
    credit_bytes: int | None = None
    credit_adaptive: bool = False
    queue_bytes: int | None = None
    shared_buffer_bytes: int | None = None
    congestion: str = "off"
    #: of the datagrams carrying payload (our DATA, the TCP model's data segments), the
    #: share lost at a full queue (a switch port's or the fabric's)
    payload_drop_fraction: float = 0.0
    #: the background traffic's spec ("": none), the bytes it sent, and its datagrams
    #: lost at full queues (a switch port's or the fabric's) - none of them the job's
    background: str = ""
    background_bytes: int = 0
    background_drops: int = 0
    #: datagrams a burst at a rank's host (``rank=`` in the loss spec) lost there
    node_losses: int = 0
    #: the bottleneck in front of rank 0 ("": none), as tc would describe its tbf, and
    #: the share of the datagrams offered to it that its queue dropped (as the testbed's
    #: qdisc counts them)
    bottleneck: str = ""
    bottleneck_drop_fraction: float | None = None
    #: with bursts in time (``window=``, ``every_s=``): the rounds that overlapped one,
    #: their mean, the other rounds' median, and the one over the other (as ``compare``
    #: reports a burst round against a normal one); None without such bursts
    burst_rounds: int = 0
    burst_round_ms_mean: float | None = None
    normal_round_ms_p50: float | None = None
    burst_over_normal_round: float | None = None
    #: the TCP baselines (gloo, tcp-ps): what the TCP model did per round, summed over
    #: the hosts - retransmission timeouts, tail loss probes, segments retransmitted (as
    #: bench kernel-loss reads Linux's own counters); None for our systems
    tcp_timeouts_per_round: float | None = None
    tcp_loss_probes_per_round: float | None = None
    tcp_retrans_segs_per_round: float | None = None
    #: the CPU the hosts' costs charged, per round, all hosts together (None: ``--cpu
    #: none``) - what ``tools/round_perf.py`` reads on the testbed as a round's busy CPU
    cpu_ms_per_round: float | None = None
    #: of our sends, the share whose last DATA carried their first PROBE (on warm paths
    #: that lose nothing: ``Recovery.may_carry_probe``); None for the TCP baselines
    probes_carried_fraction: float | None = None
    #: the time the cores lost to work not simulated, as spells a second on each core
    #: and their mean length ("": none)
    cpu_interference: str = ""
    #: our hosts' I/O thread's wake on busy cores, ms (0: none)
    cpu_wake_ms: float = 0.0
    #: what the ranks waited at before each round (SimJob.barrier), and the time between
    #: rounds (p50, ms): from when the last rank left one to when the last entered the
    #: next, as bench kernel-loss rows have it
    barrier: str = "instant"
    between_rounds_ms: float = 0.0
    #: how far apart the ranks entered a round (p50, ms): the last entry less the first,
    #: as bench kernel-loss rows have it (0 with an instant barrier)
    entry_spread_ms: float = 0.0
    #: the ranks' entries into a round in the order they came (p50 of each, ms after the
    #: first), as bench kernel-loss rows have them - for worlds the testbed runs (16
    #: ranks at most); () for larger ones, whose rows would hold a value a rank
    entry_order_ms: tuple[float, ...] = ()


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return float(s[min(len(s) - 1, int(round(q * (len(s) - 1))))])


def run_job(job: SimJob, progress: Callable[[str], None] | None = None,
            progress_every_s: float = 2.0) -> SimRow:
    """Simulate ``job``; its row. ``progress``: told about every ``progress_every_s``
    seconds of wall time how far the simulation has got (its round, virtual time,
    datagrams sent); the row is the same with it or without."""
    wall0 = time.perf_counter()
    cpu = CPU_PRESETS[job.cpu]
    costs = job.host_costs()
    if job.system in EXCHANGES:  # (a baseline's hosts run TCP)
        costs = job.tcp_costs or cpu.tcp_costs
    on_paths, at_node = job_losses(job)
    interference = job.interference() if costs is not None else None
    net = FakeNetwork(seed=job.seed, path=PathProfile(
        delay=job.delay_us * 1e-6, loss=on_paths), shared_cores=cpu.shared_cores,
        interference=interference)
    net.carries_payload = carries_payload
    if job.shared_buffer_bytes is not None:
        net.shared_buffer = SharedBuffer(job.shared_buffer_bytes)
    runtime = SimRuntime(net)
    bps = job.link_gbps * 1e9
    if job.racks > 1:
        if job.workers < job.racks:
            raise ValueError(f"{job.workers} workers cannot fill {job.racks} racks")
        per_rack = -(-job.workers // job.racks)
        net.fabric = Fabric(FabricProfile(uplink_bps=per_rack * bps / job.oversubscription,
                                          queue_datagrams=job.queue_datagrams), job.racks)
    # (every peer's receive of both phases, posted a round ahead, as the hook allows)
    config = TransportConfig(chunk_bytes=largest_chunk(job.mtu, TRAILER_BYTES if job.auth else 0),
                             max_open_receives=max(256, 4 * job.workers),
                             credit_bytes=job.credit_bytes,
                             credit_adaptive=job.credit_adaptive, congestion=job.congestion)
    peers = [(f"10.{r >> 16 & 255}.{r >> 8 & 255}.{r & 255}", 9000) for r in range(job.workers)]
    # (a TCP host's kernel takes its segments as they come: no thread to wake)
    wake_s = job.wake_s() if costs is not None and job.system not in EXCHANGES else 0.0
    profile = NodeProfile(up_bps=bps, down_bps=bps, queue_datagrams=job.queue_datagrams,
                          queue_bytes=job.queue_bytes,
                          cpu=costs, wake_s=wake_s)
    profiles = [dataclasses.replace(profile, loss=at_node[r]) if r in at_node else profile
                for r in range(job.workers)]
    if job.bottleneck is not None:
        b = job.bottleneck
        profiles[0] = dataclasses.replace(
            profiles[0], down_bps=b.rate_bps, down_burst_bytes=b.burst_bytes,
            queue_bytes=b.limit_bytes, queue_datagrams=None)
    if net.fabric is not None:
        for r, peer in enumerate(peers):
            net.fabric.place(peer, r * job.racks // job.workers)
    background = job.background if job.background and job.background.rate > 0 else None
    starts = np.zeros((job.workers, job.rounds))
    ends = np.zeros((job.workers, job.rounds))
    endpoints: list[SimEndpoint] = []
    tcp: list[SimTcp] = []

    if job.system in EXCHANGES:  # a baseline, over the TCP model
        tcp = [SimTcp(runtime, peer, job.mtu, profiles[r]) for r, peer in enumerate(peers)]
        exchange = EXCHANGES[job.system]
        barrier = make_barrier(job.barrier, runtime, peers, job.mtu, profiles, tcp)

        def rank_main(r: int) -> None:
            for t in range(job.rounds):
                barrier.wait(r)
                starts[r, t] = runtime.now
                exchange(tcp, r, 4 * job.elements)
                ends[r, t] = runtime.now
    else:
        endpoints = [SimEndpoint(runtime, peer, session=SESSION, config=config,
                                 auth_key=KEY if job.auth else None, profile=profiles[r])
                     for r, peer in enumerate(peers)]
        # (a rank's barrier runs over TCP on its host, as Gloo's does beside our socket)
        tcp_costs = None if costs is None else job.tcp_costs or cpu.tcp_costs
        barrier = make_barrier(job.barrier, runtime, peers, job.mtu,
                               [dataclasses.replace(p, cpu=tcp_costs, wake_s=0.0)
                                for p in profiles], None)
        collective = TOPOLOGIES[job.topology]
        # One gradient, read-only, for every rank: the rows are times, which the values
        # do not move, and a draw a rank cost a 1,024-worker job 4 GB and seconds.
        x = np.random.default_rng(job.seed).standard_normal(job.elements, dtype=np.float32)
        x.flags.writeable = False

        def rank_main(r: int) -> None:
            policy = parse_policy(job.system).make()
            # steady gradient norms after warm-up, as bench kernel-loss has it: DBLP in
            # its relaxed phase (the other policies take no notice of epoch ends)
            policy.epoch_end(1.0)
            policy.epoch_end(1.0)
            coll = collective(endpoints[r], r, peers, policy=policy,
                              aggregator=make_aggregator("unbiased"), session=SESSION)
            try:
                for t in range(job.rounds):
                    # The last round's posts of a next round's receives, which nothing
                    # uses, are left out where posting costs no virtual time (the rows
                    # the same): a one-round job then posts half the receives.
                    coll.post_ahead = t + 1 < job.rounds or job.posts_ahead_in_last_round()
                    barrier.wait(r)
                    starts[r, t] = runtime.now
                    coll.allreduce_mean(x, t)
                    ends[r, t] = runtime.now
            finally:
                coll.close()

    if background is not None:  # (a full packet of the MTU, counted as our datagrams are)
        start_background(net, background, peers, peak_bps=bps,
                         datagram_bytes=job.mtu - IPV4_UDP_OVERHEAD, seed=job.seed)
    for r in range(job.workers):
        runtime.spawn(functools.partial(rank_main, r), name=f"rank {r}")
    try:
        def tick() -> None:
            assert progress is not None
            done = int((ends > 0).all(axis=0).sum())
            sent = net.counts["sent"]
            wall = time.perf_counter() - wall0
            progress(f"round {min(done + 1, job.rounds)} of {job.rounds}, "
                     f"{net.now * 1e3:,.1f} ms simulated, {sent:,} datagrams "
                     f"({sent / wall:,.0f} a second)")

        runtime.run(tick=None if progress is None else tick, tick_s=progress_every_s)
        offered, dropped = net.port_counts(peers[0])  # (while rank 0 is attached)
    finally:
        runtime.close()
        for ep in endpoints:
            ep.close()
    latencies = list((ends.max(axis=0) - starts.max(axis=0)) * 1e3)
    between = list((starts.max(axis=0)[1:] - ends.max(axis=0)[:-1]) * 1e3)
    entries = entry_offsets_ms(starts)
    # (read after close: a send cancelled at the end is finished too, carrying or not)
    sends = sum(ep.mux.sends_finished for ep in endpoints)
    carried = sum(ep.mux.probes_carried for ep in endpoints)

    def tcp_per_round(count: str) -> float | None:
        if not tcp:
            return None
        return round(sum(getattr(host.stack, count) for host in tcp) / job.rounds, 4)

    bursts = burst_round_figures(on_paths, at_node, starts.max(axis=0), ends.max(axis=0))
    return SimRow(
        workers=job.workers, system=job.system, topology=job.topology, loss=job.loss,
        rounds=job.rounds, elements=job.elements,
        p50_ms=round(_percentile(latencies, 0.5), 3),
        p99_ms=round(_percentile(latencies, 0.99), 3),
        mean_ms=round(float(np.mean(latencies)), 3), max_ms=round(float(max(latencies)), 3),
        sim_datagrams=net.counts["sent"], queue_drops=net.counts["queue_drop"],
        path_losses=net.counts["path_loss"], node_losses=net.counts["node_loss"], **bursts,
        wall_s=round(time.perf_counter() - wall0, 3),
        seed=job.seed, cpu=job.cpu, loss_model=job.loss_model,
        path_loss_fraction=round(net.counts["path_loss"] / max(1, net.counts["sent"]), 5),
        racks=job.racks, oversubscription=job.oversubscription,
        fabric_drops=net.counts["fabric_drop"], credit_bytes=job.credit_bytes,
        credit_adaptive=job.credit_adaptive,
        queue_bytes=job.queue_bytes, shared_buffer_bytes=job.shared_buffer_bytes,
        congestion=job.congestion,
        payload_drop_fraction=round(
            net.counts["queue_drop_payload"] / max(1, net.counts["sent_payload"]), 5),
        bottleneck="" if job.bottleneck is None else job.bottleneck.describe(),
        bottleneck_drop_fraction=(None if job.bottleneck is None
                                  else round(dropped / max(1, offered), 5)),
        background="" if background is None else str(background),
        background_bytes=net.counts["background_bytes"],
        background_drops=(net.counts["background_queue_drop"]
                          + net.counts["background_fabric_drop"]),
        tcp_timeouts_per_round=tcp_per_round("timeouts"),
        tcp_loss_probes_per_round=tcp_per_round("probes"),
        tcp_retrans_segs_per_round=tcp_per_round("retransmits"),
        cpu_ms_per_round=(None if costs is None
                          else round(net.cpu_charged * 1e3 / job.rounds, 3)),
        probes_carried_fraction=round(carried / sends, 5) if sends else None,
        cpu_interference="" if interference is None else interference.describe(),
        cpu_wake_ms=round(wake_s * 1e3, 6), barrier=job.barrier,
        between_rounds_ms=round(_percentile(between, 0.5), 3) if between else 0.0,
        entry_spread_ms=round(_percentile(list(entries[:, -1]), 0.5), 3),
        entry_order_ms=(tuple(round(_percentile(list(column), 0.5), 3) for column in entries.T)
                        if job.workers <= TESTBED_MAX_RANKS else ()))


def plan_jobs(workers: Sequence[int], systems: Sequence[str], topologies: Sequence[str],
              losses: Sequence[float], loss_models: Sequence[str] = (),
              backgrounds: Sequence[BackgroundTraffic | None] = (None,),
              **settings: Any) -> list[SimJob]:
    """The jobs of a sweep, world by world, loss by loss (random loss of each of
    ``losses``, then each of ``loss_models``), background by background: each of our
    ``systems`` on each of ``topologies``, and each baseline once, on its own topology
    (gloo's ring, tcp-ps's server), as bench kernel-loss gives it; ``settings``: the
    rest of SimJob."""
    arms = [(s, TCP_TOPOLOGIES[s]) for s in systems if s in TCP_TOPOLOGIES]
    arms += [(s, t) for t in topologies for s in systems if s not in TCP_TOPOLOGIES]
    network = [(p, "") for p in losses] + [(0.0, m) for m in loss_models]
    return [SimJob(workers=w, system=s, topology=t, loss=p, loss_model=m, background=b,
                   **settings)
            for w in workers for p, m in network for b in backgrounds for s, t in arms]


_KIND_AT = wire.OFFSET["kind"]
_MAGIC = wire.MAGIC_BYTES
_DATA = int(wire.Kind.DATA)


def carries_payload(data: bytes) -> bool:
    """Our DATA, or one of the TCP model's data segments (asked of every datagram)."""
    return (len(data) > wire.HEADER_BYTES and data[_KIND_AT] == _DATA
            and data[:2] == _MAGIC) or is_data_segment(data)


def burst_round_figures(on_paths: LossModel | None, at_node: dict[int, LossModel],
                        starts: np.ndarray, ends: np.ndarray) -> dict[str, Any]:
    """The rows' burst-round fields: which rounds (``starts[t]`` to ``ends[t]``, virtual
    seconds) overlapped a burst in time, on the paths or at a host."""
    models = [m for m in (on_paths, *at_node.values()) if m is not None]
    until = float(ends.max()) if ends.size else 0.0
    windows = sorted(w for m in models for p in components(m) if isinstance(p, Microburst)
                     for w in p.time_windows(until))
    if not windows:
        return {}
    # a round meets a burst if one that starts before the round ends ends after it
    # starts: the latest end among the bursts started by then (they may overlap)
    opened, closed = np.array(windows).T
    latest_end = np.maximum.accumulate(closed)
    last = np.searchsorted(opened, ends, side="left") - 1
    hit = (last >= 0) & (latest_end[np.maximum(last, 0)] > starts)
    ms = (ends - starts) * 1e3
    figures: dict[str, Any] = {"burst_rounds": int(hit.sum())}
    if hit.any():
        figures["burst_round_ms_mean"] = round(float(ms[hit].mean()), 3)
    if (~hit).any():
        figures["normal_round_ms_p50"] = round(float(np.median(ms[~hit])), 3)
    if hit.any() and (~hit).any() and figures["normal_round_ms_p50"] > 0:
        figures["burst_over_normal_round"] = round(
            figures["burst_round_ms_mean"] / figures["normal_round_ms_p50"], 3)
    return figures


def burst_ranks(model: LossModel) -> set[int]:
    """The ranks whose hosts a burst of ``model`` is at (``rank=``)."""
    return {p.rank for p in components(model) if isinstance(p, Microburst)
            and p.rank is not None}


def job_losses(job: SimJob) -> tuple[LossModel | None, dict[int, LossModel]]:
    """What every path of ``job``'s network loses, and what the datagrams arriving at a
    rank's host lose there (a time burst given ``rank=``: the kernel testbed's timed
    microbursts at a node - the demo's at the server)."""
    if not job.loss_model:
        return (Bernoulli(job.loss, seed=job.seed) if job.loss > 0 else None), {}
    model = check_loss_model(job.loss_model, seed=job.seed)
    at_node: dict[int, list[LossModel]] = {}
    on_paths = []
    for part in components(model):  # (split, not parsed again: each keeps its own stream)
        if isinstance(part, Microburst) and part.rank is not None:
            if part.rank >= job.workers:
                raise ValueError(f"{job.loss_model!r}: a burst at rank {part.rank} of "
                                 f"{job.workers} workers")
            at_node.setdefault(part.rank, []).append(part)
        else:
            on_paths.append(part)
    nodes = {r: ms[0] if len(ms) == 1 else Combined(ms) for r, ms in at_node.items()}
    paths = None if not on_paths else on_paths[0] if len(on_paths) == 1 else Combined(on_paths)
    return paths, nodes


def check_loss_model(spec: str, seed: int = 0) -> LossModel:
    """``spec`` as a loss model every system meets alike: random, Gilbert-Elliott and
    bursts in time (windows, or recurring: ``every_s``; on every path, or with ``rank=``
    at that rank's host), not bursts keyed on our rounds (a TCP segment carries no
    round) nor a bottleneck (the links and queues are that); ValueError, one line, if
    not."""
    model = parse_loss_spec(spec, seed=seed)
    for part in components(model):
        if isinstance(part, Bottleneck):
            raise ValueError(f"{spec!r}: a bottleneck is the simulator's links and queues "
                             "(--link-gbps, --queue-datagrams, --bottleneck), not a path's "
                             "loss")
        if isinstance(part, Microburst) and (part.rounds or part.every):
            raise ValueError(f"{spec!r}: bursts keyed on rounds meet our datagrams alone (a "
                             "TCP segment carries no round): give them as time windows")
    return model
