"""nf_tables over netlink: one socket in a namespace, its batched changes and its rule
dumps. Messages are pyroute2's (``nft_rule_msg`` and friends encode and decode them);
the socket is a plain ``NETLINK_NETFILTER`` socket of ours, so a change is one
``sendto`` and its acknowledgements - well under a millisecond, which a microburst's
rule change needs.

Expressions are built here as pyroute2's attribute lists, named as the kernel names
them (``NFTA_NG_*`` for numgen: pyroute2's ``genex`` would name them ``NFTA_NUMGEN_*``).
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

from . import netns

NETLINK_NETFILTER = 12
NFPROTO_IPV4 = 2
#: netlink flags and nf_tables message types (linux/netlink.h, linux/netfilter/nf_tables.h;
#: kept here so that importing this module does not import pyroute2, ~80 ms of a
#: command's start: its message classes are imported where a message is made)
NLM_F_REQUEST, NLM_F_ACK, NLM_F_REPLACE, NLM_F_CREATE, NLM_F_APPEND = 0x1, 0x4, 0x100, 0x400, 0x800
NLM_F_DUMP = 0x300
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWTABLE, NFT_MSG_NEWCHAIN, NFT_MSG_DELCHAIN = 0, 3, 5
NFT_MSG_NEWRULE, NFT_MSG_GETRULE, NFT_MSG_DELRULE = 6, 7, 8
_BATCH_BEGIN, _BATCH_END = 0x10, 0x11
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_HDR = struct.Struct("=IHHII")
#: nft_cmp operators and verdicts (linux/netfilter/nf_tables.h)
CMP_EQ, CMP_NEQ, CMP_GTE = 0, 1, 5
DROP, ACCEPT, JUMP, RETURN = 0, 1, -3, -5
_META_OIFNAME, _META_L4PROTO = 7, 16
_NG_RANDOM = 1
_HOOK_FORWARD = 2
IFNAMSIZ = 16

Expr = dict[str, Any]


class NftError(OSError):
    """The kernel refused a change (errno, and which message)."""


# --------------------------------------------------------------------- expressions


def _expr(name: str, attrs: list[tuple[str, Any]]) -> Expr:
    return {"attrs": [("NFTA_EXPR_NAME", name), ("NFTA_EXPR_DATA", {"attrs": attrs})]}


def _value(b: bytes) -> dict:
    return {"attrs": [("NFTA_DATA_VALUE", b)]}


def meta(key: int) -> Expr:
    return _expr("meta", [("NFTA_META_DREG", 1), ("NFTA_META_KEY", key)])


def cmp(op: int, data: bytes) -> Expr:
    return _expr("cmp", [("NFTA_CMP_SREG", 1), ("NFTA_CMP_OP", op),
                         ("NFTA_CMP_DATA", _value(data))])


def oifname_is(ifname: str) -> list[Expr]:
    return [meta(_META_OIFNAME), cmp(CMP_EQ, ifname.encode().ljust(IFNAMSIZ, b"\0"))]


def l4proto_is_not(proto: int) -> list[Expr]:
    return [meta(_META_L4PROTO), cmp(CMP_NEQ, bytes([proto]))]


def random_at_least(modulus: int, threshold: int) -> list[Expr]:
    """True for a packet whose uniform draw in ``[0, modulus)`` is ``>= threshold``:
    with ``threshold = p * modulus``, a fraction ``1 - p`` of packets. (nft_cmp compares
    bytes, so the draw is turned big-endian first, as ``nft`` itself does.)"""
    return [_expr("numgen", [("NFTA_NG_DREG", 1), ("NFTA_NG_MODULUS", modulus),
                             ("NFTA_NG_TYPE", _NG_RANDOM), ("NFTA_NG_OFFSET", 0)]),
            _expr("byteorder", [("NFTA_BYTEORDER_SREG", 1), ("NFTA_BYTEORDER_DREG", 1),
                                ("NFTA_BYTEORDER_OP", 1), ("NFTA_BYTEORDER_LEN", 4),
                                ("NFTA_BYTEORDER_SIZE", 4)]),
            cmp(CMP_GTE, struct.pack(">I", threshold))]


def counter() -> Expr:
    return _expr("counter", [])


def verdict(code: int, chain: str | None = None) -> Expr:
    v: list[tuple[str, Any]] = [("NFTA_VERDICT_CODE", code)]
    if chain is not None:
        v.append(("NFTA_VERDICT_CHAIN", chain))
    return _expr("immediate", [("NFTA_IMMEDIATE_DREG", 0), (
        "NFTA_IMMEDIATE_DATA", {"attrs": [("NFTA_DATA_VERDICT", {"attrs": v})]})])


# --------------------------------------------------------------------- messages


def _msgs() -> Any:
    """pyroute2's nf_tables messages (``nfgen_msg``, ``nft_rule_msg``, ...)."""
    from pyroute2.netlink.nfnetlink import nftsocket

    return nftsocket


