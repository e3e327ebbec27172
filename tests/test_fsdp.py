"""FSDP2 (fully_shard) under boundedloss.torch.register: the bounded-loss reduce-scatter
and all-gather against Gloo's, under loss, in bfloat16, and across a state_dict. Each
test runs tests/fsdp_ranks.py's ranks over Gloo and real UDP loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard") or not hasattr(fsdp.FSDPModule, "set_custom_all_gather"):
    pytest.skip("this torch's FSDP2 takes no custom collectives (set_custom_all_gather)",
                allow_module_level=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(scenario: str, world: int, dtype: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(HERE / "fsdp_ranks.py"), scenario, str(world), str(_port()),
         dtype], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == world, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize(("world", "dtype"), [(3, "float32"), (2, "bfloat16"), (4, "float32")])
def test_reliable_fsdp_trains_as_gloos_fsdp(world, dtype):
    """The same losses, gradient shards and parameters as Gloo's FSDP2 step for step (a
    wrong reduce-scatter or all-gather shows in them); bfloat16 shards through
    MixedPrecisionPolicy within a rounding; the phase detector sees the full gradient's
    norm. (4 ranks: the halves in two levels, groups of 2.)"""
    _ranks("lossless", world, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lossy_fsdp_averages_what_arrived_and_keeps_the_last_parameters(dtype):
    """10% loss under a 30% bound: each gradient element is the mean over the
    contributions that arrived, each gathered parameter element the current value or the
    last one seen - element by element, on known values."""
    _ranks("lossy", 2, dtype)


def test_fsdp_state_dict_round_trip():
    """A lossy job's state_dict through torch.save/load into a second registration: the
    same counters and memory (the reduce-scatter's alone), and the rounds go on."""
    _ranks("state_dict", 2, "float32")
