"""CreditGrants: how much a receiver lets its senders have in flight (receiver-driven).

A round of a collective starts every sender at once toward the same receiver (the
parameter server; every shard owner of a transpose allreduce): what they send together
meets the queue in front of that receiver, and what does not fit is dropped - most of a
first pass under incast. As NDP, Homa and EQDS do, the receiver decides how much comes:
its senders together may have at most ``TransportConfig.credit_bytes`` in flight toward
it, and each ACK carries its sender's share (``Flag.CREDIT``: the DATA datagrams it may
have in flight beyond the highest the receiver has seen). ACKs leave as DATA arrives,
that is as the bottleneck in front of the receiver drains, so the grants follow its
drain rate: the senders' total stays at the budget whatever the link's speed.
The budget is fixed, or (``TransportConfig.credit_adaptive``, ``--credit auto``) the
receiver's own: unbounded until a queue in front of it overflows, then cut and grown
back phase by phase (protocol/drain.py, fed here as each receive's first pass ends).

The share is the budget split evenly among the receives whose sender's first pass is
under way (heard, and neither its FINAL PROBE come nor closed): a collective's round
waits for all of them, so none goes first (no SRPT). A receive posted ahead of its
round holds nothing until its first datagram comes. Where more senders than the budget
has room for at ``MIN_SHARE`` each are under way (a large incast), the later ones wait
parked, with credit 0, until an earlier one is done. A send's first pass goes
``unscheduled_bytes`` ahead of any grant - or, once an earlier message to that peer
heard one, the least it was granted (``PeerPath.granted``, at least one datagram: the
receiver learns of a sender from its first datagram).

Sans-I/O; the receives tell it when they are heard and when they close, the mux tells a
compiled data path each new share (``listener``), and the ACKs of both paths stamp it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .drain import DrainBudget

if TYPE_CHECKING:
    from .receiver import MessageReceiver

#: the least share: a sender with less could not keep one datagram in flight while the
#: ACK that frees the next is on its way
MIN_SHARE = 2
#: ``--credit auto``'s floor: a receiver's own budget (protocol/drain.py) is never
#: below this (two datagrams of the largest chunk at MTU 9,000 fit)
AUTO_FLOOR_BYTES = 32 * 1024


class CreditSetting(NamedTuple):
    """Receiver-driven credit as a command line sets it: off (``budget_bytes`` None), a
    fixed budget, or (``adaptive``) one each receiver sizes from the overflows it sees
    (protocol/drain.py), never below ``budget_bytes`` - TransportConfig's credit_bytes
    and credit_adaptive."""

    budget_bytes: int | None
    adaptive: bool = False

    def __str__(self) -> str:
        if self.budget_bytes is None:
            return "off"
        return "auto" if self.adaptive else str(self.budget_bytes)

    @classmethod
    def from_str(cls, text: str) -> CreditSetting:
        """What ``str`` wrote: off, auto, or a budget in bytes."""
        named = NAMED_CREDITS.get(text)
        return named if named is not None else cls(int(text))

    def transport(self) -> dict[str, Any]:
        """As TransportConfig's fields."""
        return {"credit_bytes": self.budget_bytes, "credit_adaptive": self.adaptive}


#: no credit
CREDIT_OFF = CreditSetting(None)
#: each receiver's own budget (protocol/drain.py)
CREDIT_AUTO = CreditSetting(AUTO_FLOOR_BYTES, adaptive=True)
#: the settings a word names (--credit off, --credit auto)
NAMED_CREDITS = {str(c): c for c in (CREDIT_OFF, CREDIT_AUTO)}


class _Phase:
    """A spell of shared budget under way (adaptive grants): when its first receive was
    heard, and of its receives done so far, the datagrams they took, what their senders
    sent as far as the sequence numbers tell, and the senders' least round trip."""

    __slots__ = ("datagrams", "rtt", "sent", "start")

    def __init__(self, start: float):
        self.start = start
        self.datagrams = 0
        self.sent = 0
        self.rtt: float | None = None


