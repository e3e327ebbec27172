"""The loss-budget guard: a bucket whose network loses more than the policy's bound
tolerates, round after round, is received reliably until the loss falls back.

A bounded policy is a bet that the network loses about its bound or less; when it loses
more, every round pays recovery passes anyway and the gradient runs at the edge of its
budget. The guard watches, per bucket, the loss the network caused: the first pass's
loss (``TransferStats.first_pass_loss``: what had not arrived when the sender had sent
every chunk once), averaged over the round's contributions this rank receives (on a
parameter-server worker, the broadcast if it is stale - its only bounded receive). When
it stays above the policy's bound in force for ``LossGuard.rounds`` rounds in a row, the
collective receives that bucket reliably (every chunk) until a round's loss is back
within the bound. The first pass's loss does not depend on the policy a receive ran
under, so a guarded - reliable - round still measures the network, and the guard
releases when the network recovers.

The guard only picks a policy: the collective shows it each round's loss as soon as the
contributions are in, before posting the bucket's next receives
(``Collective._guard_round``), and asks it which buckets it holds when posting them
(``Collective._receive_policy``); each rank guards its own receives. One warning line
(logger ``boundedloss.collective.guard``) when it engages on a bucket and one when it
releases; ``RoundStats.guarded`` flags the calls it held.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..policy._params import non_negative_int

log = logging.getLogger(__name__)

#: rounds in a row above the bound that engage the guard, unless set
DEFAULT_GUARD_ROUNDS = 3


@dataclass(frozen=True)
class LossGuard:
    """The guard's setting: it engages on a bucket after ``rounds`` rounds in a row whose
    measured loss was above the policy's bound (``rounds=0``: never - the guard is off),
    and releases it on the first round whose loss is within the bound."""

    rounds: int = DEFAULT_GUARD_ROUNDS

    def __post_init__(self) -> None:
        non_negative_int("LossGuard rounds", self.rounds)  # (0: off)

    @property
    def enabled(self) -> bool:
        return self.rounds > 0


#: the guard switched off
NO_GUARD = LossGuard(rounds=0)


@dataclass
class BucketGuard:
    """Where the guard stands on one bucket."""

    above: int = 0  # rounds in a row above the bound, while not guarded
    guarded: bool = False


class LossGuards:
    """The guard's state over one collective's buckets (``owner`` names them in logs)."""

    def __init__(self, setting: LossGuard = NO_GUARD, owner: str = ""):
        self.setting = setting
        self.owner = owner
        self.buckets: dict[int, BucketGuard] = {}

    def holds(self, bucket: int) -> bool:
        """Whether ``bucket``'s receives are to be reliable now."""
        g = self.buckets.get(bucket)
        return g is not None and g.guarded

    def observe(self, bucket: int, round_id: int, loss: float | None,
                bound: float | None) -> None:
        """A round of ``bucket`` measured ``loss`` (None: no receive to measure) while the
        policy's bound in force was ``bound`` (None or 0: nothing to tighten)."""
        if not self.setting.enabled or loss is None or bound is None or bound <= 0.0:
            return
        g = self.buckets.setdefault(bucket, BucketGuard())
        above = loss > bound
        where = f"{self.owner}, bucket {bucket}" if self.owner else f"bucket {bucket}"
        if g.guarded:
            if not above:
                g.guarded, g.above = False, 0
                log.warning("%s: loss %.2f%% within the bound %.2f%% at round %d: "
                            "bounded again", where, 100 * loss, 100 * bound, round_id)
        elif above:
            g.above += 1
            if g.above >= self.setting.rounds:
                g.guarded = True
                log.warning("%s: loss %.2f%% above the bound %.2f%% for %d rounds in a row "
                            "(to round %d): received reliably until it is back within the "
                            "bound", where, 100 * loss, 100 * bound, g.above, round_id)
        else:
            g.above = 0

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[int, dict[str, Any]]:
        """Per bucket, the rounds in a row above the bound and whether it is guarded."""
        return {b: {"above": g.above, "guarded": g.guarded}
                for b, g in sorted(self.buckets.items())}

    def load_state_dict(self, state: Mapping[int, Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s values (``ValueError``, nothing changed, for a
        value that is not one)."""
        buckets = {}
        for b, g in state.items():
            above = non_negative_int(f"guard of bucket {b}: above", g["above"])
            guarded = g["guarded"]
            if not isinstance(guarded, bool):
                raise ValueError(f"guard of bucket {b}: guarded must be a bool, "
                                 f"got {guarded!r}")
            buckets[int(b)] = BucketGuard(above, guarded)
        self.buckets = buckets
