"""SharedBuffer: one switch's packet memory, shared by the queues of all its ports.

A datacenter switch does not give each port a fixed queue: its ports draw from one
buffer, and a port may take at most ``alpha`` times what is still free (the dynamic
threshold most shared-memory switches use), so one port under incast can hold far more
than an even split while the others are quiet - and less once they are busy. Bytes
stay held until the datagram has left the port. Virtual time; FakeNetwork asks it
before queueing a datagram at a host's downlink.
"""

from __future__ import annotations

import heapq


class SharedBuffer:
    __slots__ = ("_held", "alpha", "pool_bytes", "used")

    def __init__(self, pool_bytes: int, alpha: float = 1.0):
        if pool_bytes < 1 or not alpha > 0:
            raise ValueError("a shared buffer needs pool_bytes >= 1 and alpha > 0")
        self.pool_bytes = pool_bytes
        self.alpha = alpha
        self.used = 0
        self._held: list[tuple[float, int]] = []  # (when it leaves its port, bytes)

    def admits(self, now: float, port_bytes: int, size: int) -> bool:
        """Whether a port holding ``port_bytes`` may queue ``size`` more bytes now."""
        held = self._held
        while held and held[0][0] <= now:
            self.used -= heapq.heappop(held)[1]
        free = self.pool_bytes - self.used
        return size <= free and port_bytes + size <= self.alpha * free

    def hold(self, until: float, size: int) -> None:
        """``size`` bytes queued until ``until`` (when the datagram has left its port)."""
        heapq.heappush(self._held, (until, size))
        self.used += size
