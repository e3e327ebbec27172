"""`boundedloss doctor`: what a user runs first when something looks off.

One finding each for what ``boundedloss demo`` rests on:

- the compiled data path (:mod:`boundedloss.native`: built and in use, or why not);
- authentication (OpenSSL's AES-256-GMAC, checked against a known answer; which
  libcrypto backs it);
- the kernel network (the testbed as root, or as root of a user namespace of its own -
  probed for real - or why not, with the one command that fixes it);
- a GPU (none is fine: boundedloss trains on the CPU).

A finding is ``ok``, ``warn`` (the demo runs, but not as it should: the Python data
path), ``fail`` (the demo cannot do its job: no authentication, or no kernel network -
it would fall back to in-process loss, where gloo's TCP runs lossless and cannot be
compared with) or ``info``. The command exits 1 when any finding fails.

Where no kernel network can be had, :func:`kernel_network_cause` names the cause and
the one command that fixes it (:data:`CAUSES`), from the reason the testbed gave and
the kernel's settings under ``/proc``; :func:`no_kernel_network` makes that the one
line a comparison that falls back to in-process loss starts with.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.markup import escape

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"


@dataclass(frozen=True)
class Finding:
    """One line of the doctor's: what was checked, how it stands, what it found, and
    (where something is wrong and one command fixes it) that command."""

    item: str
    state: str  # OK, WARN, FAIL or INFO
    text: str
    fix: str = ""

    @property
    def broken(self) -> bool:
        """Something the demo needs is missing."""
        return self.state == FAIL


@dataclass(frozen=True)
class Cause:
    """Why no kernel network can be had here, and the one command that fixes it
    (``cause`` empty where the testbed's own reason says it already)."""

    cause: str
    fix: str


def _sudo_demo() -> str:
    """``sudo boundedloss demo`` as it works here: sudo's own PATH (secure_path) does not
    hold a virtual environment's ``bin``, so outside the system's folders it names the
    command by its full path."""
    found = shutil.which("boundedloss")
    if found is None or os.path.dirname(found) in _SUDO_PATH:
        return "sudo boundedloss demo"
    return f"sudo {shlex.quote(found)} demo"


_SUDO_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
SUDO_DEMO = _sudo_demo()

#: the causes :func:`kernel_network_cause` tells apart, each with its fix
CAUSES: dict[str, Cause] = {
    "nf_tables": Cause("the kernel has no nf_tables (the testbed's drop rules)",
                       "sudo modprobe nf_tables"),
    "max_user_namespaces": Cause(
        "no root, and user namespaces are switched off (user.max_user_namespaces = 0)",
        "sudo sysctl -w user.max_user_namespaces=15000"),
    "userns_clone": Cause(
        "no root, and unprivileged user namespaces are forbidden "
        "(kernel.unprivileged_userns_clone = 0)",
        f"{SUDO_DEMO}, or sudo sysctl -w kernel.unprivileged_userns_clone=1"),
    "seccomp": Cause(
        "the container's seccomp profile denies unshare and setns",
        "run the container with --privileged (or --cap-add NET_ADMIN --cap-add SYS_ADMIN)"),
    "apparmor": Cause(
        "no root, and AppArmor restricts unprivileged user namespaces "
        "(kernel.apparmor_restrict_unprivileged_userns = 1)",
        "sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 (or run with sudo)"),
    "no_root": Cause("no root, and no user namespace of its own could be made",
                     SUDO_DEMO),
    # what the testbed's Python or the user namespace needs (the reason says which)
    "pyroute2": Cause("", "pip install pyroute2"),
    "unshare": Cause("", "sudo apt-get install -y util-linux"),
}

_NF_TABLES = re.compile(r"nf_tables|nftables|nfnetlink|initialize nft", re.IGNORECASE)
_NO_PYROUTE2 = re.compile(r"pyroute2 is not installed|No module named '?pyroute2")
_NO_UNSHARE = re.compile(r"unshare is not installed")
_DENIED = re.compile(r"not permitted|permission denied|\bEPERM\b|\[Errno 1\]", re.IGNORECASE)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _seccomp_filtered(status: str | None) -> bool:
    """Whether /proc/self/status says a seccomp filter is on this process (``Seccomp:
    2``, as a container's default profile is)."""
    for line in (status or "").splitlines():
        if line.startswith("Seccomp:"):
            return line.split()[1:2] == ["2"]
    return False


def kernel_network_cause(reason: str, *, privileged: bool,
                         root: Path | str = "/") -> Cause | None:
    """Why no kernel network can be had here, from ``reason`` (what the testbed or the
    attempt at a user namespace said) and the kernel's settings under ``root``/proc;
    ``privileged``: whether this process holds root's capabilities (or is root of a
    user namespace of boundedloss's). None where nothing known explains it."""
    proc = Path(root) / "proc"
    if _NO_PYROUTE2.search(reason):  # (before nf_tables: its modules' names say nfnetlink)
        return CAUSES["pyroute2"]
    if _NF_TABLES.search(reason):
        return CAUSES["nf_tables"]
    denied = bool(_DENIED.search(reason))
    seccomp = denied and _seccomp_filtered(_read(proc / "self" / "status"))
    if privileged:
        return CAUSES["seccomp"] if seccomp else None
    if _read(proc / "sys" / "user" / "max_user_namespaces") == "0":
        return CAUSES["max_user_namespaces"]
    if _read(proc / "sys" / "kernel" / "unprivileged_userns_clone") == "0":
        return CAUSES["userns_clone"]
    if _NO_UNSHARE.search(reason):  # (no use installing it where the kernel says no)
        return CAUSES["unshare"]
    # (a container's seccomp denies unshare before the host's AppArmor gets a say)
    if seccomp:
        return CAUSES["seccomp"]
    if _read(proc / "sys" / "kernel" / "apparmor_restrict_unprivileged_userns") == "1":
        return CAUSES["apparmor"]
    return CAUSES["no_root"]


def _privileged() -> bool:
    """Root's capabilities, or root of a user namespace of boundedloss's: whatever needs
    no user namespace made for it."""
    from .emulate import rootless

    return not rootless.needed()


def no_kernel_network(reason: str, *, privileged: bool | None = None) -> str:
    """The one line a comparison that falls back to in-process loss starts with: that
    no kernel network can be had, why, and (where the cause is known) the command that
    fixes it."""
    cause = kernel_network_cause(reason, privileged=_privileged() if privileged is None
                                 else privileged)
    return f"no kernel network here: {_with_cause(reason, cause)}" + (
        f"; fix: {cause.fix}" if cause else "")


def _with_cause(reason: str, cause: Cause | None) -> str:
    return f"{reason} - {cause.cause}" if cause and cause.cause else reason


# ----------------------------------------------------------------------- the checks
def check_data_path() -> Finding:
    from . import native

    item = "data path"
    if native.enabled():
        if native.authenticates():
            return Finding(item, OK, "native: the compiled extension, sealing datagrams "
                                     "with OpenSSL in C")
        return Finding(item, WARN, f"native, but {native.AUTH_FALLBACK}",
                       "sudo apt-get install -y libssl-dev, then reinstall boundedloss "
                       "(e.g. pip install --no-deps --force-reinstall -e .)")
    status = native.status()
    if "BOUNDEDLOSS_NATIVE" in status:
        return Finding(item, WARN, f"{status}: the compiled path is switched off",
                       "unset BOUNDEDLOSS_NATIVE")
    return Finding(item, WARN, f"{status}: every datagram takes the slower Python path",
                   "sudo apt-get install -y build-essential python3-dev libssl-dev, then "
                   "reinstall boundedloss (e.g. pip install --no-deps --force-reinstall -e .)")


#: AES-256-GCM with a zero key and nonce over nothing (the GCM specification's test
#: case 13), its tag cut to our 96 bits
GMAC_KNOWN_ANSWER = bytes.fromhex("530f8afbc74536b9a963b4f1")


def check_authentication() -> Finding:
    from . import native
    from .protocol.auth import AuthenticationError, Gmac, backend

    item = "authentication"
    fix = "sudo apt-get install -y libssl3 (the libcrypto Python's hashlib uses)"
    try:
        tag = Gmac(bytes(32)).tag(bytes(12), b"")
        lib = backend()
    except (AuthenticationError, OSError, AttributeError) as e:
        return Finding(item, FAIL, f"no AES-256-GMAC: {e}", fix)
    if tag != GMAC_KNOWN_ANSWER:
        return Finding(item, FAIL, f"{lib} computes a wrong AES-256-GMAC tag", fix)
    where = ("in C and in Python" if native.authenticates() else
             "in Python only (the compiled path was built without OpenSSL's headers)")
    return Finding(item, OK, f"AES-256-GMAC by {lib}, checked against a known answer; "
                             f"datagrams sealed {where}")


def check_kernel_network() -> Finding:
    from .emulate import available, rootless

    item = "kernel network"
    if rootless.needed():
        ok, why = rootless.possible()
        if not ok:
            reason = rootless.unavailable(why)
            cause = kernel_network_cause(reason, privileged=False)
            return _no_kernel_network(item, reason, cause)
        # (`boundedloss doctor` enters the namespace before it checks: not here)
        return Finding(item, WARN, "rootless possible (a user namespace of its own can be "
                                   "made), but the testbed inside it was not probed")
    mode = ("rootless (root of a user namespace of its own)"
            if os.environ.get(rootless.INSIDE) else "root")
    ok, why = available()
    if ok:
        return Finding(item, OK, f"{mode}: the testbed runs here (probed: a network "
                                 "namespace and its loss rules); every system of the demo "
                                 "crosses it")
    return _no_kernel_network(item, f"{mode}, but {why}",
                              kernel_network_cause(why, privileged=True))


def _no_kernel_network(item: str, reason: str, cause: Cause | None) -> Finding:
    return Finding(item, FAIL, f"{_with_cause(reason, cause)}; the demo falls back to "
                               "in-process loss, where gloo runs lossless",
                   cause.fix if cause else "")


def check_gpu() -> Finding:
    import torch

    item = "GPU"
    if not torch.cuda.is_available():
        return Finding(item, INFO, "none (not needed: boundedloss trains on the CPU)")
    n = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    return Finding(item, INFO, f"{n} x {', '.join(names)} (CUDA {torch.version.cuda})")


#: the doctor's checks, in the order it prints them
CHECKS: tuple[Callable[[], Finding], ...] = (
    check_data_path, check_authentication, check_kernel_network, check_gpu)


def own_user_namespace() -> None:
    """Without root, re-run this command (``boundedloss doctor``) as root of a user
    namespace of its own, as the demo does, so that the kernel network is probed where
    the demo would build it; returns where there is no need, or no way (the kernel
    network's finding then says why)."""
    from .emulate import rootless

    if rootless.needed() and rootless.possible()[0]:
        rootless.reexec()


def run_checks() -> list[Finding]:
    return [check() for check in CHECKS]


_STYLE = {OK: ("green", "ok"), WARN: ("yellow", "warn"), FAIL: ("bold red", "FAIL"),
          INFO: ("dim", "-")}


def markup(finding: Finding) -> str:
    """``finding`` as one line of rich markup."""
    style, mark = _STYLE[finding.state]
    fix = f" - [bold]fix:[/] {escape(finding.fix)}" if finding.fix else ""
    return (f"[{style}]{mark:<4}[/] [bold]{finding.item:<14}[/] {escape(finding.text)}"
            f"{fix}")
