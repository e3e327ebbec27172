"""The simulator against the kernel testbed (``tools/sim_calibrate.py``, and its case in
CI, ``tests/test_sim_calibration.py``): a testbed row as ``sim --like-testbed``
simulates it, and how near its p50 should come."""

from __future__ import annotations

from ..net.cpu import CpuCosts
from .job import LIKE_TESTBED, SimJob

#: how far a simulated round's p50 may lie from the testbed's, as a share of the testbed's
P50_TOLERANCE = 0.15


def job_for_testbed_row(system: str, topology: str, loss: float, *, elements: int,
                        rounds: int, mtu: int, costs: CpuCosts,
                        tcp_costs: CpuCosts | None = None) -> SimJob:
    """The job that simulates one of ``bench kernel-loss``'s rows (4 ranks, as the
    calibration runs it) on the testbed's network and cores, charging ``costs`` (a
    calibration's own measurement) instead of the preset's, and the TCP baselines'
    hosts ``tcp_costs`` (None: the preset's)."""
    return SimJob(workers=4, system=system, topology=topology, loss=loss, elements=elements,
                  rounds=rounds, mtu=mtu, cpu_costs=costs, tcp_costs=tcp_costs,
                  **LIKE_TESTBED)
