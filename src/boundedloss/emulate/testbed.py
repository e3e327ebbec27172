"""The real-kernel testbed: network namespaces joined by a switch namespace that routes
between them, a tbf bottleneck in front of the server, and nf_tables random loss at the
switch port toward each receiver - built over netlink from Python (pyroute2 and libc):
it needs the Linux kernel and what pip installs, no ``ip``, ``tc``, ``iptables`` or
``nft`` binary.

Topology (everything lives in namespaces the testbed creates; the root namespace's
interfaces, routes and firewall are never touched)::

    ns <p><id>-w0      ns <p><id>-sw (switch: IPv4 forwarding)          ns <p><id>-server
    eth0 10.201.0.2 --- to-w0 --+
    ns <p><id>-w1               |   forward: oifname to-X -> loss-X
    eth0 10.201.0.3 --- to-w1 --+   (numgen random drop) -> to-server [tbf] --- eth0 10.201.0.1
    ...                         |                      (egress toward        (GRO)
    eth0 10.201.0.N+1 - to-wN-1-+                       the server)

This class is the facade; each concern lives in its own module: what is asked
(``config``), the shape and how it is built (``topology``), a port's queue (``qdisc``),
the drop rules (``loss_rules`` over ``nft``), the processes run in nodes
(``processes``), namespaces themselves (``netns``), and the host's side - privileges,
leftovers, the probe (``host``).

Names carry ``prefix`` + a 6-hex-digit id, so several testbeds can coexist and
``sweep(prefix)`` can find leftovers of a crashed run without any state file.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from . import netns, processes, qdisc, tcp_counters
from .config import TestbedConfig
from .errors import TestbedError
from .host import (
    NEED_ROOT,
    available,
    have_privileges,
    kernel_step,
    leftovers,
    list_namespaces,
    require_privileges,
    sweep,
)
from .host import delete_namespace as _delete_namespace
from .loss_rules import (
    LossRules,
    LossRuleWriter,
    LossStats,
    check_probability,
    check_protocol,
    loss_chain,
)
from .processes import TrafficProcess
from .qdisc import ETH_HEADER, PORT_QUEUE_PACKETS, Bottleneck, QdiscStats
from .topology import MAX_WORKERS, NODE_IFACE, SERVER, SWITCH, Topology, port_name, with_rtnl

if TYPE_CHECKING:  # pragma: no cover
    from .bursts import LossSchedule

__all__ = [
    "ETH_HEADER", "MAX_WORKERS", "NEED_ROOT", "NODE_IFACE", "PORT_QUEUE_PACKETS", "SERVER",
    "SWITCH", "Bottleneck", "LossRuleWriter", "LossStats", "QdiscStats", "Testbed",
    "TestbedConfig", "TestbedError", "TestbedStatus", "TrafficProcess", "available",
    "check_probability", "have_privileges", "leftovers", "list_namespaces", "loss_chain",
    "port_name", "require_privileges", "sweep",
]

# ----------------------------------------------------------------------------- testbed


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
        self.topology = Topology(name=f"{config.prefix}{self.id}", id=self.id,
                                 workers=config.workers, subnet=config.subnet, mtu=config.mtu)
        self._active = False
        self._bottleneck = config.bottleneck
        self._runner = processes.ProcessRunner()
        self._rules: LossRules | None = None
        self._schedules: list[LossSchedule] = []
        self._lock = threading.RLock()
        self._prev_handlers: dict[int, Any] | None = None
        self._tearing_down = False
        self._pending_signals: list[int] = []

    # -- names ------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.topology.name

    @property
    def workers(self) -> tuple[str, ...]:
        return self.topology.worker_nodes

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.topology.nodes

    @property
    def switch_namespace(self) -> str:
        return self.topology.namespaces()[SWITCH]

    def namespaces(self) -> dict[str, str]:
        """node -> namespace name, the switch (``"sw"``) included."""
        return self.topology.namespaces()

    @property
    def addresses(self) -> dict[str, str]:
        """node -> IPv4 address (the server first, then w0, w1, ...)."""
        return self.topology.addresses

    @property
    def prefixlen(self) -> int:
        return self.topology.prefixlen

    def port_of(self, node: str) -> str:
        """The switch-side veth toward ``node`` (the bottleneck lives on ``to-server``)."""
        return port_name(self.node(node))

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
        """Create the namespaces, switch routes, veths, addresses, queues, drop-rule
        table, bottleneck and loss. On any failure (or an interrupt) whatever was made
        is removed before re-raising."""
        with self._lock:
            if self._active:
                return self
            require_privileges()
            ours = self.namespaces()
            clash = sorted(set(ours.values()) & set(list_namespaces()))
            if clash:
                raise TestbedError(f"namespace {clash[0]} already exists")
            self._active = True
            try:
                with kernel_step("building the testbed"):
                    self.topology.build()
                with kernel_step("installing the nf_tables drop rules"):
                    self._loss_rules().install()
                if self._bottleneck is not None:
                    self.set_bottleneck(self._bottleneck)
                if self.config.loss > 0:
                    self.set_loss(self.config.loss)
            except BaseException:
                self.down()
                raise
        return self

    def down(self) -> None:
        """Stop schedules and traffic, end every process left in our namespaces, delete
        the namespaces (their veths, routes, qdiscs and drop rules go with them).
        Idempotent; raises TestbedError if something of ours is still there after."""
        with self._lock:
            schedules, self._schedules = list(self._schedules), []
        for sched in schedules:  # outside the lock: a schedule thread may be in set_loss
            sched.stop(restore=False)
        with self._lock:
            self._runner.end_all()
            if self._rules is not None:
                self._rules.close()  # (the socket would keep the switch's namespace)
                self._rules = None
            if not self._active:
                return
            ours = set(self.namespaces().values())
            for _ in range(2):  # one more try (a process may have been starting)
                for ns in [ns for ns in list_namespaces() if ns in ours]:
                    _delete_namespace(ns)
            still = [ns for ns in list_namespaces() if ns in ours]
            if still:
                raise TestbedError(f"could not delete namespace(s) {', '.join(still)}")
            self._active = False

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
        """The command line that runs ``argv`` inside a node's namespace."""
        return netns.enter_argv(self.namespace(which), list(argv))

    @staticmethod
    def node_env(env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a command in a node gets (see ``processes.node_env``)."""
        return processes.node_env(env)

    def run(self, which: str | int, argv: list[str], **popen_kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside a node's namespace; returns the Popen. The environment
        is ``node_env(env)``. ``down()`` ends the process if it is still running then."""
        if not self._active:
            raise TestbedError("the testbed is not up")
        if isinstance(argv, str):
            raise TypeError("argv must be a list of strings, not one string")
        return self._runner.run(self.namespace(which), argv, **popen_kw)

    def call(self, which: str | int, argv: list[str], *, timeout: float = 30.0,
             check: bool = False) -> subprocess.CompletedProcess:
        """Run ``argv`` in a node's namespace to completion (bounded by ``timeout``),
        capturing text output."""
        if not self._active:
            raise TestbedError("the testbed is not up")
        return self._runner.call(self.namespace(which), argv, timeout=timeout, check=check,
                                 where=self.node(which))

    # -- bottleneck -------------------------------------------------------------------

    def _server_port(self, fn: Any) -> Any:
        """``fn(ipr, ifindex)`` on the switch's port toward the server."""
        port = self.port_of(SERVER)
        with kernel_step(f"the queue on {port}"):
            return with_rtnl(self.switch_namespace,
                             lambda ipr: fn(ipr, ipr.link_lookup(ifname=port)[0]))

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
            self._server_port(lambda ipr, idx: qdisc.set_queue(ipr, idx, bottleneck))
            self._bottleneck = bottleneck

    def qdisc_stats(self) -> QdiscStats | None:
        """sent/dropped/overlimits/backlog of the root qdisc toward the server (counters
        restart when ``set_bottleneck`` replaces the qdisc)."""
        return self._server_port(qdisc.stats)

    def tcp_counters(self) -> dict[str, int]:
        """Linux's TCP counters (timeouts, tail loss probes, retransmissions:
        ``tcp_counters.COUNTERS``) summed over the server's and the workers'
        namespaces; the difference of two readings is what a run's TCP did."""
        with self._lock:
            if not self._active:
                raise TestbedError("the testbed is not up")
            names = [self.namespace(node) for node in self.nodes]
        with kernel_step("reading the nodes' TCP counters"):
            return tcp_counters.read(names)

    # -- random loss ------------------------------------------------------------------

    def _loss_rules(self) -> LossRules:
        """The switch's rules, opened once (with the lock held: ``down()`` closes them)."""
        with self._lock:
            if self._rules is None:
                with kernel_step("opening nf_tables in the switch"):
                    self._rules = LossRules(self.switch_namespace)
            return self._rules

    def _receiver(self, node: str | int) -> str:
        name = self.node(node)
        if name == SWITCH:
            raise TestbedError("loss goes on a receiving node (server or a worker), "
                               "not the switch")
        if not self._active:
            raise TestbedError("the testbed is not up")
        return name

    def set_loss(self, p: float, node: str | int = SERVER, *, protocol: str = "udp") -> None:
        """Drop each packet on its way to ``node`` (at the switch, the port toward it) with
        probability ``p``: UDP only (``protocol="udp"``, the default: control traffic on
        TCP is spared) or everything (``"all"``). The rule lives in the node's chain
        (``loss_chain(node)``), jumped to from the switch's forward hook for packets
        leaving through the node's port; each call writes the node's rules afresh in one
        transaction (counters from zero), and ``p=0`` removes them (and their jump)
        altogether. (A microburst's fast changes: :meth:`loss_writer`.)"""
        p = check_probability(p)
        check_protocol(protocol)
        with self._lock:
            name = self._receiver(node)
            with kernel_step(f"setting the loss toward {name}"):
                self._loss_rules().set(name, p, protocol)

    def loss_writer(self, node: str | int = SERVER, *, protocol: str = "all") -> LossRuleWriter:
        """A :class:`LossRuleWriter` on ``node``: its loss rule changed in tens of
        microseconds, for microbursts."""
        with self._lock:
            name = self._receiver(node)
            return self._loss_rules().writer(name, protocol)

    def loss_stats(self, node: str | int = SERVER) -> LossStats:
        """The loss rule toward ``node`` as the kernel holds it, with its counters."""
        with self._lock:
            name = self._receiver(node)
            with kernel_step(f"reading the loss rule toward {name}"):
                return self._loss_rules().stats(name)

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

    # -- traffic ----------------------------------------------------------------------

    def sink(self, node: str | int, port: int, *, idle: float = 0.5, max_time: float = 10.0,
             expect: int | None = None, ready_timeout: float = 10.0) -> TrafficProcess:
        """A bounded UDP receiver in ``node`` counting datagrams per flow (returns once it
        is bound; ``.wait()`` gives its JSON report)."""
        argv = processes.sink_argv(port, idle=idle, max_time=max_time, expect=expect)
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
        argv = processes.send_argv(self.addresses[dst], port, count=count, size=size,
                                   rate_mbit=rate_mbit, duration=duration,
                                   flow=self.nodes.index(src) if flow is None else flow)
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
        qdisc_now = None
        loss: dict[str, LossStats] = {}
        if up:
            qdisc_now = self.qdisc_stats()
            for n in self.nodes:
                loss[n] = self.loss_stats(n)
        return TestbedStatus(name=self.name, up=up, namespaces=present,
                             addresses=self.addresses, bottleneck=self._bottleneck,
                             qdisc=qdisc_now, loss=loss)

    def __repr__(self) -> str:
        state = "up" if self._active else "down"
        return (f"<Testbed {self.name} {state} workers={self.config.workers} "
                f"subnet={self.config.subnet}>")
