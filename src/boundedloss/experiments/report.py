"""Plots (matplotlib, Agg) and a Markdown report for `boundedloss compare`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .compare import RunResult, Scenario

PLOTS = {
    "latency": "round_latency.png",
    "cdf": "round_latency_cdf.png",
    "metric": "metric_vs_time.png",
    "bound": "bound_per_epoch.png",
}
SWEEP_PLOT = "metric_vs_loss.png"  # sweep scenarios only


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: Path, grid: bool = True) -> None:
    """The finish every plot shares: light grid, small legend, written and closed."""
    if grid:
        ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _first(runs: dict[str, list[RunResult]]) -> dict[str, RunResult]:
    """The first repeat of each policy (plots show one run per policy)."""
    return {p: rs[0] for p, rs in runs.items() if rs}


def plot_latency(runs: dict[str, list[RunResult]], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    marked = False
    for policy, r in _first(runs).items():
        x = [row["round"] for row in r.rounds]
        y = [row["round_ms"] for row in r.rounds]
        line, = ax.plot(x, y, lw=1, label=policy)
        bx = [row["round"] for row in r.rounds if row["round"] in r.burst]
        by = [row["round_ms"] for row in r.rounds if row["round"] in r.burst]
        ax.scatter(bx, by, color=line.get_color(), marker="x", s=30, zorder=3)
        if not marked:
            for b in sorted(r.burst):
                ax.axvline(b, color="red", alpha=0.15, lw=2)
            marked = True
    ax.plot([], [], color="red", alpha=0.3, lw=2, label="burst round")
    ax.set_yscale("log")
    ax.set_xlabel("training round (iteration)")
    ax.set_ylabel("round latency (slowest rank's step, ms)")
    ax.set_title("Per-round latency; burst rounds marked (x, red bands)")
    _save(plt, fig, ax, path, grid=False)


def plot_cdf(runs: dict[str, list[RunResult]], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, rs in runs.items():
        lat = np.sort(np.concatenate([[row["round_ms"] for row in r.rounds] for r in rs]))
        if lat.size:
            ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("round latency (ms)")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("CDF of round latency (all repeats)")
    _save(plt, fig, ax, path)


def plot_metric(runs: dict[str, list[RunResult]], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    name = "metric"
    for policy, r in _first(runs).items():
        name = r.metric_name
        x = [e["wall_s"] for e in r.epochs]
        y = [e.get(name) for e in r.epochs]
        ax.plot(x, y, marker="o", ms=3, label=policy)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(f"test {name}")
    ax.set_title(f"Test {name} against wall time")
    _save(plt, fig, ax, path)


def plot_bound(runs: dict[str, list[RunResult]], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    from matplotlib.ticker import MaxNLocator

    shaded = False
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ("-", "v"), ("--", "P")]
    for i, (policy, r) in enumerate(_first(runs).items()):
        # the bound in force during epoch e is what the rounds of epoch e logged
        per_epoch: dict[int, tuple] = {}
        for row in r.rounds:
            if "bound" in row:
                per_epoch.setdefault(row["epoch"], (row["bound"], row.get("phase")))
        if not per_epoch:
            continue
        ep = sorted(per_epoch)
        bounds = [per_epoch[e][0] for e in ep]
        ls, mk = styles[i % len(styles)]
        ax.step(ep, bounds, where="mid", ls=ls, marker=mk, ms=6 - i % 3, lw=2 - 0.4 * (i % 3),
                label=policy)
        # the first run with phases (DBLP's) shades its critical regimes
        if not shaded and any(phase is not None for _, phase in per_epoch.values()):
            for e in ep:
                if str(per_epoch[e][1]).lower().startswith("crit"):
                    ax.axvspan(e - 0.5, e + 0.5, color="orange", alpha=0.2, lw=0)
            shaded = True
    if shaded:
        ax.fill_between([], [], color="orange", alpha=0.2, label="CLR (critical, dblp)")
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss bound P in force")
    ax.set_title("Bound in force per epoch (CLR shaded)")
    _save(plt, fig, ax, path)


#: a table column: (row key, header, format spec)
Column = tuple[str, str, str]
Columns = tuple[Column, ...]


def _fmt(v, spec: str) -> str:
    """``v`` formatted by ``spec``; a spec ending in ``x`` marks a ratio (``2.50x``)."""
    if v is None:
        return "-"
    return format(v, spec[:-1]) + "x" if spec.endswith("x") else format(v, spec)


TABLE_COLUMNS: Columns = (
    ("policy", "policy", "s"),
    ("wall_s", "wall s", ".1f"),
    ("time_to_target_s", "time to target s", ".1f"),
    ("tta_speedup_vs_gloo", "time to target vs gloo", ".2f"),
    ("round_ms_p50", "round p50 ms", ".1f"),
    ("round_ms_p99", "round p99 ms", ".1f"),
    ("burst_rounds", "burst rounds", ".0f"),
    ("burst_round_ms_mean", "burst round ms", ".1f"),
    ("burst_over_normal_round", "burst / normal round", ".2f"),
    ("speedup_burst_round_vs_baseline", "burst speedup vs baseline", ".2f"),
    ("speedup_burst_round_outside_clr_vs_baseline", "burst speedup outside CLR", ".2f"),
    ("speedup_burst_comm_outside_clr_vs_baseline", "burst comm speedup outside CLR", ".2f"),
    ("speedup_burst_comm_outside_clr_max_vs_baseline",
     "max single-round comm speedup outside CLR", ".2f"),
    ("burst_over_normal_round_outside_clr", "burst / normal round outside CLR", ".2f"),
    ("clr_epoch_fraction", "epochs in CLR", ".0%"),
    ("time_reduction_vs_baseline", "time reduction vs baseline", "+.1%"),
    ("final_metric", "final metric", ".4f"),
    ("metric_change_vs_reliable", "metric vs reliable", "+.4f"),
    ("delivered_fraction_mean", "delivered", ".4f"),
    ("retransmit_rounds_mean", "retx rounds", ".2f"),
)
#: sweep scenarios: no bursts; the metric against the lossless run, also relative
SWEEP_COLUMNS: Columns = (
    ("policy", "arm", "s"),
    ("wall_s", "wall s", ".1f"),
    ("round_ms_p50", "round p50 ms", ".1f"),
    ("final_metric", "final metric", ".4f"),
    ("metric_change_vs_reliable", "vs lossless", "+.4f"),
    ("metric_rel_change_vs_reliable", "vs lossless (rel)", "+.2%"),
    ("delivered_fraction_mean", "delivered", ".4f"),
    ("retransmit_rounds_mean", "retx rounds", ".2f"),
)
#: sweep scenarios on the kernel network: each arm's random loss as the kernel dropped
#: it, and its round against gloo's at the same loss
KERNEL_SWEEP_COLUMNS: Columns = (
    ("kernel_drop_fraction", "kernel drops", ".2%"),
    ("round_speedup_vs_gloo", "round vs gloo", ".2fx"),
)


#: kernel-testbed runs through a bottleneck (incast): what its queue did
BOTTLENECK_COLUMNS: Columns = (
    ("bottleneck_sent_mb", "sent into server MB", ".1f"),
    ("bottleneck_drop_fraction", "queue drops", ".1%"),
)

#: kernel-testbed runs: how the nodes' TCP recovered its losses (every TCP flow in
#: their namespaces: a TCP arm's gradients, and any arm's small rendezvous traffic)
KERNEL_TCP_COLUMNS: Columns = (
    ("tcp_timeouts", "TCP timeouts", ".0f"),
    ("tcp_timeouts_per_round", "a round", ".2f"),
    ("tcp_loss_probes", "TCP loss probes", ".0f"),
)

#: what the command prints for a policy scenario (the report has every column): first
#: what a user decides on, then the burst figures against the baseline - each table
#: narrow enough for 100 columns
DECISION_COLUMNS: Columns = (
    ("policy", "system", "s"),
    ("wall_s", "wall s", ".1f"),
    ("time_to_target_s", "to target s", ".1f"),
    ("tta_speedup_vs_gloo", "to target vs gloo", ".2fx"),
    ("wall_speedup_vs_gloo", "wall vs gloo", ".2fx"),
    ("final_metric", "final", ".4f"),
    ("metric_change_vs_gloo", "final vs gloo", "+.4f"),
)
BURST_COLUMNS: Columns = (
    ("policy", "policy", "s"),
    ("burst_rounds", "bursts", ".0f"),
    ("normal_round_ms_p50", "round ms", ".1f"),
    ("burst_round_ms_mean", "burst ms", ".1f"),
    ("burst_over_normal_round", "burst/rnd", ".2fx"),
    ("speedup_burst_round_vs_baseline", "vs base", ".2fx"),
    ("speedup_burst_comm_outside_clr_vs_baseline", "comm out CLR", ".2fx"),
    ("speedup_burst_comm_outside_clr_max_vs_baseline", "max", ".2fx"),
    ("time_reduction_vs_baseline", "time vs base", "+.1%"),
)
#: the widest a printed table may be
PRINT_WIDTH = 100


def _has_bottleneck(scenario: Scenario) -> bool:
    return (scenario.network == "kernel" and scenario.kernel is not None
            and scenario.kernel.bottleneck is not None)


def _has_bursts(scenario: Scenario) -> bool:
    if scenario.network == "kernel":
        return scenario.kernel is not None and scenario.kernel.bursts is not None
    return "burst" in scenario.loss


def columns_for(scenario: Scenario) -> Columns:
    """The report's columns (every figure of a row that the scenario has)."""
    if scenario.is_sweep:
        return SWEEP_COLUMNS + (KERNEL_SWEEP_COLUMNS if scenario.network == "kernel" else ())
    cols: Columns = TABLE_COLUMNS
    if not _has_bursts(scenario):
        cols = tuple(c for c in cols if "burst" not in c[0])
    if scenario.target_metric is None:
        cols = tuple(c for c in cols if "target" not in c[0])
    if _has_bottleneck(scenario):
        cols += BOTTLENECK_COLUMNS
    if scenario.network == "kernel":
        cols += KERNEL_TCP_COLUMNS
    return cols


