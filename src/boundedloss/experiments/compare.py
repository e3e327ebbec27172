"""`boundedloss compare`: several arms on one scenario, same model/data/seed/loss.

A scenario is a set of *arms*, each one training run configuration:

- policy scenarios (``microburst``, ``incast``) have one arm per policy under the same
  loss schedule (``--policies`` picks them, spelled as :func:`~boundedloss.policy.parse_policy`
  reads them; ``baseline`` is MLT with P fixed at DBLP's P_low, the DBLP paper's baseline);
- sweep scenarios (``random-loss``, ``lm-loss``) have one arm per aggregator and loss
  rate, plus a lossless reference, all under one bounded policy.

Each arm is trained with :func:`boundedloss.experiments.train.run_training` into its own
subdirectory of ``out`` (``runs/<arm>-r<k>``); repeats are interleaved and every other
one runs in reverse (A, B, C, then C, B, A), so that neither slow drift of the machine
nor an arm's place in the sequence favours one arm. The per-round and per-epoch logs
are read back and summarised per arm (median over repeats), with ratios against the
scenario's baseline arm and its reference arm.

A scenario with a kernel setup (``microburst``, ``incast``) can run on the real-kernel
testbed instead of in-process loss (:func:`choose_network`): one testbed for all its
arms, every rank in its own network namespace, every system - gloo's TCP included -
crossing the same links, random drops and timed microbursts (microburst) or the same
tbf in front of the server (incast, whose rows also say what that queue sent and
dropped).

Every row also has the time each arm took to reach the scenario's target metric
(``time_to_target_s``: the training time until the first epoch whose test metric
reached it) and its ratio against gloo's (``tta_speedup_vs_gloo``) - only where gloo
crossed the same lossy network as every other arm (the kernel network:
``gloo_crossed_same_network``). In-process loss cannot reach gloo's TCP: there gloo runs
lossless (``ran_lossless``), and every ratio against it is None.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..emulate import tcp_counters
from ..emulate.bursts import TimedBursts
from ..emulate.qdisc import Bottleneck
from ..policy import PolicySpec, parse_policy
from ..protocol import RECOVERY_MODES, probe_copies_for
from ..protocol.credit import CreditSetting
from .train import TrainConfig, run_training

if TYPE_CHECKING:
    from ..emulate import BurstRunner, Testbed

ROW_FIELDS = (
    "policy", "scenario", "scenario_description", "wall_s", "round_ms_p50", "round_ms_p99",
    "burst_over_normal_round", "burst_over_normal_round_outside_clr", "recovery",
    "burst_round_ms_mean", "final_metric", "metric_name", "delivered_fraction_mean",
    "retransmit_rounds_mean", "speedup_burst_round_vs_baseline", "time_reduction_vs_baseline",
    "metric_change_vs_reliable", "repeats", "network", "time_to_target_s", "samples_per_s",
    "throughput_vs_baseline",
    "tta_speedup_vs_gloo", "gloo_crossed_same_network", "ran_lossless", "sharded", "precision",
    "device", "credit",
)


@dataclass(frozen=True)
class Arm:
    """One training configuration of a scenario; ``label`` names its row."""

    label: str
    policy: PolicySpec
    loss: str
    aggregator: str = "unbiased"
    hadamard: bool = False
    #: the sweep axis (sweep scenarios only): in-process, the loss injected at our
    #: endpoints; on the kernel network, the testbed's random loss while this arm runs
    loss_rate: float | None = None


def sweep_label(name: str, rate: float) -> str:
    """A sweep arm's label: ``unbiased@10%``, ``gloo@0%``."""
    return f"{name}@{rate:.0%}"


@dataclass(frozen=True)
class KernelNetwork:
    """How a scenario runs on the kernel testbed (root, or a user namespace of its
    own): every rank in its own network namespace; ``random_loss`` dropped at random
    from everything arriving at every node (TCP and UDP alike, one wire packet at a
    time); timed microbursts (``bursts``) on top; a tbf ``bottleneck`` on the switch
    port into the server (rank 0); and ``loss`` injected in-process on top (usually
    none). gloo's TCP crosses the same links, so on the kernel it is compared like for
    like.

    A sweep scenario sweeps the random loss itself: each arm runs with the testbed's
    random loss at its own rate (set before the arm starts) - ours (the sweep's policy)
    at each of ``sweep_rates``, gloo at each of ``gloo_rates``, whose 0% arm is the
    lossless reference; a ratio against gloo is against gloo at the same rate."""

    description: str
    bottleneck: Bottleneck | None = None
    random_loss: float = 0.0
    bursts: TimedBursts | None = None
    loss: str = "none"
    sweep_rates: tuple[float, ...] = ()
    gloo_rates: tuple[float, ...] = ()

    def summary(self) -> str:
        """One short line: what the network does to every system."""
        parts = []
        if self.sweep_rates:
            parts.append("random loss at every node, each arm's: gloo at "
                         + ", ".join(f"{r:.0%}" for r in self.gloo_rates) + ", ours at "
                         + ", ".join(f"{r:.0%}" for r in self.sweep_rates))
        if self.random_loss:
            parts.append(f"{self.random_loss:.0%} random loss at every node")
        if self.bursts is not None:
            parts.append(self.bursts.describe())
        if self.bottleneck is not None:
            parts.append(f"{self.bottleneck.describe()} into the server")
        return "; ".join(parts) or "lossless"


