"""`train --sharded`: a rank's model sharded with FSDP2 (``fully_shard``) instead of DDP.

Every submodule with at least :data:`MIN_SHARD_PARAMETERS` parameters of its own (the
shipped models' Linear, Conv2d, Embedding and GRU layers) becomes an FSDP unit of its
own, then the root, which takes the rest (BatchNorm's few); the mesh is 1-D over the
world's gloo process group, on the CPU or on the rank's GPU alike. bf16 is FSDP2's
mixed precision: float32 master parameters (what the optimizer steps), bfloat16 for the
forward and backward passes and for the gradients' reduce-scatter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: a submodule with fewer parameters of its own stays with the root (a unit of its own
#: would cost two collectives a step for a few hundred bytes)
MIN_SHARD_PARAMETERS = 1024


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules of ``model`` (not itself) that get an FSDP unit of their own."""
    return [m for m in model.modules() if m is not model
            and sum(p.numel() for p in m.parameters(recurse=False)) >= MIN_SHARD_PARAMETERS]


def shard(model: torch.nn.Module, device: torch.device, reduce_dtype: torch.dtype,
          ) -> torch.nn.Module:
    """``model`` (on ``device``, float32) sharded over the world: its units, then the root;
    parameters and gradients in ``reduce_dtype`` for the passes and the reduce-scatter
    (float32: no mixed precision). Collective: every rank calls it alike."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # (a full-world 1-D mesh is the default process group itself: gloo, on cuda too)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mixed = (MixedPrecisionPolicy() if reduce_dtype == torch.float32 else
             MixedPrecisionPolicy(param_dtype=reduce_dtype, reduce_dtype=reduce_dtype))
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=mixed)
    fully_shard(model, mesh=mesh, mp_policy=mixed)
    return model
