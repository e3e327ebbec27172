"""FakeNetwork: an in-memory network with a virtual clock that drives TransferMux cores.

Deterministic from a seed: tests drop, delay, duplicate and reorder datagrams and a
lossy transfer of many megabytes takes milliseconds of real time. Each node has

- an uplink of ``up_bps`` (None: infinite) that serialises what its core sends - a
  core is polled again only once its uplink is free, which is the backpressure a real
  socket gives;
- a downlink of ``down_bps`` with a drop-tail queue of ``queue_datagrams`` and/or
  ``queue_bytes`` (incast: many senders into one shallow queue lose datagrams here) -
  or, with a ``shared_buffer``, queues that draw from one switch's memory;
- a loss model applied to every datagram it receives (``net/loss.py``);
- optionally, a background source (``net/background.py``): other tenants' datagrams
  that take its uplink in turn with its core's and queue at the destinations'
  downlinks with the job's, counted apart (``add_background``).

Between the two, every datagram that leaves an uplink passes through one *route*
(as trio's ``FakeNet.route_packet``): a callable that is handed a :class:`Datagram`
and returns the delays after which copies of it arrive at the destination's downlink
- none: it is lost; two: it is duplicated; different delays reorder. The default,
:meth:`FakeNetwork.default_route`, applies the path's profile: every path between two
nodes has a one-way ``delay``, uniform ``jitter`` (which reorders), a ``duplicate``
probability and its own optional loss model. A test that must lose, hold back or
inspect particular datagrams sets ``route`` to its own callable (which may hand the
datagrams it leaves alone to ``default_route``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

from .. import wire
from ..protocol.mux import TransferMux
from .buffer import SharedBuffer
from .cpu import Cores, CpuCosts, Interference
from .fabric import Fabric
from .loss import LossModel


@dataclass(frozen=True)
class NodeProfile:
    up_bps: float | None = None
    down_bps: float | None = None
    queue_datagrams: int | None = None  # downlink queue limit (None: unbounded)
    queue_bytes: int | None = None  # the same in bytes (None: unbounded)
    loss: LossModel | None = None
    #: what the host's CPU spends on each datagram and message (None: nothing)
    cpu: CpuCosts | None = None
    #: the downlink as a token bucket (tc's tbf) of this many bytes: a datagram leaves
    #: as soon as the bucket, refilled at ``down_bps``, holds its bytes - after a quiet
    #: spell up to this many go at once (0: a link that carries each in turn at
    #: ``down_bps``)
    down_burst_bytes: int = 0
    #: (with costs) how long the host's I/O thread takes to run once woken - a datagram
    #: arriving while it sleeps - when every core is busy: a scheduler runs a woken
    #: thread at its next turn, not at the first idle microsecond (0: at once, as for a
    #: host whose kernel takes its packets itself, TCP's)
    wake_s: float = 0.0


@dataclass(frozen=True)
class PathProfile:
    delay: float = 50e-6
    jitter: float = 0.0
    duplicate: float = 0.0
    loss: LossModel | None = None


@dataclass(frozen=True)
class Datagram:
    """One datagram on its way from ``src`` to ``dst``, as a route sees it."""

    src: Hashable
    dst: Hashable
    data: bytes
    departed: float  # virtual time its last bit left the sender's uplink

    @cached_property
    def header(self) -> wire.Header:
        """Its header, decoded on first use (a core sends only well-formed datagrams)."""
        return wire.decode(self.data)[0]

    @property
    def kind(self) -> wire.Kind:
        return self.header.kind

    @property
    def round_id(self) -> int:
        return wire.peek_round(self.data)

    @property
    def probe_seq(self) -> int | None:
        """The sequence of the PROBE this datagram is, or carries (a DATA flagged
        PROBE_CARRIED); None: neither."""
        header = self.header
        if header.kind == wire.Kind.PROBE:
            return header.index
        if header.kind == wire.Kind.DATA and header.flags & wire.Flag.PROBE_CARRIED:
            return wire.CARRIED_PROBE_SEQ
        return None


Route = Callable[[Datagram], Sequence[float]]
"""Decides a datagram's fate: the delays (seconds after it departed, each >= 0) after
which a copy of it reaches the destination; empty if it is lost."""

_ARRIVE, _DELIVER, _WAKE, _CALL, _TAKE, _SPINE_UP, _SPINE_DOWN = 0, 1, 2, 3, 4, 5, 6
#: background traffic's events (every kind from _BG_EMIT on): a source's next datagram
#: at its host's uplink, and one at the spine's links or at its destination's downlink
_BG_EMIT, _BG_SPINE_UP, _BG_SPINE_DOWN, _BG_ARRIVE = 7, 8, 9, 10


class TrafficSource(Protocol):
    """Open-loop traffic from one host (``net/background.py``)."""

    def next(self) -> tuple[float, Hashable, int]:
        """The next datagram: when it goes (never before the last), where, its bytes."""
        ...


class _Node:
    def __init__(self, address, mux: TransferMux, profile: NodeProfile,
                 serviced: Callable[[], None] | None,
                 receive: Callable[[bytes, Hashable, float], None] | None = None):
        self.address = address
        self.mux = mux
        #: how its core takes a datagram in: the mux itself, or a data path above it
        self.receive = receive or mux.datagram_received
        self.profile = profile
        self.serviced = serviced
        self.detached = False
        self.up_free = 0.0
        #: when the downlink is next free (a token bucket's: when it is full again)
        self.down_free = 0.0
        #: the datagrams in the downlink: (delivery time, bytes)
        self.queue: deque[tuple[float, int]] = deque()
        self.queued_bytes = 0
        #: datagrams offered to the switch port toward it, and those its queue dropped
        self.offered = 0
        self.dropped = 0
        self.timer_at = math.inf
        self.poll_at = math.inf
        self.cores: Cores | None = None  # where its CPU work runs (with costs)
        self.io_free = 0.0  # when its I/O thread is next free
        self.main_free = 0.0  # when its main thread is next free


class FakeNetwork:
    """Nodes are TransferMux cores addressed by any hashable; time is virtual seconds.

    ``route`` (a constructor argument, or set any time) decides every datagram's fate;
    by default :meth:`default_route`. ``counts`` tallies datagrams: ``sent`` (each one
    that left an uplink), ``no_route`` (to an address nobody holds), ``path_loss``
    (the route lost it), ``duplicated`` (extra copies the route made), ``fabric_drop``
    (lost at a full queue to or from the spine, with a ``fabric``), ``queue_drop``
    and ``node_loss`` (lost at the destination's downlink) and ``delivered`` (handed
    to the destination's core), so that
    sent + duplicated = no_route + path_loss + fabric_drop + queue_drop + node_loss
    + delivered once nothing is in flight. Background traffic is counted apart, as
    ``background_sent`` (and ``background_bytes``) = ``background_no_route`` +
    ``background_fabric_drop`` + ``background_queue_drop`` + ``background_delivered``.
    """

    POLL_BATCH = 64

    def __init__(self, seed: int = 0, path: PathProfile | None = None,
                 route: Route | None = None, shared_cores: int | None = None,
                 interference: Interference | None = None):
        """``shared_cores``: the hosts with CPU costs share this many cores (one
        machine running every rank); None: each such host has a core of its own.
        ``interference``: the time those cores lose to work not simulated."""
        self.now = 0.0
        self._seed = seed
        self._interference = interference
        self._shared = (None if shared_cores is None
                        else Cores(shared_cores, interference, seed=(seed,)))
        self._cores: list[Cores] = [] if self._shared is None else [self._shared]
        self._rng = np.random.default_rng(seed)
        self._nodes: dict = {}
        self._paths: dict = {}
        self._default_path = path or PathProfile()
        self._events: list = []
        self._order = itertools.count(1)  # (ties in time go in the order pushed)
        #: of the events waiting, how many are background traffic's, and how many are
        #: cancelled calls: neither keeps a simulation going (background never ends)
        self._background_events = 0
        self._cancelled = 0
        self.counts: Counter[str] = Counter()
        self.route = route if route is not None else self.default_route
        #: racks and a spine (None: every host on one switch)
        self.fabric: Fabric | None = None
        #: one switch's memory that every host's downlink queue draws from (None: each
        #: queue its own, as its profile says)
        self.shared_buffer: SharedBuffer | None = None
        #: which datagrams carry payload (DATA, or a TCP segment with data): those sent
        #: and dropped at full queues are counted apart (``sent_payload``,
        #: ``queue_drop_payload``); None: not counted
        self.carries_payload: Callable[[bytes], bool] | None = None

    # ------------------------------------------------------------------ set-up
    def attach(self, address, mux: TransferMux, profile: NodeProfile | None = None, *,
               serviced: Callable[[], None] | None = None,
               receive: Callable[[bytes, Hashable, float], None] | None = None) -> TransferMux:
        """Add a node at ``address`` whose core is ``mux``; ``serviced`` is called each
        time the network has fed the core, fired its timers or sent what it polled (a
        driver above the core hands on what finished there); ``receive(data, src, now)``
        takes each datagram in instead of ``mux.datagram_received`` (the compiled data
        path's ``take``, as on a real host)."""
        if address in self._nodes:
            raise ValueError(f"address {address!r} is taken")
        node = self._nodes[address] = _Node(address, mux, profile or NodeProfile(), serviced,
                                            receive)
        if node.profile.cpu is not None:
            node.cores = self._shared
            if node.cores is None:
                node.cores = Cores(1, self._interference,
                                   seed=(self._seed, len(self._cores)))
                self._cores.append(node.cores)
        return mux

    @property
    def cpu_charged(self) -> float:
        """Seconds of CPU the hosts with costs have spent so far, all together (those that
        have left included)."""
        return sum(cores.charged for cores in self._cores)

    def charge(self, address, *, main: float = 0.0, io: float = 0.0) -> float:
        """Work, ready now, for the host at ``address``: ``main`` seconds on its main
        thread and ``io`` on its I/O thread (which then sends and takes in that much
        later). When the main thread's is done (now, for a host without CPU costs)."""
        node = self._nodes[address]
        if node.cores is None:
            return self.now
        if io > 0:
            node.io_free = node.cores.run(max(self.now, node.io_free), io, self.now)
        if main > 0:
            node.main_free = node.cores.run(max(self.now, node.main_free), main, self.now)
        return max(self.now, node.main_free)

    def detach(self, address) -> None:
        """Remove the node at ``address``: what is on its way to it is lost (counted
        ``no_route``), and its core is not run again."""
        node = self._nodes.pop(address)
        node.detached = True

    def wake(self, address) -> None:
        """Run the core at ``address`` now (after the event being processed): something
        was posted to it from outside."""
        node = self._nodes[address]
        if self.now < node.poll_at:
            node.poll_at = self.now
            self._push(self.now, _WAKE, node)

    def call_at(self, t: float, fn: Callable[[], None]) -> list:
        """Call ``fn()`` when the virtual clock reaches ``t`` (now, if ``t`` has passed);
        the handle :meth:`cancel` takes."""
        handle = [fn]
        self._push(max(t, self.now), _CALL, None, None, handle)
        return handle

    def cancel(self, handle: list) -> None:
        """The call ``handle`` stands for will not happen (nothing, if it has)."""
        if handle[0] is not None:
            handle[0] = None
            self._cancelled += 1

    def add_background(self, address, source: TrafficSource) -> None:
        """Background traffic from the host at ``address``: ``source``'s datagrams, from
        its first on (see the class's counts)."""
        self._next_background(self._nodes[address], source)

    def set_path(self, src, dst, profile: PathProfile) -> None:
        self._paths[(src, dst)] = profile

    def mux(self, address) -> TransferMux:
        return self._nodes[address].mux

    def queued_bytes(self, address) -> int:
        """Bytes in the downlink queue of the node at ``address`` now (waiting, or on
        the link)."""
        node = self._nodes[address]
        self._drain(node)
        return node.queued_bytes

    def port_counts(self, address) -> tuple[int, int]:
        """The datagrams offered to the switch port toward the node at ``address`` (our
        hosts', not background traffic), and those its queue dropped."""
        node = self._nodes[address]
        return node.offered, node.dropped

    def path(self, src, dst) -> PathProfile:
        """The profile of the path from ``src`` to ``dst`` (set_path's, or the default)."""
        return self._paths.get((src, dst), self._default_path)

    # ------------------------------------------------------------------ routing
    @property
    def route(self) -> Route:
        return self._route

    @route.setter
    def route(self, route: Route) -> None:
        self._route = route
        # (the default route's datagrams go without a Datagram: nothing inspects them)
        self._routes_by_default = route == self.default_route

    def default_route(self, datagram: Datagram) -> tuple[float, ...]:
        """The path profile's decision: its loss model may lose the datagram, else it
        is duplicated with probability ``duplicate``, and each copy takes ``delay``
        plus a uniform draw of ``jitter``. To an address nobody holds: nothing (and
        no random draw)."""
        if datagram.dst not in self._nodes:
            return ()
        return self._path_delays(datagram.src, datagram.dst, datagram.data, datagram.departed)

    def _path_delays(self, src, dst, data: bytes, departed: float) -> tuple[float, ...]:
        """default_route's decision for a datagram to a node that is there."""
        path = self._paths.get((src, dst), self._default_path)
        if path.loss is not None and path.loss.drop(departed, wire.peek_round(data)):
            return ()
        copies = 2 if path.duplicate and self._rng.random() < path.duplicate else 1
        if not path.jitter:
            return (path.delay,) * copies
        return tuple(path.delay + self._rng.random() * path.jitter for _ in range(copies))

    # ------------------------------------------------------------------ running
    def run(
        self,
        until: float | None = None,
        stop_when: Callable[[], bool] | None = None,
        max_events: int = 50_000_000,
    ) -> float:
        """Process events in time order until ``until``, ``stop_when()`` or silence."""
        for node in list(self._nodes.values()):
            self._service(node)
        events = self._events
        n = 0
        # (background traffic alone is silence, unless the network runs until a time)
        while len(events) > (self._background_events if until is None else 0):
            if stop_when is not None and stop_when():
                break
            if until is not None and events[0][0] > until:
                self.now = until
                break
            self.step()
            n += 1
            if n >= max_events:
                raise RuntimeError(f"FakeNetwork: {max_events} events without finishing")
        return self.now

    def next_time(self) -> float | None:
        """When the next event happens (None: none is waiting but background traffic's,
        which never ends by itself)."""
        events = self._events
        while events and events[0][2] == _CALL and events[0][5][0] is None:
            heapq.heappop(events)  # (a cancelled call)
            self._cancelled -= 1
        if len(events) - self._cancelled <= self._background_events:
            return None
        return events[0][0]

    def step(self) -> None:
        """Process the next event (there must be one)."""
        t, _, kind, node, src, data = heapq.heappop(self._events)
        self.now = t
        if kind == _CALL:
            fn = data[0]
            if fn is None:
                self._cancelled -= 1
            else:
                data[0] = None  # (done: a cancel now is no cancel)
                fn()
            return
        if kind >= _BG_EMIT:
            self._background_events -= 1
            self._step_background(kind, node, src, data)
            return
        if node.detached:
            if kind != _WAKE:
                self.counts["no_route"] += 1
                if kind in (_DELIVER, _TAKE):  # (counted delivered when it arrived)
                    self.counts["delivered"] -= 1
            return
        if kind == _ARRIVE:
            self._arrive(node, src, data)
        elif kind == _SPINE_UP or kind == _SPINE_DOWN:
            self._cross_spine(kind, node, src, *data)
        elif kind == _DELIVER:
            cpu = node.profile.cpu
            if cpu is None:
                node.receive(data, src, t)
                self._service(node)
            else:  # its I/O thread takes it in once free, and is busy that long
                ready = max(t, node.io_free)
                if node.io_free < t and node.profile.wake_s and node.cores.all_busy(t):
                    ready = t + node.profile.wake_s  # (asleep: woken on busy cores)
                node.io_free = node.cores.run(ready, cpu.receive(len(data)), t)
                self._push(node.io_free, _TAKE, node, src, data)
        elif kind == _TAKE:
            mux = node.mux
            before = mux.core_datagrams  # (what reaches the Python core counts there)
            node.receive(data, src, t)
            cpu, cores = node.profile.cpu, node.cores
            if (mux.core_datagrams > before and cpu is not None and cpu.datagram_core > 0
                    and cores is not None):
                # the I/O thread is busy with the core's handling before it goes on
                node.io_free = cores.run(max(t, node.io_free), cpu.datagram_core, t)
            self._service(node)
        else:  # _WAKE
            if t >= node.timer_at:
                node.timer_at = math.inf
            if t >= node.poll_at:
                node.poll_at = math.inf
            d = node.mux.next_deadline()
            if d is not None and d <= t:
                node.mux.timer_fired(t)
            self._service(node)

    def run_until_done(self, transfers, timeout: float = 600.0) -> float:
        """Run until every sender/receiver in ``transfers`` has a result."""
        items = list(transfers)
        end = self.now + timeout
        self.run(until=end, stop_when=lambda: all(t.result is not None for t in items))
        if not all(t.result is not None for t in items):
            raise TimeoutError(f"transfers not done after {timeout} virtual seconds")
        return self.now

    # ----------------------------------------------------------------- internals
    def _push(self, t: float, kind: int, node: _Node | None, src=None, data=None) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, node, src, data))

    def _service(self, node: _Node) -> None:
        """Send what the node's core has (as its uplink allows) and arm its timer."""
        now = self.now
        mux = node.mux
        cpu = node.profile.cpu
        if node.up_free <= now and node.io_free <= now:
            up = node.profile.up_bps
            t = max(node.up_free, now)
            for parts, peer in mux.poll(now, self.POLL_BATCH):
                data = b"".join(parts)
                if cpu is not None:  # the I/O thread sends it, then the link carries it
                    node.io_free = node.cores.run(  # type: ignore[union-attr]
                        max(now, node.io_free), cpu.send(len(data)), now)
                    t = max(t, node.io_free)
                if up is not None:
                    t += len(data) * 8 / up
                self._transmit(node, peer, data, t)
            node.up_free = t
        if mux.has_output():
            wake = max(node.up_free, node.io_free, now)
            if wake < node.poll_at:
                node.poll_at = wake
                self._push(wake, _WAKE, node)
        d = mux.next_deadline()
        if d is not None and d < node.timer_at:
            node.timer_at = d
            self._push(max(d, now), _WAKE, node)
        if node.serviced is not None:
            node.serviced()

    def _transmit(self, src: _Node, peer, data: bytes, depart: float) -> None:
        counts = self.counts
        counts["sent"] += 1
        if self.carries_payload is not None and self.carries_payload(data):
            counts["sent_payload"] += 1
        delays: Sequence[float]
        if self._routes_by_default:
            dst = self._nodes.get(peer)
            delays = () if dst is None else self._path_delays(src.address, peer, data, depart)
        else:
            delays = self._route(Datagram(src.address, peer, data, depart))
            dst = self._nodes.get(peer)
        if dst is None:
            counts["no_route"] += 1
            return
        if not delays:
            counts["path_loss"] += 1
            return
        counts["duplicated"] += len(delays) - 1
        spine = self.fabric is not None and self.fabric.crosses(src.address, peer)
        for delay in delays:
            if not delay >= 0:
                raise ValueError(f"a route returned the delay {delay}: a copy must not "
                                 "arrive before it left")
            if spine:  # (through its rack's uplink and the spine's downlink first)
                self._push(depart, _SPINE_UP, dst, src.address, (data, delay))
            else:
                self._push(depart + delay, _ARRIVE, dst, src.address, data)

    def _cross_spine(self, kind: int, dst: _Node, src, data: bytes, delay: float) -> None:
        """A datagram at its rack's uplink (_SPINE_UP) or at the spine's downlink to the
        destination's rack (_SPINE_DOWN): queued there, or dropped (``fabric_drop``)."""
        up = kind == _SPINE_UP
        left = self._spine_offer(up, src, dst, len(data))
        if left is None:
            self.counts["fabric_drop"] += 1
            self._count_payload_drop(data)
        elif up:
            self._push(left, _SPINE_DOWN, dst, src, (data, delay))
        else:
            self._push(left + delay, _ARRIVE, dst, src, data)

    def _spine_offer(self, up: bool, src, dst: _Node, size: int) -> float | None:
        """``size`` bytes from ``src`` to ``dst`` offered to its rack's uplink (``up``)
        or to the spine's downlink into ``dst``'s rack: when they have crossed it, or
        None if its queue is full."""
        fabric = self.fabric
        assert fabric is not None
        rack = fabric.rack(src if up else dst.address)
        assert rack is not None
        return (fabric.up if up else fabric.down)[rack].offer(self.now, size)

    def _count_payload_drop(self, data: bytes) -> None:
        if self.carries_payload is not None and self.carries_payload(data):
            self.counts["queue_drop_payload"] += 1

    def _arrive(self, node: _Node, src, data: bytes) -> None:
        node.offered += 1
        if not self._admits(node, len(data)):
            node.dropped += 1
            self.counts["queue_drop"] += 1
            self._count_payload_drop(data)
            return
        prof = node.profile
        if prof.loss is not None and prof.loss.drop(self.now, wire.peek_round(data)):
            self.counts["node_loss"] += 1
            return
        t = self._enqueue(node, len(data))
        self.counts["delivered"] += 1
        self._push(t, _DELIVER, node, src, data)

    def _drain(self, node: _Node) -> None:
        """What has crossed the node's downlink by now leaves its queue."""
        queue = node.queue
        while queue and queue[0][0] <= self.now:
            node.queued_bytes -= queue.popleft()[1]

    def _admits(self, node: _Node, size: int) -> bool:
        """Whether the downlink's queue (and the shared buffer) take ``size`` bytes now."""
        now = self.now
        prof = node.profile
        queue = node.queue
        self._drain(node)
        shared = self.shared_buffer
        return not ((prof.queue_datagrams is not None and len(queue) >= prof.queue_datagrams)
                    or (prof.queue_bytes is not None
                        and node.queued_bytes + size > prof.queue_bytes)
                    or (shared is not None
                        and not shared.admits(now, node.queued_bytes, size)))

    def _enqueue(self, node: _Node, size: int) -> float:
        """Queue ``size`` bytes at the downlink; when they have crossed it."""
        prof = node.profile
        if prof.down_burst_bytes and prof.down_bps is not None:
            # (down_free: when the bucket is full again; it holds these bytes from
            # (burst - size) bytes' time before that)
            rate = prof.down_bps / 8
            t = max(self.now, node.down_free - (prof.down_burst_bytes - size) / rate)
            node.down_free = max(node.down_free, t) + size / rate
        else:
            t = max(self.now, node.down_free)
            if prof.down_bps is not None:
                t += size * 8 / prof.down_bps
            node.down_free = t
        node.queue.append((t, size))
        node.queued_bytes += size
        if self.shared_buffer is not None:
            self.shared_buffer.hold(t, size)
        return t

    # ------------------------------------------------------- background traffic
    def _push_background(self, t: float, kind: int, node: _Node, src, data) -> None:
        self._background_events += 1
        self._push(t, kind, node, src, data)

    def _next_background(self, node: _Node, source: TrafficSource) -> None:
        """Ask ``source`` for its next datagram and have it go then."""
        when, dst, size = source.next()
        self._push_background(max(when, self.now), _BG_EMIT, node, None, (source, dst, size))

    def _step_background(self, kind: int, node: _Node, src, data) -> None:
        counts = self.counts
        if kind == _BG_EMIT:
            if not node.detached:  # (a host that has left sends no more)
                self._emit_background(node, *data)
            return
        if node.detached:
            counts["background_no_route"] += 1
        elif kind == _BG_ARRIVE:
            if self._admits(node, data):
                self._enqueue(node, data)  # (it leaves the downlink and is done with)
                counts["background_delivered"] += 1
            else:
                counts["background_queue_drop"] += 1
        else:  # at its rack's uplink, or at the spine's downlink to the other rack
            size, delay = data
            up = kind == _BG_SPINE_UP
            left = self._spine_offer(up, src, node, size)
            if left is None:
                counts["background_fabric_drop"] += 1
            elif up:
                self._push_background(left, _BG_SPINE_DOWN, node, src, data)
            else:
                self._push_background(left + delay, _BG_ARRIVE, node, src, size)

    def _emit_background(self, node: _Node, source: TrafficSource, peer, size: int) -> None:
        """One of ``source``'s datagrams onto ``node``'s uplink, after what is on it
        (its core's next poll waits for it in turn)."""
        now = self.now
        self.counts["background_sent"] += 1
        self.counts["background_bytes"] += size
        depart = max(now, node.up_free)
        if node.profile.up_bps is not None:
            depart += size * 8 / node.profile.up_bps
            node.up_free = depart
        dst = self._nodes.get(peer)
        if dst is None:
            self.counts["background_no_route"] += 1
        else:  # (the path's delay, not its loss: background is dropped by queues alone)
            delay = self.path(node.address, peer).delay
            if self.fabric is not None and self.fabric.crosses(node.address, peer):
                self._push_background(depart, _BG_SPINE_UP, dst, node.address, (size, delay))
            else:
                self._push_background(depart + delay, _BG_ARRIVE, dst, node.address, size)
        self._next_background(node, source)
