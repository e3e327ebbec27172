"""``python -I -S _enter.py NSFILE CMD [ARG...]``: exec CMD inside the network namespace
bind-mounted at NSFILE (as ``ip netns exec`` does, without iproute2 - and without its
remount of ``/sys``, which CMD then sees as the host's). Standard library only, run
without site or environment, so it starts in a few milliseconds."""

import ctypes
import os
import sys

CLONE_NEWNET = 0x40000000


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: _enter.py NSFILE CMD [ARG...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(argv[1], os.O_RDONLY)
    except OSError as e:
        print(f"cannot enter {argv[1]}: {e.strerror}", file=sys.stderr)
        return 126
    if libc.setns(fd, CLONE_NEWNET) != 0:
        print(f"cannot enter {argv[1]}: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 126
    os.close(fd)
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as e:
        print(f"{argv[2]}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
