"""UdpEndpoint: one real UDP socket driving a TransferMux from a background I/O thread.

Many concurrent messages to and from many peers share the socket; the mux
demultiplexes them by header. ``send`` and ``receive`` return
``concurrent.futures.Future`` objects that resolve to SendResult / ReceiveResult.

The I/O thread drains the socket in bursts with ``recvfrom_into`` into one reusable
buffer (the receiver copies each payload once, into the destination), sends with
``sendmsg`` gathering header and payload views (no copy in Python), and sleeps in
``select`` until the socket is readable, a caller wakes it, or the mux's next deadline.
"""

from __future__ import annotations

import dataclasses
import errno
import select
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future

import numpy as np

from ..policy.base import Policy
from ..policy.reliable import ReliablePolicy
from ..protocol.mux import TransferMux
from ..protocol.types import ReceiveResult, SendResult, TransportConfig, TransportError
from ..wire import DropReason, peek_round
from .loss import LossModel

RECV_BURST = 512
SEND_BURST = 256
DEFAULT_SOCKET_BUFFER = 64 << 20


# Linux's SO_SNDBUFFORCE / SO_RCVBUFFORCE, which Python's socket module does not name.
_FORCE = {"SND": 32, "RCV": 33} if sys.platform.startswith("linux") else {}


def _set_buffer(sock: socket.socket, which: str, size: int) -> int:
    """Ask for a big kernel buffer; with CAP_NET_ADMIN, past net.core.[rw]mem_max."""
    force = getattr(socket, f"SO_{which}BUFFORCE", _FORCE.get(which))
    plain = getattr(socket, f"SO_{which}BUF")
    try:
        if force is None:
            raise PermissionError
        sock.setsockopt(socket.SOL_SOCKET, force, size)
    except (PermissionError, OSError):
        sock.setsockopt(socket.SOL_SOCKET, plain, size)
    return sock.getsockopt(socket.SOL_SOCKET, plain)


def resolve(peer) -> tuple[str, int]:
    host, port = peer
    return socket.gethostbyname(host), int(port)