#: ``--network``: where a scenario's loss happens (see :func:`choose_network`)
NETWORKS = ("auto", "kernel", "in-process")
DEFAULT_NETWORK = "auto"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str
    topology: str
    workers: int
    loss: str  # policy scenarios: the loss spec every policy shares
    epochs: int = 8
    aggregator: str = "unbiased"
    default_policies: tuple[str, ...] = ("reliable", "baseline", "dblp")  # as parse_policy
    baseline: str = "baseline"  # the arm the time ratios compare against
    reference: str = "reliable"  # the arm the metric change compares against
    # sweep scenarios: the bounded policy (as parse_policy reads it), loss rates and
    # aggregator variants
    sweep_policy: str | None = None
    sweep_rates: tuple[float, ...] = ()
    sweep_aggregators: tuple[tuple[str, bool], ...] = ()  # (aggregator, hadamard)
    kernel: KernelNetwork | None = None  # how it runs on the kernel testbed, if it can
    network: str = "in-process"  # which one this run uses: "in-process" or "kernel"
    #: the test metric every arm is timed to (accuracy: at least; perplexity: at most)
    target_metric: float | None = None
    #: why this run is in-process although the scenario has a kernel setup ("" if not)
    network_note: str = ""
    #: how every arm recovers a lost PROBE or answer (protocol.RECOVERY_MODES)
    recovery: str = "copies"
    #: our arms' receiver-driven credit per receiver, bytes (None: off)
    credit_bytes: int | None = None
    #: each receiver sizes that budget from the overflows it sees, credit_bytes its floor
    credit_adaptive: bool = False
    #: the MLP's hidden width (TrainConfig.mlp_hidden)
    mlp_hidden: int = 256
    #: the images an image model trains on (TrainConfig.data; None: digits)
    data: str | None = None
    #: every arm under FSDP2 (TrainConfig.sharded) instead of DDP
    sharded: bool = False
    #: every arm's precision (TrainConfig.precision; sharded: FSDP2's mixed precision)
    precision: str = "fp32"
    #: where every arm's ranks train (TrainConfig.device)
    device: str = "cpu"
    #: what the command line changed (--data, --model, --sharded), said after the
    #: description - on either network
    notes: str = ""

    @property
    def full_description(self) -> str:
        return self.description + self.notes

    @property
    def is_sweep(self) -> bool:
        return self.sweep_policy is not None

    def on_kernel(self) -> Scenario:
        """This scenario on the kernel testbed (``ValueError`` if it has no kernel setup).
        A sweep's reference and baseline there: gloo at 0% (lossless)."""
        if self.kernel is None:
            raise ValueError(f"scenario {self.name} injects its loss in-process; it has no "
                             "kernel-testbed setup")
        ref = sweep_label("gloo", 0.0) if self.is_sweep else None
        return replace(self, loss=self.kernel.loss, description=self.kernel.description,
                       network="kernel", reference=ref or self.reference,
                       baseline=ref or self.baseline)

    def run_as(self, *, sharded: bool = False, precision: str = "fp32",
               device: str = "cpu") -> Scenario:
        """This scenario with every arm under FSDP2 (``sharded``), in ``precision`` and on
        ``device`` (``ValueError`` with the reason if FSDP2 cannot run it: a
        parameter-server scenario, whose loss meets the pushes into its server)."""
        from .train import DEVICES, PRECISIONS

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}")
        if sharded and self.topology != "allreduce":
            fits = ", ".join(n for n, s in SCENARIOS.items() if s.topology == "allreduce")
            raise ValueError(f"scenario {self.name} is a parameter-server scenario (its loss "
                             "meets the pushes into rank 0); FSDP2 reduce-scatters among "
                             f"all ranks: --sharded runs {fits}")
        placed = replace(self, precision=precision, device=device)
        if not sharded:
            return placed
        mixed = (" in bfloat16 (FSDP2's mixed precision: bfloat16 passes and "
                 "reduce-scatter over float32 master parameters)" if precision == "bf16"
                 else " in float32")
        return replace(placed, sharded=True, notes=(
            f"{self.notes} Every arm runs under FSDP2 (fully_shard per layer, "
            f"then the root){mixed}: gloo with FSDP2's own reduce-scatter and "
            "all-gather, ours with the hook's (the reduce-scatter under the bound, the "
            "all-gather keeping a missing piece's last value); no Hadamard arms."))

    def arms(self, policies: Sequence[str | PolicySpec] | None = None) -> list[Arm]:
        """The arms of a run: one per aggregator and rate (sweeps, which take no
        ``policies``; on the kernel network, gloo's and ours at the kernel's rates), or
        one per policy (default: ``default_policies``). Under FSDP2, no Hadamard arm."""
        if self.sweep_policy is not None:
            bounded = parse_policy(self.sweep_policy)
            if self.network == "kernel" and self.kernel is not None and self.kernel.sweep_rates:
                gloo = parse_policy("gloo")
                return ([Arm(sweep_label("gloo", r), gloo, self.loss, self.aggregator,
                             loss_rate=r) for r in self.kernel.gloo_rates]
                        + [Arm(sweep_label(self.aggregator, r), bounded, self.loss,
                               self.aggregator, loss_rate=r) for r in self.kernel.sweep_rates])
            arms = [Arm("lossless", parse_policy("reliable"), "none", self.aggregator,
                        loss_rate=0.0)]
            for rate in self.sweep_rates:
                for agg, had in self.sweep_aggregators:
                    if had and self.sharded:
                        continue  # (FSDP2's shards take no Hadamard transform)
                    label = sweep_label(f"{agg}{'+hadamard' if had else ''}", rate)
                    arms.append(Arm(label, bounded, f"bernoulli:{rate:g}", agg, had, rate))
            return arms
        specs = [p if isinstance(p, PolicySpec) else parse_policy(p)
                 for p in (policies or self.default_policies)]
        # gloo and tcp-ps run over TCP: in-process loss cannot reach them, so they run
        # lossless
        return [Arm(spec.label, spec, self.loss if spec.uses_transport else "none",
                    self.aggregator) for spec in specs]


#: lm-loss on the kernel network: our arms' random loss rates, and gloo's (whose TCP
#: under 10% loss of every packet would wait out a retransmission timeout in most
#: collectives: 1% is its lossy arm)
LM_KERNEL_RATES = (0.01, 0.1)
LM_KERNEL_GLOO_RATES = (0.0, 0.01)


def _mlt_sweep(**fields) -> Scenario:
    """A sweep under MLT with its bound at 40% - above every rate tried, so a transfer
    closes after its first pass and the loss rate is the fraction of gradient missing -
    against the lossless arm."""
    return Scenario(loss="none", baseline="lossless", reference="lossless",
                    sweep_policy="mlt:0.4", **fields)


