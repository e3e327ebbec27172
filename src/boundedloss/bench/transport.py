"""`boundedloss bench transport`: goodput of message transfers on loopback.

Two worker processes (a sender and a receiver, so each has a core of its own) are driven
over pipes. Rows cover the data path (the compiled one, ``native``, and the Python
reference) and UDP offload (segmentation and receive coalescing, on or off). For each
datagram size and offload setting the machine's own limit - the ceiling - is measured in
the same run, interleaved with the rows: a bare compiled loop of the same kind and
datagram size, no protocol - UDP_SEGMENT sends into a UDP_GRO socket with offload, one
datagram per system call on both sides without - sending the message's bytes from the
sender's buffer and copying what arrives on into a message-sized destination, as any
transport must (``loop_ceiling_gbps``: the same loops on one small buffer the cache
keeps, which no transport of a real message can match). Rows with ``auth`` on carry a tag
on every datagram (AES-256-GMAC under a job key, as a training job does by default), and
``auth_ratio`` is their goodput over the same row's without. Where the extension is not
built the ceilings are the same loops in Python, and the rows say so. Goodput is message bytes over
the time from the send being posted to the receiver's close as its I/O thread saw it
(for the ceiling: from the first send to the last datagram received, over at least 16 MB
so that it is a steady-state rate), on the machine's monotonic clock, which both
processes share.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import socket
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TypeVar

import numpy as np

from .. import native
from ..net.loss import Bernoulli
from ..net.native import ipv4_address
from ..net.udp import DEFAULT_SOCKET_BUFFER, SOL_UDP, UDP_GRO, UdpEndpoint, set_socket_buffer
from ..policy import parse_policies, parse_policy
from ..protocol import ReceiveResult, TransportConfig
from ..protocol.auth import KEY_BYTES, job_key
from ..wire import DEFAULT_CHUNK_BYTES, HEADER_BYTES

MB = 1 << 20
CEILING_MIN_BYTES = 16 * MB

#: what a run measures unless told otherwise (``boundedloss bench transport``'s defaults)
DEFAULT_MESSAGE_MB = (1, 16, 64)
DEFAULT_CHUNK_SIZES = (DEFAULT_CHUNK_BYTES, 8192)  # the MTU-sized default, and jumbo
DEFAULT_LOSSES = (0.0, 0.01)
DEFAULT_POLICIES = ("reliable", "mlt")  # as parse_policy reads them
DEFAULT_OFFLOADS = (True, False)
DEFAULT_NATIVE = (True, False)  # the compiled data path, and the Python reference
DEFAULT_AUTH = (True, False)  # authenticated datagrams (a training job's default), and not


@dataclass(frozen=True)
class TransportRow:
    chunk_bytes: int
    message_bytes: int
    loss: float
    policy: str
    offload: bool  # UDP segmentation offload and receive coalescing (GSO/GRO)
    native: bool  # the compiled data path (False: the Python reference)
    auth: bool  # every datagram authenticated (protocol.auth)
    goodput_gbps: float
    ceiling_gbps: float
    loop_ceiling_gbps: float
    ratio_to_ceiling: float
    retransmit_rounds: float
    retransmitted_fraction: float
    delivered_fraction: float
    repeats: int
    ceiling: str  # what the ceiling loop was: "native" or "python"
    #: authenticated goodput over the same row's unauthenticated one (None: not measured)
    auth_ratio: float | None = None


# ---------------------------------------------------------------- worker side
T = TypeVar("T")


def _opened(thing: T | None, what: str) -> T:
    """``thing``, which the driver must have opened (or posted) by now."""
    if thing is None:
        raise RuntimeError(f"benchmark worker: {what} used before it was opened")
    return thing


def _worker(conn: Connection) -> None:
    """Serve commands from the driver until told to quit."""
    endpoint: UdpEndpoint | None = None
    future: Future[ReceiveResult] | None = None
    raw: socket.socket | None = None
    payload_cache: dict[int, np.ndarray] = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "quit":
            break
        if cmd == "open":  # (session, chunk_bytes, loss, seed, offload, native, auth_key)
            if endpoint is not None:
                endpoint.close()
            session, chunk_bytes, loss, seed, offload, use_native, auth_key = args
            cfg = TransportConfig(chunk_bytes=chunk_bytes, peer_timeout=30.0,
                                  receive_deadline=60.0)
            model = Bernoulli(loss, seed=seed) if loss else None
            endpoint = UdpEndpoint(session=session, config=cfg, loss=model,
                                   segmentation_offload=offload, native_data_path=use_native,
                                   auth_key=auth_key)
            conn.send(endpoint.address)
        elif cmd == "post":  # (peer, nbytes, policy, round)
            peer, nbytes, policy, rnd = args
            future = _opened(endpoint, "endpoint").receive(
                peer, message_id=1, round_id=rnd, policy=parse_policy(policy).make(),
                out=_message_buffer(payload_cache, -nbytes))
            conn.send("posted")
        elif cmd == "send":  # (peer, nbytes, round)
            peer, nbytes, rnd = args
            sent = _opened(endpoint, "endpoint").send(
                peer, _message_buffer(payload_cache, nbytes), message_id=1,
                round_id=rnd).result()
            s = sent.stats
            conn.send((s.started, sent.status.value, s.retransmit_rounds, s.retransmitted))
        elif cmd == "wait":
            received = _opened(future, "receive").result()
            s = received.stats  # finished: when the receiver closed, on the I/O thread's clock
            conn.send((s.finished, s.delivered, s.chunks, received.close_reason.name))
        elif cmd == "raw_open":  # (offload,)
            if raw is not None:
                raw.close()
            raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            set_socket_buffer(raw, "RCV", DEFAULT_SOCKET_BUFFER)
            set_socket_buffer(raw, "SND", DEFAULT_SOCKET_BUFFER)
            if args[0]:
                raw.setsockopt(SOL_UDP, UDP_GRO, 1)
            raw.bind(("127.0.0.1", 0))
            conn.send(raw.getsockname())
        elif cmd == "raw_recv":  # (nbytes or 0): count what arrives until the end marker
            dest = _message_buffer(payload_cache, -args[0]) if args[0] else None
            conn.send("ready")
            # (blocking: a timeout costs an extra poll() per call; the sender ends the
            # blast with 1-byte markers)
            conn.send(_drain(_opened(raw, "raw socket"), dest))
        elif cmd == "raw_send":  # (peer, count, datagram_bytes, offload, nbytes or 0)
            peer, count, size, offload, nbytes = args
            source = _message_buffer(payload_cache, nbytes) if nbytes else None
            sock = _opened(raw, "raw socket")
            t0 = time.monotonic()
            _blast(sock, peer, count, size, offload, source)
            for _ in range(50):  # end markers, spaced so a full buffer can drain
                sock.sendto(b"E", peer)
                time.sleep(0.002)
            conn.send(t0)
    if endpoint is not None:
        endpoint.close()


def _message_buffer(cache: dict[int, np.ndarray], key: int) -> np.ndarray:
    """The worker's message buffers, made once and reused, as a training job's gradient
    buckets are (a fresh one would time the kernel's page faults, not the transport):
    ``key`` > 0, a source of that many random bytes; < 0, a destination of -key bytes."""
    buf = cache.get(key)
    if buf is None:
        if key > 0:
            buf = np.random.default_rng(key).integers(0, 255, key, dtype=np.uint8)
        else:
            buf = np.ones(-key, dtype=np.uint8)
        cache[key] = buf
    return buf


def _blast(sock: socket.socket, peer, count: int, size: int, offload: bool,
           source: np.ndarray | None) -> None:
    """The ceiling's sender: ``count`` datagrams of ``size`` bytes, no protocol, from
    ``source`` (None: one buffer the cache keeps)."""
    if native.enabled():
        ip, port = ipv4_address(peer) or (0, 0)
        native.module().blast(sock, ip, port, size, count, offload, source)
        return
    data = bytes(size)
    send = sock.sendto
    for _ in range(count):
        send(data, peer)


def _drain(sock: socket.socket, dest: np.ndarray | None) -> tuple[float, int]:
    """The ceiling's receiver: (when the last datagram came, how many came), each copied
    on into ``dest`` (None: not copied)."""
    if native.enabled():
        got, _, t_last = native.module().drain(sock, dest)
        return t_last, got
    buf = bytearray(65536)
    recv = sock.recv_into
    monotonic = time.monotonic
    got = 0
    t_last = 0.0
    while recv(buf) != 1:
        got += 1
        t_last = monotonic()
    return t_last, got


# ---------------------------------------------------------------- driver side
class _Pair:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.tx_conn, tx_child = ctx.Pipe()
        self.rx_conn, rx_child = ctx.Pipe()
        self.procs = [
            ctx.Process(target=_worker, args=(tx_child,), daemon=True),
            ctx.Process(target=_worker, args=(rx_child,), daemon=True),
        ]
        for p in self.procs:
            p.start()
        self.session = secrets.randbits(64)
        self.key = job_key(secrets.token_bytes(KEY_BYTES), self.session)
        # warm-up: imports, first-use paths
        self.transfer(8192, 4 * MB, 0.0, "reliable", 0, True, native.enabled(), True)

    def call(self, conn, *msg):
        conn.send(msg)
        if not conn.poll(180):
            raise TimeoutError(f"benchmark worker did not answer {msg[0]!r} within 180 s")
        return conn.recv()

    def close(self) -> None:
        for conn in (self.tx_conn, self.rx_conn):
            try:
                conn.send(("quit",))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def ceiling(self, chunk_bytes: int, message_bytes: int, offload: bool,
                move_message: bool) -> float:
        """Steady-state raw rate for this datagram size: at least 16 MB are blasted, so
        that small messages are compared against the rate, not against one wake-up;
        ``move_message``: from the message's source buffer into a destination."""
        size = chunk_bytes + HEADER_BYTES
        count = -(-max(message_bytes, CEILING_MIN_BYTES) // chunk_bytes)
        nbytes = max(message_bytes, 1 << 17) if move_message else 0
        rx_addr = self.call(self.rx_conn, "raw_open", offload)
        self.call(self.tx_conn, "raw_open", False)
        assert self.call(self.rx_conn, "raw_recv", nbytes) == "ready"
        t0 = self.call(self.tx_conn, "raw_send", rx_addr, count, size, offload, nbytes)
        if not self.rx_conn.poll(180):
            raise TimeoutError("raw receiver did not report")
        t_last, got = self.rx_conn.recv()
        return got * chunk_bytes * 8 / max(t_last - t0, 1e-9) / 1e9

    def transfer(self, chunk_bytes: int, message_bytes: int, loss: float, policy: str,
                 rnd: int, offload: bool, use_native: bool, auth: bool) -> dict:
        key = self.key if auth else None
        tx_addr = self.call(self.tx_conn, "open", self.session, chunk_bytes, 0.0, 0, offload,
                            use_native, key)
        rx_addr = self.call(self.rx_conn, "open", self.session, chunk_bytes, loss, rnd,
                            offload, use_native, key)
        self.call(self.rx_conn, "post", tx_addr, message_bytes, policy, rnd)
        t0, status, rounds, retx = self.call(self.tx_conn, "send", rx_addr, message_bytes, rnd)
        t_end, delivered, chunks, reason = self.call(self.rx_conn, "wait")
        if status != "stopped":
            raise RuntimeError(f"send ended with {status}")
        return {
            "goodput_gbps": message_bytes * 8 / max(t_end - t0, 1e-9) / 1e9,
            "retransmit_rounds": rounds,
            "retransmitted_fraction": retx / chunks,
            "delivered_fraction": delivered / chunks,
        }


def run_transport_bench(
    *,
    message_mb: tuple[int, ...] = DEFAULT_MESSAGE_MB,
    chunk_sizes: tuple[int, ...] = DEFAULT_CHUNK_SIZES,
    losses: tuple[float, ...] = DEFAULT_LOSSES,
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    offloads: tuple[bool, ...] = DEFAULT_OFFLOADS,
    native_paths: tuple[bool, ...] = DEFAULT_NATIVE,
    auths: tuple[bool, ...] = DEFAULT_AUTH,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[TransportRow]:
    """One row per chunk size, message size, loss rate, policy (each as
    :func:`~boundedloss.policy.parse_policy` reads it; ``ValueError`` for a bad one,
    or for gloo, which does not use this transport), offload and data path (``True``:
    the compiled one - ``ValueError`` where it is not built) and authentication."""
    specs = parse_policies(policies)
    if not all(spec.uses_transport for spec in specs):
        raise ValueError("bench transport measures the bounded-loss transport; gloo has none")
    if any(native_paths) and not native.enabled():
        raise ValueError(f"the compiled data path is not in use: {native.status()}")
    if any(native_paths) and any(auths) and not native.authenticates():
        raise ValueError(native.AUTH_FALLBACK)
    names = {str(spec): spec.make().describe() for spec in specs}  # the rows' names
    ceiling_kind = "native" if native.enabled() else "python"
    pair = _Pair()
    rows: list[TransportRow] = []
    try:
        rnd = 0
        for cb in chunk_sizes:
            for mb in message_mb:
                nbytes = mb * MB
                ceilings: dict[tuple[bool, bool], list[float]] = {}
                samples: dict[tuple, list[dict]] = {}
                for rep in range(repeats):
                    # interleave: ceilings, then every protocol row, each repeat
                    for offload in offloads:
                        for move in (True, False):
                            ceilings.setdefault((offload, move), []).append(
                                pair.ceiling(cb, nbytes, offload, move))
                    for offload in offloads:
                        for use_native in native_paths:
                            for auth in auths:
                                for loss in losses:
                                    for pol in names:
                                        rnd += 1
                                        samples.setdefault(
                                            (offload, use_native, auth, loss, pol), []).append(
                                            pair.transfer(cb, nbytes, loss, pol, rnd, offload,
                                                          use_native, auth))
                    if progress:
                        progress(f"chunk {cb} B, message {mb} MB: repeat {rep + 1}/{repeats}")
                medians = {key: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                           for key, runs in samples.items()}
                for (offload, use_native, auth, loss, pol), med in medians.items():
                    ceiling = statistics.median(ceilings[(offload, True)])
                    loop_ceiling = statistics.median(ceilings[(offload, False)])
                    plain = medians.get((offload, use_native, False, loss, pol), {}).get(
                        "goodput_gbps")
                    rows.append(
                        TransportRow(
                            chunk_bytes=cb,
                            message_bytes=nbytes,
                            loss=loss,
                            policy=names[pol],
                            offload=offload,
                            native=use_native,
                            auth=auth,
                            goodput_gbps=round(med["goodput_gbps"], 3),
                            ceiling_gbps=round(ceiling, 3),
                            loop_ceiling_gbps=round(loop_ceiling, 3),
                            ratio_to_ceiling=round(med["goodput_gbps"] / ceiling, 3),
                            retransmit_rounds=med["retransmit_rounds"],
                            retransmitted_fraction=round(med["retransmitted_fraction"], 4),
                            delivered_fraction=round(med["delivered_fraction"], 4),
                            repeats=repeats,
                            ceiling=ceiling_kind,
                            auth_ratio=(round(med["goodput_gbps"] / plain, 3)
                                        if auth and plain else None),
                        )
                    )
    finally:
        pair.close()
    return rows
