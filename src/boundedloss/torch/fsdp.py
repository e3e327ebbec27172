"""FSDP2's reduce-scatter and all-gather over the bounded-loss transport (arXiv 2507.07114).

    state = boundedloss.torch.register(fully_shard(model), policy="dblp")

``register`` finds every FSDP module (``torch.distributed.fsdp.fully_shard``: the root
and the modules sharded inside it) and gives each a :class:`BoundedReduceScatter` and a
:class:`BoundedAllGather` (``FSDPModule.set_custom_reduce_scatter`` /
``set_custom_all_gather``), on the DDP path's endpoint, policy, loss guard, keys and
state. They run the transpose collective's two halves - in two levels where the world
has them (``collective/two_level.py``: 2(G + N/G - 2) messages a rank a call instead of
2(N - 1), the same shards):

- the reduce-scatter: each shard's owner averages it over the contributions that
  arrived (the job's aggregator; ``unbiased`` divides by their count), so the gradient
  estimate stays unbiased whatever subset arrived;
- the all-gather: each owner sends its parameter shard to every other rank; a missing
  piece keeps the last value that arrived (bounded drift; in two levels the last one
  the step that lost it had, possibly a round older). A shard with no last value yet
  (the first round, or after a checkpoint is loaded) is received reliably.

Module i (in ``model.modules()`` order, the same on every rank) runs its reduce-scatter
as bucket 2i and its all-gather as bucket 2i+1: round counters, receives posted ahead,
memory and the loss guard are per bucket, so no two modules' or phases' rounds mix. (An
all-gather's round counts its calls: two a step for a module resharded after forward.)
The round log's entries say which collective ran; the reduce-scatter's squared norms
are the gradient's shards', summed over the ranks at the epoch end.
FSDP calls both synchronously and reads the result as soon as the call returns; tensors
on an accelerator are exchanged through host copies. The dtype is FSDP's: with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` shards travel as bfloat16 words
(aggregated in float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.fsdp

from ..collective import MemoryKey, TransposeAllreduce, narrow, widen
from .tensors import MESSAGE_DTYPES, as_message, as_tensor

if TYPE_CHECKING:
    from .hook import BoundedLossState

#: FSDP2's module class (None: this torch has no FSDP2)
_FSDP_MODULE: type | None = getattr(torch.distributed.fsdp, "FSDPModule", None)
try:  # the custom-collective interfaces (not exported; their methods are the contract)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import (
        ReduceScatter as _ReduceScatter,
    )
except ImportError:  # pragma: no cover - FSDP2 without the seam: refused at register
    _AllGather = _ReduceScatter = object  # type: ignore[assignment,misc]

#: ``BoundedLossState.topology`` of a job registered on FSDP2 modules (its collective is
#: the transpose allreduce's two halves, in two levels where the world has them; a DDP
#: job's state cannot be loaded into it)
FSDP_TOPOLOGY = "fsdp"

_SEAM = ("set_custom_reduce_scatter", "set_custom_all_gather")


@dataclass(frozen=True)
class ModuleBuckets:
    """The collective's buckets of one FSDP module: one per phase."""

    reduce_scatter: int
    all_gather: int

    @classmethod
    def of(cls, index: int) -> ModuleBuckets:
        return cls(reduce_scatter=2 * index, all_gather=2 * index + 1)


def is_all_gather_slot(key: MemoryKey) -> bool:
    """Whether a memory slot holds an all-gather's last values: parameters, which the
    model's own checkpoint holds (and the first all-gather after a load is reliable), so
    a state_dict leaves them out - they are the whole model on every rank."""
    return key[0] % 2 == 1


def fsdp_modules(model: Any) -> list[Any]:
    """The FSDP2 modules in ``model`` (itself included), in ``modules()`` order; none
    if it has none or this torch has no FSDP2."""
    fsdp_module = _FSDP_MODULE
    if fsdp_module is None or not isinstance(model, torch.nn.Module):
        return []
    return [m for m in model.modules() if isinstance(m, fsdp_module)]


def check_modules(modules: list[Any], world: int) -> None:
    """Refuse, in one line, what the bounded-loss collectives cannot run: a torch whose
    FSDP2 takes no custom collectives, or parameters sharded over a mesh other than the
    process group's ranks (HSDP, 2-D meshes)."""
    if _ReduceScatter is object or not all(hasattr(modules[0], m) for m in _SEAM):
        raise RuntimeError(
            f"torch {torch.__version__}'s FSDP2 takes no custom collectives "
            "(FSDPModule.set_custom_reduce_scatter / set_custom_all_gather): a torch "
            "that has them is needed to register an FSDP2 model")
    for module in modules:
        for name, p in module.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and (mesh.ndim != 1 or mesh.size() != world):
                raise ValueError(
                    f"parameter {name!r} is sharded over a {tuple(mesh.shape)} mesh: the "
                    f"bounded-loss collectives shard over the {world} ranks of the "
                    "process group (a 1-D mesh; HSDP and 2-D meshes are not supported)")


