"""Random loss at the switch: nf_tables rules in the switch's namespace that drop a
fraction of the packets forwarded toward a node, each wire packet on its own.

Layout (table ``ip boundedloss``)::

    chain forward (hook forward):  oifname "to-X" counter jump loss-X      (per node X)
    chain loss-X:   [meta l4proto != udp return]        (protocol "udp" only)
                    numgen random mod 10^9 >= T return  (the gate: passes 1 - p)
                    counter drop

:meth:`LossRules.set` writes the node's rules afresh, both counters from zero, in one
transaction: ``seen`` counts every packet forwarded toward X and ``dropped`` every one
dropped there since; ``set(node, 0)`` removes them all (a packet then meets no rule of
ours: the gate's random draw costs every packet a little, measurably). A
:class:`LossRuleWriter` (a timed microburst's) replaces the gate alone, encoded once per
value, so a change is one ``sendto`` and its acknowledgement (a few tens of
microseconds) and the counters run on across changes; its ``p = 0`` is a gate that
returns without a draw.
"""

from __future__ import annotations

import errno
import threading
from dataclasses import dataclass
from typing import Any

from . import nft
from .topology import port_name

TABLE = "boundedloss"
FORWARD = "forward"
#: the gate's draw is uniform in [0, MODULUS): p is applied to 1e-9
MODULUS = 1_000_000_000
PROTOCOLS = ("udp", "all")
_UDP = 17


def check_probability(p: float) -> float:
    """``p`` as a float, or ValueError when it is not a probability in [0, 1]."""
    try:
        p = float(p)
    except (TypeError, ValueError):
        raise ValueError(f"loss probability must be a number, got {p!r}") from None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"loss probability must be in [0, 1], got {p}")
    return p


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be 'udp' or 'all', got {protocol!r}")
    return protocol


def loss_chain(node: str) -> str:
    """The switch's chain that drops packets on their way to ``node``."""
    return f"loss-{node}"


@dataclass(frozen=True)
class LossStats:
    """The random-drop rule of one node and its counters. ``seen_packets`` counts every
    packet the switch forwarded toward the node."""

    probability: float
    protocol: str | None  # "udp", "all", or None when the node has no rule (never set, or 0)
    dropped_packets: int
    dropped_bytes: int
    seen_packets: int


@dataclass(frozen=True)
class _Chain:
    gate: int  # the gate rule's handle
    protocol: str
    jump: int | None  # the forward chain's rule that jumps to the node's chain


def _gate(p: float) -> list[nft.Expr]:
    """The rule that passes ``1 - p`` of the packets on (``return``): at ``p = 0`` a bare
    ``return``, which draws no random number for every packet."""
    if p == 0:
        return [nft.verdict(nft.RETURN)]
    return [*nft.random_at_least(MODULUS, round(p * MODULUS)), nft.verdict(nft.RETURN)]


