"""A receiver's own credit budget (protocol/drain.py, ``--credit auto``): cut where a
queue overflows, from the drain rate and round trip measured; the grants that feed it;
and incasts and lossless rounds on the simulated network."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from boundedloss.cli import main
from boundedloss.protocol import TransportConfig
from boundedloss.protocol.credit import CREDIT_AUTO, CREDIT_OFF, CreditGrants, CreditSetting
from boundedloss.protocol.drain import (
    CAP_GROWTH,
    GAIN,
    OVERFLOW_MEMORY,
    SAMPLE_DATAGRAMS,
    UNMEASURED,
    DrainBudget,
)
from boundedloss.protocol.path import RttEstimate
from boundedloss.sim.calibration import job_for_incast
from boundedloss.sim.job import LIKE_TESTBED, SimJob, run_job


def test_the_budget_is_unbounded_until_a_phase_overflows() -> None:
    drain = DrainBudget(floor=10)
    assert drain.budget == UNMEASURED
    assert drain.phase_ended(1000, 1050, 0.01, 0.001) == UNMEASURED  # 5%: random
    for _ in range(20):  # the same loss, phase after phase: no overflow
        drain.phase_ended(1000, 1052, 0.01, 0.001)
    assert drain.budget == UNMEASURED


def test_an_overflow_cuts_from_what_the_drain_rate_and_round_trip_call_for() -> None:
    drain = DrainBudget(floor=4)
    drain.phase_ended(1000, 1000, 0.1, 0.002)  # 10,000 datagrams/s, 2 ms, no loss
    drain.phase_ended(600, 1000, 0.1, 0.004)  # 40% lost: an overflow
    # GAIN x the best rate x the least round trip, cut to 60% (deeper than CAP_CUT)
    assert drain.budget == int(GAIN * 10_000 * 0.002 * 0.6) == 24


def test_after_an_overflow_the_budget_grows_slowly_then_doubles() -> None:
    drain = DrainBudget(floor=4)
    drain.phase_ended(1000, 1000, 0.1, 0.002)
    drain.phase_ended(900, 1000, 0.1, 0.002)  # 10%: an overflow
    cut = drain.budget
    drain.phase_ended(1000, 1000, 0.1, 0.002)
    assert drain.budget == math.ceil(cut * CAP_GROWTH)
    for _ in range(OVERFLOW_MEMORY):
        drain.phase_ended(1000, 1000, 0.1, 0.002)
    before = drain.budget
    drain.phase_ended(1000, 1000, 0.1, 0.002)  # no overflow in memory: doubles
    assert drain.budget == 2 * before


def test_random_loss_is_not_an_overflow_but_loss_above_it_is() -> None:
    drain = DrainBudget(floor=4)
    for loss in (0.05, 0.052, 0.048, 0.05):
        drain.phase_ended(round(1000 * (1 - loss)), 1000, 0.1, 0.002)
    assert drain.budget == UNMEASURED
    # three standard deviations of 5% over 1,000 datagrams, and 2 points: ~9%
    drain.phase_ended(920, 1000, 0.1, 0.002)
    assert drain.budget == UNMEASURED
    drain.phase_ended(880, 1000, 0.1, 0.002)
    assert drain.budget < UNMEASURED


def test_a_first_phase_that_overflows_is_cut_to_the_floor_before_it_ends() -> None:
    """An incast's first round: half its datagrams lost before any round trip is known -
    the floor at once, not an unbounded grant for the senders' next messages."""
    drain = DrainBudget(floor=10)
    assert drain.phase_so_far(20, SAMPLE_DATAGRAMS - 1, None) == UNMEASURED  # (too few)
    assert drain.phase_so_far(60, SAMPLE_DATAGRAMS * 2, None) == 10
    assert drain.phase_so_far(100, SAMPLE_DATAGRAMS * 2, None) == 10  # (once)


def test_short_phases_add_up_to_a_rate_sample() -> None:
    """Pushes that arrive one after another make phases of one message each: their
    datagrams and lengths add up until they make a sample."""
    drain = DrainBudget(floor=1)
    phase = SAMPLE_DATAGRAMS // 4
    for _ in range(4):
        drain.phase_ended(phase, phase, 0.001, 0.01)
    assert drain.measured() == math.ceil(GAIN * (4 * phase / 0.004) * 0.01)


