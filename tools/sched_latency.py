"""How long a woken rank thread waits to run on the kernel testbed.

Runs ``bench kernel-loss`` (4 ranks, one system and topology) under ``perf sched record``
(every wakeup and context switch on every CPU) at each MTU and loss asked, and reads
``perf sched latency``'s line for the ranks' Python threads: their run
time, their switches, and the mean and longest wait from a wakeup to running - over the
whole run, set-up included, with a core free or not. Prints a row per setting; ``--json``
writes them. This is what ``sim --cpu-wake`` stands in for.

    python tools/sched_latency.py --mtus 1500,9000 --losses 0,0.01 --json sched.json

Needs ``perf`` (linux-tools; not a dependency of the product) and root, as the testbed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

#: perf sched latency's line for a task: runtime, switches, average and maximum delay
LINE = re.compile(r"^\s*(?P<task>[^|]+?)\s*\|\s*(?P<runtime>[\d.]+) ms\s*\|\s*(?P<switches>\d+)"
                  r"\s*\|\s*avg:\s*(?P<avg>[\d.]+) ms\s*\|\s*max:\s*(?P<max>[\d.]+) ms")
#: (the ranks' interpreter's name: ``python:`` or ``python3:`` as it was started)
RANKS = re.compile(r"python3?:")


def ranks_latency(report: str) -> dict:
    """The ranks' line of a ``perf sched latency`` report, as numbers."""
    for line in report.splitlines():
        m = LINE.match(line)
        if m and RANKS.match(m["task"]):
            return {"threads_runtime_ms": float(m["runtime"]), "switches": int(m["switches"]),
                    "avg_wake_delay_ms": float(m["avg"]), "max_wake_delay_ms": float(m["max"])}
    raise SystemExit("no line for the ranks' Python threads in perf sched latency's report")


def run(system: str, topology: str, mtu: int, loss: float, rounds: int, tmp: Path) -> dict:
    data, rows = tmp / f"sched-{mtu}-{loss}.data", tmp / f"bench-{mtu}-{loss}.json"
    subprocess.run(["perf", "sched", "record", "-q", "-o", str(data), "--",
                    sys.executable, "-m", "boundedloss.cli", "bench", "kernel-loss",
                    "--systems", system, "--topology", topology, "--losses", str(loss),
                    "--rounds", str(rounds), "--mtu", str(mtu), "--no-bare",
                    "--json", str(rows)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report = subprocess.run(["perf", "sched", "latency", "-i", str(data), "--sort", "max"],
                            check=True, capture_output=True, text=True).stdout
    bench = json.loads(rows.read_text())[0]
    return {"mtu": mtu, "loss": loss, "system": system, "topology": topology,
            "round_p50_ms": bench["p50_ms"], "round_p99_ms": bench["p99_ms"],
            **ranks_latency(report)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", default="reliable")
    ap.add_argument("--topology", default="allreduce", choices=["ps", "allreduce"])
    ap.add_argument("--mtus", default="1500,9000")
    ap.add_argument("--losses", default="0,0.01")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = []
    print(f"{'mtu':>5} {'loss':>5} | {'round p50':>9} | {'wake avg ms':>11} {'max ms':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for mtu in (int(v) for v in a.mtus.split(",")):
            for loss in (float(v) for v in a.losses.split(",")):
                row = run(a.system, a.topology, mtu, loss, a.rounds, Path(tmp))
                rows.append(row)
                print(f"{mtu:>5} {loss:>5.0%} | {row['round_p50_ms']:9.1f} | "
                      f"{row['avg_wake_delay_ms']:11.3f} {row['max_wake_delay_ms']:7.1f}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