_MICROBURST_PAPER_DESCRIPTION = (
    "DBLP's published setting: digits MLP, 3 workers, parameter-server topology (rank 0 "
    "serves and trains), missing gradient counts as zero (DBLP's ZeroFill), 30 epochs "
    "with the learning rate cut at 50% and 75% of them (so that critical learning "
    "regimes are the minority of epochs, as in real training); 1% random (Bernoulli) "
    "datagram loss at every receiver plus a burst of 80% loss at rank 0 (the server, "
    "which receives the pushes) on one training round in ten (rounds 7, 17, 27, ...). "
    "Every arm recovers a lost PROBE or answer by a retransmission timeout (--recovery "
    "timeout), as the published baseline evidently does. baseline = MLT with the bound "
    "fixed at P_low = 0.8%; DBLP uses P_low inside critical learning regimes and "
    "P_low + 40 points outside. Loss is injected in-process at the receiving endpoints "
    "(every arm is one of our transports: the same datagrams meet the same loss)."
)

#: the microburst scenarios' length: enough epochs that DBLP's critical learning regimes
#: (early training, and the epochs after each learning-rate cut) are the minority, as in
#: real training (about 1 in 6 epochs on the digits MLP; 6 in 12 at 12 epochs)
MICROBURST_EPOCHS = 30

def _microburst(**fields) -> Scenario:
    """A DBLP microburst scenario: the digits MLP on 3 ranks around a parameter server,
    missing gradient as zero (DBLP's ZeroFill), long enough that critical regimes are
    the minority, every arm timed to 95% test accuracy."""
    return Scenario(model="mlp", topology="ps", workers=3, epochs=MICROBURST_EPOCHS,
                    aggregator="zero", target_metric=0.95, **fields)


#: the incast-collapse scenario's bottleneck: a fast link with a shallow buffer
INCAST_COLLAPSE = Bottleneck(rate="1gbit", burst="16kb", limit="32kb")

#: the microburst scenario's bursts on the kernel testbed: one 10 ms burst of 80% loss
#: every 100 ms into the server, about one round in ten of our policies' (~10 ms each)
MICROBURSTS = TimedBursts(rate=0.8, every_s=0.1, length_s=0.01)

