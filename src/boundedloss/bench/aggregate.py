"""`boundedloss bench aggregate`: what each aggregator makes of a real, lossy gradient.

N workers each compute a real minibatch gradient of an MLP on scikit-learn's digits
(after a short warm-up training so the gradient is a mid-training one). Each worker's
message loses whole chunks (Bernoulli per chunk, the way the transport loses datagrams);
every aggregator estimates the workers' mean from what arrived, with and without
Hadamard dispersion, and is compared against the lossless mean:

- ``rel_l2_error``  = ||estimate - mean|| / ||mean||, averaged over seeded loss patterns;
- ``max_abs_error`` = max |estimate - mean| / max |mean| (Hadamard's point: it leaves
  the L2 error of a lost chunk unchanged but spreads it thinly over all coordinates);
- ``throughput_gbs`` = bytes of all contributions / aggregation time (median of runs);
  with Hadamard, the encode of every contribution and the decode are included.

Then Hadamard dispersion's own speed on one gradient bucket (``run_hadamard_speed``):
the blockwise transform alone, and a whole encode and decode (random signs included),
bucket bytes over time, in the compiled module and in numpy, interleaved.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import native
from ..aggregate import AGGREGATORS, HadamardDispersion, element_mask, random_chunk_mask
from ..wire import DEFAULT_CHUNK_BYTES

if TYPE_CHECKING:
    from ..workloads.images import ImageData, ImageMLP

#: what a run measures unless told otherwise (``boundedloss bench aggregate``'s defaults)
DEFAULT_LOSSES = (0.0, 0.01, 0.10, 0.30)
DEFAULT_WORKERS = 4
DEFAULT_PATTERNS = 5


DEFAULT_BUCKET_MB = 4  # DDP's first bucket is about this size


@dataclass(frozen=True)
class HadamardRow:
    operation: str  # "transform" (blockwise, in place), "encode" or "decode"
    native: bool  # the compiled module (False: numpy)
    bucket_bytes: int
    gbs: float  # bucket bytes / time, median of the repeats
    repeats: int


def run_hadamard_speed(bucket_mb: int = DEFAULT_BUCKET_MB, repeats: int = 9,
                       seed: int = 0) -> list[HadamardRow]:
    """Throughput of Hadamard dispersion on a float32 bucket of ``bucket_mb`` MB."""
    import os

    hadamard = HadamardDispersion()
    n = bucket_mb * (1 << 20) // 4
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    y = hadamard.encode(x, seed)
    work = x.copy()
    paths = (True, False) if native.enabled() else (False,)
    ops: dict[str, Callable[[], object]] = {
        "transform": lambda: hadamard.transform(work, n),
        "encode": lambda: hadamard.encode(x, seed),
        "decode": lambda: hadamard.decode(y, seed, n),
    }
    times: dict[tuple[str, bool], list[float]] = {}
    before = os.environ.get("BOUNDEDLOSS_NATIVE")
    try:
        for _ in range(repeats):
            for use_native in paths:  # interleaved, each repeat
                os.environ["BOUNDEDLOSS_NATIVE"] = "1" if use_native else "0"
                for name, op in ops.items():
                    t0 = time.perf_counter()
                    op()
                    times.setdefault((name, use_native), []).append(time.perf_counter() - t0)
    finally:
        if before is None:
            os.environ.pop("BOUNDEDLOSS_NATIVE", None)
        else:
            os.environ["BOUNDEDLOSS_NATIVE"] = before
    return [HadamardRow(name, use_native, x.nbytes,
                        round(x.nbytes / statistics.median(t) / 1e9, 3), repeats)
            for (name, use_native), t in times.items()]


@dataclass(frozen=True)
class AggregateRow:
    aggregator: str
    hadamard: bool
    loss: float
    rel_l2_error: float
    max_abs_error: float
    throughput_gbs: float
    workers: int
    elements: int
    chunk_bytes: int
    patterns: int


def _warm_model(seed: int, hidden: int, steps: int = 30) -> tuple[ImageMLP, ImageData]:
    # (torch here, not at the top: the command line imports this module for its defaults)
    import torch

    from ..workloads.digits import load_digits_split
    from ..workloads.images import ImageMLP

    torch.manual_seed(seed)
    data = load_digits_split(seed)
    model = ImageMLP(hidden=hidden, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(data.y_train), (64,), generator=g)
        opt.zero_grad()
        loss_fn(model(data.x_train[idx]), data.y_train[idx]).backward()
        opt.step()
    return model, data


def _timed(fn: Callable[[], np.ndarray], runs: int) -> tuple[np.ndarray, float]:
    """``fn()``'s result and its median time over ``runs`` calls (at least one)."""
    times = []
    for _ in range(max(1, runs)):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def run_aggregate_bench(
    *,
    losses: tuple[float, ...] = DEFAULT_LOSSES,
    workers: int = DEFAULT_WORKERS,
    hidden: int = 1024,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    patterns: int = DEFAULT_PATTERNS,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[AggregateRow]:
    """One row per loss rate, Hadamard or not, and aggregator (every one registered)."""
    from ..workloads.digits import worker_gradients

    model, data = _warm_model(seed, hidden)
    previous = np.mean(worker_gradients(model, data, workers, 64, seed + 1), axis=0)
    grads = worker_gradients(model, data, workers, 64, seed + 2)
    truth = np.mean(grads, axis=0)
    n = truth.size
    itemsize = truth.itemsize
    hadamard = HadamardDispersion()
    msg_seed = seed + 12345
    encoded_length = hadamard.encode(grads[0], msg_seed).size
    enc_prev = hadamard.encode(previous, msg_seed)
    aggregators = [cls() for cls in AGGREGATORS.values()]
    truth_norm = float(np.linalg.norm(truth))
    truth_max = float(np.abs(truth).max())
    nbytes_in = workers * n * itemsize

    rows: list[AggregateRow] = []
    for loss in losses:
        for use_h in (False, True):
            length = encoded_length if use_h else n
            n_chunks = -(-length * itemsize // chunk_bytes)
            errs: dict[str, list[float]] = {a.name: [] for a in aggregators}
            maxes: dict[str, list[float]] = {a.name: [] for a in aggregators}
            speeds: dict[str, list[float]] = {a.name: [] for a in aggregators}
            for k in range(patterns):
                rng = np.random.default_rng([seed, int(loss * 1e6), k])
                masks = [
                    element_mask(random_chunk_mask(n_chunks, loss, rng), chunk_bytes, length,
                                 itemsize)
                    for _ in range(workers)
                ]
                for agg in aggregators:
                    if use_h:
                        def run(agg=agg, masks=masks):
                            coded = [hadamard.encode(g, msg_seed) for g in grads]
                            est = agg.aggregate(coded, masks, previous=enc_prev)
                            return hadamard.decode(est, msg_seed, n)
                    else:
                        def run(agg=agg, masks=masks):
                            return agg.aggregate(grads, masks, previous=previous)
                    est, secs = _timed(run, runs=3 if k == 0 else 1)
                    diff = est - truth
                    errs[agg.name].append(float(np.linalg.norm(diff)) / truth_norm)
                    maxes[agg.name].append(float(np.abs(diff).max()) / truth_max)
                    speeds[agg.name].append(nbytes_in / secs / 1e9)
            for agg in aggregators:
                rows.append(
                    AggregateRow(
                        aggregator=agg.name,
                        hadamard=use_h,
                        loss=loss,
                        rel_l2_error=round(statistics.mean(errs[agg.name]), 6),
                        max_abs_error=round(statistics.mean(maxes[agg.name]), 6),
                        throughput_gbs=round(statistics.median(speeds[agg.name]), 3),
                        workers=workers,
                        elements=n,
                        chunk_bytes=chunk_bytes,
                        patterns=patterns,
                    )
                )
            if progress:
                progress(f"loss {loss:.0%}, hadamard={use_h}: done")
    return rows
