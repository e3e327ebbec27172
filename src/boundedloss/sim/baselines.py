"""The baselines a simulated job is compared with, over the TCP model (``tcp.py``):
gloo's ring allreduce and ``tcp-ps`` (every worker's gradient to rank 0 and the mean
back), each rank a program of a :class:`~..net.simulated.SimRuntime`."""

from __future__ import annotations

from collections.abc import Hashable

from ..net.fake import NodeProfile
from ..net.simulated import SimFuture, SimRuntime
from ..policy import GLOO, TCP_PS
from .tcp import TcpHost


class SimTcp:
    """A host's TCP stack on the runtime's network: ``send``/``recv`` of byte counts to
    and from peers, each a future a program waits on. With CPU costs (``profile.cpu``)
    the network charges the stack's segments to the host's I/O thread, and each send or
    receive costs its caller ``message_main`` first (a gloo step's own work)."""

    def __init__(self, runtime: SimRuntime, address: Hashable, mtu: int,
                 profile: NodeProfile):
        self.runtime = runtime
        self.address = address
        self.stack = TcpHost(mtu, lambda: SimFuture(runtime))
        self._message_cost = 0.0 if profile.cpu is None else profile.cpu.message_main
        runtime.network.attach(address, self.stack, profile)  # type: ignore[arg-type]

    def send(self, peer: Hashable, nbytes: int) -> SimFuture:
        self._spend()
        self.stack.now = self.runtime.now
        fut = self.stack.send(peer, nbytes)
        self.runtime.network.wake(self.address)
        return fut  # type: ignore[return-value]

    def recv(self, peer: Hashable, nbytes: int) -> SimFuture:
        self._spend()
        self.stack.now = self.runtime.now
        return self.stack.recv(peer, nbytes)  # type: ignore[return-value]

    def _spend(self) -> None:
        if self._message_cost > 0:
            self.runtime.sleep_until(
                self.runtime.network.charge(self.address, main=self._message_cost))


def ring_allreduce(tcp: list[SimTcp], rank: int, nbytes: int) -> None:
    """One allreduce of ``nbytes`` as gloo's ring does it: 2(N-1) steps, in each a
    chunk of nbytes/N to the next rank and one from the previous, a step starting once
    the previous step's chunk has arrived."""
    n = len(tcp)
    me, right, left = tcp[rank], tcp[(rank + 1) % n].address, tcp[(rank - 1) % n].address
    chunk = -(-nbytes // n)
    sends = []
    for _ in range(2 * (n - 1)):
        incoming = me.recv(left, chunk)
        sends.append(me.send(right, chunk))
        incoming.result()
    for s in sends:
        s.result()


def parameter_server(tcp: list[SimTcp], rank: int, nbytes: int) -> None:
    """One exchange through rank 0: every worker sends its gradient, the server sends
    the mean back once it has them all."""
    server = tcp[0].address
    if rank == 0:
        workers = [t.address for t in tcp[1:]]
        for got in [tcp[0].recv(w, nbytes) for w in workers]:
            got.result()
        for sent in [tcp[0].send(w, nbytes) for w in workers]:
            sent.result()
    else:
        back = tcp[rank].recv(server, nbytes)
        tcp[rank].send(server, nbytes).result()
        back.result()


EXCHANGES = {GLOO: ring_allreduce, TCP_PS: parameter_server}