def test_a_floor_must_hold_a_datagram() -> None:
    with pytest.raises(ValueError, match="floor"):
        DrainBudget(0)
    with pytest.raises(ValueError, match="floor"):
        TransportConfig(credit_adaptive=True)


class _Receive:
    """What adaptive CreditGrants reads of a receive."""

    def __init__(self, transfer_id: int, heard_at: float, datagrams: int, *, sent: int,
                 srtt: float | None = 0.001):
        self.transfer_id = transfer_id
        self.counts = type("Counts", (), {"parked": False, "first_heard": heard_at,
                                          "datagrams": datagrams, "max_tseq": sent - 1})()
        self.path = type("Path", (), {"rtt": None if srtt is None else RttEstimate(srtt, 0)})()


def test_the_grants_measure_a_phase_from_its_first_heard_receive_to_its_last_done() -> None:
    """Adaptive grants: a phase's receives add up what their senders sent and what
    arrived; an overflowed first phase cuts the budget (and the share every ACK grants)
    as soon as one of them is done."""
    told: list[int] = []
    grants = CreditGrants(4, adaptive=True)
    grants.listener = told.append
    assert grants.budget == grants.share == UNMEASURED
    receives = [_Receive(i, 0.0, 100, sent=300) for i in range(3)]
    for r in receives:
        grants.receive_heard(r)
    grants.receive_done(receives[0], 0.01)  # two thirds lost: the floor at once
    assert grants.budget == 4 and told[-1] == 2  # (split between the two still heard)
    grants.receive_done(receives[1], 0.02)
    grants.receive_done(receives[2], 0.03)
    assert grants.budget == grants.share == 4
    # a clean phase later: no overflow, it grows
    later = _Receive(9, 1.0, 400, sent=400)
    grants.receive_heard(later)
    grants.receive_done(later, 1.02)
    assert grants.budget == math.ceil(4 * CAP_GROWTH)


def test_a_fixed_budget_stays_fixed() -> None:
    grants = CreditGrants(12)
    r = _Receive(1, 0.0, 1000, sent=1000)
    grants.receive_heard(r)
    grants.receive_done(r, 0.001)
    assert grants.budget == 12


@pytest.mark.parametrize(("setting", "text"), [(CREDIT_OFF, "off"), (CREDIT_AUTO, "auto"),
                                               (CreditSetting(65536), "65536")])
def test_a_credit_setting_reads_back_what_it_writes(setting, text) -> None:
    assert str(setting) == text and CreditSetting.from_str(text) == setting
    TransportConfig(**setting.transport())


def _testbed_incast(credit: CreditSetting):
    job = job_for_incast("reliable", rounds=12, credit_bytes=credit.budget_bytes)
    return run_job(dataclasses.replace(job, credit_adaptive=credit.adaptive))


def test_auto_credit_fits_the_testbeds_incast_after_its_first_round() -> None:
    """The kernel testbed's incast (8 ranks through a 100 Mbit/s tbf with a 64 KB queue),
    simulated: without credit 80% of the pushes are dropped at the bottleneck; with the
    budget measured, only the first round's are (the round is then the link's, as with
    a budget sized by hand)."""
    off, hand, auto = (_testbed_incast(c) for c in (CREDIT_OFF, CreditSetting(48 * 1024),
                                                    CREDIT_AUTO))
    assert off.payload_drop_fraction > 0.7
    assert auto.payload_drop_fraction < 0.1 and auto.p50_ms <= 1.02 * hand.p50_ms
    assert auto.p50_ms < 0.97 * off.p50_ms


def test_auto_credit_costs_little_where_nothing_overflows() -> None:
    """Lossless 4 MB rounds simulated as on the kernel testbed (its links and CPU): the
    measured budget holds no one back."""
    def p50(credit: CreditSetting) -> float:
        return run_job(SimJob(workers=4, system="reliable", topology="allreduce", loss=0.0,
                              elements=1 << 20, rounds=12, mtu=1500,
                              **credit.transport(), **LIKE_TESTBED)).p50_ms

    assert p50(CREDIT_AUTO) <= 1.05 * p50(CREDIT_OFF)


def test_sim_takes_credit_auto_and_its_rows_say_so(tmp_path) -> None:
    out = tmp_path / "rows.json"
    assert main(["sim", "--workers", "4", "--systems", "reliable", "--topology", "ps",
                 "--losses", "0", "--elements", "4096", "--rounds", "2", "--credit", "auto",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["credit_adaptive"] is True and row["credit_bytes"] == CREDIT_AUTO.budget_bytes
