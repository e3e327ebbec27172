"""AckState: what a send's ACKs update, in one object.

A receiver ACKs every ``ack_every`` DATA datagrams with the highest transmission
sequence it has seen and the chunks it had delivered. To the sender an ACK is
bookkeeping: the peer is alive (``last_heard``), how much it reported
(``reported_delivered``), what recovery reads the loss from (``acks_heard``,
``ack_tseq``, ``ack_delivered``) and how far the flow-control window has moved
(``acked``, ``next_tseq``, ``blocked_since``; and ``credit``, how far the receiver lets
it open, protocol/credit.py). Recovery, the window and the sender all
read and write this one object, so that the compiled data path can hold it instead
(its ``Send``, the same fields) and take the ACKs itself.

Only where an ACK may call for a decision does it go to the Python core: the sender
says when (``in_python``, ``check_loss``, see ``MessageSender._share_ack_flags``), and
the compiled path hands such an ACK back untouched.
"""

from __future__ import annotations

#: the fields, as the compiled path's Send names them
ACK_FIELDS = (
    "last_heard", "reported_delivered", "acks_heard", "ack_tseq", "ack_delivered", "acked",
    "next_tseq", "blocked_since", "ack_every", "reverse_hint", "loss_limit", "in_python",
    "check_loss", "credit", "granted_least",
)


class AckState:
    __slots__ = ACK_FIELDS

    last_heard: float
    reported_delivered: int
    acks_heard: int
    ack_tseq: int
    ack_delivered: int
    acked: int
    next_tseq: int
    blocked_since: float | None
    credit: int
    granted_least: int
    ack_every: int
    reverse_hint: float
    loss_limit: float
    in_python: bool
    check_loss: bool

    def __init__(self, *, ack_every: int, reverse_hint: float, loss_limit: float):
        start(self, ack_every=ack_every, reverse_hint=reverse_hint, loss_limit=loss_limit)


def loss_with(acks, acks_heard: int, ack_tseq: int, ack_delivered: int) -> float:
    """The loss a PROBE and its answer would meet, from ACK counters (forward: of the
    first ``ack_tseq + 1`` datagrams ``ack_delivered + 1`` arrived; back: the ACKs heard
    of those owed, or the hint if higher), against ``acks``' ack_every and hint (an
    AckState or the compiled path's Send). Recovery's reading, written once here: the
    compiled path computes exactly this, operation for operation."""
    q_fwd = 1.0 - min(1.0, (ack_delivered + 1) / (ack_tseq + 1))
    return 1.0 - (1.0 - q_fwd) * (1.0 - reverse_with(acks, acks_heard, ack_delivered))


def reverse_with(acks, acks_heard: int, ack_delivered: int) -> float:
    """The loss on the way back: of the ACKs owed up to ``ack_delivered``, those not
    heard - or the hint, if higher (or alone, before any ACK)."""
    if not acks_heard:
        return acks.reverse_hint
    sent = max(1, (ack_delivered + 1) // acks.ack_every)
    return max(acks.reverse_hint, 1.0 - min(1.0, acks_heard / sent))


def start(acks, *, ack_every: int, reverse_hint: float, loss_limit: float) -> None:
    """Set ``acks`` (an AckState, or a fresh Send of the compiled path) as a send starts.
    (Written out: a send's post pays for it, and a loop of setattr costs twice as much.)"""
    acks.last_heard = 0.0  # when the receiver was last heard from
    acks.reported_delivered = 0  # chunks the receiver said it had, latest word
    # recovery's: ACKs heard, and the highest tseq one reported with what it had
    # delivered then
    acks.acks_heard = 0
    acks.ack_tseq = -1
    acks.ack_delivered = 0
    # the window's: every tseq below ``acked`` has arrived or is lost; the next DATA
    # goes as ``next_tseq``; since when the window has been shut (None: open)
    acks.acked = 0
    acks.next_tseq = 0
    acks.blocked_since = None
    # DATA datagrams the receiver lets us have in flight beyond the highest it has
    # seen: its latest grant (an ACK with Flag.CREDIT), or what the send started from
    acks.credit = 1 << 62
    # the least credit an ACK granted (-1: none did): a next message to the peer
    # starts from it (PeerPath.granted)
    acks.granted_least = -1
    # what the loss from the ACKs is read against (recovery's, fixed for the send)
    acks.ack_every = ack_every
    acks.reverse_hint = reverse_hint
    # the most loss the ACKs may imply for recovery's answer to an ACK to be "no more
    # copies" of the PROBE awaiting its answer (Recovery.loss_limit)
    acks.loss_limit = loss_limit
    # every ACK goes to the Python core (a decision may hang on any of them)
    acks.in_python = False
    # an ACK goes to the Python core unless the loss the ACKs imply with it stays at or
    # below ``loss_limit``
    acks.check_loss = False
