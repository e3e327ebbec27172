"""Run by test_fsdp.py: ranks over Gloo train FSDP2 (fully_shard) models with
boundedloss.torch.register's reduce-scatter and all-gather on real UDP loopback.

    python tests/fsdp_ranks.py SCENARIO WORLD PORT DTYPE

Scenarios (each rank prints "rank R: ok ..." and exits 0 when every check holds):

- ``lossless``: register refuses what does not apply to FSDP2 (a topology, Hadamard)
  and a model neither DDP nor FSDP2; two identical models, one on Gloo's FSDP2
  collectives and one on ours (policy "reliable"), take the same steps: the same
  losses and gradient shards each step (float32: to float rounding; bfloat16 through
  MixedPrecisionPolicy: within a rounding of bfloat16 - ours averages in float32),
  the same parameters at the end (float32), and epoch_end's gradient norm is the full
  gradient's, as DDP's is.
- ``lossy``: MLT at 30% while each rank's endpoint loses 10% of what it receives. The
  model's gradient is a known constant per rank (loss = sum(w * c_rank)), and each
  rank writes a known value into its own parameter shard before each step: every
  gradient element must be the mean over the contributions that arrived (here: both
  ranks', or the owner's own alone) and every gathered parameter element the current
  value or the last one seen there (never a zero); losses must show in both.
- ``state_dict``: the lossy job's state_dict through torch.save / torch.load into a
  second registration: the same round counters, memory (the reduce-scatter's; the
  all-gathered parameters are left out) and guard; the next step continues the round
  counters, its all-gathers received reliably (no last value kept); a DDP job's
  state_dict is refused.
"""

import io
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rank_exit import ends_with_os_exit


def mixed_precision(dtype_name):
    if dtype_name == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return MixedPrecisionPolicy()


def cpu_mesh():
    """The ranks' CPUs (fully_shard would take a GPU where there is one)."""
    return init_device_mesh("cpu", (dist.get_world_size(),))


def finish(state):
    """Close after every rank's last step (as train does): a rank that closes its
    endpoint while a peer still waits for the STOP of its last send fails that peer."""
    dist.barrier()
    state.close()