def install(modules: list[Any], state: BoundedLossState) -> None:
    """Give every FSDP module in ``modules`` its bounded-loss reduce-scatter and
    all-gather (``ModuleBuckets.of(i)`` for the i-th)."""
    for i, module in enumerate(modules):
        buckets = ModuleBuckets.of(i)
        module.set_custom_reduce_scatter(BoundedReduceScatter(state, buckets.reduce_scatter))
        module.set_custom_all_gather(BoundedAllGather(state, buckets.all_gather))


class _BoundedComm:
    """What both collectives share: the state, their bucket, its round counter, the
    checks and the allocation (plain tensors: FSDP copies in and out of them)."""

    def __init__(self, state: BoundedLossState, bucket: int):
        self.state = state
        self.bucket = bucket

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _next_round(self) -> int:
        rounds = self.state.rounds
        round_id = rounds.get(self.bucket, 0)
        rounds[self.bucket] = round_id + 1
        return round_id

    def _collective(self, group: Any, dtype: torch.dtype, what: str) -> TransposeAllreduce:
        coll = self.state.collective
        if not isinstance(coll, TransposeAllreduce):
            raise RuntimeError(f"FSDP {what} of bucket {self.bucket}: the state is not "
                               "registered on an FSDP2 model (or is closed)")
        if group is not None and (group.size() != coll.world_size or
                                  group.rank() != coll.rank):
            raise ValueError(
                f"FSDP {what} over a group of {group.size()} ranks (this one rank "
                f"{group.rank()}): registered for rank {coll.rank} of {coll.world_size}")
        if dtype not in MESSAGE_DTYPES:
            raise TypeError(f"FSDP {what} of {dtype} (parameters of mixed dtypes travel as "
                            "bytes): the bounded-loss collectives carry floating point only")
        return coll

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` flat, on the host (a reused pinned copy for an accelerator's tensor)."""
        return self.state.host_buffer(self.bucket, t.detach().reshape(-1))


class BoundedReduceScatter(_BoundedComm, _ReduceScatter):
    """FSDP2's gradient reduce-scatter: this rank's shard of the mean over the
    contributions that arrived (``TransposeAllreduce.reduce_scatter_mean``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, op: Any, async_op: bool = False) -> None:
        state = self.state
        try:
            coll = self._collective(group, input_tensor.dtype, "reduce-scatter")
            # FSDP averages (AVG) in float32 and bfloat16; float16 sums a pre-divided
            # gradient and divides after (SUM): the unbiased sum is world x the mean
            if op == dist.ReduceOp.AVG:
                factor = 1
            elif op == dist.ReduceOp.SUM:
                factor = coll.world_size
            else:
                raise ValueError(f"FSDP reduce-scatter with {op!r}: only averaging and "
                                 "summing are supported (no set_gradient_divide_factor)")
            round_id = self._next_round()
            mean, stats = coll.reduce_scatter_mean(as_message(self._host(input_tensor)),
                                                   round_id, self.bucket)
            wide = widen(mean)
            result = mean if factor == 1 else narrow(wide * np.float32(factor), mean.dtype)
            output_tensor.detach().copy_(
                as_tensor(result, output_tensor.dtype).view(output_tensor.shape))
            state.record(stats, float(np.dot(wide, wide)), collective="reduce_scatter")
        except BaseException as e:
            state.failure = e
            raise
        return None  # (done: FSDP reads the output as soon as this returns)


class BoundedAllGather(_BoundedComm, _AllGather):
    """FSDP2's parameter all-gather: every rank's shard, a missing piece keeping its
    last value (``TransposeAllreduce.all_gather``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, async_op: bool = False) -> None:
        state = self.state
        try:
            coll = self._collective(group, input_tensor.dtype, "all-gather")
            round_id = self._next_round()
            mine = as_message(self._host(input_tensor))  # (on the CPU: a view of output's)
            on_host = output_tensor.device.type == "cpu" and output_tensor.is_contiguous()
            out = as_message(output_tensor.detach().view(-1)) if on_host else None
            full, stats = coll.all_gather(mine, round_id, self.bucket, out=out)
            if not on_host:  # (into output itself: a non-contiguous one's reshape is a copy)
                output_tensor.copy_(
                    as_tensor(full, output_tensor.dtype).view(output_tensor.shape))
            state.record(stats, None, collective="all_gather")
        except BaseException as e:
            state.failure = e
            raise
        return None

