"""What a framework test's ranks report of their hook state (lightning_ranks.py,
accelerate_ranks.py): one place, so both tests read the same fields."""

from __future__ import annotations


def hook_record(state) -> dict:
    """A rank's hook counters and DBLP's decisions, as plain JSON values."""
    log = state.round_log
    return {
        "epoch": state.epoch,
        "rounds": {str(b): n for b, n in state.rounds.items()},
        "logged_rounds": len(log),
        "partial_rounds": sum(e["delivered_fraction"] < 1.0 for e in log),
        "history": [{"grad_norm": r.grad_norm, "phase": r.phase.value, "reason": r.reason}
                    for r in state.policy.history],
        "world_size": state.world_size,
    }
