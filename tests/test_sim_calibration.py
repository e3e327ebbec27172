"""The simulator against the kernel testbed's recorded rounds: the calibration's case in CI.

(Also the incast: ``compare --scenario incast --network kernel``'s rounds and its
bottleneck's drops, recorded in ``benchmarks/compare-incast-testbed-*.json``, against
``sim --like-testbed --bottleneck``.)

``benchmarks/sim-calibration-1500.json`` holds what ``tools/sim_calibrate.py`` measured:
a rank's CPU costs on this machine (ours, and TCP's for gloo's hosts), and ``bench
kernel-loss``'s rounds on the testbed (4 ranks, 4 MB, MTU 1,500). Here some of those
rows are simulated again with those costs - in virtual time, with no testbed - and each
round's p50 must lie within ``P50_TOLERANCE`` of the testbed's (and for one row, the
p99: the cores losing the preset's interference). A change to the
simulator's network, CPU or protocol model that moves it off the testbed fails here; a
new calibration (``sim_calibrate.py --json``) rewrites the figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from boundedloss.net.cpu import CpuCosts
from boundedloss.sim import SimJob, run_job
from boundedloss.sim.calibration import P50_TOLERANCE, job_for_incast, job_for_testbed_row

CALIBRATION = Path(__file__).parent.parent / "benchmarks" / "sim-calibration-1500.json"

#: not the testbed's 60: at 10 every row's simulated p50 is within 0.6% of its 60-round
#: one (which is the recorded one), in a sixth of the time
ROUNDS = 10

#: Rows within the tolerance today: gloo's ring, both systems, both topologies, each
#: loss. Outside it, and so not here (simulated over testbed p50, BENCHMARKS.md
#: "Calibration against the kernel testbed"):
#: - tcp-ps, 0% (0.80)
#: - gloo and tcp-ps at 1% (0.71, 0.65) and tcp-ps at 5% (4.2): the TCP model's recovery
#:   is not the kernel's - at 1% it costs the kernel's rounds more; at 5% the medians
#:   fall on either side of a retransmission timeout from run to run (gloo's 0.94 here
#:   is such a coincidence, and not a row to hold)
#: - the parameter servers under loss: reliable's at 1% (0.83), DBLP's at 1% and 5%
#:   (0.77, 0.85) - the simulator is fast there; what the testbed spends that the model
#:   does not charge is not known
#: (DBLP's allreduce at 1% is held at 60 rounds, its p99 too, below.)
ROWS = [("gloo", "gloo", 0.0), ("reliable", "ps", 0.0), ("dblp", "ps", 0.0),
        ("reliable", "allreduce", 0.01),
        ("reliable", "ps", 0.05), ("dblp", "allreduce", 0.05)]


@pytest.fixture(scope="module")
def calibration() -> dict:
    return json.loads(CALIBRATION.read_text())


def _row_and_job(calibration: dict, row: tuple[str, str, float],
                 rounds: int) -> tuple[dict, SimJob]:
    """A calibration's testbed row (system, topology, loss), and the job that simulates
    it with the calibration's own costs for ``rounds`` rounds."""
    testbed = next(r for r in calibration["rows"]
                   if (r["system"], r["topology"], r["loss"]) == row)
    return testbed, job_for_testbed_row(*row, elements=calibration["elements"],
                                        rounds=rounds, mtu=calibration["mtu"],
                                        costs=CpuCosts(**calibration["costs"]),
                                        tcp_costs=CpuCosts(**calibration["tcp_costs"]))


@pytest.mark.parametrize(("system", "topology", "loss"), ROWS)
def test_a_simulated_round_s_p50_is_the_kernel_testbed_s_within_the_tolerance(
        calibration, system, topology, loss):
    testbed, job = _row_and_job(calibration, (system, topology, loss), ROUNDS)
    assert run_job(job).p50_ms == pytest.approx(testbed["testbed_p50_ms"], rel=P50_TOLERANCE)


def test_a_simulated_round_s_p99_is_the_kernel_testbed_s_within_the_tolerance(calibration):
    """DBLP's transpose allreduce at 1%, a row the interference (the preset's, fitted to
    gloo's and reliable's lossless rows) was not fitted on, at the testbed's 60 rounds (at
    fewer a p99 is one round's luck): its p99 (0.94 of the testbed's; 0.77 without the
    interference, BENCHMARKS.md "The cores' interference") and its p50 (0.93) within the
    tolerance."""
    testbed, job = _row_and_job(calibration, ("dblp", "allreduce", 0.01),
                                calibration["rounds"])
    assert job.interference() is not None  # (the preset's)
    row = run_job(job)
    assert row.p99_ms == pytest.approx(testbed["testbed_p99_ms"], rel=P50_TOLERANCE)
    assert row.p50_ms == pytest.approx(testbed["testbed_p50_ms"], rel=P50_TOLERANCE)


