"""A policy as a command line writes it, and the systems a run can be made of.

Every command spells a policy the same way (:func:`parse_policy`):

- ``NAME`` - a :data:`POLICIES` name with its defaults: ``dblp``;
- ``NAME:VALUE`` - its leading parameter (:attr:`Policy.leading_param`) set:
  ``mlt:0.01`` is ``FixedBoundPolicy(p=0.01)``, ``dblp:0.01`` sets ``p_low``;
- ``NAME:KEY=VALUE[:KEY=VALUE...]`` - any of its parameters:
  ``dblp:p_low=0.01:k=0.3``, ``ltp:ratio_min=0.8``.

Three more names are systems a run can be compared on without being a policy of ours:

- ``gloo`` - DDP's own allreduce over TCP: no bounded-loss transport, no policy;
- ``tcp-ps`` - a parameter server over TCP (gloo's point-to-point send and receive
  through rank 0): LTP's baseline under incast, no bounded-loss transport, no policy;
- ``baseline`` - MLT with its bound fixed at DBLP's ``P_low`` in every phase, the DBLP
  paper's baseline (``mlt:0.008`` under its own name).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from .base import Policy
from .fixed import FixedBoundPolicy
from .phase_aware import DEFAULT_P_LOW
from .registry import POLICIES, make_policy

#: DDP's own allreduce over TCP (the reliable baseline a training job starts from)
GLOO = "gloo"
#: a parameter server over TCP (``boundedloss.torch.tcp_ps``): LTP's incast baseline
TCP_PS = "tcp-ps"
#: the systems that move gradients over TCP instead of our transport
TCP_SYSTEMS = (GLOO, TCP_PS)
#: the collective each of them runs, as rows name it (gloo's ring; a server at rank 0)
TCP_TOPOLOGIES = {GLOO: "gloo", TCP_PS: "ps"}
#: MLT with P fixed at DBLP's P_low
BASELINE = "baseline"
#: every name a command line accepts
SYSTEM_NAMES: tuple[str, ...] = (GLOO, TCP_PS, *POLICIES, BASELINE)

SPELLING = (f"write NAME, NAME:VALUE or NAME:KEY=VALUE[:KEY=VALUE...] with NAME one of "
            f"{', '.join(SYSTEM_NAMES)} (e.g. mlt:0.01)")

ParamValue = int | float


@dataclass(frozen=True)
class PolicySpec:
    """One system of a run: ``name`` (a :data:`POLICIES` name, or one of
    :data:`TCP_SYSTEMS`) with
    keyword arguments for its policy; ``alias`` is the name it was asked for by when
    that is not its own (``baseline``). ``str(spec)`` is a spelling that
    :func:`parse_policy` reads back to an equal spec (it names the run's rows)."""

    name: str
    params: tuple[tuple[str, ParamValue], ...] = ()
    alias: str | None = None

    @property
    def uses_transport(self) -> bool:
        """False for the TCP systems (gloo, tcp-ps), which move gradients without our
        transport."""
        return self.name not in TCP_SYSTEMS

    def make(self) -> Policy:
        """A fresh policy as specified (``ValueError`` for a TCP system, which has none)."""
        if not self.uses_transport:
            raise ValueError(f"{self.name} has no policy: it moves gradients over TCP")
        return make_policy(self.name, **dict(self.params))

    @property
    def fixed_bound(self) -> float | None:
        """The bound a fixed-bound (MLT) spec holds in every phase; None for others."""
        if not self.uses_transport:
            return None
        policy = self.make()
        return policy.p if isinstance(policy, FixedBoundPolicy) else None

    @property
    def label(self) -> str:
        if self.alias is not None:
            return self.alias
        return self.name + "".join(f":{k}={v!r}" for k, v in self.params)

    def __str__(self) -> str:
        return self.label


def baseline() -> PolicySpec:
    """DBLP's baseline: MLT with P fixed at DBLP's default P_low."""
    return PolicySpec("mlt", (("p", DEFAULT_P_LOW),), alias=BASELINE)


def _value(text: str) -> ParamValue:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return float(text)  # (ValueError names the text)


def parse_policy(text: str) -> PolicySpec:
    """The spec a command line's policy names (see the module notes); ``ValueError``,
    one line saying what is wrong and how to write it."""
    raw = text.strip()
    head, colon, rest = raw.partition(":")
    name = head.strip().lower()
    if name in (*TCP_SYSTEMS, BASELINE):
        if colon:
            raise ValueError(f"bad policy {raw!r}: {name} takes no parameters")
        return PolicySpec(name) if name in TCP_SYSTEMS else baseline()
    cls = POLICIES.get(name)
    if cls is None:
        older = re.fullmatch(r"([a-z]+)\s*[=(](.*?)\)?", name)
        if older and older.group(1) in SYSTEM_NAMES:  # mlt=0.01, mlt(p=0.01)
            raise ValueError(f"bad policy {raw!r}: write {older.group(1)}:{older.group(2)}")
        raise ValueError(f"unknown policy {raw!r}; {SPELLING}")
    params: dict[str, ParamValue] = {}
    for i, part in enumerate(rest.split(":") if colon else ()):
        key, eq, value = part.partition("=")
        if not eq:
            if i or cls.leading_param is None:
                raise ValueError(f"bad policy {raw!r}: {part!r} is not KEY=VALUE; {SPELLING}")
            key, value = cls.leading_param, part
        key = key.strip()
        if key in params:
            raise ValueError(f"bad policy {raw!r}: {key} given twice")
        try:
            params[key] = _value(value)
        except ValueError:
            raise ValueError(f"bad policy {raw!r}: {key} must be a number, "
                             f"got {value.strip()!r}") from None
    spec = PolicySpec(name, tuple(sorted(params.items())))
    try:
        spec.make()
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad policy {raw!r}: {e}") from None
    return spec


def parse_policies(text: str | Iterable[str]) -> tuple[PolicySpec, ...]:
    """Comma-separated policies (or an iterable of them), each as :func:`parse_policy`
    reads it; order kept; ``ValueError`` naming the bad one, or one given twice (a
    comparison would otherwise silently have one row fewer than asked for)."""
    parts = text.split(",") if isinstance(text, str) else text
    specs: list[PolicySpec] = []
    for part in parts:
        if not part.strip():
            continue
        spec = parse_policy(part)
        if spec in specs:
            raise ValueError(f"{spec} is named twice")
        specs.append(spec)
    if not specs:
        raise ValueError("no policies given")
    return tuple(specs)
