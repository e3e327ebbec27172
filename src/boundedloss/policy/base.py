"""What a loss-tolerance policy is, seen from the receiver.

A policy decides *when a message is done enough* - nothing else. When a receive opens,
the receiver asks the policy for a :class:`ClosePlan` (how many chunks must arrive, and
an optional acceptance deadline); the receiver then checks the plan with two integer
comparisons per datagram. When the receive closes, the policy is shown the outcome
(``observe``) so that adaptive policies (LTP's Early Close) can learn from the network
and phase-aware ones (DBLP) can change the bound for the *next* message.

Chunks marked critical (a mask given when the receive is posted, known to both ends)
must always arrive: the bound applies to the normal chunks only.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..wire import CloseReason

if TYPE_CHECKING:
    from .phase_aware import Phase


@dataclass(frozen=True, slots=True)
class MessageInfo:
    """What a policy may know about a message when its receive opens."""

    round_id: int
    message_id: int
    chunk_count: int
    message_bytes: int
    chunk_bytes: int
    critical_count: int = 0


@dataclass(frozen=True, slots=True)
class ClosePlan:
    """The receiver closes as soon as ``min_delivered`` chunks (every critical one among
    them) have arrived, or - with whatever has arrived, if every critical chunk has -
    once ``accept_after`` seconds have passed since the receive opened (or, with
    ``accept_from_first``, since the first datagram of the message arrived: a receive
    posted ahead of its sender does not spend its acceptance time waiting for the
    sender to start). ``bound`` is the missing fraction the plan allows, kept for logs."""

    min_delivered: int
    bound: float
    accept_after: float | None = None
    accept_from_first: bool = False

    def __post_init__(self) -> None:
        if self.min_delivered < 0:
            raise ValueError("min_delivered must be >= 0")
        if self.accept_after is not None and self.accept_after < 0:
            raise ValueError("accept_after must be >= 0")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the policy is told when a receive closes."""

    info: MessageInfo
    delivered: int
    elapsed: float
    close_reason: CloseReason
    retransmit_rounds: int
    #: seconds from the first datagram of the message (DATA or PROBE) to the close;
    #: None when nothing arrived. ``elapsed`` counts from the receive's opening, which
    #: may be long before the sender started (receives posted ahead).
    active: float | None = None


def learns(policy: Policy) -> bool:
    """Whether ``policy`` learns from outcomes (its class has an ``observe`` of its own):
    a receive closed under one that does not builds no Outcome to tell it."""
    return type(policy).observe is not Policy.observe


def min_delivered_for_bound(info: MessageInfo, bound: float) -> int:
    """Chunks needed so that at most ``bound`` of the message is missing.

    Critical chunks always count as delivered when the receive closes, so the bound
    is met whenever this many chunks arrived and every critical one is among them.
    """
    return max(info.critical_count, math.ceil((1.0 - bound) * info.chunk_count - 1e-9))


class Policy(abc.ABC):
    """Decides when a receive is done. Subclasses implement :meth:`plan`.

    The training loop tells every policy about epoch ends and learning-rate changes
    (:meth:`epoch_end`, :meth:`lr_changed`) and reads :attr:`phase` and :attr:`bound`
    for its logs; a policy that does not follow the training phase keeps the defaults
    (nothing learned, no phase)."""

    name: ClassVar[str] = "policy"
    #: the parameter a command line's ``NAME:VALUE`` sets (``mlt:0.01`` is ``p``);
    #: None: the policy takes its parameters as ``NAME:KEY=VALUE`` only
    leading_param: ClassVar[str | None] = None

    @abc.abstractmethod
    def plan(self, info: MessageInfo) -> ClosePlan:
        """The close rule for one message, fixed when its receive opens: a function of
        ``info`` and of the policy's state. Receives posted together of one size share
        the plan asked for the first of them, unless the policy learns (``observe``):
        its state moves only between rounds then (protocol.receiver.ReceiveBatch)."""

    def observe(self, outcome: Outcome) -> None:  # noqa: B027 - optional hook
        """Called once per closed receive; the default learns nothing."""

    def epoch_end(self, grad_norm: float) -> Phase | None:
        """A training epoch ended with gradient L2 norm ``grad_norm``; returns the phase
        of the next epoch, or None for a policy without phases (the default)."""
        return None

    def lr_changed(self) -> None:  # noqa: B027 - optional hook
        """The learning rate changed at this epoch boundary; the default ignores it."""

    @property
    def phase(self) -> Phase | None:
        """The training phase in force (DBLP); None for a policy without phases."""
        return None

    @property
    def bound(self) -> float | None:
        """The missing fraction the next planned message may have, for logs; None
        when the policy has no single bound ahead of a message."""
        return None

    def describe(self) -> str:
        return self.name

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this policy, as plain values (numbers, strings,
        lists, dicts - what ``torch.save`` writes and ``torch.load(weights_only=True)``
        reads): its name, its parameters and what it has learned. This one has
        neither; a policy that has overrides both this and :meth:`load_state_dict`."""
        return {"policy": self.name}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned - all of it, or nothing and a
        one-line ``ValueError`` (another policy's state_dict, a key missing or unknown,
        a value refused)."""
        state_values(self, state)


def state_values(policy: Policy, state: Mapping[str, Any], *keys: str) -> list[Any]:
    """The values of ``keys`` in ``state``, which must be a state_dict of ``policy``'s
    kind with exactly those keys; else a one-line ``ValueError`` that says which
    policy's it is, or which keys are missing or unknown."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a {policy.name} state_dict is a dict, got {type(state).__name__}")
    name = state.get("policy")
    if name != policy.name:
        raise ValueError(f"state_dict of policy {name!r} cannot be loaded into {policy.name!r}")
    missing = [k for k in keys if k not in state]
    unknown = sorted(set(state) - {"policy", *keys})
    if missing or unknown:
        raise ValueError(f"{policy.name} state_dict: "
                         + "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                                     + ([f"unknown {', '.join(unknown)}"] if unknown else [])))
    return [state[k] for k in keys]


def check_bound(p: float, what: str = "bound") -> float:
    if not (0.0 <= p < 1.0) or math.isnan(p):
        raise ValueError(f"{what} must be a fraction in [0, 1), got {p!r}")
    return float(p)
