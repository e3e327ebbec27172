"""A parameter server over TCP: the baseline LTP measures its incast figure against.

Every worker sends its gradient to rank 0 with gloo's point-to-point ``send`` (one TCP
connection per pair); rank 0 receives them all at once, averages, and sends the average
back to each worker. With many workers pushing into one server through a shallow queue,
TCP's losses turn into retransmission timeouts (Linux's minimum RTO is 200 ms) - the
incast that LTP's 30x is measured against. This is not a boundedloss transport: nothing
is bounded, nothing is authenticated, and it moves exactly what DDP's allreduce would.

``register_tcp_ps(ddp_model)`` installs it as the model's DDP comm hook;
:func:`average_through_server` does one exchange of a plain tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: the rank that aggregates
SERVER_RANK = 0


def average_through_server(tensor: torch.Tensor, group: dist.ProcessGroup | None = None
                           ) -> torch.Tensor:
    """Replace ``tensor`` (contiguous, CPU) by its mean over the group's ranks, through
    rank 0: every other rank sends it there and receives the mean back. Rank 0 posts
    every receive before waiting on any, so the workers' sends arrive together."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return tensor
    if rank == SERVER_RANK:
        parts = [torch.empty_like(tensor) for _ in range(world - 1)]
        _wait([dist.irecv(part, src=r, group=group)
               for r, part in zip(range(1, world), parts, strict=True)])
        for part in parts:
            tensor.add_(part)
        tensor.div_(world)
        _wait([dist.isend(tensor, dst=r, group=group) for r in range(1, world)])
    else:
        dist.send(tensor, dst=SERVER_RANK, group=group)
        dist.recv(tensor, src=SERVER_RANK, group=group)
    return tensor


def _wait(works: list[dist.Work | None]) -> None:
    for work in works:
        if work is not None:  # (None only for a rank outside the group)
            work.wait()


def tcp_ps_hook(state, bucket):  # no annotations: DDP checks them, and ours are strings
    """DDP comm hook ``(None, dist.GradBucket) -> Future[Tensor]``: the bucket averaged
    through the server (synchronously: the baseline does not overlap its exchange with
    the backward pass)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(average_through_server(bucket.buffer()))
    return fut


def register_tcp_ps(ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Make ``ddp_model`` average its gradients through a TCP parameter server at rank 0
    instead of DDP's ring allreduce."""
    ddp_model.register_comm_hook(None, tcp_ps_hook)
