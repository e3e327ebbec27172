"""`boundedloss compare`: several policies on one scenario, same model/data/seed/loss.

Each policy is trained with :func:`boundedloss.experiments.train.run_training` into its
own subdirectory of ``out`` (``runs/<policy>-r<k>``); repeats are interleaved (policy A,
B, C, then A, B, C again) so slow drift of the machine hits every policy alike. The
per-round and per-epoch logs are read back and summarised per policy (median over
repeats), with ratios against the fixed-bound baseline (MLT at P = P_low) and the
reliable policy.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .train import TrainConfig, run_training

#: Names accepted by ``--policies``; ``baseline`` is MLT with P fixed at DBLP's P_low.
COMPARE_POLICIES = ("gloo", "reliable", "mlt", "ltp", "dblp", "baseline")
P_LOW = 0.008  # DBLP's default P_low; the baseline's fixed bound

ROW_FIELDS = (
    "policy", "scenario", "scenario_description", "wall_s", "round_ms_p50", "round_ms_p99",
    "burst_round_ms_mean", "final_metric", "metric_name", "delivered_fraction_mean",
    "retransmit_rounds_mean", "speedup_burst_round_vs_baseline", "time_reduction_vs_baseline",
    "metric_change_vs_reliable", "repeats",
)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    model: str
    topology: str
    workers: int
    loss: str
    epochs: int = 8

    def loss_for(self, policy: str) -> str:
        """gloo runs over TCP: in-process loss cannot reach it, so it runs lossless."""
        return "none" if policy == "gloo" else self.loss


SCENARIOS: dict[str, Scenario] = {
    "microburst": Scenario(
        name="microburst",
        description=(
            "DBLP microburst: digits MLP, parameter-server topology, 1% random (Bernoulli) "
            "datagram loss at every receiver plus bursts of 80% loss at rank 0 (the server, "
            "which receives the pushes) on training rounds 7, 22, 37, ... (every 15 rounds, "
            "1 round long). gloo (DDP's TCP allreduce) cannot take in-process loss and runs "
            "lossless. baseline = MLT with the bound fixed at P_low = 0.8%."
        ),
        model="mlp",
        topology="ps",
        workers=3,
        loss="bernoulli:0.01+burst:rate=0.8,every=15,len=1,offset=7,rank=0",
    ),
}


def parse_policies(text: str) -> tuple[str, ...]:
    """Comma-separated policy names -> tuple (order kept, duplicates dropped);
    ``ValueError`` naming the bad one."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name not in COMPARE_POLICIES:
            raise ValueError(f"unknown policy {raw.strip()!r}; choose from "
                             f"{', '.join(COMPARE_POLICIES)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("no policies given")
    return tuple(names)


def make_config(scenario: Scenario, policy: str, *, out: str, epochs: int, workers: int,
                seed: int, steps_per_epoch: int | None = None) -> TrainConfig:
    if policy == "baseline":
        base, mlt_p = "mlt", P_LOW
    else:
        base, mlt_p = policy, None
    return TrainConfig(policy=base, topology=scenario.topology, workers=workers,
                       model=scenario.model, epochs=epochs, seed=seed,
                       loss=scenario.loss_for(policy), out=out,
                       steps_per_epoch=steps_per_epoch, mlt_p=mlt_p)


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
    out: set[int] = set()
    for r in round_ids:
        r = int(r)
        if any((r in b.rounds) or (b.every is not None and r >= b.offset
                                   and (r - b.offset) % b.every < b.length) for b in bursts):
            out.add(r)
    return out


# ------------------------------------------------------------------ reading a run
@dataclass
class RunResult:
    policy: str
    repeat: int
    out: str
    rounds: list[dict]
    epochs: list[dict]
    summary: dict
    burst: set[int] = field(default_factory=set)

    @property
    def metric_name(self) -> str:
        return self.summary["metric_name"]

    def stats(self) -> dict:
        lat = np.array([r["step_ms"] for r in self.rounds], dtype=float)
        burst_lat = [r["step_ms"] for r in self.rounds if r["round"] in self.burst]
        deliv = [r["delivered_fraction"] for r in self.rounds if "delivered_fraction" in r]
        retx = [r["retransmit_rounds"] for r in self.rounds if "retransmit_rounds" in r]
        return {
            "wall_s": float(self.summary["wall_s"]),
            "round_ms_p50": float(np.percentile(lat, 50)) if lat.size else None,
            "round_ms_p99": float(np.percentile(lat, 99)) if lat.size else None,
            "burst_round_ms_mean": float(np.mean(burst_lat)) if burst_lat else None,
            "final_metric": float(self.summary["final_metric"]),
            # gloo has no comm fields: everything arrives, nothing is retransmitted by us
            "delivered_fraction_mean": float(np.mean(deliv)) if deliv else 1.0,
            "retransmit_rounds_mean": float(np.mean(retx)) if retx else 0.0,
        }


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_run(policy: str, repeat: int, out: str, loss_spec: str) -> RunResult:
    d = Path(out)
    rounds = _read_jsonl(d / "rounds.jsonl")
    res = RunResult(policy=policy, repeat=repeat, out=out, rounds=rounds,
                    epochs=_read_jsonl(d / "epochs.jsonl"),
                    summary=json.loads((d / "summary.json").read_text()))
    res.burst = burst_rounds(loss_spec, [r["round"] for r in rounds])
    return res


# ------------------------------------------------------------------ rows and ratios
def _median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(statistics.median(vals)) if vals else None


def summarise(policy: str, runs: list[RunResult], scenario: Scenario) -> dict:
    stats = [r.stats() for r in runs]
    row = {"policy": policy, "scenario": scenario.name,
           "scenario_description": scenario.description,
           "metric_name": runs[0].metric_name, "repeats": len(runs)}
    for key in stats[0]:
        row[key] = _median(s[key] for s in stats)
    return row


def add_ratios(rows: list[dict]) -> list[dict]:
    """Fill ``speedup_burst_round_vs_baseline``, ``time_reduction_vs_baseline`` and
    ``metric_change_vs_reliable`` in place (None where the reference is missing)."""
    by = {r["policy"]: r for r in rows}
    base = by.get("baseline")
    rel = by.get("reliable")
    for r in rows:
        b_burst = base.get("burst_round_ms_mean") if base else None
        burst = r.get("burst_round_ms_mean")
        r["speedup_burst_round_vs_baseline"] = (
            b_burst / burst if b_burst is not None and burst else None)
        b_wall = base.get("wall_s") if base else None
        r["time_reduction_vs_baseline"] = (
            1.0 - r["wall_s"] / b_wall if b_wall else None)
        r["metric_change_vs_reliable"] = (
            r["final_metric"] - rel["final_metric"] if rel is not None else None)
    return rows


def run_compare(scenario: Scenario, policies: tuple[str, ...], out_dir: str, *,
                repeats: int = 1, epochs: int | None = None, workers: int | None = None,
                seed: int = 0, steps_per_epoch: int | None = None,
                progress: Callable[[RunResult], None] | None = None
                ) -> tuple[list[dict], dict[str, list[RunResult]]]:
    """Train every policy ``repeats`` times (interleaved); return the rows (with ratios)
    and the runs per policy."""
    epochs = epochs or scenario.epochs
    workers = workers or scenario.workers
    runs: dict[str, list[RunResult]] = {p: [] for p in policies}
    for k in range(repeats):
        for policy in policies:
            out = str(Path(out_dir) / "runs" / f"{policy}-r{k}")
            cfg = make_config(scenario, policy, out=out, epochs=epochs, workers=workers,
                              seed=seed, steps_per_epoch=steps_per_epoch)
            run_training(cfg)
            res = read_run(policy, k, out, cfg.loss)
            runs[policy].append(res)
            if progress is not None:
                progress(res)
    rows = add_ratios([summarise(p, runs[p], scenario) for p in policies])
    return rows, runs


def write_json(rows: list[dict], path: str) -> None:
    p = Path(path)
    if p.parent != Path(""):
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(rows, indent=2) + "\n")
