"""Every rank's hook state in one checkpoint, for frameworks whose checkpoint rank 0
writes alone (Lightning's, Accelerate's ``save_state``): each rank's hook state is its
own (memory, paths), so rank 0 gathers them all, and each rank loads back its own.

    accelerator.register_for_checkpointing(boundedloss.torch.EveryRankState(state))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from .hook import BoundedLossState

#: what ``EveryRankState.state_dict()`` writes under "format" (and load reads)
EVERY_RANK_FORMAT = "boundedloss.every_rank/1"


class EveryRankState:
    """A registered :class:`BoundedLossState` seen as the whole job's: ``state_dict()``
    (collective: every rank calls it, as frameworks do when they checkpoint) gathers
    every rank's ``state.state_dict()`` on rank 0 - the others return their own only -
    and ``load_state_dict()`` on each rank loads that rank's."""

    def __init__(self, state: BoundedLossState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        own = self.state.state_dict()
        group = self.state.process_group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        first = 0 if group is None else dist.get_global_rank(group, 0)  # gather's dst
        parts: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(own, parts, dst=first, group=group)
        ranks = dict(enumerate(parts)) if parts is not None else {rank: own}
        return {"format": EVERY_RANK_FORMAT, "world_size": world, "ranks": ranks}

    def load_state_dict(self, every: Mapping[str, Any]) -> None:
        """Load this rank's part of ``every``; a one-line ``ValueError`` (and nothing
        loaded) when it is not such a dict or lacks this rank's."""
        self.state.load_state_dict(own_state_dict(every, self.state.rank))


def own_state_dict(every: Mapping[str, Any], rank: int | None) -> Mapping[str, Any]:
    """Rank ``rank``'s hook state_dict out of an :meth:`EveryRankState.state_dict`."""
    if not isinstance(every, Mapping) or every.get("format") != EVERY_RANK_FORMAT:
        found = every.get("format") if isinstance(every, Mapping) else type(every).__name__
        raise ValueError(f"not every rank's boundedloss hook state (format {found!r}, "
                         f"expected {EVERY_RANK_FORMAT!r})")
    ranks = every.get("ranks")
    if not isinstance(ranks, Mapping) or rank not in ranks:
        held = sorted(ranks) if isinstance(ranks, Mapping) else []
        raise ValueError(f"this checkpoint holds the hook state of ranks {held}, not of "
                         f"rank {rank} (a world of {every.get('world_size')})")
    return ranks[rank]
