"""TwoLevelAllreduce: the transpose allreduce done twice, in groups and then across them,
so that a rank handles 2(G + N/G - 2) messages a round instead of 2(N - 1).

The transpose allreduce sends every rank a message from every other rank in each of its
two halves; each message costs a rank the same CPU whatever its size, so past a few
dozen ranks a round is its messages (4,092 a rank at 1,024). Here the world is cut into
groups of ``G`` consecutive ranks (rank ``r`` is member ``r % G`` of group ``r // G``;
consecutive ranks usually share a rack, so the bulk of the bytes stays in it):

1. reduce-scatter within the group: member ``k`` aggregates shard ``k`` of the vector
   from its group (``G - 1`` messages in);
2. reduce-scatter across the groups, among the ranks that are member ``k`` of theirs:
   group ``j``'s one aggregates piece ``j`` of shard ``k`` (``N/G - 1`` in);
3. all-gather of those pieces across the groups: shard ``k`` of the mean, whole;
4. all-gather of the shards within the group: the whole mean.

The bytes a rank sends are the transpose's (``1 - 1/N`` of the vector each way); the
messages are ``2(G - 1) + 2(N/G - 1)``, fewest near ``G = sqrt(N)`` (124 at 1,024 ranks
instead of 2,046, in each direction). Every phase's receives are posted before the first
send and one round ahead, as the transpose's.

Under loss each reduce aggregates what arrived, under the job's policy and aggregator:
step 1 makes each group's mean of what arrived, step 2 the mean of the groups' means -
the mean of every rank's vector, since the groups are equal (with the ``unbiased``
aggregator each group's mean is an unbiased estimate of its true mean, so theirs is of
the whole). A value lost in step 1 leaves its group's mean over fewer ranks; one lost in
step 2 leaves out a whole group's. The loss guard watches step 1's receives (the ranks'
own gradients), and its decision holds for both. The bounded broadcasts (steps 3 and 4,
``stale_broadcast``) keep a missing value's previous one, each in its own memory slot.

The halves a sharded model runs apart (FSDP2: ``reduce_scatter_mean``, ``all_gather``)
go in two levels too, with shard ``r`` of the vector at rank ``r`` as the transpose's
halves leave it: member ``k`` of every group stands for the shards of the ranks at
place ``k`` in theirs (its column), so the reduce-scatter's first step sends each group
member those shards packed together (a copy of the vector, once), and its second hands
each column-mate its own; the all-gather runs the same steps backwards and unpacks. In
a bounded all-gather a value lost at either step keeps what that step had last: an
earlier round's value, which may be older than the one this rank had last.

``N`` with no divisor between 2 and ``N/2`` (a prime, or fewer than 4 ranks) has no two
levels: every call is the transpose allreduce's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import PUSH, RoundStats, Tally
from .transpose import TransposeAllreduce, shard_bounds


def default_group_size(world_size: int) -> int:
    """The group size that makes a rank's messages fewest: the divisor of ``world_size``
    nearest its square root from above (the larger of the pair keeps more of the bytes
    within a group); ``world_size`` itself where there is none (one level)."""
    for g in range(math.isqrt(world_size - 1) + 1, world_size // 2 + 1):
        if world_size % g == 0:
            return g
    return world_size


def messages_per_round(world_size: int, group_size: int | None = None) -> int:
    """The messages a rank sends in a round of the two-level allreduce (and receives):
    2(G + N/G - 2), or the transpose's 2(N - 1) where there are no two levels."""
    size = default_group_size(world_size) if group_size is None else group_size
    if not 1 < size < world_size:
        return 2 * (world_size - 1)
    return 2 * (size - 1 + world_size // size - 1)


class TwoLevelAllreduce(TransposeAllreduce):
    def __init__(self, *args: Any, group_size: int | None = None, **kw: Any):
        super().__init__(*args, **kw)
        n = self.world_size
        size = default_group_size(n) if group_size is None else group_size
        if not 1 <= size <= n or n % size:
            raise ValueError(f"group size {size} does not divide a world of {n} ranks")
        self.group_size = size
        group, member = divmod(self.rank, size)
        #: the ranks of this rank's group, in member order
        self.group = [group * size + k for k in range(size)]
        #: the ranks that are the same member of their groups, in group order
        self.column = [j * size + member for j in range(n // size)]

    @property
    def two_levels(self) -> bool:
        return len(self.group) > 1 and len(self.column) > 1

    @property
    def messages_per_round(self) -> int:
        """The messages this rank sends in a round (and receives)."""
        return messages_per_round(self.world_size, self.group_size)

    def allreduce_mean(self, x: np.ndarray, round_id: int,
                       bucket: int = 0) -> tuple[np.ndarray, RoundStats]:
        if not self.two_levels:
            return super().allreduce_mean(x, round_id, bucket)
        t0 = self._clock()
        n = x.size
        coded = np.ascontiguousarray(self._encode(np.ascontiguousarray(x), round_id, bucket))
        itemsize = coded.itemsize
        # member k of the group owns shard k of the vector; in the column, group j's
        # member owns piece j of that shard
        shards = dict(zip(self.group, shard_bounds(coded.size, len(self.group))))
        lo, hi = shards[self.rank]
        pieces = dict(zip(self.column, shard_bounds(hi - lo, len(self.column))))
        plo, phi = pieces[self.rank]

        # Post (or take the pre-posted) receives of all four steps before sending anything.
        shard_in = self._take_contributions(bucket, round_id, (hi - lo) * itemsize, self.group)
        piece_in = self._take_contributions(bucket, round_id, (phi - plo) * itemsize,
                                            self.column)
        shard = self._gather_target((bucket, "piece"), round_id, hi - lo, coded.dtype)
        out = self._gather_target((bucket, "gather"), round_id, coded.size, coded.dtype)
        pieces_in = self._take_shards(pieces, bucket, round_id, itemsize, role="piece",
                                      into=shard)
        shards_in = self._take_shards(shards, bucket, round_id, itemsize, role="gather",
                                      into=out)
        sends = self._scatter(coded, shards, bucket, round_id)

        tally = Tally()
        # 1. my shard, over my group
        group_mean = self._reduce(coded[lo:hi], shard_in, round_id, bucket, "shard", tally,
                                  (bucket, "shard"))
        del shard_in  # (the contributions' buffers, free from here)
        sends += self._scatter(group_mean, pieces, bucket, round_id)
        # 2. my piece of it, over the groups
        mine = self._reduce(group_mean[plo:phi], piece_in, round_id, bucket, "piece", tally,
                            (bucket, "piece"), guard=False)
        del piece_in
        # 3. my shard of the mean, from the pieces
        sends += self._broadcast(mine, bucket, round_id, self.column)
        self._gather(shard, mine, pieces, pieces_in, bucket, round_id, tally, role="piece")
        # 4. the mean, from my group's shards
        sends += self._broadcast(shard, bucket, round_id, self.group)
        self._gather(out, shard, shards, shards_in, bucket, round_id, tally)
        self._post_shards_ahead(pieces, bucket, round_id, shard, role="piece")
        self._post_shards_ahead(shards, bucket, round_id, out)
        tally.rounds = max(tally.rounds, self._wait_sends(sends))
        out_x = self._decode(out, round_id, bucket, n)
        return out_x, tally.stats(round_id, bucket, self._clock() - t0)

    # ---------------------------------------------------------- the halves
    def _columns(self, regions: list[tuple[int, int]]) -> dict[int, list[tuple[int, int]]]:
        """Group member rank -> the regions of its column (every group's rank at its place
        in theirs), in group order: what it stands for in the first step."""
        size = len(self.group)
        return {r: [regions[j * size + k] for j in range(len(self.column))]
                for k, r in enumerate(self.group)}

    def reduce_scatter_mean(self, x: np.ndarray, round_id: int,
                            bucket: int = 0) -> tuple[np.ndarray, RoundStats]:
        if not self.two_levels:
            return super().reduce_scatter_mean(x, round_id, bucket)
        self._whole_vectors_only("reduce-scatter")
        t0 = self._clock()
        x = np.ascontiguousarray(x)
        regions = shard_bounds(x.size, self.world_size)
        columns = self._columns(regions)
        # (a column's regions back to back; in it, group j's rank's region is piece j)
        packed = {r: np.concatenate([x[lo:hi] for lo, hi in cols]).view(x.dtype)
                  for r, cols in columns.items()}
        starts = np.cumsum([0] + [hi - lo for lo, hi in columns[self.rank]])
        pieces = {r: (int(starts[j]), int(starts[j + 1])) for j, r in enumerate(self.column)}
        plo, phi = pieces[self.rank]
        column_in = self._take_contributions(bucket, round_id, packed[self.rank].nbytes,
                                             self.group)
        piece_in = self._take_contributions(bucket, round_id, (phi - plo) * x.itemsize,
                                            self.column)
        sends = self._send_each(packed, bucket, PUSH, round_id)
        tally = Tally()
        column_mean = self._reduce(packed[self.rank], column_in, round_id, bucket, "column",
                                   tally, (bucket, "column"))
        sends += self._scatter(column_mean, pieces, bucket, round_id)
        mine = self._reduce(column_mean[plo:phi], piece_in, round_id, bucket, "shard", tally,
                            (bucket, "shard"), guard=False)
        tally.rounds = max(tally.rounds, self._wait_sends(sends))
        return mine, tally.stats(round_id, bucket, self._clock() - t0)

    def all_gather(self, shard: np.ndarray, round_id: int, bucket: int = 0, *,
                   out: np.ndarray | None = None) -> tuple[np.ndarray, RoundStats]:
        if not self.two_levels:
            return super().all_gather(shard, round_id, bucket, out=out)
        self._whole_vectors_only("all-gather")
        t0 = self._clock()
        k, size, height = shard.size, len(self.group), len(self.column)
        if out is None:
            out = np.empty(k * self.world_size, dtype=shard.dtype)
        elif out.shape != (k * self.world_size,) or out.dtype != shard.dtype:
            raise ValueError(f"all-gather into {out.shape} {out.dtype}: expected "
                             f"({k * self.world_size},) {shard.dtype}")
        mine = np.array(shard)  # (shard may be a view of out's own piece: out is written)
        # my column's shards back to back, then every group member's column
        pieces = {r: (j * k, (j + 1) * k) for j, r in enumerate(self.column)}
        columns = {r: (m * height * k, (m + 1) * height * k) for m, r in enumerate(self.group)}
        column = self._gather_target((bucket, "gather"), round_id, height * k, mine.dtype)
        by_member = self._gather_target((bucket, "column"), round_id, size * height * k,
                                        mine.dtype)
        pieces_in = self._take_shards(pieces, bucket, round_id, mine.itemsize,
                                      check_memory=True, into=column)
        columns_in = self._take_shards(columns, bucket, round_id, mine.itemsize,
                                       check_memory=True, role="column", into=by_member)
        sends = self._broadcast(mine, bucket, round_id, self.column)
        tally = Tally()
        self._gather(column, mine, pieces, pieces_in, bucket, round_id, tally)
        sends += self._broadcast(column, bucket, round_id, self.group)
        self._gather(by_member, column, columns, columns_in, bucket, round_id, tally,
                     role="column")
        self._guard_round(bucket, round_id, tally)  # (bounded shards are the job's bet)
        # (member m's column holds group j's rank m's shard at j: rank j * size + m's)
        out.reshape(height, size, k)[:] = by_member.reshape(size, height, k).transpose(1, 0, 2)
        self._post_shards_ahead(pieces, bucket, round_id, column)
        self._post_shards_ahead(columns, bucket, round_id, by_member, role="column")
        tally.rounds = max(tally.rounds, self._wait_sends(sends))
        return out, tally.stats(round_id, bucket, self._clock() - t0)
