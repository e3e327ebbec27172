"""Racks and a spine for a :class:`~.fake.FakeNetwork`: the two-tier topology of a
data centre, where traffic between racks shares each rack's links to the spine.

Every host belongs to a rack. A datagram between hosts of one rack crosses only their
own links (the rack's switch, as in the one-switch network); one between racks also
crosses its rack's uplink to the spine and the spine's downlink to the other rack, each
a link of ``uplink_bps`` with a drop-tail queue of ``queue_datagrams`` (a rack of H
hosts with links of B and an oversubscription of X has an uplink of H x B / X).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class FabricProfile:
    #: each rack's link to the spine, each way
    uplink_bps: float
    #: the queue in front of each of those links, in datagrams
    queue_datagrams: int = 1024


class Link:
    """One direction of a link: datagrams leave one after another at ``bps``; one that
    finds ``queue`` datagrams waiting is dropped. Offered in time order."""

    __slots__ = ("bps", "free_at", "queue", "_waiting")

    def __init__(self, bps: float, queue: int):
        self.bps = bps
        self.queue = queue
        self.free_at = 0.0
        self._waiting: deque[float] = deque()  # when each waiting datagram leaves

    def offer(self, now: float, nbytes: int) -> float | None:
        """When a datagram of ``nbytes`` offered at ``now`` has left; None: dropped."""
        waiting = self._waiting
        while waiting and waiting[0] <= now:
            waiting.popleft()
        if len(waiting) >= self.queue:
            return None
        self.free_at = max(now, self.free_at) + nbytes * 8 / self.bps
        waiting.append(self.free_at)
        return self.free_at


class Fabric:
    """Which rack each host is in, and the racks' links to and from the spine."""

    def __init__(self, profile: FabricProfile, racks: int):
        if racks < 1:
            raise ValueError(f"a fabric has at least one rack, not {racks}")
        self.up = [Link(profile.uplink_bps, profile.queue_datagrams) for _ in range(racks)]
        self.down = [Link(profile.uplink_bps, profile.queue_datagrams) for _ in range(racks)]
        self._rack: dict[Hashable, int] = {}

    def place(self, address: Hashable, rack: int) -> None:
        if not 0 <= rack < len(self.up):
            raise ValueError(f"rack {rack} of {len(self.up)}")
        self._rack[address] = rack

    def rack(self, address: Hashable) -> int | None:
        return self._rack.get(address)

    def crosses(self, src: Hashable, dst: Hashable) -> bool:
        """Does a datagram from ``src`` to ``dst`` go through the spine?"""
        a, b = self._rack.get(src), self._rack.get(dst)
        return a is not None and b is not None and a != b
