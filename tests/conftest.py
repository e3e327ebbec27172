"""Shared helpers for the transport-core tests (wire, protocol, fake network).

Everything here is deterministic: hypothesis runs derandomized (``PROPERTY``), random
data comes from seeded numpy generators, and time is virtual.

``HandNet`` wires TransferMux endpoints together by hand, with a fixed one-way delay
and a drop filter that sees every datagram's kind - the tool for tests that must lose
a *particular* control datagram (the FakeNetwork's loss models are kind-blind).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np
from hypothesis import HealthCheck, settings

from boundedloss import wire
from boundedloss.protocol import TransferMux

#: Base settings for every property test in these files: reproducible, no deadline
#: (a lossy transfer's real time varies on a noisy 2-core machine), no example database.
PROPERTY = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SESSION = 0x5EED_0000_CAFE_F00D

# Sentinel for destination buffers: sources are drawn from 0..254, so a chunk that
# still holds 255 anywhere was never written, and a written chunk always differs.
SENTINEL = 0xFF


def source_bytes(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` random bytes that never contain SENTINEL."""
    return np.random.default_rng(seed).integers(0, SENTINEL, size=nbytes, dtype=np.uint8)


def chunk_slices(nbytes: int, chunk_bytes: int) -> list[slice]:
    count = wire.chunk_count(nbytes, chunk_bytes)
    return [slice(i * chunk_bytes, min((i + 1) * chunk_bytes, nbytes)) for i in range(count)]


def chunks_equal(src: np.ndarray, dst: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """Bool per chunk: does the destination chunk equal the source chunk byte for byte?"""
    s = np.asarray(src).reshape(-1).view(np.uint8)
    d = np.asarray(dst).reshape(-1).view(np.uint8)
    assert s.nbytes == d.nbytes
    return np.array(
        [np.array_equal(s[sl], d[sl]) for sl in chunk_slices(s.nbytes, chunk_bytes)],
        dtype=bool,
    )


def kind_of(data: bytes) -> wire.Kind:
    return wire.decode(data)[0].kind


class HandNet:
    """TransferMux endpoints joined by hand: every datagram takes ``delay`` seconds, in
    order, unless ``drop(src, dst, header, data, nth)`` says to lose it (``nth`` is how
    many datagrams of that kind ``src`` has sent so far, this one included)."""

    def __init__(
        self,
        delay: float = 1e-4,
        drop: Callable[[object, object, wire.Header, bytes, int], bool] | None = None,
    ):
        self.now = 0.0
        self.delay = delay
        self.drop = drop
        self.nodes: dict[object, TransferMux] = {}
        self._heap: list = []
        self._seq = 0
        self.sent: Counter = Counter()  # (src, kind) -> datagrams sent
        self.lost: Counter = Counter()  # kind -> datagrams dropped by the filter
        self.log: list[tuple[float, object, object, wire.Kind, bool]] = []

    def add(self, name, mux: TransferMux) -> TransferMux:
        self.nodes[name] = mux
        return mux

    def _flush(self, name) -> None:
        mux = self.nodes[name]
        while mux.has_output():
            batch = mux.poll(self.now, 1024)
            if not batch:
                break
            for parts, peer in batch:
                data = b"".join(bytes(p) for p in parts)
                header, _ = wire.decode(data)  # everything a core sends is well-formed
                self.sent[(name, header.kind)] += 1
                lost = self.drop is not None and self.drop(
                    name, peer, header, data, self.sent[(name, header.kind)]
                )
                self.log.append((self.now, name, peer, header.kind, lost))
                if lost:
                    self.lost[header.kind] += 1
                    continue
                if peer in self.nodes:
                    self._seq += 1
                    heapq.heappush(self._heap, (self.now + self.delay, self._seq, peer, name, data))

    def run(
        self,
        transfers: Iterable = (),
        until: float = math.inf,
        max_steps: int = 1_000_000,
    ) -> float:
        """Advance virtual time until every transfer has a result, ``until``, or silence."""
        transfers = list(transfers)
        for _ in range(max_steps):
            for name in self.nodes:
                self._flush(name)
            if transfers and all(t.result is not None for t in transfers):
                return self.now
            times = [self._heap[0][0]] if self._heap else []
            for mux in self.nodes.values():
                d = mux.next_deadline()
                if d is not None:
                    times.append(d)
            if not times:
                return self.now  # nothing in flight and no timer: quiescent
            t = min(times)
            if t > until:
                self.now = until
                return self.now
            self.now = max(self.now, t)
            while self._heap and self._heap[0][0] <= self.now:
                _, _, dst, src, data = heapq.heappop(self._heap)
                self.nodes[dst].datagram_received(data, src, self.now)
            for mux in self.nodes.values():
                d = mux.next_deadline()
                if d is not None and d <= self.now:
                    mux.timer_fired(self.now)
        raise AssertionError(f"HandNet: no progress after {max_steps} steps at t={self.now}")
