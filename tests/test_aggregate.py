"""Tests for boundedloss.aggregate: masks, the four hole fillers, Hadamard dispersion.

Statistical checks use fixed seeds (deterministic) and tolerances of a few standard
errors estimated from the samples themselves, not hand-picked margins; the expected
values are derived in the comments next to each check.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundedloss.aggregate import (
    AGGREGATORS,
    Aggregator,
    BubbleFill,
    Dispersed,
    HadamardDispersion,
    StaleFill,
    UnbiasedRescale,
    ZeroFill,
    apply_broadcast,
    burst_chunk_mask,
    chunk_count,
    chunk_mask_from_elements,
    element_mask,
    fill_holes,
    make_aggregator,
    message_seed,
    random_chunk_mask,
)
from boundedloss.aggregate import base as agg_base
from boundedloss.protocol.types import ReceiveResult, TransferStats
from boundedloss.wire import CloseReason
from conftest import PROPERTY

Z = 5.0  # standard errors allowed in statistical checks
ALL = [ZeroFill(), UnbiasedRescale(), BubbleFill(), StaleFill()]


# ----------------------------------------------------------------- helpers
def reference(xs, ms, kind: str, previous=None) -> np.ndarray:
    """The definitions, in float64, written the obvious (slow, where-based) way."""
    x = np.where(np.asarray(ms), np.asarray(xs, dtype=np.float64), 0.0)
    k = np.sum(ms, axis=0)
    s = x.sum(axis=0)
    n = len(xs)
    if kind == "zero":
        return s / n
    mean_arrived = np.divide(s, k, out=np.zeros_like(s), where=k > 0)
    if kind == "unbiased" or previous is None:
        return mean_arrived
    return np.where(k > 0, mean_arrived, previous)


def with_garbage(xs, ms, rng) -> list[np.ndarray]:
    """Copies of xs whose holes hold NaN, +-Inf and huge values."""
    junk = np.array([np.nan, np.inf, -np.inf, 3e38, -7e37], dtype=np.float64)
    out = []
    for x, m in zip(xs, ms):
        g = x.copy()
        with np.errstate(over="ignore"):
            g[~m] = rng.choice(junk, size=int((~m).sum())).astype(x.dtype)
        out.append(g)
    return out


def receive_result(delivered: np.ndarray, chunk_bytes: int, nbytes: int) -> ReceiveResult:
    stats = TransferStats(datagrams=0, payload_bytes=0, chunks=delivered.size,
                          delivered=int(delivered.sum()), retransmit_rounds=0,
                          retransmitted=0, probes=0, elapsed=0.0)
    return ReceiveResult(peer=None, round_id=0, message_id=0,
                         data=np.zeros(nbytes, dtype=np.uint8), delivered=delivered,
                         chunk_bytes=chunk_bytes, close_reason=CloseReason.COMPLETE,
                         bound=0.0, stats=stats)


def sylvester(m: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < m:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


# ------------------------------------------------------------------ masks
@settings(PROPERTY, max_examples=300)
@given(
    chunk_bytes=st.integers(1, 24),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(0, 80),
    extra=st.integers(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_element_mask_matches_per_byte_reference(chunk_bytes, itemsize, n, extra, seed):
    """An element is delivered iff every one of its bytes is, per the transport's own
    per-byte mask (ReceiveResult.delivered_bytes_mask)."""
    rng = np.random.default_rng(seed)
    n_chunks = chunk_count(n, chunk_bytes, itemsize) + extra
    delivered = rng.random(n_chunks) < rng.random()
    by_bytes = receive_result(delivered, chunk_bytes, n * itemsize).delivered_bytes_mask()
    expected = by_bytes.reshape(n, itemsize).all(axis=1)
    got = element_mask(delivered, chunk_bytes, n, itemsize)
    assert got.dtype == bool and got.shape == (n,)
    np.testing.assert_array_equal(got, expected)


def test_element_mask_half_float_at_chunk_edge_is_missing():
    # 6-byte chunks, float32: element 1 is bytes 4..7 = chunk 0 (0..5) + chunk 1 (6..11);
    # element 2 is bytes 8..11, all in chunk 1; element 4 is bytes 16..19 = chunks 2, 3.
    delivered = np.array([True, False, True, True, True])  # chunk 1 lost
    got = element_mask(delivered, 6, 7, 4)
    np.testing.assert_array_equal(got, [True, False, False, True, True, True, True])
    # chunk 2 lost instead: element 3 (12..15) and element 4 (16..19: chunks 2 and 3)
    got = element_mask(np.array([True, True, False, True, True]), 6, 7, 4)
    np.testing.assert_array_equal(got, [True, True, True, False, False, True, True])
    # elements wider than a chunk: float64 in 3-byte chunks; element 0 is bytes 0..7 =
    # chunks 0-2, element 1 is bytes 8..15 = chunks 2-5
    got = element_mask(np.array([True, True, True, False, True, True]), 3, 2, 8)
    np.testing.assert_array_equal(got, [True, False])
    got = element_mask(np.array([True, True, False, True, True, True]), 3, 2, 8)
    np.testing.assert_array_equal(got, [False, False])


def test_element_mask_rejects_a_short_chunk_mask():
    with pytest.raises(ValueError, match="need 3"):
        element_mask(np.ones(2, dtype=bool), 4, 3, 4)


@settings(PROPERTY, max_examples=200)
@given(
    chunk_bytes=st.integers(1, 24),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(0, 80),
    seed=st.integers(0, 2**32 - 1),
)
def test_chunk_mask_from_elements_loses_exactly_the_touched_chunks(chunk_bytes, itemsize, n, seed):
    rng = np.random.default_rng(seed)
    em = rng.random(n) < rng.random()
    cm = chunk_mask_from_elements(em, chunk_bytes, itemsize)
    n_chunks = chunk_count(n, chunk_bytes, itemsize)
    lost_bytes = np.zeros(n_chunks * chunk_bytes, dtype=bool)
    lost_bytes[: n * itemsize] = np.repeat(~em, itemsize)
    np.testing.assert_array_equal(cm, ~lost_bytes.reshape(n_chunks, chunk_bytes).any(axis=1))
    back = element_mask(cm, chunk_bytes, n, itemsize)
    assert not np.any(back & ~em)  # never claims a lost element arrived


def test_chunk_mask_round_trip_when_aligned():
    rng = np.random.default_rng(3)
    cm = rng.random(500) > 0.3
    em = element_mask(cm, 1400, 500 * 350, 4)
    np.testing.assert_array_equal(chunk_mask_from_elements(em, 1400, 4), cm)
    np.testing.assert_array_equal(element_mask(chunk_mask_from_elements(em, 1400, 4), 1400,
                                               em.size, 4), em)


def test_random_chunk_mask_loss_fraction():
    p, n = 0.2, 200_000
    m = random_chunk_mask(n, p, np.random.default_rng(0))
    se = np.sqrt(p * (1 - p) / n)
    assert abs((1 - m.mean()) - p) < Z * se
    with pytest.raises(ValueError):
        random_chunk_mask(10, 1.5, np.random.default_rng(0))


def lost_runs(mask: np.ndarray) -> np.ndarray:
    lost = np.concatenate(([0], (~mask).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(lost))
    return edges[1::2] - edges[0::2]


def test_burst_chunk_mask_rate_and_burst_length():
    p, burst, n = 0.1, 8.0, 400_000
    m = burst_chunk_mask(n, p, burst, np.random.default_rng(1))
    runs = lost_runs(m)
    # ~n p / burst = 5,000 bursts: fraction and mean run length within a few percent
    assert abs((1 - m.mean()) - p) < 0.1 * p
    assert abs(runs.mean() - burst) < Z * runs.std() / np.sqrt(runs.size)
    assert burst_chunk_mask(50, 0.0, 3, np.random.default_rng(0)).all()
    assert not burst_chunk_mask(50, 1.0, 3, np.random.default_rng(0)).any()
    with pytest.raises(ValueError, match="shorter than one chunk"):
        burst_chunk_mask(100, 0.9, 2.0, np.random.default_rng(0))
    with pytest.raises(ValueError):
        burst_chunk_mask(100, 0.1, 0.5, np.random.default_rng(0))


# ------------------------------------------------------------ aggregators
@settings(PROPERTY, max_examples=250)
@given(
    workers=st.integers(1, 6),
    n=st.integers(0, 60),
    block=st.sampled_from([1, 3, 7, 64]),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_aggregators_match_reference_and_ignore_garbage(workers, n, block, dtype, seed):
    """Every aggregator against the where-based definition, for every kernel block size
    (so block edges are crossed), with NaN/Inf/huge garbage in every hole."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(n).astype(dtype) for _ in range(workers)]
    p = rng.choice([0.0, 0.3, 0.8, 1.0])
    ms = [rng.random(n) >= p if rng.random() < 0.8 else np.ones(n, dtype=bool)
          for _ in range(workers)]
    prev = rng.standard_normal(n).astype(dtype)
    dirty = with_garbage(xs, ms, rng)
    saved = agg_base.CACHE_BLOCK
    agg_base.CACHE_BLOCK = block
    try:
        for agg in ALL:
            got = agg.aggregate(dirty, ms, previous=prev)
            assert got.dtype == np.dtype(dtype) and got.shape == (n,)
            assert np.isfinite(got).all()
            want = reference(xs, ms, agg.name, prev)
            tol = 1e-3 if dtype == "float16" else 1e-6 if dtype == "float32" else 1e-12
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    finally:
        agg_base.CACHE_BLOCK = saved


