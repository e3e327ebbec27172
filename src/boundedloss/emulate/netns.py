"""Named network namespaces from Python: create, enter, list and delete them, and run a
function or a command inside one - the kernel's system calls (``unshare``, ``setns``,
``mount``) through libc, so no ``ip`` binary is needed.

A namespace is named as ``ip netns`` names it: a file in :data:`RUN_DIR` on which the
namespace is bind-mounted, so ``ip netns list`` (where installed) shows ours and
``ip netns exec`` can enter them.

Entering is per thread: ``setns(CLONE_NEWNET)`` moves only the calling thread, so
:func:`call_in` runs a function in a short-lived thread that enters the namespace
first. A socket keeps the namespace it was created in, so a netlink or ethtool socket
made there serves the namespace from any thread afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

RUN_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
_MS_REC = 0x4000
_MS_BIND = 0x1000
_MS_SHARED = 1 << 20
_MNT_DETACH = 2
#: runs ``argv[2:]`` in the namespace file ``argv[1]`` names (``python -I -S``: no site,
#: no environment; only the standard library, so it works wherever Python does)
_ENTER = Path(__file__).with_name("_enter.py")

T = TypeVar("T")
_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def path(name: str) -> str:
    return os.path.join(RUN_DIR, name)


def names() -> list[str]:
    """The named network namespaces (what ``ip netns list`` shows)."""
    try:
        return sorted(os.listdir(RUN_DIR))
    except FileNotFoundError:
        return []


def _share_run_dir() -> None:
    """Make :data:`RUN_DIR` a shared mount (as ``ip netns add`` does), so a namespace
    mounted there shows in every mount namespace that sees the directory."""
    os.makedirs(RUN_DIR, mode=0o755, exist_ok=True)
    libc, d = _c(), RUN_DIR.encode()
    if libc.mount(b"none", d, None, _MS_SHARED | _MS_REC, None) == 0:
        return
    # not a mount point yet: bind it onto itself, then share it
    _check(libc.mount(d, d, b"none", _MS_BIND | _MS_REC, None), f"bind-mounting {RUN_DIR}")
    _check(libc.mount(b"none", d, None, _MS_SHARED | _MS_REC, None), f"sharing {RUN_DIR}")


def create(name: str) -> None:
    """A new, empty network namespace named ``name`` (OSError if it exists or cannot
    be made: no privileges, or the kernel's namespaces are off)."""
    _share_run_dir()
    target = path(name)
    os.close(os.open(target, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))

    def make() -> None:
        libc = _c()
        _check(libc.unshare(CLONE_NEWNET), f"unshare for namespace {name}")
        _check(libc.mount(b"/proc/thread-self/ns/net", target.encode(), b"none", _MS_BIND,
                          None), f"bind-mounting namespace {name}")

    try:
        _in_thread(make)  # the thread, alone in the new namespace, ends with the call
    except BaseException:
        with contextlib.suppress(OSError):
            delete(name)
        raise


def delete(name: str) -> None:
    """Unmount and remove ``name``: the namespace itself goes with the last process or
    socket still in it (see :func:`pids_in`)."""
    target = path(name)
    _c().umount2(target.encode(), _MNT_DETACH)
    try:
        os.unlink(target)
    except FileNotFoundError:
        pass


def enter(name: str) -> None:
    """Move the calling thread into ``name`` (for :func:`call_in`'s thread, and for a
    process about to exec a command inside)."""
    fd = os.open(path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_c().setns(fd, CLONE_NEWNET), f"entering namespace {name}")
    finally:
        os.close(fd)


def _in_thread(fn: Callable[[], T]) -> T:
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name="bl-netns", daemon=True)
    t.start()
    try:
        t.join()
    finally:
        # an interrupt (SIGINT, the testbed's SIGTERM handler) raises out of join: let
        # the call, a few milliseconds, finish first, so what follows sees its effect
        while t.is_alive():
            with contextlib.suppress(BaseException):
                t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")  # type: ignore[return-value]


def call_in(name: str, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` run inside namespace ``name`` (in a thread of its own that enters
    it; the caller's threads stay where they are)."""

    def run() -> T:
        enter(name)
        return fn(*args)

    return _in_thread(run)


def write_sysctls(name: str, values: dict[str, str], *, strict: bool = True) -> None:
    """Write ``/proc/sys/<key>`` files inside ``name`` (a namespace's net sysctls are
    its own; ``strict=False`` skips those the kernel refuses)."""

    def write() -> None:
        for key, value in values.items():
            try:
                with open(f"/proc/sys/{key}", "w") as f:
                    f.write(value)
            except OSError:
                if strict:
                    raise

    call_in(name, write)


def _inode(p: str) -> tuple[int, int] | None:
    try:
        st = os.stat(p)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in(name: str) -> list[int]:
    """The processes whose network namespace is ``name`` (this one excepted)."""
    ns = _inode(path(name))
    if ns is None:
        return []
    me = os.getpid()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) != me and _inode(f"/proc/{pid}/ns/net") == ns:
            out.append(int(pid))
    return out


def enter_argv(name: str, argv: list[str] | tuple[str, ...]) -> list[str]:
    """The command line that runs ``argv`` inside namespace ``name``."""
    if isinstance(argv, str):
        raise TypeError("argv must be a list of strings, not one string")
    return [sys.executable, "-I", "-S", str(_ENTER), path(name), *map(str, argv)]


__all__ = ["RUN_DIR", "call_in", "create", "delete", "enter", "enter_argv", "names",
           "path", "pids_in", "write_sysctls"]