SCENARIOS: dict[str, Scenario] = {
    "microburst": _microburst(
        name="microburst",
        description=(
            "DBLP microburst: digits MLP, parameter-server topology (rank 0 serves and "
            "trains), missing gradient counts as zero (DBLP's ZeroFill), 30 epochs, 1% random "
            "(Bernoulli) datagram loss at every receiver plus bursts of 80% loss at rank "
            "0 (the server, which receives the pushes) on training rounds 7, 37, 67, ... "
            "(every 30 rounds, 1 round long). baseline = MLT with the bound fixed at "
            "P_low = 0.8%; DBLP uses P_low inside critical learning regimes and "
            "P_low + 40 points outside. gloo (DDP's TCP allreduce) cannot take "
            "in-process loss and runs lossless."
        ),
        loss="bernoulli:0.01+burst:rate=0.8,every=30,len=1,offset=7,rank=0",
        default_policies=("gloo", "reliable", "baseline", "mlt", "ltp", "dblp"),
        kernel=KernelNetwork(
            random_loss=0.01,
            bursts=MICROBURSTS,
            description=(
                "DBLP microburst on the kernel testbed: digits MLP, 30 epochs, 3 ranks, each "
                "in its own network namespace behind one routing switch; parameter-server "
                "topology for our policies (rank 0 serves and trains), DDP's ring allreduce "
                "over TCP for gloo. The switch drops 1% of all packets toward every node at "
                "random (TCP and UDP alike, one wire packet at a time, before the "
                "receiver's GRO coalesces what survives), and the server's incoming "
                f"link has microbursts: {MICROBURSTS.describe()} - about one of our "
                "rounds in ten, a network's own congestion that does not know the job's "
                "rounds (a slower system meets more of them). Missing gradient counts "
                "as zero (DBLP's ZeroFill); baseline = MLT with the bound fixed at "
                "P_low = 0.8%; DBLP uses P_low inside critical learning regimes and "
                "P_low + 40 points outside. A burst round is one a burst overlapped."
            ),
        ),
    ),
    "microburst-paper": _microburst(
        name="microburst-paper",
        description=_MICROBURST_PAPER_DESCRIPTION,
        loss="bernoulli:0.01+burst:rate=0.8,every=10,len=1,offset=7,rank=0",
        default_policies=("reliable", "baseline", "dblp"),
        recovery="timeout",
    ),
    "incast": Scenario(
        name="incast",
        description=(
            "LTP incast: 8 ranks push their digits-MLP gradients at once to rank 0 (the "
            "parameter server, which also trains) through a shallow bottleneck, emulated "
            "in-process at rank 0's receiver as a tail-drop queue of 64 datagrams "
            "drained at 20,000 datagrams/s (about 224 Mbit/s at 1,400-byte chunks): "
            "synchronized senders overflow it every round. The queue's drops are "
            "modelled, not its delay. Missing gradient is filled by LTP's BubbleFill "
            "(the mean of the contributions that arrived). gloo and tcp-ps (TCP) cannot "
            "take in-process loss and run without the bottleneck."
        ),
        model="mlp",
        topology="ps",
        workers=8,
        epochs=6,
        aggregator="bubble",
        loss="bottleneck:rate=20000,queue=64,rank=0",
        default_policies=("gloo", "tcp-ps", "reliable", "mlt", "ltp", "dblp"),
        baseline="reliable",
        kernel=KernelNetwork(
            bottleneck=Bottleneck(rate="100mbit", burst="32kb", limit="64kb"),
            description=(
                "LTP incast on the kernel testbed: 8 ranks, each in its own network "
                "namespace behind one routing switch; 7 push their digits-MLP gradients "
                "(340 KB each) at once to rank 0 (the parameter server, which also trains) "
                "through a real bottleneck - a tbf on the switch port into the server, "
                "100 Mbit/s with a 64 KB queue (about 45 full datagrams): a round's 2.4 MB "
                "of pushes is 190 ms of wire time at the least, and the synchronized "
                "pushes overflow the queue every round. No loss is injected: every drop "
                "is the kernel's queue. "
                "Missing gradient is filled by LTP's BubbleFill. tcp-ps - the same "
                "parameter server over TCP (gloo's send and receive), LTP's baseline - and "
                "gloo (DDP's TCP allreduce: a ring, not a parameter server) cross the same "
                "bottleneck."
            ),
        ),
    ),
    "incast-collapse": Scenario(
        name="incast-collapse",
        description=(
            "LTP's incast collapse, in-process: 8 ranks push a small MLP's gradients "
            "(36 KB each) at once to rank 0 through a tail-drop queue of 22 datagrams "
            "drained at 85,000 datagrams/s (about 1 Gbit/s at 1,400-byte chunks), "
            "modelled at rank 0's receiver (its drops, not its delay). Our arms run "
            "with receiver-driven credit (32 KB per receiver). gloo and tcp-ps (TCP) "
            "cannot take in-process loss and run without the bottleneck: their "
            "collapse needs the kernel network."
        ),
        model="mlp",
        mlp_hidden=64,
        topology="ps",
        workers=8,
        epochs=30,
        aggregator="bubble",
        loss="bottleneck:rate=85000,queue=22,rank=0",
        default_policies=("gloo", "tcp-ps", "reliable", "ltp", "dblp"),
        baseline="tcp-ps",
        target_metric=0.9,
        credit_bytes=32 * 1024,
        kernel=KernelNetwork(
            bottleneck=INCAST_COLLAPSE,
            description=(
                "LTP's incast collapse on the kernel testbed: 8 ranks, each in its own "
                "network namespace behind one routing switch; 7 push a digits MLP's "
                "gradients (hidden width 64: 36 KB, 25 datagrams each) at once to rank 0 "
                "(the parameter server, which also trains) through a fast bottleneck with "
                f"a shallow buffer - {INCAST_COLLAPSE.describe()} on the switch port into "
                "the server. A round's pushes are 0.25 MB, 2 ms of wire time; the ideal "
                "round is a few milliseconds. Where the ranks send in step, synchronised "
                "TCP senders each open with ten segments (14.5 KB; Linux restarts slow "
                "start after an idle round), 100 KB into 48 KB of buffer: whole tails of "
                "windows are lost, and with too few segments behind a loss for fast "
                "retransmit a flow waits out its retransmission timeout (200 ms at the "
                "least) - the round with it. (Ranks that take turns on a few cores do not "
                "send in step, and TCP then collapses rarely: BENCHMARKS.md.) "
                "Our arms run with receiver-driven credit: the server grants its senders "
                "32 KB in flight together. No loss is injected: every drop is the "
                "kernel's queue. Missing gradient is filled by LTP's BubbleFill. tcp-ps "
                "- the same parameter server over TCP (gloo's send and receive), LTP's "
                "baseline - and gloo (DDP's ring allreduce over TCP) cross the same "
                "bottleneck."
            ),
        ),
    ),
    "random-loss": _mlt_sweep(
        name="random-loss",
        description=(
            "MLT random loss: digits MLP, parameter-server topology, 4 workers, random "
            "(Bernoulli) datagram loss at every receiver at each rate; the push uses "
            "MLT's bound fixed at P = 40% (above every rate tried, so the transfer "
            "closes after its first pass and the loss rate is the fraction of gradient "
            "missing; MLT's critical chunks - biases - still always arrive); the "
            "broadcast back is reliable. Each aggregator at each rate, against a "
            "lossless reliable run."
        ),
        model="mlp",
        topology="ps",
        workers=4,
        epochs=8,
        sweep_rates=(0.1, 0.2, 0.3, 0.35),
        sweep_aggregators=(("zero", False), ("unbiased", False), ("bubble", False)),
    ),
    "lm-loss": _mlt_sweep(
        name="lm-loss",
        description=(
            "2507.07114 LM under loss: character-level LM on text that ships with "
            "Python, transpose allreduce (reduce-scatter to shard owners, all-gather) "
            "over 3 workers, random (Bernoulli) datagram loss at every receiver; the "
            "reduce-scatter uses MLT's bound fixed at P = 40% (the loss rate is the "
            "fraction of gradient missing), the all-gather is reliable. ZeroFill "
            "against UnbiasedRescale, with and without Hadamard dispersion, against a "
            "lossless reliable run. Metric: test perplexity (lower is better)."
        ),
        model="charlm",
        topology="allreduce",
        workers=3,
        epochs=6,
        sweep_rates=(0.1, 0.3),
        sweep_aggregators=(("zero", False), ("unbiased", False), ("unbiased", True)),
        kernel=KernelNetwork(
            sweep_rates=LM_KERNEL_RATES,
            gloo_rates=LM_KERNEL_GLOO_RATES,
            description=(
                "2507.07114 LM under loss on the kernel testbed: character-level LM on "
                "text that ships with Python, every rank in its own network namespace "
                "behind one routing switch, which drops packets toward every node at "
                "random (TCP and UDP alike, one wire packet at a time) at each arm's "
                "rate. Ours: a reduce-scatter to shard owners and an all-gather (DDP: "
                "the transpose allreduce), the reduce-scatter under MLT's bound fixed at P = 40% "
                "(the loss rate is about the fraction of gradient missing) with "
                "UnbiasedRescale, the all-gather reliable; at "
                + " and ".join(f"{r:.0%}" for r in LM_KERNEL_RATES) + " loss. gloo "
                "(over TCP) crosses the same network at "
                + " and ".join(f"{r:.0%}" for r in LM_KERNEL_GLOO_RATES) + " loss; "
                "gloo at 0% is the lossless reference. Metric: test perplexity (lower "
                "is better)."
            ),
        ),
    ),
}


