"""Meeting the other ranks through torch.distributed's store: which address this host
uses, one random session token for the job, and every rank's UDP endpoint."""

from __future__ import annotations

import os
import secrets
import socket

import torch.distributed as dist

from ..net.udp import largest_chunk, path_mtu

#: the largest chunk a job picks by itself: one that fits a 9,000-byte jumbo frame.
#: A larger path MTU (loopback's 65,536) would only make every lost datagram take more
#: of a gradient with it.
AUTO_CHUNK_MAX = largest_chunk(9000)


def local_ip() -> str:
    """The address this host uses to reach the job's master (works in namespaces)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((socket.gethostbyname(master), 9))
        return s.getsockname()[0]
    finally:
        s.close()


def default_store() -> dist.Store:
    """The store of the default process group (``init_process_group``'s rendezvous)."""
    # torch (2.13) has no public accessor for it
    return dist.distributed_c10d._get_default_store()  # noqa: SLF001


def agree_session(store: dist.Store, prefix: str, rank: int) -> int:
    """A random 64-bit session token drawn by rank 0, the same on every rank."""
    if rank == 0:
        store.set(f"{prefix}/session", str(secrets.randbits(64)))
    return int(store.get(f"{prefix}/session").decode())


def agree_chunk_bytes(store: dist.Store, prefix: str, rank: int, world: int, host: str) -> int:
    """The chunk size for a job that did not set one: the largest whose datagram fits
    one packet of the path MTU between every pair of ranks' hosts (each rank measures
    its own paths, IP_MTU), at most AUTO_CHUNK_MAX - the same on every rank."""
    store.set(f"{prefix}/host/{rank}", host)
    hosts = {store.get(f"{prefix}/host/{r}").decode() for r in range(world)}
    mine = AUTO_CHUNK_MAX
    for other in hosts:
        mtu = path_mtu((other, 9), host)
        if mtu is not None:
            mine = min(mine, largest_chunk(mtu))
    store.set(f"{prefix}/chunk/{rank}", str(mine))
    return min(int(store.get(f"{prefix}/chunk/{r}").decode()) for r in range(world))


def exchange_addresses(store: dist.Store, prefix: str, rank: int, world: int,
                       address: tuple[str, int]) -> list[tuple[str, int]]:
    """Publish this rank's UDP ``address``; every rank's, in rank order (waits for
    each to be published)."""
    host, port = address
    store.set(f"{prefix}/endpoint/{rank}", f"{host}:{port}")
    peers = []
    for r in range(world):
        h, p = store.get(f"{prefix}/endpoint/{r}").decode().rsplit(":", 1)
        peers.append((h, int(p)))
    return peers
