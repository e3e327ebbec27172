"""Policies: LTP's adaptive Early Close, DBLP's phase-aware bound and its critical-regime
detector, MLT's chunk priorities, and the ``make_policy`` factory. Synthetic outcomes
test the rules exactly; FakeNetwork transfers (virtual clock, seeded loss) test them
end to end."""

from __future__ import annotations

import math
import pickle
import re

import numpy as np
import pytest

from boundedloss import wire
from boundedloss.net.fake import FakeNetwork, NodeProfile, PathProfile
from boundedloss.net.loss import Bernoulli, Microburst
from boundedloss.policy import (
    BASELINE,
    DEFAULT_P_LOW,
    GLOO,
    POLICIES,
    SYSTEM_NAMES,
    TCP_PS,
    ClosePlan,
    CriticalRegimeDetector,
    EarlyClosePolicy,
    FixedBoundPolicy,
    MessageInfo,
    Outcome,
    Phase,
    PhaseAwarePolicy,
    PhaseReason,
    PhaseRecord,
    Policy,
    PolicySpec,
    ReliablePolicy,
    TensorLayout,
    combine,
    critical_by_layer,
    critical_by_magnitude,
    make_policy,
    min_delivered_for_bound,
    parse_policies,
    parse_policy,
    priority_order,
)
from boundedloss.protocol import CloseReason, SendStatus, TransferMux, TransportConfig
from conftest import SESSION, chunks_equal, source_bytes

C = CloseReason


def info(chunks: int = 100, critical: int = 0, message_id: int = 1) -> MessageInfo:
    return MessageInfo(round_id=0, message_id=message_id, chunk_count=chunks,
                       message_bytes=chunks * 1024, chunk_bytes=1024, critical_count=critical)


def outcome(reason: CloseReason, t: float, delivered: int, chunks: int = 100,
            active: bool = True) -> Outcome:
    return Outcome(info=info(chunks), delivered=delivered, elapsed=t + 0.5,
                   close_reason=reason, retransmit_rounds=0, active=t if active else None)


