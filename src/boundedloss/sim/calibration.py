"""The simulator against the kernel testbed (``tools/sim_calibrate.py``, and its case in
CI, ``tests/test_sim_calibration.py``): a testbed row as ``sim --like-testbed``
simulates it, and how near its p50 should come."""

from __future__ import annotations

from ..experiments.compare import SCENARIOS
from ..net.cpu import CpuCosts, Interference
from .job import LIKE_TESTBED, LIKE_TESTBED_MTU, SimJob

#: how far a simulated round's p50 may lie from the testbed's, as a share of the testbed's
P50_TOLERANCE = 0.15

#: ``compare --scenario incast --network kernel``: its ranks around a parameter server,
#: the tbf on the switch port into the server, and a push of the digits MLP's 85,002
#: parameters (the model's default hidden width)
INCAST = SCENARIOS["incast"]
INCAST_ELEMENTS = 85_002


def job_for_testbed_row(system: str, topology: str, loss: float, *, elements: int,
                        rounds: int, mtu: int, costs: CpuCosts,
                        tcp_costs: CpuCosts | None = None,
                        interference: Interference | None = None,
                        wake_s: float | None = None, barrier: str = "instant",
                        seed: int = 0) -> SimJob:
    """The job that simulates one of ``bench kernel-loss``'s rows (4 ranks, as the
    calibration runs it) on the testbed's network and cores, charging ``costs`` (a
    calibration's own measurement) instead of the preset's, the TCP baselines'
    hosts ``tcp_costs`` (None: the preset's), the cores losing ``interference`` and our
    hosts' I/O thread woken on busy cores after ``wake_s`` (None: the preset's), the
    ranks waiting at ``barrier`` before each round (``sim.barrier.BARRIERS``)."""
    return SimJob(workers=4, system=system, topology=topology, loss=loss, elements=elements,
                  rounds=rounds, mtu=mtu, cpu_costs=costs, tcp_costs=tcp_costs,
                  cpu_interference=interference, cpu_wake_s=wake_s, barrier=barrier,
                  seed=seed, **LIKE_TESTBED)


def job_for_incast(system: str, *, rounds: int, credit_bytes: int | None) -> SimJob:
    """The job that simulates a ``compare --scenario incast --network kernel`` arm:
    ``sim --like-testbed`` with the scenario's ranks, push and bottleneck (the testbed's
    rounds also hold a training step, about 16 ms of them, which the job does not)."""
    assert INCAST.kernel is not None
    return SimJob(workers=INCAST.workers, system=system, topology=INCAST.topology, loss=0.0,
                  elements=INCAST_ELEMENTS, rounds=rounds, mtu=LIKE_TESTBED_MTU,
                  bottleneck=INCAST.kernel.bottleneck, credit_bytes=credit_bytes,
                  **LIKE_TESTBED)
