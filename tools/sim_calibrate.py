"""The simulator against the kernel testbed, row by row, measured in one run.

1. A rank's CPU costs on this machine, now: ``tools/round_cpu.py`` (reliable, the
   transpose allreduce, authenticated, lossless, at the same MTU, at each world size
   of ``--fit-ranks``: 4 and 16 ranks split what a round costs beyond its bytes into
   per posting call and per message) - the one setting the simulator is fitted to -
   and TCP's, for the baselines' hosts (``tools/tcp_cpu.py``: a bulk transfer's cost per
   byte, gloo's lossless ring's per message; ``--tcp-costs``: a ``tools/tcp_fit.py``
   fit's, from a file; ``--fit-tcp``: such a fit made in the run, from gloo's rounds at
   4, 8 and 16 ranks measured with steps 1 and 3 - a fit from another day reads gloo's
   rows as fast as that day's machine was).
2. The testbed's rounds: ``boundedloss bench kernel-loss`` (4 ranks, ``--systems``,
   both topologies, ``--losses``, ``--mtu``).
3. Step 1 again (this machine's speed drifts: the costs are the mean of both, and
   their spread is printed).
4. The same rows simulated: ``sim --like-testbed`` with the costs of steps 1 and 3 -
   and again with the Python core's handling folded into the per-message cost, as the
   model read it before charging each handed datagram (``datagram_core``).

The cores lose time to what the simulation does not run as the preset's
``Interference`` says (``--interference``: another, or ``off``), and our hosts' I/O
thread, woken on busy cores, runs after the preset's wake (``--wake``);
``--fit-interference`` (with ``--again``) draws a grid of interference over the fitted
rows and keeps the one whose p50s and p99s come nearest the testbed's, ``--fit-wake`` a
grid of wakes over reliable's allreduce at 1% (after the interference).

Prints testbed and simulated p50/p99 side by side with their ratios, and writes every
figure (``--json``). Rows other than reliable's lossless allreduce and gloo's lossless
ring are settings the costs (and a fitted interference) were not measured on.

    python tools/sim_calibrate.py --json calibration.json
    python tools/sim_calibrate.py --mtu 9000 --json calibration-9000.json
    python tools/sim_calibrate.py --fit-tcp --json calibration.json   # TCP's costs fitted now
    python tools/sim_calibrate.py --again calibration.json   # simulate its rows again
    python tools/sim_calibrate.py --again calibration.json --fit-interference --fit-wake

(root, or a user namespace of its own, as ``boundedloss testbed``.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import multiprocessing
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
#: the rows the costs are read from (lossless): ours from round_cpu, TCP's from tcp_cpu
FITTED = {("reliable", "allreduce"), ("gloo", "gloo")}


def measure_costs(a: argparse.Namespace, out: Path) -> list[dict]:
    """round_cpu's figures at each of ``--fit-ranks``' world sizes."""
    figures = []
    for ranks in a.fit_ranks:
        path = out.with_name(f"{out.stem}-{ranks}.json")
        subprocess.run([sys.executable, str(TOOLS / "round_cpu.py"), "--system", "reliable",
                        "--topology", "allreduce", "--auth", "on", "--ranks", str(ranks),
                        "--rounds", str(a.cost_rounds), "--elements", str(a.elements),
                        "--mtu", str(a.mtu), "--json", str(path)],
                       check=True, stdout=subprocess.DEVNULL)
        figures.append(json.loads(path.read_text()))
    return figures


def measure_tcp_costs(a: argparse.Namespace, out: Path) -> dict:
    subprocess.run([sys.executable, str(TOOLS / "tcp_cpu.py"), "--rounds", str(a.cost_rounds),
                    "--elements", str(a.elements), "--mtu", str(a.mtu), "--json", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def simulate(testbed: list[dict], costs, a: argparse.Namespace, tcp_costs=None,
             machine: dict | None = None) -> list[dict]:
    """The testbed's rows simulated with ``costs`` (and the TCP baselines' hosts with
    ``tcp_costs``; None: the preset's) and the machine's scheduling as ``machine`` says
    (``interference``, ``wake_s``; None, or left out: the preset's; and the ``barrier``
    and ``seed`` of ``job_for_testbed_row``): each row's figures side by side."""
    from boundedloss.sim import run_job
    from boundedloss.sim.calibration import P50_TOLERANCE, job_for_testbed_row

    rows = []
    print(f"{'system':>9} {'topology':>9} {'loss':>5} | {'testbed p50':>11} {'sim p50':>8} "
          f"{'ratio':>6} | {'testbed p99':>11} {'sim p99':>8} {'ratio':>6}")
    for t in testbed:
        s = run_job(job_for_testbed_row(t["system"], t["topology"], t["loss"],
                                        elements=a.elements, rounds=a.rounds, mtu=a.mtu,
                                        costs=costs, tcp_costs=tcp_costs,
                                        **(machine or {})))
        row = {"system": t["system"], "topology": t["topology"], "loss": t["loss"],
               "testbed_p50_ms": t["p50_ms"], "sim_p50_ms": s.p50_ms,
               "p50_ratio": round(s.p50_ms / t["p50_ms"], 3),
               "testbed_p99_ms": t["p99_ms"], "sim_p99_ms": s.p99_ms,
               "p99_ratio": round(s.p99_ms / t["p99_ms"], 3),
               # (how far apart the ranks entered a round: the testbed's, where its rows
               # have it, and the simulated barrier's)
               "testbed_entry_spread_ms": t.get("entry_spread_ms"),
               "sim_entry_spread_ms": s.entry_spread_ms,
               "fitted": t["loss"] == 0 and (t["system"], t["topology"]) in FITTED}
        rows.append(row)
        print(f"{row['system']:>9} {row['topology']:>9} {row['loss']:>5.0%} | "
              f"{row['testbed_p50_ms']:11.1f} {row['sim_p50_ms']:8.1f} {row['p50_ratio']:6.2f} | "
              f"{row['testbed_p99_ms']:11.1f} {row['sim_p99_ms']:8.1f} {row['p99_ratio']:6.2f}"
              + ("  (fitted)" if row["fitted"] else ""))
    for q in ("p50", "p99"):
        within = sum(abs(r[f"{q}_ratio"] - 1) <= P50_TOLERANCE for r in rows)
        print(f"{q} within {P50_TOLERANCE:.0%}: {within} of {len(rows)}")
    return rows


