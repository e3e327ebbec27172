"""Tests for boundedloss.net.loss.

Statistical checks use fixed seeds (so they are deterministic) and tolerances of a few
standard errors derived from the model, not hand-picked margins: a failure means the
model is off, not that the dice were unlucky.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundedloss.net.loss import (
    BLOCK,
    Bernoulli,
    Combined,
    GilbertElliott,
    LossModel,
    Microburst,
    NoLoss,
    derive_seed,
    parse_loss_spec,
)

N = 200_000
Z = 4.0  # standard errors allowed


def draws(model: LossModel, n: int, *, now: float = 0.0, round_id: int = -1) -> list[bool]:
    return [model.drop(now, round_id) for _ in range(n)]


def runs(seq: list[bool]) -> list[int]:
    """Lengths of maximal runs of consecutive drops."""
    out: list[int] = []
    cur = 0
    for d in seq:
        if d:
            cur += 1
        elif cur:
            out.append(cur)
            cur = 0
    if cur:
        out.append(cur)
    return out


# ---------------------------------------------------------------------- Bernoulli


@pytest.mark.parametrize("p", [0.001, 0.05, 0.5])
def test_bernoulli_rate_within_standard_errors(p: float) -> None:
    got = sum(draws(Bernoulli(p, seed=11), N)) / N
    se = math.sqrt(p * (1 - p) / N)
    assert abs(got - p) <= Z * se


@pytest.mark.parametrize("p, expected", [(0.0, False), (1.0, True)])
def test_bernoulli_extremes_are_exact(p: float, expected: bool) -> None:
    assert set(draws(Bernoulli(p), 3 * BLOCK)) == {expected}


@pytest.mark.parametrize("p", [-0.1, 1.5, math.nan])
def test_bernoulli_rejects_bad_p(p: float) -> None:
    with pytest.raises(ValueError, match="probability in \\[0, 1\\]"):
        Bernoulli(p)


def test_bernoulli_deterministic_by_seed_and_reset() -> None:
    n = 2 * BLOCK + 17  # crosses block refills
    a = draws(Bernoulli(0.3, seed=5), n)
    assert draws(Bernoulli(0.3, seed=5), n) == a
    assert draws(Bernoulli(0.3, seed=6), n) != a
    m = Bernoulli(0.3, seed=5)
    draws(m, 1234)
    m.reset()
    assert draws(m, n) == a
    m.reset(6)
    assert draws(m, n) == draws(Bernoulli(0.3, seed=6), n)
    m.reset()  # keeps the latest seed
    assert draws(m, n) == draws(Bernoulli(0.3, seed=6), n)


# ----------------------------------------------------------------- Gilbert-Elliott


def ge_mean_se(m: GilbertElliott, n: int) -> float:
    """Standard error of the empirical loss rate over n datagrams.

    Drop_t = f(S_t) + noise_t with f(S) the state's loss probability. The chain part
    has lag-k autocorrelation lambda^k (lambda = 1 - p_gb - p_bg), which inflates its
    variance by (1 + lambda) / (1 - lambda); the noise is independent given the states.
    """
    pi = m.stationary_bad
    lam = 1.0 - m.p_gb - m.p_bg
    chain = (m.loss_bad - m.loss_good) ** 2 * pi * (1 - pi) * (1 + lam) / (1 - lam)
    noise = (1 - pi) * m.loss_good * (1 - m.loss_good) + pi * m.loss_bad * (1 - m.loss_bad)
    return math.sqrt((chain + noise) / n)


@pytest.mark.parametrize(
    "model",
    [
        GilbertElliott.from_rate(0.05, 8, seed=3),
        GilbertElliott.from_rate(0.2, 3, seed=4),
        GilbertElliott(0.02, 0.2, loss_good=0.01, loss_bad=0.6, seed=5),
    ],
    ids=["rate5%-burst8", "rate20%-burst3", "partial-loss"],
)
def test_ge_stationary_loss_matches_theory(model: GilbertElliott) -> None:
    got = sum(draws(model, N)) / N
    assert abs(got - model.stationary_loss) <= Z * ge_mean_se(model, N)


def test_ge_from_rate_parameters() -> None:
    m = GilbertElliott.from_rate(0.02, 8)
    assert m.p_bg == pytest.approx(1 / 8)
    assert m.stationary_loss == pytest.approx(0.02)
    assert m.mean_burst_len == pytest.approx(8)
    assert (m.loss_good, m.loss_bad) == (0.0, 1.0)


@pytest.mark.parametrize("burst", [2.0, 8.0, 25.0])
def test_ge_mean_burst_length_matches_theory(burst: float) -> None:
    m = GilbertElliott.from_rate(0.1, burst, seed=7)
    seq = draws(m, N)
    lengths = runs(seq)
    if seq[-1]:
        lengths.pop()  # truncated by the end of the sample
    # With loss 0/1 a run of drops is one stay in the bad state: geometric(p_bg).
    p = m.p_bg
    se = math.sqrt(1 - p) / p / math.sqrt(len(lengths))
    assert abs(sum(lengths) / len(lengths) - burst) <= Z * se


def test_ge_is_burstier_than_bernoulli_of_same_rate() -> None:
    n = 100_000
    ge = runs(draws(GilbertElliott.from_rate(0.05, 8, seed=1), n))
    bern = runs(draws(Bernoulli(0.05, seed=1), n))
    ge_long = sum(r > 3 for r in ge)
    bern_long = sum(r > 3 for r in bern)
    # Expected: Bernoulli ~ n*p*(1-p)*p^3 ~ 0.6 long runs, GE ~ n*pi*p_bg*(7/8)^3 ~ 420.
    assert ge_long > 100
    assert bern_long < 10


def test_ge_deterministic_and_reset() -> None:
    n = 3 * BLOCK
    a = draws(GilbertElliott(0.1, 0.3, 0.05, 0.7, seed=2), n)
    m = GilbertElliott(0.1, 0.3, 0.05, 0.7, seed=2)
    assert draws(m, n) == a
    m.reset()
    assert draws(m, n) == a


@pytest.mark.parametrize(
    "rate, burst", [(1.0, 8), (-0.1, 8), (0.1, 0.5), (0.6, 1), (0.1, math.inf)]
)
def test_ge_from_rate_rejects(rate: float, burst: float) -> None:
    with pytest.raises(ValueError, match="ge"):
        GilbertElliott.from_rate(rate, burst)


def test_ge_frozen_chain_stays_good() -> None:
    m = GilbertElliott(0.0, 0.0, loss_good=0.0, loss_bad=1.0)
    assert m.stationary_loss == 0.0
    assert not any(draws(m, 1000))


# --------------------------------------------------------------------- Microburst


def test_microburst_rate_inside_rounds_and_base_outside() -> None:
    m = Microburst(0.8, rounds=[5, 9], every=20, length=2, offset=3,
                   base=Bernoulli(0.1, seed=9), seed=8)
    n = 40_000
    for r, expected in [(5, 0.8), (9, 0.8), (3, 0.8), (4, 0.8), (23, 0.8), (24, 0.8),
                        (6, 0.1), (25, 0.1), (2, 0.1), (-1, 0.1)]:
        got = sum(draws(m, n, round_id=r)) / n
        assert abs(got - expected) <= Z * math.sqrt(expected * (1 - expected) / n), r


def test_microburst_windows_boundaries() -> None:
    m = Microburst(1.0, windows=[(1.0, 1.5), (3.0, 3.25)])
    inside = [1.0, 1.2, 1.4999, 3.0, 3.2]
    outside = [0.0, 0.999, 1.5, 2.0, 3.25, 10.0]
    assert all(m.drop(t, -1) for t in inside)
    assert not any(m.drop(t, -1) for t in outside)


def test_microburst_window_rate() -> None:
    m = Microburst(0.7, windows=[(1.0, 1.5)], seed=4)
    n = 40_000
    got = sum(draws(m, n, now=1.25)) / n
    assert abs(got - 0.7) <= Z * math.sqrt(0.7 * 0.3 / n)
    assert not any(draws(m, 1000, now=2.0))


def test_microburst_base_stream_advances_every_datagram() -> None:
    # Outside bursts the answers are exactly the base's own stream at the same index,
    # i.e. the base is stepped for burst datagrams too.
    m = Microburst(1.0, every=3, base=Bernoulli(0.3, seed=5))
    ref = Bernoulli(0.3, seed=5)
    for r in range(5000):
        want = ref.drop(0.0, r)
        got = m.drop(0.0, r)
        assert got == (True if r % 3 == 0 else want)


@given(
    every=st.integers(1, 40),
    data=st.data(),
    offset=st.integers(0, 60),
    rounds=st.lists(st.integers(-1, 300), max_size=30),
)
@settings(max_examples=200, deadline=None)
def test_periodic_schedule_matches_direct_definition(
    every: int, data: st.DataObject, offset: int, rounds: list[int]
) -> None:
    length = data.draw(st.integers(1, every))
    m = Microburst(1.0, every=every, length=length, offset=offset)
    # Direct definition: bursts are the rounds offset + k*every + j, k >= 0, j < length.
    burst = {offset + k * every + j for k in range(300 // every + 2) for j in range(length)}
    for r in rounds:
        assert m.in_burst(0.0, r) == (r in burst)
        assert m.drop(0.0, r) == (r in burst)  # rate 1, no base


@given(explicit=st.sets(st.integers(0, 100), min_size=1), r=st.integers(-1, 120))
@settings(max_examples=100, deadline=None)
def test_explicit_rounds(explicit: set[int], r: int) -> None:
    assert Microburst(1.0, rounds=explicit).drop(0.0, r) == (r in explicit)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rate": 1.2, "every": 3}, "probability"),
        ({"rate": 0.5}, "needs rounds=, every=, window= or every_s="),
        ({"rate": 0.5, "every_s": 0.1}, "go together"),
        ({"rate": 0.5, "length_s": 0.01}, "go together"),
        ({"rate": 0.5, "every_s": 0.1, "length_s": 0.1}, "len_s"),
        ({"rate": 0.5, "every_s": 0.1, "length_s": 0.0}, "len_s"),
        ({"rate": 0.5, "every": 0}, "every must be >= 1"),
        ({"rate": 0.5, "every": 3, "length": 4}, "len"),
        ({"rate": 0.5, "every": 3, "offset": -1}, "offset"),
        ({"rate": 0.5, "length": 2, "rounds": [1]}, "need every="),
        ({"rate": 0.5, "rounds": [-3]}, "round"),
        ({"rate": 0.5, "rounds": [1.5]}, "integer"),
        ({"rate": 0.5, "windows": [(2.0, 1.0)]}, "start < end"),
        ({"rate": 0.5, "windows": [(1.0,)]}, "pair"),
        ({"rate": 0.5, "every": 2, "rank": -1}, "rank"),
    ],
)
def test_microburst_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Microburst(**kwargs)


def test_recurring_bursts_take_one_len_s_of_each_period_at_a_drawn_place() -> None:
    """``every_s``/``len_s``: a burst of len_s in each every_s from the clock's every_s
    on - its place in the period drawn from the seed, so no two periods need put it at
    the same phase (a strictly periodic burst phase-locks with timers that are multiples
    of its period on a virtual clock); the same seed, the same places."""
    step = 1e-4
    ts = [i * step for i in range(int(3.0 / step))]

    def starts(seed: int) -> list[float]:
        m = Microburst(1.0, every_s=0.1, length_s=0.01, seed=seed)
        inside = [m.in_burst(t, -1) for t in ts]
        assert not any(inside[: int(0.1 / step)])  # (nothing before the first period)
        return [t for t, a, b in zip(ts[1:], inside, inside[1:]) if b and not a]

    got = starts(7)
    assert len(got) == 29  # one in each period from 0.1 s to 3.0 s
    for k, t in enumerate(got, start=1):  # each within its own period, whole
        assert k * 0.1 - step <= t <= (k + 1) * 0.1 - 0.01 + step
    phases = {round(t % 0.1, 3) for t in got}
    assert len(phases) > 20  # drawn, not one phase
    assert starts(7) == got and starts(8) != got
    m = Microburst(1.0, every_s=0.1, length_s=0.01, seed=7)
    duty = sum(m.in_burst(t, -1) for t in ts) / len(ts)
    assert duty == pytest.approx(29 * 0.01 / 3.0, abs=2e-3)
    # asked out of order, a period's burst is where it is asked in order
    late = Microburst(1.0, every_s=0.1, length_s=0.01, seed=7)
    assert late.in_burst(got[5] + 0.005, -1) and late.in_burst(got[2] + 0.005, -1)
    assert not late.in_burst(got[2] - 0.001, -1)


def test_a_bursts_time_windows_are_the_ones_it_drops_in() -> None:
    m = Microburst(1.0, every_s=0.1, length_s=0.01, windows=[(0.02, 0.03)], seed=5)
    windows = m.time_windows(1.0)
    assert len(windows) == 1 + 9 and windows[0] == (0.02, 0.03)
    for start, end in windows:
        assert m.in_burst(start + 1e-6, -1) and m.in_burst(end - 1e-6, -1)
        assert not m.in_burst(start - 1e-6, -1) and not m.in_burst(end + 1e-6, -1)
    assert m.time_windows(0.05) == [(0.02, 0.03)]
    assert Microburst(1.0, every=3).time_windows(10.0) == []  # (rounds, not time)


def test_recurring_bursts_as_a_spec() -> None:
    m = parse_loss_spec("bernoulli:0.01+burst:rate=0.8,every_s=0.1,len_s=0.01,rank=0", seed=3)
    assert isinstance(m, Combined)
    burst = m.models[1]
    assert isinstance(burst, Microburst) and burst.rank == 0
    assert (burst.every_s, burst.length_s, burst.rate) == (0.1, 0.01, 0.8)
    assert not m.needs_round  # (time alone: it meets segments without our header too)
    again = parse_loss_spec(m.to_spec(), seed=3)
    assert again.to_spec() == m.to_spec()
    assert "every_s=0.1" in burst.describe() and "len_s=0.01" in burst.describe()
    for bad in ("burst:rate=0.8,every_s=0.1", "burst:rate=0.8,every_s=x,len_s=0.01",
                "burst:rate=0.8,every_s=0.01,len_s=0.1"):
        with pytest.raises(ValueError):
            parse_loss_spec(bad)


# ----------------------------------------------------------------------- Combined


def test_combined_is_or_of_independent_streams() -> None:
    def parts() -> list[LossModel]:
        return [Bernoulli(0.2, seed=1), GilbertElliott.from_rate(0.1, 4, seed=2),
                Microburst(0.5, every=4, seed=3)]

    n = 20_000
    solo = [[m.drop(0.0, i % 50) for i in range(n)] for m in parts()]
    c = Combined(parts())
    got = [c.drop(0.0, i % 50) for i in range(n)]
    assert got == [any(col) for col in zip(*solo)]
    c.reset()
    assert [c.drop(0.0, i % 50) for i in range(n)] == got


def test_noloss_and_empty_combined() -> None:
    assert not any(draws(NoLoss(), 100))
    assert not any(draws(Combined([]), 100))
    assert NoLoss().describe() == "none"


# ------------------------------------------------------------------------- parser


@pytest.mark.parametrize("spec", ["", "  ", "none", "NONE"])
def test_parse_none(spec: str) -> None:
    assert isinstance(parse_loss_spec(spec), NoLoss)


def test_parse_forms() -> None:
    b = parse_loss_spec("bernoulli:0.05", seed=3)
    assert isinstance(b, Bernoulli) and b.p == 0.05 and b.seed == 3
    assert parse_loss_spec("bernoulli:p=0.05").p == 0.05  # type: ignore[attr-defined]
    assert b.describe() == "bernoulli(p=0.05)"

    g = parse_loss_spec("ge:rate=0.02,burst=8")
    assert isinstance(g, GilbertElliott)
    assert g.stationary_loss == pytest.approx(0.02) and g.p_bg == pytest.approx(1 / 8)
    g = parse_loss_spec("ge:p_gb=0.01,p_bg=0.3,loss_good=0.001,loss_bad=0.9")
    assert isinstance(g, GilbertElliott)
    assert (g.p_gb, g.p_bg, g.loss_good, g.loss_bad) == (0.01, 0.3, 0.001, 0.9)
    g = parse_loss_spec("ge:p_gb=0.01,p_bg=0.3")
    assert (g.loss_good, g.loss_bad) == (0.0, 1.0)  # type: ignore[attr-defined]

    m = parse_loss_spec("burst:rate=0.8,every=20,len=2,offset=3,rank=0")
    assert isinstance(m, Microburst)
    assert (m.rate, m.every, m.length, m.offset, m.rank) == (0.8, 20, 2, 3, 0)
    m = parse_loss_spec("burst:rate=0.8,rounds=5;9;13")
    assert isinstance(m, Microburst) and m.rounds == {5, 9, 13} and m.rank is None
    m = parse_loss_spec("burst:rate=0.7,window=1.0-1.5;3-3.25")
    assert isinstance(m, Microburst) and m.windows == ((1.0, 1.5), (3.0, 3.25))


def test_parse_combined_seeds_are_distinct() -> None:
    c = parse_loss_spec(" bernoulli:0.5 + bernoulli:0.5 + ge:rate=0.1,burst=4", seed=7)
    assert isinstance(c, Combined)
    assert [m.seed for m in c.models] == [derive_seed(7, i) for i in range(3)]  # type: ignore[attr-defined]
    a, b, _ = c.models
    assert draws(a, 1000) != draws(b, 1000)


SPECS = [
    "none",
    "bernoulli:0.05",
    "ge:rate=0.02,burst=8",
    "ge:p_gb=0.01,p_bg=0.3,loss_good=0.001,loss_bad=0.9",
    "burst:rate=0.8,every=20,len=1,offset=4,rank=1",
    "burst:rate=0.8,rounds=5;9;13",
    "burst:rate=0.7,window=1.0-1.5;2-2.5e0",
    "bernoulli:0.01+ge:rate=0.05,burst=4"
    "+burst:rate=0.9,every=7,len=2,rounds=3,window=0.5-1",
]


@pytest.mark.parametrize("spec", SPECS)
def test_parse_round_trip(spec: str) -> None:
    m = parse_loss_spec(spec, seed=42)
    again = parse_loss_spec(m.to_spec(), seed=42)
    assert again.to_spec() == m.to_spec()
    assert again.describe() == m.describe()
    seq = [(0.1 * (i % 40), i % 30) for i in range(3000)]
    assert [m.drop(t, r) for t, r in seq] == [again.drop(t, r) for t, r in seq]


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("foo:0.1", ["'foo:0.1'", "unknown loss kind 'foo'"]),
        ("bernoulli:1.5", ["'bernoulli:1.5'", "p must be a probability"]),
        ("bernoulli:-0.1", ["p must be a probability"]),
        ("bernoulli:abc", ["p='abc' is not a number"]),
        ("bernoulli:", ["bernoulli needs p="]),
        ("bernoulli:q=0.1", ["unknown bernoulli parameter(s) q"]),
        ("bernoulli:0.1,0.2", ["expected key=value"]),
        ("bernoulli:p=0.1,p=0.2", ["p= given twice"]),
        ("ge:rate=0.02", ["ge needs burst="]),
        ("ge:burst=8", ["ge needs rate="]),
        ("ge:rate=0.02,burst=8,p_gb=0.1", ["unknown ge parameter(s) p_gb"]),
        ("ge:p_gb=0.1", ["ge needs p_bg="]),
        ("ge:rate=0.9,burst=1", ["unreachable"]),
        ("burst:every=20", ["'burst:every=20'", "burst needs rate="]),
        ("burst:rate=0.5", ["needs rounds=, every=, window= or every_s="]),
        ("burst:rate=0.5,every=x", ["every='x' is not an integer"]),
        ("burst:rate=0.5,every=2.5", ["is not an integer"]),
        ("burst:rate=0.5,rounds=1;two", ["rounds='two' is not an integer"]),
        ("burst:rate=0.5,window=1.5", ["window '1.5' is not START-END"]),
        ("burst:rate=0.5,window=2-1", ["start < end"]),
        ("burst:rate=zz,every=2", ["rate='zz' is not a number"]),
        ("bernoulli:0.1+", ["part ''", "empty component"]),
        ("none:3", ["none takes no parameters"]),
    ],
)
def test_parse_errors(spec: str, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        parse_loss_spec(spec)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("bad loss spec part ")
    assert "Accepted: none | bernoulli:P" in msg
    for f in fragments:
        assert f in msg


SPEC_WORDS = ["none", "bernoulli", "ge", "burst", "p", "rate", "burst", "every", "len",
              "offset", "rounds", "window", "rank", "p_gb", "p_bg", "loss_good",
              "loss_bad", ":", "=", ",", ";", "+", "-", ".", "0", "1", "0.5", "8",
              "1e3", "nan", "inf", " ", "x"]


@given(st.one_of(st.text(max_size=20),
                 st.lists(st.sampled_from(SPEC_WORDS), max_size=14).map("".join)))
@settings(max_examples=300, deadline=None)
def test_parse_never_raises_other_errors(spec: str) -> None:
    # Whatever the user types, the CLI gets a model or a one-line ValueError.
    try:
        m = parse_loss_spec(spec)
    except ValueError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(m, LossModel)


# ----------------------------------------------------------------------- for_rank


def test_for_rank_filters_other_ranks_bursts() -> None:
    c = parse_loss_spec(
        "bernoulli:0.01+burst:rate=0.8,every=20,rank=1+burst:rate=0.3,every=5"
    )
    assert isinstance(c, Combined)
    mine = c.for_rank(1)
    assert isinstance(mine, Combined) and len(mine.models) == 3
    other = c.for_rank(0)
    assert isinstance(other, Combined)
    assert [type(m) for m in other.models] == [Bernoulli, Microburst]
    assert other.models[1].rank is None  # type: ignore[attr-defined]


def test_for_rank_single_and_lone() -> None:
    m = parse_loss_spec("burst:rate=0.8,every=20,rank=2")
    assert m.for_rank(2) is m
    assert isinstance(m.for_rank(0), NoLoss)
    anyone = parse_loss_spec("burst:rate=0.8,every=20")
    assert anyone.for_rank(5) is anyone
    b = parse_loss_spec("bernoulli:0.1")
    assert b.for_rank(3) is b
    only = parse_loss_spec("bernoulli:0.1+burst:rate=0.8,every=20,rank=2").for_rank(0)
    assert isinstance(only, Bernoulli)
    gone = parse_loss_spec("burst:rate=1,every=2,rank=1+burst:rate=1,rounds=3,rank=1")
    assert isinstance(gone.for_rank(0), NoLoss)


def test_for_rank_keeps_base_of_other_ranks_burst() -> None:
    base = Bernoulli(0.2)
    m = Microburst(1.0, every=2, rank=1, base=base)
    assert m.for_rank(0) is base


def test_needs_round_says_which_models_read_the_round():
    from boundedloss.net.loss import Bernoulli, Combined, Microburst, parse_loss_spec

    assert not Bernoulli(0.1).needs_round
    assert Microburst(0.8, every=5).needs_round
    assert Microburst(0.8, rounds=[3]).needs_round
    assert not Microburst(0.8, windows=[(0.0, 1.0)]).needs_round
    assert Combined([Bernoulli(0.1), Microburst(0.5, every=3)]).needs_round
    assert not parse_loss_spec("bernoulli:0.1+ge:rate=0.02,burst=4").needs_round


def test_a_burst_with_a_base_model_says_it_has_no_spec_form():
    from boundedloss.net.loss import Bernoulli, Microburst

    with pytest.raises(ValueError, match="no spec form"):
        Microburst(0.5, rounds=[1], base=Bernoulli(0.1)).to_spec()
