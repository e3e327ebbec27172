"""The real-kernel testbed (boundedloss.emulate).

The kernel tests need root (CAP_NET_ADMIN + CAP_SYS_ADMIN), network namespaces and
nf_tables - the kernel alone: no ``ip``, ``tc``, ``iptables`` or ``nft`` binary is used
(CI runs them with none on PATH); without them they are skipped with the reason. The
parsing/validation tests and the "no root -> one clear line" tests run everywhere.

Every testbed here is torn down in a ``finally`` (fixtures) or by its context manager,
so a failing assertion leaves nothing behind; each traffic tool is bounded in datagrams
and seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from click.testing import CliRunner

from boundedloss.emulate import (
    NEED_ROOT,
    Bottleneck,
    LossSchedule,
    Testbed,
    TestbedConfig,
    TestbedError,
    available,
    host,
    leftovers,
    list_namespaces,
    netns,
    nft,
    parse_rate,
    parse_size,
    tcp_counters,
)
from boundedloss.emulate import testbed as testbed_mod
from boundedloss.emulate.cli import testbed as cli_group
from boundedloss.emulate.topology import with_rtnl
from boundedloss.protocol.credit import CREDIT_AUTO

KERNEL_OK, KERNEL_WHY = available()
needs_kernel = pytest.mark.skipif(
    not KERNEL_OK,
    reason=f"kernel testbed needs root, network namespaces and nf_tables: {KERNEL_WHY}",
)


def _prefix() -> str:
    """A prefix no other testbed (another test run in parallel, a user's) shares."""
    return f"blt{secrets.token_hex(2)}-"


def _root_links() -> str:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return " ".join(link.get_attr("IFLA_IFNAME") for link in ipr.get_links())


def _assert_gone(tb: Testbed) -> None:
    """No namespace of ours (and with them their links, qdiscs and drop rules), no
    link named like ours here, no namespace file left."""
    ours = set(tb.namespaces().values())
    assert not ours & set(list_namespaces())
    assert tb.name not in _root_links()
    assert leftovers(tb.config.prefix) == []
    assert not any(os.path.exists(netns.path(ns)) for ns in ours)


def _link_stats(bed, node: str) -> dict:
    """The switch's port toward ``node``: its 64-bit counters (rtnetlink)."""
    port = bed.port_of(node)
    return with_rtnl(bed.switch_namespace,
                     lambda ipr: dict(ipr.get_links(ifname=port)[0].get_attr("IFLA_STATS64")))


# ------------------------------------------------------------------ everywhere (no root)


def test_units_follow_tc():
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("12.5mbps") == 100_000_000  # tc: bps is BYTES per second
    assert parse_size("32kb") == 32 * 1024
    assert parse_size("1514b") == parse_size(1514) == 1514
    assert parse_size("1mbit") == 1024 * 1024 // 8
    for bad in ("fast", "10 parsecs", "-1mbit", "0kbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_config_validation():
    with pytest.raises(ValueError, match="private"):
        TestbedConfig(subnet="8.8.8.0/24")
    with pytest.raises(ValueError, match="too few"):
        TestbedConfig(workers=8, subnet="10.201.0.0/29")
    with pytest.raises(ValueError, match="prefix"):
        TestbedConfig(prefix="")
    with pytest.raises(ValueError, match="prefix"):
        TestbedConfig(prefix="a b")
    with pytest.raises(ValueError, match="below one frame"):  # tbf's real minimum
        TestbedConfig(mtu=1500, bottleneck=Bottleneck("10mbit", "1kb", "64kb"))
    TestbedConfig(mtu=1500, bottleneck=Bottleneck("10mbit", "1514b", "1514b"))
    with pytest.raises(ValueError):
        TestbedConfig(loss=1.5)
    tb = Testbed(workers=3, subnet="10.201.7.0/24")
    assert tb.addresses == {"server": "10.201.7.1", "w0": "10.201.7.2", "w1": "10.201.7.3",
                            "w2": "10.201.7.4"}
    assert tb.node(2) == tb.node("2") == "w2" and tb.node(tb.namespace("w1")) == "w1"
    with pytest.raises(TestbedError, match="unknown node"):
        tb.node("w3")
    assert TestbedConfig.from_dict(
        TestbedConfig(bottleneck=Bottleneck("5mbit")).to_dict()).bottleneck == Bottleneck("5mbit")


def _decoded(messages) -> list:
    """The rule messages as the kernel would list them: encoded, then decoded."""
    from pyroute2.netlink.nfnetlink.nftsocket import nft_rule_msg

    sock = nft.NftSocket.__new__(nft.NftSocket)  # (encode needs no socket)
    sock._seq = iter(range(1, 1000))  # noqa: SLF001
    out = []
    for m in messages:
        inner = sock.encode([m]).data[20:]  # after the batch's begin message
        r = nft_rule_msg(inner)
        r.decode()
        out.append(r)
    return out


def test_the_netlink_constants_are_the_kernels():
    """nft.py keeps its own copy of the netlink flags and nf_tables message types (so that
    a command's start does not import pyroute2): each equals pyroute2's."""
    from pyroute2.netlink import nfnetlink
    from pyroute2.netlink import nlsocket as netlink
    from pyroute2.netlink.nfnetlink import nftsocket

    for name in ("NLM_F_REQUEST", "NLM_F_ACK", "NLM_F_REPLACE", "NLM_F_CREATE",
                 "NLM_F_APPEND", "NLM_F_DUMP"):
        assert getattr(nft, name) == getattr(netlink, name), name
    assert nft.NFNL_SUBSYS_NFTABLES == nfnetlink.NFNL_SUBSYS_NFTABLES
    for name in ("NFT_MSG_NEWTABLE", "NFT_MSG_NEWCHAIN", "NFT_MSG_DELCHAIN", "NFT_MSG_NEWRULE",
                 "NFT_MSG_GETRULE", "NFT_MSG_DELRULE"):
        assert getattr(nft, name) == getattr(nftsocket, name), name


def test_a_loss_chain_reads_back_as_it_was_written():
    """The rules set_loss writes, read back as a dump shows them: the probability (to
    1e-9), the protocol, and which forward rule counts what goes to the node."""
    from boundedloss.emulate import loss_rules as lr

    for p, proto in ((0.05, "udp"), (0.123456789, "all"), (0.0, "udp"), (1.0, "all")):
        chain = lr.loss_chain("w3")
        msgs = [nft.rule_msg(lr.TABLE, lr.FORWARD, [*nft.oifname_is("to-w3"), nft.counter(),
                                                    nft.verdict(nft.JUMP, chain)])]
        if proto == "udp":
            msgs.append(nft.rule_msg(lr.TABLE, chain, [*nft.l4proto_is_not(17),
                                                       nft.verdict(nft.RETURN)]))
        msgs += [nft.rule_msg(lr.TABLE, chain, lr._gate(p)),  # noqa: SLF001
                 nft.rule_msg(lr.TABLE, chain, [nft.counter(), nft.verdict(nft.DROP)])]
        rules = _decoded(msgs)
        rules[-2]["attrs"].append(["NFTA_RULE_HANDLE", 42])
        view = lr._ChainView.of(rules, "w3")  # noqa: SLF001
        assert (view.gate, view.probability, view.protocol) == (42, p, proto)
        other = lr._ChainView.of(rules, "w2")  # noqa: SLF001
        assert other.gate is None and other.protocol is None


def test_schedule_change_points():
    s = LossSchedule([(0.2, 0.5, 0.3), (0.4, 0.6, 0.9)], base=0.01)
    assert s.change_points() == [(0.0, 0.01), (0.2, 0.3), (0.4, 0.9), (0.6, 0.01)]
    assert s.loss_at(0.45) == 0.9 and s.loss_at(0.7) == 0.01 and s.duration == 0.6
    with pytest.raises(ValueError):
        LossSchedule([(0.5, 0.2, 0.1)])
    with pytest.raises(ValueError):
        LossSchedule([(0, 1, 2.0)])


def test_without_privileges_one_clear_line(monkeypatch, tmp_path):
    """Without root, where user namespaces cannot be had either, every testbed command
    fails in one line that says so and why (the library's Testbed in one line too)."""
    from boundedloss.emulate import rootless

    monkeypatch.setattr(host, "_effective_caps", lambda: 0)
    monkeypatch.delenv(rootless.INSIDE, raising=False)
    monkeypatch.setattr(rootless, "possible", lambda: (False, "no user namespaces here"))
    with pytest.raises(TestbedError) as e:
        Testbed(workers=2).up()
    assert str(e.value) == NEED_ROOT and "\n" not in str(e.value)
    runner = CliRunner()
    for args in (["up", "--workers", "2"], ["down"], ["status"], ["run", "--node", "w0", "true"],
                 ["set", "--loss", "0.1"]):
        r = runner.invoke(cli_group, [*args, "--state-dir", str(tmp_path)])
        assert r.exit_code in (1, 2), r.output
        assert r.exception is None or isinstance(r.exception, SystemExit)
        assert r.output.strip() == ("Error: the kernel testbed needs root or unprivileged "
                                    "user namespaces: no user namespaces here"), args


def test_tcp_counters_parse_the_kernels_tables():
    """Each table's names line pairs with its values line; fields this kernel lacks
    read 0, and a pair that does not match is skipped rather than misread."""
    text = ("Tcp: RtoAlgorithm OutSegs RetransSegs\nTcp: 1 1200 37\n"
            "TcpExt: TCPTimeouts TCPLossProbes\nTcpExt: 4 9\n"
            "IpExt: InOctets OutOctets\nIpExt: 5\n")
    tables = tcp_counters.parse_tables(text)
    assert tables[("Tcp", "OutSegs")] == 1200 and ("IpExt", "InOctets") not in tables
    picked = tcp_counters.pick(tables)
    assert (picked["tcp_out_segs"], picked["tcp_retrans_segs"], picked["tcp_timeouts"],
            picked["tcp_loss_probes"], picked["tcp_fast_retrans"]) == (1200, 37, 4, 9, 0)
    assert tcp_counters.difference(picked, {**picked, "tcp_timeouts": 6})["tcp_timeouts"] == 2


# ------------------------------------------------------------------ kernel (root)


@pytest.fixture(scope="module")
def tb():
    bed = Testbed(workers=8, prefix=_prefix())
    bed.up()
    try:
        yield bed
    finally:
        bed.down()
        _assert_gone(bed)


@pytest.fixture
def bed(tb):
    """The shared testbed, reset to no bottleneck and no loss after each test."""
    try:
        yield tb
    finally:
        tb.set_bottleneck(None)
        for node in tb.nodes:
            tb.set_loss(0, node)


@needs_kernel
def test_tcp_between_namespaces(bed):
    """What a torch rendezvous needs: TCP from every worker to the server's address,
    and between workers."""
    server = bed.run("server", [sys.executable, "-c", (
        "import socket,sys\n"
        "s=socket.create_server(('0.0.0.0',29500)); s.settimeout(10)\n"
        "print('READY',flush=True); got=[]\n"
        f"for _ in range({len(bed.workers)}):\n"
        "    c,a=s.accept(); c.settimeout(5); got.append(c.recv(16).decode())\n"
        "    c.sendall(b'ok'); c.close()\n"
        "print(','.join(sorted(got)))\n")], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "READY"
    client = ("import socket,sys\n"
              "c=socket.create_connection((sys.argv[1],29500),timeout=5)\n"
              "c.sendall(sys.argv[2].encode()); assert c.recv(2)==b'ok'\n")
    procs = [bed.run(w, [sys.executable, "-c", client, bed.addresses["server"], w])
             for w in bed.workers]
    assert [p.wait(timeout=15) for p in procs] == [0] * len(procs)
    out, _ = server.communicate(timeout=15)
    assert out.strip() == ",".join(sorted(bed.workers))
    # torch's Gloo must bind eth0 (the host name resolves outside the namespace)
    assert bed.call("w2", ["sh", "-c", "echo $GLOO_SOCKET_IFNAME"]).stdout.strip() == "eth0"
    assert bed.call("w2", ["sh", "-c", "echo ${BOUNDEDLOSS_UDP_GSO-unset}"]).stdout.strip() \
        == "unset"  # our endpoints keep offload on: the links carry wire-size packets
    # worker to worker
    p7 = bed.run("w7", [sys.executable, "-c",
                        "import socket\n"
                        "s=socket.create_server(('0.0.0.0',29502)); s.settimeout(10)\n"
                        "print('READY',flush=True); a,_=s.accept(); print(a.recv(8).decode())"],
                 stdout=subprocess.PIPE, text=True)
    assert p7.stdout.readline().strip() == "READY"
    bed.call("w1", [sys.executable, "-c",
                    "import socket,sys; socket.create_connection((sys.argv[1],29502),timeout=5)"
                    ".sendall(b'hi-w7')", bed.addresses["w7"]], timeout=15, check=True)
    assert p7.communicate(timeout=10)[0].strip() == "hi-w7"


@needs_kernel
def test_random_loss_matches_configured_rate(bed):
    p, n = 0.1, 20_000
    bed.set_loss(p)
    stats = bed.loss_stats()
    assert (stats.probability, stats.protocol) == (p, "udp")
    sink = bed.sink("server", 9100, idle=0.3, max_time=20, expect=n)
    sent = bed.send("w0", "server", 9100, count=n, size=32, duration=15).wait()
    got = sink.wait()
    assert sent["sent"] == n and sent["errors"] == 0
    assert got["rcvbuf_errors"] == 0  # the socket dropped nothing: all loss is the rule's
    unique = got["flows"][str(bed.nodes.index("w0"))]["unique"]
    measured = 1 - unique / n
    assert abs(measured - p) < 0.02, f"measured loss {measured:.4f}, configured {p}"
    assert bed.loss_stats().dropped_packets == n - unique  # the kernel counted the same
    bed.set_loss(0)
    after = bed.loss_stats()  # the node's rules removed: nothing of ours on its way
    assert (after.probability, after.protocol, after.seen_packets) == (0.0, None, 0)


_TCP_BULK = ("import socket,sys\n"
             "c=socket.create_connection((sys.argv[1],9400),timeout=30)\n"
             "c.sendall(bytes(8<<20)); c.close()\n")
_TCP_SINK = ("import socket\n"
             "s=socket.create_server(('0.0.0.0',9400)); s.settimeout(30); c,_=s.accept()\n"
             "n=0\n"
             "while (d:=c.recv(1<<20)): n+=len(d)\n"
             "print(n)\n")
_UDP_GSO_SEND = ("import socket,sys\n"
                 "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                 "s.setsockopt(17,103,1400)\n"  # UDP_SEGMENT: 1,400-byte datagrams
                 "s.connect((sys.argv[1],9401))\n"
                 "for _ in range(500): s.send(bytes(45*1400))\n"
                 "print(500*45)\n")


@needs_kernel
def test_tcp_and_udp_cross_as_wire_size_packets_each_dropped_alone(bed):
    """A TCP stream and UDP_SEGMENT sends (45 datagrams a system call) arrive as
    MTU-sized packets, and the random drop takes each alone: its rate per wire packet
    is the configured one within 2 points, for TCP and for UDP."""
    p = 0.05
    bed.set_loss(p, "server", protocol="all")
    counted = bed.tcp_counters()
    sink = bed.run("server", [sys.executable, "-c", _TCP_SINK], stdout=subprocess.PIPE,
                   text=True)
    time.sleep(0.5)
    assert bed.run("w0", [sys.executable, "-c", _TCP_BULK, bed.addresses["server"]]).wait(60) == 0
    out, _ = sink.communicate(timeout=60)
    assert int(out) == 8 << 20  # TCP recovered every byte
    tcp = bed.loss_stats("server")
    assert tcp.seen_packets > (8 << 20) / 1500  # not 64 KB super-packets
    assert tcp.dropped_bytes / tcp.dropped_packets < 1600  # each drop one wire packet
    assert abs(tcp.dropped_packets / tcp.seen_packets - p) < 0.02
    # The nodes' own TCP counters saw the flow: its segments, and a retransmission for
    # about every packet the rule dropped - a dropped pure ACK of w0's (the handshake's,
    # the close's) needs none (the root namespace's counters would see none of it).
    counted = tcp_counters.difference(counted, bed.tcp_counters())
    assert counted["tcp_out_segs"] >= (8 << 20) // 1448
    assert counted["tcp_retrans_segs"] >= 0.9 * tcp.dropped_packets > 0
    assert counted["tcp_fast_retrans"] + counted["tcp_timeouts"] > 0
    bed.set_loss(0, "server")
    bed.set_loss(p, "server", protocol="udp")
    sink = bed.sink("server", 9401, idle=0.5, max_time=20)
    sender = bed.call("w1", [sys.executable, "-c", _UDP_GSO_SEND, bed.addresses["server"]])
    assert sender.returncode == 0, sender.stderr
    sent = int(sender.stdout)
    got = sink.wait()
    udp = bed.loss_stats("server")
    assert udp.seen_packets >= sent * 0.99  # 45 packets per system call, not one
    assert udp.dropped_bytes / udp.dropped_packets < 1500
    measured = 1 - got["received"] / sent
    assert abs(measured - p) < 0.02 and abs(udp.dropped_packets / sent - p) < 0.02


@needs_kernel
def test_a_udp_segment_sender_reaches_a_gro_endpoint_across_the_testbed(bed):
    """Our endpoints keep offload on in the testbed: a message sent with UDP_SEGMENT
    from one namespace arrives whole at a UDP_GRO endpoint in another."""
    code = ("import sys, numpy as np\n"
            "from boundedloss.net.udp import UdpEndpoint\n"
            "from boundedloss.protocol import TransportConfig\n"
            "role, peer_host = sys.argv[1], sys.argv[2]\n"
            "cfg = TransportConfig(peer_timeout=20.0, receive_deadline=20.0)\n"
            "data = np.random.default_rng(5).integers(0, 256, 4_000_000, dtype=np.uint8)\n"
            "with UdpEndpoint('0.0.0.0', 9402, session=7, config=cfg) as ep:\n"
            "    assert ep.segmentation_offload and ep.receive_offload\n"
            "    if role == 'rx':\n"
            "        r = ep.receive((peer_host, 9402), message_id=1, nbytes=data.nbytes)"
            ".result(30)\n"
            "        assert r.complete and np.array_equal(r.data, data)\n"
            "    else:\n"
            "        assert ep.send((peer_host, 9402), data, message_id=1).result(30).ok\n"
            "print('ok')\n")
    rx = bed.run("server", [sys.executable, "-c", code, "rx", bed.addresses["w2"]],
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    tx = bed.call("w2", [sys.executable, "-c", code, "tx", bed.addresses["server"]])
    out, _ = rx.communicate(timeout=60)
    assert tx.returncode == 0 and tx.stdout.strip() == "ok", tx.stdout + tx.stderr
    assert rx.returncode == 0 and out.strip().endswith("ok"), out


_UDP_GRO_SINK = ("import socket,struct,sys\n"
                 "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.bind(('0.0.0.0',9403))\n"
                 "s.setsockopt(17,104,1)\n"  # UDP_GRO: coalesced datagrams come in one read
                 "s.setsockopt(socket.SOL_SOCKET,33,64<<20)\n"  # SO_RCVBUFFORCE: keep all
                 "s.settimeout(2.0); print('ready', flush=True)\n"
                 "reads=datagrams=0\n"
                 "try:\n"
                 "    while True:\n"
                 "        d,anc,_,_=s.recvmsg(1<<16,64); reads+=1\n"
                 "        size=[struct.unpack('H',v[:2])[0] for l,t,v in anc if (l,t)==(17,104)]\n"
                 "        datagrams+=len(d)//size[0] if size else 1\n"
                 "except socket.timeout: pass\n"
                 "print(reads, datagrams)\n")


@needs_kernel
def test_the_receiver_coalesces_what_survived_the_switch(bed):
    """Drops happen per wire packet at the switch, before the receiver; the receiver's
    interface then coalesces what arrives (GRO), as a NIC's driver would: a UDP_GRO
    socket reads the surviving datagrams in far fewer reads than datagrams, and the
    loss per wire packet is still the configured one."""
    p = 0.05
    bed.set_loss(p, "server", protocol="udp")
    before = bed.loss_stats("server")
    sink = bed.run("server", [sys.executable, "-c", _UDP_GRO_SINK], stdout=subprocess.PIPE,
                   text=True)
    assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
    paced = _UDP_GSO_SEND.replace("9401", "9403").replace(
        "s.send(bytes(45*1400))", "s.send(bytes(45*1400)); time.sleep(0.001)")
    sender = bed.call("w1", [sys.executable, "-c", "import time\n" + paced,
                             bed.addresses["server"]])
    assert sender.returncode == 0, sender.stderr
    sent = int(sender.stdout)
    reads, datagrams = map(int, sink.communicate(timeout=30)[0].split())
    after = bed.loss_stats("server")
    dropped = after.dropped_packets - before.dropped_packets
    assert datagrams == sent - dropped  # every survivor delivered, whole
    assert abs(dropped / sent - p) < 0.02
    assert reads < datagrams / 4, f"{reads} reads for {datagrams} datagrams: no GRO"


_UDP_BLAST = ("import socket,sys\n"
              "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.setsockopt(17,103,1400)\n"
              "for _ in range(1000): s.sendto(bytes(45*1400),(sys.argv[1],9))\n")


def _link_tx_dropped(bed, node: str) -> int:
    return _link_stats(bed, node)["tx_dropped"]


@needs_kernel
def test_a_switch_port_queues_and_counts_every_packet_it_drops(bed):
    """Three workers blast UDP_SEGMENT runs at the server at memory speed: the switch's
    port holds what the receiver's ring cannot take in its queue (backpressure), and
    every packet it drops is the queue's, counted: none vanishes in the veth."""
    bed.set_bottleneck(None)
    before, veth_before = bed.qdisc_stats(), _link_tx_dropped(bed, "server")
    blasts = [bed.run(w, [sys.executable, "-c", _UDP_BLAST, bed.addresses["server"]])
              for w in ("w0", "w1", "w2")]
    assert [b.wait(60) for b in blasts] == [0, 0, 0]
    after = bed.qdisc_stats()
    assert after.kind == "pfifo"
    offered = 3 * 1000 * 45
    handled = (after.sent_packets - before.sent_packets) + (after.dropped - before.dropped)
    assert offered <= handled < offered + 200  # (+ what else crossed: a few stray packets)
    assert _link_tx_dropped(bed, "server") == veth_before


def _link_tx(bed, node: str) -> tuple[int, int]:
    """(packets, bytes) the switch's port toward ``node`` has sent: what left the tbf."""
    st = _link_stats(bed, node)
    return st["tx_packets"], st["tx_bytes"]


@needs_kernel
def test_tbf_queues_wire_packets(bed):
    """A TCP stream through the bottleneck leaves the tbf (the switch port toward the
    server, which counts every frame it hands on) as MTU-sized packets, not as 64 KB
    super-packets: the queue holds and meters what a wire would carry."""
    bed.set_bottleneck(Bottleneck("200mbit", "32kb", "256kb"))
    before = _link_tx(bed, "server")
    sink = bed.run("server", [sys.executable, "-c", _TCP_SINK], stdout=subprocess.PIPE,
                   text=True)
    time.sleep(0.5)
    assert bed.run("w3", [sys.executable, "-c", _TCP_BULK, bed.addresses["server"]]).wait(60) == 0
    sink.communicate(timeout=60)
    after = _link_tx(bed, "server")
    packets, nbytes = after[0] - before[0], after[1] - before[1]
    assert nbytes > 8 << 20 and packets > nbytes / 1600  # frames of at most ~1,514 B


@needs_kernel
def test_tbf_rate(bed):
    rate = 20_000_000
    bed.set_bottleneck(Bottleneck("20mbit", "32kb", "64kb"))
    sink = bed.sink("server", 9200, idle=0.3, max_time=15)
    sent = bed.send("w0", "server", 9200, size=1200, rate_mbit=40, duration=1.5).wait()
    got = sink.wait()
    assert sent["sent"] > 0 and got["received"] > 100
    # frames after the first, over the time between first and last arrival
    frame = 1200 + 42
    measured = (got["wire_bytes"] - frame) * 8 / got["span_s"]
    assert abs(measured / rate - 1) < 0.10, f"measured {measured / 1e6:.2f} Mbit/s"
    q = bed.qdisc_stats()
    assert q.kind == "tbf" and q.rate_bps == rate
    assert q.dropped > 0  # 40 Mbit/s offered into 20 Mbit/s with a 64 kB queue


@needs_kernel
def test_incast_into_shallow_queue_drops(bed):
    bed.set_bottleneck(Bottleneck("50mbit", "4kb", "8kb"))
    assert bed.qdisc_stats().dropped == 0
    sink = bed.sink("server", 9300, idle=0.3, max_time=15)
    senders = [bed.send(w, "server", 9300, size=1200, rate_mbit=20, duration=0.5)
               for w in bed.workers]
    sent = {str(bed.nodes.index(w)): s.wait()["sent"]
            for w, s in zip(bed.workers, senders, strict=True)}
    got = sink.wait()
    missing = sum(n - got["flows"].get(f, {"unique": 0})["unique"] for f, n in sent.items())
    q = bed.qdisc_stats()
    assert len(sent) == 8 and q.dropped > 0 and missing > 0
    assert got["rcvbuf_errors"] == 0
    assert abs(missing - q.dropped) <= 0.02 * sum(sent.values()) + 5  # the queue lost them


@needs_kernel
def test_microbursts_schedule_and_cross_traffic(bed):
    # (a) a loss step: 100 % loss for 0.3 s in the middle of a 1 s paced stream
    sink = bed.sink("server", 9400, idle=1.0, max_time=15)  # idle > the burst
    snd = bed.send("w0", "server", 9400, size=64, rate_mbit=0.848, duration=1.0)  # 1000/s
    with bed.loss_schedule([(0.3, 0.6, 1.0)]) as sched:
        assert sched.wait(timeout=5)
    sent, got = snd.wait(), sink.wait()
    assert [p for _, p in sched.applied] == [0.0, 1.0, 0.0]
    assert abs(sched.applied[1][0] - 0.3) < 0.1 and abs(sched.applied[2][0] - 0.6) < 0.1
    lost = sent["sent"] - got["flows"][str(bed.nodes.index("w0"))]["unique"]
    assert 0.2 * sent["sent"] < lost < 0.4 * sent["sent"], (lost, sent["sent"])
    assert bed.loss_stats().protocol is None  # back to base 0: no rule
    # (b) real cross-traffic through the bottleneck: 30 Mbit/s into 10 Mbit/s
    bed.set_bottleneck(rate="10mbit", burst="16kb", limit="32kb")
    t0 = time.monotonic()
    ct = bed.cross_traffic(0.5, 30)
    assert 0.4 < time.monotonic() - t0 < 5 and ct.done
    assert ct.result["sent"] > 0
    assert bed.qdisc_stats().dropped > 0


@needs_kernel
def test_a_loss_writer_changes_the_rule_in_place(bed):
    """The writer's transactions replace the node's rule (TCP and UDP alike, or UDP
    only), 0 leaves a rule that drops nothing, and bad input is a clear error."""
    from boundedloss.emulate import LossRuleWriter

    w = bed.loss_writer("w1")
    assert isinstance(w, LossRuleWriter)
    w.set(0.8)
    w.set(0.25)
    w.close()
    st = bed.loss_stats("w1")
    assert (st.probability, st.protocol) == (0.25, "all")
    w = bed.loss_writer("w1", protocol="udp")
    w.set(0)
    w.close()
    assert bed.loss_stats("w1").probability == 0.0
    bed.set_loss(0.1, "w1")  # set_loss takes over the same chain
    assert bed.loss_stats("w1").probability == 0.1
    with pytest.raises(ValueError):
        bed.loss_writer("w1").set(1.5)
    with pytest.raises(TestbedError, match="not the switch"):
        bed.loss_writer("sw")


@needs_kernel
def test_a_writer_keeps_counting_across_changes_and_another_process_rewrite(bed):
    """A writer's changes leave the counters running; where another process rewrote
    the node's rules (a new gate handle), the writer finds the new gate and goes on."""
    from boundedloss.emulate.loss_rules import LossRules

    w = bed.loss_writer("w2", protocol="all")
    w.set(1.0)
    assert bed.call("w0", [sys.executable, "-c", _UDP_BLAST_SMALL, bed.addresses["w2"]],
                    check=True).returncode == 0
    first = bed.loss_stats("w2")
    assert first.dropped_packets == first.seen_packets >= 100
    other = LossRules(bed.switch_namespace)  # another process's view of the same switch
    try:
        other.set("w2", 1.0, "all")  # written afresh: a new gate, counters from zero
    finally:
        other.close()
    w.set(0.0)
    w.set(1.0)  # the stale gate handle: found again, changed in place
    assert bed.call("w0", [sys.executable, "-c", _UDP_BLAST_SMALL, bed.addresses["w2"]],
                    check=True).returncode == 0
    after = bed.loss_stats("w2")
    assert after.probability == 1.0 and after.dropped_packets == after.seen_packets >= 100


_UDP_BLAST_SMALL = ("import socket,sys\n"
                    "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                    "for _ in range(100): s.sendto(bytes(64),(sys.argv[1],9))\n")


@needs_kernel
def test_a_batch_the_kernel_refuses_whole_is_an_error_not_a_wait():
    """The kernel refuses a batch it cannot take at all (here: its begin names no
    subsystem, as where nf_tables is missing) on the batch's own sequence number: that
    is an NftError with the kernel's errno, not a wait for answers that never come."""
    import dataclasses
    import struct

    ns = f"{_prefix()}{secrets.token_hex(3)}-probe"
    netns.create(ns)
    try:
        with nft.NftSocket(ns, timeout=60) as s:
            txn = s.encode([nft.table_msg("probe")])
            bad = bytearray(txn.data)
            struct.pack_into(">H", bad, 18, 99)  # the begin's nfgenmsg res_id
            with pytest.raises(nft.NftError) as e:
                s.send(dataclasses.replace(txn, data=bytes(bad)))
            assert "the transaction" in str(e.value) and e.value.errno > 0
            s.send(txn)  # the socket is still good: the real one goes through
    finally:
        netns.delete(ns)


def test_rounds_overlapping_a_burst():
    from boundedloss.emulate.bursts import rounds_overlapping

    rounds = [{"round": i, "start_mono_s": 10.0 + i, "end_mono_s": 10.9 + i} for i in range(5)]
    rounds.append({"round": 9})  # a round without times (an old log) is never a burst round
    assert rounds_overlapping([(11.5, 11.6), (12.95, 13.05)], rounds) == {1, 3}
    assert rounds_overlapping([(12.85, 13.05)], rounds) == {2, 3}  # one burst, two rounds
    assert rounds_overlapping([(10.9, 11.0)], rounds) == set()  # touching is not overlapping
    assert rounds_overlapping([], rounds) == set()


def test_timed_bursts_validation():
    from boundedloss.emulate import TimedBursts

    assert TimedBursts(0.8, 0.1, 0.01).describe() == "80% loss at server for 10 ms every 100 ms"
    for bad in [(1.5, 0.1, 0.01), (0.8, 0.1, 0.1), (0.8, 0.1, 0.0), (0.8, 1e5, 0.01)]:
        with pytest.raises(ValueError):
            TimedBursts(*bad)


@needs_kernel
def test_timed_bursts_drop_what_arrives_during_them(bed):
    """Bursts of 100% loss half the time into the server, under a paced stream: what is
    lost is what arrived during the bursts the runner logged; after stop() the base
    loss is back."""
    from boundedloss.emulate import TimedBursts

    sink = bed.sink("server", 9410, idle=1.0, max_time=15)
    snd = bed.send("w0", "server", 9410, size=64, rate_mbit=0.848, duration=1.0)  # 1000/s
    t0 = time.monotonic()
    with TimedBursts(rate=1.0, every_s=0.1, length_s=0.05).start(bed) as runner:
        time.sleep(1.0)
    sent, got = snd.wait(), sink.wait()
    windows = runner.windows_between(t0, t0 + 1.0)
    assert len(windows) >= 3
    assert all(b - a >= 0.045 for a, b in windows)  # each burst lasted its length
    in_bursts = sum(min(b, t0 + 1.0) - a for a, b in windows) / 1.0
    lost = 1 - got["flows"][str(bed.nodes.index("w0"))]["unique"] / sent["sent"]
    assert abs(lost - in_bursts) < 0.2, (lost, in_bursts)
    assert bed.loss_stats().probability == 0.0  # back to the base


@needs_kernel
def test_status_reports_kernel_state(bed):
    bed.set_bottleneck(Bottleneck("30mbit", "16kb", "32kb"))
    bed.set_loss(0.25, "w3", protocol="all")
    st = bed.status()
    assert st.up and all(st.namespaces.values())
    assert st.addresses == bed.addresses
    assert st.qdisc.kind == "tbf" and st.qdisc.rate_bps == 30_000_000
    assert (st.loss["w3"].probability, st.loss["w3"].protocol) == (0.25, "all")
    assert st.loss["server"].protocol is None


@needs_kernel
def test_teardown_leaves_nothing():
    prefix = _prefix()
    prev = signal.getsignal(signal.SIGTERM)
    with Testbed(workers=2, prefix=prefix, mtu=4000, bottleneck=Bottleneck("10mbit"),
                 loss=0.1) as t:
        assert signal.getsignal(signal.SIGTERM) != prev  # guarded while up
        assert with_rtnl(t.namespace("w1"), lambda ipr: ipr.get_links(
            ifname="eth0")[0].get_attr("IFLA_MTU")) == 4000
        assert t.loss_stats().probability == 0.1 and t.qdisc_stats().kind == "tbf"
        sleeper = t.run("w0", ["sleep", "30"])
        # runtime removal of qdisc and rule
        t.set_bottleneck(None)
        assert t.qdisc_stats().kind != "tbf"
        t.set_loss(0)
        assert t.loss_stats().protocol is None  # rules, jump and chain removed
        t.set_loss(0.1)
    assert sleeper.poll() is not None  # ended, not orphaned in a deleted namespace
    assert signal.getsignal(signal.SIGTERM) == prev
    _assert_gone(t)

    # an exception inside the block still tears down
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(workers=1, prefix=prefix) as t2:
            raise RuntimeError("boom")
    _assert_gone(t2)

    # SIGTERM while up unwinds through the teardown, then the old handler is back
    with pytest.raises(SystemExit):
        with Testbed(workers=1, prefix=prefix) as t3:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) == prev
    _assert_gone(t3)


#: exit 7 when this node reaches argv[1] from the address argv[2] (its own)
_EXIT_7_IF_SOURCE_IS = ("import socket,sys\n"
                        "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                        "s.connect((sys.argv[1],9))\n"
                        "sys.exit(7 if s.getsockname()[0]==sys.argv[2] else 1)\n")


@needs_kernel
def test_cli_up_status_run_down(tmp_path):
    prefix = _prefix()
    common = ["--prefix", prefix, "--state-dir", str(tmp_path)]
    runner = CliRunner()
    try:
        r = runner.invoke(cli_group, ["up", "--workers", "2", "--rate", "20mbit",
                                        "--loss", "0.05", "--subnet", "10.201.9.0/24", *common])
        assert r.exit_code == 0, r.output
        assert "10.201.9.1" in r.output and (tmp_path / f"{prefix}testbed.json").exists()
        r = runner.invoke(cli_group, ["up", *common])
        assert r.exit_code == 1 and "already up" in r.output
        r = runner.invoke(cli_group, ["status", *common])
        assert r.exit_code == 0 and "loss 0.05 (udp)" in r.output and "tbf rate 20mbit" in r.output
        r = runner.invoke(cli_group, ["run", "--node", "w1", *common, "--", sys.executable,
                                        "-c", _EXIT_7_IF_SOURCE_IS, "10.201.9.1", "10.201.9.3"])
        assert r.exit_code == 7
        r = runner.invoke(cli_group, ["set", "--loss", "0", *common])
        assert r.exit_code == 0, r.output
        r = runner.invoke(cli_group, ["down", *common])
        assert r.exit_code == 0 and "removed 4" in r.output
        assert leftovers(prefix) == [] and not (tmp_path / f"{prefix}testbed.json").exists()
        # down with no state file still finds leftovers by name
        Testbed(workers=1, prefix=prefix).up()
        assert len(leftovers(prefix)) == 3
        r = runner.invoke(cli_group, ["down", *common])
        assert r.exit_code == 0 and "removed 3" in r.output
    finally:
        testbed_mod.sweep(prefix)
    assert leftovers(prefix) == []


@needs_kernel
def test_the_testbed_needs_no_network_tool_on_path(tmp_path):
    """up, status, run, set and down with nothing on PATH but the interpreter's folder:
    the testbed is the kernel's and pip's alone (no ip, tc, iptables or nft)."""
    prefix = _prefix()
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    for tool in ("ip", "tc", "iptables", "nft"):
        assert shutil.which(tool, path=env["PATH"]) is None, tool

    def tb(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "boundedloss.cli", "testbed", args[0],
                               "--prefix", prefix, "--state-dir", str(tmp_path), *args[1:]],
                              capture_output=True, text=True, timeout=120, env=env)

    try:
        up = tb("up", "--workers", "2", "--rate", "20mbit", "--loss", "0.05")
        assert up.returncode == 0, up.stdout + up.stderr
        st = tb("status")
        assert "loss 0.05 (udp)" in st.stdout and "tbf rate 20mbit" in st.stdout, st
        r = tb("run", "--node", "w1", "--", sys.executable, "-c", _EXIT_7_IF_SOURCE_IS,
               "10.201.0.1", "10.201.0.3")
        assert r.returncode == 7, r.stdout + r.stderr
        assert tb("set", "--loss", "0.2", "--node", "w0").returncode == 0
        down = tb("down")
        assert down.returncode == 0 and "removed 4" in down.stdout, down
        assert leftovers(prefix) == []
    finally:
        testbed_mod.sweep(prefix)


_LOOPBACK_ECHO = ("import socket,sys\n"
                  "from boundedloss.emulate import rootless\n"
                  "if sys.argv[1] == 'up': rootless.loopback_up()\n"
                  "s=socket.create_server(('127.0.0.1',0))\n"
                  "try: socket.create_connection(s.getsockname(),timeout=5)\n"
                  "except OSError as e: sys.exit(f'{e.strerror}')\n")


@needs_kernel
def test_a_command_inside_a_fresh_namespace_has_loopback():
    """What a command re-run in a user namespace of its own meets: a network namespace
    whose lo is down (a rendezvous on 127.0.0.1 fails), until loopback_up, which the
    CLI calls first thing in there, brings it up."""
    ns = f"{_prefix()}{secrets.token_hex(3)}-probe"
    netns.create(ns)
    try:
        down = subprocess.run(netns.enter_argv(ns, [sys.executable, "-c", _LOOPBACK_ECHO,
                                                   "as-is"]), capture_output=True, text=True)
        assert down.returncode != 0 and "unreachable" in down.stderr.lower(), down.stderr
        up = subprocess.run(netns.enter_argv(ns, [sys.executable, "-c", _LOOPBACK_ECHO, "up"]),
                            capture_output=True, text=True)
        assert up.returncode == 0, up.stderr
    finally:
        netns.delete(ns)


# ----------------------------------------------------------- rootless (user namespace)
def _unprivileged() -> list[str]:
    """The command prefix that runs as the unprivileged user (BOUNDEDLOSS_TEST_UID, which
    CI creates; else nobody), or a pytest skip saying why it cannot here."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a command as an unprivileged user")
    uid = os.environ.get("BOUNDEDLOSS_TEST_UID", "65534")
    # (our PATH: in CI it holds no ip, tc, iptables or nft - nor must the user's)
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "env",
              f"PATH={os.path.dirname(sys.executable)}:{os.environ.get('PATH', '/usr/bin:/bin')}"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import boundedloss.cli"],
                           capture_output=True, text=True, timeout=60, cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"the package is not usable by uid {uid} here: "
                    f"{probe.stderr.strip().splitlines()[-1:]}")
    userns = subprocess.run([*prefix, "unshare", "--user", "--map-root-user", "--net", "true"],
                            capture_output=True, text=True, timeout=30, cwd="/")
    if userns.returncode != 0:
        pytest.skip(f"this kernel forbids unprivileged user namespaces: {userns.stderr.strip()}")
    return prefix


def _their_processes(prefix: list[str]) -> int:
    """The unprivileged user's processes, zombies aside (an exited process its parent
    has not reaped yet is gone for every purpose here)."""
    uid = prefix[1].split("=")[1]
    ps = subprocess.run(["ps", "-o", "stat=", "-u", uid], capture_output=True, text=True)
    return sum(not st.startswith("Z") for st in ps.stdout.split())


def _processes_left(prefix: list[str], timeout: float = 10.0) -> int:
    """The user's processes once they are gone, or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while _their_processes(prefix) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _their_processes(prefix)


@contextlib.contextmanager
def _their_workdir(prefix: list[str]):
    """A folder the unprivileged user can write; afterwards it is gone, and so is every
    process of the user's, and no namespace was left in the host's /run/netns."""
    work = tempfile.mkdtemp()
    os.chmod(work, 0o777)
    before = list_namespaces()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert list_namespaces() == before
    assert _processes_left(prefix) == 0


def test_a_kernel_loss_round_runs_from_the_last_rank_in_to_the_last_rank_out():
    """A rank the barrier releases late (a TCP timeout in the harness, not the exchange)
    does not add its delay to the round: the others wait for its data, and the round is
    timed from when it came in."""
    from boundedloss.bench.kernel_loss import round_latencies_ms

    on_time = {"start": [10.0, 20.0], "end": [10.25, 20.04]}  # waited for the late one
    late = {"start": [10.2, 20.0], "end": [10.24, 20.05]}  # left the barrier 200 ms late
    assert round_latencies_ms([on_time, late]) == pytest.approx([50.0, 50.0])


def test_kernel_loss_rows_time_the_barrier_between_rounds_and_the_ranks_cpu():
    """Between rounds runs from the last rank out of one to the last rank into the
    next; the entry spread from the first rank into a round to the last; the ranks' CPU
    a round from entering the barrier to leaving the round, all
    ranks together, and of it the barrier's part."""
    from boundedloss.bench.kernel_loss import between_rounds_ms, entry_offsets_ms, ranks_cpu_ms

    # (process CPU marks per round: at the barrier, at the start, at the end)
    a = {"start": [1.0, 1.1], "end": [1.05, 1.16], "cpu": [(0.0, 0.001, 0.011),
                                                        (0.011, 0.013, 0.023)]}
    b = {"start": [1.01, 1.12], "end": [1.06, 1.15], "cpu": [(0.0, 0.002, 0.006),
                                                         (0.006, 0.007, 0.011)]}
    assert between_rounds_ms([a, b]) == pytest.approx([60.0])  # 1.12 - 1.06
    # (the spread: 1.01 - 1.0, 1.12 - 1.1)
    assert entry_offsets_ms([a["start"], b["start"]])[:, -1] == pytest.approx([10.0, 20.0])
    c = {"start": [1.005, 1.1], "end": [1.06, 1.16], "cpu": []}
    # (in the order the ranks came: a, c, b in the first round; a and c, then b in the next)
    entries = entry_offsets_ms([a["start"], b["start"], c["start"]])
    assert entries.tolist() == [pytest.approx([0.0, 5.0, 10.0]), pytest.approx([0.0, 0.0, 20.0])]
    whole, barrier = ranks_cpu_ms([a, b])
    assert whole == pytest.approx((11 + 12 + 6 + 5) / 2)
    assert barrier == pytest.approx((1 + 2 + 2 + 1) / 2)


def test_kernel_loss_repeats_interleave_every_arm_alike():
    """With repeats each arm runs once per repeat, every other repeat in reverse order:
    each arm's runs sit at mirrored places in the sequence, so a steady drift in the
    machine's speed weighs on every arm alike."""
    from boundedloss.bench.kernel_loss import interleaved

    arms = [("gloo", "gloo", False), ("dblp", "ps", True), ("dblp", "allreduce", True)]
    order = interleaved(arms, 4)
    assert order == arms + arms[::-1] + arms + arms[::-1]
    places = {arm: [i for i, a in enumerate(order) if a == arm] for arm in arms}
    assert len({sum(p) for p in places.values()}) == 1  # (the same mean place)
    assert interleaved(arms, 1) == arms


@needs_kernel
def test_kernel_loss_runs_the_world_asked_for(tmp_path):
    """bench kernel-loss --ranks N: N ranks (the server's namespace and N - 1 workers'),
    every row saying so; a world beyond the bench's range is one line before anything
    starts."""
    out = tmp_path / "k.json"
    p = subprocess.run([sys.executable, "-m", "boundedloss.cli", "bench", "kernel-loss",
                        "--systems", "reliable,tcp-ps", "--losses", "0.01", "--rounds", "3",
                        "--elements", "65536", "--topology", "allreduce", "--ranks", "6",
                        "--credit", "off,64k,auto", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())
    # (--credit: an arm each for our transport, auto's floor its bytes; TCP has none)
    assert [(r["system"], r["ranks"], r["credit_bytes"], r["credit_adaptive"])
            for r in rows] == [
        ("reliable", 6, None, False), ("reliable", 6, 65536, False),
        ("reliable", 6, CREDIT_AUTO.budget_bytes, True), ("tcp-ps", 6, None, False)]
    assert all(r["delivered_fraction"] == 1.0 for r in rows)
    assert rows[-1]["tcp_retrans_segs_per_round"] > 0  # (Linux's TCP recovered the 1%)
    assert "6-rank exchange" in p.stdout
    bad = subprocess.run([sys.executable, "-m", "boundedloss.cli", "bench", "kernel-loss",
                          "--ranks", "17"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "--ranks" in bad.stderr


def test_kernel_loss_runs_without_root_in_a_user_namespace_of_its_own():
    """bench kernel-loss as an unprivileged user: the testbed runs as root of a user
    namespace of its own, and nothing is left behind in the host's namespaces."""
    prefix = _unprivileged()
    with _their_workdir(prefix) as work:
        p = subprocess.run([*prefix, sys.executable, "-m", "boundedloss.cli", "bench",
                            "kernel-loss", "--systems", "reliable,tcp-ps", "--losses", "0.01",
                            "--rounds", "3", "--elements", "65536", "--topology", "ps",
                            "--auth", "on,off", "--repeats", "2", "--json", f"{work}/k.json"],
                           capture_output=True, text=True, timeout=300, cwd="/")
        assert p.returncode == 0, p.stdout + p.stderr
        rows = json.loads(open(f"{work}/k.json").read())
        assert [(r["system"], r["topology"], r["loss"], r["auth"]) for r in rows] == [
            ("reliable", "ps", 0.01, "random"), ("reliable", "ps", 0.01, "off"),
            ("tcp-ps", "ps", 0.01, "off")]
        assert all(r["delivered_fraction"] == 1.0 and r["repeats"] == 2 for r in rows)
        # (the nodes' TCP counters are read inside the user namespace too)
        assert rows[-1]["tcp_retrans_segs_per_round"] > 0


def test_the_microburst_comparison_runs_without_root():
    """compare on the kernel network as an unprivileged user (what `boundedloss demo`
    does): it re-runs itself in a user namespace of its own, says in its first line
    that every system crosses the kernel network, and leaves nothing behind."""
    prefix = _unprivileged()
    with _their_workdir(prefix) as work:
        p = subprocess.run([*prefix, sys.executable, "-m", "boundedloss.cli", "compare",
                            "--scenario", "microburst", "--policies", "gloo,dblp",
                            "--workers", "2", "--epochs", "1", "--steps-per-epoch", "5",
                            "--json", f"{work}/c.json", "--out", f"{work}/out"],
                           capture_output=True, text=True, timeout=300, cwd="/")
        assert p.returncode == 0, p.stdout + p.stderr
        assert "on the kernel network" in p.stdout.splitlines()[0], p.stdout
        rows = json.loads(open(f"{work}/c.json").read())
        assert [(r["policy"], r["network"]) for r in rows] == [("gloo", "kernel"),
                                                                ("dblp", "kernel")]


def test_the_testbed_cli_without_root():
    """`testbed up/status/run/set/down` as an unprivileged user: the testbed lives in a
    user namespace of its own, held between commands; later commands run inside it;
    `down` (or a killed holder) ends everything, and the host's namespaces are never
    touched."""
    prefix = _unprivileged()
    with _their_workdir(prefix) as work:
        before = list_namespaces()

        def tb(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([*prefix, sys.executable, "-m", "boundedloss.cli",
                                   "testbed", *args, "--state-dir", f"{work}/state"],
                                  capture_output=True, text=True, timeout=120, cwd="/")

        try:
            up = tb("up", "--workers", "2", "--loss", "0.05")
            assert up.returncode == 0, up.stdout + up.stderr
            assert "user namespace of its own" in up.stdout
            assert list_namespaces() == before  # nothing in the host's /run/netns
            st = tb("status")
            assert st.returncode == 0 and ": up;" in st.stdout and "loss 0.05" in st.stdout, st
            again = tb("up", "--workers", "2")
            assert again.returncode == 1 and "already up" in again.stderr
            # (`--` after the command's options: run takes CMD last)
            r = subprocess.run([*prefix, sys.executable, "-m", "boundedloss.cli", "testbed",
                                "run", "--state-dir", f"{work}/state", "--node", "w0", "--",
                                sys.executable, "-c", _EXIT_7_IF_SOURCE_IS, "10.201.0.1",
                                "10.201.0.2"],
                               capture_output=True, text=True, timeout=60, cwd="/")
            assert r.returncode == 7, r.stdout + r.stderr
            s = tb("set", "--loss", "0.2", "--node", "w1")
            assert s.returncode == 0 and "loss 0.2 on w1" in s.stdout, s.stderr
            down = tb("down")
            assert down.returncode == 0 and "user namespace ended" in down.stdout, down.stderr
            assert _processes_left(prefix) == 0
            assert "no testbed recorded" in tb("status").stdout
            # a holder killed from outside: later commands say the testbed has ended
            assert tb("up", "--workers", "1").returncode == 0
            state = json.load(open(f"{work}/state/bl-testbed.json"))
            os.kill(state["userns_holder"]["pid"], signal.SIGKILL)
            assert _processes_left(prefix) == 0
            gone = tb("set", "--loss", "0.1")
            assert gone.returncode == 1 and "has ended" in gone.stderr, gone.stderr
            assert "had already ended" in tb("down").stdout
        finally:
            tb("down")


def test_a_killed_rootless_run_leaves_nothing_behind():
    """SIGKILL of the command (the unshare that stands for it) ends every process of its
    user namespace, and the namespaces with them."""
    prefix = _unprivileged()
    work = tempfile.mkdtemp()
    os.chmod(work, 0o777)
    try:
        p = subprocess.Popen([*prefix, sys.executable, "-m", "boundedloss.cli", "bench",
                              "kernel-loss", "--systems", "reliable,tcp-ps", "--losses", "0.01",
                              "--rounds", "100000", "--topology", "ps",
                              "--json", f"{work}/k.json"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
        deadline = time.monotonic() + 60
        while _their_processes(prefix) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)  # until the ranks run inside the testbed
        assert _their_processes(prefix) >= 4
        p.kill()
        p.wait(timeout=10)
        assert _processes_left(prefix) == 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------- bench fairness
def test_fairness_goodput_is_what_arrived_within_the_window():
    from boundedloss.bench.fairness import goodput_mbps

    samples = [(0.5, 10**6), (1.0, 125_000), (1.5, 125_000), (2.0, 10**6)]
    # [1, 2): 250,000 bytes in a second; the samples at 0.5 and 2.0 are outside
    assert goodput_mbps(samples, 1.0, 2.0) == pytest.approx(2.0)
    assert goodput_mbps(samples, 2.0, 2.0) == 0.0


@needs_kernel
def test_fairness_runs_both_flows_through_the_bottleneck_and_leaves_nothing(tmp_path):
    """bench fairness: a TCP flow and a boundedloss transfer through one tbf, a row per
    credit setting; both delivered with credit (without, TCP may be starved outright in
    a window this short: what credit is for), their shares add up, the queue's drops
    are counted, and no namespace is left behind. (How the link is shared is measured,
    not asserted: BENCHMARKS.md.)"""
    before = list_namespaces()
    out = tmp_path / "f.json"
    p = subprocess.run([sys.executable, "-m", "boundedloss.cli", "bench", "fairness",
                        "--credit", "off,48k", "--seconds", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())
    assert [r["credit_bytes"] for r in rows] == [None, 48 * 1024]
    for r in rows:
        assert r["boundedloss_mbps"] > 0 and r["tcp_mbps"] >= 0
        assert r["tcp_share"] + r["boundedloss_share"] == pytest.approx(1, abs=1e-3)
        assert 0 < r["utilization"] < 1.2 and 0 <= r["queue_drop_fraction"] < 1
    assert rows[1]["tcp_mbps"] > 0  # (with credit, TCP keeps its part)
    assert list_namespaces() == before
    bad = subprocess.run([sys.executable, "-m", "boundedloss.cli", "bench", "fairness",
                          "--credit", "2k", "--json", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_fairness_runs_without_root_in_a_user_namespace_of_its_own():
    prefix = _unprivileged()
    with _their_workdir(prefix) as work:
        p = subprocess.run([*prefix, sys.executable, "-m", "boundedloss.cli", "bench",
                            "fairness", "--credit", "48k", "--seconds", "3", "--json",
                            f"{work}/f.json"], capture_output=True, text=True, timeout=300,
                           cwd="/")
        assert p.returncode == 0, p.stdout + p.stderr
        (row,) = json.loads(open(f"{work}/f.json").read())
        assert row["tcp_mbps"] > 0 and row["boundedloss_mbps"] > 0
