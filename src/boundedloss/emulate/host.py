"""The host's side of the testbed: whether this process may build one, the namespaces of
ours that exist (and sweeping them), and a probe that a testbed can run here at all."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
from collections.abc import Iterator

from . import netns, processes
from .errors import TestbedError

_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,15}$")

NEED_ROOT = ("the kernel testbed needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); without "
             "root, the boundedloss commands (testbed, demo, compare, bench kernel-loss) "
             "run it in a user namespace of their own where the kernel allows that")
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21  # naming a namespace bind-mounts it


# ----------------------------------------------------------------------------- system


def _effective_caps() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def have_privileges() -> bool:
    """True when this process may create network namespaces and configure them."""
    caps = _effective_caps()
    if caps is None:
        return os.geteuid() == 0
    need = (1 << _CAP_NET_ADMIN) | (1 << _CAP_SYS_ADMIN)
    return caps & need == need


def require_privileges() -> None:
    if not have_privileges():
        raise TestbedError(NEED_ROOT)


@contextlib.contextmanager
def kernel_step(what: str) -> Iterator[None]:
    """The kernel's refusal of ``what`` (an OSError, or pyroute2's NetlinkError) as one
    TestbedError line."""
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        yield
    except NetlinkError as e:
        raise TestbedError(f"{what}: {os.strerror(e.code) if e.code else e}") from None
    except OSError as e:
        raise TestbedError(f"{what}: {e.strerror or e}") from None


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (as ``ip netns list`` shows them)."""
    return netns.names()


def _leftover_re(prefix: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(prefix)}[0-9a-f]{{6}}-(sw|server|w\d+|probe)$")


def _root_veths(prefix: str) -> list[str]:
    """Links in this namespace named like ours (this design creates none; the sweep
    looks anyway, and only ever at links with our exact name pattern)."""
    pat = re.compile(rf"^{re.escape(prefix)}[0-9a-f]{{6}}-\S+$")
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    return [n for n in names if pat.match(n)]


def leftovers(prefix: str = "bl-") -> list[str]:
    """Namespaces (and root-namespace veths) whose names match ``prefix`` + id: what
    ``sweep`` would remove."""
    check_prefix(prefix)
    pat = _leftover_re(prefix)
    names = [ns for ns in list_namespaces() if pat.match(ns)]
    return names + [f"link:{name}" for name in _root_veths(prefix)]


def delete_namespace(ns: str) -> None:
    """End every process left in namespace ``ns``, then delete it."""
    processes.end_pids(netns.pids_in(ns))
    netns.delete(ns)


def sweep(prefix: str = "bl-") -> list[str]:
    """Remove every testbed leftover named ``prefix`` + id, with or without a state file:
    processes still inside those namespaces are ended, the namespaces deleted (which
    deletes their veths, routes, qdiscs and drop rules with them). Returns what was
    removed."""
    require_privileges()
    found = leftovers(prefix)
    for name in found:
        if name.startswith("link:"):
            from pyroute2 import IPRoute

            with IPRoute() as ipr, contextlib.suppress(Exception):
                ipr.link("del", index=ipr.link_lookup(ifname=name[5:])[0])
        else:
            delete_namespace(name)
    still = leftovers(prefix)
    if still:
        raise TestbedError(f"could not remove {', '.join(still)}")
    return found


def check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix or ""):
        raise ValueError(f"bad prefix {prefix!r}: 1-16 characters, a letter first, then "
                         "letters, digits, '_', '.', '-' (it names everything we create)")


def available(prefix: str = "bl-") -> tuple[bool, str]:
    """Can a testbed with random loss run here? ``(True, "")`` or ``(False, reason)``.
    Creates and deletes one probe namespace, with an nf_tables table in it, to be sure."""
    if not have_privileges():
        return False, NEED_ROOT
    from . import nft

    try:
        import pyroute2  # noqa: F401 - (the testbed's netlink messages)
    except ImportError as e:
        return False, f"pyroute2 is not installed ({e}); pip install pyroute2"
    ns = f"{prefix}{secrets.token_hex(3)}-probe"
    try:
        try:
            netns.create(ns)
        except OSError as e:
            return False, f"cannot create a network namespace: {e.strerror or e}"
        try:
            with nft.NftSocket(ns) as s:
                s.apply([nft.table_msg("probe")])
        except OSError as e:
            return False, f"nf_tables is not available: {e.strerror or e}"
    finally:
        with contextlib.suppress(OSError):
            netns.delete(ns)
    return True, ""