def printed_tables(scenario: Scenario) -> list[tuple[str, Columns]]:
    """``(title, columns)`` of each table the command prints: sweeps their one table;
    policy scenarios what a user decides on, then (with bursts) the burst figures, then
    (through a bottleneck) what its queue did."""
    if scenario.is_sweep:
        if scenario.network != "kernel":
            return [("", SWEEP_COLUMNS)]
        # (within 100 columns: the change in relative terms only, no retransmissions)
        return [("", tuple(c for c in columns_for(scenario) if c[0] not in (
            "metric_change_vs_reliable", "retransmit_rounds_mean")))]
    target = scenario.target_metric
    decide: Columns = DECISION_COLUMNS
    if target is None:
        decide = tuple(c for c in decide if "target" not in c[0])
    tables: list[tuple[str, Columns]] = [("", decide)]
    if _has_bursts(scenario):
        tables.append((f"bursts: against {scenario.baseline}", BURST_COLUMNS))
    if _has_bottleneck(scenario):
        tables.append(("the bottleneck into the server",
                       (("policy", "policy", "s"), ("round_ms_p50", "round p50 ms", ".1f"),
                        *BOTTLENECK_COLUMNS, *KERNEL_TCP_COLUMNS)))
    return tables


def table_cells(row: dict, columns: Columns = TABLE_COLUMNS) -> list[str]:
    """A row's cells; an arm that ran lossless while the others met the loss (a TCP
    arm under in-process loss) says so beside its name."""
    return [_fmt(row.get(k), spec) + (" (lossless)" if k == "policy"
                                       and row.get("ran_lossless") else "")
            for k, _, spec in columns]


