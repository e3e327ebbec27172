"""The simulator's rows from this checkout against another's: the same to the bit?

A change meant to make the simulator faster (or to reorganise the code it runs) must
leave every virtual figure as it was. This runs a fixed set of ``boundedloss sim``
commands - every system and topology, loss, a CPU model, the testbed's settings,
credit, bursts at a rank, background traffic, racks with a shared buffer, congestion
control, a bottleneck, the Python data path - from this checkout and from ``--baseline
SRC`` (another checkout's ``src`` folder, its extension built), compares their JSON
rows field by field but ``wall_s``, and prints each command's wall time in both. Exit
status 1 if any row differs.

    git worktree add /tmp/old HEAD~1 && (cd /tmp/old && python setup.py build_ext --inplace)
    python tools/sim_identical.py --baseline /tmp/old/src

(A field that only one side's rows have - a new one - is left out of the comparison
and named.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = "import sys; from boundedloss.cli import main; sys.exit(main())"

#: name -> (the sim arguments, environment changes)
CASES: dict[str, tuple[list[str], dict[str, str]]] = {
    "sweep": ("--workers 4,16 --systems gloo,tcp-ps,reliable,dblp --topology "
              "ps,allreduce,two-level --losses 0,0.01 --rounds 2 --elements 100000", {}),
    "cpu": ("--workers 16 --systems gloo,reliable,ltp --topology ps,two-level --losses 0.01 "
            "--rounds 2 --elements 200000 --cpu cluster-node", {}),
    "testbed": ("--workers 4 --systems gloo,reliable,dblp --topology ps,allreduce "
                "--losses 0,0.05 --rounds 3 --like-testbed", {}),
    "credit": ("--workers 16 --systems reliable,mlt --topology ps,allreduce --losses 0 "
               "--rounds 2 --elements 32768 --queue-datagrams 32 --credit 96k", {}),
    "bursts": ("--workers 8 --systems reliable,dblp,tcp-ps --topology ps --losses 0.01 "
               "--loss-model bernoulli:0.01+burst:rate=0.8,every_s=0.01,len_s=0.002,rank=0 "
               "--rounds 4 --elements 100000", {}),
    "background": ("--workers 8 --systems gloo,dblp --topology allreduce --losses 0 "
                   "--rounds 2 --elements 100000 --queue-datagrams 256 "
                   "--background 0.3:onoff", {}),
    "racks": ("--workers 16 --systems reliable,gloo --topology allreduce,two-level "
              "--losses 0.01 --rounds 2 --elements 100000 --racks 2 --oversubscription 2 "
              "--shared-buffer 1m --queue-datagrams 100000", {}),
    "congestion": ("--workers 8 --systems reliable --topology ps --losses 0.01 --rounds 2 "
                   "--elements 100000 --congestion delay --queue-bytes 288k "
                   "--queue-datagrams 100000", {}),
    "bottleneck": ("--workers 8 --systems tcp-ps,reliable --topology ps --losses 0 "
                   "--rounds 3 --elements 85002 --like-testbed --bottleneck 100mbit "
                   "--credit 48k", {}),
    "python-path": ("--workers 4 --systems reliable,dblp --topology ps,allreduce "
                    "--losses 0.01 --rounds 2 --elements 100000", {"BOUNDEDLOSS_NATIVE": "0"}),
}


def run(src: Path | None, args: str, env_changes: dict[str, str], out: Path) -> float:
    """Run one case from ``src`` (None: this checkout); its wall time."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(env_changes)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", RUN, "sim", *args.split(), "--json", str(out)],
                       env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"sim {args} failed ({'baseline' if src else 'this checkout'}):\n"
                 + p.stderr.strip())
    return time.perf_counter() - t0


def differences(new: list[dict], old: list[dict]) -> tuple[list[str], set[str]]:
    """Where the rows differ (but wall_s and fields only one side has), and those fields."""
    if len(new) != len(old):
        return [f"{len(new)} rows against {len(old)}"], set()
    found, one_sided = [], set()
    for a, b in zip(new, old):
        one_sided |= set(a) ^ set(b)
        for key in (set(a) & set(b)) - {"wall_s"}:
            if a[key] != b[key]:
                found.append(f"{a['workers']} {a['system']} {a['topology']} "
                             f"{a['loss']}: {key} {a[key]!r} against {b[key]!r}")
    return found, one_sided


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="another checkout's src")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of: {', '.join(CASES)}")
    a = ap.parse_args()
    if not (a.baseline / "boundedloss").is_dir():
        sys.exit(f"--baseline {a.baseline}: no boundedloss package there")
    cases = a.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"--cases: no case {unknown[0]!r} (choose from {', '.join(CASES)})")
    failed = False
    walls = {"new": 0.0, "old": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        for name in cases:
            args, env = CASES[name]
            new_s = run(None, args, env, Path(tmp, f"{name}-new.json"))
            old_s = run(a.baseline, args, env, Path(tmp, f"{name}-old.json"))
            walls["new"] += new_s
            walls["old"] += old_s
            found, one_sided = differences(
                json.loads(Path(tmp, f"{name}-new.json").read_text()),
                json.loads(Path(tmp, f"{name}-old.json").read_text()))
            verdict = "same rows" if not found else f"{len(found)} differences"
            print(f"{name:12} {verdict:16} wall {new_s:6.1f} s (baseline {old_s:6.1f} s)"
                  + (f"; fields on one side only: {', '.join(sorted(one_sided))}"
                     if one_sided else ""))
            for line in found[:10]:
                print("   ", line)
            failed = failed or bool(found)
    print(f"all: wall {walls['new']:.1f} s against the baseline's {walls['old']:.1f} s")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