def table_msg(table: str) -> tuple[Any, int, int]:
    m = _msgs().nft_table_msg()
    m["attrs"] = [["NFTA_TABLE_NAME", table]]
    return m, NFT_MSG_NEWTABLE, NLM_F_CREATE


def chain_msg(table: str, chain: str, *, forward_hook: bool = False) -> tuple[Any, int, int]:
    m = _msgs().nft_chain_msg()
    m["attrs"] = [["NFTA_CHAIN_TABLE", table], ["NFTA_CHAIN_NAME", chain]]
    if forward_hook:
        m["attrs"] += [["NFTA_CHAIN_HOOK", {"attrs": [["NFTA_HOOK_HOOKNUM", _HOOK_FORWARD],
                                                      ["NFTA_HOOK_PRIORITY", 0]]}],
                       ["NFTA_CHAIN_TYPE", "filter"], ["NFTA_CHAIN_POLICY", ACCEPT]]
    return m, NFT_MSG_NEWCHAIN, NLM_F_CREATE


def delete_chain_msg(table: str, chain: str) -> tuple[Any, int, int]:
    """Delete ``chain`` (empty, and jumped to by no rule, in the same transaction)."""
    m = _msgs().nft_chain_msg()
    m["attrs"] = [["NFTA_CHAIN_TABLE", table], ["NFTA_CHAIN_NAME", chain]]
    return m, NFT_MSG_DELCHAIN, 0


def rule_msg(table: str, chain: str, exprs: list[Expr], *,
             replace: int | None = None) -> tuple[Any, int, int]:
    """A rule appended to ``chain``, or replacing the rule whose handle is ``replace``."""
    m = _msgs().nft_rule_msg()
    m["attrs"] = [["NFTA_RULE_TABLE", table], ["NFTA_RULE_CHAIN", chain]]
    if replace is not None:
        m["attrs"].append(["NFTA_RULE_HANDLE", replace])
    m["attrs"].append(["NFTA_RULE_EXPRESSIONS", exprs])
    if replace is not None:
        return m, NFT_MSG_NEWRULE, NLM_F_REPLACE
    return m, NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND


def flush_msg(table: str, chain: str) -> tuple[Any, int, int]:
    """Delete every rule of ``chain``."""
    m = _msgs().nft_rule_msg()
    m["attrs"] = [["NFTA_RULE_TABLE", table], ["NFTA_RULE_CHAIN", chain]]
    return m, NFT_MSG_DELRULE, 0


def delete_rule_msg(table: str, chain: str, handle: int) -> tuple[Any, int, int]:
    m = _msgs().nft_rule_msg()
    m["attrs"] = [["NFTA_RULE_TABLE", table], ["NFTA_RULE_CHAIN", chain],
                  ["NFTA_RULE_HANDLE", handle]]
    return m, NFT_MSG_DELRULE, 0


# --------------------------------------------------------------------- the socket


@dataclass(frozen=True)
class Transaction:
    """An encoded nf_tables batch: its bytes and the sequence numbers of its begin, its
    changes and its end (what the kernel's answers name)."""

    data: bytes
    begin: int
    changes: tuple[int, ...]
    end: int