def markdown_table(rows: list[dict], columns: Columns) -> list[str]:
    """``rows`` as the lines of a Markdown table of ``columns`` (the arm left-aligned)."""
    return ["| " + " | ".join(h for _, h, _ in columns) + " |",
            "|" + "|".join("---" if k == "policy" else "---:" for k, _, _ in columns) + "|",
            *("| " + " | ".join(table_cells(r, columns)) + " |" for r in rows)]


def plot_metric_vs_loss(rows: list[dict], path: Path) -> None:
    """Final metric against the loss rate, one line per aggregator variant, the
    lossless run as a horizontal reference."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    name = rows[0]["metric_name"] if rows else "metric"
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("loss_rate") is None:
            continue
        if r.get("loss_rate") == 0:
            ax.axhline(r["final_metric"], color="black", ls="--", lw=1, label=r["policy"])
            continue
        key = ("gloo" if r.get("transport_policy") == "gloo" else
               r["aggregator"] + ("+hadamard" if r.get("hadamard") else ""))
        lines.setdefault(key, []).append((r["loss_rate"], r["final_metric"]))
    for key, pts in lines.items():
        pts.sort()
        ax.plot([100 * x for x, _ in pts], [y for _, y in pts], marker="o", label=key)
    ax.set_xlabel("random datagram loss (%)")
    ax.set_ylabel(f"final test {name}")
    ax.set_title(f"Final test {name} against loss, per aggregator")
    _save(plt, fig, ax, path)


def write_report(rows: list[dict], runs: dict[str, list[RunResult]], scenario: Scenario,
                 out_dir: str, command: str, settings: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_latency(runs, out / PLOTS["latency"])
    plot_cdf(runs, out / PLOTS["cdf"])
    plot_metric(runs, out / PLOTS["metric"])
    plot_bound(runs, out / PLOTS["bound"])
    if scenario.is_sweep:
        plot_metric_vs_loss(rows, out / SWEEP_PLOT)
    columns = columns_for(scenario)
    metric = rows[0]["metric_name"] if rows else "metric"
    if scenario.is_sweep:
        ratios = (f"Differences are against the lossless run, `{scenario.reference}` "
                  "(`metric_change_vs_reliable`, absolute and relative)"
                  + ("; a round against gloo's is against gloo at the same loss."
                     if scenario.network == "kernel" else "."))
    else:
        ratios = (f"Ratios are against `{scenario.baseline}` (burst speedup: its mean "
                  "burst-round latency over this policy's; *outside CLR*: the same over "
                  "the burst rounds that fell outside DBLP's critical learning regimes; "
                  "time reduction: 1 - wall / its wall) and the metric change against "
                  f"`{scenario.reference}`.")
    if scenario.network == "kernel":
        where = "Network: the kernel testbed (every system crosses the same links and loss)  "
    else:
        where = ("Network: loss injected in-process at our endpoints (gloo's TCP cannot "
                 "take it and runs lossless)"
                 + (f"; {scenario.network_note}" if scenario.network_note else "") + "  ")
    # (add_ratios gives figures against gloo only where it crossed the same network)
    gloo_ran = any(r.get("transport_policy") == "gloo" or r["policy"] == "gloo" for r in rows)
    against_gloo = any(r.get("gloo_crossed_same_network") for r in rows)
    if gloo_ran and not against_gloo:
        where += ("No figure is given against gloo (its columns are empty): it did not "
                  "cross the same lossy network as the others.  ")
    target = ""
    if scenario.target_metric is not None:
        target = (f"Time to target: training time until the end of the first epoch whose "
                  f"test {metric} reached {scenario.target_metric:g} (an accuracy every "
                  "system reaches)"
                  + ("; its ratio is gloo's time over the system's.  " if against_gloo
                     else ".  "))
    lines = [
        f"# boundedloss compare: {scenario.name}",
        "",
        scenario.full_description,
        "",
        where,
        *([] if scenario.is_sweep or scenario.loss == "none"
          else [f"In-process loss spec: `{scenario.loss}`  "]),
        *([target] if target else []),
        f"Settings: {settings}  ",
        "Round latency is each round's step time (forward, backward, gradient exchange, "
        "optimizer step) on its slowest rank, for every policy alike. Values are medians "
        "over repeats; "
        f"the final metric is test {metric}. {ratios}",
        "",
        *markdown_table(rows, columns),
    ]
    if scenario.is_sweep:
        lines += ["", f"## Final test {metric} against loss", f"![metric vs loss]({SWEEP_PLOT})"]
    lines += [
        "",
        "## Per-round latency (burst rounds marked)",
        f"![per-round latency]({PLOTS['latency']})",
        "",
        "## CDF of round latency",
        f"![round latency CDF]({PLOTS['cdf']})",
        "",
        f"## Test {metric} against wall time",
        f"![metric vs time]({PLOTS['metric']})",
        "",
        "## Bound in force per epoch (CLR shaded)",
        f"![bound per epoch]({PLOTS['bound']})",
        "",
        "## Command",
        "",
        "```",
        command,
        "```",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


#: the sweep over burst frequency: per frequency, each arm's burst figures
SWEEP_FREQUENCY_COLUMNS: Columns = (
    ("burst_every", "burst every N rounds", "d"),
    ("policy", "policy", "s"),
    ("burst_round_ms_mean", "burst round ms", ".1f"),
    ("burst_over_normal_round", "burst / normal round", ".2f"),
    ("speedup_burst_comm_outside_clr_vs_baseline", "burst comm speedup outside CLR (mean)",
     ".2f"),
    ("speedup_burst_comm_outside_clr_max_vs_baseline", "(max)", ".2f"),
    ("time_reduction_vs_baseline", "time reduction vs baseline", "+.1%"),
    ("final_metric", "final metric", ".4f"),
    ("metric_change_vs_reliable", "metric vs reliable", "+.4f"),
)


def write_sweep_report(rows: list[dict], scenario: Scenario, out_dir: str,
                       command: str) -> Path:
    """``sweep.md``: the comparison at each burst frequency (``burst_every`` in every
    row), one line per frequency and arm; each frequency's full report is in its own
    folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# boundedloss compare: {scenario.name}, swept over burst frequency",
        "",
        scenario.full_description,
        "",
        "Each frequency's full report (plots, every column) is in `everyN/report.md`. "
        "Speedups and the time reduction are against the baseline arm of the same "
        "frequency; *outside CLR*: the burst rounds outside DBLP's critical learning "
        "regimes; *(max)*: the largest single-round communication speedup among them.",
        "",
        *markdown_table(rows, SWEEP_FREQUENCY_COLUMNS),
        "", "## Command", "", "```", command, "```", "",
    ]
    path = out / "sweep.md"
    path.write_text("\n".join(lines))
    return path
