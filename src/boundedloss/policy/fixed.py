from __future__ import annotations

from .base import ClosePlan, MessageInfo, Policy, check_bound, min_delivered_for_bound


class FixedBoundPolicy(Policy):
    """MLT's bounded-loss tolerance: done when the missing fraction is at most ``p``.

    ``p`` is agreed before training (per job, or per tensor by giving each message its
    own policy). Critical chunks never count towards the allowed loss.
    """

    name = "mlt"

    def __init__(self, p: float = 0.01):
        self.p = check_bound(p, "loss bound p")

    def plan(self, info: MessageInfo) -> ClosePlan:
        return ClosePlan(min_delivered=min_delivered_for_bound(info, self.p), bound=self.p)

    def describe(self) -> str:
        return f"mlt(p={self.p:g})"
