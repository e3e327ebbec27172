"""A sweep's rows side by side in processes of their own: the same rows as in turn, as
memory allows, and an error or a lost process said and nothing left running."""

from __future__ import annotations

import dataclasses
import multiprocessing

import pytest

from boundedloss.cli import main
from boundedloss.sim import SimJob, run_sweep
from boundedloss.sim.memory import needs
from boundedloss.sim.sweep import _Worker

JOBS = [SimJob(workers=w, system=s, topology=t, loss=p, elements=20_000, rounds=2)
        for w in (4, 8) for s, t in (("reliable", "ps"), ("dblp", "allreduce"),
                                     ("gloo", "allreduce")) for p in (0.0, 0.02)]


def _rows(rows) -> list[dict]:
    return [{k: v for k, v in dataclasses.asdict(r).items() if k != "wall_s"} for r in rows]


def test_rows_side_by_side_are_the_rows_in_turn_in_the_jobs_order() -> None:
    said: list[str] = []
    side_by_side = run_sweep(JOBS, said.append, processes=3)
    assert _rows(side_by_side) == _rows(run_sweep(JOBS))
    assert any("3 side by side" in s for s in said)  # (it did run them together)
    assert not multiprocessing.active_children()


def test_jobs_whose_floors_do_not_fit_together_run_one_at_a_time() -> None:
    """Memory for the biggest job alone: never two at once, and every row still comes."""
    said: list[str] = []
    rows = run_sweep(JOBS[:4], said.append, processes=4,
                     available=max(needs(j) for j in JOBS[:4]) + 1)
    assert _rows(rows) == _rows(run_sweep(JOBS[:4]))
    assert said and all("simulating 1 side by side" in s for s in said)


def test_a_job_s_error_is_raised_and_nothing_is_left_running() -> None:
    bad = dataclasses.replace(JOBS[0], cpu="no-such-preset")
    with pytest.raises(Exception) as raised:
        run_sweep([*JOBS[:2], bad, *JOBS[2:4]], processes=2)
    with pytest.raises(type(raised.value)):
        run_sweep([bad])  # (the error the same job raises in turn)
    assert not multiprocessing.active_children()


def test_a_worker_that_dies_without_a_row_is_said_by_its_job() -> None:
    worker = _Worker(multiprocessing.get_context("spawn"), "sim-worker-test")
    job = dataclasses.replace(JOBS[0], workers=256, elements=1 << 22)
    worker.start(0, job)
    worker.process.kill()
    with pytest.raises(RuntimeError, match=r"256 workers, reliable, ps.*ended without a row"):
        worker.row(job)
    worker.stop()
    assert not multiprocessing.active_children()


def test_boundedloss_sim_jobs_writes_the_same_rows(tmp_path) -> None:
    args = ["sim", "--workers", "4", "--systems", "reliable,dblp", "--topology", "allreduce",
            "--losses", "0,0.02", "--rounds", "2", "--elements", "20000"]
    assert main([*args, "--json", str(tmp_path / "one.json")]) == 0
    assert main([*args, "--jobs", "2", "--json", str(tmp_path / "two.json")]) == 0
    import json

    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    for row in one + two:
        row.pop("wall_s")
    assert one == two and len(one) == 4


def test_boundedloss_sim_refuses_no_jobs_in_one_line(capsys) -> None:
    assert main(["sim", "--jobs", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--jobs" in err
