"""The real-kernel testbed: network namespaces joined by a switch namespace that routes
between them, a tbf bottleneck in front of the server, and iptables random loss at the
switch port toward each receiver.

Topology (everything lives in namespaces the testbed creates; the root namespace's
interfaces, routes and firewall are never touched)::

    ns <p><id>-w0      ns <p><id>-sw (switch: IPv4 forwarding)          ns <p><id>-server
    eth0 10.201.0.2 --- to-w0 --+
    ns <p><id>-w1               |   FORWARD -o to-X -> BL_LOSS-X
    eth0 10.201.0.3 --- to-w1 --+   (statistic DROP) -> to-server [tbf] --- eth0 10.201.0.1
    ...                         |                      (egress toward        (GRO)
    eth0 10.201.0.N+1 - to-wN-1-+                       the server)

Packets are wire-size wherever they are dropped or queued, as on a NIC and a wire: each
node's interface has its segmentation offloads off (software GSO cuts a TCP or
UDP_SEGMENT super-packet into MTU-sized packets just before it), the switch forwards
packet by packet (its ports have GRO off), and each node's interface has GRO on, so a
receiver's kernel coalesces what survived, as a NIC's driver would.

Names carry ``prefix`` + a 6-hex-digit id, so several testbeds can coexist and
``sweep(prefix)`` can find leftovers of a crashed run without any state file.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .units import format_rate, parse_rate, parse_size

if TYPE_CHECKING:  # pragma: no cover
    from .bursts import LossSchedule

#: iptables chains in the switch's namespace that hold the random-drop rules: one per
#: receiving node (``BL_LOSS-server``, ``BL_LOSS-w0``...), see :func:`loss_chain`.
LOSS_CHAIN = "BL_LOSS"
NODE_IFACE = "eth0"
SERVER = "server"
SWITCH = "sw"
#: tbf meters whole frames: an MTU-sized IP packet is MTU + 14 bytes at the veth.
ETH_HEADER = 14
MAX_WORKERS = 64
#: Each switch port's queue where no bottleneck is set (``pfifo``; the kernel's default
#: receive backlog): without a qdisc a veth whose peer coalesces (GRO, NAPI) drops
#: what overflows its 256-packet ring, uncounted by any qdisc; with one, a full ring
#: holds the packets back in the queue, and only what overflows the queue is dropped.
PORT_QUEUE_PACKETS = 1000
#: that queue, as tc's arguments after ``root``
PORT_QDISC = ("pfifo", "limit", str(PORT_QUEUE_PACKETS))
#: How long any one ip/tc/iptables call may take before it is an error.
CMD_TIMEOUT_S = 20.0

_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,15}$")
_SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
_TRAFFIC = Path(__file__).with_name("traffic.py")

NEED_ROOT = ("the kernel testbed needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); without "
             "root, the boundedloss commands (testbed, demo, compare, bench kernel-loss) "
             "run it in a user namespace of their own where the kernel allows that")
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21  # `ip netns add` bind-mounts the namespace file


class TestbedError(RuntimeError):
    """A one-line, user-facing reason the testbed cannot do what was asked."""

    __test__ = False  # keep pytest from collecting it when a test module imports it

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


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


_HINTS = {
    "ip": "install iproute2",
    "tc": "install iproute2",
    "iptables": "install iptables (apt-get install -y iptables)",
    "iptables-restore": "install iptables (apt-get install -y iptables)",
}


def find_tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(_SBIN))


def _tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        raise TestbedError(f"{name} not found: {_HINTS.get(name, 'install it')}")
    return path


def _run(argv: list[str], *, input: str | None = None, timeout: float = CMD_TIMEOUT_S,
         check: bool = True) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{shlex.join(argv)}` timed out after {timeout:g} s") from None
    except FileNotFoundError:
        raise TestbedError(f"{argv[0]} not found: {_HINTS.get(Path(argv[0]).name, '')}") from None
    if check and p.returncode != 0:
        lines = [ln for ln in (p.stderr or p.stdout).strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {p.returncode}"
        raise TestbedError(f"`{shlex.join(argv)}` failed: {why}")
    return p


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    p = _run([_tool("ip"), "netns", "list"], check=False)
    return [ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()]


def _leftover_re(prefix: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(prefix)}[0-9a-f]{{6}}-(sw|server|w\d+|probe)$")


def _root_veths(prefix: str) -> list[str]:
    """veth links in the root namespace named like ours (this design creates none; the
    sweep looks anyway, and only ever at veths with our exact name pattern)."""
    p = _run([_tool("ip"), "-o", "link", "show", "type", "veth"], check=False)
    pat = re.compile(rf"^{re.escape(prefix)}[0-9a-f]{{6}}-\S+$")
    out = []
    for ln in p.stdout.splitlines():
        parts = ln.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if pat.match(name):
                out.append(name)
    return out


def leftovers(prefix: str = "bl-") -> list[str]:
    """Namespaces (and root-namespace veths) whose names match ``prefix`` + id: what
    ``sweep`` would remove."""
    _check_prefix(prefix)
    pat = _leftover_re(prefix)
    names = [ns for ns in list_namespaces() if pat.match(ns)]
    return names + [f"link:{name}" for name in _root_veths(prefix)]


def _pids_in(ns: str) -> list[int]:
    p = _run([_tool("ip"), "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit() and int(x) != os.getpid()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is as good as gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _end_pids(pids: list[int], grace_s: float = 1.0) -> None:
    """SIGTERM these pids (processes running inside one of our namespaces), then SIGKILL
    whatever is still alive after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in pids if _alive(p)]
        if not live:
            return
        for p in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in live):
            time.sleep(0.02)


