"""The kernel testbed without root: a command re-run as root of a user namespace of its own.

Where the kernel allows unprivileged user namespaces, a command that needs the testbed
(``bench kernel-loss``, ``compare --network kernel``) replaces itself with::

    unshare --user --map-root-user --mount --net --pid --fork --kill-child --mount-proc \\
        sh -c 'mount a tmpfs on /run/netns; exec "$@"' sh  python -m boundedloss.cli ...

Inside, the command holds CAP_NET_ADMIN over every network namespace it creates (they
all belong to that user namespace), ``ip netns add`` works on the private tmpfs, and
nothing touches the host's namespaces, interfaces or firewall. Teardown cannot leak:
the command is the new PID namespace's first process, so when it ends - or when the
``unshare`` that stands in for the original process is killed, even with SIGKILL
(``--kill-child``) - the kernel kills every process inside, and the namespaces go with
the last of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from .testbed import have_privileges

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


def needed() -> bool:
    """Without privileges, and not yet inside: the testbed needs the user namespace."""
    return not have_privileges() and not os.environ.get(INSIDE)


def reexec() -> None:
    """Replace this process (a ``boundedloss`` command) by the same command inside a user
    namespace of its own (never returns); RuntimeError with the reason where that
    cannot be done."""
    ok, why = possible()
    if not ok:
        raise RuntimeError(f"the kernel testbed needs root or unprivileged user namespaces: "
                           f"{why}")
    argv = [sys.executable, "-m", "boundedloss.cli", *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe("unshare", _unshare_argv(argv), {**os.environ, INSIDE: "1"})
