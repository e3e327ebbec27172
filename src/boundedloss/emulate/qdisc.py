"""A switch port's queue: the plain ``pfifo`` every port has, or a ``tbf`` bottleneck,
set and read over rtnetlink (pyroute2) - no ``tc`` binary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .units import format_rate, parse_rate, parse_size

#: tbf meters whole frames: an MTU-sized IP packet is MTU + 14 bytes at the veth.
ETH_HEADER = 14
#: Each switch port's queue where no bottleneck is set (``pfifo``; the kernel's default
#: receive backlog): without a qdisc a veth whose peer coalesces (GRO, NAPI) drops
#: what overflows its 256-packet ring, uncounted by any qdisc; with one, a full ring
#: holds the packets back in the queue, and only what overflows the queue is dropped.
PORT_QUEUE_PACKETS = 1000
_U32 = 2**32 - 1
#: the kernel's packet-scheduler ticks per microsecond at most (15.625 here, from
#: /proc/net/psched; 64 bounds it on the kernels we know)
_TICKS_PER_US = 64


@dataclass(frozen=True)
class Bottleneck:
    """A token-bucket bottleneck (``tbf``) on the switch port toward the server:
    ``rate`` is the drain rate, ``burst`` the bucket (how many bytes may leave back to
    back at line rate), ``limit`` the queue (bytes that may wait for tokens; beyond it,
    arriving frames are dropped - the shallow-buffer incast drop). tc's units:
    ``kbit/mbit/gbit`` rates, ``b/kb/mb`` sizes (``kb`` = 1024 bytes)."""

    rate: str = "100mbit"
    burst: str = "32kb"
    limit: str = "64kb"

    def __post_init__(self):
        # Fail at construction, not inside the kernel.
        parse_rate(self.rate)
        parse_size(self.burst)
        parse_size(self.limit)
        # tbf's netlink fields are 32-bit: bytes/s, bytes, and the bucket as scheduler
        # ticks at the rate (pyroute2 writes no 64-bit rate)
        if self.rate_bps // 8 > _U32:
            raise ValueError(f"tbf rate {self.rate} is above {format_rate(_U32 * 8)}, the "
                             "most this testbed sets")
        if self.limit_bytes > _U32:
            raise ValueError(f"tbf limit {self.limit} is above {_U32} B")
        if self.burst_bytes * 8 / self.rate_bps * 1e6 * _TICKS_PER_US > _U32:
            raise ValueError(f"tbf burst {self.burst} at {self.rate} is longer than the "
                             "kernel can hold (a 32-bit count of scheduler ticks); "
                             "use a smaller burst or a higher rate")

    @property
    def rate_bps(self) -> int:
        return parse_rate(self.rate)

    @property
    def burst_bytes(self) -> int:
        return parse_size(self.burst)

    @property
    def limit_bytes(self) -> int:
        return parse_size(self.limit)

    def check_mtu(self, mtu: int) -> None:
        frame = mtu + ETH_HEADER
        if self.burst_bytes < frame:
            raise ValueError(
                f"tbf burst {self.burst} ({self.burst_bytes} B) is below one frame "
                f"({frame} B at mtu {mtu}): tbf would drop every full-size packet; "
                f"use burst >= {frame}b")
        if self.limit_bytes < frame:
            raise ValueError(
                f"tbf limit {self.limit} ({self.limit_bytes} B) is below one frame "
                f"({frame} B at mtu {mtu}); use limit >= {frame}b")

    def describe(self) -> str:
        return (f"tbf rate {format_rate(self.rate_bps)} burst {self.burst_bytes} B "
                f"limit {self.limit_bytes} B")


@dataclass(frozen=True)
class QdiscStats:
    """Counters of a port's root qdisc."""

    kind: str
    sent_bytes: int
    sent_packets: int
    dropped: int
    overlimits: int
    requeues: int
    backlog_bytes: int
    backlog_packets: int
    rate_bps: int | None = None  # tbf only
    burst_bytes: int | None = None  # tbf only


def set_queue(ipr: Any, ifindex: int, bottleneck: Bottleneck | None) -> None:
    """Make the root qdisc of ``ifindex`` the bottleneck, or the port's plain queue."""
    if bottleneck is None:
        ipr.tc("replace", "pfifo", ifindex, limit=PORT_QUEUE_PACKETS)
    else:
        ipr.tc("replace", "tbf", ifindex, rate=f"{bottleneck.rate_bps}bit",
               burst=bottleneck.burst_bytes, limit=bottleneck.limit_bytes)


def _attrs(nla: Any) -> dict:
    return dict(nla["attrs"]) if nla else {}


def stats(ipr: Any, ifindex: int) -> QdiscStats | None:
    """The root qdisc of ``ifindex`` and its counters (they restart when the qdisc is
    replaced), or None when it has none."""
    for q in ipr.get_qdiscs(index=ifindex):
        if q.get("parent") != 0xFFFFFFFF:
            continue
        s2 = _attrs(q.get_attr("TCA_STATS2"))
        basic = s2.get("TCA_STATS_BASIC") or {}
        queue = s2.get("TCA_STATS_QUEUE") or {}
        kind = q.get_attr("TCA_KIND") or "?"
        rate = burst = None
        if kind == "tbf":
            parms = _attrs(q.get_attr("TCA_OPTIONS")).get("TCA_TBF_PARMS") or {}
            rate = int(parms.get("rate", 0)) * 8  # bytes/s in the kernel
            burst = _burst_bytes(parms)
        return QdiscStats(
            kind=kind, sent_bytes=int(basic.get("bytes", 0)),
            sent_packets=int(basic.get("packets", 0)), dropped=int(queue.get("drops", 0)),
            overlimits=int(queue.get("overlimits", 0)),
            requeues=int(queue.get("requeues", 0)), backlog_bytes=int(queue.get("backlog", 0)),
            backlog_packets=int(queue.get("qlen", 0)), rate_bps=rate, burst_bytes=burst)
    return None


def _burst_bytes(parms: dict) -> int | None:
    """tbf keeps its bucket as a time (``buffer``, in scheduler ticks, at ``rate``);
    the bytes it holds, as ``tc`` prints them (pyroute2 converted them to ticks with
    the same clock)."""
    from pyroute2.netlink.rtnl.tcmsg.common import tick_in_usec

    rate = int(parms.get("rate", 0))
    if rate <= 0:
        return None
    return round(int(parms.get("buffer", 0)) / tick_in_usec * rate / 1e6)
