"""Loss-tolerance policies: when is a message done enough?

- :class:`ReliablePolicy` - every chunk (the reliable baseline);
- :class:`FixedBoundPolicy` - MLT: at most ``p`` of the message missing;
- :class:`EarlyClosePolicy` - LTP: an adaptive acceptance ratio and deadline;
- :class:`PhaseAwarePolicy` - DBLP: ``p_low`` inside a critical learning regime,
  ``p_low + k`` outside, decided by :class:`CriticalRegimeDetector`.

``policy.importance`` computes MLT's per-chunk critical masks. :data:`POLICIES` is the
registry of names and :func:`make_policy` builds a policy by name; :func:`parse_policy`
reads a policy as a command line writes it (``mlt:0.01``), and :data:`SYSTEM_NAMES`
adds the systems a run can be compared on that are not a policy of ours (``gloo``,
DDP's own allreduce; ``baseline``, MLT at DBLP's P_low).
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
    DEFAULT_ETA,
    DEFAULT_K,
    DEFAULT_P_LOW,
    DEFAULT_WARMUP_EPOCHS,
    CriticalRegimeDetector,
    Phase,
    PhaseAwarePolicy,
    PhaseReason,
    PhaseRecord,
)
from .registry import POLICIES, make_policy
from .reliable import ReliablePolicy
from .spec import (
    BASELINE,
    GLOO,
    SYSTEM_NAMES,
    TCP_PS,
    TCP_SYSTEMS,
    TCP_TOPOLOGIES,
    PolicySpec,
    parse_policies,
    parse_policy,
)

__all__ = [
    "BASELINE",
    "ClosePlan",
    "CriticalRegimeDetector",
    "DEFAULT_CRITICAL_PATTERNS",
    "DEFAULT_ETA",
    "DEFAULT_K",
    "DEFAULT_P_LOW",
    "DEFAULT_WARMUP_EPOCHS",
    "EarlyClosePolicy",
    "FixedBoundPolicy",
    "GLOO",
    "TCP_PS",
    "TCP_SYSTEMS",
    "TCP_TOPOLOGIES",
    "MessageInfo",
    "Outcome",
    "POLICIES",
    "Phase",
    "PhaseAwarePolicy",
    "PhaseReason",
    "PhaseRecord",
    "Policy",
    "PolicySpec",
    "ReliablePolicy",
    "SYSTEM_NAMES",
    "TensorLayout",
    "TensorSpec",
    "combine",
    "critical_by_layer",
    "critical_by_magnitude",
    "make_policy",
    "min_delivered_for_bound",
    "parse_policies",
    "parse_policy",
    "priority_order",
]
