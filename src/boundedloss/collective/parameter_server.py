"""ParameterServer: workers push to a server rank, which aggregates and broadcasts back.

The LTP/DBLP topology. The server is rank ``server`` and contributes its own gradient
(it trains too). Pushes are received under the job's policy and aggregated by the job's
aggregator; the broadcast back is reliable (LTP: replicas never diverge) or, with
``stale_broadcast``, bounded by the same policy with missing values keeping their
previous value (bounded drift, 2507.07114 / MLT).
"""

from __future__ import annotations

import numpy as np

from ..aggregate import apply_broadcast
from .base import PULL, PUSH, Collective, RoundStats, message_id


class ParameterServer(Collective):
    def __init__(self, *args, server: int = 0, **kw):
        super().__init__(*args, **kw)
        if not 0 <= server < self.world_size:
            raise ValueError(f"server rank {server} outside the world of {self.world_size}")
        self.server = server

    def allreduce_mean(self, x: np.ndarray, round_id: int, bucket: int = 0) -> tuple[np.ndarray, RoundStats]:
        """The mean of every rank's ``x`` (1-D float array) - as far as it arrived."""
        t0 = self._clock()
        n = x.size
        coded = self._encode(np.ascontiguousarray(x), round_id, bucket)
        nbytes = coded.nbytes
        if self.rank == self.server:
            out, fractions, reasons, rounds, bound = self._serve(coded, n, round_id, bucket, nbytes)
        else:
            out, fractions, reasons, rounds, bound = self._work(coded, n, round_id, bucket, nbytes)
        stats = RoundStats(
            round_id=round_id, bucket=bucket, latency_s=self._clock() - t0,
            delivered_fraction=float(np.mean(fractions)) if fractions else 1.0,
            min_delivered_fraction=float(np.min(fractions)) if fractions else 1.0,
            retransmit_rounds=rounds, bound=bound, close_reasons=tuple(reasons),
        )
        return out, stats

    def _serve(self, coded, n, round_id, bucket, nbytes):
        workers = [r for r in range(self.world_size) if r != self.server]
        futs = {w: self._take(w, bucket, PUSH, round_id, nbytes, self.policy) for w in workers}
        contributions = [coded]
        masks = [np.ones(coded.size, dtype=bool)]
        fractions, reasons, rounds, bound = [], [], 0, 0.0
        for w in workers:
            res = self._wait(futs[w], f"push from rank {w} (round {round_id}, bucket {bucket})")
            values, mask = self._elements(res, coded.size, coded.dtype)
            contributions.append(values)
            masks.append(mask)
            fractions.append(res.stats.delivered_fraction)
            reasons.append(res.close_reason.name.lower())
            rounds = max(rounds, res.stats.retransmit_rounds)
            bound = max(bound, res.bound)
            # next round's push from w, same size
            self._post_ahead(w, bucket, PUSH, round_id + 1, nbytes, self.policy)
        key = (bucket, "aggregate")
        agg = self.aggregator.aggregate(contributions, masks, previous=self._previous.get(key))
        agg = np.ascontiguousarray(agg, dtype=coded.dtype)
        self._previous[key] = agg
        sends = [
            (w, self.endpoint.send(self.peers[w], agg, message_id=message_id(bucket, PULL),
                                   round_id=round_id))
            for w in workers
        ]
        rounds = max(rounds, self._wait_sends(sends))
        return self._decode(agg, round_id, bucket, n), fractions, reasons, rounds, bound

    def _work(self, coded, n, round_id, bucket, nbytes):
        policy = self._broadcast_policy()
        pull = self._take(self.server, bucket, PULL, round_id, nbytes, policy)
        send = self.endpoint.send(self.peers[self.server], coded, message_id=message_id(bucket, PUSH),
                                  round_id=round_id)
        res = self._wait(pull, f"broadcast from server rank {self.server} "
                               f"(round {round_id}, bucket {bucket})")
        self._post_ahead(self.server, bucket, PULL, round_id + 1, nbytes, policy)
        rounds = self._wait_sends([(self.server, send)])
        values, mask = self._elements(res, coded.size, coded.dtype)
        key = (bucket, "broadcast")
        previous = self._previous.get(key)
        if mask.all():
            result = values.copy()
        else:
            result = apply_broadcast(values, mask, previous if previous is not None
                                     else np.zeros_like(values))
        self._previous[key] = result
        fraction = res.stats.delivered_fraction
        return (self._decode(result, round_id, bucket, n), [fraction],
                [res.close_reason.name.lower()], max(rounds, res.stats.retransmit_rounds),
                res.bound)