class Recording(EarlyClosePolicy):
    """EarlyClosePolicy that keeps its plans and outcomes."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.plans: list[ClosePlan] = []
        self.outcomes: list[Outcome] = []

    def plan(self, info):
        p = super().plan(info)
        self.plans.append(p)
        return p

    def observe(self, outcome):
        self.outcomes.append(outcome)
        super().observe(outcome)


def pair(cfg: TransportConfig, seed: int = 0, path: PathProfile | None = None,
         up_bps: float | None = None):
    net = FakeNetwork(seed=seed)
    a = net.attach("a", TransferMux(SESSION, cfg), NodeProfile(up_bps=up_bps))
    b = net.attach("b", TransferMux(SESSION, cfg))
    if path is not None:
        net.set_path("a", "b", path)
    return net, a, b


# =====================================================================  LTP


def test_early_close_plan_before_any_observation_uses_initial_values() -> None:
    pol = EarlyClosePolicy(initial_rate=2000.0, initial_floor=0.003, margin=2.0)
    assert pol.ratio == 0.99 and pol.bound == pytest.approx(0.01) and pol.deadline is None
    plan = pol.plan(info(500))
    assert plan.min_delivered == 495
    assert plan.accept_after == pytest.approx(2.0 * 500 / 2000.0 + 0.003)
    assert plan.accept_from_first and plan.bound == pytest.approx(0.01)
    assert pol.deadline == plan.accept_after
    # critical chunks raise the count; clamps apply; an initial ratio in range is used
    assert pol.plan(info(10, critical=10)).min_delivered == 10
    assert pol.plan(info(1)).accept_after == pytest.approx(2.0 * 1 / 2000.0 + 0.003)
    assert EarlyClosePolicy().plan(info(1)).accept_after == 0.002  # min_deadline
    assert pol.plan(info(1000)).accept_after == 1.0  # max_deadline
    assert EarlyClosePolicy(initial_ratio=0.95).plan(info(100)).min_delivered == 95
    assert pol.plan(info(0)).min_delivered == 0


def test_early_close_fast_clean_network_shortens_deadline_and_raises_ratio() -> None:
    pol = EarlyClosePolicy(initial_ratio=0.95, initial_rate=1000.0)
    before = pol.deadline_for(100)
    ratios = [pol.ratio]
    for _ in range(20):  # 100 chunks in 0.5 ms: 198,000 chunks/s, all delivered
        pol.observe(outcome(C.COMPLETE, 0.0005, 100))
        ratios.append(pol.ratio)
    assert pol.rate == pytest.approx(99 / 0.0005)
    assert pol.deadline_for(100) < before / 10
    assert pol.deadline_for(100) == pol.min_deadline  # 1.5 * 100 / 198000 < 2 ms
    assert ratios[1] == pytest.approx(0.955)  # additive: +0.005 per comfortable close
    assert all(b >= a for a, b in zip(ratios, ratios[1:]))
    assert ratios[-1] == pol.ratio_max == 0.99  # and capped there
    assert pol.completion_time == pytest.approx(0.0005)
    assert pol.observed == 20 and pol.deadline_closes == 0


def test_early_close_lossy_slow_network_lowers_ratio_within_bounds_lengthens_deadline() -> None:
    pol = EarlyClosePolicy(initial_rate=100_000.0)
    before = pol.deadline_for(100)
    ratios = [pol.ratio]
    deadlines = [before]
    for i in range(12):  # cut off by the deadline with 60 of 100 chunks, ever slower
        pol.observe(outcome(C.ACCEPT_DEADLINE, 0.01 * (i + 1), 60))
        ratios.append(pol.ratio)
        deadlines.append(pol.deadline_for(100))
    # multiplicative decrease of the distance to ratio_min: 0.99 -> 0.945 -> 0.9225
    assert ratios[1] == pytest.approx(0.945) and ratios[2] == pytest.approx(0.9225)
    assert all(b < a for a, b in zip(ratios, ratios[1:]))
    assert all(r >= pol.ratio_min for r in ratios) and ratios[-1] < 0.9001
    assert all(b > a for a, b in zip(deadlines, deadlines[1:]))
    assert pol.rate == pytest.approx(
        _ewma([59 / (0.01 * (i + 1)) for i in range(12)], 0.25))
    assert pol.deadline_closes == 12
    # very slow samples: the deadline stops at max_deadline
    for _ in range(10):
        pol.observe(outcome(C.ACCEPT_DEADLINE, 100.0, 2))
    assert pol.deadline_for(100) == pol.max_deadline == 1.0
    assert pol.ratio >= pol.ratio_min


def _ewma(samples, gain):
    est = samples[0]
    for s in samples[1:]:
        est += gain * (s - est)
    return est


def test_early_close_ratio_rule_is_aimd_with_a_dead_zone() -> None:
    pol = EarlyClosePolicy(initial_rate=1000.0, ratio_decrease=0.25, ratio_increase=0.01)
    pol.observe(outcome(C.ACCEPT_DEADLINE, 0.15, 50))  # planned 0.15 s for 100 chunks
    assert pol.ratio == pytest.approx(0.90 + 0.75 * 0.09)
    r = pol.ratio
    late = pol.deadline_for(100) * 0.9  # met the ratio, but after comfort * deadline
    pol.observe(outcome(C.BOUND_MET, late, 99))
    assert pol.ratio == r
    comfortable = pol.deadline_for(100) * 0.5  # exactly at comfort * deadline
    pol.observe(outcome(C.BOUND_MET, comfortable, 99))
    assert pol.ratio == pytest.approx(r + 0.01)
    # the hard deadline and a cancel say nothing about the network
    state = (pol.ratio, pol.rate, pol.completion_time, pol.observed)
    pol.observe(outcome(C.DEADLINE, 30.0, 3))
    pol.observe(outcome(C.CANCELLED, 1.0, 3))
    assert (pol.ratio, pol.rate, pol.completion_time, pol.observed) == state
    # without Outcome.active the time from the receive's opening is used
    pol2 = EarlyClosePolicy()
    pol2.observe(outcome(C.COMPLETE, 0.01, 100, active=False))
    assert pol2.rate == pytest.approx(99 / 0.51)


def test_early_close_floor_is_fastest_recent_small_message() -> None:
    pol = EarlyClosePolicy(initial_rate=1e6, floor_window=3, small_chunks=4, margin=1.0,
                           min_deadline=1e-6)
    assert pol.floor == 0.0
    for t in (0.003, 0.001, 0.002):
        pol.observe(outcome(C.COMPLETE, t, 4, chunks=4))
    assert pol.floor == pytest.approx(0.001)
    pol.observe(outcome(C.ACCEPT_DEADLINE, 0.0001, 2, chunks=4))  # deadline closes: left out
    pol.observe(outcome(C.COMPLETE, 0.0001, 100, chunks=100))  # not small: left out
    assert pol.floor == pytest.approx(0.001)
    pol.observe(outcome(C.COMPLETE, 0.004, 4, chunks=4))
    pol.observe(outcome(C.COMPLETE, 0.005, 4, chunks=4))
    assert pol.floor == pytest.approx(0.002)  # 0.001 fell out of the window of 3
    assert pol.deadline_for(1000) == pytest.approx(1000 / pol.rate + 0.002)


def test_early_close_parameters_are_validated_and_settable() -> None:
    for bad in (dict(ratio_min=0.995), dict(ratio_max=0.0), dict(ratio_max=1.5),
                dict(margin=0.0), dict(margin=float("nan")), dict(min_deadline=2.0),
                dict(initial_ratio=0.5), dict(gain=0.0), dict(floor_window=0),
                dict(initial_rate=-1.0), dict(ratio_increase=-0.1), dict(comfort=1.5)):
        with pytest.raises(ValueError):
            EarlyClosePolicy(**bad)
    with pytest.raises(TypeError):
        EarlyClosePolicy(margin="2")
    pol = EarlyClosePolicy()
    with pytest.raises(ValueError):
        pol.ratio_min = 0.995  # above ratio_max: refused, old value kept
    assert pol.ratio_min == 0.90
    pol.configure(ratio_min=0.995, ratio_max=0.999)  # together they are fine
    assert (pol.ratio_min, pol.ratio_max) == (0.995, 0.999) and pol.ratio == 0.995
    with pytest.raises(ValueError):
        pol.configure(margin=3.0, max_deadline=1e-4)  # refused as a whole
    assert pol.margin == 1.5 and pol.max_deadline == 1.0
    with pytest.raises(TypeError):
        pol.configure(nonsense=1)
    pol.margin = 3.0
    assert pol.deadline_for(100) == pytest.approx(3.0 * 100 / pol.initial_rate)
    pol.ratio_max = 0.996  # the current ratio is kept inside the new range
    pol.observe(outcome(C.COMPLETE, 1e-5, 100))
    assert pol.ratio == 0.996
    pol.reset()
    assert pol.ratio == 0.996 and pol.rate == pol.initial_rate and pol.observed == 0
    assert pickle.loads(pickle.dumps(pol)).params() == pol.params()


def test_early_close_lossy_transfer_closes_at_the_planned_deadline() -> None:
    """No loss for the first 2 ms (the critical chunks, sent first, get through), then
    half of everything is lost: the ratio is out of reach and the receive closes by
    its acceptance deadline, counted from the first datagram."""
    cfg = TransportConfig(chunk_bytes=1024)
    path = PathProfile(delay=50e-6, loss=Microburst(0.5, windows=[(0.002, 10.0)], seed=1))
    net, a, b = pair(cfg, path=path, up_bps=1e8)  # 86 us per datagram: 34 ms for 400
    msg = source_bytes(400 * 1024, 1)
    crit = np.zeros(400, bool)
    crit[[0, 1, 150, 151, 399]] = True
    pol = Recording(initial_rate=40_000.0, margin=1.0)  # 400 chunks -> 10 ms
    rx = b.start_receive("a", 1, 1, net.now, policy=pol, nbytes=msg.nbytes, critical=crit)
    tx = a.start_send("b", 1, 1, msg, net.now, critical=crit)
    net.run_until_done([rx, tx], timeout=10.0)
    r = rx.result
    assert pol.plans[0].accept_after == pytest.approx(0.01)
    assert r.close_reason == C.ACCEPT_DEADLINE
    assert rx.first_heard == pytest.approx(50e-6 + 1072 * 8 / 1e8)
    assert r.stats.finished == pytest.approx(rx.first_heard + 0.01)
    assert r.delivered[crit].all()
    assert 0.1 < r.stats.delivered_fraction < 0.5  # far from the ratio
    assert chunks_equal(msg, r.data, 1024)[r.delivered].all()
    assert tx.result.status == SendStatus.STOPPED
    assert tx.result.close_reason == C.ACCEPT_DEADLINE
    [o] = pol.outcomes
    assert o.active == pytest.approx(0.01) and o.delivered == r.stats.delivered
    assert pol.ratio < pol.ratio_max  # and it learned from it


def test_early_close_deadline_waits_for_critical_chunks_under_bernoulli_loss() -> None:
    cfg = TransportConfig(chunk_bytes=1024)
    reasons = []
    for seed in range(4):
        path = PathProfile(delay=50e-6, loss=Bernoulli(0.4, seed=seed))
        net, a, b = pair(cfg, seed=seed, path=path, up_bps=1e8)
        msg = source_bytes(300 * 1024, seed)
        crit = np.zeros(300, bool)
        crit[::25] = True
        pol = Recording(initial_rate=60_000.0, margin=1.0)  # 5 ms, the pass takes 26 ms
        rx = b.start_receive("a", 1, 1, net.now, policy=pol, critical=crit, nbytes=msg.nbytes)
        tx = a.start_send("b", 1, 1, msg, net.now, critical=crit)
        net.run_until_done([rx, tx], timeout=10.0)
        r = rx.result
        reasons.append(r.close_reason)
        assert r.delivered[crit].all()
        assert r.stats.finished >= rx.first_heard + pol.plans[0].accept_after - 1e-12
        assert chunks_equal(msg, r.data, 1024)[r.delivered].all()
    # closed by the deadline once the critical chunks were in - or, when a critical
    # chunk was unlucky for long enough, by the retransmissions completing everything
    assert set(reasons) <= {C.ACCEPT_DEADLINE, C.COMPLETE}
    assert reasons.count(C.ACCEPT_DEADLINE) >= 3


def test_early_close_deadline_counts_from_the_first_datagram_of_a_receive_posted_ahead() -> None:
    """A receive posted 0.5 s before its sender starts (as the collectives post the next
    round's receives) must not spend its acceptance time waiting."""
    cfg = TransportConfig(chunk_bytes=1024)
    path = PathProfile(delay=50e-6, loss=Bernoulli(0.5, seed=3))
    net, a, b = pair(cfg, seed=3, path=path, up_bps=1e8)
    msg = source_bytes(400 * 1024, 3)
    pol = Recording(initial_rate=40_000.0, margin=1.0)
    rx = b.start_receive("a", 1, 1, 0.0, policy=pol, nbytes=msg.nbytes)
    assert b.next_deadline() == pytest.approx(cfg.receive_deadline)  # no accept clock yet
    net.run(until=0.5)
    assert rx.result is None
    tx = a.start_send("b", 1, 1, msg, net.now)
    net.run_until_done([rx, tx], timeout=10.0)
    r = rx.result
    assert r.close_reason == C.ACCEPT_DEADLINE and r.stats.delivered > 50
    assert rx.first_heard > 0.5
    assert r.stats.finished == pytest.approx(rx.first_heard + 0.01)
    [o] = pol.outcomes
    assert o.elapsed == pytest.approx(rx.first_heard + 0.01)
    assert o.active == pytest.approx(0.01)
    assert pol.rate == pytest.approx((o.delivered - 1) / 0.01)


def test_early_close_adapts_to_a_lossy_spell_and_recovers() -> None:
    """Message after message: clean (2% loss), then rounds 4-9 at 50% loss, then clean
    again. The first deadline (from the initial rate) is far too long, the next follow
    the measured rate; in the lossy spell receives are cut off by the deadline, so the
    ratio falls and the deadline grows; afterwards receives close comfortably early,
    the ratio climbs back and the deadline shrinks. No receive closes without its
    critical chunks."""
    cfg = TransportConfig(chunk_bytes=512)
    loss = Microburst(0.5, rounds=range(4, 10), base=Bernoulli(0.02, seed=9), seed=9)
    net, a, b = pair(cfg, seed=9, path=PathProfile(delay=50e-6, loss=loss), up_bps=1e8)
    pol = Recording(initial_rate=500.0)  # 200 chunks -> 0.6 s before any measurement
    crit = np.zeros(200, bool)
    crit[:4] = True
    ratios = []
    for m in range(14):
        msg = source_bytes(200 * 512, m)
        rx = b.start_receive("a", m, 1, net.now, policy=pol, nbytes=msg.nbytes, critical=crit)
        tx = a.start_send("b", m, 1, msg, net.now, critical=crit)
        net.run_until_done([rx, tx], timeout=10.0)
        assert rx.result.delivered[crit].all()
        assert chunks_equal(msg, rx.result.data, 512)[rx.result.delivered].all()
        ratios.append(pol.ratio)
    deadlines = [p.accept_after for p in pol.plans]
    reasons = [o.close_reason for o in pol.outcomes]
    assert deadlines[0] == pytest.approx(0.6)
    assert all(d < 0.02 for d in deadlines[1:5])  # learned: ~1.5x a clean message
    assert all(r in (C.COMPLETE, C.BOUND_MET) for r in reasons[:4])
    assert ratios[3] == pol.ratio_max
    spell = reasons[4:10]
    # (>= 2: first-pass PROBEs sized from the ACKs let the later ones meet the ratio)
    assert spell[0] == C.ACCEPT_DEADLINE and spell.count(C.ACCEPT_DEADLINE) >= 2
    assert ratios[4] < ratios[3] and min(ratios) >= pol.ratio_min
    assert min(ratios) <= 0.90 + 0.09 / 4 + 1e-9  # two deadline closes: 0.99 -> 0.945 -> 0.9225
    assert deadlines[9] > 1.5 * deadlines[4]
    assert all(r in (C.COMPLETE, C.BOUND_MET) for r in reasons[10:])
    # climbing back: never down again, and up by the end (a step up needs a receive
    # done within half its deadline, which the first one after the spell may miss)
    assert all(b >= a for a, b in zip(ratios[9:], ratios[10:]))
    assert ratios[-1] >= ratios[9] + 0.01
    assert all(b < a for a, b in zip(deadlines[10:], deadlines[11:]))  # and shorter
    assert pol.observed == 14


# ============================================================== CLR detector


def test_detector_first_epoch_critical_then_steady_norms_relaxed() -> None:
    det = CriticalRegimeDetector()
    assert det.phase is Phase.CRITICAL and det.reason is PhaseReason.WARMUP and det.epoch == 0
    phases = [det.epoch_end(n) for n in (10.0, 10.5, 11.0, 10.6, 10.9)]
    assert phases == [Phase.RELAXED] * 5
    assert det.relative_change == pytest.approx(0.3 / 10.6)
    assert det.epoch == 5 and det.reason is PhaseReason.STEADY

    det3 = CriticalRegimeDetector(warmup_epochs=3)
    assert [det3.epoch_end(10.0) for _ in range(4)] == [Phase.CRITICAL, Phase.CRITICAL,
                                                         Phase.RELAXED, Phase.RELAXED]
    assert CriticalRegimeDetector(warmup_epochs=0).phase is Phase.RELAXED


@pytest.mark.parametrize(
    "prev, norm, phase",
    [
        (10.0, 16.0, Phase.CRITICAL),  # +60%
        (10.0, 4.0, Phase.CRITICAL),  # -60%
        (4.0, 6.0, Phase.CRITICAL),  # exactly +eta
        (4.0, 2.0, Phase.CRITICAL),  # exactly -eta
        (4.0, 5.999, Phase.RELAXED),  # just below
        (4.0, 2.001, Phase.RELAXED),
        (0.0, 0.0, Phase.RELAXED),  # no change
        (0.0, 1e-3, Phase.CRITICAL),  # from zero: an infinite change
    ],
)
def test_detector_flags_a_relative_change_of_at_least_eta(prev, norm, phase) -> None:
    det = CriticalRegimeDetector(eta=0.5)
    det.epoch_end(prev)
    assert det.phase is Phase.RELAXED and det.relative_change is None
    assert det.epoch_end(norm) is phase
    assert det.reason is (PhaseReason.GRAD_NORM_CHANGE if phase is Phase.CRITICAL
                          else PhaseReason.STEADY)
    assert det.epoch_end(norm) is Phase.RELAXED  # no change since: relaxed again


def test_detector_lr_change_marks_the_next_epoch_critical() -> None:
    det = CriticalRegimeDetector()
    det.epoch_end(10.0)
    det.lr_changed()
    assert det.phase is Phase.RELAXED and det.lr_change_pending  # nothing changes yet
    assert det.epoch_end(10.1) is Phase.CRITICAL and det.reason is PhaseReason.LR_CHANGE
    assert not det.lr_change_pending
    assert det.epoch_end(10.2) is Phase.RELAXED  # only one epoch
    det.lr_changed()
    det.lr_changed()  # twice before one boundary: still one epoch
    assert det.epoch_end(10.2) is Phase.CRITICAL
    assert det.epoch_end(10.2) is Phase.RELAXED


def test_detector_validation() -> None:
    for kw in (dict(eta=0.0), dict(eta=-1.0), dict(eta=float("nan")), dict(warmup_epochs=-1),
               dict(warmup_epochs=1.5)):
        with pytest.raises(ValueError):
            CriticalRegimeDetector(**kw)
    det = CriticalRegimeDetector()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            det.epoch_end(bad)
    assert det.epoch == 0  # a refused norm changes nothing
    det.warmup_epochs = 0  # before the first boundary: the initial phase follows
    assert det.phase is Phase.RELAXED
    det.eta = 0.1
    det.epoch_end(1.0)
    assert det.epoch_end(1.1) is Phase.CRITICAL  # +10% >= 0.1


# ===================================================================== DBLP


def test_dblp_bounds_are_exactly_p_low_and_p_low_plus_k() -> None:
    pol = PhaseAwarePolicy()
    assert (pol.p_low, pol.k) == (0.008, 0.40)
    assert pol.phase is Phase.CRITICAL and pol.bound == 0.008
    plan = pol.plan(info(1000))
    assert plan == ClosePlan(min_delivered=992, bound=0.008)
    pol.epoch_end(5.0)
    assert pol.phase is Phase.RELAXED
    assert pol.bound == 0.408 == pol.p_high == round(0.008 + 0.40, 12)
    plan = pol.plan(info(1000, critical=7))
    assert plan.bound == 0.408 and plan.min_delivered == 592
    assert plan.min_delivered == min_delivered_for_bound(info(1000, critical=7), 0.408)
    pol2 = PhaseAwarePolicy(p_low=0.024, k=0.3, warmup_epochs=0)
    assert pol2.bound == 0.324 and pol2.plan(info(1000)).min_delivered == 676


def test_dblp_parameters_validated() -> None:
    for p_low, k in ((0.6, 0.4), (0.5, 0.5), (-0.1, 0.4), (0.008, 1.0), (1.0, 0.0),
                     (0.008, -0.1), (float("nan"), 0.4)):
        with pytest.raises(ValueError):
            PhaseAwarePolicy(p_low, k)
    PhaseAwarePolicy(0.5, 0.49)
    pol = PhaseAwarePolicy()
    with pytest.raises(ValueError):
        pol.k = 0.992  # p_low + k = 1
    assert pol.k == 0.40
    pol.configure(p_low=0.1, k=0.5)
    assert pol.p_high == 0.6
    with pytest.raises(TypeError):
        PhaseAwarePolicy(eta=0.3, detector=CriticalRegimeDetector())
    det = CriticalRegimeDetector(eta=0.3, warmup_epochs=2)
    assert PhaseAwarePolicy(detector=det).detector is det


def test_dblp_phase_change_alters_the_next_plan_not_an_open_one() -> None:
    pol = PhaseAwarePolicy()
    first = pol.plan(info(500))
    assert first.bound == 0.008
    assert pol.epoch_end(3.0) is Phase.RELAXED
    second = pol.plan(info(500))
    assert first.bound == 0.008 and first.min_delivered == 496  # unchanged
    assert second.bound == 0.408 and second.min_delivered == 296
    pol.lr_changed()
    assert pol.plan(info(500)).bound == 0.408  # takes effect at the boundary
    assert pol.epoch_end(3.0) is Phase.CRITICAL
    assert pol.plan(info(500)).bound == 0.008
    assert [(h.epoch, h.grad_norm, h.relative_change, h.phase, h.bound, h.reason)
            for h in pol.history] == [
        (0, 3.0, None, Phase.RELAXED, 0.408, PhaseReason.STEADY),
        (1, 3.0, 0.0, Phase.CRITICAL, 0.008, PhaseReason.LR_CHANGE),
    ]
    assert isinstance(pol.history[0], PhaseRecord)
    with pytest.raises(AttributeError):
        pol.history[0].bound = 0.5  # frozen
    # a checkpoint keeps the phase, the detector's memory and the history
    back = pickle.loads(pickle.dumps(pol))
    assert back.phase is Phase.CRITICAL and back.history == pol.history
    assert back.detector.last_norm == 3.0 and back.bound == 0.008


def test_dblp_phase_change_through_transfer_mux_receives() -> None:
    """One receive opens in the critical phase; the phase changes; a second receive
    opens. Both then run through 30% loss: each keeps the bound it opened with."""
    cfg = TransportConfig(chunk_bytes=256)
    path = PathProfile(delay=50e-6, loss=Bernoulli(0.3, seed=5))
    net, a, b = pair(cfg, seed=5, path=path)
    pol = PhaseAwarePolicy()
    m1, m2 = source_bytes(250 * 256, 1), source_bytes(250 * 256, 2)
    rx1 = b.start_receive("a", 7, 1, net.now, policy=pol, nbytes=m1.nbytes)
    assert rx1.plan.bound == 0.008
    pol.epoch_end(12.0)  # leaves the warm-up: relaxed
    rx2 = b.start_receive("a", 7, 2, net.now, policy=pol, nbytes=m2.nbytes)
    assert rx1.plan.bound == 0.008 and rx2.plan.bound == 0.408
    txs = [a.start_send("b", 7, 1, m1, net.now), a.start_send("b", 7, 2, m2, net.now)]
    net.run_until_done([rx1, rx2, *txs], timeout=10.0)
    r1, r2 = rx1.result, rx2.result
    assert r1.bound == 0.008 and r2.bound == 0.408
    assert r1.stats.delivered >= 248  # ceil(0.992 * 250)
    assert r2.close_reason == C.BOUND_MET and 148 <= r2.stats.delivered < 250
    assert r1.stats.retransmit_rounds > r2.stats.retransmit_rounds


def test_fixed_bound_policy_is_the_dblp_baseline() -> None:
    base = FixedBoundPolicy(0.008)
    dblp = PhaseAwarePolicy()
    dblp.epoch_end(1.0)
    assert base.bound == 0.008 and base.plan(info(1000)).min_delivered == 992
    assert dblp.plan(info(1000)).min_delivered == 592


# =============================================================== MLT priorities


def _ref_layer_mask(layout: TensorLayout, cb: int, small: int, names: tuple[str, ...]):
    """Byte by byte: which chunks hold a byte of a critical tensor."""
    owner = np.zeros(layout.nbytes, dtype=bool)
    for s in layout.specs:
        if s.numel < small or any(n in s.name.lower() for n in names):
            owner[s.offset : s.end] = True
    count = wire.chunk_count(layout.nbytes, cb)
    return np.array([owner[i * cb : (i + 1) * cb].any() for i in range(count)], dtype=bool)


RESNETISH = [
    ("conv1.weight", 1728, 4), ("bn1.weight", 64, 4), ("bn1.bias", 64, 4),
    ("layer1.0.conv1.weight", 36864, 4), ("layer1.0.bn1.weight", 64, 4),
    ("layer1.0.bn1.bias", 64, 4), ("subnet.proj.weight", 4096, 4), ("fc.weight", 5120, 4),
    ("fc.bias", 10, 4), ("ln_f.norm_scale", 512, 4), ("empty.bias", 0, 4),
]


@pytest.mark.parametrize("cb", [61, 256, 1400, 8192])
def test_critical_by_layer_matches_a_byte_level_reference(cb: int) -> None:
    layout = TensorLayout(RESNETISH)
    got = critical_by_layer(layout, cb, small_numel=100)
    # the default patterns: "bn" matches the bn1 components but not "subnet"; "bias"
    # and "norm" anywhere
    ref = _ref_layer_mask(layout, cb, 100, ("bias", "norm", "bn1."))
    assert got.shape == (layout.chunk_count(cb),) and got.dtype == bool
    assert np.array_equal(got, ref)
    # random layouts, explicit offsets with gaps, padding at the end
    rng = np.random.default_rng(cb)
    for _ in range(30):
        n = int(rng.integers(1, 12))
        rows, off = [], int(rng.integers(0, 50))
        for i in range(n):
            numel, size = int(rng.integers(0, 3000)), int(rng.choice([1, 2, 4, 8]))
            rows.append((f"t{i}.{'bias' if rng.random() < 0.2 else 'weight'}", numel, size, off))
            off += numel * size + int(rng.integers(0, 300))
        lay = TensorLayout(rows, nbytes=off + int(rng.integers(0, 100)))
        got = critical_by_layer(lay, cb, small_numel=200, patterns=("bias",))
        assert np.array_equal(got, _ref_layer_mask(lay, cb, 200, ("bias",)))


def test_critical_by_layer_rules_and_layout_validation() -> None:
    layout = TensorLayout([("w", 1000, 4), ("encoder.subnet.weight", 5000, 4),
                           ("Block.BatchNorm.weight", 5000, 4), ("layer2.bn3.running", 5000, 4)])
    mask = critical_by_layer(layout, 4000)
    # w: small (< 1024 elements); subnet: not "bn"; BatchNorm: "norm"; bn3: "bn"
    assert mask.tolist() == [True] + [False] * 5 + [True] * 10
    assert not critical_by_layer(layout, 4000, small_numel=0, patterns=()).any()
    assert TensorLayout([("a", 3, 4), ("b", 5, 2)]).specs[1].offset == 12
    assert TensorLayout.from_named([("a", np.zeros(3, np.float32)),
                                    ("b", np.zeros((2, 3), np.float64))]).nbytes == 12 + 48
    assert critical_by_layer(TensorLayout([]), 100).tolist() == [False]  # empty: one chunk
    with pytest.raises(ValueError):
        TensorLayout([("a", 10, 4, 0), ("b", 10, 4, 20)])  # overlap
    with pytest.raises(ValueError):
        TensorLayout([("a", 10, 4, 0), ("b", 10, 4)])  # offsets for some only
    with pytest.raises(ValueError):
        TensorLayout([("a", 10, 4)], nbytes=39)
    with pytest.raises(ValueError):
        TensorLayout([("a", -1, 4)])
    with pytest.raises(ValueError):
        critical_by_layer(layout, 0)


def _ref_magnitude_mask(values: np.ndarray, cb: int, frac: float, score: str) -> np.ndarray:
    flat = values.reshape(-1)
    size = flat.itemsize
    count = wire.chunk_count(flat.nbytes, cb)
    scores = []
    for c in range(count):
        lo, hi = c * cb, (c + 1) * cb
        vals = [abs(float(v)) for j, v in enumerate(flat)
                if j * size < hi and (j + 1) * size > lo]
        vals = [math.inf if math.isnan(v) else v for v in vals]
        if score == "max":
            s = max(vals, default=0.0)
        else:
            s = math.sqrt(sum(v * v for v in vals))
        scores.append(s)
    k = math.floor(frac * count + 1e-9)
    order = sorted(range(count), key=lambda i: (-scores[i], i))
    mask = np.zeros(count, dtype=bool)
    mask[order[:k]] = True
    return mask


@pytest.mark.parametrize("cb", [16, 61, 64, 100])
@pytest.mark.parametrize("score", ["max", "l2"])
def test_critical_by_magnitude_matches_a_reference(cb: int, score: str) -> None:
    rng = np.random.default_rng(cb)
    for n, frac, dtype in ((500, 0.2, np.float32), (257, 0.5, np.float64),
                           (300, 0.1, np.int16), (33, 1.0, np.float32), (40, 0.0, np.float32)):
        v = (rng.standard_normal(n) * rng.choice([1, 100], size=n)).astype(dtype)
        got = critical_by_magnitude(v, cb, frac, score=score)
        assert np.array_equal(got, _ref_magnitude_mask(v, cb, frac, score)), (n, dtype)
        assert got.sum() == math.floor(frac * got.size + 1e-9)
    v = np.zeros(16, np.float32)  # 4 chunks of 4 values
    v[10] = np.nan
    v[3] = -5.0
    assert np.flatnonzero(critical_by_magnitude(v, 16, 0.5, score=score)).tolist() == [0, 2]
    assert np.flatnonzero(critical_by_magnitude(np.zeros(16, np.float32), 16, 0.5)).tolist() \
        == [0, 1]  # ties: lower index first
    with pytest.raises(ValueError):
        critical_by_magnitude(v, 16, 1.5)
    with pytest.raises(ValueError):
        critical_by_magnitude(v, 16, 0.5, score="mean")


def test_combine_and_priority_order() -> None:
    a = np.array([1, 0, 0, 1, 0], bool)
    b = np.array([0, 0, 1, 1, 0], bool)
    assert combine(a, None, b).tolist() == [True, False, True, True, False]
    assert combine(None) is None
    with pytest.raises(ValueError):
        combine(a, np.zeros(4, bool))
    assert priority_order(combine(a, b)).tolist() == [0, 2, 3, 1, 4]
    # it is the order in which MessageSender sends a message's first pass
    mux = TransferMux(SESSION, TransportConfig(chunk_bytes=16))
    crit = np.zeros(40, bool)
    crit[[5, 17, 39]] = True
    mux.start_send("b", 1, 1, source_bytes(40 * 16, 0), 0.0, critical=crit)
    sent = [wire.decode(b"".join(bytes(p) for p in parts))[0]
            for parts, _ in mux.poll(0.0, 1000)]
    order = [h.index for h in sent if h.kind == wire.Kind.DATA]
    assert order == priority_order(crit).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_layer_mask_on_both_ends_delivers_every_bias_and_norm_chunk(seed: int) -> None:
    """MLT end to end: 40% Bernoulli loss, FixedBoundPolicy(0.2), the layer mask derived
    independently on each end from the bucket's layout."""
    cb = 256
    layout = TensorLayout([
        ("conv1.weight", 4000, 4), ("conv1.bias", 32, 4), ("bn1.weight", 32, 4),
        ("bn1.bias", 32, 4), ("conv2.weight", 9000, 4), ("conv2.bias", 64, 4),
        ("ln.norm.weight", 300, 4), ("fc.weight", 6000, 4), ("fc.bias", 10, 4),
    ])
    values = np.random.default_rng(seed).standard_normal(layout.nbytes // 4).astype(np.float32)
    send_mask = critical_by_layer(layout, cb)
    recv_mask = critical_by_layer(TensorLayout([(s.name, s.numel, s.itemsize) for s in layout]),
                                  cb)
    assert np.array_equal(send_mask, recv_mask) and 0 < send_mask.sum() < 0.2 * send_mask.size
    cfg = TransportConfig(chunk_bytes=cb)
    path = PathProfile(delay=50e-6, jitter=2e-5, loss=Bernoulli(0.4, seed=seed))
    net, a, b = pair(cfg, seed=seed, path=path)
    net.set_path("b", "a", PathProfile(delay=50e-6, loss=Bernoulli(0.4, seed=seed + 100)))
    out = np.zeros_like(values)
    rx = b.start_receive("a", 3, 9, net.now, policy=FixedBoundPolicy(0.2), out=out,
                         critical=recv_mask)
    tx = a.start_send("b", 3, 9, values, net.now, critical=send_mask)
    net.run_until_done([rx, tx], timeout=60.0)
    r = rx.result
    # (a critical chunk unlucky for long enough lets the retransmissions finish it all)
    assert r.close_reason in (C.BOUND_MET, C.COMPLETE)
    assert r.delivered[send_mask].all()  # every bias / norm chunk
    assert (~r.delivered).mean() <= 0.2
    if r.close_reason == C.BOUND_MET:
        assert (~r.delivered).any()  # the bound was used: some weight chunks are missing
    ok = chunks_equal(values, out, cb)
    assert ok[r.delivered].all() and ok[send_mask].all()
    for s in layout:  # bias and norm tensors arrived whole, bit-exact
        if "bias" in s.name or "norm" in s.name or "bn" in s.name:
            lo, hi = s.offset // 4, s.end // 4
            assert np.array_equal(out[lo:hi], values[lo:hi]), s.name


# ================================================================== factory


def test_make_policy() -> None:
    assert isinstance(make_policy("reliable"), ReliablePolicy)
    assert make_policy("mlt", p=0.2).p == 0.2
    assert make_policy("MLT").p == 0.01
    assert make_policy("ltp", ratio_min=0.8).ratio_min == 0.8
    dblp = make_policy("dblp", p_low=0.024, k=0.3, eta=0.4)
    assert isinstance(dblp, PhaseAwarePolicy) and dblp.bound == 0.024
    assert dblp.detector.eta == 0.4
    assert set(POLICIES) == {"reliable", "mlt", "ltp", "dblp"}
    with pytest.raises(ValueError) as e:
        make_policy("tcp")
    for name in ("reliable", "mlt", "ltp", "dblp"):
        assert name in str(e.value)
    with pytest.raises(ValueError):
        make_policy("mlt", p=1.0)
    with pytest.raises(ValueError):
        make_policy("dblp", p_low=0.6, k=0.4)
    with pytest.raises(TypeError):
        make_policy("dblp", ratio_min=0.5)


# ================================================================ command-line spelling


@pytest.mark.parametrize("text, name, params", [
    ("dblp", "dblp", {}),
    (" MLT ", "mlt", {}),
    ("mlt:0.02", "mlt", {"p": 0.02}),
    ("mlt:p=0.02", "mlt", {"p": 0.02}),
    ("dblp:0.01:k=0.3", "dblp", {"p_low": 0.01, "k": 0.3}),
    ("dblp:warmup_epochs=2", "dblp", {"warmup_epochs": 2}),
    ("ltp:ratio_min=0.8", "ltp", {"ratio_min": 0.8}),
    ("gloo", GLOO, {}),
    ("TCP-PS", TCP_PS, {}),
])
def test_a_policy_as_the_command_line_writes_it(text, name, params) -> None:
    spec = parse_policy(text)
    assert (spec.name, dict(spec.params)) == (name, params)
    assert parse_policy(str(spec)) == spec  # its name in rows reads back the same
    if spec.uses_transport:
        policy = spec.make()
        assert isinstance(policy, POLICIES[name])
        assert policy.describe() == POLICIES[name](**params).describe()
    else:
        with pytest.raises(ValueError, match=f"{name} has no policy"):
            spec.make()


def test_baseline_is_mlt_at_dblps_p_low() -> None:
    spec = parse_policy("baseline")
    assert str(spec) == BASELINE and spec.name == "mlt"
    assert spec.fixed_bound == DEFAULT_P_LOW == PhaseAwarePolicy().p_low
    assert isinstance(spec.make(), FixedBoundPolicy) and spec.make().bound == DEFAULT_P_LOW
    assert parse_policy("mlt:0.3").fixed_bound == 0.3
    assert parse_policy("mlt").fixed_bound == FixedBoundPolicy().p
    assert parse_policy("dblp").fixed_bound is None and parse_policy("gloo").fixed_bound is None
    assert set(SYSTEM_NAMES) == {GLOO, TCP_PS, BASELINE, *POLICIES}


@pytest.mark.parametrize("text, says", [
    ("tcp", "unknown policy 'tcp'"),
    ("mlt=0.01", "write mlt:0.01"),  # the spelling bench transport once took
    ("mlt(p=0.01)", "write mlt:p=0.01"),
    ("mlt:1.5", "must be a fraction"),
    ("mlt:q=0.1", "unexpected keyword"),
    ("mlt:0.1:p=0.2", "p given twice"),
    ("dblp:p_low=x", "must be a number"),
    ("ltp:0.9", "not KEY=VALUE"),  # LTP has no leading parameter
    ("gloo:1", "takes no parameters"),
    ("tcp-ps:0.1", "takes no parameters"),
    ("baseline:0.1", "takes no parameters"),
])
def test_a_bad_policy_is_one_line_that_says_how_to_write_it(text, says) -> None:
    with pytest.raises(ValueError) as e:
        parse_policy(text)
    message = str(e.value)
    assert says in message and "\n" not in message


def test_comma_separated_policies_keep_order_and_refuse_repeats() -> None:
    specs = parse_policies(" DBLP,baseline ,mlt:0.008")
    assert [str(s) for s in specs] == ["dblp", "baseline", "mlt:p=0.008"]
    with pytest.raises(ValueError, match="dblp is named twice"):
        parse_policies(" DBLP,baseline,dblp ,mlt:0.008")  # (a row would go missing)
    assert parse_policies(["reliable", "mlt"]) == (PolicySpec("reliable"), PolicySpec("mlt"))
    with pytest.raises(ValueError, match="no policies"):
        parse_policies(" , ")
    with pytest.raises(ValueError, match="'tcp'"):
        parse_policies("dblp,tcp")


def test_every_policy_takes_the_training_loops_calls() -> None:
    """A policy without phases takes epoch ends and LR changes and reports no phase, so
    the training loop calls them on any policy; DBLP's answer them."""
    for cls in (ReliablePolicy, FixedBoundPolicy, EarlyClosePolicy):
        policy = cls()
        policy.lr_changed()
        assert policy.epoch_end(1.0) is None and policy.phase is None
        assert policy.bound is not None  # each has a bound to log
        assert policy.plan(MessageInfo(0, 0, 10, 14_000, 1400)).min_delivered <= 10
    dblp = PhaseAwarePolicy(warmup_epochs=0)
    assert isinstance(dblp, Policy) and dblp.phase is Phase.RELAXED
    dblp.lr_changed()
    assert dblp.epoch_end(1.0) is Phase.CRITICAL and dblp.bound == dblp.p_low


# =====================================================================  checkpoints


def _through_torch_save(state: dict) -> dict:
    """``state`` written by torch.save and read back by torch.load's default loader
    (weights_only: plain values only)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def _trained(name: str) -> Policy:
    """A policy of each registered name with parameters off their defaults and
    something learned (a KeyError for a name without one: add it here)."""
    if name == "reliable":
        return ReliablePolicy()
    if name == "mlt":
        return FixedBoundPolicy(0.03)
    if name == "ltp":
        ltp = EarlyClosePolicy(ratio_min=0.8, margin=2.0, floor_window=4)
        ltp.plan(info(100))
        for o in (outcome(C.ACCEPT_DEADLINE, 0.02, 85), outcome(C.COMPLETE, 0.001, 4, chunks=4),
                  outcome(C.BOUND_MET, 0.004, 97), outcome(C.COMPLETE, 0.0005, 3, chunks=3)):
            ltp.observe(o)
        return ltp
    if name == "dblp":
        dblp = PhaseAwarePolicy(p_low=0.01, k=0.3, eta=0.4)
        for norm in (2.0, 2.1, 0.9):
            dblp.epoch_end(norm)
        dblp.lr_changed()  # pending at the checkpoint: the next epoch is critical
        return dblp
    raise KeyError(name)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_resumes_from_its_state_dict_as_it_was(name) -> None:
    """state_dict() is plain values torch.save writes and torch.load(weights_only=True)
    reads; a fresh policy of the same name loaded with it has the same parameters and
    learned state, and from then on plans and decides exactly as the original."""
    original = _trained(name)
    state = original.state_dict()
    assert state["policy"] == name
    resumed = make_policy(name)
    resumed.load_state_dict(_through_torch_save(state))
    assert resumed.state_dict() == state
    assert (resumed.phase, resumed.bound) == (original.phase, original.bound)
    for chunks in (3, 40, 1000):
        assert resumed.plan(info(chunks)) == original.plan(info(chunks))
    for norm in (0.85, 0.2, 0.21):  # what they decide from here on
        assert resumed.epoch_end(norm) == original.epoch_end(norm)
        for o in (outcome(C.ACCEPT_DEADLINE, 0.05, 80), outcome(C.COMPLETE, 0.001, 100)):
            original.observe(o)
            resumed.observe(o)
        assert resumed.plan(info(200)) == original.plan(info(200))
        assert resumed.state_dict() == original.state_dict()


def test_dblp_state_dict_keeps_phase_detector_and_history() -> None:
    dblp = _trained("dblp")
    resumed = PhaseAwarePolicy()
    resumed.load_state_dict(dblp.state_dict())
    assert resumed.history == dblp.history and len(resumed.history) == 3
    assert resumed.history[-1].reason is PhaseReason.GRAD_NORM_CHANGE
    assert (resumed.p_low, resumed.k, resumed.detector.eta) == (0.01, 0.3, 0.4)
    assert resumed.detector.epoch == 3 and resumed.detector.last_norm == 0.9
    assert resumed.detector.lr_change_pending
    assert resumed.phase is Phase.CRITICAL and resumed.bound == 0.01
    # the pending LR change marks the next epoch critical, as it would have
    assert resumed.epoch_end(0.9) is Phase.CRITICAL
    assert resumed.history[-1].reason is PhaseReason.LR_CHANGE


@pytest.mark.parametrize("source", list(POLICIES))
def test_a_policy_refuses_another_policys_state_dict_in_one_line(source) -> None:
    state = _trained(source).state_dict()
    for target in POLICIES:
        if target == source:
            continue
        policy = make_policy(target)
        before = policy.state_dict()
        with pytest.raises(ValueError) as refused:
            policy.load_state_dict(state)
        message = str(refused.value)
        assert "\n" not in message and repr(source) in message and repr(target) in message
        assert policy.state_dict() == before


@pytest.mark.parametrize(("name", "change", "says"), [
    ("dblp", lambda s: s["detector"].update(phase="bogus"), "'bogus' is not a valid Phase"),
    ("dblp", lambda s: s["params"].update(k=0.995), "p_low + k must be < 1"),
    ("dblp", lambda s: s["history"][1].update(reason="guess"), "not a valid PhaseReason"),
    ("dblp", lambda s: s["detector"].pop("last_norm"), "missing 'last_norm'"),
    ("dblp", lambda s: s.pop("history"), "missing history"),
    ("ltp", lambda s: s["learned"].update(ratio=0.5), "ratio 0.5 outside"),
    ("ltp", lambda s: s["learned"].update(rate=-1.0), "rate must be > 0"),
    ("ltp", lambda s: s.update(extra=1), "unknown extra"),
    ("mlt", lambda s: s.update(p=1.5), "loss bound p must be a fraction"),
    ("reliable", lambda s: s.update(p=0.1), "unknown p"),
])
def test_a_refused_state_dict_changes_nothing(name, change, says) -> None:
    """A value refused anywhere in a state_dict is one ValueError line naming the policy,
    and the policy is left exactly as it was (no partial load)."""
    state = _trained(name).state_dict()
    change(state)
    policy = make_policy(name)
    if name == "dblp":
        policy.epoch_end(5.0)  # something of its own that a partial load would lose
    before = policy.state_dict()
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        policy.load_state_dict(state)
    assert "\n" not in str(refused.value) and name in str(refused.value)
    assert policy.state_dict() == before
