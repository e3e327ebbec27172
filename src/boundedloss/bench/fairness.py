"""`boundedloss bench fairness`: one boundedloss transfer and one TCP bulk flow share a
bottleneck on the kernel testbed; what share of the link each one gets.

Two workers send to the server through the testbed's tbf bottleneck on the switch port
into it: worker 0 a TCP bulk flow (the kernel's default congestion control, CUBIC), worker
1 boundedloss messages one after another (the reliable policy, authenticated, as a job
sends them) - one run per ``credit`` setting and ``congestion`` control, the TCP flow the
same in each. Each
receiver stamps what arrives on the machine's monotonic clock (every namespace shares
it); a row reports each flow's goodput over the time both were running (the first and
last ``SETTLE_S`` left out) and its share of what the two got through together.

(root, or a user namespace of its own, as ``boundedloss testbed``.)
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..emulate.qdisc import Bottleneck
from ..protocol.credit import CREDIT_OFF, CreditSetting

#: the run's first and last seconds are left out: TCP's slow start, the last message
SETTLE_S = 1.0
TCP_PORT = 7300
UDP_PORT = 7301
SESSION = 0xFA1E
DEFAULT_SECONDS = 8.0
DEFAULT_MESSAGE_BYTES = 1 << 20
DEFAULT_BOTTLENECK = Bottleneck(rate="100mbit", burst="32kb", limit="64kb")
#: goodput samples: bytes delivered, stamped every this many bytes at most
_TCP_READ = 1 << 16


@dataclass(frozen=True)
class FairnessRow:
    #: boundedloss's receiver-driven credit, bytes (None: off)
    credit_bytes: int | None
    bottleneck: str
    seconds: float  # the window both flows ran in, measured
    tcp_mbps: float
    boundedloss_mbps: float
    #: each flow's share of what the two got through together
    tcp_share: float
    boundedloss_share: float
    #: the two together over the bottleneck's rate
    utilization: float
    #: of the packets the bottleneck saw, the share its queue dropped
    queue_drop_fraction: float
    message_bytes: int
    #: boundedloss's congestion control (TransportConfig.congestion)
    congestion: str = "off"
    #: the receiver sized the credit budget from the overflows it saw (credit_bytes: its
    #: floor)
    credit_adaptive: bool = False


# ------------------------------------------------------------ one role, in a namespace
def _stamp(out: str, samples: list[tuple[float, int]]) -> None:
    Path(out).write_text(json.dumps(samples))


def _tcp_receive(a: argparse.Namespace) -> None:
    srv = socket.create_server((a.host, TCP_PORT))
    srv.settimeout(60)
    conn, _ = srv.accept()
    samples = []
    with conn:
        while True:
            data = conn.recv(_TCP_READ)
            if not data:
                break
            samples.append((time.monotonic(), len(data)))
    _stamp(a.out, samples)


def _tcp_send(a: argparse.Namespace) -> None:
    chunk = bytes(_TCP_READ)
    patience = time.monotonic() + 20.0  # (the receiver may still be starting)
    while True:
        try:
            conn = socket.create_connection((a.peer, TCP_PORT), timeout=60)
            break
        except ConnectionRefusedError:
            if time.monotonic() > patience:
                raise
            time.sleep(0.1)
    deadline = time.monotonic() + a.seconds
    with conn:
        while time.monotonic() < deadline:
            conn.sendall(chunk)


def _endpoint(a: argparse.Namespace, port: int):
    from ..net.udp import UdpEndpoint
    from ..protocol import TransportConfig
    from ..protocol.auth import job_key

    return UdpEndpoint(a.host, port, session=SESSION, auth_key=job_key(b"fairness", SESSION),
                       config=TransportConfig(**CreditSetting.from_str(a.credit).transport(),
                                              congestion=a.congestion))


def _boundedloss_receive(a: argparse.Namespace) -> None:
    from ..policy import ReliablePolicy

    ep = _endpoint(a, UDP_PORT)
    samples = []
    peer = (a.peer, UDP_PORT)
    try:
        for r in range(1 << 30):
            # (posted without a size: the sender's last word is one byte, its time is up)
            res = ep.receive(peer, message_id=0, round_id=r, policy=ReliablePolicy()
                             ).result(timeout=a.seconds + 30)
            if res.data.nbytes == 1:
                break
            samples.append((time.monotonic(), int(res.stats.payload_bytes)))
    finally:
        ep.close()
    _stamp(a.out, samples)


def _boundedloss_send(a: argparse.Namespace) -> None:
    import numpy as np

    ep = _endpoint(a, UDP_PORT)
    payload = np.zeros(a.message_bytes, dtype=np.uint8)
    peer = (a.peer, UDP_PORT)
    deadline = time.monotonic() + a.seconds
    try:
        r = 0
        while time.monotonic() < deadline:
            ep.send(peer, payload, message_id=0, round_id=r).result(timeout=60)
            r += 1
        # the receiver's next receive (round r) takes a one-byte message: time is up
        ep.send(peer, np.full(1, 0xFF, dtype=np.uint8), message_id=0, round_id=r
                ).result(timeout=60)
    finally:
        ep.close()


ROLES: dict[str, Callable[[argparse.Namespace], None]] = {
    "tcp-receive": _tcp_receive, "tcp-send": _tcp_send,
    "boundedloss-receive": _boundedloss_receive, "boundedloss-send": _boundedloss_send,
}


def role_main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=list(ROLES), required=True)
    ap.add_argument("--host", required=True, help="this node's address")
    ap.add_argument("--peer", required=True, help="the other end's address")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--message-bytes", type=int, default=DEFAULT_MESSAGE_BYTES)
    ap.add_argument("--credit", default="off", help="off, auto, or bytes")
    ap.add_argument("--congestion", default="off")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    ROLES[a.role](a)


# ------------------------------------------------------------------- driver (root)
def goodput_mbps(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Mbit/s of what arrived within [start, end)."""
    got = sum(n for t, n in samples if start <= t < end)
    return got * 8 / (end - start) / 1e6 if end > start else 0.0