def make_config(scenario: Scenario, arm: Arm, *, out: str, epochs: int, workers: int,
                seed: int, steps_per_epoch: int | None = None,
                probe_copies_max: int | None = None) -> TrainConfig:
    # every arm as its system is defined - the published ones have no loss guard, and
    # with it a bound below the network's loss would run as reliable
    return TrainConfig(policy=str(arm.policy), workers=workers,
                       topology=None if scenario.sharded else scenario.topology,
                       sharded=scenario.sharded, precision=scenario.precision,
                       model=scenario.model, epochs=epochs, seed=seed, loss=arm.loss,
                       out=out, aggregator=arm.aggregator, hadamard=arm.hadamard,
                       steps_per_epoch=steps_per_epoch, probe_copies_max=probe_copies_max,
                       guard_rounds=0, credit_bytes=scenario.credit_bytes,
                       credit_adaptive=scenario.credit_adaptive,
                       mlp_hidden=scenario.mlp_hidden, data=scenario.data,
                       device=scenario.device)


# ------------------------------------------------------------------ burst rounds
def burst_rounds(loss_spec: str, round_ids) -> set[int]:
    """Round ids among ``round_ids`` that fall in a round-scheduled burst of the spec."""
    from ..net.loss import Microburst, parse_loss_spec

    model = parse_loss_spec(loss_spec)
    bursts: list = []

    def walk(m) -> None:
        if isinstance(m, Microburst):
            bursts.append(m)
        for sub in getattr(m, "models", ()) or ():
            walk(sub)

    walk(model)
    # now = -1: before any time window, so only the round schedule counts
    return {int(r) for r in round_ids if any(b.in_burst(-1.0, int(r)) for b in bursts)}


# ------------------------------------------------------------------ reading a run
@dataclass
class RunResult:
    policy: str  # the arm's label
    repeat: int
    out: str
    rounds: list[dict]
    epochs: list[dict]
    summary: dict
    burst: set[int] = field(default_factory=set)
    arm: Arm | None = None
    #: kernel runs: what its queue did (and a sweep's random loss: its drop fraction)
    bottleneck: dict = field(default_factory=dict)
    #: kernel runs: what the nodes' TCP counted (timeouts, loss probes: tcp_counters)
    tcp: dict = field(default_factory=dict)

    @property
    def metric_name(self) -> str:
        return self.summary["metric_name"]

    def critical_rounds(self) -> set[int]:
        """Rounds this run spent inside a critical learning regime (DBLP's phase log)."""
        return {r["round"] for r in self.rounds if r.get("phase") == "critical"}

    def clr_epoch_fraction(self) -> float | None:
        """The fraction of epochs spent inside a critical learning regime (None: the
        run's policy has no phases)."""
        phases = {r["epoch"]: r.get("phase") for r in self.rounds if "epoch" in r}
        if not phases or all(p is None for p in phases.values()):
            return None
        return sum(p == "critical" for p in phases.values()) / len(phases)

    def comm_by_round(self) -> dict[int, float]:
        """Each round's communication time (the slowest rank's), where it was logged."""
        return {r["round"]: r["round_comm_ms"] for r in self.rounds
                if r.get("round_comm_ms") is not None}

    def time_to_target(self, target: float | None) -> float | None:
        """Training time (s) until the end of the first epoch whose test metric reached
        ``target`` (accuracy: at least it; perplexity: at most it); None if none did."""
        if target is None:
            return None
        lower_is_better = self.metric_name == "perplexity"
        for e in self.epochs:
            v = e.get(self.metric_name)
            if v is not None and (v <= target if lower_is_better else v >= target):
                return float(e["wall_s"])
        return None

    def stats(self, outside: set[int] | None = None, target: float | None = None) -> dict:
        """Summary figures; ``outside``: rounds to leave out of the outside-CLR burst
        mean (the reference DBLP run's critical rounds); ``target``: the metric the
        time to target is measured to."""
        lat = np.array([r["round_ms"] for r in self.rounds], dtype=float)

        def bursts(key: str, outside_clr: bool) -> float | None:
            vals = [r[key] for r in self.rounds
                    if r["round"] in self.burst and r.get(key) is not None
                    and (not outside_clr or (outside is not None and r["round"] not in outside))]
            return float(np.mean(vals)) if vals else None

        normal = [r["round_ms"] for r in self.rounds if r["round"] not in self.burst]
        normal_p50 = float(np.median(normal)) if normal else None
        deliv = [r["delivered_fraction"] for r in self.rounds if "delivered_fraction" in r]
        config = self.summary.get("config", {})
        samples = len(lat) * config.get("workers", 0) * config.get("batch_size", 0)
        retx = [r["retransmit_rounds"] for r in self.rounds if "retransmit_rounds" in r]
        return {
            "wall_s": float(self.summary["wall_s"]),
            "round_ms_p50": float(np.percentile(lat, 50)) if lat.size else None,
            "round_ms_p99": float(np.percentile(lat, 99)) if lat.size else None,
            # training throughput as LTP gives it: samples every rank trained, over the
            # rounds' time (not the evaluations')
            "samples_per_s": samples / (lat.sum() / 1e3) if samples and lat.sum() else None,
            "burst_round_ms_mean": bursts("round_ms", False),
            "burst_round_ms_mean_outside_clr": bursts("round_ms", True),
            # the communication part alone (DBLP's figure is single-round communication);
            # None for gloo, whose allreduce runs inside DDP's backward
            "burst_comm_ms_mean": bursts("round_comm_ms", False),
            "burst_comm_ms_mean_outside_clr": bursts("round_comm_ms", True),
            "burst_rounds": len(self.burst),
            "normal_round_ms_p50": normal_p50,
            "clr_epoch_fraction": self.clr_epoch_fraction(),
            "final_metric": float(self.summary["final_metric"]),
            "time_to_target_s": self.time_to_target(target),
            # gloo has no comm fields: everything arrives, nothing is retransmitted by us
            "delivered_fraction_mean": float(np.mean(deliv)) if deliv else 1.0,
            "retransmit_rounds_mean": float(np.mean(retx)) if retx else 0.0,
            **self.bottleneck,
            **self.tcp,
            # (incast collapse is a retransmission timeout in most rounds)
            "tcp_timeouts_per_round": (self.tcp["tcp_timeouts"] / len(lat)
                                       if self.tcp and lat.size else None),
        }


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_run(policy: str, repeat: int, out: str, loss_spec: str,
             arm: Arm | None = None) -> RunResult:
    d = Path(out)
    rounds = _read_jsonl(d / "rounds.jsonl")
    # A round's latency is its slowest rank's step (rank 0, the server, may be done
    # with a round while a worker still waits for the broadcast); its communication
    # time likewise the slowest rank's (a worker's: its push out until the broadcast in).
    slowest: dict[int, float] = {}
    slowest_comm: dict[int, float] = {}
    for path in d.glob("rounds.rank*.jsonl"):
        for e in _read_jsonl(path):
            slowest[e["round"]] = max(slowest.get(e["round"], 0.0), e["step_ms"])
            if e.get("comm_ms") is not None:
                slowest_comm[e["round"]] = max(slowest_comm.get(e["round"], 0.0), e["comm_ms"])
    for r in rounds:
        r["round_ms"] = max(r["step_ms"], slowest.get(r["round"], 0.0))
        if r.get("comm_ms") is not None:
            r["round_comm_ms"] = max(r["comm_ms"], slowest_comm.get(r["round"], 0.0))
    res = RunResult(policy=policy, repeat=repeat, out=out, rounds=rounds,
                    epochs=_read_jsonl(d / "epochs.jsonl"),
                    summary=json.loads((d / "summary.json").read_text()), arm=arm)
    res.burst = burst_rounds(loss_spec, [r["round"] for r in rounds])
    return res


