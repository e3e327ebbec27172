"""`boundedloss sim --plot`: round time against the number of workers, log-log, one
panel per loss (rate or model) and background, a line per system and topology (p50
solid, p99 dashed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..experiments.report import _plt
from .job import SimRow


def _network(r: SimRow) -> tuple[str, float, str]:
    """What a panel holds: the rows of one loss and one background."""
    return r.loss_model, r.loss, r.background


def plot_scaling(rows: Sequence[SimRow], path: Path) -> None:
    plt = _plt()
    networks = sorted({_network(r) for r in rows})
    fig, axes = plt.subplots(1, len(networks), figsize=(5.5 * len(networks), 4.2),
                             squeeze=False)
    for ax, network in zip(axes[0], networks):
        arms = sorted({(r.system, r.topology) for r in rows if _network(r) == network})
        for i, (system, topology) in enumerate(arms):
            mine = sorted((r for r in rows if (r.system, r.topology, *_network(r))
                           == (system, topology, *network)), key=lambda r: r.workers)
            n = [r.workers for r in mine]
            color = f"C{i % 10}"
            ax.plot(n, [r.p50_ms for r in mine], "o-", color=color,
                    label=f"{system} ({topology}) p50")
            ax.plot(n, [r.p99_ms for r in mine], "x--", color=color, alpha=0.6,
                    label=f"{system} ({topology}) p99")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_ylabel("round ms (virtual)")
        background = f", background {network[2]}" if network[2] else ""
        ax.set_title((network[0] or f"{network[1]:.1%} random loss") + background,
                     fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
