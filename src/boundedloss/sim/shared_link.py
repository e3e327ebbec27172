"""Flows through one shared bottleneck, simulated: boundedloss senders sending messages
one after another to a server, beside an optional TCP bulk flow (the TCP model of
``tcp.py``) into the same server - ``bench fairness``'s set-up, on the simulated
network and its virtual clock, deterministic from a seed.

The server's downlink is the bottleneck: ``rate_bps`` with a drop-tail queue of
``queue_bytes``; the senders' uplinks are ``uplink_ratio`` times faster, so that what
they send at once meets that queue. One node holds one core, so the server is a
``SharedHost``: our transport's core and a TCP stack behind one address, each
datagram handed to the one it is for. A run reports what each flow got through the
bottleneck (bytes arriving at the server, retransmissions included, over the time
after ``settle_s``), the queue's occupancy sampled every ``SAMPLE_EVERY`` and its drops.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from .. import wire
from ..net.fake import FakeNetwork, NodeProfile, PathProfile
from ..net.loss import Bernoulli
from ..policy import ReliablePolicy
from ..protocol import TransferMux, TransportConfig
from ..protocol.sender import MessageSender
from .tcp import TcpHost

SERVER, TCP_SENDER = ("10.0.0.1", 9000), ("10.0.0.2", 9000)
SESSION = 0x5A4ED
MTU = 1500
#: how often the bottleneck's queue is sampled (virtual seconds)
SAMPLE_EVERY = 100e-6


def _is_ours(data: bytes) -> bool:
    """Our datagram (its magic first) rather than a TCP segment (zeros there)."""
    return data[:2] == wire.MAGIC_BYTES


class SharedHost:
    """Our transport's core and a TCP stack at one network address (the server of a
    shared bottleneck): each arriving datagram goes to the one it is for, and what both
    send leaves through the one uplink. It counts the bytes of each flow's DATA that
    arrive (``arrived``: ours by sending peer, TCP's under ``"tcp"``) from ``count_from``
    on."""

    def __init__(self, mux: TransferMux, tcp: TcpHost, count_from: float):
        self.mux = mux
        self.tcp = tcp
        self.count_from = count_from
        self.arrived: dict[Hashable, int] = {}

    def datagram_received(self, data: bytes, peer: Hashable, now: float) -> None:
        ours = _is_ours(data)
        if now >= self.count_from and len(data) > wire.HEADER_BYTES:
            key = peer if ours else "tcp"
            self.arrived[key] = self.arrived.get(key, 0) + len(data)
        (self.mux if ours else self.tcp).datagram_received(data, peer, now)

    def poll(self, now: float, limit: int = 64) -> list:
        out = self.mux.poll(now, limit)
        if len(out) < limit:
            out.extend(self.tcp.poll(now, limit - len(out)))
        return out

    def has_output(self) -> bool:
        return self.mux.has_output() or self.tcp.has_output()

    def next_deadline(self) -> float | None:
        ds = [d for d in (self.mux.next_deadline(), self.tcp.next_deadline()) if d is not None]
        return min(ds) if ds else None

    def timer_fired(self, now: float) -> None:
        d = self.mux.next_deadline()
        if d is not None and d <= now:
            self.mux.timer_fired(now)
        d = self.tcp.next_deadline()
        if d is not None and d <= now:
            self.tcp.timer_fired(now)


@dataclass(frozen=True)
class SharedLink:
    """One run's set-up."""

    #: TransportConfig.congestion of our senders
    congestion: str = "off"
    #: boundedloss senders (each its own host)
    senders: int = 1
    #: a TCP bulk flow beside them
    tcp: bool = False
    rate_bps: float = 100e6
    queue_bytes: int = 64 * 1024
    uplink_ratio: float = 10.0
    #: one-way delay of every path
    delay: float = 100e-6
    #: random loss on our senders' paths to the server (the TCP flow's path is clean)
    loss: float = 0.0
    message_bytes: int = 1 << 20
    #: virtual seconds to run, and the first of them left out of the counts
    seconds: float = 2.0
    settle_s: float = 0.5
    seed: int = 1


@dataclass(frozen=True)
class SharedLinkResult:
    #: bits/s each of our senders got through the bottleneck after the settling time
    boundedloss_bps: tuple[float, ...]
    tcp_bps: float
    #: the bottleneck queue's mean and 95th-percentile occupancy, as queueing delay (s)
    queue_delay_mean: float
    queue_delay_p95: float
    #: datagrams and segments the bottleneck's queue dropped
    queue_drops: int
    #: messages our senders completed
    messages: int
    #: cuts the delay loops made (0 with congestion control off)
    cuts: int

    @property
    def boundedloss_share(self) -> float:
        total = sum(self.boundedloss_bps) + self.tcp_bps
        return sum(self.boundedloss_bps) / total if total else 0.0

    @property
    def tcp_share(self) -> float:
        total = sum(self.boundedloss_bps) + self.tcp_bps
        return self.tcp_bps / total if total else 0.0


def run_shared_link(link: SharedLink) -> SharedLinkResult:
    config = TransportConfig(congestion=link.congestion, peer_timeout=5.0,
                             receive_deadline=60.0)
    net = FakeNetwork(seed=link.seed, path=PathProfile(delay=link.delay))
    up = link.rate_bps * link.uplink_ratio
    server_mux = TransferMux(SESSION, config)
    server_tcp = TcpHost(MTU, Future)
    server = SharedHost(server_mux, server_tcp, link.settle_s)
    net.attach(SERVER, server,  # type: ignore[arg-type]
               NodeProfile(up_bps=up, down_bps=link.rate_bps, queue_bytes=link.queue_bytes))
    addresses = [(f"10.0.1.{i + 1}", 9000) for i in range(link.senders)]
    if link.loss:
        for i, a in enumerate(addresses):
            net.set_path(a, SERVER, PathProfile(delay=link.delay,
                                                loss=Bernoulli(link.loss, seed=link.seed + i)))
    payload = np.random.default_rng(link.seed).integers(0, 256, link.message_bytes,
                                                        dtype=np.uint8)
    muxes = [TransferMux(SESSION, config) for _ in addresses]
    current: list[MessageSender | None] = [None] * len(addresses)
    messages = [0]

    def next_message(i: int) -> None:
        """Sender ``i``'s message done (or none yet): the next one, and its receive."""
        tx = current[i]
        if tx is not None and tx.result is None:
            return
        if tx is not None:
            messages[0] += 1
        mid = 0 if tx is None else tx.message_id + 1
        now = net.now
        server_mux.start_receive(addresses[i], 1, mid, now, policy=ReliablePolicy(),
                                 nbytes=link.message_bytes)
        current[i] = muxes[i].start_send(SERVER, 1, mid, payload, now)
        net.wake(SERVER)
        net.wake(addresses[i])

    for i, a in enumerate(addresses):
        net.attach(a, muxes[i], NodeProfile(up_bps=up),
                   serviced=functools.partial(next_message, i))
    if link.tcp:
        sender_tcp = TcpHost(MTU, Future)
        net.attach(TCP_SENDER, sender_tcp, NodeProfile(up_bps=up))  # type: ignore[arg-type]
        # (more than the run can send: a bulk flow for its whole length)
        bulk = int(link.rate_bps / 8 * link.seconds * 2)
        sender_tcp.send(SERVER, bulk)
        server_tcp.recv(TCP_SENDER, bulk)
    occupancy: list[int] = []

    def sample() -> None:
        if net.now >= link.settle_s:
            occupancy.append(net.queued_bytes(SERVER))
        if net.now + SAMPLE_EVERY <= link.seconds:
            net.call_at(net.now + SAMPLE_EVERY, sample)

    net.call_at(0.0, sample)
    for i in range(len(addresses)):
        next_message(i)
    net.run(until=link.seconds)
    span = link.seconds - link.settle_s
    delays = np.asarray(occupancy, dtype=float) * 8 / link.rate_bps
    cuts = sum(c.cuts for m in muxes for c in [m.path(SERVER).congestion] if c is not None)
    return SharedLinkResult(
        boundedloss_bps=tuple(server.arrived.get(a, 0) * 8 / span for a in addresses),
        tcp_bps=server.arrived.get("tcp", 0) * 8 / span,
        queue_delay_mean=float(delays.mean()) if delays.size else math.nan,
        queue_delay_p95=float(np.percentile(delays, 95)) if delays.size else math.nan,
        queue_drops=net.counts["queue_drop"],
        messages=messages[0],
        cuts=cuts,
    )
