"""DBLP: a loss bound that follows the training phase.

Training alternates between *critical learning regimes* (CLR: early training, right
after a learning-rate change - where missing gradient hurts accuracy) and the rest.
Inside a CLR the bound is ``p_low``; outside it is ``p_low + k``. The regime is decided
once per epoch by :class:`CriticalRegimeDetector` from the gradient L2 norm (as in
Accordion, MLSys'21). The same protocol with the bound fixed at ``p_low`` in every
phase - DBLP's baseline - is simply ``FixedBoundPolicy(p_low)``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._params import (
    Configurable,
    Param,
    all_or_nothing,
    fraction_closed_open,
    loading,
    non_negative,
    non_negative_int,
    optional_float,
    positive,
)
from .base import ClosePlan, MessageInfo, Policy, min_delivered_for_bound, state_values

#: DBLP's reported operating point: the bound inside a critical learning regime, and
#: what is added to it outside one
DEFAULT_P_LOW = 0.008
DEFAULT_K = 0.40
#: the detector's defaults: a 50% change of the gradient norm flags a critical regime,
#: and epoch 0 (before any boundary) is one
DEFAULT_ETA = 0.5
DEFAULT_WARMUP_EPOCHS = 1


def _high(p_low: float, k: float) -> float:
    return round(p_low + k, 12)


class Phase(enum.Enum):
    CRITICAL = "critical"  # inside a critical learning regime: the tight bound
    RELAXED = "relaxed"  # outside: the loose bound


class PhaseReason(enum.StrEnum):
    """Why a phase was chosen (a ``str``, so it logs as plain text)."""

    WARMUP = "warmup"  # one of the first ``warmup_epochs`` epochs
    LR_CHANGE = "lr_change"  # the learning rate changed at this epoch boundary
    GRAD_NORM_CHANGE = "grad_norm_change"  # |norm - prev| / prev >= eta
    STEADY = "steady"  # none of the above


@dataclass(frozen=True, slots=True)
class PhaseRecord:
    """One epoch-boundary decision, for the run's log.

    ``epoch`` is the epoch that just ended (0-based) and ``grad_norm`` its gradient
    norm; ``phase`` and ``bound`` are what is in force from this boundary on, i.e. for
    epoch ``epoch + 1``."""

    epoch: int
    grad_norm: float
    relative_change: float | None  # None at the first boundary (nothing to compare)
    phase: Phase
    bound: float
    reason: PhaseReason

    def as_dict(self) -> dict[str, Any]:
        """Plain values (the enums as their strings), for a checkpoint or a log."""
        return {"epoch": self.epoch, "grad_norm": self.grad_norm,
                "relative_change": self.relative_change, "phase": self.phase.value,
                "bound": self.bound, "reason": self.reason.value}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PhaseRecord:
        return cls(epoch=non_negative_int("epoch", d["epoch"]),
                   grad_norm=non_negative("grad_norm", d["grad_norm"]),
                   relative_change=_optional_change(d["relative_change"]),
                   phase=Phase(d["phase"]), bound=fraction_closed_open("bound", d["bound"]),
                   reason=PhaseReason(d["reason"]))


def _optional_change(value: Any) -> float | None:
    """A relative change of the gradient norm: None (no previous norm), or >= 0 -
    infinity included (a change from a norm of 0)."""
    change = optional_float(value)
    if change is not None and not change >= 0.0:
        raise ValueError(f"relative_change must be >= 0, got {value!r}")
    return change


class CriticalRegimeDetector(Configurable):
    """Decides, at each epoch boundary, whether the next epoch is critical.

    Epochs are numbered from 0; ``epoch_end(norm)`` is called once at the end of each,
    with that epoch's gradient L2 norm, and returns the phase of the *next* epoch. The
    next epoch ``e`` is CRITICAL when (the first that holds is the ``reason``):

    1. ``e < warmup_epochs`` (WARMUP) - epoch 0 is the phase before any boundary, so
       with the default ``warmup_epochs = 1`` exactly epoch 0 is critical by warmup;
    2. :meth:`lr_changed` was called since the previous boundary (LR_CHANGE);
    3. ``|norm - prev| / prev >= eta`` with ``prev`` the previous epoch's norm
       (GRAD_NORM_CHANGE; ``prev = 0`` gives 0 if ``norm = 0``, else infinity;
       the first boundary has no ``prev`` and no change);

    and RELAXED (STEADY) otherwise. Call :meth:`lr_changed` *before* the
    :meth:`epoch_end` of the boundary at which the learning rate changes (step the
    scheduler, see that the rate moved, then ``lr_changed()`` then ``epoch_end()``), so
    that the first epoch trained at the new rate is critical.
    """

    eta = Param(positive, "relative change of the gradient norm that flags a CLR")
    warmup_epochs = Param(non_negative_int, "the first this many epochs are critical")

    def __init__(self, eta: float = DEFAULT_ETA, warmup_epochs: int = DEFAULT_WARMUP_EPOCHS):
        self.eta = eta
        self.warmup_epochs = warmup_epochs
        self.reset()
        self._finish_params()

    def reset(self) -> None:
        """Back to before epoch 0."""
        self.epoch = 0  # the epoch now being trained (= boundaries seen so far)
        self.last_norm: float | None = None
        self.relative_change: float | None = None  # at the last boundary
        self._lr_pending = False
        self._initial_phase()

    def _initial_phase(self) -> None:
        if self.warmup_epochs > 0:
            self.phase, self.reason = Phase.CRITICAL, PhaseReason.WARMUP
        else:
            self.phase, self.reason = Phase.RELAXED, PhaseReason.STEADY

    def _params_changed(self) -> None:
        if self.epoch == 0:  # nothing decided yet: the initial phase follows warmup_epochs
            self._initial_phase()

    @property
    def critical(self) -> bool:
        return self.phase is Phase.CRITICAL

    @property
    def lr_change_pending(self) -> bool:
        return self._lr_pending

    def lr_changed(self) -> None:
        """The learning rate changed: the epoch after the next boundary is critical."""
        self._lr_pending = True

    def epoch_end(self, grad_norm: float) -> Phase:
        """The epoch ended with gradient L2 norm ``grad_norm``: the next epoch's phase."""
        if isinstance(grad_norm, bool):
            raise TypeError("grad_norm must be a number")
        norm = float(grad_norm)
        if not 0.0 <= norm < math.inf:
            raise ValueError(f"grad_norm must be finite and >= 0, got {grad_norm!r}")
        prev = self.last_norm
        if prev is None:
            change = None
        elif prev > 0.0:
            change = abs(norm - prev) / prev
        else:
            change = 0.0 if norm == 0.0 else math.inf
        self.epoch += 1
        self.last_norm = norm
        self.relative_change = change
        if self.epoch < self.warmup_epochs:
            phase, reason = Phase.CRITICAL, PhaseReason.WARMUP
        elif self._lr_pending:
            phase, reason = Phase.CRITICAL, PhaseReason.LR_CHANGE
        elif change is not None and change >= self.eta:
            phase, reason = Phase.CRITICAL, PhaseReason.GRAD_NORM_CHANGE
        else:
            phase, reason = Phase.RELAXED, PhaseReason.STEADY
        self._lr_pending = False
        self.phase, self.reason = phase, reason
        return phase

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Its parameters and where it stands: the epoch, the last norm and change, an
        LR change not yet acted on, the phase in force and why."""
        return {"params": self.params(), "epoch": self.epoch, "last_norm": self.last_norm,
                "relative_change": self.relative_change,
                "lr_change_pending": self._lr_pending, "phase": self.phase.value,
                "reason": self.reason.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (the caller turns errors into one line
        and undoes a partial load: see ``PhaseAwarePolicy.load_state_dict``)."""
        self.configure(**state["params"])
        self.epoch = non_negative_int("epoch", state["epoch"])
        norm = optional_float(state["last_norm"])
        self.last_norm = None if norm is None else non_negative("last_norm", norm)
        self.relative_change = _optional_change(state["relative_change"])
        pending = state["lr_change_pending"]
        if not isinstance(pending, bool):
            raise TypeError(f"lr_change_pending must be a bool, got {pending!r}")
        self._lr_pending = pending
        self.phase, self.reason = Phase(state["phase"]), PhaseReason(state["reason"])

    def __repr__(self) -> str:
        return (f"CriticalRegimeDetector(eta={self.eta:g}, warmup_epochs={self.warmup_epochs}, "
                f"epoch={self.epoch}, phase={self.phase.name})")


