"""Tests for the Bottleneck (shallow tail-drop queue) loss model.

The model has no randomness, so every check is exact or a closed-form bound.
"""

from __future__ import annotations

import pytest

from boundedloss.net.loss import (
    Bernoulli,
    Bottleneck,
    Combined,
    LossModel,
    Microburst,
    NoLoss,
    parse_loss_spec,
)

RATE = 20_000.0
QUEUE = 64


def kept(model: LossModel, times: list[float]) -> int:
    return sum(not model.drop(t, -1) for t in times)


def test_arrivals_slower_than_rate_never_dropped() -> None:
    m = Bottleneck(RATE, 1)  # even a one-datagram buffer suffices
    dt = 1.0 / RATE * 1.01
    assert kept(m, [i * dt for i in range(50_000)]) == 50_000


def test_arrivals_exactly_at_rate_never_dropped() -> None:
    m = Bottleneck(RATE, 1)
    assert kept(m, [i / RATE for i in range(50_000)]) == 50_000


@pytest.mark.parametrize("n", [1, QUEUE - 1, QUEUE, QUEUE + 1, 8 * 100])
def test_burst_keeps_exactly_queue(n: int) -> None:
    m = Bottleneck(RATE, QUEUE)
    drops = [m.drop(5.0, -1) for _ in range(n)]
    # Tail drop: the first `queue` arrivals fill the buffer, the rest are lost.
    assert drops == [False] * min(n, QUEUE) + [True] * max(0, n - QUEUE)


@pytest.mark.parametrize("k", [1, 3, 17, QUEUE])
@pytest.mark.parametrize("t0", [0.0, 1.2345, 1000.0])
def test_pause_of_k_over_rate_admits_k(k: int, t0: float) -> None:
    m = Bottleneck(RATE, QUEUE)
    assert kept(m, [t0] * (QUEUE + 10)) == QUEUE
    t1 = t0 + k / RATE
    drops = [m.drop(t1, -1) for _ in range(k + 10)]
    assert drops == [False] * k + [True] * 10


def test_long_pause_empties_queue_and_no_more() -> None:
    m = Bottleneck(RATE, QUEUE)
    kept(m, [0.0] * 1000)
    # Draining far more than the queue holds leaves it empty, not "negative".
    assert kept(m, [10.0] * 1000) == QUEUE


@pytest.mark.parametrize("queue", [1, 8, QUEUE])
def test_steady_stream_at_twice_rate_keeps_half(queue: int) -> None:
    m = Bottleneck(RATE, queue)
    n = 200_000
    dt = 1.0 / (2.0 * RATE)
    got = kept(m, [i * dt for i in range(n)]) / n
    # Exactly rate * duration + queue datagrams get through, i.e. 0.5 + queue / n.
    assert got == pytest.approx(0.5, abs=0.01)
    assert 0.5 <= got <= 0.5 + (queue + 1) / n


def test_incast_eight_senders() -> None:
    # 8 workers each push a 100-datagram burst at the same moment, interleaved.
    m = Bottleneck(RATE, QUEUE)
    arrivals = sorted((i * 1e-6, w) for w in range(8) for i in range(100))
    kept_per = [0] * 8
    for t, w in arrivals:
        if not m.drop(t, -1):
            kept_per[w] += 1
    # Queue plus what drains during the ~100 us burst; the rest (most of it) is lost.
    total = sum(kept_per)
    assert QUEUE <= total <= QUEUE + RATE * 100e-6 + 1
    assert min(kept_per) > 0  # the loss hits every sender, not just one


def test_earlier_now_drains_nothing() -> None:
    m = Bottleneck(RATE, 2)
    assert [m.drop(1.0, -1) for _ in range(3)] == [False, False, True]
    assert m.drop(0.5, -1) is True  # going back in time must not free room
    assert m.drop(1.0 + 1.0 / RATE, -1) is False


def test_reset_restores_empty_queue_and_replays() -> None:
    m = Bottleneck(RATE, QUEUE)
    times = [i * 1e-5 for i in range(5000)] + [0.2 + i * 1e-6 for i in range(500)]
    first = [m.drop(t, -1) for t in times]
    assert any(first) and not all(first)
    m.reset(123)  # a seed is accepted and changes nothing
    assert m.level == 0.0
    assert [m.drop(t, -1) for t in times] == first
    # After reset the last time is forgotten: an earlier clock starts afresh.
    m.reset()
    assert kept(m, [-50.0] * 100) == QUEUE


def test_interface() -> None:
    m = Bottleneck(RATE, QUEUE)
    assert m.needs_round is False
    assert not hasattr(m, "__dict__")
    assert m.describe() == "bottleneck(rate=20000/s, queue=64)"
    assert (
        Bottleneck(1.5e3, 8, rank=2).describe()
        == "bottleneck(rate=1500/s, queue=8, rank=2)"
    )
    assert "Bottleneck" in repr(m)


