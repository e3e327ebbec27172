"""ParameterServer: workers push to a server rank, which aggregates and broadcasts back.

The LTP/DBLP topology. The server is rank ``server`` and contributes its own gradient
(it trains too). Pushes are received under the job's policy and aggregated by the job's
aggregator; the broadcast back is reliable (LTP: replicas never diverge) or, with
``stale_broadcast``, bounded by the same policy with missing values keeping their
previous value (bounded drift, 2507.07114 / MLT).

The server does not wait for its broadcast to be acknowledged: a worker that has the
result goes on, and a STOP lost on its way back (a microburst at the server) would
otherwise hold the server - and with it every worker's next round - for an RTO or
more. The sends finish in the background; a failed one is raised in a later round
(once that round's pushes are in); ``close`` waits a while for the last ones.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..protocol import SendResult
from .base import PULL, PUSH, Collective, RoundStats, Tally, message_id

#: the longest close() waits for the last broadcasts to settle
CLOSE_SETTLE_S = 5.0


@dataclass(frozen=True)
class PendingBroadcast:
    """A result the server sent to a worker and has not yet seen acknowledged."""

    round_id: int
    worker: int
    future: Future[SendResult]


class ParameterServer(Collective):
    def __init__(self, *args: Any, server: int = 0, **kw: Any):
        super().__init__(*args, **kw)
        if not 0 <= server < self.world_size:
            raise ValueError(f"server rank {server} outside the world of {self.world_size}")
        self.server = server
        self._broadcasts: dict[int, list[PendingBroadcast]] = {}  # by bucket

    def unacknowledged_broadcasts(self, bucket: int) -> tuple[PendingBroadcast, ...]:
        """The server's broadcasts of ``bucket`` still waiting for their STOP."""
        return tuple(self._broadcasts.get(bucket, ()))

    def allreduce_mean(self, x: np.ndarray, round_id: int,
                       bucket: int = 0) -> tuple[np.ndarray, RoundStats]:
        """The mean of every rank's ``x`` (1-D float array) - as far as it arrived."""
        t0 = self._clock()
        coded = np.ascontiguousarray(self._encode(np.ascontiguousarray(x), round_id, bucket))
        tally = Tally()
        if self.rank == self.server:
            result = self._serve(coded, round_id, bucket, tally)
        else:
            result = self._work(coded, round_id, bucket, tally)
        out = self._decode(result, round_id, bucket, x.size)
        return out, tally.stats(round_id, bucket, self._clock() - t0)

    def _serve(self, coded: np.ndarray, round_id: int, bucket: int, tally: Tally) -> np.ndarray:
        workers = [r for r in range(self.world_size) if r != self.server]
        pushes = self._take_many(dict.fromkeys(workers, coded.nbytes), bucket, PUSH, round_id)
        agg = self._reduce(coded, pushes, round_id, bucket, "push", tally, (bucket, "aggregate"))
        self._settle_broadcasts(bucket, before=round_id - 1)
        # (``agg`` is never written again: it is safe to send from in the background)
        sent = self.endpoint.send_many([(self.peers[w], agg) for w in workers],
                                       message_id=message_id(bucket, PULL), round_id=round_id)
        self._broadcasts.setdefault(bucket, []).extend(
            PendingBroadcast(round_id, w, fut) for w, fut in zip(workers, sent))
        return agg

    def _settle_broadcasts(self, bucket: int, before: int) -> None:
        """Raise for a broadcast that failed; wait for those older than ``before``
        (a worker that pushed this round has last round's result, so those are only
        waiting for a STOP)."""
        pending = deque(self._broadcasts.pop(bucket, []))
        keep: list[PendingBroadcast] = []
        try:
            while pending:
                sent = pending.popleft()
                if sent.future.done() or sent.round_id < before:
                    try:
                        self._wait_sends([(sent.worker, sent.future)])
                    except BaseException:
                        if not sent.future.done():  # (its wait ran out: still going)
                            keep.append(sent)
                        raise
                else:
                    keep.append(sent)
        finally:
            # (those after a failed one stay tracked: close() waits for or cancels them)
            keep += pending
            if keep:
                self._broadcasts[bucket] = keep

    def close(self) -> None:
        """Let the last broadcasts be delivered - for at most ``CLOSE_SETTLE_S`` - then
        cancel what is left and release the posted receives. (A worker that has finished
        its last step has its broadcast; its STOP may be lost at shutdown, and with the
        worker gone nothing would answer the server's PROBEs until the peer timeout.)"""
        deadline = self._clock() + CLOSE_SETTLE_S
        try:
            for sends in self._broadcasts.values():
                for sent in sends:
                    sent.future.result(timeout=max(0.0, deadline - self._clock()))
        except TimeoutError:
            pass  # not settled in time: cancelled below
        finally:
            for sends in self._broadcasts.values():
                for sent in sends:
                    if not sent.future.done():
                        self.endpoint.cancel(sent.future)
            self._broadcasts.clear()
            super().close()

    def _work(self, coded: np.ndarray, round_id: int, bucket: int, tally: Tally) -> np.ndarray:
        pull = self._take(self.server, bucket, PULL, round_id, coded.nbytes)
        send = self.endpoint.send(self.peers[self.server], coded,
                                  message_id=message_id(bucket, PUSH), round_id=round_id)
        res = self._wait(pull, f"broadcast from server rank {self.server} "
                               f"(round {round_id}, bucket {bucket})")
        tally.add(res, pull)
        self._guard_round(bucket, round_id, tally)  # (a stale broadcast is bounded)
        self._post_ahead({self.server: coded.nbytes}, bucket, PULL, round_id + 1)
        tally.rounds = max(tally.rounds, self._wait_sends([(self.server, send)]))
        return self._accept_broadcast(res, coded.size, coded.dtype, (bucket, "broadcast"))
