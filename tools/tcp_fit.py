"""TCP's CPU costs for the simulator's baselines (gloo's ring, tcp-ps), fitted to what a
round of gloo's ring costs the whole machine on the kernel testbed.

``tools/round_perf.py`` reads a round's busy CPU, every process together, at several
world sizes. The simulator's charge for a round is linear in the TCP hosts' costs (per
byte sent, per byte taken in, per message - a ring step's send or its receive), so this
simulates the same lossless rounds (``sim --like-testbed``) with one cost at a time
(their charge: ``cpu_ms_per_round``, rounds 2 on) and fits the costs, least squares, to
the measured busy CPU: per byte and per message, and with runs at several MTUs per
segment too (the MTU sets how many segments a byte takes). A round cannot tell sending
from taking in apart; the costs out and in keep the proportion ``tools/tcp_cpu.py``
measured between them on a bulk transfer at the lowest MTU
(``benchmarks/sim-calibration-<MTU>.json``, ``tcp_costs``). Prints the costs and, with
them and with the preset's, each world's charged CPU and round against the testbed's.

    python tools/round_perf.py --systems gloo --ranks 4 --rounds 600 --json p4.json   # 8, 16
    python tools/tcp_fit.py p4.json p8.json p16.json --json tcp-costs.json
    python tools/tcp_fit.py p4.json ... p16-9000.json --json tcp-costs.json   # both MTUs
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

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: rounds simulated a world: the first two (connections opening, windows growing) are
#: left out of the charge by simulating 2 and ROUNDS and taking the difference
ROUNDS = 6


def simulate(ranks: int, costs: CpuCosts, elements: int, mtu: int) -> tuple[float, float]:
    """gloo's ring on the testbed's network and cores: its steady charge (CPU ms per
    round, rounds 2 on) and its median round (ms) with ``costs``."""
    def job(rounds: int):
        return run_job(SimJob(workers=ranks, system="gloo", topology="gloo", loss=0.0,
                              elements=elements, rounds=rounds, mtu=mtu, tcp_costs=costs,
                              **LIKE_TESTBED))
    long_, short = job(ROUNDS), job(2)
    assert long_.cpu_ms_per_round is not None and short.cpu_ms_per_round is not None
    steady = (long_.cpu_ms_per_round * ROUNDS - short.cpu_ms_per_round * 2) / (ROUNDS - 2)
    return steady, long_.p50_ms


def fit_tcp(runs: list[dict]) -> dict:
    """TCP's costs fitted to ``runs`` (``tools/round_perf.py``'s rows; gloo's,
    authenticated, are read): ``{"mtus", "tcp_costs", "preset", "fit"}``, the fit's rows
    (each world's busy CPU and round, the testbed's, the fitted costs' and the preset's)
    printed as they come."""
    # (MTU, world) -> the runs' busy CPU a round, and their p50s
    busy: dict[tuple[int, int], list[float]] = defaultdict(list)
    rounds: dict[tuple[int, int], list[float]] = defaultdict(list)
    elements = 1 << 20
    for row in runs:
        if row["system"] == "gloo" and row["auth"] == "on":
            key = (row.get("mtu", 1500), row["ranks"])
            busy[key].append(row["busy_ms_per_round"])
            rounds[key].append(row["p50_ms"])
    points = sorted(busy)
    mtus = sorted({mtu for mtu, _ in points})
    if not mtus or any(len([p for p in points if p[0] == mtu]) < 2 for mtu in mtus):
        raise SystemExit("need gloo's rows at two world sizes at least (--ranks 4, 16) "
                         "at each MTU")
    # (one MTU: a cost per byte and per message; several: per segment too, which the
    # MTU tells apart from the bytes)
    measured = json.loads((BENCHMARKS / f"sim-calibration-{mtus[0]}.json").read_text())[
        "tcp_costs"]
    out_share = measured["byte_out"] / (measured["byte_out"] + measured["byte_in"])
    units = {"ns a byte": CpuCosts(byte_out=out_share * 1e-9, byte_in=(1 - out_share) * 1e-9),
             "us a message": CpuCosts(message_main=1e-6)}
    if len(mtus) > 1:
        units["us a segment"] = CpuCosts(datagram_out=out_share * 1e-6,
                                         datagram_in=(1 - out_share) * 1e-6)
    a_rows = [[simulate(n, unit, elements, mtu)[0] for unit in units.values()]
              for mtu, n in points]
    y = np.array([np.mean(busy[p]) for p in points])
    solved, *_ = np.linalg.lstsq(np.array(a_rows), y, rcond=None)
    per = dict(zip(units, (float(v) for v in solved)))
    per_segment = per.get("us a segment", 0.0)
    fitted = CpuCosts(byte_out=out_share * per["ns a byte"] * 1e-9,
                      byte_in=(1 - out_share) * per["ns a byte"] * 1e-9,
                      datagram_out=out_share * per_segment * 1e-6,
                      datagram_in=(1 - out_share) * per_segment * 1e-6,
                      message_main=per["us a message"] * 1e-6)
    print("fitted: " + ", ".join(f"{v:.3f} {k}" for k, v in per.items())
          + f" (out {out_share:.0%} of a byte's and a segment's, in the rest)")
    fit = []
    print(f"{'MTU':>5} {'ranks':>5} | {'testbed busy':>12} {'fitted':>7} {'preset':>7} | "
          f"{'testbed p50':>11} {'fitted':>7} {'preset':>7}")
    for (mtu, n), busy_n in zip(points, y):
        (charged, p50), (charged_old, p50_old) = (simulate(n, c, elements, mtu)
                                                  for c in (fitted, MEASURED_TCP_COSTS))
        testbed_p50 = float(np.mean(rounds[(mtu, n)]))
        print(f"{mtu:5d} {n:5d} | {busy_n:12.1f} {charged:7.1f} {charged_old:7.1f} | "
              f"{testbed_p50:11.1f} {p50:7.1f} {p50_old:7.1f}")
        fit.append({"mtu": mtu, "ranks": n, "testbed_busy_ms": float(busy_n),
                    "testbed_p50_ms": testbed_p50, "charged_ms": charged, "p50_ms": p50,
                    "preset_charged_ms": charged_old, "preset_p50_ms": p50_old})
    return {"mtus": mtus, "tcp_costs": dataclasses.asdict(fitted),
            "preset": dataclasses.asdict(MEASURED_TCP_COSTS), "fit": fit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="tools/round_perf.py's JSON files")
    ap.add_argument("--json", type=Path, help="write the costs and the fit here")
    a = ap.parse_args()
    fitted = fit_tcp([row for path in a.runs for row in json.loads(path.read_text())])
    if a.json:
        a.json.write_text(json.dumps({**fitted, "runs": [str(p) for p in a.runs]},
                                     indent=2) + "\n")


if __name__ == "__main__":
    main()
