"""The credit budget from the measured drain rate (protocol/drain.py, ``--credit auto``):
the estimator, the grants that feed it, and incasts and lossless rounds on the simulated
network."""

from __future__ import annotations

import dataclasses
import json

import pytest

from boundedloss.cli import main
from boundedloss.protocol import TransportConfig
from boundedloss.protocol.credit import CREDIT_AUTO, CREDIT_OFF, CreditGrants, CreditSetting
from boundedloss.protocol.drain import GAIN, SAMPLE_DATAGRAMS, UNMEASURED, DrainBudget
from boundedloss.protocol.path import RttEstimate
from boundedloss.sim.calibration import job_for_incast
from boundedloss.sim.job import LIKE_TESTBED, SimJob, run_job


def test_the_budget_is_unbounded_until_a_phase_is_measured() -> None:
    drain = DrainBudget(floor=10)
    assert drain.budget == UNMEASURED
    # a phase too short to time leaves it as it was
    assert drain.phase_ended(SAMPLE_DATAGRAMS - 1, 0.001, 0.001) == UNMEASURED


def test_with_no_round_trip_known_the_budget_falls_to_its_floor() -> None:
    """The first phase of an incast: its rate is known before any send to its peers has
    finished - the floor, not an unbounded grant for the senders' next messages."""
    drain = DrainBudget(floor=10)
    assert drain.phase_so_far(SAMPLE_DATAGRAMS, 0.01, None) == 10


def test_the_budget_is_twice_the_best_rate_times_the_least_round_trip() -> None:
    drain = DrainBudget(floor=4)
    drain.phase_ended(1000, 0.1, 0.002)  # 10,000 datagrams/s, 2 ms
    assert drain.budget == GAIN * 10_000 * 0.002 == 40
    drain.phase_ended(1000, 0.05, 0.004)  # 20,000/s: the best rate, 2 ms still the least
    assert drain.budget == GAIN * 20_000 * 0.002
    drain.phase_ended(100, 1.0, 0.001)  # a slow phase does not lower the best rate
    assert drain.budget == GAIN * 20_000 * 0.001
    for _ in range(8):  # ... until the phases remembered are all slow
        drain.phase_ended(100, 1.0, 0.001)
    assert drain.budget == 4  # (0.2 datagrams: the floor)


def test_short_phases_add_up_to_a_sample() -> None:
    """Pushes that arrive one after another make phases of one message each: their
    datagrams and lengths add up until they make a sample."""
    drain = DrainBudget(floor=1)
    phase = SAMPLE_DATAGRAMS // 4
    for _ in range(3):
        assert drain.phase_ended(phase, 0.001, 0.01) == UNMEASURED
    drain.phase_ended(phase, 0.001, 0.01)
    assert drain.budget == GAIN * (4 * phase / 0.004) * 0.01


def test_a_floor_must_hold_a_datagram() -> None:
    with pytest.raises(ValueError, match="floor"):
        DrainBudget(0)
    with pytest.raises(ValueError, match="floor"):
        TransportConfig(credit_adaptive=True)


class _Receive:
    """What adaptive CreditGrants reads of a receive."""

    def __init__(self, transfer_id: int, heard_at: float, datagrams: int,
                 srtt: float | None):
        self.transfer_id = transfer_id
        self.counts = type("Counts", (), {"parked": False, "first_heard": heard_at,
                                          "datagrams": datagrams})()
        self.path = type("Path", (), {"rtt": None if srtt is None else RttEstimate(srtt, 0)})()


def test_the_grants_measure_a_phase_from_its_first_heard_receive_to_its_last_done() -> None:
    told: list[int] = []
    grants = CreditGrants(4, adaptive=True)
    grants.listener = told.append
    assert grants.budget == grants.share == UNMEASURED
    receives = [_Receive(i, 0.0, 100, 0.002 + i / 1000) for i in range(3)]
    for r in receives:
        grants.receive_heard(r)
    grants.receive_done(receives[0], 0.01)  # 100 datagrams in 10 ms so far, 2 ms
    assert grants.budget == GAIN * 10_000 * 0.002 == 40
    grants.receive_done(receives[1], 0.02)
    grants.receive_done(receives[2], 0.03)  # 300 in 30 ms: the phase's end
    assert grants.budget == 40 and grants.share == 40 and told[-1] == 40
    # the next phase starts at its first heard receive, not where the last one ended
    later = _Receive(9, 1.0, 400, 0.001)
    grants.receive_heard(later)
    grants.receive_done(later, 1.02)  # 20,000/s
    assert grants.budget == GAIN * 20_000 * 0.001


def test_a_fixed_budget_stays_fixed() -> None:
    grants = CreditGrants(12)
    r = _Receive(1, 0.0, 1000, 0.001)
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