class PhaseAwarePolicy(Configurable, Policy):
    """DBLP's bounded loss: bound ``p_low`` inside a critical learning regime, ``p_low +
    k`` outside (defaults 0.8% and 40 percentage points, the reported operating point).

    The policy holds a :class:`CriticalRegimeDetector`; feed it through
    :meth:`epoch_end` (the epoch's gradient L2 norm) and :meth:`lr_changed`. A phase
    change applies to the *next* message planned: ``plan`` reads the phase in force
    when a receive opens, and a receive already open keeps its plan. ``history`` holds
    one :class:`PhaseRecord` per epoch boundary. ``p_low`` and ``k`` are validated
    (each in [0, 1), ``p_low + k < 1``) and may be changed at any time; ``p_high =
    p_low + k`` is rounded to 12 decimals so that the logged bound reads 0.408.
    """

    name = "dblp"
    leading_param = "p_low"

    p_low = Param(fraction_closed_open, "bound inside a critical learning regime")
    k = Param(fraction_closed_open, "added to p_low outside a critical learning regime")

    def __init__(self, p_low: float = DEFAULT_P_LOW, k: float = DEFAULT_K, *,
                 eta: float | None = None,
                 warmup_epochs: int | None = None,
                 detector: CriticalRegimeDetector | None = None):
        if detector is not None and (eta is not None or warmup_epochs is not None):
            raise TypeError("give either a detector or eta/warmup_epochs, not both")
        if detector is None:
            detector = CriticalRegimeDetector(
                eta=DEFAULT_ETA if eta is None else eta,
                warmup_epochs=DEFAULT_WARMUP_EPOCHS if warmup_epochs is None else warmup_epochs,
            )
        self.detector = detector
        self.p_low = p_low
        self.k = k
        self.history: list[PhaseRecord] = []
        self._finish_params()

    def _check_params(self) -> None:
        if not _high(self.p_low, self.k) < 1.0:
            raise ValueError(f"p_low + k must be < 1, got {self.p_low} + {self.k}")

    # ------------------------------------------------------------------ state
    @property
    def phase(self) -> Phase:
        return self.detector.phase

    @property
    def p_high(self) -> float:
        """``p_low + k`` (rounded to 12 decimals: 0.008 + 0.40 is 0.408, not
        0.40800000000000003, in plans and logs)."""
        return _high(self.p_low, self.k)

    def bound_for(self, phase: Phase) -> float:
        return self.p_low if phase is Phase.CRITICAL else self.p_high

    @property
    def bound(self) -> float:
        """The bound the next planned message gets."""
        return self.bound_for(self.detector.phase)

    # ------------------------------------------------------------- training
    def epoch_end(self, grad_norm: float) -> Phase:
        """Forwarded to the detector; the decision is appended to ``history``."""
        det = self.detector
        phase = det.epoch_end(grad_norm)
        assert det.last_norm is not None  # the boundary just recorded it
        self.history.append(PhaseRecord(
            epoch=det.epoch - 1, grad_norm=det.last_norm, relative_change=det.relative_change,
            phase=phase, bound=self.bound_for(phase), reason=det.reason,
        ))
        return phase

    def lr_changed(self) -> None:
        self.detector.lr_changed()

    # --------------------------------------------------------------- policy
    def plan(self, info: MessageInfo) -> ClosePlan:
        bound = self.bound
        return ClosePlan(min_delivered=min_delivered_for_bound(info, bound), bound=bound)

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Its bounds, its detector's state (the phase in force, the epoch, the last
        gradient norm, an LR change pending) and the history of its decisions: a job
        resumed from it continues in the same phase with the same bound."""
        return {"policy": self.name, "params": self.params(),
                "detector": self.detector.state_dict(),
                "history": [r.as_dict() for r in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        params, detector, history = state_values(self, state, "params", "detector", "history")
        with loading(self.name), all_or_nothing(self, self.detector):
            self.configure(**params)
            self.detector.load_state_dict(detector)
            self.history = [PhaseRecord.from_dict(r) for r in history]

    def describe(self) -> str:
        return (f"dblp(p_low={self.p_low:g}, k={self.k:g}, eta={self.detector.eta:g}, "
                f"phase={self.phase.value})")
