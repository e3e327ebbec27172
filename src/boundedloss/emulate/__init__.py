"""The real-kernel testbed: network namespaces, a routing switch, a tbf bottleneck toward
the server, iptables random loss on the way to a receiver, and microbursts (loss steps or real
cross-traffic). Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN), iproute2 and iptables.

    from boundedloss.emulate import Bottleneck, Testbed

    with Testbed(workers=8, bottleneck=Bottleneck("100mbit", "32kb", "64kb")) as tb:
        tb.set_loss(0.01)                           # 1 % of UDP into the server
        tb.run("w0", ["python", "train.py"]).wait()
        print(tb.qdisc_stats().dropped)

See docs/emulator.md.
"""

from .bursts import BurstRunner, LossSchedule, TimedBursts
from .testbed import (
    LOSS_CHAIN,
    NEED_ROOT,
    Bottleneck,
    LossRuleWriter,
    LossStats,
    QdiscStats,
    Testbed,
    TestbedConfig,
    TestbedError,
    TestbedStatus,
    TrafficProcess,
    available,
    have_privileges,
    leftovers,
    list_namespaces,
    parse_tc_stats,
    sweep,
)
from .units import parse_rate, parse_size

__all__ = [
    "LOSS_CHAIN",
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
    "parse_rate",
    "parse_size",
    "parse_tc_stats",
    "sweep",
]
