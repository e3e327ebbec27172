"""The compiled DATA path (``boundedloss._native``) under a TransferMux, and whether it
is in use.

It takes the DATA datagrams of open receives off the Python core's hands: validation,
the copy into the destination, the delivered flags, the counters and the ACKs; the ACKs
for open sends: the bookkeeping they are (``protocol.acks``); the PROBEs for open
receives, answered with their BITMAPs; and what still comes for messages that closed
(stale; a remembered receive's STOP said again). Two it takes and then hands the core the
decision they call for, before the next datagram: the DATA that meets a receive's plan
(``TransferMux.receive_met``: the receive closes) and a STOP for an open send
(``TransferMux.stop_arrived``, with its reason and count: the send ends). A receive
whose close decides nothing (``MessageReceiver.close_is_routine``: no credit, a policy
that does not learn) it closes itself when its plan is met - its STOP said, the closed
receive remembered - and the core records those results before anything else
(``TransferMux.closed_by_data_path``). Every other
datagram - and the few whose handling is a decision: a receive's first DATA where its
plan starts a clock on it, its first FINAL PROBE, an ACK that may add PROBE copies - goes
to ``TransferMux.datagram_received`` as before, in order. The Python path
stays the reference: ``BOUNDEDLOSS_NATIVE=0`` turns the native one off, and where the
extension was not built it is off and says why (``status()``).
"""

from __future__ import annotations

import secrets
import socket
import struct
from collections.abc import Hashable
from typing import Any

from ..native import AUTH_FALLBACK, authenticates, enabled, module, status
from ..protocol.auth import NONCE_BYTES, ipv4_address
from ..protocol.mux import TransferMux
from ..protocol.receiver import MessageReceiver
from ..protocol.sender import MessageSender
from ..wire import Kind
from .loss import LossModel


