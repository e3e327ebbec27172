"""The kernel testbed without root: a command re-run as root of a user namespace of its own.

Where the kernel allows unprivileged user namespaces, a command that needs the testbed
(``bench kernel-loss``, ``compare --network kernel``) replaces itself with::

    unshare --user --map-root-user --mount --net --pid --fork --kill-child --mount-proc \\
        sh -c 'mount a tmpfs on /run/netns; exec "$@"' sh  python -m boundedloss.cli ...

Inside, the command holds CAP_NET_ADMIN over every network namespace it creates (they
all belong to that user namespace), naming a namespace works on the private tmpfs, the
command brings up its own namespace's loopback first (:func:`loopback_up`), and nothing
touches the host's namespaces, interfaces or firewall. Teardown cannot leak:
the command is the new PID namespace's first process, so when it ends - or when the
``unshare`` that stands in for the original process is killed, even with SIGKILL
(``--kill-child``) - the kernel kills every process inside, and the namespaces go with
the last of them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

from .host import have_privileges

#: set inside the user namespace: a command there must not re-run itself again
INSIDE = "BOUNDEDLOSS_USERNS"

_SETUP = ("if [ -d /run/netns ]; then mount -t tmpfs tmpfs /run/netns; "
          "else mount -t tmpfs tmpfs /run && mkdir -p /run/netns; fi || exit 125; "
          'exec "$@"')


def _unshare_argv(argv: list[str]) -> list[str]:
    return ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork",
            "--kill-child", "--mount-proc", "sh", "-c", _SETUP, "sh", *argv]


def possible() -> tuple[bool, str]:
    """Can this process run the testbed in a user namespace of its own? ``(True, "")``
    or ``(False, one line why not)``."""
    if os.environ.get(INSIDE):
        return False, "already inside a user namespace of boundedloss's"
    if shutil.which("unshare") is None:
        return False, "unshare is not installed (util-linux)"
    try:
        p = subprocess.run(_unshare_argv(["true"]), capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"unshare failed: {e}"
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return False, f"this kernel does not let an unprivileged user make namespaces ({why})"
    return True, ""


def inside() -> bool:
    """This process runs as root of a user namespace of boundedloss's."""
    return bool(os.environ.get(INSIDE))


def loopback_up() -> None:
    """Bring up ``lo`` of this network namespace. A user namespace's new network
    namespace starts with it down; a command that falls back to in-process loss in
    there (no nf_tables for the testbed) needs it for its ranks' rendezvous."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname="lo")
        if found:
            ipr.link("set", index=found[0], state="up")


def needed() -> bool:
    """Without privileges, and not yet inside: the testbed needs the user namespace."""
    return not have_privileges() and not os.environ.get(INSIDE)


def reexec() -> None:
    """Replace this process (a ``boundedloss`` command) by the same command inside a user
    namespace of its own (never returns); RuntimeError with the reason where that
    cannot be done."""
    ok, why = possible()
    if not ok:
        raise RuntimeError(unavailable(why))
    argv = [sys.executable, "-m", "boundedloss.cli", *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe("unshare", _unshare_argv(argv), {**os.environ, INSIDE: "1"})


# ------------------------------------------------- a testbed kept between commands
#: set inside the user namespace by ``testbed up``: after building, hold the namespace
HOLD = "BOUNDEDLOSS_USERNS_HOLD"
#: the state file's key for the process that holds a rootless testbed's namespaces
HOLDER_KEY = "userns_holder"
#: the line the holder writes once the testbed is built (``unshare`` itself keeps the
#: output pipe open, so its end cannot be the signal)
READY = "boundedloss: the testbed is up; holding its user namespace"


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot; field 22 of /proc/PID/stat),
    which tells a live holder from a later process that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def unavailable(why: str) -> str:
    """The one line that says the testbed cannot run here, and why."""
    return f"the kernel testbed needs root or unprivileged user namespaces: {why}"


def start_holder(argv: list[str], state_file: str,
                 env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``argv`` (``boundedloss testbed up ...``) as root of a new user namespace and
    keep that namespace after it: the command builds the testbed, closes its output
    and holds (it is the namespace's first process: killing it ends the testbed and
    everything in it). Returns ``(exit status, its output)``; on success the state
    file records the holder for later commands (:func:`enter_argv`)."""
    ok, why = possible()
    if not ok:
        raise RuntimeError(unavailable(why))
    env = {**os.environ, **(env or {}), INSIDE: "1", HOLD: "1"}
    p = subprocess.Popen(_unshare_argv(argv), env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)  # not ended by this terminal's Ctrl-C
    assert p.stdout is not None
    out = []
    for line in p.stdout:  # until the command says it holds the testbed, or ends
        if line.rstrip("\n") == READY:
            break
        out.append(line)
    else:
        p.stdout.close()
        return p.wait(), "".join(out)
    p.stdout.close()
    try:
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            holder = int(f.read().split()[0])  # unshare's child: the namespace's first
    except (OSError, ValueError, IndexError):
        p.kill()
        return 1, "".join(out) + "could not find the process holding the user namespace\n"
    with open(state_file) as f:
        state = json.load(f)
    state[HOLDER_KEY] = {"pid": holder, "start": _start_time(holder), "unshare": p.pid}
    tmp = f"{state_file}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, state_file)
    return 0, "".join(out)


def hold() -> None:
    """Inside, after ``testbed up`` built the testbed: close the output the starting
    command waits on and keep the namespace until killed (never returns)."""
    print(READY)
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        signal.pause()


def holder_alive(state: dict) -> bool:
    h = state.get(HOLDER_KEY) or {}
    pid = h.get("pid")
    return isinstance(pid, int) and _start_time(pid) is not None and \
        _start_time(pid) == h.get("start")


def enter_argv(state: dict, argv: list[str]) -> list[str]:
    """``argv`` run as root inside a rootless testbed's namespaces (its holder's user,
    mount, network and PID namespaces)."""
    pid = str(state[HOLDER_KEY]["pid"])
    # (--preserve-credentials: our uid is the one the namespace maps to root, and
    # setgroups, which nsenter would call otherwise, is denied in it)
    return ["nsenter", "-t", pid, "--user", "--mount", "--net", "--pid",
            "--preserve-credentials", "--", *argv]


def end_holder(state: dict) -> bool:
    """Kill a rootless testbed's holder (and with it every process and namespace of
    it); True if it was alive."""
    if not holder_alive(state):
        return False
    os.kill(state[HOLDER_KEY]["pid"], signal.SIGKILL)
    return True
