"""tools/round_perf.py's reading of perf's samples: what each counts as, and the window
inside the rounds it reads them from (the perf runs themselves are the tool's)."""

from __future__ import annotations

import pytest

from conftest import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("round_perf")


@pytest.mark.parametrize(("comm", "dso", "expected"), [
    ("swapper", "[kernel.kallsyms]", "idle"),
    ("python3", "[kernel.kallsyms]", "kernel"),
    ("gloo_tcp_loop", "[kernel.kallsyms]", "kernel"),
    ("python3", "/usr/lib/libpython3.11.so.1.0", "python"),
    ("python3", "/usr/lib/x86_64-linux-gnu/libcrypto.so.3", "openssl"),
    ("python3", "/usr/lib/x86_64-linux-gnu/libc.so.6", "libc"),
    ("python3", "/venv/numpy/_core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so",
     "numpy"),
    ("python3", "/src/boundedloss/_native.cpython-311-x86_64-linux-gnu.so", "compiled path"),
    ("gloo_tcp_loop", "/venv/torch/lib/libtorch_cpu.so", "torch/gloo"),
    ("python3", "[unknown]", "other"),
])
def test_each_sample_counts_as_its_library(tool, comm, dso, expected):
    assert tool.category(comm, dso) == expected


def test_the_window_lies_inside_the_rounds_and_scales_shares_to_a_round(tool):
    """Set-up (all Python), rounds (kernel 3 : python 1), tear-down (all other): only the
    rounds' samples are read, and their shares times the cores times the round are the
    CPU a round costs."""
    rate = 1000  # samples a second, both cores together
    setup, rounds, mean_ms = 5.0, 400, 25.0
    span = rounds * mean_ms / 1e3
    samples = [(i / rate, "python") for i in range(int(setup * rate))]
    for i in range(int(span * rate)):
        samples.append((setup + i / rate, "kernel" if i % 4 else "python"))
    end = setup + span
    samples += [(end + i / rate, "other") for i in range(int(tool.TEARDOWN_S * rate))]
    ms, (start_before_end, stop_before_end), n = tool.per_round(samples, rounds, mean_ms)
    assert tool.TEARDOWN_S < stop_before_end < start_before_end <= tool.TEARDOWN_S + span
    assert n > 0.7 * span * rate
    assert ms["kernel"] == pytest.approx(0.75 * tool.CORES * mean_ms, rel=0.01)
    assert ms["python"] == pytest.approx(0.25 * tool.CORES * mean_ms, rel=0.01)
    assert ms["other"] == 0 and ms["idle"] == 0


def test_too_short_a_run_for_a_window_is_refused(tool):
    with pytest.raises(SystemExit, match="run more"):
        tool.per_round([(0.0, "kernel"), (1.0, "kernel")], 10, 25.0)


def test_a_window_with_no_samples_is_refused_not_divided_by(tool):
    # (the run's samples all at its end: nothing inside the rounds' window)
    samples = [(100.0 + i / 1000, "kernel") for i in range(100)]
    with pytest.raises(SystemExit, match="no samples"):
        tool.per_round(samples, 400, 25.0)