#: A calibration measured at MTU 9,000 on one day with TCP's costs fitted per byte,
#: segment and message at both MTUs (``sim_calibrate.py --tcp-costs``) and our costs
#: read with the core's decisions counted (``--recompute-costs``): its TCP rows
#: lossless and at 1% (1.07, 1.08, 0.98, 0.98 of the testbed's; 0.69-0.78 with
#: ``tcp_cpu.py``'s one-process costs) and our allreduce at 1% (1.06). Not here: ours
#: lossless (the allreduce 1.25-1.45: ``round_cpu``'s costs charge more than the
#: testbed's rounds hold that day), DBLP's parameter server under loss (0.65-0.68), and
#: TCP at 5% (either side of a retransmission timeout).
CALIBRATION_9000 = CALIBRATION.with_name("sim-calibration-9000-d.json")
ROWS_9000 = [("gloo", "gloo", 0.0), ("tcp-ps", "ps", 0.0), ("gloo", "gloo", 0.01),
             ("tcp-ps", "ps", 0.01), ("reliable", "allreduce", 0.01)]


#: The same at MTU 9,000, measured afresh once a lossy round's aggregation cost what a
#: lossless one's does (``sim-calibration-9000-e.json``): the rows it moved - DBLP's
#: parameter server at 1% (0.91 of the testbed's; 0.66 before, when its testbed rounds
#: aggregated every lossy contribution element by element) and DBLP's allreduce at 5%
#: (0.95) - and reliable's parameter server, lossless (0.92).
CALIBRATION_9000_E = CALIBRATION.with_name("sim-calibration-9000-e.json")
ROWS_9000_E = [("dblp", "ps", 0.01), ("dblp", "allreduce", 0.05), ("reliable", "ps", 0.0)]


@pytest.mark.parametrize(
    ("path", "system", "topology", "loss"),
    [(CALIBRATION_9000, *row) for row in ROWS_9000]
    + [(CALIBRATION_9000_E, *row) for row in ROWS_9000_E],
    ids=lambda v: v.stem if isinstance(v, Path) else str(v))
def test_a_simulated_round_s_p50_at_mtu_9000_is_the_kernel_testbed_s(path, system, topology,
                                                                     loss):
    calibration = json.loads(path.read_text())
    testbed, job = _row_and_job(calibration, (system, topology, loss), ROUNDS)
    assert run_job(job).p50_ms == pytest.approx(testbed["testbed_p50_ms"], rel=P50_TOLERANCE)


INCAST_RUNS = {48 * 1024: "compare-incast-testbed-credit48k.json",
               None: "compare-incast-testbed-nocredit.json"}
#: how far the simulated bottleneck's drop fraction may lie from the testbed qdisc's
DROP_TOLERANCE = 0.05


#: Arms within the tolerance at 10 rounds: ours with credit (p50 0.90-0.92 of the
#: testbed's, whose rounds hold a training step of about 16 ms the job does not), and
#: reliable's without (0.87; its drops 82.6% against 83.6%). Not here: tcp-ps (0.53-0.67:
#: the TCP model drops 5% at the tbf where the kernel's TCP drops 29%), DBLP without
#: credit (0.59: the job runs DBLP's relaxed bound throughout; under its critical
#: regimes' bound the round is 0.90 of the testbed's) and LTP without (0.85 at 10 rounds,
#: 0.89 at 30).
@pytest.mark.parametrize(("system", "credit"), [("reliable", 48 * 1024), ("ltp", 48 * 1024),
                                                ("reliable", None)])
def test_a_simulated_incast_round_and_its_drops_are_the_kernel_testbed_s(system, credit):
    testbed = next(r for r in json.loads((CALIBRATION.parent / INCAST_RUNS[credit]).read_text())
                   if r["policy"] == system)
    row = run_job(job_for_incast(system, rounds=ROUNDS, credit_bytes=credit))
    assert row.p50_ms == pytest.approx(testbed["round_ms_p50"], rel=P50_TOLERANCE)
    assert row.bottleneck_drop_fraction == pytest.approx(testbed["bottleneck_drop_fraction"],
                                                         abs=DROP_TOLERANCE)


def test_the_simulated_incast_pushes_the_scenario_s_model():
    """The simulated push is the incast scenario's model, parameter for parameter (the
    digits MLP at its default width)."""
    from boundedloss.experiments.train import TrainConfig
    from boundedloss.sim.calibration import INCAST, INCAST_ELEMENTS
    from boundedloss.workloads.images import ImageMLP

    assert INCAST.model == "mlp"
    model = ImageMLP(8, hidden=TrainConfig().mlp_hidden)
    assert sum(p.numel() for p in model.parameters()) == INCAST_ELEMENTS
