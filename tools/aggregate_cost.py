"""What the aggregation kernel costs a round, by chunk size and loss, beside another tree's.

A parameter server's round aggregates every worker's whole gradient; a transpose
allreduce's rank, its shard of every rank's. Here: ``--workers`` contributions of
``--elements`` float32 (the first whole - a collective's own - the others with each chunk
of ``--chunk-bytes`` lost at the given rate, as the transport loses them), through
``masked_mean`` as the unbiased aggregator calls it. With ``--baseline SRC`` (another
tree's ``src``) its kernel runs too, interleaved call by call, and every result is
checked equal to the bit. Then a lossy broadcast's receiver at each loss: one message
of ``--elements`` float32 whose holes take the previous round's values, filled in the
receive's own buffer (``fill_holes``, as the collective does) against a new array
(``np.where``, as it did before). Prints the median milliseconds a call; ``--json``
writes them.

    python tools/aggregate_cost.py
    python tools/aggregate_cost.py --baseline /tmp/old/src --json benchmarks/aggregate-cost.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from boundedloss.aggregate import base as current
from boundedloss.aggregate import fill_holes
from boundedloss.aggregate.masks import element_mask


def kernel_of(src: Path) -> ModuleType:
    """That tree's ``aggregate/base.py`` (it imports nothing of the package)."""
    spec = importlib.util.spec_from_file_location(
        "baseline_kernel", src / "boundedloss" / "aggregate" / "base.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 20)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--chunk-bytes", default="1428,8948",
                    type=lambda v: [int(x) for x in v.split(",")])
    ap.add_argument("--losses", default="0,0.01,0.05",
                    type=lambda v: [float(x) for x in v.split(",")])
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--baseline", type=Path, metavar="SRC")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    kernels = {"current": current}
    if a.baseline is not None:
        kernels["baseline"] = kernel_of(a.baseline)
    rng = np.random.default_rng(a.seed)
    n = a.elements
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(a.workers)]
    rows = []
    for chunk_bytes in a.chunk_bytes:
        chunks = -(-n * 4 // chunk_bytes)
        for loss in a.losses:
            masks = [np.ones(n, dtype=bool)] + [
                element_mask(rng.random(chunks) >= loss, chunk_bytes, n, 4)
                for _ in range(a.workers - 1)]
            took: dict[str, list[float]] = {name: [] for name in kernels}
            results = {}
            for _ in range(a.calls):
                for name, kernel in kernels.items():
                    p = kernel.prepare(xs, masks)
                    t = time.perf_counter()
                    est, _ = kernel.masked_mean(p, per_arrived=True)
                    took[name].append(time.perf_counter() - t)
                    results[name] = est
            if "baseline" in results and not np.array_equal(
                    results["current"].view(np.uint32), results["baseline"].view(np.uint32)):
                raise SystemExit(f"chunk {chunk_bytes}, loss {loss}: the kernels differ")
            row = {"elements": n, "workers": a.workers, "chunk_bytes": chunk_bytes,
                   "loss": loss, **{f"{name}_ms": 1e3 * statistics.median(v)
                                    for name, v in took.items()}}
            rows.append(row)
            print(f"chunk {chunk_bytes:>5} B, loss {loss:.2f}: " + ", ".join(
                f"{name} {row[f'{name}_ms']:.2f} ms" for name in kernels))
    broadcast = []
    previous = rng.standard_normal(n).astype(np.float32)
    for chunk_bytes in a.chunk_bytes:
        chunks = -(-n * 4 // chunk_bytes)
        for loss in [x for x in a.losses if x > 0]:
            mask = element_mask(rng.random(chunks) >= loss, chunk_bytes, n, 4)
            took = {"in_place": [], "new_array": []}
            for _ in range(a.calls):
                buffer = xs[0].copy()  # (a receive's buffer, written by the network)
                t = time.perf_counter()
                filled = fill_holes(buffer, mask, previous)
                took["in_place"].append(time.perf_counter() - t)
                t = time.perf_counter()
                made = np.where(mask, xs[0], previous)
                took["new_array"].append(time.perf_counter() - t)
                if not np.array_equal(filled, made):
                    raise SystemExit(f"chunk {chunk_bytes}, loss {loss}: the fills differ")
            row = {"elements": n, "chunk_bytes": chunk_bytes, "loss": loss,
                   **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in took.items()}}
            broadcast.append(row)
            print(f"broadcast, chunk {chunk_bytes:>5} B, loss {loss:.2f}: in place "
                  f"{row['in_place_ms']:.2f} ms, a new array {row['new_array_ms']:.2f} ms")
    if a.json:
        a.json.write_text(json.dumps({"baseline": str(a.baseline) if a.baseline else None,
                                      "rows": rows, "broadcast": broadcast},
                                     indent=2) + "\n")


if __name__ == "__main__":
    main()
