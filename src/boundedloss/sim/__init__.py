"""Discrete-event simulation of a data-parallel job at scale, running the product's own
core and collectives over a simulated network (``job.py``; a sweep of jobs,
``sweep.py``)."""

from .job import CPU_PRESETS, LIKE_TESTBED, SimJob, SimRow, plan_jobs, run_job
from .sweep import run_sweep

__all__ = ["CPU_PRESETS", "LIKE_TESTBED", "SimJob", "SimRow", "plan_jobs", "run_job",
           "run_sweep"]