# ------------------------------------------------------------------ rows and ratios
def _median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(statistics.median(vals)) if vals else None


def summarise(label: str, runs: list[RunResult], scenario: Scenario,
              clr: list[set[int] | None] | None = None) -> dict:
    """One row: the median over repeats of each figure. ``clr[k]``: the critical rounds
    of DBLP's repeat k (None: no DBLP run to take them from)."""
    stats = [r.stats(clr[r.repeat] if clr and r.repeat < len(clr) else None,
                     scenario.target_metric) for r in runs]
    arm = runs[0].arm
    row = {"policy": label, "scenario": scenario.name,
           "scenario_description": scenario.full_description,
           "metric_name": runs[0].metric_name, "repeats": len(runs),
           "target_metric": scenario.target_metric}
    if arm is not None:
        row.update(transport_policy=arm.policy.name, aggregator=arm.aggregator,
                   hadamard=arm.hadamard, loss=arm.loss, loss_rate=arm.loss_rate,
                   bound=arm.policy.fixed_bound)
    for key in stats[0]:
        row[key] = _median(s[key] for s in stats)
    return row


def add_ratios(rows: list[dict], baseline: str = "baseline",
               reference: str = "reliable", gloo: str = "gloo") -> list[dict]:
    """Fill, in place, ``speedup_burst_round_vs_baseline`` (mean burst-round latency of
    the baseline arm over this arm's; also over the bursts outside DBLP's CLR, and
    both for the rounds' communication time alone: ``speedup_burst_comm_...``),
    ``time_reduction_vs_baseline`` (1 - wall / baseline wall),
    ``burst_over_normal_round`` (this arm's mean burst round over its median other
    round), ``tta_speedup_vs_gloo``, ``wall_speedup_vs_gloo`` and
    ``metric_change_vs_gloo`` (the gloo arm's time to the target metric and wall time
    over this arm's; this arm's final metric minus gloo's), and
    ``metric_change_vs_reliable`` (final metric minus the reference arm's; also
    relative); None where a reference is missing.

    The figures against gloo are given only where gloo crossed the same lossy network
    as the arm (``gloo_crossed_same_network``, in every row): the kernel network (each
    row's ``network``) at the same random loss (a sweep's ``loss_rate``: each row
    against gloo's at its rate), with no loss injected in-process for some arms alone
    (each row's ``loss``). Elsewhere gloo's TCP ran lossless or at another rate, and a
    ratio against it would compare unlike networks: they are None. ``round_speedup_vs_gloo``
    is gloo's median round over this arm's."""
    by = {r["policy"]: r for r in rows}
    base = by.get(baseline)
    ref = by.get(reference)
    # gloo's row at each loss rate (policy scenarios: one, at rate None)
    tcps = {r.get("loss_rate"): r for r in rows
            if r["policy"] == gloo or r.get("transport_policy") == gloo}
    same_loss = all(r.get("loss") == rows[0].get("loss") for r in rows)

    def ratio(num, den):
        return num / den if num is not None and den else None

    for r in rows:
        tcp = tcps.get(r.get("loss_rate"))
        crossed = tcp is not None and tcp.get("network") == "kernel" and same_loss
        if not crossed:
            tcp = None  # (every *_vs_gloo figure below: None)
        r["gloo_crossed_same_network"] = crossed
        r["round_speedup_vs_gloo"] = ratio(tcp.get("round_ms_p50") if tcp else None,
                                           r.get("round_ms_p50"))
        r["burst_over_normal_round"] = ratio(r.get("burst_round_ms_mean"),
                                             r.get("normal_round_ms_p50"))
        r["burst_over_normal_round_outside_clr"] = ratio(
            r.get("burst_round_ms_mean_outside_clr"), r.get("normal_round_ms_p50"))
        r["tta_speedup_vs_gloo"] = ratio(tcp.get("time_to_target_s") if tcp else None,
                                         r.get("time_to_target_s"))
        r["wall_speedup_vs_gloo"] = ratio(tcp.get("wall_s") if tcp else None, r.get("wall_s"))
        r["metric_change_vs_gloo"] = (r["final_metric"] - tcp["final_metric"]
                                      if tcp is not None else None)
        for what in ("round", "comm"):
            for suffix in ("", "_outside_clr"):
                key = f"burst_{what}_ms_mean{suffix}"
                r[f"speedup_burst_{what}{suffix}_vs_baseline"] = ratio(
                    base.get(key) if base else None, r.get(key))
        b_wall = base.get("wall_s") if base else None
        r["time_reduction_vs_baseline"] = 1.0 - r["wall_s"] / b_wall if b_wall else None
        r["throughput_vs_baseline"] = ratio(r.get("samples_per_s"),
                                            base.get("samples_per_s") if base else None)
        if ref is not None:
            r["metric_change_vs_reliable"] = r["final_metric"] - ref["final_metric"]
            r["metric_rel_change_vs_reliable"] = (
                r["final_metric"] / ref["final_metric"] - 1.0 if ref["final_metric"] else None)
        else:
            r["metric_change_vs_reliable"] = r["metric_rel_change_vs_reliable"] = None
    return rows


