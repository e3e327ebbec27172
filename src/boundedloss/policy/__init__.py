"""Loss-tolerance policies: when is a message done enough?"""

from .base import ClosePlan, MessageInfo, Outcome, Policy, min_delivered_for_bound
from .fixed import FixedBoundPolicy
from .reliable import ReliablePolicy

__all__ = [
    "ClosePlan",
    "FixedBoundPolicy",
    "MessageInfo",
    "Outcome",
    "Policy",
    "ReliablePolicy",
    "min_delivered_for_bound",
]