def test_for_rank() -> None:
    m = Bottleneck(RATE, QUEUE, rank=0)
    assert m.for_rank(0) is m
    assert isinstance(m.for_rank(1), NoLoss)
    every = Bottleneck(RATE, QUEUE)
    assert every.for_rank(0) is every and every.for_rank(7) is every

    combo = parse_loss_spec("bernoulli:0.01+bottleneck:rate=20000,queue=64,rank=0")
    on0 = combo.for_rank(0)
    assert isinstance(on0, Combined)
    assert [type(c) for c in on0.models] == [Bernoulli, Bottleneck]
    assert isinstance(combo.for_rank(3), Bernoulli)
    only = parse_loss_spec(
        "bottleneck:rate=100,queue=4,rank=1+burst:rate=1,rounds=2,rank=1"
    )
    assert isinstance(only.for_rank(0), NoLoss)
    assert isinstance(only.for_rank(1), Combined)
    assert [type(c) for c in only.for_rank(1).models] == [Bottleneck, Microburst]


def test_parse() -> None:
    m = parse_loss_spec("bottleneck:rate=20000,queue=64")
    assert isinstance(m, Bottleneck)
    assert (m.rate, m.queue, m.rank) == (20000.0, 64, None)
    m = parse_loss_spec(" Bottleneck : queue = 8 , rate = 2.5e4 , rank = 3 ")
    assert isinstance(m, Bottleneck)
    assert (m.rate, m.queue, m.rank) == (25000.0, 8, 3)


@pytest.mark.parametrize(
    "spec",
    [
        "bottleneck:rate=20000,queue=64",
        "bottleneck:rate=20000,queue=64,rank=0",
        "bottleneck:rate=1234.5678,queue=1",
        "bernoulli:0.01+bottleneck:rate=20000,queue=64,rank=0",
        "bottleneck:rate=5e4,queue=16+ge:rate=0.02,burst=8",
    ],
)
def test_round_trip(spec: str) -> None:
    m = parse_loss_spec(spec, seed=7)
    again = parse_loss_spec(m.to_spec(), seed=7)
    assert again.to_spec() == m.to_spec()
    assert again.describe() == m.describe()
    times = (
        [i * 2e-5 for i in range(3000)]
        + [0.1] * 200
        + [0.2 + i * 1e-6 for i in range(500)]
    )
    assert [m.drop(t, -1) for t in times] == [again.drop(t, -1) for t in times]


@pytest.mark.parametrize(
    "spec, fragments",
    [
        (
            "bottleneck:rate=0,queue=64",
            [
                "'bottleneck:rate=0,queue=64'",
                "rate must be a finite number > 0, got 0.0",
            ],
        ),
        (
            "bottleneck:rate=-5,queue=64",
            ["bottleneck rate must be a finite number > 0"],
        ),
        (
            "bottleneck:rate=inf,queue=64",
            ["bottleneck rate must be a finite number > 0"],
        ),
        (
            "bottleneck:rate=nan,queue=64",
            ["bottleneck rate must be a finite number > 0"],
        ),
        ("bottleneck:rate=20000,queue=0", ["bottleneck queue must be >= 1, got 0"]),
        ("bottleneck:rate=20000,queue=2.5", ["queue='2.5' is not an integer"]),
        ("bottleneck:rate=fast,queue=8", ["rate='fast' is not a number"]),
        ("bottleneck:rate=20000,queue=8,rank=-1", ["bottleneck rank must be >= 0"]),
        ("bottleneck:rate=20000", ["bottleneck needs queue="]),
        ("bottleneck:queue=64", ["bottleneck needs rate="]),
        ("bottleneck:20000", ["expected key=value"]),
        (
            "bottleneck:rate=20000,queue=64,size=1500",
            ["unknown bottleneck parameter(s) size", "(expected queue, rank, rate)"],
        ),
        ("bernoulli:0.01+bottleneck:rate=0,queue=8", ["'bottleneck:rate=0,queue=8'"]),
    ],
)
def test_bad_specs(spec: str, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        parse_loss_spec(spec)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, msg
    assert "bottleneck:rate=DATAGRAMS_PER_S,queue=N[,rank=K]" in msg  # forms listed


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"rate": 0, "queue": 8}, "rate must be a finite number > 0"),
        ({"rate": 100, "queue": 0}, "queue must be >= 1"),
        ({"rate": 100, "queue": 8.0}, "queue must be an integer"),
        ({"rate": 100, "queue": True}, "queue must be an integer"),
        ({"rate": 100, "queue": 8, "rank": -2}, "rank must be >= 0"),
    ],
)
def test_constructor_checks(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        Bottleneck(**kwargs)
