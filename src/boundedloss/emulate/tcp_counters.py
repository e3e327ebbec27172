"""Linux's TCP counters in a testbed namespace: how TCP recovered what it lost.

Every network namespace keeps its own ``Tcp`` (``/proc/net/snmp``) and ``TcpExt``
(``/proc/net/netstat``) counters, the ones ``nstat`` prints. Read before and after a run
in each node's namespace, they say how the run's TCP flows recovered their losses: by
retransmission timeout (``TCPTimeouts``, each one at least Linux's 200 ms minimum RTO -
what incast collapse is made of), by a tail loss probe (``TCPLossProbes``: a copy of the
last segment sent about two round trips after it, which turns a lost tail into a fast
recovery instead of a timeout), or by fast retransmit - and how many of the
retransmissions were not needed (``TCPDSACKRecvSegs``: segments the receiver said it got
twice). They count every TCP flow in the
namespace: a run's own rendezvous traffic too, which is small next to a TCP arm's
gradients.

The files are read through ``/proc/thread-self``: a thread that entered a namespace sees
that namespace's counters there, where ``/proc/self`` shows its process's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .netns import call_in

#: our name -> (the kernel's table, its field)
COUNTERS: dict[str, tuple[str, str]] = {
    "tcp_out_segs": ("Tcp", "OutSegs"),
    "tcp_retrans_segs": ("Tcp", "RetransSegs"),
    "tcp_timeouts": ("TcpExt", "TCPTimeouts"),
    "tcp_loss_probes": ("TcpExt", "TCPLossProbes"),
    "tcp_loss_probe_recoveries": ("TcpExt", "TCPLossProbeRecovery"),
    "tcp_fast_retrans": ("TcpExt", "TCPFastRetrans"),
    # segments a receiver reported getting twice (D-SACK): retransmissions that were not
    # needed - on the testbed, mostly reordering read as loss
    "tcp_dsack_segs": ("TcpExt", "TCPDSACKRecvSegs"),
}
_FILES = ("/proc/thread-self/net/snmp", "/proc/thread-self/net/netstat")


def parse_tables(text: str) -> dict[tuple[str, str], int]:
    """``(table, field) -> value`` from the text of ``/proc/net/snmp`` or ``netstat``:
    each table is a line of field names and a line of values, both led by ``Table:``.
    A line pair that does not match (names without values, a count that differs, a
    value that is not an integer) is skipped: the files are the kernel's, but their
    fields come and go between versions."""
    out: dict[tuple[str, str], int] = {}
    lines = text.splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        table, _, rest = names.partition(":")
        vtable, _, vrest = values.partition(":")
        fields, numbers = rest.split(), vrest.split()
        if table != vtable or len(fields) != len(numbers):
            continue
        for name, number in zip(fields, numbers):
            try:
                out[(table, name)] = int(number)
            except ValueError:
                continue
    return out


def pick(tables: Mapping[tuple[str, str], int]) -> dict[str, int]:
    """Our counters from parsed tables (0 for one this kernel does not have)."""
    return {name: tables.get(where, 0) for name, where in COUNTERS.items()}


def _read_here() -> dict[str, int]:
    tables: dict[tuple[str, str], int] = {}
    for path in _FILES:
        with open(path) as f:
            tables.update(parse_tables(f.read()))
    return pick(tables)


def read(namespaces: Iterable[str]) -> dict[str, int]:
    """The counters summed over ``namespaces``."""
    total = dict.fromkeys(COUNTERS, 0)
    for name in namespaces:
        for key, value in call_in(name, _read_here).items():
            total[key] += value
    return total


def difference(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """What each counter counted between two readings."""
    return {key: after[key] - before[key] for key in COUNTERS}