class UdpEndpoint:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        session: int,
        config: TransportConfig | None = None,
        loss: LossModel | None = None,
        socket_buffer: int = DEFAULT_SOCKET_BUFFER,
        name: str = "boundedloss-udp",
    ):
        config = config or TransportConfig()
        self.loss = loss
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.rcvbuf = _set_buffer(self.sock, "RCV", socket_buffer)
        self.sndbuf = _set_buffer(self.sock, "SND", socket_buffer)
        # The flow-control window must fit the kernel's receive buffer, or the kernel
        # drops what does not: getsockopt reports twice the usable bytes, and a queued
        # datagram costs up to twice its size, hence a quarter. (Peers of one job run on
        # alike hosts, so our own buffer stands in for the receiver's.)
        fits = max(config.chunk_bytes, self.rcvbuf // 4)
        if config.window_bytes > fits:
            config = dataclasses.replace(config, window_bytes=fits)
        self.config = config
        self.mux = TransferMux(session, config)
        self.sock.bind((host, port))
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()
        self._futures: dict[int, tuple[object, Future]] = {}
        self._closing = False
        self.io_errors: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    # --------------------------------------------------------------------- API
    def send(self, peer, payload, *, message_id: int, round_id: int = 0,
             critical: np.ndarray | None = None) -> Future:
        """Send ``payload`` (any C-contiguous buffer; not to be modified until done)."""
        peer = resolve(peer)
        fut: Future = Future()
        with self._lock:
            self._check_open()
            tx = self.mux.start_send(peer, round_id, message_id, payload, time.monotonic(),
                                     critical=critical)
            self._futures[id(tx)] = (tx, fut)
        self._wake()
        return fut

    def receive(self, peer, *, message_id: int, round_id: int = 0,
                policy: Policy | None = None, out: np.ndarray | None = None,
                nbytes: int | None = None, critical: np.ndarray | None = None) -> Future:
        """Post a receive; chunks land in ``out`` (or a new uint8 array of the sender's size)."""
        peer = resolve(peer)
        fut: Future = Future()
        with self._lock:
            self._check_open()
            rx = self.mux.start_receive(peer, round_id, message_id, time.monotonic(),
                                        policy=policy or ReliablePolicy(), out=out,
                                        nbytes=nbytes, critical=critical)
            self._futures[id(rx)] = (rx, fut)
            self._resolve(self.mux.pop_finished())
        self._wake()
        return fut

    def cancel(self, future: Future) -> None:
        """Cancel a send or receive: it resolves with a CANCELLED result. A cancelled
        receive sends no STOP, so a receive posted again for the message takes over."""
        with self._lock:
            for obj, fut in list(self._futures.values()):
                if fut is future and obj.result is None:
                    self.mux.cancel(obj, time.monotonic())
            self._resolve(self.mux.pop_finished())

    def counters(self) -> dict[str, int]:
        with self._lock:
            d = self.mux.counters()
        d.update({f"io_{k}": v for k, v in self.io_errors.items()})
        return d

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._wake()
        self._thread.join(timeout=5)
        with self._lock:
            for obj, fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(TransportError("endpoint closed"))
            self._futures.clear()
        self.sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> UdpEndpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._closing:
            raise TransportError("endpoint is closed")

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake, or closing

    def _resolve(self, finished: list) -> None:
        for obj in finished:
            entry = self._futures.pop(id(obj), None)
            if entry is None:
                continue
            fut = entry[1]
            result = obj.result
            if isinstance(result, (ReceiveResult, SendResult)) and not fut.done():
                fut.set_result(result)

    def _run(self) -> None:
        sock = self.sock
        recv = sock.recvfrom_into
        sendmsg = sock.sendmsg
        buf = bytearray(65536)
        mv = memoryview(buf)
        mux = self.mux
        loss = self.loss
        loss_needs_round = loss is not None and loss.needs_round
        drops = mux.drops
        monotonic = time.monotonic
        batch: list = []  # datagrams polled from the mux, sent up to pos
        pos = 0
        rlist = [sock, self._wake_r]
        while not self._closing:
            blocked = False
            with self._lock:
                now = monotonic()
                for _ in range(RECV_BURST):
                    try:
                        n, addr = recv(buf)
                    except BlockingIOError:
                        break
                    except OSError as e:  # e.g. ECONNREFUSED from an earlier ICMP
                        self.io_errors[errno.errorcode.get(e.errno, str(e.errno))] += 1
                        continue
                    if loss is not None and loss.drop(
                        now, peek_round(mv[:n]) if loss_needs_round else -1
                    ):
                        drops[DropReason.INJECTED_LOSS] += 1
                        continue
                    mux.datagram_received(mv[:n], addr, now)
                now = monotonic()
                deadline = mux.next_deadline()
                if deadline is not None and deadline <= now:
                    mux.timer_fired(now)
                if pos >= len(batch):
                    batch = mux.poll(now, SEND_BURST)
                    pos = 0
                while pos < len(batch):
                    try:
                        for parts, peer in batch[pos:] if pos else batch:
                            sendmsg(parts, (), 0, peer)
                            pos += 1
                    except BlockingIOError:  # socket buffer full: wait until writable
                        blocked = True
                        break
                    except OSError as e:  # unreachable peer, ...: that datagram is lost
                        self.io_errors[errno.errorcode.get(e.errno, str(e.errno))] += 1
                        pos += 1
                        if e.errno == errno.ENOBUFS:
                            blocked = True
                            break
                more = pos < len(batch) or mux.has_output()
                deadline = mux.next_deadline()  # sending may have armed timers (probes)
                finished = mux.pop_finished()
                if finished:
                    self._resolve(finished)
            if more and not blocked:
                timeout = 0.0
            elif deadline is None:
                timeout = 1.0
            else:
                timeout = min(1.0, max(0.0, deadline - monotonic()))
            if blocked:
                timeout = min(timeout, 0.001) if timeout else 0.001
                readable, _, _ = select.select(rlist, [sock], [], timeout)
            else:
                readable, _, _ = select.select(rlist, [], [], timeout)
            if self._wake_r in readable:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except BlockingIOError:
                    pass