def _run_pair(tb, credit: CreditSetting, congestion: str, seconds: float, message_bytes: int,
              tmp: str) -> tuple[list, list]:
    server, tcp_node, bl_node = "server", "w0", "w1"
    addr = tb.addresses
    base = [sys.executable, "-m", "boundedloss.bench.fairness", "--seconds", str(seconds),
            "--message-bytes", str(message_bytes), "--congestion", congestion,
            "--credit", str(credit)]

    def start(node: str, role: str, peer: str, out: str = "") -> subprocess.Popen:
        return tb.run(node, [*base, "--role", role, "--host", addr[node], "--peer",
                             addr[peer], "--out", out],
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    tcp_out, bl_out = str(Path(tmp, "tcp.json")), str(Path(tmp, "bl.json"))
    receivers = [start(server, "tcp-receive", tcp_node, tcp_out),
                 start(server, "boundedloss-receive", bl_node, bl_out)]
    time.sleep(1.0)  # (a head start; the TCP sender also retries until it listens)
    senders = [start(tcp_node, "tcp-send", server), start(bl_node, "boundedloss-send", server)]
    roles = ["tcp-send", "boundedloss-send", "tcp-receive", "boundedloss-receive"]
    procs = senders + receivers

    def kill_all() -> None:  # (a hung role must not hang the bench)
        for p in procs:
            p.kill()

    timer = threading.Timer(seconds + 120, kill_all)
    timer.start()
    try:
        for role, p in zip(roles, procs):
            _, err = p.communicate()
            if p.returncode:
                raise RuntimeError(f"fairness: {role} failed (exit {p.returncode}): "
                                   f"{err.decode(errors='replace').strip()[-300:]}")
    finally:
        timer.cancel()
    return json.loads(Path(tcp_out).read_text()), json.loads(Path(bl_out).read_text())


def run_fairness_bench(*, credits: tuple[CreditSetting, ...] = (CREDIT_OFF,),
                       congestions: tuple[str, ...] = ("off",),
                       seconds: float = DEFAULT_SECONDS,
                       message_bytes: int = DEFAULT_MESSAGE_BYTES,
                       bottleneck: Bottleneck = DEFAULT_BOTTLENECK, mtu: int = 1500,
                       progress: Callable[[str], None] | None = None) -> list[FairnessRow]:
    """A row per congestion control and credit setting (each once):
    both flows through one testbed's bottleneck for ``seconds``."""
    from ..emulate import Testbed, TestbedConfig
    from ..protocol.congestion import parse_congestion

    if not credits or len(set(credits)) != len(credits):
        raise ValueError("credits: each once")
    if not congestions or len(set(congestions)) != len(congestions):
        raise ValueError("congestions: each once")
    for congestion in congestions:
        parse_congestion(congestion)
    if seconds <= 2 * SETTLE_S:
        raise ValueError(f"seconds must be over {2 * SETTLE_S:g}")
    rows = []
    with Testbed(TestbedConfig(workers=2, mtu=mtu, bottleneck=bottleneck)) as tb:
        for congestion, credit in [(g, c) for g in congestions for c in credits]:
            if progress:
                progress(f"credit {credit}, congestion control {congestion}: both "
                         f"flows for {seconds:g} s")
            before = tb.qdisc_stats()
            with tempfile.TemporaryDirectory() as tmp:
                tcp, bl = _run_pair(tb, credit, congestion, seconds, message_bytes, tmp)
            after = tb.qdisc_stats()
            if not tcp or not bl:
                raise RuntimeError("fairness: a flow delivered nothing")
            start = max(tcp[0][0], bl[0][0]) + SETTLE_S
            end = min(tcp[-1][0], bl[-1][0]) - SETTLE_S
            if end - start < 0.5:
                raise RuntimeError("fairness: the flows overlapped for less than half a "
                                   "second (a slow start: give --seconds more)")
            t_mbps, b_mbps = goodput_mbps(tcp, start, end), goodput_mbps(bl, start, end)
            both = t_mbps + b_mbps
            sent = after.sent_packets - before.sent_packets if after and before else 0
            dropped = after.dropped - before.dropped if after and before else 0
            rows.append(FairnessRow(
                credit_bytes=credit.budget_bytes, credit_adaptive=credit.adaptive,
                bottleneck=bottleneck.describe(),
                seconds=round(end - start, 2), tcp_mbps=round(t_mbps, 2),
                boundedloss_mbps=round(b_mbps, 2),
                tcp_share=round(t_mbps / both, 4) if both else 0.0,
                boundedloss_share=round(b_mbps / both, 4) if both else 0.0,
                utilization=round(both * 1e6 / bottleneck.rate_bps, 4),
                queue_drop_fraction=round(dropped / max(1, sent + dropped), 5),
                message_bytes=message_bytes, congestion=congestion))
    return rows


if __name__ == "__main__":
    role_main()
