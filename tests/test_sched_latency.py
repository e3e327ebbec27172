"""tools/sched_latency.py's reading of ``perf sched latency``'s report: the ranks' line,
whichever name their interpreter ran under (the perf runs themselves are the tool's)."""

from __future__ import annotations

import pytest

from conftest import load_tool

REPORT = """
 -----------------------------------------------------------------------------------------
  Task                  |   Runtime ms  | Switches | Avg delay ms    | Max delay ms    |
 -----------------------------------------------------------------------------------------
  gloo_tcp_loop:(4)     |    231.840 ms |      404 | avg:   0.450 ms | max:  10.496 ms |
  {name}:(12)          |  10751.017 ms |     4775 | avg:   1.914 ms | max:  16.003 ms |
  ksoftirqd/0:14        |      0.972 ms |        1 | avg:   0.000 ms | max:   0.000 ms |
"""


@pytest.fixture(scope="module")
def tool():
    return load_tool("sched_latency")


@pytest.mark.parametrize("name", ["python3", "python"])
def test_the_ranks_line_is_read_whichever_their_interpreter_s_name(tool, name):
    assert tool.ranks_latency(REPORT.format(name=name)) == {
        "threads_runtime_ms": 10751.017, "switches": 4775, "avg_wake_delay_ms": 1.914,
        "max_wake_delay_ms": 16.003}


def test_a_report_without_the_ranks_is_an_error(tool):
    with pytest.raises(SystemExit, match="ranks' Python threads"):
        tool.ranks_latency(REPORT.format(name="gloo_other"))
