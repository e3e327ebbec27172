"""How long the kernel testbed takes to come up and go down, and to change a loss rule.

Times, interleaved in one run (every other repeat in reverse order):
- ``boundedloss testbed up --workers N`` and ``down`` as a user runs them (a fresh
  process each, Python's start included), for this checkout and - with ``--baseline
  SRC`` - for another checkout's ``src`` folder (e.g. a ``git worktree`` of an older
  commit), each with the ``--loss`` given where the baseline can take it;
- in one process: a loss-rule change through a ``LossRuleWriter`` (a timed microburst's
  change: burst rate and base in turn, prepared first as a burst runner prepares them)
  and through ``Testbed.set_loss`` (a rule set afresh), ``--changes`` of each.

Prints a table and writes JSON (``--json``). Root, or a user namespace of its own.

    python tools/testbed_timing.py --workers 4 --repeats 5 --json bench-testbed.json
    git worktree add /tmp/old d3b6caa
    python tools/testbed_timing.py --baseline /tmp/old/src --json bench-testbed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "src"


def _cli(src: Path, state: str, *args: str) -> float:
    """Seconds one ``boundedloss testbed`` command takes (it must succeed)."""
    env = {**os.environ, "PYTHONPATH": str(src), "BOUNDEDLOSS_STATE_DIR": state}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "boundedloss.cli", "testbed", *args],
                       capture_output=True, text=True, env=env, timeout=120)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"`testbed {' '.join(args)}` from {src} failed: "
                         f"{(p.stderr or p.stdout).strip()}")
    return took


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _rule_changes(workers: int, changes: int) -> dict[str, list[float]]:
    sys.path.insert(0, str(HERE))
    from boundedloss.emulate import Testbed

    out: dict[str, list[float]] = {"writer": [], "set_loss": []}
    with Testbed(workers=workers, prefix="bltime-") as tb:
        w = tb.loss_writer("server")
        w.prepare(0.8, 0.01)  # (as a burst runner does before its first burst)
        for i in range(changes):
            t0 = time.perf_counter()
            w.set(0.8 if i % 2 else 0.01)
            out["writer"].append(time.perf_counter() - t0)
        for i in range(changes // 10):
            t0 = time.perf_counter()
            tb.set_loss(0.05 if i % 2 else 0.01, "w0")
            out["set_loss"].append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--loss", default="0.01", help="--loss for `up` (this checkout)")
    ap.add_argument("--baseline", type=Path, help="another checkout's src folder")
    ap.add_argument("--baseline-loss", default="0",
                    help="--loss for the baseline's `up` (0: it may lack the tools for it)")
    ap.add_argument("--changes", type=int, default=1000)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    arms = [("this", HERE, a.loss)]
    if a.baseline is not None:
        arms.append(("baseline", a.baseline.resolve(), a.baseline_loss))
    times: dict[str, dict[str, list[float]]] = {n: {"up": [], "down": []} for n, _, _ in arms}
    for k in range(a.repeats):
        for name, src, loss in (arms if k % 2 == 0 else arms[::-1]):
            with tempfile.TemporaryDirectory() as state:
                times[name]["up"].append(_cli(src, state, "up", "--workers", str(a.workers),
                                              "--loss", loss, "--prefix", "bltime-"))
                times[name]["down"].append(_cli(src, state, "down", "--prefix", "bltime-"))
    changes = _rule_changes(a.workers, a.changes)
    rows = []
    for name, src, loss in arms:
        for step in ("up", "down"):
            xs = times[name][step]
            rows.append({"what": f"testbed {step} ({name}, --loss {loss})", "src": str(src),
                         "n": len(xs), "median_ms": 1e3 * statistics.median(xs),
                         "max_ms": 1e3 * max(xs)})
    for kind, xs in changes.items():
        rows.append({"what": f"rule change: {kind}", "src": str(HERE), "n": len(xs),
                     "median_ms": 1e3 * statistics.median(xs), "p99_ms": 1e3 * _pct(xs, 0.99),
                     "max_ms": 1e3 * max(xs)})
    print(f"{'what':44} {'n':>5} {'median ms':>10} {'p99 ms':>8} {'max ms':>8}")
    for r in rows:
        p99 = f"{r['p99_ms']:8.3f}" if "p99_ms" in r else f"{'':8}"
        print(f"{r['what']:44} {r['n']:5d} {r['median_ms']:10.3f} {p99} {r['max_ms']:8.3f}")
    if a.json:
        a.json.write_text(json.dumps({"workers": a.workers, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
