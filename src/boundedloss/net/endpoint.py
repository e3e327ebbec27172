"""Endpoint: what a collective and the DDP hook call - sends and receives of whole
messages, each a ``concurrent.futures.Future`` - over one TransferMux core, above one
seam to the world.

The seam is what the endpoint needs from the world and nothing more (as trio fakes
the socket and everything above runs unchanged):

- ``clock()``: now, in seconds (monotonic; virtual on a simulated network);
- ``_new_future()``: a future a caller can wait on (a simulated network's hands the
  turn to the simulation while its caller waits);
- ``_wake()``: the driver runs the core again soon - something was posted;
- ``_resolve_address(peer)`` / ``check_path(peer)``: a peer as the core keys it, and
  whether a chunk's datagram fits one packet to it;
- ``_stop_driver()`` and ``_driver_counters()``.

Below it, the driver feeds the core what arrives, fires its timers, sends what it
polls and hands back what finished (``_resolve``): :class:`~.udp.UdpEndpoint`, a real
UDP socket and the compiled data path driven by an I/O thread, or
:class:`~.simulated.SimEndpoint`, a host of a :class:`~.fake.FakeNetwork` whose
discrete-event loop drives it in virtual time.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..policy.base import Policy
from ..policy.reliable import ReliablePolicy
from ..protocol.auth import DatagramAuth
from ..protocol.mux import TransferMux
from ..protocol.receiver import MessageReceiver, ReceiveBatch
from ..protocol.sender import MessageSender, SendBatch
from ..protocol.types import ReceiveResult, SendResult, TransportConfig, TransportError


class Endpoint(abc.ABC):
    """The message API over a core; a subclass is the driver below the seam."""

    #: what drives the core, as an error names it
    driver_name = "driver"
    config: TransportConfig
    mux: TransferMux
    auth: DatagramAuth | None

    def _start_api(self) -> None:
        """The API's own state (a driver calls it once its core exists)."""
        self._lock = threading.Lock()
        # transfer_id -> (its MessageSender or MessageReceiver, the future it resolves)
        self._futures: dict[int, tuple[MessageSender | MessageReceiver, Future]] = {}
        #: each of those futures -> its transfer_id (cancel finds its transfer at once)
        self._transfer_of: dict[Future, int] = {}
        self._closing = False  # the driver stops, and new calls are refused
        self._closed = False
        self._failure: BaseException | None = None  # what killed the driver, if anything
        #: when the driver runs the core again on its own at the latest (the clock's
        #: time; set under the lock with the deadline it sleeps until)
        self.sleeps_until = 0.0
        self.wakeups = 0  # times a call woke the driver (a pass of its loop each)

    # ------------------------------------------------------------------ the seam
    @abc.abstractmethod
    def clock(self) -> float:
        """Now, in seconds, as the core's timers count it."""

    @property
    @abc.abstractmethod
    def address(self) -> tuple[str, int]:
        """This endpoint's address, as its peers send to it."""

    @abc.abstractmethod
    def _wake(self) -> None:
        """Have the driver run the core soon (something was posted)."""

    @abc.abstractmethod
    def _new_future(self) -> Future:
        """A future for a caller to wait on."""

    @abc.abstractmethod
    def _resolve_address(self, peer) -> tuple[str, int]:
        """``peer`` as the core keys it."""

    @abc.abstractmethod
    def check_path(self, peer: tuple[str, int]) -> None:
        """Raise if a chunk's datagram does not fit one packet to ``peer``."""

    @abc.abstractmethod
    def _stop_driver(self) -> None:
        """Stop running the core (``_closing`` is set): return once it has stopped."""

    def _driver_counters(self) -> dict[str, int]:
        """The driver's own counters, for :meth:`counters`."""
        return {}

    # --------------------------------------------------------------------- API
    def send(self, peer, payload, *, message_id: int, round_id: int = 0,
             critical: np.ndarray | None = None) -> Future:
        """Send ``payload`` (any C-contiguous buffer; not to be modified until done)."""
        return self.send_many([(peer, payload)], message_id=message_id, round_id=round_id,
                              critical=critical)[0]

    def send_many(self, messages: Sequence[tuple[Any, Any]], *, message_id: int,
                  round_id: int = 0, critical: np.ndarray | None = None) -> list[Future]:
        """``send`` message ``message_id`` to each ``(peer, payload)`` of ``messages``, all
        at once: the lock taken once, the driver woken once. If one cannot start,
        those started before it are cancelled and the error raised."""
        messages = list(messages)  # (read twice below)
        peers = [self._resolve_address(peer) for peer, _ in messages]
        for peer in peers:
            self.check_path(peer)
        batch = SendBatch()  # (one geometry per size for them all)
        with self._lock:
            self._check_open()
            now = self.clock()
            _, futures = self._start_each(
                [(peer, payload) for peer, (_, payload) in zip(peers, messages)],
                lambda m: self.mux.start_send(m[0], round_id, message_id, m[1], now,
                                              critical=critical, batch=batch),
                self.mux.cancel_send, now)
        self._wake()
        return futures

    def receive(self, peer, *, message_id: int, round_id: int = 0,
                policy: Policy | None = None, out: np.ndarray | None = None,
                nbytes: int | None = None, critical: np.ndarray | None = None) -> Future:
        """Post a receive; chunks land in ``out`` (or a new uint8 array of the sender's size)."""
        return self._receive([(peer, out, nbytes, critical)], message_id, round_id, policy)[0]

    def receive_many(self, messages: Sequence[tuple[Any, int]], *, message_id: int,
                     round_id: int = 0, policy: Policy | None = None,
                     into: Sequence[np.ndarray | None] | None = None) -> list[Future]:
        """``receive`` message ``message_id`` from each ``(peer, nbytes)`` of ``messages``,
        all at once: the lock taken once, the driver woken at most once; ``into``: each
        one's destination (``receive``'s ``out``; None: a new array). If one cannot be
        posted, those posted before it are cancelled and the error raised."""
        outs = [None] * len(messages) if into is None else into
        return self._receive([(peer, out, nbytes, None)
                              for (peer, nbytes), out in zip(messages, outs, strict=True)],
                             message_id, round_id, policy)

    def _receive(self, messages: list[tuple], message_id: int, round_id: int,
                 policy: Policy | None) -> list[Future]:
        peers = [self._resolve_address(peer) for peer, *_ in messages]
        for peer in peers:
            self.check_path(peer)
        policy = policy or ReliablePolicy()
        batch = ReceiveBatch()  # (one plan per size for them all)
        with self._lock:
            self._check_open()
            now = self.clock()
            posted, futures = self._start_each(
                [(peer, *rest) for peer, (_, *rest) in zip(peers, messages)],
                lambda m: self.mux.start_receive(m[0], round_id, message_id, now,
                                                 policy=policy, out=m[1], nbytes=m[2],
                                                 critical=m[3], batch=batch),
                self.mux.cancel_receive, now)
            self._resolve(self.mux.pop_finished())
            # The driver need not run for a receive it would not act on before it
            # wakes anyway (a wake costs it a pass of its loop): only for something to
            # send, or a timer of a receive due sooner.
            wake = bool(self.mux.outbox)
            for rx in posted:
                due = rx.next_deadline()
                wake = wake or (due is not None and due < self.sleeps_until)
        if wake:
            self._wake()
        return futures

    def _start_each(self, messages: list, start: Callable[[Any], Any],
                    cancel: Callable[[Any, float], None], now: float) -> tuple[list, list[Future]]:
        """``start`` each of ``messages`` (under the lock), a future for each; if one cannot
        start, cancel those started before it and raise (nothing runs without its
        future). The transfers and their futures."""
        started: list = []
        futures: list[Future] = []
        try:
            for message in messages:
                transfer = start(message)
                started.append(transfer)
                fut = self._new_future()
                self._futures[transfer.transfer_id] = (transfer, fut)
                self._transfer_of[fut] = transfer.transfer_id
                futures.append(fut)
        except BaseException:
            for transfer in started:
                cancel(transfer, now)
            self._resolve(self.mux.pop_finished())
            raise
        return started, futures

    def cancel(self, future: Future) -> None:
        """Cancel a send or receive: it resolves with a CANCELLED result. A cancelled
        receive sends no STOP, so a receive posted again for the message takes over."""
        with self._lock:
            entry = self._futures.get(self._transfer_of.get(future, -1))
            if entry is not None and entry[0].result is None:
                transfer = entry[0]
                if isinstance(transfer, MessageSender):
                    self.mux.cancel_send(transfer, self.clock())
                else:
                    self.mux.cancel_receive(transfer, self.clock())
            self._resolve(self.mux.pop_finished())

    def path_state(self, peer) -> dict[str, Any]:
        """What this endpoint has learned of the path to and from ``peer`` - its round
        trip and delivery rates (``PeerPath.state_dict``) - for a checkpoint."""
        peer = self._resolve_address(peer)
        with self._lock:
            return self.mux.path(peer).state_dict()

    def load_path_state(self, peer, state: Mapping[str, Any]) -> None:
        """Start the path to ``peer`` from a checkpoint's :meth:`path_state` (the next
        send to it starts from that round trip and rate instead of the defaults)."""
        peer = self._resolve_address(peer)
        with self._lock:
            self.mux.path(peer).load_state_dict(state)

    def counters(self) -> dict[str, int]:
        with self._lock:
            d = self.mux.counters()
        d.update(self._driver_counters())
        d["io_wakeups"] = self.wakeups
        d["authenticated"] = int(self.auth is not None)
        return d

    def close(self) -> None:
        if self._closed:
            return
        self._closed = self._closing = True
        self._stop_driver()
        with self._lock:
            for _, fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(TransportError("endpoint closed"))
            self._futures.clear()
            self._transfer_of.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------ for the driver
    def _check_open(self) -> None:
        if self._failure is not None:
            raise self._failed_error() from self._failure
        if self._closing:
            raise TransportError("endpoint is closed")

    def _failed_error(self) -> TransportError:
        e = self._failure
        return TransportError(
            f"the endpoint's {self.driver_name} failed: {type(e).__name__}: {e}")

    def _fail(self, e: BaseException) -> None:
        """The driver died of ``e`` (a bug below the API - a policy's observe raising,
        say): every operation waiting on this endpoint, and every later call, fails
        with it at once, rather than the driver dying alone and its callers waiting
        out their timeouts, then blaming the peer."""
        self._failure = e
        self._closing = True
        with self._lock:
            for _, fut in self._futures.values():
                if not fut.done():
                    error = self._failed_error()
                    error.__cause__ = e
                    fut.set_exception(error)
            self._futures.clear()
            self._transfer_of.clear()

    def _resolve(self, finished: list[SendResult | ReceiveResult]) -> None:
        for result in finished:
            entry = self._futures.pop(result.transfer_id, None)
            if entry is None:
                continue
            fut = entry[1]
            del self._transfer_of[fut]
            if not fut.done():
                fut.set_result(result)
