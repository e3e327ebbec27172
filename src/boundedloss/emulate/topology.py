"""The testbed's shape and how it is built: one namespace per node (the server and the
workers) and one for the switch that routes between them, a veth from the switch's
port ``to-<node>`` to the node's ``eth0``, addresses, host routes, static neighbours,
queues and offloads - all over rtnetlink (pyroute2) and libc, no ``ip`` binary.

Packets are wire-size wherever they are dropped or queued, as on a NIC and a wire: each
node's interface has its segmentation offloads off (software GSO cuts a TCP or
UDP_SEGMENT super-packet into MTU-sized packets just before it), the switch forwards
packet by packet (its ports have GRO off), and each node's interface has GRO on, so a
receiver's kernel coalesces what survived, as a NIC's driver would.
"""

from __future__ import annotations

import functools
import ipaddress
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from . import netns, offload, qdisc
from .errors import TestbedError

NODE_IFACE = "eth0"
SERVER = "server"
SWITCH = "sw"
MAX_WORKERS = 64

T = TypeVar("T")



def port_name(node: str) -> str:
    """The switch-side veth toward ``node``."""
    return f"to-{node}"


def with_rtnl(namespace: str, fn: Callable[[Any], T]) -> T:
    """``fn(ipr)`` with an rtnetlink socket inside ``namespace``. (pyroute2 keeps its
    socket per thread and makes it in the thread's namespace: made and used in one
    thread that entered the namespace, it talks to that namespace.)"""
    from pyroute2 import IPRoute

    def run() -> T:
        with IPRoute() as ipr:
            return fn(ipr)

    return netns.call_in(namespace, run)


@dataclass(frozen=True)
class Topology:
    """Names and addresses of a testbed called ``name`` (prefix + id)."""

    name: str
    id: str
    workers: int
    subnet: str
    mtu: int

    @property
    def worker_nodes(self) -> tuple[str, ...]:
        return tuple(f"w{i}" for i in range(self.workers))

    @property
    def nodes(self) -> tuple[str, ...]:
        return (SERVER, *self.worker_nodes)

    def namespaces(self) -> dict[str, str]:
        """node -> namespace name, the switch (``"sw"``) included."""
        out = {n: f"{self.name}-{n}" for n in self.nodes}
        out[SWITCH] = f"{self.name}-{SWITCH}"
        return out

    @property
    def addresses(self) -> dict[str, str]:
        """node -> IPv4 address: the server takes the subnet's first host address,
        worker ``wi`` the (i+2)-th."""
        net = ipaddress.ip_network(self.subnet, strict=False)
        return {n: str(net.network_address + 1 + i) for i, n in enumerate(self.nodes)}

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet, strict=False).prefixlen

    def mac(self, node: str, *, switch_side: bool = False) -> str:
        """A locally administered unicast MAC (leading 0x02, or 0x06 for the switch's
        port toward the node) made of the testbed id and the node's index: unique per
        interface and per testbed."""
        i = self.nodes.index(node)
        b = bytes.fromhex(self.id)
        return ":".join(f"{octet:02x}" for octet in (0x06 if switch_side else 0x02,
                                                     b[0], b[1], b[2], i >> 8, i & 0xFF))

    # -- building ---------------------------------------------------------------------

    def build(self) -> None:
        """Create every namespace and link. The caller removes the namespaces if this
        raises (whatever was made lives in them)."""
        ours = self.namespaces()
        for ns in ours.values():
            netns.create(ns)
        for ns in ours.values():  # no IPv6: no DAD/MLD/RS chatter through the bottleneck
            netns.write_sysctls(ns, {f"net/ipv6/conf/{k}/disable_ipv6": "1"
                                     for k in ("all", "default")}, strict=False)
        # The switch routes (IPv4 forwarding) rather than bridges: a routed packet passes
        # the switch's forward hook, where the loss rules drop it one wire packet at a
        # time before the receiver's GRO; bridged frames would reach nf_tables only
        # through br_netfilter, a host-wide module we cannot count on.
        netns.write_sysctls(ours[SWITCH], {
            "net/ipv4/ip_forward": "1",
            **{f"net/ipv4/conf/{k}/{s}": "0" for k in ("all", "default")
               for s in ("rp_filter", "send_redirects")}})
        with_rtnl(ours[SWITCH], self._build_switch)
        for n in self.nodes:
            with_rtnl(ours[n], functools.partial(self._build_node, node=n))
        self._set_offloads()

    def _build_switch(self, ipr: Any) -> None:
        ours, addrs = self.namespaces(), self.addresses
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        for n in self.nodes:
            port = port_name(n)
            ipr.link("add", ifname=port, kind="veth", mtu=self.mtu,
                     address=self.mac(n, switch_side=True),
                     peer={"ifname": NODE_IFACE, "mtu": self.mtu, "address": self.mac(n),
                           "net_ns_fd": netns.path(ours[n])})
            idx = ipr.link_lookup(ifname=port)[0]
            ipr.link("set", index=idx, state="up")
            ipr.route("replace", dst=f"{addrs[n]}/32", oif=idx)
            # static neighbours: no ARP, so a saturated bottleneck cannot starve
            # address resolution (which would look like loss no knob asked for)
            ipr.neigh("replace", dst=addrs[n], lladdr=self.mac(n), ifindex=idx,
                      state="permanent")
            qdisc.set_queue(ipr, idx, None)

    def _build_node(self, ipr: Any, node: str) -> None:
        addrs = self.addresses
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        idx = ipr.link_lookup(ifname=NODE_IFACE)[0]
        ipr.addr("add", index=idx, address=addrs[node], prefixlen=self.prefixlen)
        ipr.link("set", index=idx, state="up")
        # every other node is on-link, reached through the switch's port
        for m in self.nodes:
            if m != node:
                ipr.neigh("replace", dst=addrs[m], lladdr=self.mac(node, switch_side=True),
                          ifindex=idx, state="permanent")

    def _set_offloads(self) -> None:
        ours = self.namespaces()
        for n in self.nodes:
            # wire-size packets on every link (segmentation offloads off: the kernel cuts
            # super-packets into MTU-sized ones before the link, one system call still)
            # and GRO on (what survived the switch is coalesced on arrival)
            now = netns.call_in(ours[n], lambda: offload.as_on_a_wire(NODE_IFACE, gro=True))
            _require_wire_size(now, f"{n}'s {NODE_IFACE}")
            if not now.get(offload.GRO):
                # (a kernel whose veths cannot coalesce: the receivers get the packets
                # one by one, as before veth GRO existed - fewer offloads, not wrong
                # packets)
                print(f"boundedloss: {n}'s {NODE_IFACE} cannot coalesce (GRO) here; "
                      "it receives packet by packet", file=sys.stderr)
        # the switch's ports: GRO off (the loss rules see each wire packet), and TSO off,
        # without which a veth does not coalesce at its peer, the receiving node
        for n in self.nodes:
            now = netns.call_in(ours[SWITCH],
                               lambda n=n: offload.as_on_a_wire(port_name(n), gro=False))
            _require_wire_size(now, f"the switch's {port_name(n)}")
            if now.get(offload.GRO):
                raise TestbedError(f"could not turn {offload.GRO} off on the switch's "
                                 f"{port_name(n)}: its drops would not be per wire packet")


def _require_wire_size(features: dict[str, bool], where: str) -> None:
    left = [f for f in offload.SEGMENTATION_FEATURES if features.get(f)]
    if left:
        raise TestbedError(f"could not turn off {', '.join(left)} on {where}")