class NftSocket:
    """A ``NETLINK_NETFILTER`` socket in one namespace (made there, usable from any
    thread): :meth:`apply` commits a list of messages as one transaction, :meth:`rules`
    dumps a table's rules."""

    def __init__(self, namespace: str | None = None, *, timeout: float = 5.0):
        def make() -> socket.socket:
            return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)

        self._sock = make() if namespace is None else netns.call_in(namespace, make)
        self._sock.settimeout(timeout)
        self._sock.bind((0, 0))
        self._seq = itertools.count(int.from_bytes(os.urandom(2), "little") + 1)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> NftSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _batch_edge(kind: int, seq: int) -> bytes:
        m = _msgs().nfgen_msg()
        m["res_id"] = NFNL_SUBSYS_NFTABLES
        m["header"]["type"] = kind
        m["header"]["flags"] = NLM_F_REQUEST
        m["header"]["sequence_number"] = seq
        m.encode()
        return bytes(m.data)

    def encode(self, messages: list[tuple[Any, int, int]]) -> Transaction:
        """``messages`` as one transaction, ready to send (and to send again)."""
        begin = next(self._seq)
        parts = [self._batch_edge(_BATCH_BEGIN, begin)]
        changes = []
        for msg, kind, flags in messages:
            seq = next(self._seq)
            msg["header"]["type"] = (NFNL_SUBSYS_NFTABLES << 8) | kind
            msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | flags
            msg["header"]["sequence_number"] = seq
            msg["nfgen_family"] = NFPROTO_IPV4
            msg.encode()
            parts.append(bytes(msg.data))
            changes.append(seq)
        end = next(self._seq)
        parts.append(self._batch_edge(_BATCH_END, end))
        return Transaction(b"".join(parts), begin, tuple(changes), end)

    def apply(self, messages: list[tuple[Any, int, int]]) -> None:
        """Commit ``messages`` as one transaction (all or nothing); NftError with the
        kernel's errno if it refused it."""
        self.send(self.encode(messages))

    def send(self, txn: Transaction) -> None:
        """Commit a transaction :meth:`encode` made (it can be sent again: encoding
        takes a few hundred microseconds of Python, sending it a few tens). The kernel
        answers each change, or refuses the whole batch on its begin or end (no
        nf_tables, no privilege, no memory)."""
        with self._lock:
            self._drain()  # (a late answer to an earlier send of the same bytes)
            self._sock.sendto(txn.data, (0, 0))
            pending = set(txn.changes)
            error: tuple[int, str] | None = None
            while pending and error is None:
                buf = self._sock.recv(65536)
                for kind, seq, body in _split(buf):
                    if kind != _NLMSG_ERROR:
                        continue
                    code = -struct.unpack_from("=i", body)[0]
                    if seq in pending:
                        pending.discard(seq)
                        if code > 0 and error is None:
                            k = txn.changes.index(seq)
                            error = (code, f"change {k + 1} of {len(txn.changes)}")
                    elif seq in (txn.begin, txn.end) and code > 0:
                        error = (code, "the transaction")
        if error is not None:
            code, what = error
            raise NftError(code, f"nf_tables refused {what}: {os.strerror(code)}")

    def _drain(self) -> None:
        """Read whatever is waiting on the socket, without waiting. (A socket with a
        timeout waits out EAGAIN even under MSG_DONTWAIT: poll first.)"""
        while select.select([self._sock], [], [], 0)[0]:
            self._sock.recv(65536)

    def rules(self, table: str) -> list[Any]:
        """Every rule of ``table`` (decoded ``nft_rule_msg``s), in chain order."""
        m = _msgs().nft_rule_msg()
        m["attrs"] = [["NFTA_RULE_TABLE", table]]
        m["header"]["type"] = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETRULE
        m["header"]["flags"] = NLM_F_REQUEST | NLM_F_DUMP
        seq = next(self._seq)
        m["header"]["sequence_number"] = seq
        m["nfgen_family"] = NFPROTO_IPV4
        m.encode()
        out: list[Any] = []
        with self._lock:
            self._sock.sendto(bytes(m.data), (0, 0))
            while True:
                buf = self._sock.recv(1 << 20)
                for kind, got, body in _split(buf, raw=True):
                    if got != seq:
                        continue
                    if kind == _NLMSG_DONE:
                        return out
                    if kind == _NLMSG_ERROR:
                        code = struct.unpack_from("=i", body, _HDR.size)[0]
                        if code < 0:
                            raise NftError(-code, f"listing nf_tables rules: "
                                                  f"{os.strerror(-code)}")
                        continue
                    r = _msgs().nft_rule_msg(body)
                    r.decode()
                    if r.get_attr("NFTA_RULE_TABLE") == table:
                        out.append(r)


def _split(buf: bytes, *, raw: bool = False):
    """``(type, seq, body)`` of each netlink message in ``buf``; with ``raw`` the body
    is the whole message, header included (pyroute2 decodes it from there)."""
    off = 0
    while off + _HDR.size <= len(buf):
        length, kind, _flags, seq, _pid = _HDR.unpack_from(buf, off)
        if length < _HDR.size:
            return
        yield kind, seq, (buf[off:off + length] if raw else buf[off + _HDR.size:off + length])
        off += (length + 3) & ~3


def expressions(rule: Any) -> list[tuple[str, dict]]:
    """A dumped rule's expressions as ``(name, {attribute: value})``."""
    out = []
    for e in rule.get_attr("NFTA_RULE_EXPRESSIONS") or []:
        data = e.get_attr("NFTA_EXPR_DATA")
        attrs = dict(data["attrs"]) if data else {}
        out.append((e.get_attr("NFTA_EXPR_NAME"), attrs))
    return out
