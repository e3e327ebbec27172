"""Run by test_torch.py: 2 ranks over Gloo check the hook's loss guard and state_dict on
real UDP loopback endpoints.

Rank 0 (the parameter server) loses half of what reaches it in rounds 0-3; the job runs
MLT at 5% with the guard as register() sets it by default (3 rounds). Its round log must
show the guard engage after round 2, hold rounds 3 and 4 (every chunk delivered), and
release once round 4 is clean. Then every rank's state_dict() goes through torch.save
and torch.load (weights_only) into a second registered model, whose live collective and
endpoint must then hold the same round counters, memory, guard and paths, and continue
from those round counters; a state_dict of another topology is refused in one line and
changes nothing; and a pickled state registered again keeps them too. Exit code 0 on
success; prints "rank R: ok".
"""

import io
import os
import pickle
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rank_exit import ends_with_os_exit

ROUNDS = 6


@ends_with_os_exit
def rank_main(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import boundedloss.torch as bl
    from boundedloss.net.loss import Microburst

    def model():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 500), torch.nn.ReLU(),
                                  torch.nn.Linear(500, 10))
        return torch.nn.parallel.DistributedDataParallel(net)

    def step(ddp, g):
        ddp.zero_grad()
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()

    transport = bl.hook_transport(chunk_bytes=1400, receive_deadline=10)
    burst = Microburst(0.5, rounds=range(4), seed=rank) if rank == 0 else None
    ddp = model()
    # (a parameter server's job, named: the default at 2 ranks is the transpose allreduce)
    state = bl.register(ddp, "mlt", p=0.05, topology="ps", transport=transport, loss=burst)
    assert state.guard == bl.LossGuard(), state.guard  # on by default for a bounded policy
    g = torch.Generator().manual_seed(rank)
    for _ in range(ROUNDS):
        step(ddp, g)
    log = sorted(state.round_log, key=lambda e: e["round"])
    assert [e["round"] for e in log] == list(range(ROUNDS)), log  # (one bucket)
    if rank == 0:
        guarded = [e["guarded"] for e in log]
        assert guarded == [False, False, False, True, True, False], log
        assert all(e["first_pass_loss"] > 0.3 for e in log[:4]), log
        assert all(e["delivered_fraction"] == 1.0 for e in log[3:5]), log
        assert [e["first_pass_loss"] for e in log[4:]] == [0.0, 0.0], log
    else:  # a worker's only receive is the reliable broadcast: nothing to guard
        assert not any(e["guarded"] for e in log) and log[0]["first_pass_loss"] is None, log

    saved = state.state_dict()
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # (weights_only: plain values only)
    assert loaded["rounds"] == {0: ROUNDS} and loaded["rank"] == rank
    peer = 1 - rank
    assert loaded["paths"][peer]["srtt"] is not None  # a round trip was learned
    # the server's aggregate (stale fill starts from it); a worker's broadcast, received
    # reliably (no stale_broadcast), arrives whole and needs no last value kept
    memory = {bucket: set(roles) for bucket, roles in loaded["memory"].items()}
    assert memory == ({0: {"aggregate"}} if rank == 0 else {}), memory

    twin = model()
    again = bl.register(twin, "mlt", p=0.05, topology="ps", transport=transport)
    bad = dict(loaded, topology="allreduce")
    try:
        again.load_state_dict(bad)
    except ValueError as e:
        assert "\n" not in str(e) and "'allreduce'" in str(e), e
    else:
        raise AssertionError("a state_dict of another topology was loaded")
    assert again.rounds == {} and not again.collective.memory
    again.load_state_dict(loaded)
    coll = again.collective
    assert again.rounds == state.rounds and again.policy.p == 0.05
    assert coll.guard.state_dict() == state.collective.guard.state_dict()
    for key, values in state.collective.memory.items():
        assert (coll.memory[key] == values).all(), key
    assert again.endpoint.path_state(coll.peers[peer]) == loaded["paths"][peer]
    step(twin, g)  # continues from the loaded round counter
    assert [e["round"] for e in again.round_log] == [ROUNDS], again.round_log

    # a pickled state registered again (register(state=...)) keeps the same, too
    third = model()
    pickled = pickle.loads(pickle.dumps(state))
    path = pickled.paths[peer]  # (as of the pickling: the last broadcast's STOP may be late)
    assert path["srtt"] is not None
    kept = bl.register(third, state=pickled)
    assert kept.rounds == state.rounds and kept.guard == state.guard
    assert kept.collective.guard.state_dict() == state.collective.guard.state_dict()
    assert kept.endpoint.path_state(kept.collective.peers[peer]) == path
    assert kept.endpoint.config == state.endpoint.config
    for s in (state, again, kept):
        s.close()
    dist.destroy_process_group()
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    world, port = 2, int(sys.argv[1])
    mp.start_processes(rank_main, args=(world, port), nprocs=world, start_method="spawn")
