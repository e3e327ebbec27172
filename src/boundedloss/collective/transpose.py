"""TransposeAllreduce: reduce-scatter to shard owners, then all-gather (two rounds).

The OptiReduce / 2507.07114 topology. The vector is cut into ``world_size`` contiguous
shards; rank r owns shard r. Every rank sends shard j to rank j, each owner aggregates
its shard from whatever arrived (the job's policy and aggregator), then sends the
reduced shard to every other rank - reliably, or with ``stale_broadcast`` under the
same bound, a missing value keeping its previous one (bounded drift). Received reliably,
the shards land where the result is gathered (each receive writes into its piece of the
round's output array, posted a round ahead into the next round's): no buffer of their
own, no copy.

Each half also runs on its own, for a sharded model (FSDP2) whose gradients are
reduce-scattered and whose parameters are all-gathered at different times:
:meth:`TransposeAllreduce.reduce_scatter_mean` (this rank's shard of the mean, over the
contributions that arrived) and :meth:`TransposeAllreduce.all_gather` (every rank's
shard, a missing piece keeping the last value that arrived). A half's rounds are its
bucket's own: give the two halves different buckets.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from concurrent.futures import Future

import numpy as np

from .. import wire
from .base import PULL, PUSH, Collective, Posted, RoundStats, Tally, message_id

#: rank -> the (lo, hi) of the piece of a vector that rank owns
Bounds = dict[int, tuple[int, int]]


def shard_bounds(n: int, world_size: int) -> list[tuple[int, int]]:
    """Nearly equal contiguous shards; the first ``n % world_size`` get one more."""
    base, extra = divmod(n, world_size)
    bounds, lo = [], 0
    for r in range(world_size):
        hi = lo + base + (1 if r < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def rotated(ranks: Iterable[int], start: int) -> list[int]:
    """``ranks`` in turn from the first above ``start``, wrapping around. Every rank
    sends its batch in this order (r to r+1, r+2, ...), so that the k-th sends of all
    ranks go to different peers, each once: in rank order, every rank's first datagrams
    would meet at rank 0's port, then at rank 1's - an incast of the whole world at each
    receiver in turn."""
    ordered = sorted(ranks)
    k = bisect.bisect_right(ordered, start)
    return ordered[k:] + ordered[:k]


class TransposeAllreduce(Collective):
    def allreduce_mean(self, x: np.ndarray, round_id: int,
                       bucket: int = 0) -> tuple[np.ndarray, RoundStats]:
        t0 = self._clock()
        n = x.size
        coded = np.ascontiguousarray(self._encode(np.ascontiguousarray(x), round_id, bucket))
        bounds = dict(enumerate(shard_bounds(coded.size, self.world_size)))
        lo, hi = bounds[self.rank]

        # Post (or take the pre-posted) receives for both phases before sending anything.
        scatter_in = self._take_contributions(bucket, round_id, (hi - lo) * coded.itemsize)
        out = self._gather_target((bucket, "gather"), round_id, coded.size, coded.dtype)
        gather_in = self._take_shards(bounds, bucket, round_id, coded.itemsize, into=out)
        sends = self._scatter(coded, bounds, bucket, round_id)

        # Reduce my shard.
        tally = Tally()
        mine = self._reduce(coded[lo:hi], scatter_in, round_id, bucket, "shard", tally,
                            (bucket, "shard"))
        del scatter_in  # (the contributions' buffers, free while the gather runs)

        # All-gather the reduced shards.
        sends += self._broadcast(mine, bucket, round_id)
        self._gather(out, mine, bounds, gather_in, bucket, round_id, tally)
        # (a peer sends its next reduced shard only after this rank's next contribution)
        self._post_shards_ahead(bounds, bucket, round_id, coded)
        tally.rounds = max(tally.rounds, self._wait_sends(sends))
        out_x = self._decode(out, round_id, bucket, n)
        return out_x, tally.stats(round_id, bucket, self._clock() - t0)

    # ---------------------------------------------------------- the halves
    def reduce_scatter_mean(self, x: np.ndarray, round_id: int,
                            bucket: int = 0) -> tuple[np.ndarray, RoundStats]:
        """This rank's shard (``shard_bounds(x.size, world_size)[rank]``) of the mean of
        every rank's ``x``, element by element over the contributions that arrived (the
        job's aggregator: ``unbiased`` divides by their count)."""
        self._whole_vectors_only("reduce-scatter")
        t0 = self._clock()
        x = np.ascontiguousarray(x)
        bounds = dict(enumerate(shard_bounds(x.size, self.world_size)))
        lo, hi = bounds[self.rank]
        scatter_in = self._take_contributions(bucket, round_id, (hi - lo) * x.itemsize)
        sends = self._scatter(x, bounds, bucket, round_id)
        tally = Tally()
        mine = self._reduce(x[lo:hi], scatter_in, round_id, bucket, "shard", tally,
                            (bucket, "shard"))
        tally.rounds = max(tally.rounds, self._wait_sends(sends))
        return mine, tally.stats(round_id, bucket, self._clock() - t0)

    def all_gather(self, shard: np.ndarray, round_id: int, bucket: int = 0, *,
                   out: np.ndarray | None = None) -> tuple[np.ndarray, RoundStats]:
        """Every rank's ``shard`` (all of one size), in rank order, into ``out`` (or a new
        array). With ``stale_broadcast`` a piece that did not arrive keeps the last value
        that did (``memory[(bucket, "gather<r>")]``: bounded drift), and a shard with no
        last value yet is received reliably; without it, every shard reliably. ``shard``
        may be a view of ``out``'s own piece (FSDP's in-place all-gather)."""
        self._whole_vectors_only("all-gather")
        t0 = self._clock()
        k = shard.size
        bounds = {r: (r * k, (r + 1) * k) for r in range(self.world_size)}
        if out is None:
            out = self._gather_target((bucket, "gather"), round_id, k * self.world_size,
                                      shard.dtype)
        elif out.shape != (k * self.world_size,) or out.dtype != shard.dtype:
            raise ValueError(f"all-gather into {out.shape} {out.dtype}: expected "
                             f"({k * self.world_size},) {shard.dtype}")
        mine = np.ascontiguousarray(shard)
        gather_in = self._take_shards(bounds, bucket, round_id, mine.itemsize,
                                      check_memory=True, into=out)
        sends = self._broadcast(mine, bucket, round_id)
        tally = Tally()
        self._gather(out, mine, bounds, gather_in, bucket, round_id, tally)
        self._guard_round(bucket, round_id, tally)  # (bounded shards are the job's bet)
        self._post_shards_ahead(bounds, bucket, round_id, out)
        tally.rounds = max(tally.rounds, self._wait_sends(sends))
        return out, tally.stats(round_id, bucket, self._clock() - t0)

    def _whole_vectors_only(self, what: str) -> None:
        if self.hadamard is not None:  # (its transform mixes every shard into every other)
            raise ValueError(f"a {what} on its own cannot run with Hadamard dispersion: "
                             "a shard of the transform decodes only with all the others")

    # ----------------------------------------------------------- the steps
    # (``bounds``: rank -> the (lo, hi) of the piece of a vector that rank owns, this
    # rank's own included; ``role``: the memory slots' name for what is gathered)
    def _others(self, ranks: Iterable[int] | None = None) -> list[int]:
        ranks = range(self.world_size) if ranks is None else ranks
        return [r for r in ranks if r != self.rank]

    def _take_contributions(self, bucket: int, round_id: int, nbytes: int,
                            ranks: Iterable[int] | None = None) -> dict[int, Posted]:
        """This round's receives of my shard from every other rank (of ``ranks``)."""
        return self._take_many(dict.fromkeys(self._others(ranks), nbytes), bucket, PUSH,
                               round_id)

    def _take_shards(self, bounds: Bounds, bucket: int, round_id: int, itemsize: int,
                     check_memory: bool = False, role: str = "gather",
                     into: np.ndarray | None = None) -> dict[int, Posted]:
        """This round's receives of every other rank's (reduced) shard; ``check_memory``:
        reliably where no last value of it is remembered; ``into``: the array the
        round gathers them into, which those posted now write into in place where
        results are (``_in_place``)."""
        into = into if self._in_place() else None
        others = {r: b for r, b in bounds.items() if r != self.rank}
        return self._take_many(
            {r: (hi - lo) * itemsize for r, (lo, hi) in others.items()}, bucket, PULL,
            round_id,
            {r: not check_memory or self._remembered((bucket, f"{role}{r}"),
                                                     (hi - lo,)) is not None
             for r, (lo, hi) in others.items()},
            None if into is None else {r: into[lo:hi] for r, (lo, hi) in others.items()})

    def _send_each(self, payloads: Mapping[int, np.ndarray | memoryview], bucket: int, phase: int,
                   round_id: int) -> list[tuple[int, Future]]:
        """Send each other rank in ``payloads`` its payload, all in one batch, in turn
        from the rank after this one (see ``rotated``)."""
        others = rotated(self._others(payloads), self.rank)
        return list(zip(others, self.endpoint.send_many(
            [(self.peers[r], payloads[r]) for r in others],
            message_id=message_id(bucket, phase), round_id=round_id)))

    # (a send holds its payload as a flat byte view: slices of one view of ``x``, and one
    # view of ``mine`` for all, spare a simulated job's millions of sends an array and a
    # view each)
    def _scatter(self, x: np.ndarray, bounds: Bounds, bucket: int,
                 round_id: int) -> list[tuple[int, Future]]:
        """Send every other rank its shard of my ``x``."""
        view, size = wire.as_bytes_view(x), x.itemsize
        return self._send_each({r: view[lo * size:hi * size] for r, (lo, hi) in bounds.items()},
                               bucket, PUSH, round_id)

    def _broadcast(self, mine: np.ndarray, bucket: int, round_id: int,
                   ranks: Iterable[int] | None = None) -> list[tuple[int, Future]]:
        """Send my (reduced) shard to every other rank (of ``ranks``)."""
        ranks = range(self.world_size) if ranks is None else ranks
        return self._send_each(dict.fromkeys(ranks, wire.as_bytes_view(mine)), bucket, PULL,
                               round_id)

    def _gather(self, out: np.ndarray, mine: np.ndarray, bounds: Bounds,
                gather_in: dict[int, Posted], bucket: int, round_id: int,
                tally: Tally, role: str = "gather") -> None:
        """``out``: my shard and every other rank's as it arrived (missing values kept
        from the last round)."""
        lo, hi = bounds[self.rank]
        out[lo:hi] = mine
        for r, posted in gather_in.items():
            rlo, rhi = bounds[r]
            res = self._wait(posted, f"shard from rank {r} (round {round_id}, bucket {bucket})")
            tally.add(res, posted)
            values = self._accept_broadcast(res, rhi - rlo, out.dtype, (bucket, f"{role}{r}"))
            # (a receive that wrote into ``out``'s piece has nothing to copy: the same
            # bounds carve the same piece of an array of one size)
            if posted.into is None or posted.into.base is not out:
                out[rlo:rhi] = values

    def _post_shards_ahead(self, bounds: Bounds, bucket: int, round_id: int,
                           like: np.ndarray, role: str = "gather") -> None:
        """Post next round's receives of every other rank's shard of an array like
        ``like`` - into next round's array of ``role``, where results are gathered in
        place."""
        into = self._post_target_ahead((bucket, role), round_id + 1, like.size, like.dtype,
                                       bounds)
        self._post_ahead({r: (hi - lo) * like.itemsize for r, (lo, hi) in bounds.items()
                          if r != self.rank}, bucket, PULL, round_id + 1, into)
