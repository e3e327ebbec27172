from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._params import loading
from .base import (
    ClosePlan,
    MessageInfo,
    Policy,
    check_bound,
    min_delivered_for_bound,
    state_values,
)


class FixedBoundPolicy(Policy):
    """MLT's bounded-loss tolerance: done when the missing fraction is at most ``p``.

    ``p`` is agreed before training (per job, or per tensor by giving each message its
    own policy). Critical chunks never count towards the allowed loss: they are named by
    the mask given to ``start_send``/``start_receive`` (see ``policy.importance`` for
    MLT's layer and magnitude priorities), and the receiver waits for every one of them
    whatever ``p``. ``FixedBoundPolicy(p_low)`` is also DBLP's baseline.
    """

    name = "mlt"
    leading_param = "p"

    def __init__(self, p: float = 0.01):
        self.p = check_bound(p, "loss bound p")

    @property
    def bound(self) -> float:
        """The bound every plan gets (for logs)."""
        return self.p

    def plan(self, info: MessageInfo) -> ClosePlan:
        return ClosePlan(min_delivered=min_delivered_for_bound(info, self.p), bound=self.p)

    def describe(self) -> str:
        return f"mlt(p={self.p:g})"

    def state_dict(self) -> dict[str, Any]:
        """Its bound (it learns nothing)."""
        return {"policy": self.name, "p": self.p}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        (p,) = state_values(self, state, "p")
        with loading(self.name):
            self.p = check_bound(p, "loss bound p")
