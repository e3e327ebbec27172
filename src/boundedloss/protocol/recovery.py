"""Recovery: how one send learns the round trip and recovers from lost PROBEs.

A sender asks "what is missing?" with a PROBE and waits for the answer. This object
decides the two things that make that wait short and safe:

- the retransmission timeout: a smoothed round trip and its variation (RFC 6298) from
  PROBE round trips, doubled for each PROBE in a row that went unanswered, but to at most
  ``probe_backoff_limit`` times what the round trips say (a PROBE is one header: sending
  it again costs the network nothing, while unbounded doubling turns a burst of random
  loss into seconds of idle waiting);
- how many copies a PROBE goes in: enough that all of them, or all their answers, are
  lost with chance at most ``probe_miss_target``, given the loss forward (what the last
  pass lost, read against the loss expected before it - ``loss_prior.py`` - or before
  any answer what the ACKs say) and on the way back (the ACKs that did not come, or
  what a receive from this peer saw lately). Each unanswered PROBE doubles the copies
  of the next, up to ``probe_copies_max``.

It also keeps the record of the current pass - the DATA sent since the last answered
PROBE, when it started, and how much of it the answer reported missing - which is
what the loss is measured on. Sans-I/O: the sender feeds it ``now``.
"""

from __future__ import annotations

import functools
import math

from .acks import AckState, loss_with, reverse_with
from .acks import start as start_acks
from .loss_prior import LossPrior, pass_loss
from .path import RttEstimate
from .rtt_prior import RttPrior, rto_for, smoothed
from .types import TransportConfig

#: ``--recovery``: how a lost PROBE, or its lost answer, is recovered, as the
#: ``probe_copies_max`` it sets. ``copies`` (the transport's default): the
#: transport's own - a PROBE goes in as many copies as the measured loss asks, so a
#: loss rarely costs a timeout; ``timeout``: one copy, so a lost PROBE or answer costs a
#: retransmission timeout, as in a transport that recovers by timeouts (the published
#: DBLP baseline evidently does).
RECOVERY_MODES: dict[str, int] = {"copies": TransportConfig().probe_copies_max, "timeout": 1}


def probe_copies_for(recovery: str) -> int:
    """The ``probe_copies_max`` that recovery mode ``recovery`` sets (ValueError for an
    unknown one)."""
    if recovery not in RECOVERY_MODES:
        raise ValueError(f"unknown recovery {recovery!r}; choose from "
                         f"{', '.join(RECOVERY_MODES)}")
    return RECOVERY_MODES[recovery]


def copies_for(q: float, target: float, most: int) -> int:
    """PROBE copies such that all of them (or all their answers) are lost with chance <=
    ``target`` when each is lost with chance ``q``, at most ``most``."""
    if q <= target:
        return 1
    if q >= 1.0:
        return most
    return min(most, math.ceil(math.log(target) / math.log(q)))


@functools.lru_cache(maxsize=256)
def _loss_limit(target: float, most: int, copies: int) -> float:
    """The largest float ``q`` with ``copies_for(q, target, most) <= copies`` (copies_for
    grows with ``q``): bisected over the floats themselves, so that comparing a loss with
    it decides exactly as copies_for would."""
    if copies >= most:
        return 1.0
    if copies < 1:
        return -1.0  # (no loss at all is within it)
    lo, hi = target, 1.0  # copies_for(lo) = 1 <= copies < copies_for(hi)
    while math.nextafter(lo, hi) < hi:
        mid = lo + (hi - lo) / 2
        if not lo < mid < hi:
            break
        if copies_for(mid, target, most) <= copies:
            lo = mid
        else:
            hi = mid
    return lo


