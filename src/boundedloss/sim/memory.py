"""How much memory a simulated job needs at least, and whether this machine has it.

The simulator holds every rank of a job in one process: the job's gradient (one, which
every rank sends), each rank's receive buffers and result of a round and of the next
(posted ahead), the collective's memory, and a Python object or three for every message
it has open. A sweep that does not fit is stopped before it starts, rather than killed
by the kernel minutes in.

The estimate is a floor, under the peak of every job measured (``boundedloss sim``'s
peak RSS at 16 to 1,024 workers, 64 KB to 4 MB gradients, each topology: the runs are in
``tests/test_sim_memory.py``, which holds the floor under each): so a job it refuses
would not have fitted, and one it lets through may still not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..collective.two_level import messages_per_round
from ..policy import TCP_TOPOLOGIES

#: the interpreter, numpy and the simulator before any rank (a 2-worker run's peak)
BASE_BYTES = 46_000_000
#: a rank's gradient's bytes, this many times over at least: the round's contributions
#: and its result (which the gather's receives write into in place), the next round's
#: (posted ahead), what the collective remembers (the gradient itself is one for the
#: whole job, which every rank sends from)
VECTOR_COPIES = {"ps": 1.0, "allreduce": 1.4, "two-level": 1.4}
#: a send's or a receive's Python objects, its future and its small buffers
MESSAGE_BYTES = 2_000


@dataclass(frozen=True)
class MemoryShortfall:
    """A job that needs more than is available: what it is, and both figures."""

    workers: int
    topology: str
    elements: int
    needs: int
    available: int

    def message(self) -> str:
        return (f"{self.workers:,} workers exchanging {self.elements * 4 / 1e6:,.1f} MB "
                f"({self.topology}) need at least {self.needs / 1e9:,.1f} GB of memory, "
                f"and {self.available / 1e9:,.1f} GB is available: fewer --workers or "
                "smaller --elements")


def messages_per_rank(topology: str, workers: int, posts_ahead: bool = True) -> int:
    """The sends and receives a rank holds in a round, and the next round's receives
    where its last round posts them (``posts_ahead``; a one-round job without CPU costs
    posts none: ``SimJob.posts_ahead_in_last_round``); a parameter server's averaged
    over its ranks."""
    # (a round's sends and receives, and the next round's receives)
    times = 3 if posts_ahead else 2
    if topology == "ps":
        return 2 * times  # (the server times x 2(N - 1), a worker times x 2: about so)
    if topology == "two-level":
        return times * messages_per_round(workers)
    return times * 2 * (workers - 1)


def job_floor(system: str, topology: str, workers: int, elements: int,
              posts_ahead: bool = True) -> int:
    """Bytes a job needs at least (the baselines over the TCP model move no gradient:
    the process's own); ``posts_ahead``: its last round posts the next round's receives
    (``messages_per_rank``)."""
    if system in TCP_TOPOLOGIES:
        return BASE_BYTES
    per_rank = (VECTOR_COPIES[topology] * 4 * elements
                + MESSAGE_BYTES * messages_per_rank(topology, workers, posts_ahead))
    return int(BASE_BYTES + 4 * elements + workers * per_rank)


def needs(job) -> int:
    """Bytes the SimJob ``job`` needs at least (job_floor, for its settings)."""
    return job_floor(job.system, job.topology, job.workers, job.elements,
                     job.rounds > 1 or job.posts_ahead_in_last_round())


def available_bytes() -> int | None:
    """Memory available to a new process here (``MemAvailable``; None where the kernel
    does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def shortfall(jobs: Sequence, available: int | None = None) -> MemoryShortfall | None:
    """The job of ``jobs`` (SimJobs) that most exceeds the memory available, if any."""
    available = available_bytes() if available is None else available
    if available is None:
        return None
    most, worst = max(((needs(j), j) for j in jobs), key=lambda pair: pair[0],
                      default=(0, None))
    if worst is None or most <= available:
        return None
    return MemoryShortfall(worst.workers, worst.topology, worst.elements, most, available)
