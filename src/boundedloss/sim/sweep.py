"""A sweep's jobs, one after another or several side by side in processes of their own.

Each job is a simulation of its own, seeded by the job alone, so its row is the same
whichever way it runs, and wherever it runs (its ``wall_s`` apart: what it took, with
whatever ran beside it). Side by side, a job starts only once one of ``processes``
slots is free and the floors of what runs (``memory.needs``) and of the job
itself fit in the memory available when the sweep starts; a job too big to run beside
the others waits until it can run alone. The floor is a floor: jobs it lets through side
by side may still need more than there is, as a single job may.
"""

from __future__ import annotations

import functools
import multiprocessing
import pickle
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as connection_wait

from .job import SimJob, SimRow, run_job
from .memory import available_bytes, needs


def describe(job: SimJob) -> str:
    """The job in a few words, as progress says it."""
    background = f", background {job.background}" if job.background else ""
    return (f"{job.workers} workers, {job.system}, {job.topology}, "
            f"{job.loss_model or f'{job.loss:.1%}'} loss{background}")


def _say_within(progress: Callable[[str], None], job: str, how_far: str) -> None:
    progress(f"{job} - {how_far}")


def run_sweep(jobs: Sequence[SimJob], progress: Callable[[str], None] | None = None, *,
              processes: int = 1, available: int | None = None) -> list[SimRow]:
    """Each of ``jobs``' rows, in the jobs' order. ``processes``: how many run side by
    side, each in a process of its own (1: in turn, in this one); ``available``: the
    memory they may take together (default: what this machine has available now)."""
    if processes < 1:
        raise ValueError("processes must be at least 1")
    if processes == 1 or len(jobs) <= 1:
        rows = []
        for i, job in enumerate(jobs, 1):
            said = f"simulating {i}/{len(jobs)}: {describe(job)}"
            if progress is None:
                rows.append(run_job(job))
                continue
            progress(said)
            rows.append(run_job(job, functools.partial(_say_within, progress, said)))
        return rows
    if available is None:
        available = available_bytes()
    return _side_by_side(list(jobs), progress, processes, available)


class _Worker:
    """A process of its own that simulates the jobs it is handed, one at a time (its
    imports paid once, not once a job)."""

    def __init__(self, context, name: str):
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), name=name, daemon=True)
        self.process.start()
        theirs.close()
        self.job: int | None = None  # (the index of the job it runs)

    def start(self, i: int, job: SimJob) -> None:
        self.job = i
        self.conn.send(job)

    def row(self, job: SimJob) -> SimRow:
        """The row it sent for ``job``, or the job's error raised here."""
        self.job = None
        try:
            ok, value = self.conn.recv()
        except (EOFError, OSError):  # (it ended without a word: killed - for memory?)
            self.process.join()
            raise RuntimeError(
                f"the simulation of {describe(job)} ended without a row (exit status "
                f"{self.process.exitcode}; killed for memory?): run it alone, or with "
                "fewer --jobs") from None
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        if self.job is None and self.process.is_alive():
            try:
                self.conn.send(None)  # (done: it ends by itself)
            except OSError:
                pass
        else:
            self.process.terminate()  # (an error elsewhere, or an interrupt)
        self.process.join()
        self.conn.close()


def _serve(conn: Connection) -> None:
    """A worker's loop: each job it is handed, its row (or its error) sent back."""
    while True:
        job = conn.recv()
        if job is None:
            break
        try:
            outcome: tuple = (True, run_job(job))
        except BaseException as e:  # noqa: BLE001 - handed to the sweep's caller
            try:
                pickle.dumps(e)
                outcome = (False, e)
            except Exception:  # noqa: BLE001 - (an error that cannot cross: as text)
                outcome = (False, RuntimeError(f"{type(e).__name__}: {e}"))
        conn.send(outcome)
    conn.close()


def _side_by_side(jobs: list[SimJob], progress: Callable[[str], None] | None,
                  processes: int, available: int | None) -> list[SimRow]:
    rows: list[SimRow | None] = [None] * len(jobs)
    floors = [needs(job) for job in jobs]
    waiting = list(range(len(jobs)))
    workers: list[_Worker] = []
    # (spawned, not forked: this process has threads - a progress display's, say)
    context = multiprocessing.get_context("spawn")
    try:
        while waiting or any(w.job is not None for w in workers):
            busy = [w for w in workers if w.job is not None]
            held = sum(floors[w.job] for w in busy if w.job is not None)
            # the next jobs in order, while a slot is free and their floors fit
            while waiting and len(busy) < processes and (
                    not busy or available is None or held + floors[waiting[0]] <= available):
                idle = next((w for w in workers if w.job is None), None)
                if idle is None:
                    idle = _Worker(context, f"sim-worker-{len(workers)}")
                    workers.append(idle)
                i = waiting.pop(0)
                idle.start(i, jobs[i])
                busy.append(idle)
                held += floors[i]
            if progress is not None:
                done = len(jobs) - len(waiting) - len(busy)
                now = "; ".join(describe(jobs[w.job]) for w in busy if w.job is not None)
                progress(f"simulating {len(busy)} side by side ({done}/{len(jobs)} done): "
                         f"{now}")
            ready = set(connection_wait([w.conn for w in busy]))
            for w in busy:
                if w.conn in ready and w.job is not None:
                    i = w.job
                    rows[i] = w.row(jobs[i])
    finally:  # (what still runs after an error or an interrupt is stopped)
        for w in workers:
            w.stop()
    assert all(row is not None for row in rows)
    return rows  # type: ignore[return-value]
