"""Loss-tolerance policies: when is a message done enough?

- :class:`ReliablePolicy` - every chunk (the reliable baseline);
- :class:`FixedBoundPolicy` - MLT: at most ``p`` of the message missing;
- :class:`EarlyClosePolicy` - LTP: an adaptive acceptance ratio and deadline;
- :class:`PhaseAwarePolicy` - DBLP: ``p_low`` inside a critical learning regime,
  ``p_low + k`` outside, decided by :class:`CriticalRegimeDetector`.

``policy.importance`` computes MLT's per-chunk critical masks. :func:`make_policy`
builds a policy by name.
"""

from __future__ import annotations

from .base import ClosePlan, MessageInfo, Outcome, Policy, min_delivered_for_bound
from .early_close import EarlyClosePolicy
from .fixed import FixedBoundPolicy
from .importance import (
    DEFAULT_CRITICAL_PATTERNS,
    TensorLayout,
    TensorSpec,
    combine,
    critical_by_layer,
    critical_by_magnitude,
    priority_order,
)
from .phase_aware import (
    CriticalRegimeDetector,
    Phase,
    PhaseAwarePolicy,
    PhaseReason,
    PhaseRecord,
)
from .reliable import ReliablePolicy

#: ``make_policy`` names and the classes they build.
POLICIES: dict[str, type[Policy]] = {
    "reliable": ReliablePolicy,
    "mlt": FixedBoundPolicy,
    "ltp": EarlyClosePolicy,
    "dblp": PhaseAwarePolicy,
}


def make_policy(name: str, **kw) -> Policy:
    """A fresh policy by name: ``reliable``, ``mlt`` (``p=``), ``ltp`` (see
    :class:`EarlyClosePolicy`), ``dblp`` (``p_low=``, ``k=``, ``eta=``,
    ``warmup_epochs=``). Keyword arguments go to the class; a wrong one raises
    ``TypeError``, an unknown name ``ValueError``."""
    key = name.strip().lower() if isinstance(name, str) else name
    cls = POLICIES.get(key)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; valid names: {', '.join(POLICIES)}")
    return cls(**kw)


__all__ = [
    "ClosePlan",
    "CriticalRegimeDetector",
    "DEFAULT_CRITICAL_PATTERNS",
    "EarlyClosePolicy",
    "FixedBoundPolicy",
    "MessageInfo",
    "Outcome",
    "POLICIES",
    "Phase",
    "PhaseAwarePolicy",
    "PhaseReason",
    "PhaseRecord",
    "Policy",
    "ReliablePolicy",
    "TensorLayout",
    "TensorSpec",
    "combine",
    "critical_by_layer",
    "critical_by_magnitude",
    "make_policy",
    "min_delivered_for_bound",
    "priority_order",
]
