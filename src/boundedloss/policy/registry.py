"""The policy registry: every name a policy is known by, and the one way to build one."""

from __future__ import annotations

from typing import Any

from .base import Policy
from .early_close import EarlyClosePolicy
from .fixed import FixedBoundPolicy
from .phase_aware import PhaseAwarePolicy
from .reliable import ReliablePolicy

#: ``make_policy`` names and the classes they build.
POLICIES: dict[str, type[Policy]] = {
    "reliable": ReliablePolicy,
    "mlt": FixedBoundPolicy,
    "ltp": EarlyClosePolicy,
    "dblp": PhaseAwarePolicy,
}


def make_policy(name: str, **kw: Any) -> Policy:
    """A fresh policy by name: ``reliable``, ``mlt`` (``p=``), ``ltp`` (see
    :class:`EarlyClosePolicy`), ``dblp`` (``p_low=``, ``k=``, ``eta=``,
    ``warmup_epochs=``). Keyword arguments go to the class; a wrong one raises
    ``TypeError``, an unknown name ``ValueError``."""
    key = name.strip().lower() if isinstance(name, str) else name
    cls = POLICIES.get(key)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; valid names: {', '.join(POLICIES)}")
    return cls(**kw)
