"""Run by test_torch.py: N ranks compare the hook's gradients with Gloo allreduce's.

Each rank builds two identical models (in float32, float16 or bfloat16), one under plain
DDP (Gloo allreduce) and one with boundedloss.torch.register(..., policy="reliable"),
runs the same batches through both and checks the averaged gradients match - exactly
in float32; in 16 bits within a rounding of each other (the hook averages in float32,
Gloo in the bucket's dtype). Exit code 0 on success.
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rank_exit import ends_with_os_exit


@ends_with_os_exit
def rank_main(rank, world, port, topology, dtype_name):
    dtype = getattr(torch, dtype_name)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import boundedloss.torch as bl

    torch.manual_seed(0)

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(64, 2000), torch.nn.ReLU(),
                                   torch.nn.Linear(2000, 10))

    net, twin = mlp().to(dtype), mlp().to(dtype)
    twin.load_state_dict(net.state_dict())
    cap = 0.05 * torch.finfo(dtype).bits / 32  # several buckets in flight, in any dtype
    gloo = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap)
    ours = torch.nn.parallel.DistributedDataParallel(twin, bucket_cap_mb=cap)
    # chunks that do not divide a float's bytes evenly: floats cut at chunk edges too
    transport = bl.hook_transport(chunk_bytes=1202, receive_deadline=10)
    frozen = gc.get_freeze_count()
    state = bl.register(ours, "reliable", topology=topology, transport=transport)
    assert state.endpoint.config == transport and state.transport is transport
    # the model, torch's objects: out of later full collections (the I/O thread's GIL)
    assert gc.get_freeze_count() > frozen + 1000
    g = torch.Generator().manual_seed(rank)
    worst = 0.0
    for step in range(4):
        x = torch.randn(16, 64, generator=g).to(dtype)
        y = torch.randint(0, 10, (16,), generator=g)
        for m in (gloo, ours):
            m.zero_grad()
            torch.nn.functional.cross_entropy(m(x).float(), y).backward()
        for a, b in zip(net.parameters(), twin.parameters()):
            assert a.grad.dtype == b.grad.dtype == dtype
            # a few roundings of the dtype apart: Gloo sums in it, the hook in float32
            ulp = {torch.float32: 1e-5, torch.float16: 2 ** -8, torch.bfloat16: 2 ** -5}[dtype]
            scale = float(a.grad.float().abs().max())
            if not torch.allclose(a.grad.float(), b.grad.float(), rtol=ulp,
                                  atol=ulp * scale + 1e-7):
                print(f"rank {rank} step {step}: max diff {(a.grad - b.grad).abs().max()}")
                sys.exit(3)
            worst = max(worst, float((a.grad.float() - b.grad.float()).abs().max()))
        with torch.no_grad():  # take the same step on both (from Gloo's gradient, so
            for a, b in zip(net.parameters(), twin.parameters()):  # 16-bit roundings
                a -= 0.1 * a.grad                                  # do not compound)
                b.copy_(a)
    buckets = len({e["bucket"] for e in state.round_log})
    assert buckets >= 2, f"expected several buckets in flight, saw {buckets}"
    state.close()
    dist.destroy_process_group()
    print(f"rank {rank}: ok, worst abs diff {worst:.3g}, buckets {buckets}")


if __name__ == "__main__":
    world, port, topology = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dtype_name = sys.argv[4] if len(sys.argv) > 4 else "float32"
    mp.start_processes(rank_main, args=(world, port, topology, dtype_name), nprocs=world,
                       start_method="spawn")
