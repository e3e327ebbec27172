"""The simulator's memory floor: under every job measured, and a sweep that cannot fit
stopped before it starts."""

from __future__ import annotations

import pytest

from boundedloss.cli import main
from boundedloss.sim import plan_jobs
from boundedloss.sim.memory import BASE_BYTES, job_floor, messages_per_rank, shortfall

#: peak RSS (MB) of ``boundedloss sim --workers W --systems reliable --topology T
#: --losses 0 --elements E --rounds 1 --cpu cluster-node`` (the 1,024-worker row: DBLP at
#: 1% loss, 2 rounds), read with GNU time's maximum resident set at 1642863 (one gradient
#: a job, a round's results freed with it)
MEASURED = [
    (16, "allreduce", 1 << 20, 256),
    (64, "allreduce", 1 << 20, 1005),
    (64, "two-level", 1 << 20, 949),
    (128, "ps", 1 << 18, 262),
    (256, "allreduce", 1 << 18, 2434),
    (256, "allreduce", 1 << 14, 1328),
    (256, "two-level", 1 << 18, 1217),
    (512, "allreduce", 1 << 18, 7221),
    (1024, "two-level", 1 << 18, 6371),
]


#: the same for one round at 1% loss without CPU costs (``--losses 0.01 --rounds 1``, no
#: ``--cpu``; 256 workers reliable, 512 DBLP), where the simulator posts no next round's
#: receives, at the commit that left them out
MEASURED_ONE_ROUND = [
    (256, "allreduce", 1 << 20, 4300),
    (512, "allreduce", 1 << 20, 10044),
]


@pytest.mark.parametrize("workers,topology,elements,peak_mb", MEASURED + MEASURED_ONE_ROUND)
def test_the_floor_is_under_every_job_measured(workers, topology, elements, peak_mb):
    floor = job_floor("reliable", topology, workers, elements)
    assert floor <= peak_mb * 1e6
    assert floor >= 0.6 * peak_mb * 1e6  # (and not so low that it never refuses)


def test_messages_a_rank_holds_follow_the_topology():
    assert messages_per_rank("allreduce", 16) == 3 * 2 * 15
    assert messages_per_rank("two-level", 16) == 3 * 2 * (4 + 4 - 2)
    assert messages_per_rank("two-level", 13) == 3 * 2 * 12  # (a prime: one level)
    assert job_floor("gloo", "allreduce", 1024, 1 << 28) == BASE_BYTES  # (no gradient)


def test_the_worst_job_of_a_sweep_is_the_one_reported():
    jobs = plan_jobs([16, 1024], ("gloo", "reliable"), ("allreduce", "two-level"), [0.0],
                     elements=1 << 20, rounds=1)
    short = shortfall(jobs, available=8_000_000_000)
    assert short is not None
    assert (short.workers, short.topology) == (1024, "allreduce")
    assert short.needs > 25e9 and "1,024 workers" in short.message()
    assert shortfall(jobs[:3], available=8_000_000_000) is None  # (16 workers fit)


def test_a_sweep_that_cannot_fit_stops_with_one_line_before_it_starts(capsys):
    argv = ["sim", "--workers", "1024", "--systems", "reliable", "--topology", "allreduce",
            "--elements", "100000000"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "need at least" in captured.err and "GB of memory" in captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""  # (nothing ran)
