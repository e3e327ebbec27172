"""TCP's CPU costs for the simulator's baselines (gloo's ring, tcp-ps), fitted to what a
round of gloo's ring costs the whole machine on the kernel testbed.

``tools/round_perf.py`` reads a round's busy CPU, every process together, at several
world sizes. The simulator's charge for a round is linear in the TCP hosts' costs (per
byte sent, per byte taken in, per message - a ring step's send or its receive), so this
simulates the same lossless rounds (``sim --like-testbed``) with one cost at a time
(their charge: ``cpu_ms_per_round``, rounds 2 on) and fits the costs, least squares, to
the measured busy CPU. A round cannot tell sending from taking in apart; the two per-byte
costs keep the proportion ``tools/tcp_cpu.py`` measured between them on a bulk transfer
(``benchmarks/sim-calibration-1500.json``, ``tcp_costs``). Prints the costs and, with
them and with the preset's, each world's charged CPU and round against the testbed's.

    python tools/round_perf.py --systems gloo --ranks 4 --rounds 600 --json p4.json   # 8, 16
    python tools/tcp_fit.py p4.json p8.json p16.json --json tcp-costs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from boundedloss.net.cpu import CpuCosts
from boundedloss.sim.job import LIKE_TESTBED, MEASURED_TCP_COSTS, SimJob, run_job

CALIBRATION = Path(__file__).resolve().parents[1] / "benchmarks" / "sim-calibration-1500.json"
#: rounds simulated a world: the first two (connections opening, windows growing) are
#: left out of the charge by simulating 2 and ROUNDS and taking the difference
ROUNDS = 6


def simulate(ranks: int, costs: CpuCosts, elements: int) -> tuple[float, float]:
    """gloo's ring on the testbed's network and cores: its steady charge (CPU ms per
    round, rounds 2 on) and its median round (ms) with ``costs``."""
    def job(rounds: int):
        return run_job(SimJob(workers=ranks, system="gloo", topology="gloo", loss=0.0,
                              elements=elements, rounds=rounds, mtu=1500, tcp_costs=costs,
                              **LIKE_TESTBED))
    long_, short = job(ROUNDS), job(2)
    assert long_.cpu_ms_per_round is not None and short.cpu_ms_per_round is not None
    steady = (long_.cpu_ms_per_round * ROUNDS - short.cpu_ms_per_round * 2) / (ROUNDS - 2)
    return steady, long_.p50_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="tools/round_perf.py's JSON files")
    ap.add_argument("--json", type=Path, help="write the costs and the fit here")
    a = ap.parse_args()
    busy: dict[int, list[float]] = defaultdict(list)
    rounds: dict[int, list[float]] = defaultdict(list)
    elements = 1 << 20
    for path in a.runs:
        for row in json.loads(path.read_text()):
            if row["system"] == "gloo" and row["auth"] == "on":
                busy[row["ranks"]].append(row["busy_ms_per_round"])
                rounds[row["ranks"]].append(row["p50_ms"])
    worlds = sorted(busy)
    if len(worlds) < 2:
        raise SystemExit("need gloo's rows at two world sizes at least (--ranks 4, 16)")
    measured = json.loads(CALIBRATION.read_text())["tcp_costs"]
    out_share = measured["byte_out"] / (measured["byte_out"] + measured["byte_in"])
    units = {"per byte (ns, out and in)": CpuCosts(byte_out=out_share * 1e-9,
                                                   byte_in=(1 - out_share) * 1e-9),
             "per message (us)": CpuCosts(message_main=1e-6)}
    a_rows = [[simulate(n, unit, elements)[0] for unit in units.values()] for n in worlds]
    y = np.array([np.mean(busy[n]) for n in worlds])
    (per_byte, per_message), *_ = np.linalg.lstsq(np.array(a_rows), y, rcond=None)
    fitted = CpuCosts(byte_out=out_share * per_byte * 1e-9,
                      byte_in=(1 - out_share) * per_byte * 1e-9,
                      message_main=per_message * 1e-6)
    print(f"fitted: {per_byte:.3f} ns a byte (out {fitted.byte_out * 1e9:.3f}, in "
          f"{fitted.byte_in * 1e9:.3f}), {per_message:.1f} us a message")
    fit = []
    print(f"{'ranks':>5} | {'testbed busy':>12} {'fitted':>7} {'preset':>7} | "
          f"{'testbed p50':>11} {'fitted':>7} {'preset':>7}")
    for n, busy_n in zip(worlds, y):
        (charged, p50), (charged_old, p50_old) = (simulate(n, c, elements)
                                                  for c in (fitted, MEASURED_TCP_COSTS))
        testbed_p50 = float(np.mean(rounds[n]))
        print(f"{n:5d} | {busy_n:12.1f} {charged:7.1f} {charged_old:7.1f} | "
              f"{testbed_p50:11.1f} {p50:7.1f} {p50_old:7.1f}")
        fit.append({"ranks": n, "testbed_busy_ms": float(busy_n), "testbed_p50_ms": testbed_p50,
                    "charged_ms": charged, "p50_ms": p50, "preset_charged_ms": charged_old,
                    "preset_p50_ms": p50_old})
    if a.json:
        a.json.write_text(json.dumps({"tcp_costs": dataclasses.asdict(fitted),
                                      "preset": dataclasses.asdict(MEASURED_TCP_COSTS),
                                      "runs": [str(p) for p in a.runs], "fit": fit},
                                     indent=2) + "\n")


if __name__ == "__main__":
    main()
