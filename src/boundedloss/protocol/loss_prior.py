"""How a pass's loss is read: against what was expected before it.

After a pass's answer, the next PROBE goes in as many copies as the pass's loss calls
for (``recovery.py``). A short pass measures its loss poorly: a message of one datagram
that lost it reads as a path that loses everything, and its next PROBE went in 32
copies, each answered by a STOP. Under an incast - a reduce-scatter of one-datagram
shards among 1,024 ranks, where a sixth of the first pass is dropped at the receivers'
queues - those copies were most of what crossed the network, and crowded the same
queues further.

So a pass's loss is read as if it had also sent ``PRIOR_DATAGRAMS`` datagrams that met
the loss expected before it (a Beta prior's posterior mean, :func:`pass_loss`): for a
send's first answered pass, what the endpoint's sends lost lately over every peer
(:class:`LossPrior`); for each later one, what the send's previous pass was read as. One
datagram lost of one, where a sixth of what the endpoint sent lately was lost, reads as
a third, not as everything; the short passes at the end of a send inside a microburst
read as the burst its longer passes measured. A long pass's loss is its own (at 100
datagrams the prior moves it by less than four points).
"""

from __future__ import annotations

#: how many datagrams' weight what was expected has against a pass's own measurement
PRIOR_DATAGRAMS = 4
#: the datagrams an endpoint's recent loss is counted over (its counts halve past it)
HORIZON = 4096
#: the DATA datagrams in passes answered lately, at least, before nothing reported
#: missing reads as quiet (none lost of 1,024 puts the loss under 0.3%, by the rule of
#: three; a quarter of the horizon, so that a halving does not undo it at once)
QUIET_EVIDENCE = HORIZON // 4


def pass_loss(missing: int, sent: int, expected: float) -> float:
    """The loss of a pass that sent ``sent`` datagrams, ``missing`` of them reported
    missing, where ``expected`` was the loss expected before it."""
    return (missing + PRIOR_DATAGRAMS * expected) / (sent + PRIOR_DATAGRAMS)


class LossPrior:
    """What an endpoint's sends have lost lately, over every peer (the loss a send's
    first answered pass is read against).

    Counted from every DATA datagram sent and every chunk an answer reported missing: a
    pass that ends well ends with a STOP, not an answer, so counting answered passes
    alone would see only the lossy ones. Its memory is counted in datagrams, not time:
    its counts halve once ``HORIZON`` datagrams have gone. Not checkpointed: the
    network a restarted job meets is another moment's."""

    __slots__ = ("answered", "missing", "sent")

    def __init__(self) -> None:
        self.sent = 0.0  # DATA datagrams sent lately
        self.missing = 0.0  # of those, what answers reported missing
        self.answered = 0.0  # of those, the ones in passes answered (a BITMAP or a STOP)

    def data_sent(self, k: int) -> None:
        self.sent += k
        if self.sent > HORIZON:
            self.sent /= 2
            self.missing /= 2
            self.answered /= 2

    def missing_reported(self, n: int) -> None:
        self.missing += n

    def pass_answered(self, k: int) -> None:
        """A pass of ``k`` DATA datagrams was answered: what it lost, if anything, has
        been reported."""
        self.answered += k

    def quiet(self) -> bool:
        """Nothing lost lately: at least ``QUIET_EVIDENCE`` DATA datagrams in answered
        passes, and under half a datagram's weight of what answers reported missing left
        after the halvings (one lost datagram is forgotten two halvings on).

        Only an answered pass is evidence: a pass still in flight has reported nothing
        yet, lost or not. Read from what was sent, a cold round at 256 workers under 1%
        loss read as quiet when its second phase began, before the first's losses were
        answered; its carried PROBEs, lost with their DATA, waited the first timeout (a
        round of 201 ms against 153, BENCHMARKS.md)."""
        return self.missing < 0.5 and self.answered >= QUIET_EVIDENCE

    def rate(self) -> float:
        """The fraction of what was sent lately that answers reported missing."""
        return min(1.0, self.missing / self.sent) if self.sent else 0.0