#: the grid ``--fit-interference`` draws: spells a second on each core, and their mean
#: length (seconds)
FIT_RATES = (5.0, 10.0, 20.0, 40.0)
FIT_MEANS = (1e-3, 2e-3, 3e-3, 4e-3, 6e-3)
#: the grid ``--fit-wake`` draws (seconds), and the row it is fitted on: where a round's
#: replies wait for a woken thread (a loss's recovery), as the costs' row is lossless
FIT_WAKES = (0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1.5e-3, 2e-3)
WAKE_ROW = ("reliable", "allreduce", 0.01)


def fit(what: str, rows: list[dict], grid: list[dict], costs, a: argparse.Namespace,
        tcp_costs, machine: dict) -> dict:
    """Of ``grid`` (each point a ``machine`` setting, over ``machine``'s others), the one
    whose ``rows``' p50s and p99s lie nearest the testbed's (the largest ratio away from
    1, either way, the least); printed. (Virtual time: the grid's points run side by
    side, ``--fit-jobs`` at once.)"""
    points = [{**machine, **point} for point in grid]
    with multiprocessing.get_context("spawn").Pool(a.fit_jobs) as pool:
        results = pool.starmap(_simulate_quietly,
                               [(rows, costs, a, tcp_costs, point) for point in points])
    best, best_off = points[0], math.inf
    for point, simulated in zip(points, results):
        off = max(abs(math.log(r[f"{q}_ratio"])) for r in simulated for q in ("p50", "p99"))
        print(f"{describe(point):>34}: "
              + "  ".join(f"{r['system']} {r['topology']} {r['loss']:.0%} p50 "
                          f"{r['p50_ratio']:.2f} p99 {r['p99_ratio']:.2f}" for r in simulated)
              + f"  | farthest {math.exp(off) - 1:+.1%}")
        if off < best_off:
            best, best_off = point, off
    print(f"fitted {what}: {describe(best)}, its rows' p50s and p99s within "
          f"{math.exp(best_off) - 1:.1%} of the testbed's")
    return best


def fit_machine(testbed: list[dict], costs, a: argparse.Namespace, tcp_costs) -> dict:
    """``--fit-interference`` (on the rows the costs were measured on) and ``--fit-wake``
    (on ``WAKE_ROW``, with the interference found), as asked; the others as given."""
    from boundedloss.net.cpu import Interference

    machine = {"interference": a.interference, "wake_s": a.wake, "barrier": a.barrier,
               "seed": a.seed}
    if a.fit_interference:
        rows = [t for t in testbed if t["loss"] == 0 and (t["system"], t["topology"]) in FITTED]
        machine = fit("interference", rows,
                      [{"interference": Interference(rate, mean)}
                       for rate in FIT_RATES for mean in FIT_MEANS],
                      costs, a, tcp_costs, machine)
    if a.fit_wake:
        rows = [t for t in testbed if (t["system"], t["topology"], t["loss"]) == WAKE_ROW]
        machine = fit("wake", rows, [{"wake_s": w} for w in FIT_WAKES],
                      costs, a, tcp_costs, machine)
    return machine


