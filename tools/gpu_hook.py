"""The DDP hook's CUDA path on a GPU: `boundedloss train --device cuda`, system by system
(``--sharded``: FSDP2's instead of DDP's - gloo is then FSDP2's own collectives, ours its
reduce-scatter and all-gather, and bf16 its mixed precision over float32 parameters).

For each precision (``--precisions``, fp32 then bf16) and system (``--systems``: gloo,
DDP's own allreduce, and our policies) runs ``boundedloss train --device cuda`` with
``--workers`` ranks sharing the one GPU, lossless loopback, the same model, seed and
steps for every arm; then one arm of ours (``--lossy-policy``) with in-process loss at
its receivers (``--loss``), in bf16 when that precision is run - which gloo, over TCP,
does not cross, so that arm gets no ratio against it. Prints the environment first
(torch, the GPU, whether boundedloss's compiled extension is enabled), then a table -
system, precision, step p50 (and p90) ms, ratio to gloo at the same precision, the
final test metric, training and process wall s - and writes it all as JSON (``--json``).
Needs no kernel testbed (no pyroute2, no namespaces).

    python3 tools/gpu_hook.py --json gpu-hook.json
    python3 tools/gpu_hook.py --sharded --json gpu-hook-fsdp2.json

The default (charlm, 4 workers, 6 epochs of 60 steps, 7 runs) is sized to finish in
about 4 minutes on one H100 (each run spends ~20 s starting its ranks, CUDA and the
rendezvous); ``--sharded``'s took 194 s on an H100 (torch 2.11). A failed run is
reported with its last lines; the others go on, and the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Arm:
    """One training run: a system at a precision, over loopback with or without loss."""

    system: str
    precision: str
    loss: str = "none"
    #: FSDP2 (``train --sharded``) instead of DDP
    sharded: bool = False

    @property
    def name(self) -> str:
        lossy = "" if self.loss == "none" else "-" + self.loss.replace(":", "").replace(",", "")
        fsdp = "-fsdp2" if self.sharded else ""
        return f"{self.system.replace(':', '')}-{self.precision}{lossy}{fsdp}"


@dataclass(frozen=True)
class Result:
    arm: Arm
    ok: bool
    step_p50_ms: float | None = None
    step_p90_ms: float | None = None
    comm_p50_ms: float | None = None  # ours: the hook's slowest bucket a round, rank 0
    metric_name: str | None = None
    final_metric: float | None = None
    train_s: float | None = None  # the training loop (summary.json's wall_s)
    wall_s: float | None = None  # the whole process: start-up, CUDA, rendezvous, training
    rounds: int | None = None
    summary: dict | None = None
    error: str | None = None


def environment() -> dict:
    """What the figures were taken on, printed and kept in the JSON."""
    import torch

    from boundedloss import native

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpu": gpu,
            "gpus_visible": torch.cuda.device_count() if gpu else 0,
            "native_enabled": native.enabled(), "native_status": native.status(),
            "cpus": os.cpu_count()}


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(
        values) > 1 else values[0]


def run(arm: Arm, a: argparse.Namespace, out: Path) -> Result:
    cmd = [sys.executable, "-m", "boundedloss.cli", "train", "--device", "cuda",
           "--precision", arm.precision, "--policy", arm.system, "--loss", arm.loss,
           "--workers", str(a.workers), "--model", a.model,
           "--epochs", str(a.epochs), "--steps-per-epoch", str(a.steps_per_epoch),
           "--seed", str(a.seed), "--out", str(out)]
    # (FSDP2 has no topology: train refuses one with --sharded)
    cmd += ["--sharded"] if arm.sharded else ["--topology", a.topology]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "120"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        return Result(arm, False, wall_s=wall, error=" | ".join(tail))
    summary = json.loads((out / "summary.json").read_text())
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    steps = [r["step_ms"] for r in rounds]
    comms = [r["comm_ms"] for r in rounds if r.get("comm_ms") is not None]
    return Result(arm, True, step_p50_ms=statistics.median(steps),
                  step_p90_ms=_percentile(steps, 90),
                  comm_p50_ms=statistics.median(comms) if comms else None,
                  metric_name=summary["metric_name"], final_metric=summary["final_metric"],
                  train_s=summary["wall_s"], wall_s=wall, rounds=summary["rounds"],
                  summary=summary)


def arms(a: argparse.Namespace) -> list[Arm]:
    planned = [Arm(s, p, sharded=a.sharded) for p in a.precisions for s in a.systems]
    if a.lossy_policy != "none" and a.loss != "none":
        precision = "bf16" if "bf16" in a.precisions else a.precisions[0]
        planned.append(Arm(a.lossy_policy, precision, a.loss, sharded=a.sharded))
    return planned


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def print_table(results: list[Result]) -> None:
    gloo = {(r.arm.precision, r.arm.sharded): r.step_p50_ms for r in results
            if r.ok and r.arm.system == "gloo" and r.arm.loss == "none"}
    head = (f"{'system':10s} {'wrap':5s} {'precision':9s} {'network':26s} {'step p50':>9s} "
            f"{'p90':>8s} {'vs gloo':>8s} {'comm p50':>9s} {'metric':>18s} {'train s':>8s} "
            f"{'wall s':>7s}")
    print(head)
    print("-" * len(head))
    for r in results:
        network = "loopback" if r.arm.loss == "none" else f"loopback+{r.arm.loss}*"
        wrap = "FSDP2" if r.arm.sharded else "DDP"
        if not r.ok:
            print(f"{r.arm.system:10s} {wrap:5s} {r.arm.precision:9s} {network:26s} "
                  f"FAILED: {r.error}")
            continue
        base = gloo.get((r.arm.precision, r.arm.sharded))
        # a ratio only against gloo at the same precision and wrapping (DDP or FSDP2)
        # over the same (lossless) network
        ratio = ("-" if r.arm.loss != "none" or base is None or r.arm.system == "gloo"
                 else f"{r.step_p50_ms / base:.2f}x")
        metric = f"{r.metric_name} {r.final_metric:.4f}"
        print(f"{r.arm.system:10s} {wrap:5s} {r.arm.precision:9s} {network:26s} "
              f"{_ms(r.step_p50_ms):>9s} {_ms(r.step_p90_ms):>8s} {ratio:>8s} "
              f"{_ms(r.comm_p50_ms):>9s} {metric:>18s} {r.train_s:8.1f} {r.wall_s:7.1f}")
    if any(r.arm.loss != "none" for r in results):
        print("* in-process loss injected at our endpoints' receivers: gloo (TCP) did not "
              "cross it, so that arm has no ratio to gloo; compare its metric with the same "
              "system's lossless row")


def _list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", type=_list, default=("gloo", "reliable", "dblp"),
                    help="gloo and policies of ours, comma-separated (gloo,reliable,dblp)")
    ap.add_argument("--precisions", type=_list, default=("fp32", "bf16"))
    ap.add_argument("--workers", type=int, default=4, help="ranks, all on the one GPU")
    ap.add_argument("--model", default="charlm",
                    help="charlm (a GRU language model: the shipped model with the most "
                         "GPU work a step), mlp or cnn")
    ap.add_argument("--topology", default="ps", choices=["ps", "allreduce", "two-level"],
                    help="the DDP hook's collective (not with --sharded)")
    ap.add_argument("--sharded", action="store_true",
                    help="FSDP2 instead of DDP (train --sharded); rows and JSON say so")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--steps-per-epoch", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lossy-policy", default="dblp",
                    help="the arm of ours run with --loss too (none: no such arm)")
    ap.add_argument("--loss", default="bernoulli:0.05",
                    help="the in-process loss that arm's receivers see (none: no such arm)")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu-hook"),
                    help="each run's logs under OUT/<arm>/")
    ap.add_argument("--json", type=Path, help="write the environment and every row here")
    a = ap.parse_args()
    env = environment()
    print(f"python {env['python']}  torch {env['torch']} (CUDA {env['cuda']})  "
          f"GPU: {env['gpu'] or 'none visible'}  x{env['gpus_visible']}  cpus {env['cpus']}")
    print(f"boundedloss compiled extension enabled: {env['native_enabled']} "
          f"({env['native_status']})", flush=True)
    if env["gpu"] is None:
        print("no CUDA device is visible: nothing to run", file=sys.stderr)
        return 1
    results = []
    for arm in arms(a):
        r = run(arm, a, a.out / arm.name)
        results.append(r)
        said = (f"step p50 {_ms(r.step_p50_ms)} ms, {r.metric_name} {r.final_metric:.4f}"
                if r.ok else f"FAILED: {r.error}")
        print(f"  {arm.name}: {said} ({r.wall_s:.1f} s)", flush=True)
    print()
    print_table(results)
    if a.json:
        a.json.write_text(json.dumps({
            "environment": env, "settings": {k: (str(v) if isinstance(v, Path) else v)
                                             for k, v in vars(a).items()},
            "rows": [{**asdict(r), "arm": asdict(r.arm)} for r in results]}, indent=2) + "\n")
        print(f"written to {a.json}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