def run_compare(scenario: Scenario, arms: list[Arm], out_dir: str, *,
                repeats: int = 1, epochs: int | None = None, workers: int | None = None,
                seed: int = 0, steps_per_epoch: int | None = None,
                probe_copies_max: int | None = None,
                progress: Callable[[RunResult], None] | None = None,
                starting: Callable[[Arm, int], None] | None = None,
                ) -> tuple[list[dict], dict[str, list[RunResult]]]:
    """Train every arm ``repeats`` times (interleaved); return the rows (with ratios)
    and the runs per arm. ``probe_copies_max``: the transport's PROBE copies for every
    arm (None: the scenario's recovery mode's)."""
    epochs = epochs or scenario.epochs
    workers = workers or scenario.workers
    if probe_copies_max is None and scenario.recovery != "copies":
        probe_copies_max = probe_copies_for(scenario.recovery)
    with _network(scenario, workers) as network:
        runs = _run_arms(scenario, arms, out_dir, repeats, epochs, workers, seed,
                         steps_per_epoch, probe_copies_max, progress, starting, network)
    return compare_rows(scenario, arms, runs, probe_copies_max), runs


def compare_rows(scenario: Scenario, arms: list[Arm], runs: dict[str, list[RunResult]],
                 probe_copies_max: int | None = None) -> list[dict]:
    """The rows of a comparison's runs (one per arm, medians over repeats), with every
    ratio (:func:`add_ratios`)."""
    # DBLP's critical regimes, from its first arm (the rounds left out of the
    # outside-CLR figures of every arm)
    dblp = next((runs[a.label] for a in arms if a.policy.name == "dblp"), None)
    clr: list[set[int] | None] | None = (
        [r.critical_rounds() for r in dblp] if dblp else None)
    rows = [summarise(a.label, runs[a.label], scenario, clr) for a in arms]
    recovery = next((name for name, copies in RECOVERY_MODES.items()
                     if copies == (probe_copies_max or RECOVERY_MODES["copies"])), None)
    base = runs.get(scenario.baseline)
    for arm, row in zip(arms, rows):
        row["network"] = scenario.network
        row["sharded"] = scenario.sharded
        row["precision"] = scenario.precision
        row["device"] = scenario.device
        # (our arms' receiver-driven credit: off, a budget in bytes, or auto)
        row["credit"] = (str(CreditSetting(scenario.credit_bytes, scenario.credit_adaptive))
                         if arm.policy.uses_transport else None)
        # in-process loss cannot reach a TCP arm (gloo, tcp-ps): it ran lossless while
        # the others met the loss
        row["ran_lossless"] = (scenario.network != "kernel" and not scenario.is_sweep
                               and arm.loss == "none" and scenario.loss != "none")
        row["probe_copies_max"] = probe_copies_max
        row["recovery"] = recovery or f"copies<={probe_copies_max}"
        row["speedup_burst_comm_outside_clr_max_vs_baseline"] = _median(
            max_burst_comm_speedup(b, r, clr[r.repeat] if clr else None)
            for b, r in zip(base or [], runs[arm.label]))
    return add_ratios(rows, scenario.baseline, scenario.reference)


def max_burst_comm_speedup(baseline: RunResult, run: RunResult,
                           critical: set[int] | None) -> float | None:
    """The largest single-round communication speedup of ``run`` against ``baseline``
    (the same repeat, so the same burst schedule) over the burst rounds outside the
    critical regimes ``critical``: max over those rounds of the baseline's communication
    time over this run's (the published "up to 5.88x" is such a maximum)."""
    if critical is None:
        return None
    mine, theirs = run.comm_by_round(), baseline.comm_by_round()
    ratios = [theirs[r] / mine[r] for r in run.burst & baseline.burst
              if r not in critical and r in mine and r in theirs and mine[r] > 0]
    return max(ratios) if ratios else None


@dataclass(frozen=True)
class KernelRun:
    """The kernel network the arms of a run cross: the testbed, and its bursts (if the
    scenario has them) running from before the first arm to after the last."""

    testbed: Testbed
    bursts: BurstRunner | None = None

    def set_random_loss(self, rate: float) -> None:
        """Drop ``rate`` of every packet toward every node, at random (the counters of
        :meth:`drop_fraction` from zero)."""
        for node in self.testbed.nodes:
            self.testbed.set_loss(rate, node, protocol="all")

    def drop_fraction(self) -> float:
        """The fraction of the packets toward the nodes that the random loss dropped,
        since it was last set."""
        stats = [self.testbed.loss_stats(node) for node in self.testbed.nodes]
        seen = sum(s.seen_packets for s in stats)
        return sum(s.dropped_packets for s in stats) / seen if seen else 0.0


def _network(scenario: Scenario, workers: int) -> AbstractContextManager[KernelRun | None]:
    """The kernel network the arms run in (one for all of them), or a null context."""
    if scenario.network != "kernel" or scenario.kernel is None:
        return contextlib.nullcontext(None)
    return _kernel_network(scenario.kernel, workers)


@contextlib.contextmanager
def _kernel_network(kernel: KernelNetwork, workers: int):
    from ..emulate import Testbed, TestbedConfig

    with Testbed(TestbedConfig(workers=workers - 1, bottleneck=kernel.bottleneck)) as tb:
        if kernel.random_loss > 0:
            KernelRun(tb).set_random_loss(kernel.random_loss)
        if kernel.bursts is None:
            yield KernelRun(tb)
            return
        with kernel.bursts.start(tb, base=kernel.random_loss) as bursts:
            yield KernelRun(tb, bursts)