def _simulate_quietly(*args) -> list[dict]:
    with contextlib.redirect_stdout(io.StringIO()):
        return simulate(*args)


def mean_costs(measured: list, what: str):
    """The mean of the costs measured before and after the testbed's run, printed with
    them (this machine's speed drifts)."""
    from boundedloss.net.cpu import CpuCosts

    mean = CpuCosts(**{f.name: sum(getattr(c, f.name) for c in measured) / len(measured)
                       for f in dataclasses.fields(CpuCosts)})
    print(f"{what} (before, after, used):")
    for f in dataclasses.fields(CpuCosts):
        values = [getattr(c, f.name) for c in (*measured, mean)]
        if any(values):
            unit, scale = ("ns/B", 1e9) if f.name.startswith("byte") else ("us", 1e6)
            print(f"  {f.name:13s} " + "  ".join(f"{scale * v:8.3f}" for v in values)
                  + f" {unit}")
    return mean


def folded(costs):
    """``costs`` as the model read them before ``datagram_core``: the core's handling in
    the per-message cost (the lossless fit hands it one datagram a message)."""
    return dataclasses.replace(costs, message_io=costs.message_io + costs.datagram_core,
                               datagram_core=0.0)


def parse_interference(text: str):
    """``RATE,MEAN_MS``, ``off``, or ``preset`` (None: the preset's)."""
    from boundedloss.net.cpu import Interference

    return None if text == "preset" else Interference.parse(text)


def parse_wake(text: str) -> float | None:
    """``MS`` or ``preset`` (None: the preset's)."""
    from boundedloss.net.cpu import parse_wake_ms

    return None if text == "preset" else parse_wake_ms(text)


def describe(machine: dict) -> str:
    """The machine's scheduling the rows were simulated with (None: the preset's)."""
    from boundedloss.sim.job import CPU_PRESETS, LIKE_TESTBED

    preset = CPU_PRESETS[LIKE_TESTBED["cpu"]]
    spec = machine.get("interference") or preset.interference
    wake = machine.get("wake_s")
    wake = preset.wake_s if wake is None else wake
    barrier = machine.get("barrier", "instant")
    return (f"interference {'none' if spec is None or not spec.active else spec.describe()}, "
            f"wake {wake * 1e3:g} ms, barrier {barrier}, seed {machine.get('seed', 0)}")


#: the world sizes whose gloo rounds ``--fit-tcp`` fits TCP's costs to (tools/tcp_fit.py)
TCP_FIT_RANKS = (4, 8, 16)