def _delete_namespace(ns: str) -> None:
    _end_pids(_pids_in(ns))
    _run([_tool("ip"), "netns", "del", ns], check=False)


def sweep(prefix: str = "bl-") -> list[str]:
    """Remove every testbed leftover named ``prefix`` + id, with or without a state file:
    processes still inside those namespaces are ended, the namespaces deleted (which
    deletes their veths, routes, qdiscs and iptables rules with them). Returns what was
    removed."""
    require_privileges()
    found = leftovers(prefix)
    for name in found:
        if name.startswith("link:"):
            _run([_tool("ip"), "link", "del", name[5:]], check=False)
        else:
            _delete_namespace(name)
    still = leftovers(prefix)
    if still:
        raise TestbedError(f"could not remove {', '.join(still)}")
    return found


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix or ""):
        raise ValueError(f"bad prefix {prefix!r}: 1-16 characters, a letter first, then "
                         "letters, digits, '_', '.', '-' (it names everything we create)")


def available(prefix: str = "bl-") -> tuple[bool, str]:
    """Can a testbed with random loss run here? ``(True, "")`` or ``(False, reason)``.
    Creates and deletes one probe namespace to be sure ``ip netns`` really works."""
    if not have_privileges():
        return False, NEED_ROOT
    for name in ("ip", "tc", "iptables", "iptables-restore"):
        if find_tool(name) is None:
            return False, f"{name} not found: {_HINTS[name]}"
    ns = f"{prefix}{secrets.token_hex(3)}-probe"
    try:
        _run([_tool("ip"), "netns", "add", ns])
        _run([_tool("ip"), "netns", "exec", ns, _tool("iptables"), "-w", "-S"])
    except TestbedError as e:
        return False, str(e)
    finally:
        _run([_tool("ip"), "netns", "del", ns], check=False)
    return True, ""


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Bottleneck:
    """A token-bucket bottleneck (``tc qdisc ... tbf``) on the switch port toward the
    server: ``rate`` is the drain rate, ``burst`` the bucket (how many bytes may leave
    back to back at line rate), ``limit`` the queue (bytes that may wait for tokens;
    beyond it, arriving frames are dropped - the shallow-buffer incast drop). tc units:
    ``kbit/mbit/gbit`` rates, ``b/kb/mb`` sizes (``kb`` = 1024 bytes)."""

    rate: str = "100mbit"
    burst: str = "32kb"
    limit: str = "64kb"

    def __post_init__(self):
        # Fail at construction, not inside tc.
        parse_rate(self.rate)
        parse_size(self.burst)
        parse_size(self.limit)

    @property
    def rate_bps(self) -> int:
        return parse_rate(self.rate)

    @property
    def burst_bytes(self) -> int:
        return parse_size(self.burst)

    @property
    def limit_bytes(self) -> int:
        return parse_size(self.limit)

    def check_mtu(self, mtu: int) -> None:
        frame = mtu + ETH_HEADER
        if self.burst_bytes < frame:
            raise ValueError(
                f"tbf burst {self.burst} ({self.burst_bytes} B) is below one frame "
                f"({frame} B at mtu {mtu}): tbf would drop every full-size packet; "
                f"use burst >= {frame}b")
        if self.limit_bytes < frame:
            raise ValueError(
                f"tbf limit {self.limit} ({self.limit_bytes} B) is below one frame "
                f"({frame} B at mtu {mtu}); use limit >= {frame}b")

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", f"{self.burst_bytes}b",
                "limit", f"{self.limit_bytes}b"]

    def describe(self) -> str:
        return (f"tbf rate {format_rate(self.rate_bps)} burst {self.burst_bytes} B "
                f"limit {self.limit_bytes} B")


@dataclass(frozen=True)
class TestbedConfig:
    """What to build. ``loss`` is the random-drop probability applied to UDP arriving at
    the server (``set_loss`` changes it, or sets it on another node, at run time)."""

    __test__ = False

    workers: int = 4
    subnet: str = "10.201.0.0/24"
    mtu: int = 1500
    prefix: str = "bl-"
    bottleneck: Bottleneck | None = None
    loss: float = 0.0

    def __post_init__(self):
        if not isinstance(self.workers, int) or not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be 1..{MAX_WORKERS}, got {self.workers!r}")
        try:
            net = ipaddress.ip_network(self.subnet, strict=False)
        except ValueError as e:
            raise ValueError(f"bad subnet {self.subnet!r}: {e}") from None
        if (net.version != 4 or not net.is_private or net.is_loopback or net.is_link_local
                or net.is_unspecified or net.is_multicast):
            raise ValueError(f"subnet {self.subnet} must be a private IPv4 range "
                             "(e.g. 10.201.0.0/24), not loopback or link-local; it is used "
                             "only inside our namespaces")
        if net.num_addresses - 2 < self.workers + 1:
            raise ValueError(f"subnet {self.subnet} has too few addresses for "
                             f"{self.workers} workers + 1 server")
        if not isinstance(self.mtu, int) or not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be 576..65535, got {self.mtu!r}")
        _check_prefix(self.prefix)
        if self.bottleneck is not None:
            if not isinstance(self.bottleneck, Bottleneck):
                raise ValueError("bottleneck must be a Bottleneck or None")
            self.bottleneck.check_mtu(self.mtu)
        check_probability(self.loss)

    def to_dict(self) -> dict:
        d = asdict(self)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TestbedConfig:
        d = dict(d)
        if d.get("bottleneck") is not None:
            d["bottleneck"] = Bottleneck(**d["bottleneck"])
        return cls(**d)


