"""The barrier a simulated job's ranks wait at before each round, as ``bench
kernel-loss``'s ranks wait at Gloo's.

Where the barrier takes no time, whatever a round leaves its hosts to do - the last
STOPs and ACKs, a send's result - is done at the start of the next round. On the
testbed it is done while the ranks wait at the barrier: Gloo's barrier is messages over
TCP that cross the same links and queues and wait for the same busy cores, and a round
is timed from when the last rank left it. So ``gloo`` runs that barrier over the
simulator's TCP model (``tcp.py``); ``instant`` opens it at the virtual instant the last
rank arrives. (``sim --like-testbed`` keeps ``instant``: on the testbed our rounds leave
little work to the barrier, about 0.7 ms of CPU a rank, and Gloo's barrier here moves
the calibrated rows no nearer - BENCHMARKS.md, "The barrier between rounds".)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from ..net.fake import NodeProfile
from ..net.simulated import SimFuture, SimRuntime
from .baselines import SimTcp

#: what one of Gloo's barrier messages carries over TCP: no payload, its op header
GLOO_BARRIER_BYTES = 48
#: the port a rank's barrier stack listens at beside its endpoint (our systems')
BARRIER_PORT = 29500


class Barrier(Protocol):
    def wait(self, rank: int) -> None:
        """Return once every rank has called ``wait`` for this round."""


class InstantBarrier:
    """Every rank goes on at the virtual instant the last one arrives."""

    def __init__(self, runtime: SimRuntime, parties: int):
        self._runtime = runtime
        self._parties = parties
        self._arrived = 0
        self._open: SimFuture = SimFuture(runtime)

    def wait(self, rank: int) -> None:
        gate = self._open
        self._arrived += 1
        if self._arrived == self._parties:
            self._arrived = 0
            self._open = SimFuture(self._runtime)
            gate.set_result(None)
        gate.result()


class GlooBarrier:
    """Gloo's dissemination barrier (Hensgen, Finkel and Manber; ``gloo/barrier.cc``):
    in each step d = 1, 2, 4, ... below N, rank r sends a message to rank r + d and
    waits for one from rank r - d, then for its own send, each over TCP - ceil(log2 N)
    steps, each costing its caller a TCP message's CPU (``message_main``)."""

    def __init__(self, stacks: Sequence[SimTcp]):
        self._stacks = list(stacks)

    def wait(self, rank: int) -> None:
        n = len(self._stacks)
        me = self._stacks[rank]
        d = 1
        while d < n:
            incoming = me.recv(self._stacks[(rank - d) % n].address, GLOO_BARRIER_BYTES)
            sent = me.send(self._stacks[(rank + d) % n].address, GLOO_BARRIER_BYTES)
            incoming.result()
            sent.result()
            d <<= 1


def barrier_address(peer: tuple[str, int]) -> tuple[str, int]:
    """Where a rank of ours keeps its barrier's TCP stack: its host, another port."""
    return (peer[0], BARRIER_PORT)


def make_barrier(kind: str, runtime: SimRuntime, peers: Sequence[Hashable], mtu: int,
                 profiles: Sequence[NodeProfile],
                 stacks: Sequence[SimTcp] | None) -> Barrier:
    """The barrier ``kind`` names (``BARRIERS``) for ranks at ``peers``. ``stacks``: the
    ranks' TCP stacks where they have them (the TCP baselines', whose barrier shares
    their connections, as Gloo's does); else each rank gets one, on its host (its
    ``profiles``' CPU, sharing the host's cores)."""
    if kind not in BARRIERS:
        raise ValueError(f"{kind!r}: the barriers are {', '.join(BARRIERS)}")
    return BARRIERS[kind](runtime, peers, mtu, profiles, stacks)


def _instant(runtime: SimRuntime, peers: Sequence[Hashable], mtu: int,
             profiles: Sequence[NodeProfile], stacks: Sequence[SimTcp] | None) -> Barrier:
    return InstantBarrier(runtime, len(peers))


def _gloo(runtime: SimRuntime, peers: Sequence[Hashable], mtu: int,
          profiles: Sequence[NodeProfile], stacks: Sequence[SimTcp] | None) -> Barrier:
    if stacks is None:
        stacks = [SimTcp(runtime, barrier_address(peer), mtu, profile)  # type: ignore[arg-type]
                  for peer, profile in zip(peers, profiles)]
    return GlooBarrier(stacks)


#: every barrier a simulated job can wait at, by the name ``sim --barrier`` takes
BARRIERS: dict[str, Callable[..., Barrier]] = {"instant": _instant, "gloo": _gloo}