def ack_cadence(ack_every: int, credit: int) -> int:
    """DATA datagrams per ACK of a receive whose sender holds ``credit`` (its latest
    grant; -1: none yet): four ACKs per credit's worth, so that the sender's window
    stays near full rather than emptying to half between grants - beside a TCP flow's
    standing queue, two per credit left boundedloss 38% of the link, four 47-53%
    (BENCHMARKS.md, fairness) - or the message's own ``ack_every`` where that is more
    often."""
    return max(1, min(ack_every, credit // 4))


class CreditGrants:
    """A receiving endpoint's credit budget, and which of its heard receives hold a
    share of it.

    Every heard receive gets ``share`` = budget / heard, down to ``MIN_SHARE``; past
    that, receives heard later are *parked* (credit 0, ``counts.parked``) until one
    holding credit is done - its sender's first pass over (its FINAL PROBE) or closed -
    and are then granted in the order they were heard, each by an ACK of its own."""

    __slots__ = ("_granted", "_parked", "_phase", "budget", "drain", "listener", "share")

    def __init__(self, budget: int, *, adaptive: bool = False):
        """``adaptive``: the budget is the receiver's own, sized from the overflows it
        sees (protocol/drain.py), ``budget`` its floor; else ``budget`` is fixed."""
        if budget < MIN_SHARE:
            raise ValueError(f"a credit budget holds at least {MIN_SHARE} datagrams")
        #: sizes the budget from what each phase measured (None: a fixed budget)
        self.drain = DrainBudget(budget) if adaptive else None
        #: DATA datagrams all senders toward this endpoint may have in flight together
        self.budget = budget if self.drain is None else self.drain.budget
        #: what each receive holding credit grants in its ACKs now
        self.share = self.budget
        self._phase: _Phase | None = None  # (adaptive; None between phases)
        self._granted: set[int] = set()  # transfer ids of the receives holding credit
        # the parked receives, in the order they were heard: transfer id -> receive
        self._parked: OrderedDict[int, MessageReceiver] = OrderedDict()
        #: told each new share (a compiled data path stamps it on the ACKs it builds)
        self.listener: Callable[[int], None] | None = None

    @property
    def heard(self) -> int:
        """Receives sharing the budget: holding credit or parked."""
        return len(self._granted) + len(self._parked)

    @property
    def parked(self) -> int:
        return len(self._parked)

    def credit(self, receive: MessageReceiver) -> int:
        """What ``receive``'s ACKs grant its sender now."""
        return 0 if receive.counts.parked else self.share

    def receive_heard(self, receive: MessageReceiver) -> None:
        """``receive``'s first datagram came: from now on it shares the budget."""
        tid = receive.transfer_id
        if tid in self._granted or tid in self._parked:
            return
        if self.drain is not None and self._phase is None:
            self._phase = _Phase(receive.counts.first_heard)
        self._set_share(len(self._granted) + len(self._parked) + 1)
        if (len(self._granted) + 1) * self.share <= self.budget:
            self._granted.add(tid)
        else:
            receive.counts.parked = True
            self._parked[tid] = receive

    def receive_done(self, receive: MessageReceiver, now: float) -> list[MessageReceiver]:
        """``receive`` needs no more credit (its sender's first pass is over, or it
        closed, at ``now``): the parked receives that now hold credit, each to be told by
        an ACK."""
        tid = receive.transfer_id
        if tid in self._granted:
            self._granted.discard(tid)
        elif self._parked.pop(tid, None) is not None:
            receive.counts.parked = False
        else:
            return []
        if self._phase is not None:
            self._phase_step(receive, now)
        self._set_share(max(1, len(self._granted) + len(self._parked)))
        unparked = []
        while self._parked and (len(self._granted) + 1) * self.share <= self.budget:
            tid, waiting = self._parked.popitem(last=False)
            waiting.counts.parked = False
            self._granted.add(tid)
            unparked.append(waiting)
        return unparked

    def _phase_step(self, receive: MessageReceiver, now: float) -> None:
        """Count what ``receive`` took into the phase; at the phase's end (no receive
        shares the budget any more), the budget DrainBudget makes of it."""
        assert self.drain is not None and self._phase is not None
        phase = self._phase
        phase.datagrams += receive.counts.datagrams
        phase.sent += receive.counts.max_tseq + 1
        rtt = receive.path.rtt
        if rtt is not None and (phase.rtt is None or rtt.srtt < phase.rtt):
            phase.rtt = rtt.srtt
        if self._granted or self._parked:
            self.budget = self.drain.phase_so_far(phase.datagrams, phase.sent, phase.rtt)
            return
        self._phase = None
        self.budget = self.drain.phase_ended(phase.datagrams, phase.sent, now - phase.start,
                                             phase.rtt)

    def _set_share(self, heard: int) -> None:
        share = max(MIN_SHARE, self.budget // heard)
        if share != self.share:
            self.share = share
            if self.listener is not None:
                self.listener(share)