class NativeDataPath:
    """Attach to ``mux`` (``mux.data_path``); feed datagrams with ``take`` or, from a
    socket, ``receive``."""

    def __init__(self, mux: TransferMux):
        self._native = module()
        self._mux = mux
        self.dispatcher = self._native.Dispatcher(mux.session)
        self._peers: dict[tuple[int, int], tuple[str, int]] = {}
        #: peer -> its ``(ip, port)`` as integers, or None if not IPv4 (ipv4_address, once
        #: per peer: a job's peers stay put)
        self._addresses: dict[Hashable, tuple[int, int] | None] = {}
        #: the closed receives the mux remembers, by key: their STOPs are said from here
        self._closed: dict[tuple, object] = {}
        if mux.auth is not None:
            local = ipv4_address(mux.auth.local)
            if local is None or not authenticates():
                raise ValueError("the compiled data path authenticates IPv4 endpoints, "
                                 "built with OpenSSL")
            # (its own nonces: a sealer of its own, seeded apart from the Python core's)
            self.dispatcher.authenticate(mux.auth.key, *local, secrets.token_bytes(NONCE_BYTES))
        grants = mux.grants
        if grants is not None:  # (the share it stamps on its ACKs follows the core's)
            self.dispatcher.credit = grants.share
            grants.listener = self._credit_changed
        mux.data_path = self

    def _credit_changed(self, share: int) -> None:
        self.dispatcher.credit = share

    def address(self, peer: Hashable) -> tuple[int, int] | None:
        """``ipv4_address(peer)``, remembered."""
        try:
            return self._addresses[peer]
        except KeyError:
            pass
        address = ipv4_address(peer)
        if len(self._addresses) >= 4096:
            self._addresses.clear()
        self._addresses[peer] = address
        return address

    # ------------------------------------------------------- DataPath for the mux
    def new_counts(self, peer: Hashable):
        """A ``Receive`` to keep a receive's counts in from the start (no copy when it
        is bound), or None for a peer whose DATA the Python core takes."""
        return None if self.address(peer) is None else self._native.Receive()

    def receive_opened(self, receiver: MessageReceiver) -> None:
        shared: Any = receiver.counts
        address = self.address(receiver.peer)
        if address is None or type(shared) is not self._native.Receive:
            return  # not an IPv4 peer (new_counts gave it none): the Python core takes its DATA
        dest, delivered, critical = receiver.buffers()
        shared.bind(receiver.peer, address[0], address[1], receiver.round_id,
                    receiver.message_id, receiver.count, receiver.nbytes, receiver.chunk_bytes,
                    receiver.ack_every, dest, delivered, critical,
                    receiver.ack_template())
        config = self._mux.config
        if config.closed_memory > 0 and receiver.close_is_routine():
            shared.close_here(config.min_rto)  # (remembered: its STOP said again from here)
        self.dispatcher.register(shared)

    def receive_closed(self, receiver: MessageReceiver, remembered_at: float | None) -> None:
        shared = receiver.counts
        if not isinstance(shared, self._native.Receive) or not shared.registered:
            return
        if remembered_at is None:
            self.dispatcher.unregister(shared)
            return
        # (the mux remembers it closed: its STOP is said again from here, until forgotten
        # - closed here already, or now)
        if not shared.closed:
            shared.close(receiver.stop, remembered_at, self._mux.config.min_rto)
        self._closed[(receiver.peer, receiver.round_id, receiver.message_id)] = shared

    def forget_closed(self, key: tuple) -> None:
        shared = self._closed.pop(key, None)
        if shared is not None:
            self.dispatcher.unregister(shared)

    def new_acks(self, peer: Hashable):
        """A ``Send`` for a send to ``peer`` to keep what its ACKs move in from the start
        (no copy when it is bound), or None for a peer whose ACKs the Python core takes."""
        return None if self.address(peer) is None else self._native.Send()

    def send_opened(self, sender: MessageSender) -> None:
        shared: Any = sender.acks
        address = self.address(sender.peer)
        if address is None or type(shared) is not self._native.Send:
            return  # not an IPv4 peer (new_acks gave it none): the Python core takes its ACKs
        shared.bind(address[0], address[1], sender.round_id, sender.message_id, sender.count,
                    sender.nbytes, sender.chunk_bytes)
        self.dispatcher.register_send(shared)

    def send_closed(self, sender: MessageSender) -> None:
        if isinstance(sender.acks, self._native.Send):
            self.dispatcher.close_send(sender.acks)  # (what comes for it later is stale)

    def seal(self, parts: tuple, peer: Hashable) -> tuple:
        address = self.address(peer)
        if address is None:  # (resolve() makes every peer an IPv4 address)
            raise ValueError(f"not an IPv4 peer: {peer!r}")
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return (*parts, self.dispatcher.seal(data, *address))

    def send_datagrams(self, sock: socket.socket, batch: list, start: int,
                       seal: bool = False) -> tuple[int, int, int]:
        """Send the control datagrams of a poll's ``batch`` from ``start`` on, a
        ``sendmmsg`` per 64, up to the first the compiled path does not send (a DataRun, a
        peer not IPv4): ``(end, errno, calls)`` - the first not sent, the errno the last
        call stopped on (0: none), the system calls that sent. ``seal``: the batch is a
        ``poll(sealed=False)``'s, its datagrams sealed here as they go."""
        return self.dispatcher.send_datagrams(sock, batch, start, seal)

    def counters(self) -> dict[str, int]:
        c = self.dispatcher.counters()
        c["datagrams_in"] = c.pop("taken")
        return c

    # --------------------------------------------------------------- feeding
    def take(self, data, peer: Hashable, now: float) -> None:
        """One datagram from ``peer``: taken here, or handed to the mux."""
        address = self.address(peer)
        taken = (False if address is None
                 else self.dispatcher.take(data, address[0], address[1], self._mux.outbox,
                                           now))
        if taken is False:
            # (the whole datagram as it came: the mux verifies its tag once more)
            self._mux.datagram_received(data, peer, now)
        elif taken is None:  # (it closed a receive here)
            self._mux.closed_by_data_path(self.dispatcher.closed(), now)
        elif taken is not True:
            self._event(taken, now)

    def _event(self, event: tuple, now: float) -> None:
        """What a datagram the compiled path took calls for from the core: a receive whose
        plan it met closes; the first PROBE a DATA carried is answered; a STOP ends its
        send."""
        kind = event[0]
        if kind == Kind.DATA:
            _, peer, round_id, message_id = event
            self._mux.receive_met((peer, round_id, message_id), now)
        elif kind == Kind.PROBE:
            _, peer, round_id, message_id = event
            self._mux.probe_carried((peer, round_id, message_id), now)
        else:
            _, ip, port, round_id, message_id, reason, delivered = event
            self._mux.stop_arrived((self._peer(ip, port), round_id, message_id), reason,
                                   delivered, now)

    def receive(self, sock: socket.socket, now: float, loss: LossModel | None = None) -> int:
        """One batch from ``sock`` (up to 64 messages, each a datagram or a GRO run):
        DATA taken here, the rest handed to the mux in order. ``loss`` decides, per
        datagram, which the network is made to lose. Returns the messages read."""
        got = self.read(sock)
        if got:
            self.take_read(now, loss)
        return got

    def read(self, sock: socket.socket) -> int:
        """One recvmmsg into the batch buffer (OSError as the socket raises it; nothing
        read then). Returns the messages read."""
        return self.dispatcher.recv(sock)

    def take_read(self, now: float, loss: LossModel | None = None) -> None:
        """Take what ``read`` read: DATA here, the rest handed to the mux in order."""
        self._take_batch(now, loss)

    def take_batch(self, messages: list, peer: Hashable, now: float,
                   loss: LossModel | None = None) -> None:
        """A batch as ``receive`` would have read it from a socket, all from ``peer``
        (an IPv4 ``(host, port)``): each message a datagram or, as UDP GRO hands them
        over, ``(run, segment)`` - equal-sized datagrams back to back, the last possibly
        shorter. For driving the compiled path without a socket (its tests)."""
        address = ipv4_address(peer)
        if address is None:
            raise ValueError(f"not an IPv4 peer: {peer!r}")
        self.dispatcher.load(messages, address[0], address[1])
        self._take_batch(now, loss)

    def _take_batch(self, now: float, loss: LossModel | None) -> None:
        dispatcher = self.dispatcher
        if loss is not None:
            rounds = memoryview(dispatcher.batch_rounds()).cast("q")
            if not loss.needs_round:  # (the Python path passes -1 then, too)
                rounds = [-1] * len(rounds)  # type: ignore[assignment]
            dispatcher.lose(bytes(loss.drop(now, r) for r in rounds))
        outbox = self._mux.outbox
        # (with authentication a datagram handed back is verified, its trailer cut off)
        mux = self._mux
        hand_back = (mux.authenticated_datagram_received if mux.auth is not None
                     else mux.datagram_received)
        handed = dispatcher.step(outbox, now)
        while handed is not None:
            if handed is True:  # (taken, and it closed a receive: the core records it)
                mux.closed_by_data_path(dispatcher.closed(), now)
            elif type(handed[0]) is int:  # (taken, with a decision for the core)
                self._event(handed, now)
            else:
                data, ip, port = handed
                hand_back(data, self._peer(ip, port), now)
            handed = dispatcher.step(outbox, now)

    def _peer(self, ip: int, port: int) -> tuple[str, int]:
        peer = self._peers.get((ip, port))
        if peer is None:
            if len(self._peers) > 4096:
                self._peers.clear()
            peer = self._peers[(ip, port)] = (socket.inet_ntoa(struct.pack("!I", ip)), port)
        return peer


__all__ = ["AUTH_FALLBACK", "NativeDataPath", "authenticates", "enabled", "ipv4_address",
           "module", "status"]