def sequential(xs, ms, per_arrived: bool, fallback=None) -> np.ndarray:
    """The kernel's definition, element for element: every contribution added in order
    (a hole as +0.0) in the accumulator's dtype, then divided by N - or, with
    ``per_arrived`` and any hole, by k (``fallback`` where k = 0, else 0)."""
    dtype = xs[0].dtype
    acc = np.float32 if dtype == np.float16 else dtype
    tot = np.where(ms[0], xs[0], 0).astype(acc)
    for x, m in zip(xs[1:], ms[1:]):
        tot = tot + np.where(m, x, 0).astype(acc)
    k = np.sum(ms, axis=0)
    if not per_arrived or all(m.all() for m in ms):
        return np.divide(tot, len(xs)).astype(dtype)
    est = np.divide(tot, np.maximum(k, 1).astype(acc))
    if fallback is not None:
        est = np.where(k == 0, fallback.astype(acc), est)
    return est.astype(dtype)


@settings(PROPERTY, max_examples=300)
@given(
    workers=st.integers(1, 6),
    n=st.integers(0, 700),
    block=st.sampled_from([1, 5, 64, 1 << 17]),
    chunk=st.integers(1, 40),
    p=st.sampled_from([0.0, 0.01, 0.05, 0.3, 1.0]),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_kernel_gives_the_sequential_sum_bit_for_bit(workers, n, block, chunk, p,
                                                           dtype, seed):
    """Holes of whole chunks (added around, a few runs a block) or scattered ones (zeroed
    bitwise), -0.0 values and garbage in the holes: whichever way a block goes, every
    element is the same float as the sequential definition's, bit for bit."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(n).astype(dtype) for _ in range(workers)]
    for x in xs:
        x[rng.random(n) < 0.2] = -0.0  # (-0.0 + a hole's +0.0 is +0.0)
    chunks = -(-n // chunk)
    ms = [np.ones(n, dtype=bool) if rng.random() < 0.3
          else np.repeat(rng.random(chunks) >= p, chunk)[:n] for _ in range(workers)]
    fallback = rng.standard_normal(n).astype(dtype)
    dirty = with_garbage(xs, ms, rng)
    saved = agg_base.CACHE_BLOCK
    agg_base.CACHE_BLOCK = block
    try:
        for per_arrived, fb in ((False, None), (True, None), (True, fallback)):
            got, lost = agg_base.masked_mean(agg_base.prepare(dirty, ms), per_arrived=per_arrived,
                                             fallback=fb)
            want = sequential(xs, ms, per_arrived, fb)
            bits = np.dtype(f"u{np.dtype(dtype).itemsize}")
            assert np.array_equal(got.view(bits), want.view(bits)), (per_arrived, fb is None)
            none = int(np.count_nonzero(np.sum(ms, axis=0) == 0)) if n else 0
            assert lost == (none if per_arrived and not all(m.all() for m in ms) else 0)
    finally:
        agg_base.CACHE_BLOCK = saved


DIVIDE_AROUND = agg_base._divide_around  # noqa: SLF001 - (counted, then called)


@pytest.mark.parametrize("seed", range(12))
def test_chunks_lost_as_a_network_loses_them_give_the_sequential_sum(seed, monkeypatch):
    """A job's geometry - 1,428-byte chunks of float32 (357 elements), the kernel's own
    blocks, 1-2% of the chunks lost - where holey blocks are added around and divided
    around their holes: bit for bit the sequential definition."""
    rng = np.random.default_rng(seed)
    divided_around = []
    monkeypatch.setattr(agg_base, "_divide_around",
                        lambda *a: divided_around.append(1) or DIVIDE_AROUND(*a))
    n, chunk, workers = 2 * agg_base.CACHE_BLOCK + 5_000, 357, 4
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(workers)]
    ms = [np.ones(n, dtype=bool)] + [
        np.repeat(rng.random(-(-n // chunk)) >= rng.choice([0.01, 0.02]), chunk)[:n]
        for _ in range(workers - 1)]
    fallback = rng.standard_normal(n).astype(np.float32)
    got, _ = agg_base.masked_mean(agg_base.prepare(with_garbage(xs, ms, rng), ms),
                                  per_arrived=True, fallback=fallback)
    want = sequential(xs, ms, True, fallback)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert divided_around


def test_a_hole_added_around_still_adds_its_plus_zero():
    """A run of holes added around (a few whole chunks lost) leaves the sum where -0.0 +
    +0.0 would have left it: +0.0 - as the bitwise path, which adds the zeroed hole,
    does. (An estimate of -0.0 and one of +0.0 are different floats.)"""
    n = 4096
    lost = np.ones(n, dtype=bool)
    lost[64:72] = False  # (one chunk of 8 elements)
    xs = [np.full(n, -0.0, dtype=np.float32),
          np.random.default_rng(3).standard_normal(n).astype(np.float32)]
    for per_arrived in (False, True):
        got, _ = agg_base.masked_mean(agg_base.prepare(xs, [np.ones(n, dtype=bool), lost]),
                                      per_arrived=per_arrived)
        assert not np.signbit(got[64:72]).any()
        assert np.array_equal(got.view(np.uint32),
                              sequential(xs, [np.ones(n, dtype=bool), lost],
                                         per_arrived).view(np.uint32))


def loss_patterns(workers: int, n: int, p: float, patterns: int, seed: int):
    """Element masks from chunk loss (4 float32 per 16-byte chunk), as the transport
    would deliver them: each element lost independently per worker with probability p."""
    rng = np.random.default_rng(seed)
    chunks = chunk_count(n, 16, 4)
    for _ in range(patterns):
        yield [element_mask(random_chunk_mask(chunks, p, rng), 16, n, 4) for _ in range(workers)]


def test_unbiased_rescale_is_unbiased_zero_fill_is_not():
    """2,000 random loss patterns, N = 4 workers, p = 0.3 per element.

    UnbiasedRescale: given k > 0 the arrived set is a uniform random k-subset (loss is
    independent and the same for every worker), so E[s / k | k > 0] = mean exactly;
    unconditionally E = (1 - p^N) mean (k = 0 gives 0). ZeroFill: E[s / N] = (1 - p) mean,
    a 30% shrink - it must fail the very check UnbiasedRescale passes.
    """
    workers, n, p, patterns = 4, 64, 0.3, 2000
    rng = np.random.default_rng(42)
    mu = rng.choice([-1.0, 1.0], n) * rng.uniform(1.0, 2.0, n)
    noise = rng.standard_normal((workers, n))
    noise -= noise.mean(axis=0)  # the workers' mean is mu: |mean| >= 1 on every coordinate
    xs = [(mu + e).astype(np.float32) for e in noise]
    truth = np.mean(np.asarray(xs, dtype=np.float64), axis=0)
    unb, zero, arrived = [], [], []
    for ms in loss_patterns(workers, n, p, patterns, seed=7):
        unb.append(UnbiasedRescale().aggregate(xs, ms))
        zero.append(ZeroFill().aggregate(xs, ms))
        arrived.append(np.sum(ms, axis=0) > 0)
    unb = np.asarray(unb, dtype=np.float64)
    zero = np.asarray(zero, dtype=np.float64)
    arrived = np.asarray(arrived)

    def mean_and_se(samples, use):
        cnt = use.sum(axis=0)
        mean = np.where(use, samples, 0).sum(axis=0) / cnt
        var = np.where(use, (samples - mean) ** 2, 0).sum(axis=0) / (cnt - 1)
        return mean, np.sqrt(var / cnt)

    everything = np.ones_like(arrived)
    m_u, se_u = mean_and_se(unb, arrived)
    assert np.all(np.abs(m_u - truth) < Z * se_u), "UnbiasedRescale biased given k > 0"
    m_u_all, se_u_all = mean_and_se(unb, everything)
    assert np.all(np.abs(m_u_all - (1 - p**workers) * truth) < Z * se_u_all)

    m_z, se_z = mean_and_se(zero, everything)
    assert np.all(np.abs(m_z - truth) > Z * se_z), "ZeroFill should fail the unbiasedness check"
    assert np.all(np.abs(m_z - (1 - p) * truth) < Z * se_z), "ZeroFill's bias is the (1-p) factor"


def test_bubble_fill_equals_unbiased_where_anything_arrived():
    rng = np.random.default_rng(5)
    n, workers = 5000, 5
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(workers)]
    ms = [rng.random(n) > 0.6 for _ in range(workers)]
    prev = rng.standard_normal(n).astype(np.float32)
    k = np.sum(ms, axis=0)
    assert (k == 0).any() and (k > 0).any()
    bubble = BubbleFill().aggregate(with_garbage(xs, ms, rng), ms, previous=prev)
    unbiased = UnbiasedRescale().aggregate(xs, ms, previous=prev)
    np.testing.assert_array_equal(bubble[k > 0], unbiased[k > 0])  # to the bit
    np.testing.assert_array_equal(bubble[k == 0], prev[k == 0])
    np.testing.assert_array_equal(unbiased[k == 0], 0)

    filled = BubbleFill().fill(with_garbage(xs, ms, rng), ms, previous=prev)
    assert len(filled) == workers
    for f, x, m in zip(filled, xs, ms):
        assert f.dtype == np.float32 and np.isfinite(f).all()
        np.testing.assert_array_equal(f[m], x[m])  # arrived values untouched
        np.testing.assert_array_equal(f[~m], bubble[~m])  # holes get the bubble value
    np.testing.assert_allclose(np.mean(filled, axis=0), bubble, rtol=1e-5, atol=1e-6)
    no_prev = BubbleFill().aggregate(xs, ms)
    np.testing.assert_array_equal(no_prev[k == 0], 0)


def test_fill_holes_keeps_what_arrived_and_the_previous_value_elsewhere_in_place():
    rng = np.random.default_rng(5)
    received = rng.standard_normal(1000).astype(np.float32)
    mask = np.repeat(rng.random(100) >= 0.2, 10)
    previous = rng.standard_normal(1000).astype(np.float32)
    want = np.where(mask, received, previous)
    copied = apply_broadcast(received, mask, previous)
    assert copied is not received and np.array_equal(copied, want)
    got = fill_holes(received, mask, previous)
    assert got is received and np.array_equal(got, want)
    fresh = rng.standard_normal(1000).astype(np.float32)
    assert np.array_equal(fill_holes(fresh.copy(), mask, None),
                          np.where(mask, fresh, 0.0))


def test_stale_fill_single_worker_is_the_broadcast_receiver():
    rng = np.random.default_rng(9)
    received = rng.standard_normal((40, 25)).astype(np.float32)
    mask = rng.random((40, 25)) > 0.1
    previous = rng.standard_normal((40, 25)).astype(np.float32)
    dirty = with_garbage([received], [mask], rng)[0]
    want = np.where(mask, received, previous)
    got = StaleFill().aggregate([dirty], [mask], previous=previous)
    assert got.shape == (40, 25) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(apply_broadcast(dirty, mask, previous), want)


def test_stale_fill_keeps_previous_where_all_lost_and_needs_it_there():
    xs = [np.array([1.0, 2.0, 3.0]), np.array([3.0, 4.0, 5.0])]
    ms = [np.array([True, False, False]), np.array([True, True, False])]
    prev = np.array([9.0, 9.0, 9.0])
    np.testing.assert_array_equal(StaleFill().aggregate(xs, ms, previous=prev), [2.0, 4.0, 9.0])
    with pytest.raises(ValueError, match="1 element"):
        StaleFill().aggregate(xs, ms)
    full = [np.ones(3, dtype=bool), ms[1]]  # k >= 1 everywhere: nothing to keep
    np.testing.assert_array_equal(StaleFill().aggregate(xs, full), [2.0, 3.0, 3.0])
    with pytest.raises(ValueError):
        apply_broadcast(xs[0], ms[0], None)


def test_input_validation_and_dtypes():
    x32 = np.ones(4, dtype=np.float32)
    m = np.ones(4, dtype=bool)
    for agg in ALL:
        with pytest.raises(ValueError):
            agg.aggregate([], [])
        with pytest.raises(ValueError):
            agg.aggregate([x32, x32], [m])
        with pytest.raises(TypeError):
            agg.aggregate([np.ones(4, dtype=np.int32)], [m])
        with pytest.raises(TypeError):
            agg.aggregate([x32, x32.astype(np.float64)], [m, m])
        with pytest.raises(ValueError):
            agg.aggregate([x32, np.ones(5, dtype=np.float32)], [m, np.ones(5, dtype=bool)])
        half = agg.aggregate([x32.astype(np.float16)] * 3, [m] * 3, previous=x32)
        assert half.dtype == np.float16
    for agg in (BubbleFill(), StaleFill()):  # the two that read previous check its shape
        with pytest.raises(ValueError, match="previous has shape"):
            agg.aggregate([x32], [m], previous=np.ones(3))


def test_float16_accumulates_without_overflow():
    big = np.full(8, 60000.0, dtype=np.float16)  # float16 max is 65504: a sum overflows
    m = np.ones(8, dtype=bool)
    out = UnbiasedRescale().aggregate([big] * 4, [m] * 4)
    np.testing.assert_array_equal(out, big)


def test_registry():
    for name, cls in AGGREGATORS.items():
        agg = make_aggregator(name)
        assert isinstance(agg, cls) and isinstance(agg, Aggregator) and agg.name == name
    with pytest.raises(ValueError, match="zero, unbiased, bubble, stale"):
        make_aggregator("median")


# --------------------------------------------------------- bounded drift
def test_stale_broadcast_drift_is_bounded_zero_fill_is_not():
    """10,000 broadcast rounds at p = 10% per coordinate.

    The sender's parameters random-walk: theta_t = theta_{t-1} + u_t, u_t ~ N(0, s^2).
    A replica gets each round's theta_t through a Bernoulli(1 - p) mask.

    StaleFill replica: its gap D_t = r_t - theta_t is 0 if the coordinate arrived, else
    D_{t-1} - u_t. So E[D^2] = p (E[D^2] + s^2): steady state **p s^2 / (1 - p)**, for
    any number of rounds. Two replicas with independent masks: E[D1 D2] = p^2 (E[D1 D2] +
    s^2), so E[(r1 - r2)^2] = 2 p s^2/(1-p) - 2 p^2 s^2/(1-p^2) = **2 p s^2 / (1 - p^2)**.

    Zero-fill replica (a lost coordinate reads 0): its gap is theta_t itself where lost,
    E = p t s^2 - it grows without bound (RMS like sqrt(t)).
    """
    p, s, dims, rounds = 0.1, 1.0, 200, 10_000
    rng = np.random.default_rng(2024)
    theta = np.zeros(dims)
    stale_a, stale_b = theta.copy(), theta.copy()
    gap_a = np.empty(rounds)
    gap_ab = np.empty(rounds)
    gap_zero = np.empty(rounds)
    stale = StaleFill()
    for t in range(rounds):
        theta = theta + s * rng.standard_normal(dims)
        mask_a = rng.random(dims) >= p
        mask_b = rng.random(dims) >= p
        stale_a = stale.aggregate([theta], [mask_a], previous=stale_a)
        stale_b = apply_broadcast(theta, mask_b, stale_b)
        zero = ZeroFill().aggregate([theta], [mask_a])
        gap_a[t] = np.mean((stale_a - theta) ** 2)
        gap_ab[t] = np.mean((stale_a - stale_b) ** 2)
        gap_zero[t] = np.mean((zero - theta) ** 2)

    def batch_mean(series, lo, hi, batch=100):
        b = series[lo:hi].reshape(-1, batch).mean(axis=1)
        return b.mean(), b.std(ddof=1) / np.sqrt(b.size), b

    warm = 100
    half = rounds // 2
    for series, theory in ((gap_a, p * s**2 / (1 - p)), (gap_ab, 2 * p * s**2 / (1 - p**2))):
        m1, se1, b1 = batch_mean(series, warm, half)
        m2, se2, b2 = batch_mean(series, half, rounds)
        assert abs(m1 - theory) < Z * se1 and abs(m2 - theory) < Z * se2, (m1, m2, theory)
        assert b2.max() < 1.5 * b1.max()  # not growing

    # zero fill: E[gap^2] = p t s^2 - a tenfold-plus worse gap that keeps growing
    t = np.arange(1, rounds + 1)
    quarter = rounds // 4
    assert gap_zero[-quarter:].mean() > 4 * gap_zero[:quarter].mean()  # theory: 7x
    assert 0.5 < np.mean(gap_zero[half:] / (p * t[half:] * s**2)) < 2.0
    assert gap_zero[-1000:].mean() > 1000 * gap_a[-1000:].mean()


def test_stationary_parameters_give_the_2p_over_1_plus_p_replica_gap():
    """The figure in SYSTEMS.md, E[(r1 - r2)^2] = 2p/(1+p) * sigma^2, is the replica gap
    for parameters that do *not* accumulate: theta_t i.i.d. each round with
    Var(theta_t - theta_s) = sigma^2. Each replica holds theta_{t-a} with geometric age
    a; the replicas differ iff their ages differ, P = 1 - (1-p)^2 / (1 - p^2) = 2p/(1+p)."""
    p, sigma, dims, rounds = 0.1, 1.0, 200, 5_000
    rng = np.random.default_rng(77)
    theta = rng.standard_normal(dims) * sigma / np.sqrt(2)
    r1, r2 = theta.copy(), theta.copy()
    gaps = np.empty(rounds)
    for t in range(rounds):
        theta = rng.standard_normal(dims) * sigma / np.sqrt(2)
        r1 = apply_broadcast(theta, rng.random(dims) >= p, r1)
        r2 = StaleFill().aggregate([theta], [rng.random(dims) >= p], previous=r2)
        gaps[t] = np.mean((r1 - r2) ** 2)
    batches = gaps[100:].reshape(-1, 98).mean(axis=1)
    se = batches.std(ddof=1) / np.sqrt(batches.size)
    assert abs(batches.mean() - 2 * p / (1 + p) * sigma**2) < Z * se


# -------------------------------------------------------------- Hadamard
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-6)])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 16, 17, 33, 1000, 2**16, 2**16 + 5, 3 * 2**16 + 7])
def test_hadamard_round_trip_and_norm(n, dtype, tol):
    h = HadamardDispersion()
    x = np.random.default_rng(n).standard_normal(n).astype(dtype)
    y = h.encode(x, seed=11)
    assert y.dtype == dtype and y.size == h.encoded_length(n)
    z = h.decode(y, seed=11, n=n)
    assert z.dtype == dtype and z.shape == (n,)
    scale = max(1.0, float(np.abs(x).max())) if n else 1.0
    np.testing.assert_allclose(z, x, rtol=0, atol=tol * scale)
    np.testing.assert_allclose(np.linalg.norm(y), np.linalg.norm(x), rtol=10 * tol)


@pytest.mark.parametrize("block", [1, 2, 4, 8, 1024])
def test_hadamard_multi_block_round_trip(block):
    h = HadamardDispersion(block=block)
    for n in (1, 7, 100, 3 * block + 1, 5 * block):
        x = np.random.default_rng(n).standard_normal(n)
        y = h.encode(x, 3)
        np.testing.assert_allclose(h.decode(y, 3, n), x, atol=1e-12)
        np.testing.assert_allclose(np.linalg.norm(y), np.linalg.norm(x), rtol=1e-12)


def test_hadamard_is_the_sylvester_transform_of_the_signed_vector():
    h = HadamardDispersion()
    for n in (1, 2, 4, 64, 256, 5, 100):
        x = np.random.default_rng(n).standard_normal(n)
        m = h.encoded_length(n)
        signed = np.zeros(m)
        signed[:n] = h.signs(21, n) * x
        np.testing.assert_allclose(h.encode(x, 21), sylvester(m) @ signed / np.sqrt(m), atol=1e-12)
    # blocks: block-diagonal; n = 12 with block 4 is three independent 4-blocks
    hb = HadamardDispersion(block=4)
    x = np.random.default_rng(0).standard_normal(12)
    want = np.kron(np.eye(3), sylvester(4)) @ (hb.signs(5, 12) * x) / 2.0
    np.testing.assert_allclose(hb.encode(x, 5), want, atol=1e-12)
    signs = h.signs(21, 10_000)
    assert set(np.unique(signs)) == {-1.0, 1.0} and abs(signs.mean()) < 0.05


def test_hadamard_layout_and_validation():
    h = HadamardDispersion()
    assert [h.encoded_length(n) for n in (0, 1, 3, 2**16, 2**16 + 5, 2**17 + 1)] == [
        0, 1, 4, 2**16, 2**16 + 8, 2**17 + 1]
    with pytest.raises(ValueError):
        HadamardDispersion(block=3)
    with pytest.raises(ValueError, match="has 8 elements"):
        h.decode(np.zeros(7), 0, 5)


def test_hadamard_seeds():
    h = HadamardDispersion()
    x = np.random.default_rng(0).standard_normal(3000)
    np.testing.assert_array_equal(h.encode(x, 1), h.encode(x, 1))
    assert not np.allclose(h.encode(x, 1), h.encode(x, 2))
    assert not np.allclose(h.decode(h.encode(x, 1), 2, x.size), x)  # wrong seed: garbage
    assert message_seed(1, 2, 3) == message_seed(1, 2, 3)
    seeds = {message_seed(s, r, m) for s in (0, 2**63 + 5) for r in range(20) for m in range(20)}
    assert len(seeds) == 800 and all(0 <= s < 2**64 for s in seeds)


def test_hadamard_large_vector():
    """2**20 float32 (16 blocks) round trip: whole-array numpy stages, no per-element loop."""
    h = HadamardDispersion()
    x = np.random.default_rng(1).standard_normal(2**20).astype(np.float32)
    y = h.encode(x, message_seed(7, 1, 0))
    np.testing.assert_allclose(h.decode(y, message_seed(7, 1, 0), x.size), x, atol=1e-5)


def test_hadamard_spreads_a_lost_chunk():
    """One lost 1,400-byte chunk (350 values) of a 2**16-element message.

    Without dispersion (zero fill) the error is the lost values themselves: max ~3
    sigma. With it, each coordinate's error is a +/- sum of 350 encoded values / 256,
    ~N(0, 350/65536 sigma^2): max over 65,536 coordinates ~4.5 * 0.073 sigma = 0.33 sigma.
    The L2 error is the same either way in distribution (orthonormal: ||error|| equals
    the norm of the lost encoded values exactly)."""
    n, chunk = 2**16, 350
    x = np.random.default_rng(8).standard_normal(n)
    lost = np.ones(n, dtype=bool)
    lost[1000 : 1000 + chunk] = False
    zero_fill_max = np.abs(x[~lost]).max()

    seed = message_seed(1, 1, 1)
    h = HadamardDispersion()
    y = h.encode(x, seed)
    z = Dispersed(ZeroFill(), seed, n).aggregate([y], [lost])
    err = z - x
    assert np.abs(err).max() < 0.2 * zero_fill_max
    np.testing.assert_allclose(np.linalg.norm(err), np.linalg.norm(y[~lost]), rtol=1e-9)


def test_dispersed_aggregators():
    rng = np.random.default_rng(12)
    n, workers, seed = 5000, 4, message_seed(3, 4, 5)
    h = HadamardDispersion()
    m = h.encoded_length(n)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(workers)]
    enc = [h.encode(x, seed) for x in xs]
    truth = np.mean(xs, axis=0)

    full = [np.ones(m, dtype=bool)] * workers
    for inner in ALL:
        d = Dispersed(inner, seed, n)
        assert d.name == f"{inner.name}+hadamard"
        got = d.aggregate(enc, full, previous=truth)
        assert got.shape == (n,) and got.dtype == np.float32
        np.testing.assert_allclose(got, truth, atol=1e-5)

    masks = [element_mask(random_chunk_mask(chunk_count(m, 1400, 4), 0.1, rng), 1400, m, 4)
             for _ in range(workers)]
    dirty = with_garbage(enc, masks, rng)
    got = Dispersed(UnbiasedRescale(), seed, n).aggregate(dirty, masks)
    np.testing.assert_allclose(got, h.decode(UnbiasedRescale().aggregate(enc, masks), seed, n),
                               atol=1e-6)

    # everything lost: stale fill in the encoded domain hands back previous
    previous = rng.standard_normal(n).astype(np.float32)
    none = [np.zeros(m, dtype=bool)] * workers
    got = Dispersed(StaleFill(), seed, n).aggregate(dirty, none, previous=previous)
    np.testing.assert_allclose(got, previous, atol=1e-5)