# ------------------------------------------------------------------ lossless
class Net(torch.nn.Module):
    """Two sharded layers (dims that do not divide the world: FSDP pads) and a
    parameter of the root's own."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(64, 301)
        self.second = torch.nn.Linear(301, 10)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 10))

    def forward(self, x):
        return self.second(torch.relu(self.first(x))) * self.scale


def sharded_net(dtype_name):
    torch.manual_seed(0)
    net = Net()
    mp_policy, mesh = mixed_precision(dtype_name), cpu_mesh()
    fully_shard(net.first, mesh=mesh, mp_policy=mp_policy)
    fully_shard(net.second, mesh=mesh, mp_policy=mp_policy)
    fully_shard(net, mesh=mesh, mp_policy=mp_policy)
    return net


def lossless(rank, world, dtype_name, bl, transport):
    gloo, ours = sharded_net(dtype_name), sharded_net(dtype_name)
    for refused, kw, says in (
            (ours, {"topology": "allreduce"}, "does not apply to an FSDP2 model"),
            (ours, {"hadamard": True}, "hadamard=True does not apply to an FSDP2 model"),
            (torch.nn.Linear(2, 2), {}, "a DistributedDataParallel model or one sharded")):
        try:
            bl.register(refused, "reliable", transport=transport, **kw)
        except (ValueError, TypeError) as e:
            assert says in str(e), e
        else:
            raise AssertionError(f"register({type(refused).__name__}, {kw}) was taken")
    state = bl.register(ours, "reliable", transport=transport)
    assert state.topology == "fsdp" and state.stale_broadcast
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (gloo, ours)]
    bf16 = dtype_name == "bfloat16"
    g = torch.Generator().manual_seed(rank)
    norms, worst = [], 0.0
    for step in range(4):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        losses = []
        for m, opt in zip((gloo, ours), opts):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x).float(), y)
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= (1e-2 if bf16 else 1e-5) * abs(losses[0]), losses
        sq = 0.0
        for (name, a), b in zip(gloo.named_parameters(), ours.parameters()):
            ga, gb = a.grad.to_local(), b.grad.to_local()
            # a rounding of the dtype apart: Gloo averages in it, ours in float32
            ulp = 2 ** -7 if bf16 else 1e-5
            scale = float(ga.abs().max()) if ga.numel() else 0.0
            if not torch.allclose(ga, gb, rtol=ulp, atol=ulp * scale + 1e-7):
                print(f"rank {rank} step {step} {name}: gradient shards differ by "
                      f"{float((ga - gb).abs().max()):.3g}", flush=True)
                sys.exit(3)
            worst = max(worst, float((ga - gb).abs().max()) if ga.numel() else 0.0)
            sq += float(a.grad.full_tensor().double().pow(2).sum())  # (Gloo's, unsharded)
        norms.append(sq ** 0.5)
        for opt in opts:
            opt.step()
        if bf16:  # take Gloo's step on both, so that bfloat16 roundings do not compound
            with torch.no_grad():
                for a, b in zip(gloo.parameters(), ours.parameters()):
                    b.to_local().copy_(a.to_local())
    for (name, a), b in zip(gloo.named_parameters(), ours.parameters()):
        assert torch.allclose(a.to_local(), b.to_local(), rtol=1e-5, atol=1e-6), name
    # the phase detector sees the full gradient's norm (the shards' summed), as with DDP
    report = state.epoch_end()
    want = sum(norms) / len(norms)
    assert abs(report["grad_norm"] - want) <= (1e-2 if bf16 else 1e-5) * want, (report, want)
    kinds = {(e["bucket"], e["collective"]) for e in state.round_log}
    # buckets 2i / 2i+1: module i's reduce-scatter and all-gather (modules: net, first,
    # second - every one with parameters of its own)
    assert kinds == {(0, "reduce_scatter"), (1, "all_gather"), (2, "reduce_scatter"),
                     (3, "all_gather"), (4, "reduce_scatter"), (5, "all_gather")}, kinds
    assert state.rounds[0] == state.rounds[2] == state.rounds[4] == 4, state.rounds
    assert all(e["delivered_fraction"] == 1.0 for e in state.round_log)
    finish(state)
    return f"worst gradient difference {worst:.3g}"


# --------------------------------------------------------------------- lossy
class Probe(torch.nn.Module):
    """loss = sum(w * c): the gradient of w is c; what forward saw of w is kept."""

    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))
        self.seen = None

    def forward(self, c):
        self.seen = self.w.detach().float().clone()
        return (self.w * c).sum()


class Probes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Probe(30_000), Probe(20_002)

    def forward(self, c):
        return self.a(c[:30_000]) + self.b(c[30_000:])


def sharded_probes(dtype_name):
    net = Probes()
    mp_policy, mesh = mixed_precision(dtype_name), cpu_mesh()
    # (one all-gather a step per module, so that the last value seen is forward's)
    fully_shard(net.a, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(net.b, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(net, mesh=mesh, mp_policy=mp_policy)
    return net


def value(owner, step, world):
    """What rank ``owner`` writes into its shard before ``step`` (exact in bfloat16)."""
    return float(1 + step * world + owner)


def contribution(rank, step):
    return float((2 * rank + 1) * (step + 1))  # (2 ranks: 1, 3 - their mean 2; exact)


def lossy_steps(rank, world, net, state, steps, first=0, kept=None):
    """Take ``steps`` steps and check every gradient and gathered element; returns what
    each probe last saw (None where nothing was seen yet), and the fractions of
    elements the loss touched (gradients, parameters)."""
    probes = (net.a, net.b)
    kept = kept or [None, None]
    missing_grads = missing_params = elements = 0
    for step in range(first, first + steps):
        with torch.no_grad():  # each owner's shard: a value that says whose and when
            for p in probes:
                p.w.to_local().fill_(value(rank, step, world))
        c = torch.full((50_002,), contribution(rank, step))
        for p in probes:
            p.w.grad = None
        net(c).backward()
        for i, p in enumerate(probes):
            # the gathered parameter: my shard now; another's now, or what I saw last
            n = p.w.shape[0]
            k = (n + world - 1) // world
            seen = p.seen
            for owner in range(world):
                piece = seen[owner * k:min(n, (owner + 1) * k)]
                now = value(owner, step, world)
                if owner == rank or kept[i] is None:  # (mine, or the first: reliable)
                    assert bool((piece == now).all()), (rank, step, owner)
                    continue
                before = kept[i][owner * k:min(n, (owner + 1) * k)]
                fresh = piece == now
                assert bool((fresh | (piece == before)).all()), (
                    rank, step, owner, piece[~fresh & (piece != before)][:5])
                missing_params += int((~fresh & (before != now)).sum())
            kept[i] = seen
            # the gradient shard: the mean over what arrived - both, or mine alone
            grad = p.w.grad.to_local()
            both = sum(contribution(r, step) for r in range(world)) / world
            mine = contribution(rank, step)
            full = grad == both
            assert bool((full | (grad == mine)).all()), (rank, step, grad[:5])
            missing_grads += int((~full).sum())
            elements += grad.numel()
    return kept, missing_grads / elements, missing_params / elements


def lossy(rank, world, dtype_name, bl, transport):
    from boundedloss.net.loss import Bernoulli

    net = sharded_probes(dtype_name)
    state = bl.register(net, "mlt", p=0.3, transport=transport,
                        loss=Bernoulli(0.1, seed=rank + 1))
    _, grads, params = lossy_steps(rank, world, net, state, steps=4)
    log = state.round_log
    delivered = {kind: [e["delivered_fraction"] for e in log if e["collective"] == kind]
                 for kind in ("reduce_scatter", "all_gather")}
    # the bound was used: pieces did go missing, as many as the receives say
    for kind, touched in (("reduce_scatter", grads), ("all_gather", params)):
        said = sum(1 - f for f in delivered[kind]) / len(delivered[kind])
        assert 0.0 < said <= 0.3, (kind, delivered[kind])
        if kind == "reduce_scatter":
            assert abs(touched - said) < 0.03, (kind, touched, said)
    assert 0.0 < params <= grads + 0.1, (grads, params)
    # the first all-gather of each module (nothing kept yet) was received reliably
    first = [e for e in log if e["collective"] == "all_gather" and e["round"] == 0]
    assert len(first) == 2 and all(e["delivered_fraction"] == 1.0 for e in first), first
    finish(state)
    return f"gradient elements lost {grads:.3f}, parameter elements stale {params:.3f}"


# ---------------------------------------------------------------- state_dict
def state_dict(rank, world, dtype_name, bl, transport):
    from boundedloss.net.loss import Bernoulli

    net = sharded_probes(dtype_name)
    state = bl.register(net, "mlt", p=0.3, transport=transport,
                        loss=Bernoulli(0.1, seed=rank + 1))
    kept, _, _ = lossy_steps(rank, world, net, state, steps=3)
    state.epoch_end()
    saved = state.state_dict()
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # (weights_only: plain values)
    assert loaded["topology"] == "fsdp" and loaded["epoch"] == 1
    # modules 1 and 2 (a, b): reduce-scatter buckets 2, 4 and all-gather buckets 3, 5
    assert loaded["rounds"] == {2: 3, 3: 3, 4: 3, 5: 3}, loaded["rounds"]
    # the reduce-scatter's memory only: the all-gathered parameters are the model's
    assert sorted(loaded["memory"]) == [2, 4], sorted(loaded["memory"])
    assert all(set(roles) == {"shard"} for roles in loaded["memory"].values())
    assert any(k[0] % 2 for k in state.collective.memory), "no all-gather memory kept live"
    finish(state)

    twin = sharded_probes(dtype_name)
    again = bl.register(twin, "mlt", p=0.3, transport=transport,
                        loss=Bernoulli(0.1, seed=rank + 11))
    ddp_like = dict(loaded, topology="ps")
    try:
        again.load_state_dict(ddp_like)
    except ValueError as e:
        assert "'ps'" in str(e) and "\n" not in str(e), e
    else:
        raise AssertionError("a DDP job's state_dict was loaded into an FSDP2 job")
    again.load_state_dict(loaded)
    now = again.state_dict()
    assert {k: v for k, v in now.items() if k not in ("memory", "paths")} == {
        k: v for k, v in loaded.items() if k not in ("memory", "paths")}
    assert all(now["memory"][b][r].equal(t) for b, roles in loaded["memory"].items()
               for r, t in roles.items())
    # the next step: round counters go on; nothing kept to fill a gathered piece with,
    # so the all-gathers are reliable (and every element current), the rest bounded
    lossy_steps(rank, world, twin, again, steps=1, first=3)
    log = again.round_log
    assert sorted((e["bucket"], e["round"]) for e in log) == [(2, 3), (3, 3), (4, 3),
                                                              (5, 3)], log
    gathers = [e for e in log if e["collective"] == "all_gather"]
    assert all(e["delivered_fraction"] == 1.0 and e["bound"] == 0.3 for e in gathers)
    assert all(e["close_reasons"] == ["complete"] for e in gathers), gathers
    finish(again)
    return "round trip"


SCENARIOS = {"lossless": lossless, "lossy": lossy, "state_dict": state_dict}


@ends_with_os_exit
def rank_main(rank, world, port, scenario, dtype_name):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import boundedloss.torch as bl

    # chunks that do not divide a float's bytes evenly: floats cut at chunk edges too
    transport = bl.hook_transport(chunk_bytes=1202, receive_deadline=10)
    said = SCENARIOS[scenario](rank, world, dtype_name, bl, transport)
    dist.destroy_process_group()
    print(f"rank {rank}: ok, {scenario} {dtype_name}: {said}", flush=True)


if __name__ == "__main__":
    scenario, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dtype_name = sys.argv[4] if len(sys.argv) > 4 else "float32"
    mp.start_processes(rank_main, args=(world, port, scenario, dtype_name), nprocs=world,
                       start_method="spawn")