def check_probability(p: float) -> float:
    """``p`` as a float, or ValueError when it is not a probability in [0, 1]."""
    try:
        p = float(p)
    except (TypeError, ValueError):
        raise ValueError(f"loss probability must be a number, got {p!r}") from None
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"loss probability must be in [0, 1], got {p}")
    return p


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class QdiscStats:
    """Counters of the root qdisc on the switch port toward the server."""

    kind: str
    sent_bytes: int
    sent_packets: int
    dropped: int
    overlimits: int
    requeues: int
    backlog_bytes: int
    backlog_packets: int
    rate_bps: int | None = None  # tbf only
    burst_bytes: int | None = None  # tbf only


_TC_HEAD = re.compile(r"^qdisc\s+(\S+)\s+(\S+)")
_TC_SENT = re.compile(
    r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)")
_TC_BACKLOG = re.compile(r"backlog (\S+?)b? (\d+)p")


def parse_tc_stats(text: str) -> QdiscStats | None:
    """Parse the root qdisc's block of ``tc -s qdisc show dev X`` (text form)."""
    blocks = re.split(r"\n(?=qdisc )", text.strip())
    for block in blocks:
        head = _TC_HEAD.match(block)
        if not head or (" root " not in block.splitlines()[0] and len(blocks) > 1):
            continue
        sent = _TC_SENT.search(block)
        backlog = _TC_BACKLOG.search(block)
        vals = [int(x) for x in sent.groups()] if sent else [0] * 5
        rate = re.search(r"\brate (\S+)", block)
        burst = re.search(r"\bburst (\S+)", block)
        # tc prints "20Mbit", "32Kb", "1514b": its units, capitalised
        backlog_b = backlog.group(1).lower() if backlog else "0"
        return QdiscStats(
            kind=head.group(1), sent_bytes=vals[0], sent_packets=vals[1], dropped=vals[2],
            overlimits=vals[3], requeues=vals[4],
            backlog_bytes=parse_size(backlog_b) if backlog_b != "0" else 0,
            backlog_packets=int(backlog.group(2)) if backlog else 0,
            rate_bps=parse_rate(rate.group(1).lower()) if rate else None,
            burst_bytes=parse_size(burst.group(1).lower()) if burst else None,
        )
    return None


def _qdisc_from_json(items: list[dict]) -> QdiscStats | None:
    for q in items:
        if not q.get("root"):
            continue
        opts = q.get("options") or {}
        return QdiscStats(
            kind=q.get("kind", "?"), sent_bytes=int(q.get("bytes", 0)),
            sent_packets=int(q.get("packets", 0)), dropped=int(q.get("drops", 0)),
            overlimits=int(q.get("overlimits", 0)), requeues=int(q.get("requeues", 0)),
            backlog_bytes=int(q.get("backlog", 0)), backlog_packets=int(q.get("qlen", 0)),
            rate_bps=int(opts["rate"]) * 8 if "rate" in opts else None,  # tc -j: bytes/s
            burst_bytes=int(opts["burst"]) if "burst" in opts else None,
        )
    return None


@dataclass(frozen=True)
class LossStats:
    """The random-drop rule of one node and its counters (since the rule was set).
    ``seen_packets`` counts every packet the switch forwarded toward the node."""

    probability: float
    protocol: str | None  # "udp", "all", or None when no rule is set
    dropped_packets: int
    dropped_bytes: int
    seen_packets: int


@dataclass(frozen=True)
class TestbedStatus:
    __test__ = False

    name: str
    up: bool
    namespaces: dict[str, bool]
    addresses: dict[str, str]
    bottleneck: Bottleneck | None
    qdisc: QdiscStats | None
    loss: dict[str, LossStats] = field(default_factory=dict)


# ----------------------------------------------------------------------------- testbed


def loss_chain(node: str) -> str:
    """The switch's chain that drops packets on their way to ``node``."""
    return f"{LOSS_CHAIN}-{node}"


def port_name(node: str) -> str:
    """The switch-side veth toward ``node``."""
    return f"to-{node}"


def loss_transaction(p: float, protocol: str, *, node: str, jump: bool) -> str:
    """The iptables-restore transaction (for the switch's namespace) that makes
    ``node``'s chain drop ``p`` of the packets forwarded to it (``protocol`` "udp" or
    "all"); ``jump`` adds FORWARD's jump to it (the chain's first use). ``:CHAIN - [0:0]``
    creates the chain, or flushes it when it exists, so the rule is replaced atomically."""
    if protocol not in ("udp", "all"):
        raise ValueError(f"protocol must be 'udp' or 'all', got {protocol!r}")
    chain = loss_chain(node)
    lines = ["*filter", f":{chain} - [0:0]"]
    if p > 0:
        match = "-p udp " if protocol == "udp" else ""
        stat = f"-m statistic --mode random --probability {p:.10f} " if p < 1 else ""
        lines.append(f"-A {chain} {match}{stat}-j DROP")
    if jump:
        lines.append(f"-I FORWARD 1 -o {port_name(node)} -j {chain}")
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


