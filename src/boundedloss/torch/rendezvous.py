"""Meeting the other ranks through torch.distributed's store: which address this host
uses, one random session token for the job, the job's datagram key, and every rank's
UDP endpoint."""

from __future__ import annotations

import hmac
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ..net.udp import largest_chunk, path_mtu
from ..protocol.auth import KEY_BYTES, AuthenticationError, job_key, key_check
from ..secret import SECRET_ENV, SECRET_FILE_ENV, secret_from_env

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


def agree_chunk_bytes(store: dist.Store, prefix: str, rank: int, world: int, host: str,
                      trailer: int = 0) -> int:
    """The chunk size for a job that did not set one: the largest whose datagram (with
    ``trailer`` bytes after the payload: an authentication tag) fits one packet of the
    path MTU between every pair of ranks' hosts (each rank measures its own paths,
    IP_MTU), at most a jumbo frame's (AUTO_CHUNK_MAX without a trailer) - the same on
    every rank."""
    store.set(f"{prefix}/host/{rank}", host)
    hosts = {store.get(f"{prefix}/host/{r}").decode() for r in range(world)}
    mine = AUTO_CHUNK_MAX - trailer
    for other in hosts:
        mtu = path_mtu((other, 9), host)
        if mtu is not None:
            mine = min(mine, largest_chunk(mtu, trailer))
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


# ------------------------------------------------------------------ authentication
#: how a job authenticates its datagrams: not at all, with a key derived from the
#: user's secret, or with one derived from a random secret rank 0 hands out
AUTH_MODES = ("off", "secret", "random")


@dataclass(frozen=True)
class JobAuth:
    """What a rank agreed at rendezvous: the job's ``mode`` (one of AUTH_MODES) and its
    datagram key (None when off; never printed)."""

    mode: str
    key: bytes | None = field(default=None, repr=False)


def rendezvous_auth(store: dist.Store, prefix: str, rank: int, world: int, session: int, *,
                    enabled: bool, environ: Mapping[str, str] | None = None) -> JobAuth:
    """The job's datagram key, the same on every rank (None when ``enabled`` is
    False), and the mode every rank runs in. Collective: every rank calls it with the
    same ``prefix`` and ``session``.

    With a secret (:func:`secret_from_env`), the key is derived from it and the session
    (:func:`~boundedloss.protocol.auth.job_key`). Without one, rank 0 draws a random
    secret and hands it out on the ``store`` in plaintext: the key is then as safe as
    the store's TCP traffic. Every rank publishes its mode and a check of its key
    (:func:`~boundedloss.protocol.auth.key_check`, which does not give the key away)
    and compares every other rank's with its own: a rank with another secret, without
    one, or without authentication fails rendezvous on every rank with a one-line
    AuthenticationError naming the ranks that differ from this one."""
    try:
        secret = secret_from_env(environ) if enabled else None
    except AuthenticationError:
        # say so on the store, so that the other ranks stop now, not at its timeout
        store.set(f"{prefix}/auth/{rank}", "error -")
        _linger(store, prefix, rank, world)
        raise
    mode = "off" if not enabled else "random" if secret is None else "secret"
    if rank == 0 and mode == "random":
        secret = secrets.token_bytes(KEY_BYTES)
        # (set before rank 0's own entry: a rank that read that one finds this one)
        store.set(f"{prefix}/auth/random", secret.hex())
    if rank != 0 and mode == "random":
        if _entry(store.get(f"{prefix}/auth/0"))[0] == "random":
            secret = bytes.fromhex(store.get(f"{prefix}/auth/random").decode())
        # (else rank 0 handed none out: the modes differ, and the check below says so)
    key = None if secret is None else job_key(secret, session)
    mine = (mode, b"-" if key is None else key_check(key).encode())
    store.set(f"{prefix}/auth/{rank}", f"{mode} {mine[1].decode()}")
    entries = [mine if r == rank else _entry(store.get(f"{prefix}/auth/{r}"))
               for r in range(world)]
    problem = _disagreement(rank, entries)
    if problem is not None:
        _linger(store, prefix, rank, world)
        raise AuthenticationError(problem)
    return JobAuth(mode, key)


#: how long a rank that fails rendezvous waits for the others to have read what it
#: published before it exits
LINGER_S = 10.0


def _linger(store: dist.Store, prefix: str, rank: int, world: int) -> None:
    """Say this rank has read every entry, then wait (at most LINGER_S) until every rank
    has: the rank hosting the store (rank 0's TCPStore) must not exit, taking the store
    with it, while another still reads why - that one would fail with a connection reset
    instead of its own one-line reason."""
    store.set(f"{prefix}/auth_read/{rank}", "1")
    try:
        store.wait([f"{prefix}/auth_read/{r}" for r in range(world)],
                   timedelta(seconds=LINGER_S))
    except Exception:  # noqa: BLE001 - a rank gone already: nothing left to wait for
        pass


def _entry(raw: bytes) -> tuple[str, bytes]:
    """A rank's published ``mode check``."""
    mode, _, check = bytes(raw).partition(b" ")
    return mode.decode("ascii", "replace"), check


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _disagreement(rank: int, entries: list[tuple[str, bytes]]) -> str | None:
    """Why the ranks' ``entries`` (mode, key check) do not let them authenticate each
    other, said from ``rank``'s side, naming the ranks that differ from it; None if
    they agree."""
    mode, check = entries[rank]
    this = f"this rank (rank {rank})"

    def differ(pred) -> tuple[str, bool]:
        rs = [r for r, e in enumerate(entries) if r != rank and pred(*e)]
        return (_ranks(rs), len(rs) == 1) if rs else ("", False)

    who, one = differ(lambda m, c: m not in AUTH_MODES)
    if who:
        return (f"{who} could not set up authentication ({'its' if one else 'their'} own "
                "error says why)")
    if mode == "off":
        who, one = differ(lambda m, c: m != "off")
        if who:
            return (f"{who} {'authenticates' if one else 'authenticate'} datagrams while "
                    f"{this} runs without authentication: turn it off (or on) on every rank")
        return None
    who, one = differ(lambda m, c: m == "off")
    if who:
        return (f"{who} {'runs' if one else 'run'} without authentication while {this} "
                "authenticates: turn it on (or off) on every rank")
    sources = f"{SECRET_ENV} or {SECRET_FILE_ENV}"
    who, one = differ(lambda m, c: m != mode)
    if who:
        has = "has" if one else "have"
        if mode == "secret":
            return (f"{who} {has} no secret ({sources}) while {this} has one: give every "
                    "rank the same secret")
        return (f"{who} {has} a secret ({sources}) while {this} has none: give every rank "
                "the same secret")
    who, one = differ(lambda m, c: not hmac.compare_digest(c, check))
    if who:
        if mode == "secret":
            return (f"the secret ({sources}) of {who} differs from that of {this}: every "
                    "rank of a job needs the same secret")
        return (f"{who} derived another key than {this} from the random secret rank 0 "
                "handed out: the store gave the ranks different values")
    return None
