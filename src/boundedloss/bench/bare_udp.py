"""The machine's own limit for a gradient exchange over UDP: the transpose allreduce's
datagrams and nothing else.

Each round has two phases, as the transpose allreduce's reduce-scatter and all-gather
do: every rank sends each peer one shard (``nbytes / world``) and receives one from
each. The datagrams leave as UDP_SEGMENT runs (one ``sendmsg`` per run, as long as the
kernel takes) and arrive coalesced (UDP_GRO) - the offloads boundedloss's endpoints use -
with
no acknowledgement, retransmission, authentication, aggregation or copy into a
gradient: whatever a transport does on top of that costs time on top of this. A lost
datagram is never recovered (the phase ends at its deadline short of it), so the loop
measures a lossless network; its rows say how much arrived.

Every datagram starts with its round and phase (``<II``), so a fast peer's next phase
is counted where it belongs.
"""

from __future__ import annotations

import select
import socket
import struct
import sys
import time
from collections import Counter

from ..net.udp import (
    DEFAULT_SOCKET_BUFFER,
    GSO_MAX_BYTES,
    GSO_MAX_SEGMENTS,
    SOL_UDP,
    UDP_GRO,
    UDP_SEGMENT,
    set_socket_buffer,
)

_TAG = struct.Struct("<II")  # round, phase


class BareExchange:
    """One rank's side of the bare loop: ``exchange(round_id)`` runs one round and
    returns the fraction of the expected datagrams that arrived."""

    def __init__(self, sock: socket.socket, rank: int, peers: list[tuple[str, int]],
                 nbytes: int, chunk_bytes: int, datagram_bytes: int, *,
                 deadline_s: float = 2.0):
        """``peers``: every rank's address, this one's included; ``nbytes``: the
        gradient each rank contributes; ``chunk_bytes`` of it in each datagram of
        ``datagram_bytes`` (a transport's chunk and its datagram, header included: the
        same datagrams, as many of them)."""
        if datagram_bytes < _TAG.size:
            raise ValueError(f"datagrams of {datagram_bytes} B cannot hold their tag")
        self.sock = sock
        self.rank = rank
        self.peers = [p for r, p in enumerate(peers) if r != rank]
        shard = -(-nbytes // len(peers))
        self.datagram_bytes = datagram_bytes
        self.per_peer = -(-shard // chunk_bytes)  # datagrams to each peer
        # the longest run the kernel takes, as the endpoints' runs are
        self.run = min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // datagram_bytes)
        self.deadline_s = deadline_s
        self.counts: Counter[tuple[int, int]] = Counter()
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
        set_socket_buffer(sock, "RCV", DEFAULT_SOCKET_BUFFER)
        set_socket_buffer(sock, "SND", 16 << 20)
        sock.setblocking(False)
        self._buf = bytearray(1 << 16)
        self._segmented = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", datagram_bytes))]

    def _run(self, round_id: int, phase: int, n: int) -> bytes:
        tag = _TAG.pack(round_id, phase)
        return (tag + bytes(self.datagram_bytes - _TAG.size)) * n

    def _send(self, data: bytes, peer: tuple[str, int]) -> None:
        while True:
            try:
                self.sock.sendmsg([data], self._segmented, 0, peer)
                return
            except BlockingIOError:  # the send buffer is full: let the kernel drain it
                select.select([], [self.sock], [], 0.01)
                self.drain()

    def drain(self) -> None:
        """Read whatever has arrived, counting each datagram under its round and phase."""
        while True:
            try:
                n, anc, _, _ = self.sock.recvmsg_into([self._buf], 64)
            except BlockingIOError:
                return
            if n < _TAG.size:
                continue
            size = n
            for level, kind, data in anc:
                if level == SOL_UDP and kind == UDP_GRO:  # the coalesced segments' size
                    size = int.from_bytes(data[:4], sys.byteorder)
            segments = -(-n // size)
            first = _TAG.unpack_from(self._buf, 0)
            last_at = (segments - 1) * size
            if n - last_at >= _TAG.size and _TAG.unpack_from(self._buf, last_at) == first:
                # a peer's tags only grow and GRO keeps their order: one tag for the run
                self.counts[first] += segments
                continue
            for off in range(0, n, size):  # a run across a phase's end: segment by segment
                if n - off >= _TAG.size:
                    self.counts[_TAG.unpack_from(self._buf, off)] += 1

    def _phase(self, round_id: int, phase: int) -> float:
        expected = self.per_peer * len(self.peers)
        full, tail = divmod(self.per_peer, self.run)
        runs = [self.run] * full + ([tail] if tail else [])
        bodies = {n: self._run(round_id, phase, n) for n in set(runs)}
        for n in runs:  # one run to each peer in turn, reading what has come in between
            for peer in self.peers:
                self._send(bodies[n], peer)
            self.drain()
        key = (round_id, phase)
        give_up = time.monotonic() + self.deadline_s
        while self.counts[key] < expected and time.monotonic() < give_up:
            select.select([self.sock], [], [], 0.01)
            self.drain()
        return min(1.0, self.counts.pop(key, 0) / expected)

    def exchange(self, round_id: int) -> float:
        """One round (both phases); the fraction of its datagrams that arrived."""
        got = min(self._phase(round_id, 0), self._phase(round_id, 1))
        for key in [k for k in self.counts if k[0] < round_id]:  # stragglers of old rounds
            del self.counts[key]
        return got
