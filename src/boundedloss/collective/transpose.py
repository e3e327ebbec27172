"""TransposeAllreduce: reduce-scatter to shard owners, then all-gather (two rounds).

The OptiReduce / 2507.07114 topology. The vector is cut into ``world_size`` contiguous
shards; rank r owns shard r. Every rank sends shard j to rank j, each owner aggregates
its shard from whatever arrived (the job's policy and aggregator), then sends the
reduced shard to every other rank - reliably, or with ``stale_broadcast`` under the
same bound, a missing value keeping its previous one (bounded drift).
"""

from __future__ import annotations

import numpy as np

from .base import PULL, PUSH, Collective, RoundStats, Tally, message_id


def shard_bounds(n: int, world_size: int) -> list[tuple[int, int]]:
    """Nearly equal contiguous shards; the first ``n % world_size`` get one more."""
    base, extra = divmod(n, world_size)
    bounds, lo = [], 0
    for r in range(world_size):
        hi = lo + base + (1 if r < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class TransposeAllreduce(Collective):
    def allreduce_mean(self, x: np.ndarray, round_id: int,
                       bucket: int = 0) -> tuple[np.ndarray, RoundStats]:
        t0 = self._clock()
        n = x.size
        coded = np.ascontiguousarray(self._encode(np.ascontiguousarray(x), round_id, bucket))
        bounds = shard_bounds(coded.size, self.world_size)
        me = self.rank
        lo, hi = bounds[me]
        itemsize = coded.itemsize
        others = [r for r in range(self.world_size) if r != me]

        # Post (or take the pre-posted) receives for both phases before sending anything.
        scatter_in = {r: self._take(r, bucket, PUSH, round_id, (hi - lo) * itemsize)
                      for r in others}
        gather_in = {r: self._take(r, bucket, PULL, round_id,
                                   (bounds[r][1] - bounds[r][0]) * itemsize)
                     for r in others}
        sends = list(zip(others, self.endpoint.send_many(
            [(self.peers[r], coded[bounds[r][0]:bounds[r][1]]) for r in others],
            message_id=message_id(bucket, PUSH), round_id=round_id)))

        # Reduce my shard.
        tally = Tally()
        mine = self._reduce(coded[lo:hi], scatter_in, round_id, bucket, "shard", tally,
                            (bucket, "shard"))

        # All-gather the reduced shards.
        sends += zip(others, self.endpoint.send_many(
            [(self.peers[r], mine) for r in others], message_id=message_id(bucket, PULL),
            round_id=round_id))
        out = np.empty_like(coded)
        out[lo:hi] = mine
        for r in others:
            rlo, rhi = bounds[r]
            res = self._wait(gather_in[r], f"reduced shard from rank {r} "
                                           f"(round {round_id}, bucket {bucket})")
            tally.add(res, gather_in[r])
            out[rlo:rhi] = self._accept_broadcast(res, rhi - rlo, coded.dtype,
                                                  (bucket, f"gather{r}"))
        # (a peer sends its next reduced shard only after this rank's next contribution)
        self._post_ahead({r: (bounds[r][1] - bounds[r][0]) * itemsize for r in others},
                         bucket, PULL, round_id + 1)
        tally.rounds = max(tally.rounds, self._wait_sends(sends))
        out_x = self._decode(out, round_id, bucket, n)
        return out_x, tally.stats(round_id, bucket, self._clock() - t0)
