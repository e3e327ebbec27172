"""Rounds of this checkout against another's, interleaved, on the kernel testbed.

Runs ``boundedloss bench kernel-loss`` (gloo and the systems given, one topology,
lossless unless told) from this checkout and from ``--baseline SRC`` (another
checkout's ``src`` folder, its extension built: ``git worktree add /tmp/old REV`` then
``python setup.py build_ext --inplace`` there) in turn, new first, ``--pairs`` times;
prints each run's p50 and p99 per system and writes them (``--json``). Gloo runs in
both, so each checkout's ratio to it is measured side by side.

    git worktree add /tmp/old 0e42d47 && (cd /tmp/old && python setup.py build_ext --inplace)
    python tools/kernel_loss_ab.py --baseline /tmp/old/src --pairs 3 --rounds 200

(root, or a user namespace of its own, as ``boundedloss testbed``.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = "import sys; from boundedloss.cli import main; sys.exit(main())"


def run(src: Path | None, a: argparse.Namespace, out: Path) -> list[dict]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    subprocess.run([sys.executable, "-c", RUN, "bench", "kernel-loss", "--json", str(out),
                    "--systems", a.systems, "--topology", a.topology, "--losses", a.losses,
                    "--rounds", str(a.rounds), "--ranks", str(a.ranks), "--no-bare",
                    *(["--mtu", str(a.mtu)] if a.mtu is not None else [])],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="another checkout's src")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--systems", default="gloo,reliable")
    ap.add_argument("--topology", default="allreduce", choices=["ps", "allreduce", "two-level"])
    ap.add_argument("--losses", default="0")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mtu", type=int, default=None,
                    help="the testbed links' (bench kernel-loss --mtu; its default if not given)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not (a.baseline / "boundedloss").is_dir():
        sys.exit(f"--baseline {a.baseline}: no boundedloss package there")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(a.pairs):
            for tree, src in (("new", None), ("old", a.baseline)):
                for r in run(src, a, Path(tmp, f"{tree}{pair}.json")):
                    row = {"tree": tree, "pair": pair, "system": r["system"],
                           "loss": r["loss"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"]}
                    rows.append(row)
                    print(f"pair {pair} {tree:3s} {r['system']:9s} loss {r['loss']:.0%}  "
                          f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
