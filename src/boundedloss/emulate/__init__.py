"""The real-kernel testbed: network namespaces, a routing switch, a tbf bottleneck toward
the server, nf_tables random loss on the way to a receiver, and microbursts (loss steps
or real cross-traffic). Built over netlink (pyroute2) and libc: it needs the Linux
kernel and root (CAP_NET_ADMIN + CAP_SYS_ADMIN), or a user namespace of its own - no
``ip``, ``tc``, ``iptables`` or ``nft`` binary.

    from boundedloss.emulate import Bottleneck, Testbed

    with Testbed(workers=8, bottleneck=Bottleneck("100mbit", "32kb", "64kb")) as tb:
        tb.set_loss(0.01)                           # 1 % of UDP into the server
        tb.run("w0", ["python", "train.py"]).wait()
        print(tb.qdisc_stats().dropped)

See docs/emulator.md.
"""

from .bursts import BurstRunner, LossSchedule, TimedBursts
from .loss_rules import LossRuleWriter, LossStats, loss_chain
from .qdisc import Bottleneck, QdiscStats
from .testbed import (
    NEED_ROOT,
    Testbed,
    TestbedConfig,
    TestbedError,
    TestbedStatus,
    TrafficProcess,
    available,
    have_privileges,
    leftovers,
    list_namespaces,
    sweep,
)
from .units import parse_rate, parse_size

__all__ = [
    "NEED_ROOT",
    "Bottleneck",
    "BurstRunner",
    "LossRuleWriter",
    "LossSchedule",
    "TimedBursts",
    "LossStats",
    "QdiscStats",
    "Testbed",
    "TestbedConfig",
    "TestbedError",
    "TestbedStatus",
    "TrafficProcess",
    "available",
    "have_privileges",
    "leftovers",
    "list_namespaces",
    "loss_chain",
    "parse_rate",
    "parse_size",
    "sweep",
]
