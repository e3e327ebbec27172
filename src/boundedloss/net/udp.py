"""UdpEndpoint: the endpoint's real driver - one UDP socket driving a TransferMux from
a background I/O thread (the message API above it is :class:`~.endpoint.Endpoint`'s).

Many concurrent messages to and from many peers share the socket; the mux
demultiplexes them by header. ``send`` and ``receive`` return
``concurrent.futures.Future`` objects that resolve to SendResult / ReceiveResult.

The I/O thread drains the socket in bursts (``recvfrom_into``, or ``recvmsg_into``
with offload) into one reusable buffer (the receiver copies each payload once, into the
destination), sends with ``sendmsg`` gathering header and payload views (no copy in
Python), and sleeps in ``select`` until the socket is readable, a caller wakes it, or
the mux's next deadline. An exception in that thread (a bug, say in a policy) fails
every pending and later call with it as the cause.

Runs of equal-sized datagrams to one peer (a pass of full chunks) go out as one
``sendmsg`` with Linux's UDP segmentation offload (``UDP_SEGMENT``): the kernel (or the
NIC) cuts the gathered buffer into the same datagrams, each with its own header, at a
quarter of the cost of a system call per datagram. Where the kernel refuses it the
endpoint falls back to one call per datagram. On receive (``UDP_GRO``) the kernel hands
such a run over in one ``recvmsg`` and the mux takes a run of DATA in whole-array steps
(``TransferMux.run_received``). ``BOUNDEDLOSS_UDP_GSO=0`` turns both off (the
emulator's nodes do: a qdisc sees a segmented run as one packet, so netem's loss and a
tbf's queue would drop whole runs instead of datagrams).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future

from ..protocol.auth import DatagramAuth
from ..protocol.mux import TransferMux
from ..protocol.types import (
    DataRun,
    TransportConfig,
    TransportError,
)
from ..wire import HEADER_BYTES, DropReason, peek_round
from . import native
from .endpoint import Endpoint
from .loss import LossModel
from .native import NativeDataPath

RECV_BURST = 512
SEND_BURST_RUNS = 2048  # datagrams polled at once when the compiled path sends them
RECV_BATCH = 64  # messages the compiled data path reads per system call
SEND_BURST = 256
DEFAULT_SOCKET_BUFFER = 64 << 20

# UDP segmentation offload (linux/udp.h); Python 3.11's socket module names neither.
SOL_UDP = getattr(socket, "SOL_UDP", 17)
UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
UDP_GRO = getattr(socket, "UDP_GRO", 104)
GSO_MAX_SEGMENTS = 64  # UDP_MAX_SEGMENTS
GSO_MAX_BYTES = 65507  # one IPv4 datagram's worth of UDP payload
# what a refused segmented send fails with: no offload for the route's device, a segment
# larger than its MTU, an old kernel
_GSO_REFUSED = {errno.EIO, errno.EINVAL, errno.EMSGSIZE, errno.ENOPROTOOPT, errno.EOPNOTSUPP}


def gso_enabled_by_env() -> bool:
    flag = os.environ.get("BOUNDEDLOSS_UDP_GSO", "1").strip().lower()
    return flag not in ("0", "no", "off", "false")


def segment_run(batch: list, start: int) -> tuple[int, int]:
    """``(end, size)``: ``batch[start:end]`` can go out as one segmented send of
    ``size``-byte segments - the same peer, each datagram ``size`` bytes but the last,
    which may be shorter, within the kernel's limits. ``end - start == 1`` when there is
    no run to make."""
    parts, peer = batch[start]
    size = sum(map(len, parts))
    limit = min(start + GSO_MAX_SEGMENTS, start + GSO_MAX_BYTES // max(size, 1), len(batch))
    end = start + 1
    while end < limit:
        parts, p = batch[end]
        if p != peer:
            break
        n = sum(map(len, parts))
        if n != size:
            if n < size:
                end += 1  # a short last segment closes the run
            break
        end += 1
    return end, size


# Path MTU (linux/in.h), which Python's socket module does not name: IP_MTU_DISCOVER set
# to IP_PMTUDISC_DO sends every datagram with DF and refuses one larger than the path
# MTU (EMSGSIZE) instead of fragmenting it; IP_MTU reads a connected socket's path MTU.
IP_MTU_DISCOVER, IP_PMTUDISC_DO, IP_MTU = 10, 2, 14
IPV4_UDP_OVERHEAD = 28  # IPv4 header without options, and UDP's


def path_mtu(peer: tuple[str, int], local_host: str = "0.0.0.0") -> int | None:
    """The path MTU toward ``peer`` as the kernel knows it (the route's, or less if a
    smaller one was discovered); None where the kernel cannot say."""
    if not sys.platform.startswith("linux"):
        return None
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.bind((local_host, 0))
        probe.connect(peer)
        return probe.getsockopt(socket.IPPROTO_IP, IP_MTU)
    except OSError:
        return None
    finally:
        probe.close()


def largest_chunk(mtu: int, trailer: int = 0) -> int:
    """The largest chunk whose datagram fits one IPv4 packet of ``mtu`` bytes
    (``trailer``: bytes after the payload - an authentication tag's)."""
    return mtu - IPV4_UDP_OVERHEAD - HEADER_BYTES - trailer


class ChunkTooLarge(TransportError):
    """The configured chunk does not fit one packet on the path to a peer."""


# Linux's SO_SNDBUFFORCE / SO_RCVBUFFORCE, which Python's socket module does not name.
_FORCE = {"SND": 32, "RCV": 33} if sys.platform.startswith("linux") else {}


def set_socket_buffer(sock: socket.socket, which: str, size: int) -> int:
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


log = logging.getLogger(__name__)
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


def resolve(peer) -> tuple[str, int]:
    host, port = peer
    return socket.gethostbyname(host), int(port)


class UdpEndpoint(Endpoint):
    driver_name = "I/O thread"

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
        segmentation_offload: bool | None = None,
        native_data_path: bool | None = None,
        auth_key: bytes | None = None,
    ):
        """``auth_key``: the job's 32-byte key (``protocol.auth.job_key``); every
        datagram is then sealed with a tag and every one that comes in must verify.
        An authenticated endpoint binds one address (``host``), as the tags cover it."""
        config = config or TransportConfig()
        if auth_key is not None and host in ("", "0.0.0.0"):
            raise ValueError("an authenticated endpoint binds one address, not any: its "
                             "datagrams' tags cover it")
        self.loss = loss
        #: send runs of datagrams with UDP_SEGMENT and take them in with UDP_GRO (None:
        #: unless BOUNDEDLOSS_UDP_GSO=0); cleared if the kernel refuses a segmented send
        if segmentation_offload is None:
            segmentation_offload = gso_enabled_by_env()
        self.segmentation_offload = bool(segmentation_offload) and sys.platform.startswith("linux")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.rcvbuf = set_socket_buffer(self.sock, "RCV", socket_buffer)
        self.sndbuf = set_socket_buffer(self.sock, "SND", socket_buffer)
        # The flow-control window must fit the kernel's receive buffer, or the kernel
        # drops what does not: getsockopt reports twice the usable bytes, and a queued
        # datagram costs up to twice its size, hence a quarter. (Peers of one job run on
        # alike hosts, so our own buffer stands in for the receiver's.)
        fits = max(config.chunk_bytes, self.rcvbuf // 4)
        if config.window_bytes > fits:
            config = dataclasses.replace(config, window_bytes=fits)
        self.config = config
        self.sock.bind((host, port))
        self.auth = None if auth_key is None else DatagramAuth(auth_key, self.address)
        #: bytes after each datagram's payload (the tag's, when authenticating)
        self.trailer = 0 if self.auth is None else self.auth.trailer_bytes
        self.mux = TransferMux(session, config, auth=self.auth)
        if sys.platform.startswith("linux"):
            # DF on every datagram: the kernel refuses one the path cannot carry rather
            # than fragmenting it (a lost fragment loses the whole datagram)
            self.sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        self._fits: set[tuple[str, int]] = set()  # peers whose path carries our chunks
        self._addresses: dict[tuple, tuple[str, int]] = {}  # peer as given -> resolved
        #: the compiled DATA path (None: the Python core takes every datagram);
        #: ``native_data_path`` None: use it unless BOUNDEDLOSS_NATIVE=0 or not built
        self.data_path: NativeDataPath | None = None
        #: why the Python path runs where the compiled one was asked for (else None)
        self.data_path_note: str | None = None
        if native_data_path or (native_data_path is None and native.enabled()):
            if self.auth is not None and not native.authenticates():
                self.data_path_note = native.AUTH_FALLBACK
                if native_data_path:
                    raise TransportError(native.AUTH_FALLBACK)
                _warn_once(native.AUTH_FALLBACK)
            else:
                self.data_path = NativeDataPath(self.mux)
        #: runs of datagrams arrive coalesced (UDP_GRO); False where the kernel has none
        self.receive_offload = False
        if self.segmentation_offload:
            try:
                self.sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.receive_offload = True
            except OSError:
                pass
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._start_api()
        self.io_errors: Counter[str] = Counter()
        self.sendmsg_calls = 0  # system calls that sent datagrams (one per segmented run)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the seam
    def clock(self) -> float:
        return time.monotonic()

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def _new_future(self) -> Future:
        return Future()

    def _stop_driver(self) -> None:
        # (the thread ends and the sockets close before close() fails what still waits:
        # nothing can resolve a future after that)
        self._wake()
        self._thread.join(timeout=5)
        self.sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def _driver_counters(self) -> dict[str, int]:
        d = {f"io_{k}": v for k, v in self.io_errors.items()}
        d["sendmsg_calls"] = self.sendmsg_calls
        d["native_data_path"] = int(self.data_path is not None)
        return d

    # --------------------------------------------------------------- internals
    def _resolve_address(self, peer) -> tuple[str, int]:
        """``peer`` as an IPv4 ``(host, port)``, looked up once per endpoint (a job's
        peers stay put; ``gethostbyname`` releases the GIL, which a busy I/O thread then
        holds for a while)."""
        key = tuple(peer)
        address = self._addresses.get(key)
        if address is None:
            address = resolve(key)
            if len(self._addresses) < 4096:
                self._addresses[key] = address
        return address

    def check_path(self, peer: tuple[str, int]) -> None:
        """Raise ChunkTooLarge if a chunk's datagram does not fit one packet to ``peer``
        (its answers come back the same way: a receive checks it too)."""
        if peer in self._fits:
            return
        mtu = path_mtu(peer, self.address[0])
        cb = self.config.chunk_bytes
        most = None if mtu is None else largest_chunk(mtu, self.trailer)
        if most is not None and cb > most:
            tag = (f" (authenticated datagrams carry a {self.trailer}-byte nonce and tag)"
                   if self.trailer else "")
            raise ChunkTooLarge(
                f"chunk size {cb:,} B does not fit one packet to {peer[0]}:{peer[1]}: the "
                f"path MTU is {mtu:,} B, so chunks can be at most {most:,} B{tag} "
                f"(set TransportConfig.chunk_bytes)")
        self._fits.add(peer)

    def _run(self) -> None:
        try:
            self._io_loop()
        except BaseException as e:  # noqa: BLE001 - nothing may die silently here
            self._fail(e)

    def _wake(self) -> None:
        self.wakeups += 1
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake, or closing

    def _send_run(self, data_path, run: DataRun, start: int) -> tuple[int, bool]:
        """Send ``run.indices[start:]`` through the compiled path: how far it got, and
        whether the socket is full (or out of buffers) so the loop must wait."""
        address = data_path.address(run.peer)
        if address is None:  # (resolve() makes every peer an IPv4 address)
            raise TransportError(f"the compiled data path sends to IPv4 peers, not {run.peer!r}")
        ip, port = address
        nbytes = run.payload.nbytes
        while True:
            start, err, end, calls = data_path.dispatcher.send_run(
                self.sock, ip, port, run.headers, run.payload, run.indices, start,
                run.chunk_bytes, nbytes, self.segmentation_offload, run.last_flags)
            self.sendmsg_calls += calls
            if err == 0:
                return start, False
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                return start, True
            if self.segmentation_offload and end - start > 1 and err in _GSO_REFUSED:
                self.segmentation_offload = False  # one datagram per call from now on
                self.io_errors["gso_refused"] += 1
                continue
            # unreachable peer, ...: those datagrams are lost
            self.io_errors[errno.errorcode.get(err, str(err))] += 1
            if err == errno.ENOBUFS:
                return end, True
            start = end

    def _receive_native(self, data_path: NativeDataPath, now: float) -> None:
        """Drain the socket through the compiled data path, a batch per system call."""
        for _ in range(RECV_BURST // RECV_BATCH):
            try:
                got = data_path.read(self.sock)
            except OSError as e:  # e.g. ECONNREFUSED from an earlier ICMP: nothing read
                self.io_errors[errno.errorcode.get(e.errno or 0, str(e.errno))] += 1
                continue
            if got:
                data_path.take_read(now, self.loss)
            if got < RECV_BATCH:
                return  # (a short batch: the socket is drained)

    def _io_loop(self) -> None:
        sock = self.sock
        recv = sock.recvfrom_into
        recvmsg = sock.recvmsg_into
        gro = self.receive_offload
        gro_space = socket.CMSG_SPACE(4)
        sendmsg = sock.sendmsg
        buf = bytearray(65536)
        bufs = [buf]
        mv = memoryview(buf)
        mux = self.mux
        loss = self.loss
        loss_needs_round = loss is not None and loss.needs_round
        drops = mux.drops
        monotonic = time.monotonic
        batch: list = []  # datagrams polled from the mux, sent up to pos
        pos = 0
        run_pos = 0  # how far into batch[pos], a DataRun, the compiled path has sent
        calls = 0
        gso_cmsg: dict[int, list] = {}  # segment size -> its UDP_SEGMENT control message
        wake_r = self._wake_r
        rlist = [sock, wake_r]
        data_path = self.data_path
        # (the core's calls, looked up once)
        next_deadline, timer_fired, poll = mux.next_deadline, mux.timer_fired, mux.poll
        has_output, pop_finished = mux.has_output, mux.pop_finished
        # Authenticating, the compiled path seals the core's control datagrams as it sends
        # them (poll hands them out unsealed); one it leaves to sendmsg is sealed here.
        seal_on_send = data_path is not None and self.auth is not None
        seal = None if self.auth is None else self.auth.seal
        lock = self._lock

        def lost(view) -> bool:
            """Did the loss model drop this datagram (counted if so)?"""
            if loss is None or not loss.drop(now, peek_round(view) if loss_needs_round else -1):
                return False
            drops[DropReason.INJECTED_LOSS] += 1
            return True

        while not self._closing:
            blocked = False
            with lock:
                now = monotonic()
                for _ in range(RECV_BURST if data_path is None else 0):
                    size = 0
                    try:
                        if gro:
                            n, anc, _, addr = recvmsg(bufs, gro_space)
                            if anc and anc[0][1] == UDP_GRO:
                                size = int.from_bytes(anc[0][2][:4], sys.byteorder)
                        else:
                            n, addr = recv(buf)
                    except BlockingIOError:
                        break
                    except OSError as e:  # e.g. ECONNREFUSED from an earlier ICMP
                        self.io_errors[errno.errorcode.get(e.errno or 0, str(e.errno))] += 1
                        continue
                    if 0 < size < n and n // size >= mux.run_min:
                        # a coalesced run long enough to take at once: whole datagrams of
                        # size, then (a short last one) what is left
                        start = n - n % size
                        keep = (None if loss is None else
                                [not lost(mv[o : o + size]) for o in range(0, start, size)])
                        mux.run_received(mv[:start], size, addr, now, keep)
                        offsets: Sequence[int] = (start,) if start < n else ()
                    else:  # one datagram, or a run too short to gain by: one by one
                        offsets = range(0, n, size) if 0 < size < n else (0,)
                        size = size or n
                    for o in offsets:
                        view = mv[o : min(o + size, n)]
                        if not lost(view):
                            mux.datagram_received(view, addr, now)
                if data_path is not None:
                    self._receive_native(data_path, now)
                now = monotonic()
                deadline = next_deadline()
                if deadline is not None and deadline <= now:
                    timer_fired(now)
                if pos >= len(batch):
                    if data_path is None:
                        batch = poll(now, SEND_BURST)
                    else:
                        batch = poll(now, SEND_BURST_RUNS, runs=True, sealed=not seal_on_send)
                    pos = 0
                while pos < len(batch):
                    item = batch[pos]
                    if type(item) is DataRun:
                        # (the compiled path sends it; the sends are counted there)
                        run_pos, blocked = self._send_run(data_path, item, run_pos)
                        if blocked:
                            break
                        pos, run_pos = pos + 1, 0
                        continue
                    if data_path is not None:
                        # (the compiled path sends the control datagrams, up to 64 a call)
                        end, err, sent = data_path.send_datagrams(sock, batch, pos,
                                                                  seal_on_send)
                        calls += sent
                        if end > pos:
                            pos = end
                            continue
                        if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                            blocked = True
                            break
                        if err:  # unreachable peer, ...: that datagram is lost
                            self.io_errors[errno.errorcode.get(err, str(err))] += 1
                            pos += 1
                            if err == errno.ENOBUFS:
                                blocked = True
                                break
                            continue
                        # (a datagram the compiled path does not send: below, by sendmsg)
                    if self.segmentation_offload and data_path is None:
                        end, size = segment_run(batch, pos)
                    else:
                        end = pos + 1
                    try:
                        if end - pos > 1:
                            cmsg = gso_cmsg.get(size)
                            if cmsg is None:
                                cmsg = gso_cmsg[size] = [
                                    (SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))]
                            sendmsg([b for parts, _ in batch[pos:end] for b in parts], cmsg, 0,
                                    batch[pos][1])
                        else:
                            item = batch[pos]
                            parts, peer = item[0], item[1]
                            if seal_on_send and len(item) == 2:
                                parts = seal(parts, peer)  # type: ignore[misc]
                            sendmsg(parts, (), 0, peer)
                        calls += 1
                        pos = end
                    except BlockingIOError:  # socket buffer full: wait until writable
                        blocked = True
                        break
                    except OSError as e:
                        if end - pos > 1 and e.errno in _GSO_REFUSED:
                            # no offload on this path: one call per datagram from now on
                            self.segmentation_offload = False
                            self.io_errors["gso_refused"] += 1
                            continue
                        # unreachable peer, ...: those datagrams are lost
                        self.io_errors[errno.errorcode.get(e.errno or 0, str(e.errno))] += 1
                        pos = end
                        if e.errno == errno.ENOBUFS:
                            blocked = True
                            break
                self.sendmsg_calls += calls
                calls = 0
                more = pos < len(batch) or has_output()
                deadline = next_deadline()  # sending may have armed timers (probes)
                finished = pop_finished()
                if finished:
                    self._resolve(finished)
                now = monotonic()
                if more and not blocked:
                    timeout = 0.0
                elif deadline is None:
                    timeout = 1.0
                else:
                    timeout = min(1.0, max(0.0, deadline - now))
                if blocked:
                    timeout = min(timeout, 0.001) if timeout else 0.001
                self.sleeps_until = now + timeout  # (what receive() compares its timers with)
            if blocked:
                readable, _, _ = select.select(rlist, [sock], [], timeout)
            else:
                readable, _, _ = select.select(rlist, [], [], timeout)
            if wake_r in readable:
                try:
                    # (one read: a wake is a byte, and what a full read leaves keeps the
                    # socket readable for the next pass)
                    wake_r.recv(4096)
                except BlockingIOError:
                    pass