def _run_arms(scenario, arms, out_dir, repeats, epochs, workers, seed, steps_per_epoch,
              probe_copies_max, progress, starting,
              network: KernelRun | None) -> dict[str, list[RunResult]]:
    testbed = network.testbed if network is not None else None
    runs: dict[str, list[RunResult]] = {a.label: [] for a in arms}
    for k in range(repeats):
        for arm in arm_order(arms, k):
            if starting is not None:
                starting(arm, k)
            out = str(Path(out_dir) / "runs" / f"{_safe(arm.label)}-r{k}")
            cfg = make_config(scenario, arm, out=out, epochs=epochs, workers=workers,
                              seed=seed, steps_per_epoch=steps_per_epoch,
                              probe_copies_max=probe_copies_max)
            before = testbed.qdisc_stats() if testbed is not None else None
            tcp_before = testbed.tcp_counters() if testbed is not None else None
            sweep_on_kernel = network if scenario.is_sweep else None
            if sweep_on_kernel is not None:
                sweep_on_kernel.set_random_loss(arm.loss_rate or 0.0)  # (this arm's network)
            run_training(cfg, testbed=testbed)
            # every arm marks the scenario's burst rounds (gloo's too, though its TCP
            # path cannot take the loss), so the rounds compared are the same
            res = read_run(arm.label, k, out, scenario.loss, arm)
            if network is not None and network.bursts is not None:
                res.burst = network.bursts.rounds_in_bursts(res.rounds)
            if testbed is not None and before is not None:
                res.bottleneck = bottleneck_figures(before, testbed.qdisc_stats())
            if testbed is not None and tcp_before is not None:
                res.tcp = tcp_counters.difference(tcp_before, testbed.tcp_counters())
            if sweep_on_kernel is not None:
                res.bottleneck["kernel_drop_fraction"] = sweep_on_kernel.drop_fraction()
            runs[arm.label].append(res)
            if progress is not None:
                progress(res)
    return runs


def bottleneck_figures(before, after) -> dict:
    """What the bottleneck's queue did during one run, from its qdisc counters before and
    after (start-up and rendezvous traffic included: small next to the gradients)."""
    if before is None or after is None:
        return {}
    sent = after.sent_packets - before.sent_packets
    dropped = after.dropped - before.dropped
    return {"bottleneck_sent_mb": (after.sent_bytes - before.sent_bytes) / 1e6,
            "bottleneck_dropped": float(dropped),
            "bottleneck_drop_fraction": dropped / (sent + dropped) if sent + dropped else 0.0}


def arm_order(arms: list[Arm], repeat: int) -> list[Arm]:
    """The order of the arms in repeat ``repeat``: as given, reversed every other one."""
    return list(arms) if repeat % 2 == 0 else list(reversed(arms))


def _safe(label: str) -> str:
    """An arm's label as a folder name (``mlt:p=0.05`` -> ``mlt-p0.05``)."""
    return (label.replace("@", "-").replace("%", "pct").replace("+", "-")
            .replace(":", "-").replace("=", ""))


def choose_network(scenario: Scenario, network: str = DEFAULT_NETWORK) -> Scenario:
    """The scenario on the network asked for: ``in-process`` (loss injected at the
    endpoints), ``kernel`` (the testbed; ``ValueError`` with the reason if this scenario
    has no kernel setup or the testbed cannot run here), or ``auto`` (the kernel when the
    scenario has a kernel setup and the testbed can run, else in-process)."""
    if network not in NETWORKS:
        raise ValueError(f"unknown network {network!r}; choose from {', '.join(NETWORKS)}")
    if network == "in-process" or (network == "auto" and scenario.kernel is None):
        return scenario
    kernel = scenario.on_kernel()  # raises for "kernel" without a kernel setup
    from ..emulate import available

    ok, why = available()
    if ok:
        return kernel
    if network == "kernel":
        raise ValueError(f"the kernel testbed cannot run here: {why}")
    from ..doctor import no_kernel_network

    return replace(scenario, network_note=no_kernel_network(why))


def with_burst_every(scenario: Scenario, every: int) -> Scenario:
    """The scenario with its in-process round bursts every ``every`` rounds (each
    ``burst:`` term's ``every``; its offset kept below it)."""
    terms = []
    for term in scenario.loss.split("+"):
        if term.startswith("burst:"):
            fields = dict(kv.split("=", 1) for kv in term[len("burst:"):].split(","))
            fields["every"] = str(every)
            if "offset" in fields:
                fields["offset"] = str(int(fields["offset"]) % every)
            term = "burst:" + ",".join(f"{k}={v}" for k, v in fields.items())
        terms.append(term)
    return replace(scenario, loss="+".join(terms))


#: the test accuracy every arm is timed to, per ``--data``: the level each data set's
#: models reach in a comparison's length (digits: the scenarios' own 95%)
DATA_TARGETS = {"digits": 0.95, "fashion-mnist": 0.80}


def with_images(scenario: Scenario, data: str | None = None,
                model: str | None = None) -> Scenario:
    """The scenario's image model on ``data`` (a ``--data`` name; its target then that
    data's) and/or another image model (``--model mlp|cnn``); ``ValueError`` (one line)
    for a scenario whose model takes no images."""
    from .train import IMAGE_MODELS

    if scenario.model not in IMAGE_MODELS:
        raise ValueError(f"scenario {scenario.name} trains {scenario.model} on text; --data "
                         f"and --model are for the image scenarios")
    if data is not None and data not in DATA_TARGETS:
        raise ValueError(f"--data must be one of {', '.join(DATA_TARGETS)}")
    if model is not None and model not in IMAGE_MODELS:
        raise ValueError(f"--model must be one of {', '.join(IMAGE_MODELS)}")
    data = data or scenario.data or "digits"
    model = model or scenario.model
    target = scenario.target_metric and DATA_TARGETS[data]
    note = ""
    if model != scenario.model:
        note += f" Model: the {model.upper()} instead of the {scenario.model.upper()} (--model)."
    if data != "digits":
        timed = f", every arm timed to {target:.0%} test accuracy" if target else ""
        note += f" Images: {data} instead of digits (--data){timed}."
    return replace(scenario, data=data, model=model, target_metric=target,
                   notes=scenario.notes + note)


def with_loss(scenario: Scenario, loss_spec: str) -> Scenario:
    """The scenario with its shared loss spec replaced (policy scenarios)."""
    return replace(scenario, loss=loss_spec, description=(
        f"{scenario.description} Loss spec overridden on the command line: {loss_spec}."))
