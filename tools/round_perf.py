"""Where a gradient-exchange round's CPU goes on the kernel testbed: every process and
every library, ours against gloo's.

``tools/round_cpu.py`` times the steps of one of our ranks from inside; this looks from
outside, at the whole machine. For each system it runs ``boundedloss bench kernel-loss``
(lossless) under a system-wide ``perf record`` (every CPU and process: the ranks, their
threads, the kernel's forwarding in the switch's namespace, softirqs) and reads the
samples of a window inside its rounds - from a fifth of the way into them to just before
their end, which it places from the run's last sample back (the tear-down takes under
two seconds) and the rounds' own span (``--rounds`` x their mean). Each category's share
of that window's samples, times the two cores, times the mean round, is what it costs a
round, in ms of CPU:

- ``kernel``: the kernel, not idle (system calls, the UDP or TCP stack, the veths and
  the switch's forwarding, the scheduler);
- ``python``: the interpreter (our core, the collective, the harness; gloo's Python is
  the harness's alone);
- ``openssl``: libcrypto - our datagrams' tags (gloo authenticates nothing);
- ``libc``: mostly memcpy (our staging and take copies; gloo's copies);
- ``numpy``: numpy and its BLAS (aggregation, the collective's array steps);
- ``compiled path``: ``boundedloss._native`` (parsing, routing, bookkeeping);
- ``torch/gloo``: libtorch, c10, libstdc++ (gloo's ring and its sum);
- ``other``, and ``idle`` (the cores with nothing to run).

A round on the testbed is CPU-bound (its cores run every rank and the switch), so a
system's round lasts about its busy CPU over the cores, and the busy CPU less a
category, over the cores, is about what the round would last without that category's
work - its limit if that work went.

    python tools/round_perf.py --systems gloo,reliable --ranks 4
    python tools/round_perf.py --systems gloo,reliable --ranks 16 --rounds 200 --json F

Needs ``perf`` (linux-tools; not a dependency of the product) and root, as the testbed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

RUN = "import sys; from boundedloss.cli import main; sys.exit(main())"
#: samples a second on each CPU
FREQUENCY = 999
#: cores the testbed's ranks and switch share (this machine's)
CORES = os.cpu_count() or 1
#: seconds from the rounds' end to the run's last sample, at most (the ranks exiting,
#: the namespaces going)
TEARDOWN_S = 2.0
#: the window read, as fractions of the rounds' span from their start (the first rounds
#: touch fresh memory)
WINDOW = (0.2, 0.95)
#: the rounds' span at least, for a window of a few seconds
MIN_SPAN_S = 6.0
CATEGORIES = ("kernel", "python", "openssl", "libc", "numpy", "compiled path", "torch/gloo",
              "other", "idle")
_SAMPLE = re.compile(r"^\s*(.+?)\s+(\d+\.\d+):\s+\S+\s+\((.*)\)\s*$")


def category(comm: str, dso: str) -> str:
    """What a sample of ``comm`` in ``dso`` (perf's names) counts as."""
    if comm == "swapper":
        return "idle"
    if dso == "[kernel.kallsyms]":
        return "kernel"
    name = Path(dso).name
    if name.startswith(("libpython", "python")):
        return "python"
    if name.startswith(("libcrypto", "libssl")):
        return "openssl"
    if name.startswith(("libc.so", "libm.so", "ld-linux")):
        return "libc"
    if "_multiarray" in name or "numpy" in dso or "openblas" in name:
        return "numpy"
    if name.startswith("_native"):
        return "compiled path"
    if name.startswith(("libtorch", "libc10", "libstdc++", "libgomp", "libgloo")):
        return "torch/gloo"
    return "other"


def read_samples(data: Path) -> list[tuple[float, str]]:
    """Every sample of a ``perf record`` file: (time, category)."""
    out = subprocess.run(["perf", "script", "-i", str(data), "-G", "-F", "comm,time,ip,dso"],
                         check=True, capture_output=True, text=True).stdout
    samples = []
    for line in out.splitlines():
        m = _SAMPLE.match(line)
        if m:
            samples.append((float(m.group(2)), category(m.group(1), m.group(3))))
    return samples


def per_round(samples: list[tuple[float, str]], rounds: int,
              mean_ms: float) -> tuple[dict[str, float], tuple[float, float], int]:
    """CPU ms per round by category, from the window inside the rounds; the window
    (seconds before the run's end) and its samples."""
    span = rounds * mean_ms / 1e3
    if span < MIN_SPAN_S:
        raise SystemExit(f"the rounds took {span:.1f} s: run more (--rounds), for a "
                         f"window of a few seconds inside them")
    last = max(t for t, _ in samples)
    end = last - TEARDOWN_S
    lo, hi = end - span * (1 - WINDOW[0]), end - span * (1 - WINDOW[1])
    counts = Counter(c for t, c in samples if lo <= t <= hi)
    n = sum(counts.values())
    if not n:
        raise SystemExit("no samples inside the rounds: did perf record the whole run?")
    ms = {c: counts[c] / n * CORES * mean_ms for c in CATEGORIES}
    return ms, (last - lo, last - hi), n


def run(system: str, a: argparse.Namespace, tmp: Path) -> dict:
    """One bench run under perf, and what its rounds cost."""
    data, rows = tmp / f"{system}.data", tmp / f"{system}.json"
    subprocess.run(
        ["perf", "record", "-a", "-F", str(FREQUENCY), "-o", str(data), "--",
         sys.executable, "-c", RUN, "bench", "kernel-loss", "--json", str(rows),
         "--systems", system, "--topology", a.topology, "--losses", "0",
         "--rounds", str(a.rounds), "--ranks", str(a.ranks), "--auth", a.auth, "--no-bare",
         "--mtu", str(a.mtu)],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    row = json.loads(rows.read_text())[0]
    ms, window, n = per_round(read_samples(data), a.rounds, row["mean_ms"])
    return {"system": system, "topology": row.get("topology", a.topology), "ranks": a.ranks,
            "mtu": a.mtu, "auth": a.auth, "rounds": a.rounds, "p50_ms": row["p50_ms"],
            "mean_ms": row["mean_ms"], "window_s_before_end": window, "window_samples": n,
            "cpu_ms_per_round": ms,
            "busy_ms_per_round": sum(v for c, v in ms.items() if c != "idle")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default="gloo,reliable", help="as bench kernel-loss's")
    ap.add_argument("--topology", default="allreduce", choices=["ps", "allreduce", "two-level"])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--auth", default="on", choices=["on", "off"])
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--mtu", type=int, default=1500, help="the testbed links' (as bench's)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    if shutil.which("perf") is None:
        sys.exit("perf is not installed (linux-tools)")
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(system, a, Path(tmp)) for system in a.systems.split(",")]
    print(f"CPU ms per round, {CORES} cores together, {a.ranks} ranks, lossless, "
          f"auth {a.auth} (a window of {a.rounds} rounds)")
    print(f"{'':14s}" + "".join(f"{r['system']:>12s}" for r in results))
    for c in CATEGORIES:
        print(f"{c:14s}" + "".join(f"{r['cpu_ms_per_round'][c]:12.1f}" for r in results))
    print(f"{'busy':14s}" + "".join(f"{r['busy_ms_per_round']:12.1f}" for r in results))
    print(f"{'round p50 ms':14s}" + "".join(f"{r['p50_ms']:12.1f}" for r in results))
    print(f"{'round mean ms':14s}" + "".join(f"{r['mean_ms']:12.1f}" for r in results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
