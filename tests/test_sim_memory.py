"""The simulator's memory floor: under every job measured, and a sweep that cannot fit
stopped before it starts."""

from __future__ import annotations

import pytest

from boundedloss.cli import main
from boundedloss.sim import plan_jobs
from boundedloss.sim.memory import BASE_BYTES, job_floor, messages_per_rank, shortfall

#: peak RSS (MB) of ``boundedloss sim --workers W --systems reliable --topology T
#: --losses 0 --elements E --rounds 1 --cpu cluster-node`` (the 1,024-worker row: DBLP at
#: 1% loss, 2 rounds), read with GNU time's maximum resident set at 41ceb4b (a reliable
#: gather written in place, a send's payload a slice of one view)
MEASURED = [
    (16, "allreduce", 1 << 20, 200),
    (64, "allreduce", 1 << 20, 721),
    (64, "two-level", 1 << 20, 472),
    (128, "ps", 1 << 18, 262),
    (256, "allreduce", 1 << 18, 1573),
    (256, "allreduce", 1 << 14, 960),
    (256, "two-level", 1 << 18, 926),
    (512, "allreduce", 1 << 18, 4764),
    (1024, "two-level", 1 << 18, 3787),
]


#: the same for one round at 1% loss without CPU costs (``--losses 0.01 --rounds 1``, no
#: ``--cpu``; 256 workers reliable, 512 and 1,024 DBLP), where the simulator posts no next
#: round's receives
MEASURED_ONE_ROUND = [
    (256, "allreduce", 1 << 20, 3464),
    (512, "allreduce", 1 << 20, 8284),
    (1024, "allreduce", 1 << 20, 20759),
]


@pytest.mark.parametrize(("workers", "topology", "elements", "peak_mb", "posts_ahead"),
                         [(*m, True) for m in MEASURED]
                         + [(*m, False) for m in MEASURED_ONE_ROUND])
def test_the_floor_is_under_every_job_measured(workers, topology, elements, peak_mb,
                                               posts_ahead):
    floor = job_floor("reliable", topology, workers, elements, posts_ahead)
    assert floor <= peak_mb * 1e6
    assert floor >= 0.55 * peak_mb * 1e6  # (and not so low that it never refuses)


def test_messages_a_rank_holds_follow_the_topology():
    assert messages_per_rank("allreduce", 16) == 3 * 2 * 15
    assert messages_per_rank("allreduce", 16, posts_ahead=False) == 2 * 2 * 15
    assert messages_per_rank("two-level", 16) == 3 * 2 * (4 + 4 - 2)
    assert messages_per_rank("two-level", 13) == 3 * 2 * 12  # (a prime: one level)
    assert messages_per_rank("ps", 64, posts_ahead=False) < messages_per_rank("ps", 64)
    assert job_floor("gloo", "allreduce", 1024, 1 << 28) == BASE_BYTES  # (no gradient)


def test_a_one_round_job_without_cpu_costs_is_counted_without_a_next_round():
    """The floor counts the next round's receives where the simulator posts them: every
    round but a last one, which posts them only where the hosts' CPU is charged."""
    one, two, charged = (plan_jobs([1024], ("reliable",), ("allreduce",), [0.0],
                                   elements=1 << 20, **kw)[0]
                         for kw in ({"rounds": 1}, {"rounds": 2},
                                    {"rounds": 1, "cpu": "cluster-node"}))
    assert not one.posts_ahead_in_last_round() and charged.posts_ahead_in_last_round()
    needs = {job: shortfall([job], available=1).needs for job in (one, two, charged)}
    assert needs[one] == job_floor("reliable", "allreduce", 1024, 1 << 20, False)
    assert needs[one] < needs[two] == needs[charged] == job_floor(
        "reliable", "allreduce", 1024, 1 << 20)


def test_the_worst_job_of_a_sweep_is_the_one_reported():
    jobs = plan_jobs([16, 1024], ("gloo", "reliable"), ("allreduce", "two-level"), [0.0],
                     elements=1 << 20, rounds=1)
    short = shortfall(jobs, available=8_000_000_000)
    assert short is not None
    assert (short.workers, short.topology) == (1024, "allreduce")
    assert short.needs > 14e9 and "1,024 workers" in short.message()
    assert shortfall(jobs[:3], available=8_000_000_000) is None  # (16 workers fit)


def test_a_sweep_that_cannot_fit_stops_with_one_line_before_it_starts(capsys):
    argv = ["sim", "--workers", "1024", "--systems", "reliable", "--topology", "allreduce",
            "--elements", "100000000"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "need at least" in captured.err and "GB of memory" in captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""  # (nothing ran)