class Recovery:
    __slots__ = (
        "_ack_owed_at", "_config", "_copies_sent", "_loss", "_measured", "_min_copies",
        "_more_copies", "_pass_sent", "_pass_started_at", "_prior", "_reply_missing", "_rto",
        "_rto_base", "_rtt_prior", "_rttvar", "_srtt", "acks", "unanswered",
    )

    def __init__(self, config: TransportConfig, rtt: RttEstimate | None = None,
                 reverse_loss: float | None = None, *, ack_every: int | None = None,
                 loss_prior: LossPrior | None = None, acks=None,
                 rtt_prior: RttPrior | None = None):
        """``ack_every``: how many DATA datagrams the receiver takes per ACK
        (``config.ack_every_for`` the message's chunk count; default: a short
        message's). ``loss_prior``: the endpoint's, shared by its sends (default: this
        send's own). ``acks``: a fresh state to keep what the ACKs say in (the compiled
        data path's ``Send``, set up here as an AckState would start; default: an
        AckState). ``rtt_prior``: the endpoint's round trips, shared by its sends - what a
        send with none of its own waits for a PROBE's answer (rtt_prior.py; None: the
        initial RTO)."""
        self._config = config
        self._prior = loss_prior if loss_prior is not None else LossPrior()
        self._rtt_prior = rtt_prior
        #: what the ACKs say (shared with the sender and its window; the loss on the way
        #: back starts from ``reverse_loss``, a receive's hint)
        ack_every = ack_every or config.ack_every_for(0)
        if acks is None:
            acks = AckState(ack_every=ack_every, reverse_hint=reverse_loss or 0.0,
                            loss_limit=config.probe_miss_target)
        else:
            start_acks(acks, ack_every=ack_every, reverse_hint=reverse_loss or 0.0,
                       loss_limit=config.probe_miss_target)
        self.acks = acks
        # Round trips: from earlier messages to this peer when there were any, so that a
        # new message does not start from the conservative initial RTO.
        self._srtt: float | None = None
        self._rttvar = 0.0
        self._rto = config.initial_rto
        if rtt is not None:
            self._srtt, self._rttvar = rtt.srtt, rtt.rttvar
            self._rto = rto_for(self._srtt, self._rttvar, config)
        self._rto_base = self._rto  # what the round trips say; backoff starts from here
        #: PROBEs in a row that got no answer
        self.unanswered = 0
        # the current pass: DATA sent since the last answered PROBE, when its first went,
        # and how many chunks the answer to its PROBE reported missing
        self._pass_sent = 0
        self._pass_started_at: float | None = None
        # when the pass had sent enough DATA to be owed its first ACK
        self._ack_owed_at: float | None = None
        self._reply_missing = 0
        self._measured = False  # an answer has reported chunks missing: loss measured
        self._loss: float | None = None  # what the latest answered pass was read as
        # PROBE copies: the least the last pass's loss calls for, how many went with the
        # PROBE now awaiting its answer, and how many more to send (ACKs behind it)
        self._min_copies = 1
        self._copies_sent = 0
        self._more_copies = 0

    # ------------------------------------------------------------ round trips
    @property
    def rto(self) -> float:
        """The timeout a PROBE sent now waits for its answer."""
        return self._rto

    @property
    def rto_base(self) -> float:
        """The timeout the round trips alone call for (no backoff)."""
        return self._rto_base

    @property
    def srtt(self) -> float | None:
        return self._srtt

    @property
    def rtt_estimate(self) -> RttEstimate | None:
        return None if self._srtt is None else RttEstimate(self._srtt, self._rttvar)

    def probe_timeout(self) -> float:
        """The timeout a PROBE sent now waits for its answer: ``rto``, or - while the
        send has no round trip of its own and none of its PROBEs has timed out - the
        endpoint's, if that is shorter (rtt_prior.py)."""
        if self._srtt is None and self.unanswered == 0 and self._rtt_prior is not None:
            endpoint = self._rtt_prior.rto(self._config)
            if endpoint is not None and endpoint < self._rto:
                self._rto = self._rto_base = endpoint
        return self._rto

    def rtt_sample(self, sample: float) -> None:
        if self._rtt_prior is not None:
            self._rtt_prior.sample(sample)
        self._srtt, self._rttvar = smoothed(self._srtt, self._rttvar, sample)
        self._rto = rto_for(self._srtt, self._rttvar, self._config)
        self._rto_base = self._rto

    def probe_timed_out(self) -> None:
        """The PROBE or its answer was lost: back off, within the limit."""
        cfg = self._config
        self._rto = min(cfg.max_rto, self._rto * 2, self._rto_base * cfg.probe_backoff_limit)
        self.unanswered += 1

    # ------------------------------------------------------------------ passes
    def data_sent(self, now: float, k: int) -> None:
        self._prior.data_sent(k)
        if self._pass_started_at is None:
            self._pass_started_at = now
        self._pass_sent += k
        if self._ack_owed_at is None and self._pass_sent >= self.acks.ack_every:
            self._ack_owed_at = now

    @property
    def pass_started_at(self) -> float | None:
        return self._pass_started_at

    def missing_reported(self, n: int) -> None:
        """A segment of the answer to the PROBE awaiting it reports ``n`` chunks missing."""
        self._reply_missing += n
        self._prior.missing_reported(n)

    def reply_received(self, sample: float) -> tuple[bool, int]:
        """The whole answer came, ``sample`` seconds after its PROBE: learn the round
        trip and the pass's loss, and start a new pass. Returns whether the answer was
        to the first PROBE sent for it (so the pass's time holds no timeout), and how
        many of the pass's datagrams got through."""
        self.rtt_sample(sample)
        # (Karn, as for the RTT: after a repeated PROBE the pass's time also holds the
        # timeouts - a receive posted late, the answers lost - not how fast it drained)
        unrepeated = self.unanswered == 0
        self.unanswered = 0
        self._more_copies = 0
        # The PROBEs that follow cross the same path as the pass just answered, and their
        # answers the way back, so they go in as many copies as that loss calls for.
        self._prior.pass_answered(self._pass_sent)
        if self._pass_sent:
            expected = self._prior.rate() if self._loss is None else self._loss
            q = self._loss = pass_loss(self._reply_missing, self._pass_sent, expected)
            self._min_copies = self.copies_for(1.0 - (1.0 - q) * (1.0 - self.reverse_loss()))
        got = self._pass_sent - self._reply_missing
        self._pass_started_at = None
        self._ack_owed_at = None
        self._pass_sent = 0
        if self._reply_missing:
            self._measured = True
        return unrepeated, got

    @property
    def reply_missing(self) -> int:
        """Chunks the answer to the latest PROBE reported missing."""
        return self._reply_missing

    def stop_received(self, undelivered: int) -> None:
        """A STOP ended the send, with ``undelivered`` of its chunks not delivered: of its
        last pass, at least the rest got through (the undelivered may be lost or still on
        their way: a bound met early reports neither)."""
        self._prior.pass_answered(max(0, self._pass_sent - undelivered))

    # ------------------------------------------------------------ PROBE copies
    def probe_copies(self, now: float, first_pass: bool) -> int:
        """Copies for a PROBE going out now (and it becomes the one awaiting an answer)."""
        self._reply_missing = 0
        if self._unmeasured():
            # No answer has measured the loss yet, but the ACKs may have (a microburst
            # would otherwise cost an RTO right here).
            self._min_copies = max(self._min_copies, self._copies_from_acks(now, first_pass))
        # a repeated PROBE goes in twice the copies of the one that went unanswered
        grow = 2 * self._copies_sent if self.unanswered else 1
        copies = min(self._config.probe_copies_max, max(self._min_copies, grow))
        self._copies_sent = copies
        self._more_copies = 0
        return copies

    def may_carry_probe(self) -> bool:
        """Whether the first PROBE may ride on the first pass's last DATA: this send
        starts from a measured round trip, and nothing was lost lately either way -
        forward, by what the endpoint's sends lost (``LossPrior.quiet``); back, by the
        ACKs and receives.

        A carried PROBE is lost with its DATA, and where that DATA is all the receive
        lacked, no answer comes but the timeout, where a PROBE of its own would have
        been answered (and the close's STOP, if lost, said again). Carried always, under
        loss within the miss target, or cold, rounds of one-datagram messages at 1% loss
        took 2.2-4.3x as long on average, their slowest messages waiting timeouts
        (BENCHMARKS.md, "The first PROBE carried by the last DATA")."""
        return (self._srtt is not None and self._prior.quiet()
                and self.reverse_loss() == 0.0)

    def take_more_copies(self) -> int:
        """Copies of the PROBE awaiting its answer to send now, beyond those already sent."""
        more, self._more_copies = self._more_copies, 0
        self._copies_sent += more
        return more

    @property
    def more_copies_due(self) -> bool:
        return self._more_copies > 0

    def ack_received(self, tseq_seen: int, delivered: int, now: float,
                     after_first_pass_probe: bool) -> None:
        """An ACK: the highest transmission sequence the receiver saw, and the chunks it
        had delivered before that datagram. ``after_first_pass_probe``: a PROBE that
        follows the whole first pass awaits its answer."""
        acks = self.acks
        acks.acks_heard += 1
        if tseq_seen > acks.ack_tseq:
            acks.ack_tseq = tseq_seen
            acks.ack_delivered = delivered
        if after_first_pass_probe and self._unmeasured():
            # The pass was shorter than a round trip, so its PROBE went out before these
            # ACKs could say how lossy the path is; if they call for more copies, send
            # them now rather than wait an RTO for the one that was probably lost.
            self._more_copies = max(0, self._copies_from_acks(now, False) - self._copies_sent)

    def copies_for(self, q: float) -> int:
        """PROBE copies such that all of them (or all their answers) are lost with
        chance <= ``probe_miss_target`` when each is lost with chance ``q``."""
        cfg = self._config
        return copies_for(q, cfg.probe_miss_target, cfg.probe_copies_max)

    def loss_limit(self) -> float:
        """The most loss the ACKs may imply for the PROBE awaiting its answer to need no
        more copies than it went in: ``copies_for(q) <= copies sent`` exactly for ``q``
        up to this (what lets the compiled path take such an ACK, AckState.loss_limit)."""
        cfg = self._config
        return _loss_limit(cfg.probe_miss_target, cfg.probe_copies_max, self._copies_sent)

    def _unmeasured(self) -> bool:
        """No answer has told this send how lossy the path is yet."""
        return not self._measured and self._pass_sent > 0

    @property
    def acks_may_add_copies(self) -> bool:
        """An ACK heard now, with a PROBE that follows the whole first pass awaiting its
        answer (``ack_received``'s ``after_first_pass_probe``), may call for more copies
        of it: no answer has measured the loss yet."""
        return self._unmeasured()

    def _copies_from_acks(self, now: float, first_pass: bool) -> int:
        """PROBE copies for the end of the first pass, from the ACKs it drew.

        The receiver ACKs every ``ack_every`` DATA datagrams, with the highest
        transmission sequence it saw and what it had delivered before that datagram.
        Forward loss: of the first ``tseq + 1`` datagrams, ``delivered + 1`` arrived.
        Reverse loss: up to that one the receiver sent ``(delivered + 1) // ack_every``
        ACKs, we heard ``acks_heard`` (ACKs still in flight come after it, so they do not
        count as lost). A PROBE is answered when it and its answer both get through."""
        acks = self.acks
        if not acks.acks_heard:
            every = acks.ack_every
            copies = self.copies_for(self.reverse_loss())  # (no ACK: just the hint)
            if (not first_pass and self._srtt is not None
                    and self._ack_owed_at is not None
                    and now - self._ack_owed_at > self._rto_base
                    and self._pass_sent >= 2 * every):
                # The whole pass is out, and the first ACK it owed is an RTO late:
                # fewer than ack_every of its datagrams (or none of the ACKs) got
                # through - a microburst of 90% loss, where one copy would cost RTO
                # after RTO. (An ACK late by less may only be behind a busy receiver,
                # as on a CPU-bound host, and copies - each answered - load it more.
                # Not for a PROBE sent because the window is shut, either: there the
                # silence says the receiver is behind.)
                copies = max(copies, self.copies_for(1.0 - every / self._pass_sent))
            # (else nothing to go on but the hint: a short message, or the ACKs may
            # still be on their way)
            return copies
        return self.copies_for(loss_with(acks, acks.acks_heard, acks.ack_tseq, acks.ack_delivered))

    def reverse_loss(self) -> float:
        """The loss on the way back: from the ACKs heard so far (see _copies_from_acks),
        or what a receive from this peer saw lately, whichever is higher. (The ACKs
        alone read low when the one heard last came early in the pass.)"""
        return reverse_with(self.acks, self.acks.acks_heard, self.acks.ack_delivered)