class LossRuleWriter:
    """One node's loss rule, changed fast: an ``iptables-restore --noflush`` kept open in
    the switch's namespace applies each transaction written to it at its COMMIT, so a
    change costs a write to a pipe instead of starting two processes (tens of
    milliseconds on a loaded machine: longer than the microburst it would start).
    ``set(0)`` leaves the chain empty (nothing dropped) rather than removing it."""

    def __init__(self, testbed: Testbed, node: str, protocol: str, *, jump: bool):
        if protocol not in ("udp", "all"):
            raise ValueError(f"protocol must be 'udp' or 'all', got {protocol!r}")
        self.node = node
        self.protocol = protocol
        self._jump = jump
        self._proc = testbed.run(SWITCH, [_tool("iptables-restore"), "-w", "--noflush"],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)

    def set(self, p: float) -> None:
        """Drop ``p`` of what arrives at the node from now on; TestbedError if the
        writer has failed (its iptables-restore refused a transaction)."""
        p = check_probability(p)
        proc = self._proc
        assert proc.stdin is not None
        try:
            proc.stdin.write(loss_transaction(p, self.protocol, node=self.node,
                                              jump=self._jump))
            proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            self.close()  # raises with iptables-restore's reason
            raise TestbedError(f"the loss rule on {self.node} can no longer be changed") from None
        self._jump = False

    def close(self) -> None:
        """End the writer (the rule stays as last set); TestbedError with
        iptables-restore's reason if it failed."""
        proc = self._proc
        with contextlib.suppress(BrokenPipeError, ValueError, OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=CMD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err = ""
        if proc.stderr is not None:
            err = proc.stderr.read()
            proc.stderr.close()
        if proc.returncode != 0:
            why = (err or "").strip().splitlines() or [f"exit status {proc.returncode}"]
            raise TestbedError(f"iptables-restore on {self.node} failed: {why[-1]}")


class Testbed:
    """N worker namespaces and one server namespace, routed by a switch namespace.

    Use as a context manager (``with Testbed(workers=8) as tb: ...``): ``up()`` on entry,
    ``down()`` on exit whatever happened, and SIGINT/SIGTERM turned into exceptions while
    inside so that they unwind through the teardown (the previous handlers are restored
    afterwards). ``up()``/``down()`` can be called directly too; ``down()`` is idempotent.
    """

    __test__ = False

    def __init__(self, config: TestbedConfig | None = None, *, id: str | None = None,
                 **overrides: Any):
        if config is None:
            config = TestbedConfig(**overrides)
        elif overrides:
            config = replace(config, **overrides)
        self.config = config
        if id is not None and not re.fullmatch(r"[0-9a-f]{6}", id):
            raise ValueError(f"bad testbed id {id!r}: 6 lowercase hex digits")
        self.id = id or secrets.token_hex(3)
        self._active = False
        self._bottleneck = config.bottleneck
        self._procs: list[subprocess.Popen] = []
        self._schedules: list[LossSchedule] = []
        self._lock = threading.RLock()
        self._prev_handlers: dict[int, Any] | None = None
        self._tearing_down = False
        self._pending_signals: list[int] = []
        self._chains: set[str] = set()  # the loss chains this process made

    # -- names ------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return f"{self.config.prefix}{self.id}"

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(f"w{i}" for i in range(self.config.workers))

    @property
    def nodes(self) -> tuple[str, ...]:
        return (SERVER, *self.workers)

    @property
    def switch_namespace(self) -> str:
        return f"{self.name}-{SWITCH}"

    def namespaces(self) -> dict[str, str]:
        """node -> namespace name, the switch (``"sw"``) included."""
        out = {n: f"{self.name}-{n}" for n in self.nodes}
        out[SWITCH] = self.switch_namespace
        return out

    @property
    def addresses(self) -> dict[str, str]:
        """node -> IPv4 address: the server takes the subnet's first host address, worker
        ``wi`` the (i+2)-th."""
        net = ipaddress.ip_network(self.config.subnet, strict=False)
        return {n: str(net.network_address + 1 + i) for i, n in enumerate(self.nodes)}

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.config.subnet, strict=False).prefixlen

    def port_of(self, node: str) -> str:
        """The switch-side veth toward ``node`` (the bottleneck lives on ``to-server``)."""
        return port_name(self.node(node))

    def _mac(self, node: str, *, switch_side: bool = False) -> str:
        """A locally administered unicast MAC (leading 0x02, or 0x06 for the switch's
        port toward the node) made of the testbed id and the node's index: unique per
        interface and per testbed."""
        i = self.nodes.index(node)
        b = bytes.fromhex(self.id)
        return ":".join(f"{octet:02x}" for octet in (0x06 if switch_side else 0x02,
                                                     b[0], b[1], b[2], i >> 8, i & 0xFF))

    def node(self, which: str | int) -> str:
        """Resolve ``"server"``, ``"w3"``, ``3`` (worker index), ``"sw"``, or one of our
        namespace names to a node name."""
        if isinstance(which, int) and not isinstance(which, bool):
            if 0 <= which < self.config.workers:
                return f"w{which}"
        elif isinstance(which, str):
            if which in self.nodes or which == SWITCH:
                return which
            if which == "switch":
                return SWITCH
            if which.isdigit():
                return self.node(int(which))
            for node, ns in self.namespaces().items():
                if which == ns:
                    return node
        raise TestbedError(f"unknown node {which!r}: use server, w0..w{self.config.workers - 1}"
                           " or a worker index")

    def namespace(self, which: str | int) -> str:
        return self.namespaces()[self.node(which)]

    @property
    def bottleneck(self) -> Bottleneck | None:
        return self._bottleneck

    @property
    def is_up(self) -> bool:
        return self._active

    # -- lifecycle --------------------------------------------------------------------

    def up(self) -> Testbed:
        """Create the namespaces, switch routes, veths, addresses, bottleneck and loss rule. On
        any failure (or an interrupt) whatever was made is removed before re-raising."""
        with self._lock:
            if self._active:
                return self
            require_privileges()
            ip = _tool("ip")
            _tool("tc")
            if self.config.loss > 0:
                _tool("iptables")
                _tool("iptables-restore")
            ours = self.namespaces()
            clash = sorted(set(ours.values()) & set(list_namespaces()))
            if clash:
                raise TestbedError(f"namespace {clash[0]} already exists")
            self._active = True
            try:
                self._build(ip, ours)
                if self._bottleneck is not None:
                    self.set_bottleneck(self._bottleneck)
                if self.config.loss > 0:
                    self.set_loss(self.config.loss)
            except BaseException:
                self.down()
                raise
        return self

    def _build(self, ip: str, ours: dict[str, str]) -> None:
        cfg = self.config
        for ns in ours.values():
            _run([ip, "netns", "add", ns])
        for ns in ours.values():  # no IPv6: no DAD/MLD/RS chatter through the bottleneck
            _run([ip, "netns", "exec", ns, "sh", "-c",
                  "for k in all default; do f=/proc/sys/net/ipv6/conf/$k/disable_ipv6; "
                  "[ -w $f ] && echo 1 > $f; done; true"], check=False)
        mtu = str(cfg.mtu)
        addrs = self.addresses
        # The switch routes (IPv4 forwarding) rather than bridges: a routed packet passes
        # the switch's FORWARD chain, where the loss rules drop it one wire packet at a
        # time before the receiver's GRO; bridged frames would reach iptables only
        # through br_netfilter, a host-wide module we cannot count on.
        _run([ip, "netns", "exec", ours[SWITCH], "sh", "-c",
              "echo 1 > /proc/sys/net/ipv4/ip_forward && "
              "for k in all default; do echo 0 > /proc/sys/net/ipv4/conf/$k/rp_filter; "
              "echo 0 > /proc/sys/net/ipv4/conf/$k/send_redirects; done"])
        sw = ["link set lo up"]
        for n in self.nodes:
            port = self.port_of(n)
            sw += [f"link add {port} mtu {mtu} address {self._mac(n, switch_side=True)} "
                   f"type veth peer name {NODE_IFACE} mtu {mtu} "
                   f"address {self._mac(n)} netns {ours[n]}",
                   f"link set {port} up",
                   f"route replace {addrs[n]}/32 dev {port}",
                   # static neighbours: no ARP, so a saturated bottleneck cannot starve
                   # address resolution (which would look like loss no knob asked for)
                   f"neigh replace {addrs[n]} lladdr {self._mac(n)} dev {port} nud permanent"]
        _run([ip, "-n", ours[SWITCH], "-batch", "-"], input="\n".join(sw) + "\n")
        _run([_tool("tc"), "-n", ours[SWITCH], "-batch", "-"], input="".join(
            f"qdisc replace dev {self.port_of(n)} root {' '.join(PORT_QDISC)}\n"
            for n in self.nodes))
        for n in self.nodes:
            cmds = ["link set lo up",
                    f"addr add {addrs[n]}/{self.prefixlen} dev {NODE_IFACE}",
                    f"link set {NODE_IFACE} up"]
            # every other node is on-link, reached through the switch's port
            cmds += [f"neigh replace {addrs[m]} lladdr {self._mac(n, switch_side=True)} "
                     f"dev {NODE_IFACE} nud permanent" for m in self.nodes if m != n]
            _run([ip, "-n", ours[n], "-batch", "-"], input="\n".join(cmds) + "\n")
        offload = [sys.executable, "-m", "boundedloss.emulate.offload"]
        for n in self.nodes:
            # Wire-size packets on every link, coalesced at the receiver: segmentation
            # offloads off on each node's interface (the kernel cuts TCP and UDP_SEGMENT
            # super-packets into MTU-sized packets before the link, one system call
            # still) and GRO on (what survived the switch is coalesced on arrival).
            _run([ip, "netns", "exec", ours[n], *offload, "--gro", NODE_IFACE])
        # the switch's ports: GRO off (the loss rules see each wire packet), and TSO off,
        # without which a veth does not coalesce at its peer, the receiving node
        _run([ip, "netns", "exec", ours[SWITCH], *offload,
              *(self.port_of(n) for n in self.nodes)])

    def down(self) -> None:
        """Stop schedules and traffic, end every process left in our namespaces, delete
        the namespaces (their veths, routes, qdisc and iptables rules go with them).
        Idempotent; raises TestbedError if something of ours is still there after."""
        with self._lock:
            schedules, self._schedules = list(self._schedules), []
        for sched in schedules:  # outside the lock: a schedule thread may be in set_loss
            sched.stop(restore=False)
        with self._lock:
            for p in self._procs:
                if p.poll() is None:
                    _end_pids([p.pid], grace_s=0.5)
                with contextlib.suppress(Exception):
                    p.wait(timeout=1)
            self._procs.clear()
            if not self._active:
                return
            ours = set(self.namespaces().values())
            present = [ns for ns in list_namespaces() if ns in ours]
            for ns in present:
                _delete_namespace(ns)
            still = [ns for ns in list_namespaces() if ns in ours]
            for ns in still:  # one more try (a process may have been starting)
                _delete_namespace(ns)
            still = [ns for ns in list_namespaces() if ns in ours]
            if still:
                raise TestbedError(f"could not delete namespace(s) {', '.join(still)}")
            self._active = False
            self._chains.clear()

    # -- signals / context manager ----------------------------------------------------

    def _on_signal(self, signum, frame):
        if self._tearing_down:
            self._pending_signals.append(signum)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._prev_handlers = {}
        for s in (signal.SIGINT, signal.SIGTERM):
            self._prev_handlers[s] = signal.getsignal(s)
            signal.signal(s, self._on_signal)

    def _restore_handlers(self) -> None:
        prev, self._prev_handlers = self._prev_handlers, None
        if prev is None:
            return
        for s, h in prev.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        pending, self._pending_signals = self._pending_signals, []
        for s in dict.fromkeys(pending):  # deliver what arrived during teardown, once
            signal.raise_signal(s)

    @contextlib.contextmanager
    def guard_signals(self):
        """While inside: SIGINT/SIGTERM raise (KeyboardInterrupt / SystemExit) so the
        caller's cleanup runs; on leaving, ``down()`` if the body raised, then restore."""
        self._install_handlers()
        try:
            yield self
        except BaseException:
            self._tearing_down = True
            try:
                self.down()
            finally:
                self._tearing_down = False
            raise
        finally:
            self._restore_handlers()

    def __enter__(self) -> Testbed:
        self._install_handlers()
        try:
            self.up()
        except BaseException:
            self._restore_handlers()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._tearing_down = True
        try:
            self.down()
        finally:
            self._tearing_down = False
            self._restore_handlers()

    # -- state (for the CLI: up in one process, down in another) -----------------------

    def to_state(self) -> dict:
        return {"version": 1, "id": self.id, "name": self.name,
                "config": self.config.to_dict(),
                "bottleneck": asdict(self._bottleneck) if self._bottleneck else None,
                "namespaces": self.namespaces(), "addresses": self.addresses,
                "created": time.time(), "pid": os.getpid()}

    @classmethod
    def from_state(cls, state: dict) -> Testbed:
        """A handle on a testbed another process brought up (``down()`` removes it)."""
        tb = cls(TestbedConfig.from_dict(state["config"]), id=state["id"])
        b = state.get("bottleneck", asdict(tb.config.bottleneck) if tb.config.bottleneck else None)
        tb._bottleneck = Bottleneck(**b) if b else None
        tb._active = True
        return tb

    # -- processes --------------------------------------------------------------------

    def netns_argv(self, which: str | int, argv: list[str] | tuple[str, ...]) -> list[str]:
        """The command line that runs ``argv`` inside a node's namespace
        (``ip netns exec NS ...``)."""
        if isinstance(argv, str):
            raise TypeError("argv must be a list of strings, not one string")
        return [_tool("ip"), "netns", "exec", self.namespace(which), *map(str, argv)]

    @staticmethod
    def node_env(env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a command in a node gets: ``env`` (default: ours) with
        ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME`` = eth0, the node's one interface
        (Gloo otherwise binds to what the host name resolves to - 127.0.0.1 or a root
        namespace address - and a rendezvous across namespaces times out). An explicit
        ``env`` keeps its own values; the inherited environment is overridden."""
        node = dict(GLOO_SOCKET_IFNAME=NODE_IFACE, TP_SOCKET_IFNAME=NODE_IFACE)
        if env is None:
            return {**os.environ, **node}
        return {**node, **env}

    def run(self, which: str | int, argv: list[str], **popen_kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside a node's namespace (``ip netns exec``); returns the Popen.
        The environment is ``node_env(env)``. ``down()`` ends the process if it is still
        running then."""
        if not self._active:
            raise TestbedError("the testbed is not up")
        popen_kw["env"] = self.node_env(popen_kw.get("env"))
        p = subprocess.Popen(self.netns_argv(which, argv), **popen_kw)
        self._procs = [q for q in self._procs if q.poll() is None] + [p]
        return p

    def call(self, which: str | int, argv: list[str], *, timeout: float = 30.0,
             check: bool = False) -> subprocess.CompletedProcess:
        """Run ``argv`` in a node's namespace to completion (bounded by ``timeout``),
        capturing text output."""
        if not self._active:
            raise TestbedError("the testbed is not up")
        try:
            p = subprocess.run(self.netns_argv(which, argv), capture_output=True, text=True,
                               timeout=timeout, env=self.node_env())
        except subprocess.TimeoutExpired:
            raise TestbedError(f"{shlex.join(map(str, argv))} in {which} timed out after "
                               f"{timeout:g} s") from None
        if check and p.returncode != 0:
            why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
            raise TestbedError(f"{shlex.join(map(str, argv))} in {which} failed: {why}")
        return p

    # -- bottleneck -------------------------------------------------------------------

    def set_bottleneck(self, bottleneck: Bottleneck | None = None, **kw: str) -> None:
        """Install or replace the tbf on the switch port toward the server
        (``set_bottleneck(rate="20mbit", burst="16kb", limit="32kb")`` works too);
        ``None`` and no keywords puts the port's plain queue back (``pfifo``,
        :data:`PORT_QUEUE_PACKETS`)."""
        if bottleneck is None and kw:
            bottleneck = Bottleneck(**kw)
        if bottleneck is not None:
            bottleneck.check_mtu(self.config.mtu)
        with self._lock:
            if not self._active:
                raise TestbedError("the testbed is not up")
            tc = _tool("tc")
            dev = self.port_of(SERVER)
            if bottleneck is None:
                current = self.qdisc_stats()
                if current is not None and current.kind == "tbf":
                    _run([tc, "-n", self.switch_namespace, "qdisc", "replace", "dev", dev,
                          "root", *PORT_QDISC])
            else:
                _run([tc, "-n", self.switch_namespace, "qdisc", "replace", "dev", dev,
                      "root", *bottleneck.tc_args()])
            self._bottleneck = bottleneck

    def qdisc_stats(self) -> QdiscStats | None:
        """sent/dropped/overlimits/backlog of the root qdisc toward the server (counters
        restart when ``set_bottleneck`` replaces the qdisc)."""
        tc = _tool("tc")
        base = [tc, "-n", self.switch_namespace, "-s"]
        tail = ["qdisc", "show", "dev", self.port_of(SERVER)]
        p = _run([*base, "-j", *tail], check=False)
        if p.returncode == 0 and p.stdout.strip().startswith("["):
            try:
                return _qdisc_from_json(json.loads(p.stdout))
            except (ValueError, KeyError, TypeError):
                pass
        return parse_tc_stats(_run([*base, *tail]).stdout)

    # -- random loss ------------------------------------------------------------------

    def _ipt(self, ns: str, *args: str, check: bool = True, input: str | None = None):
        return _run([_tool("ip"), "netns", "exec", ns, *args], check=check, input=input)

    def _has_chain(self, chain: str) -> bool:
        if find_tool("iptables") is None:
            return False
        return self._ipt(self.switch_namespace, _tool("iptables"), "-w", "-S", chain,
                         check=False).returncode == 0

    def set_loss(self, p: float, node: str | int = SERVER, *, protocol: str = "udp") -> None:
        """Drop each packet on its way to ``node`` (at the switch, the port toward it) with
        probability ``p``: UDP only (``protocol="udp"``, the default: control traffic on
        TCP is spared) or everything (``"all"``). The rule lives alone in the node's chain
        (``loss_chain(node)``), jumped to from the switch's FORWARD for packets leaving
        through the node's port, and is replaced in one iptables-restore transaction;
        ``p=0`` removes the rule, the jump and the chain."""
        p = check_probability(p)
        if protocol not in ("udp", "all"):
            raise ValueError(f"protocol must be 'udp' or 'all', got {protocol!r}")
        with self._lock:
            name, chain, exists = self._loss_chain(node)
            ns = self.switch_namespace
            if p == 0:
                if exists:
                    self._ipt(ns, _tool("iptables-restore"), "-w", "--noflush", input=(
                        f"*filter\n-F {chain}\n-D FORWARD -o {port_name(name)} -j {chain}\n"
                        f"-X {chain}\nCOMMIT\n"))
                self._chains.discard(chain)
                return
            self._ipt(ns, _tool("iptables-restore"), "-w", "--noflush",
                      input=loss_transaction(p, protocol, node=name, jump=not exists))
            self._chains.add(chain)

    def loss_writer(self, node: str | int = SERVER, *, protocol: str = "all") -> LossRuleWriter:
        """A :class:`LossRuleWriter` on ``node``: its loss rule changed in about a
        millisecond, for microbursts (``down()`` ends it)."""
        with self._lock:
            name, chain, exists = self._loss_chain(node)
            self._chains.add(chain)
        return LossRuleWriter(self, name, protocol, jump=not exists)

    def _loss_chain(self, node: str | int) -> tuple[str, str, bool]:
        """The receiving ``node`` whose loss rule is to change, its chain, and whether
        the chain exists (with the lock held)."""
        name = self.node(node)
        if name == SWITCH:
            raise TestbedError("loss goes on a receiving node (server or a worker), "
                               "not the switch")
        if not self._active:
            raise TestbedError("the testbed is not up")
        chain = loss_chain(name)
        return name, chain, chain in self._chains or self._has_chain(chain)

    def loss_stats(self, node: str | int = SERVER) -> LossStats:
        """The loss rule toward ``node`` as the kernel holds it, with its counters."""
        name = self.node(node)
        chain, ns = loss_chain(name), self.switch_namespace
        if not self._has_chain(chain):
            return LossStats(0.0, None, 0, 0, 0)
        out = self._ipt(ns, _tool("iptables"), "-w", "-L", "-v", "-x", "-n").stdout
        spec = self._ipt(ns, _tool("iptables"), "-w", "-S", chain).stdout
        prob, proto = 0.0, None
        for ln in spec.splitlines():
            if ln.startswith(f"-A {chain}") and "-j DROP" in ln:
                m = re.search(r"--probability (\S+)", ln)
                prob = round(float(m.group(1)), 9) if m else 1.0
                proto = "udp" if "-p udp" in ln else "all"
        seen = dropped = dbytes = 0
        listed = None
        for ln in out.splitlines():
            if ln.startswith("Chain "):
                listed = ln.split()[1]
                continue
            cols = ln.split()
            if len(cols) < 3 or not cols[0].isdigit():
                continue
            if listed == "FORWARD" and cols[2] == chain:
                seen += int(cols[0])
            elif listed == chain and cols[2] == "DROP":
                dropped += int(cols[0])
                dbytes += int(cols[1])
        return LossStats(prob, proto, dropped, dbytes, seen)

    # -- bursts -----------------------------------------------------------------------

    def loss_schedule(self, windows, *, base: float = 0.0, node: str | int = SERVER,
                      protocol: str = "udp") -> LossSchedule:
        """A started ``LossSchedule`` (see ``boundedloss.emulate.bursts``)."""
        from .bursts import LossSchedule

        return LossSchedule(windows, base=base, node=node, protocol=protocol).start(self)

    def register_schedule(self, sched: LossSchedule) -> None:
        """Have ``down()`` stop ``sched`` (``LossSchedule.start`` registers itself)."""
        with self._lock:
            self._schedules.append(sched)

    def unregister_schedule(self, sched: LossSchedule) -> None:
        """Forget ``sched`` (it has ended or was stopped); unknown schedules are ignored."""
        with self._lock:
            if sched in self._schedules:
                self._schedules.remove(sched)

    def sink(self, node: str | int, port: int, *, idle: float = 0.5, max_time: float = 10.0,
             expect: int | None = None, ready_timeout: float = 10.0) -> TrafficProcess:
        """A bounded UDP receiver in ``node`` counting datagrams per flow (returns once it
        is bound; ``.wait()`` gives its JSON report)."""
        argv = [sys.executable, str(_TRAFFIC), "sink", "--port", str(port), "--idle",
                str(idle), "--max-time", str(max_time)]
        if expect is not None:
            argv += ["--expect", str(expect)]
        proc = self.run(node, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        t = TrafficProcess(proc, bound_s=max_time, what=f"sink in {self.node(node)}")
        t.wait_until_ready(ready_timeout)
        return t

    def send(self, src: str | int, dst: str | int, port: int, *, count: int | None = None,
             size: int = 1200, rate_mbit: float | None = None, duration: float = 10.0,
             flow: int | None = None) -> TrafficProcess:
        """A bounded UDP sender from ``src`` to ``dst``'s address: at most ``count``
        datagrams (derived from ``rate_mbit`` x ``duration`` when not given) of ``size``
        payload bytes, for at most ``duration`` s. Returns at once; ``.wait()``."""
        src, dst = self.node(src), self.node(dst)
        if not 8 <= size <= self.config.mtu - 28:
            raise ValueError(f"size must be 8..{self.config.mtu - 28} (one unfragmented "
                             f"datagram at mtu {self.config.mtu}), got {size}")
        if count is None and not rate_mbit:
            raise ValueError("give count, or rate_mbit (with duration) to bound the sender")
        argv = [sys.executable, str(_TRAFFIC), "send", "--dst", self.addresses[dst],
                "--port", str(port), "--size", str(size), "--duration", str(duration),
                "--flow", str(self.nodes.index(src) if flow is None else flow)]
        if count is not None:
            argv += ["--count", str(count)]
        if rate_mbit:
            argv += ["--rate-mbit", str(rate_mbit)]
        proc = self.run(src, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        return TrafficProcess(proc, bound_s=duration, what=f"sender in {src}")

    def cross_traffic(self, duration_s: float, rate_mbit: float, size: int = 1200, *,
                      src: str | int | None = None, dst: str | int = SERVER, port: int = 9,
                      wait: bool = True) -> TrafficProcess:
        """A real microburst: a paced UDP flood of ``rate_mbit`` for ``duration_s`` from a
        worker (default: the last one) through the bottleneck to ``dst`` (default: the
        server's discard port 9, where nobody listens; the bottleneck is what it is for).
        Bounded by ``duration_s`` and by ``ceil(duration x rate / frame)`` datagrams.
        ``wait=True`` returns when it is done; ``wait=False`` returns the handle."""
        if not 0 < duration_s <= 600:
            raise ValueError("duration_s must be in (0, 600]")
        if not 0 < rate_mbit <= 100_000:
            raise ValueError("rate_mbit must be in (0, 100000]")
        src = self.workers[-1] if src is None else src
        t = self.send(src, dst, port, size=size, rate_mbit=rate_mbit, duration=duration_s)
        if wait:
            t.wait()
        return t

    # -- status -----------------------------------------------------------------------

    def status(self) -> TestbedStatus:
        ours = self.namespaces()
        existing = set(list_namespaces())
        present = {n: ns in existing for n, ns in ours.items()}
        up = all(present.values())
        qdisc = None
        loss: dict[str, LossStats] = {}
        if up:
            if find_tool("tc"):
                qdisc = self.qdisc_stats()
            for n in self.nodes:
                loss[n] = self.loss_stats(n)
        return TestbedStatus(name=self.name, up=up, namespaces=present,
                             addresses=self.addresses, bottleneck=self._bottleneck,
                             qdisc=qdisc, loss=loss)

    def __repr__(self) -> str:
        state = "up" if self._active else "down"
        return (f"<Testbed {self.name} {state} workers={self.config.workers} "
                f"subnet={self.config.subnet}>")


class TrafficProcess:
    """A running ``traffic.py`` sender or sink. ``wait()`` returns its JSON report; it is
    bounded by the tool's own time bound plus a margin, after which it is killed."""

    def __init__(self, proc: subprocess.Popen, *, bound_s: float, what: str):
        self.proc = proc
        self.bound_s = bound_s
        self.what = what
        self.result: dict | None = None

    def wait_until_ready(self, timeout: float) -> None:
        """Block until the tool prints ``READY`` on stdout (a sink once it is bound); a
        tool that exits first, or stays silent for ``timeout`` s, is a TestbedError."""
        import selectors

        stdout, stderr = self.proc.stdout, self.proc.stderr
        if stdout is None or stderr is None:
            raise TestbedError(f"{self.what} was started without stdout/stderr pipes: "
                               "nothing to wait on")
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.stop()
                    raise TestbedError(f"{self.what} did not start within {timeout:g} s")
                line = stdout.readline()
                if line.strip() == b"READY":
                    return
                if not line:
                    err = stderr.read().decode(errors="replace").strip()
                    last = err.splitlines()[-1] if err else "no output"
                    raise TestbedError(f"{self.what} exited: {last}")

    @property
    def done(self) -> bool:
        return self.proc.poll() is not None

    def wait(self, timeout: float | None = None) -> dict:
        if self.result is not None:
            return self.result
        timeout = self.bound_s + 10.0 if timeout is None else timeout
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise TestbedError(f"{self.what} still running after {timeout:g} s; ended it") from None
        text = out.decode(errors="replace").strip().splitlines()
        try:
            self.result = json.loads(text[-1])
        except (IndexError, ValueError):
            why = err.decode(errors="replace").strip().splitlines()
            raise TestbedError(f"{self.what} failed (exit {self.proc.returncode}): "
                               f"{why[-1] if why else 'no output'}") from None
        return self.result

    def stop(self) -> None:
        if self.proc.poll() is None:
            _end_pids([self.proc.pid], grace_s=0.5)
        with contextlib.suppress(Exception):
            self.proc.communicate(timeout=1)

    def __enter__(self) -> TrafficProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