class LossRules:
    """The switch's drop rules, over one nf_tables socket in its namespace."""

    def __init__(self, switch_namespace: str):
        self._nft = nft.NftSocket(switch_namespace)
        self._chains: dict[str, _Chain] = {}  # what this process knows is in the kernel
        self._encoded: dict[tuple[str, int, int], nft.Transaction] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the socket (after any change in flight: a burst's thread may be in
        one)."""
        with self._lock:
            self._nft.close()

    def install(self) -> None:
        """The table and its forward chain (at ``up``)."""
        self._nft.apply([nft.table_msg(TABLE), nft.chain_msg(TABLE, FORWARD, forward_hook=True)])

    def set(self, node: str, p: float, protocol: str = "udp", *, restart: bool = True) -> None:
        """Drop ``p`` of the ``protocol`` packets forwarded toward ``node`` from now on;
        the counters start from zero (``restart``), or run on where the protocol is
        unchanged (a writer's fast change). A restart at ``p = 0`` removes the node's
        rules altogether: a packet toward it then meets no rule of ours at all."""
        p = check_probability(p)
        check_protocol(protocol)
        with self._lock:
            if not restart:
                have = self._chains.get(node) or self._read(node)
                for _ in range(2):  # (once more where another process rewrote the chain)
                    if have is None or have.protocol != protocol:
                        break
                    try:
                        self._nft.send(self._gate_change(node, have.gate, p))
                        return
                    except nft.NftError as e:
                        if e.errno != errno.ENOENT:
                            raise
                    have = self._read(node)
            have = self._read(node)
            if restart and p == 0:
                self._remove(node, have)
            else:
                self._build(node, p, protocol, have)

    def _remove(self, node: str, have: _Chain | None) -> None:
        """The node's forward rule and chain deleted, in one transaction."""
        if have is None:
            return
        chain = loss_chain(node)
        msgs = [] if have.jump is None else [nft.delete_rule_msg(TABLE, FORWARD, have.jump)]
        self._nft.apply([*msgs, nft.flush_msg(TABLE, chain), nft.delete_chain_msg(TABLE, chain)])
        self._chains.pop(node, None)

    def prepare(self, node: str, protocol: str, ps: list[float]) -> None:
        """The node's chain made for ``protocol`` if it is not, and the gate changes to
        each of ``ps`` encoded (see :class:`LossRuleWriter`)."""
        with self._lock:
            have = self._chains.get(node) or self._read(node)
            if have is None or have.protocol != protocol:
                self._build(node, 0.0, protocol, have)
                have = self._chains[node]
            for p in ps:
                self._gate_change(node, have.gate, p)

    def _gate_change(self, node: str, gate: int, p: float) -> nft.Transaction:
        """The transaction that replaces ``node``'s gate by one for ``p``, encoded once
        per value (bursts switch between two)."""
        key = (node, gate, round(p * MODULUS))
        got = self._encoded.get(key)
        if got is None:
            if len(self._encoded) >= 64:
                self._encoded.clear()
            got = self._encoded[key] = self._nft.encode(
                [nft.rule_msg(TABLE, loss_chain(node), _gate(p), replace=gate)])
        return got

    def _build(self, node: str, p: float, protocol: str, have: _Chain | None) -> None:
        """The node's forward rule and chain written afresh, in one transaction."""
        chain = loss_chain(node)
        msgs = []
        if have is None:
            msgs.append(nft.chain_msg(TABLE, chain))
        else:
            if have.jump is not None:
                msgs.append(nft.delete_rule_msg(TABLE, FORWARD, have.jump))
            msgs.append(nft.flush_msg(TABLE, chain))
        msgs.append(nft.rule_msg(TABLE, FORWARD, [*nft.oifname_is(port_name(node)),
                                                  nft.counter(), nft.verdict(nft.JUMP, chain)]))
        if protocol == "udp":
            msgs.append(nft.rule_msg(TABLE, chain, [*nft.l4proto_is_not(_UDP),
                                                    nft.verdict(nft.RETURN)]))
        msgs += [nft.rule_msg(TABLE, chain, _gate(p)),
                 nft.rule_msg(TABLE, chain, [nft.counter(), nft.verdict(nft.DROP)])]
        self._nft.apply(msgs)
        got = self._read(node)
        if got is None or got.protocol != protocol:
            raise nft.NftError(errno.EIO, f"the loss rule toward {node} did not take")

    def _read(self, node: str) -> _Chain | None:
        """The node's chain as the kernel holds it (and remember it)."""
        view = _ChainView.of(self._nft.rules(TABLE), node)
        chain = None if view.gate is None else _Chain(view.gate, view.protocol or "all",
                                                      view.jump)
        if chain is None:
            self._chains.pop(node, None)
        else:
            self._chains[node] = chain
        return chain

    def stats(self, node: str) -> LossStats:
        """The rule toward ``node`` as the kernel holds it, with its counters."""
        with self._lock:
            view = _ChainView.of(self._nft.rules(TABLE), node)
        if view.gate is None:
            return LossStats(0.0, None, 0, 0, view.seen)
        return LossStats(view.probability, view.protocol, view.dropped, view.dropped_bytes,
                         view.seen)

    def writer(self, node: str, protocol: str = "all") -> LossRuleWriter:
        return LossRuleWriter(self, node, protocol)


@dataclass
class _ChainView:
    """What a dump of the table says about one node's chain."""

    gate: int | None = None
    jump: int | None = None
    probability: float = 0.0
    protocol: str | None = None
    dropped: int = 0
    dropped_bytes: int = 0
    seen: int = 0

    @classmethod
    def of(cls, rules: list[Any], node: str) -> _ChainView:
        chain = loss_chain(node)
        v = cls()
        for rule in rules:
            where = rule.get_attr("NFTA_RULE_CHAIN")
            exprs = nft.expressions(rule)
            names = [name for name, _ in exprs]
            if where == FORWARD and _jumps_to(exprs) == chain:
                v.seen += _counter(exprs)[0]
                v.jump = rule.get_attr("NFTA_RULE_HANDLE")
            elif where != chain:
                continue
            elif "meta" in names:
                v.protocol = "udp"
            elif "counter" in names:
                v.dropped, v.dropped_bytes = _counter(exprs)
            else:  # the gate: a draw, or a bare return at p = 0
                v.gate = rule.get_attr("NFTA_RULE_HANDLE")
                v.probability = round(_threshold(exprs) / MODULUS, 9) if "numgen" in names \
                    else 0.0
        if v.gate is not None and v.protocol is None:
            v.protocol = "all"
        return v


def _counter(exprs: list[tuple[str, dict]]) -> tuple[int, int]:
    for name, attrs in exprs:
        if name == "counter":
            return (int(attrs.get("NFTA_COUNTER_PACKETS", 0)),
                    int(attrs.get("NFTA_COUNTER_BYTES", 0)))
    return 0, 0


def _threshold(exprs: list[tuple[str, dict]]) -> int:
    for name, attrs in exprs:
        if name == "cmp":
            data = attrs.get("NFTA_CMP_DATA")
            raw = dict(data["attrs"]).get("NFTA_DATA_VALUE") if data else None
            if isinstance(raw, str):  # pyroute2 hands 'cdata' back as hex text
                raw = bytes.fromhex(raw.replace(":", ""))
            if raw is not None:
                return int.from_bytes(bytes(raw)[:4], "big")
    return 0


def _jumps_to(exprs: list[tuple[str, dict]]) -> str | None:
    for name, attrs in exprs:
        if name == "immediate":
            data = attrs.get("NFTA_IMMEDIATE_DATA")
            verdict = dict(data["attrs"]).get("NFTA_DATA_VERDICT") if data else None
            if verdict:
                return dict(verdict["attrs"]).get("NFTA_VERDICT_CHAIN")
    return None


class LossRuleWriter:
    """One node's loss rule, changed fast (a timed microburst's rule): each ``set`` is
    one netlink transaction replacing the gate, in the process that holds the rules -
    no helper process. ``set(0)`` leaves the chain passing everything."""

    def __init__(self, rules: LossRules, node: str, protocol: str):
        self.node = node
        self.protocol = check_protocol(protocol)
        self._rules = rules

    def prepare(self, *ps: float) -> None:
        """Have the changes to each of ``ps`` ready (the node's rule made if it is not
        there yet, each transaction encoded), so that none of them waits on Python's
        message encoding when its time comes."""
        self._rules.prepare(self.node, self.protocol, [check_probability(p) for p in ps])

    def set(self, p: float) -> None:
        """Drop ``p`` of what arrives at the node from now on (the counters run on)."""
        self._rules.set(self.node, p, self.protocol, restart=False)

    def close(self) -> None:
        """Nothing to end (the rule stays as last set); kept for the callers' ``with``."""
