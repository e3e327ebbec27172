"""`boundedloss sim --plot`: round time against the number of workers, log-log, one
panel per loss (rate or model) and background, a line per system and topology: a colour
per system, a marker per topology, p50 solid and p99 dashed, named once in a legend
beside the panels (a sweep of every system and topology has fourteen lines)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..experiments.report import _plt
from .job import SimRow

#: inches a panel takes, and the legend's column beside them
PANEL_WIDTH_IN = 5.5
LEGEND_WIDTH_IN = 2.4
_MARKERS = {"allreduce": "o", "two-level": "s", "ps": "^", "gloo": "D"}


def _network(r: SimRow) -> tuple[str, float, str]:
    """What a panel holds: the rows of one loss and one background."""
    return r.loss_model, r.loss, r.background


def arm_style(systems: Sequence[str], system: str, topology: str) -> dict[str, str]:
    """How an arm's lines look: its system's colour (``systems``: every system drawn, in
    order) and its topology's marker."""
    return {"color": f"C{systems.index(system) % 10}", "marker": _MARKERS.get(topology, "v")}


def plot_scaling(rows: Sequence[SimRow], path: Path) -> None:
    plt = _plt()
    networks = sorted({_network(r) for r in rows})
    arms = sorted({(r.system, r.topology) for r in rows})
    systems = sorted({system for system, _ in arms})
    width = PANEL_WIDTH_IN * len(networks)
    fig, axes = plt.subplots(1, len(networks), figsize=(width + LEGEND_WIDTH_IN, 4.2),
                             squeeze=False)
    handles: dict[str, Any] = {}  # (label -> its p50 line, for the legend)
    for ax, network in zip(axes[0], networks):
        for system, topology in arms:
            mine = sorted((r for r in rows if (r.system, r.topology, *_network(r))
                           == (system, topology, *network)), key=lambda r: r.workers)
            if not mine:
                continue
            n = [r.workers for r in mine]
            style = arm_style(systems, system, topology)
            (line,) = ax.plot(n, [r.p50_ms for r in mine], "-", **style)
            ax.plot(n, [r.p99_ms for r in mine], "--", alpha=0.55, markerfacecolor="none",
                    **style)
            handles.setdefault(f"{system} ({topology})", line)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_ylabel("round ms (virtual): p50 solid, p99 dashed")
        background = f", background {network[2]}" if network[2] else ""
        ax.set_title((network[0] or f"{network[1]:.1%} random loss") + background,
                     fontsize=10)
        ax.grid(alpha=0.3, which="both")
    total = width + LEGEND_WIDTH_IN
    fig.tight_layout(rect=(0, 0, width / total, 1))
    fig.legend(list(handles.values()), list(handles), loc="center left",
               bbox_to_anchor=(width / total, 0.5), fontsize=8, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