def measure_gloo_rounds(a: argparse.Namespace, out: Path) -> list[dict]:
    """``tools/round_perf.py``'s rows for gloo's lossless ring at each of TCP_FIT_RANKS'
    world sizes, at the calibration's MTU: what a round costs the whole machine."""
    rows = []
    for ranks in TCP_FIT_RANKS:
        path = out.with_name(f"{out.stem}-{ranks}.json")
        # (a round takes about as long as the world is large: each run a few seconds,
        # enough for round_perf's window)
        rounds = max(1, a.tcp_fit_rounds * TCP_FIT_RANKS[0] // ranks)
        subprocess.run([sys.executable, str(TOOLS / "round_perf.py"), "--systems", "gloo",
                        "--ranks", str(ranks), "--rounds", str(rounds),
                        "--mtu", str(a.mtu), "--json", str(path)],
                       check=True, stdout=subprocess.DEVNULL)
        rows += json.loads(path.read_text())
    return rows


def main() -> None:
    from boundedloss.sim.barrier import BARRIERS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default="gloo,tcp-ps,reliable,dblp")
    ap.add_argument("--losses", default="0,0.01,0.05")
    ap.add_argument("--mtu", type=int, default=1500,
                    help="the testbed's (bench kernel-loss's default), and the costs'")
    ap.add_argument("--rounds", type=int, default=60, help="testbed and simulated rounds")
    ap.add_argument("--cost-rounds", type=int, default=60)
    ap.add_argument("--fit-ranks", default="4,16", type=lambda v: [int(x) for x in v.split(",")],
                    help="world sizes round_cpu measures at: from two or more, our costs "
                         "split into per posting call and per message")
    ap.add_argument("--elements", type=int, default=1 << 20)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--again", type=Path, metavar="JSON",
                    help="measure nothing: simulate a calibration's testbed rows again with "
                         "its costs (this model's rows, then the per-message reading's)")
    ap.add_argument("--interference", default="preset", type=parse_interference,
                    metavar="RATE,MEAN_MS|off|preset",
                    help="the time the simulated cores lose to work not simulated")
    ap.add_argument("--fit-interference", action="store_true",
                    help="(with --again) fit it to the fitted rows first, then simulate "
                         "every row with it")
    ap.add_argument("--wake", default="preset", type=parse_wake, metavar="MS|preset",
                    help="how long our hosts' I/O thread takes to run once woken on busy "
                         "cores")
    ap.add_argument("--fit-wake", action="store_true",
                    help=f"(with --again) fit it to {' '.join(map(str, WAKE_ROW))} first "
                         "(after the interference, if that is fitted too)")
    ap.add_argument("--barrier", default="instant", choices=list(BARRIERS),
                    help="what the simulated ranks wait at before each round")
    ap.add_argument("--seed", type=int, default=0, help="the simulations' seed")
    ap.add_argument("--tcp-costs", type=Path, metavar="JSON",
                    help="the TCP baselines' hosts' costs from tools/tcp_fit.py's JSON "
                         "(fitted to what gloo's rounds cost the whole machine, at the "
                         "calibration's MTU among others) in place of tools/tcp_cpu.py's "
                         "(with --again: of the calibration's own)")
    ap.add_argument("--fit-tcp", action="store_true",
                    help="fit the TCP baselines' hosts' costs in the run, as --tcp-costs "
                         "would read them: gloo's lossless rounds at 4, 8 and 16 ranks "
                         "(tools/round_perf.py) before and after the testbed's rows, "
                         "fitted by tools/tcp_fit.py - the same hour's, as ours are")
    ap.add_argument("--tcp-fit-rounds", type=int, default=600,
                    help="gloo's rounds at 4 ranks for --fit-tcp (at 8, half; at 16, a "
                         "quarter)")
    ap.add_argument("--recompute-costs", action="store_true",
                    help="(with --again) read our costs again from the calibration's own "
                         "round_cpu figures, as costs_from_round_cpu reads them now")
    ap.add_argument("--preset-costs", action="store_true",
                    help="(with --again) our hosts' and TCP's costs from the simulator's "
                         "this-machine preset (every MTU's) in place of the calibration's "
                         "own")
    ap.add_argument("--no-folded", action="store_true",
                    help="(with --again) simulate the rows once, not again with the "
                         "core's handling folded into the per-message cost")
    ap.add_argument("--fit-jobs", type=int, default=2,
                    help="grid points simulated at once (processes)")
    a = ap.parse_args()
    if a.preset_costs and (a.again is None or a.recompute_costs or a.tcp_costs):
        ap.error("--preset-costs simulates --again's rows with the preset's costs alone")
    if (a.fit_interference or a.fit_wake) and a.again is None:
        ap.error("--fit-interference and --fit-wake read the testbed's rows from --again's "
                 "calibration")
    if a.fit_tcp and (a.again is not None or a.tcp_costs is not None):
        ap.error("--fit-tcp measures TCP's costs in the run: not with --again or --tcp-costs")
    fitted_tcp = None
    if a.tcp_costs is not None:
        fitted = json.loads(a.tcp_costs.read_text())
        mtu = json.loads(a.again.read_text())["mtu"] if a.again is not None else a.mtu
        if mtu not in fitted.get("mtus", [1500]):
            ap.error(f"{a.tcp_costs} holds TCP's costs fitted at MTUs "
                     f"{fitted.get('mtus', [1500])}, not at the calibration's {mtu}")
        fitted_tcp = fitted["tcp_costs"]

    from boundedloss.net.cpu import CpuCosts
    from boundedloss.sim.job import costs_from_round_cpu

    if a.again is not None:
        done = json.loads(a.again.read_text())
        a.mtu, a.rounds, a.elements = done["mtu"], done["rounds"], done["elements"]
        testbed = [{"system": r["system"], "topology": r["topology"], "loss": r["loss"],
                    "p50_ms": r["testbed_p50_ms"], "p99_ms": r["testbed_p99_ms"],
                    "entry_spread_ms": r.get("testbed_entry_spread_ms")}
                   for r in done["rows"]]
        costs = CpuCosts(**done["costs"])
        if a.recompute_costs:
            measured = [costs_from_round_cpu(*f) for f in done["round_cpu"]]
            costs = mean_costs(measured, "costs")
            done = {**done, "costs": dataclasses.asdict(costs),
                    "costs_measured": [dataclasses.asdict(c) for c in measured]}
        tcp_costs = CpuCosts(**done["tcp_costs"]) if "tcp_costs" in done else None
        if fitted_tcp is not None:
            tcp_costs = CpuCosts(**fitted_tcp)
        if a.preset_costs:
            from boundedloss.sim.job import MEASURED_COSTS, MEASURED_TCP_COSTS

            costs, tcp_costs = MEASURED_COSTS, MEASURED_TCP_COSTS
            done = {**done, "costs": dataclasses.asdict(costs),
                    "tcp_costs": dataclasses.asdict(tcp_costs),
                    "costs_from": "the this-machine preset"}
        machine = fit_machine(testbed, costs, a, tcp_costs)
        rows = simulate(testbed, costs, a, tcp_costs, machine)
        rows_folded = None
        if not a.no_folded:
            print("the core's handling folded into the per-message cost:")
            rows_folded = simulate(testbed, folded(costs), a, tcp_costs, machine)
        if a.json:
            a.json.write_text(json.dumps({
                **done, "machine": describe(machine),
                **({} if a.tcp_costs is None else {
                    "tcp_costs": dataclasses.asdict(tcp_costs),
                    "tcp_costs_from": str(a.tcp_costs)}),
                "rows": rows, "rows_folded": rows_folded}, indent=2) + "\n")
        return

    with tempfile.TemporaryDirectory() as tmp:
        before = measure_costs(a, Path(tmp, "cpu1.json"))
        if a.fit_tcp:  # (fitted once gloo's rounds are in before and after)
            gloo_rounds = measure_gloo_rounds(a, Path(tmp, "gloo1.json"))
        elif fitted_tcp is None:
            tcp_before = measure_tcp_costs(a, Path(tmp, "tcp1.json"))
        else:
            tcp_before = tcp_after = {"costs": fitted_tcp, "from": str(a.tcp_costs)}
        subprocess.run([sys.executable, "-m", "boundedloss.cli", "bench", "kernel-loss",
                        "--ranks", "4", "--systems", a.systems, "--topology", "ps,allreduce",
                        "--losses", a.losses, "--rounds", str(a.rounds), "--mtu", str(a.mtu),
                        "--elements", str(a.elements), "--no-bare",
                        "--json", str(Path(tmp, "testbed.json"))],
                       check=True, stdout=subprocess.DEVNULL)
        testbed = json.loads(Path(tmp, "testbed.json").read_text())
        after = measure_costs(a, Path(tmp, "cpu2.json"))
        if a.fit_tcp:  # (one fit to both measurements' rounds: tcp_fit takes their mean)
            gloo_rounds += measure_gloo_rounds(a, Path(tmp, "gloo2.json"))
            from tcp_fit import fit_tcp  # (this script's folder: tools/)

            fit = fit_tcp(gloo_rounds)  # (as --tcp-costs reads tcp_fit's JSON)
            tcp_before = tcp_after = {"costs": fit["tcp_costs"], "from": "fitted in the run",
                                      "fit": fit, "round_perf": gloo_rounds}
        elif fitted_tcp is None:
            tcp_after = measure_tcp_costs(a, Path(tmp, "tcp2.json"))
    measured = [costs_from_round_cpu(*f) for f in (before, after)]
    tcp_measured = [CpuCosts(**f["costs"]) for f in (tcp_before, tcp_after)]
    costs, tcp_costs = mean_costs(measured, "costs"), mean_costs(tcp_measured, "TCP's costs")

    machine = {"interference": a.interference, "wake_s": a.wake, "barrier": a.barrier,
               "seed": a.seed}
    rows = simulate(testbed, costs, a, tcp_costs, machine)
    rows_folded = simulate(testbed, folded(costs), a, tcp_costs, machine)
    if a.json:
        a.json.write_text(json.dumps({
            "mtu": a.mtu, "rounds": a.rounds, "elements": a.elements,
            "machine": describe(machine),
            "costs": dataclasses.asdict(costs),
            "costs_measured": [dataclasses.asdict(c) for c in measured],
            "round_cpu": [before, after],  # (what the costs were read from)
            "tcp_costs": dataclasses.asdict(tcp_costs),
            "tcp_costs_measured": [dataclasses.asdict(c) for c in tcp_measured],
            "tcp_cpu": [tcp_before, tcp_after],
            "rows": rows, "rows_folded": rows_folded}, indent=2) + "\n")


if __name__ == "__main__":
    main()
