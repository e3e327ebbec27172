"""Meeting the other ranks through torch.distributed's store: which address this host
uses, one random session token for the job, and every rank's UDP endpoint."""

from __future__ import annotations

import os
import secrets
import socket

import torch.distributed as dist


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
