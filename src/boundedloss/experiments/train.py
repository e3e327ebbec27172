"""`boundedloss train`: data-parallel training with the bounded-loss DDP hook, or with
``sharded`` FSDP2 (``sharding.py``) and the hook's reduce-scatter and all-gather.

Starts ``workers`` local processes (torch.distributed over Gloo on 127.0.0.1), or one per
node of a kernel testbed (``run_training(cfg, testbed)``), or, when
started by ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR in the environment), runs as
that one rank. Rank 0 writes, under ``out``:

- ``rounds.jsonl``  one line per training round (iteration): step time, communication
  latency, delivered fraction, retransmission rounds, bound in force, phase, why closed;
- ``epochs.jsonl``  one line per epoch: test metric, gradient norm, phase, bound, lr;
- ``summary.json``  the configuration (``topology`` and ``stale_broadcast`` as resolved:
  ``fsdp`` when ``sharded``), whether it was ``sharded``, what it trained on (``data``),
  final metric,
  wall time, the device rank 0 ran
  on (and the GPU's name under cuda), the parameters' dtype (and so DDP's gradient
  buckets'), the dtype gradients travel in (``grad_dtype``), the parameter count,
  whether the UDP
  endpoints used segmentation offload, the most copies a PROBE went in, the data
  path (``native``, or ``python (why)``) and how datagrams were authenticated
  (``auth``: ``secret``, ``random`` or ``off``; None under gloo), and what rank 0's
  endpoint received (``datagrams_received``) and dropped, by reason
  (``datagrams_dropped``: ``bad_auth`` counts forgeries);
- with ``checkpoint_every``, ``checkpoint.rank<r>.pt`` per rank (every rank writes its
  own, replaced at each checkpoint): the epoch and round reached, the model's, the
  optimizer's, the scheduler's and the hook's ``state_dict()``. ``resume=DIR`` starts
  every rank from its file in DIR and appends to the logs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn, Protocol, cast

import numpy as np

from .. import native
from ..aggregate import AGGREGATORS
from ..collective import TOPOLOGIES, default_topology
from ..heap import freeze_heap
from ..policy import TCP_PS, TCP_TOPOLOGIES, parse_policy
from ..secret import secret_from_env
from ..wire import DEFAULT_CHUNK_BYTES, DropReason

#: the endpoint counters that are datagrams dropped, by why
DROP_REASONS = frozenset(r.value for r in DropReason)

if TYPE_CHECKING:
    import torch
    from rich.progress import Progress, TaskID

    from ..collective import LossGuard
    from ..emulate import Testbed
    from ..protocol import TransportConfig
    from ..workloads.images import ImageData


@dataclass(frozen=True)
class TrainConfig:
    #: a policy as the command line writes it (``dblp``, ``mlt:0.008``, ``gloo``, ...)
    policy: str = "dblp"
    #: the DDP hook's collective (None: ``ps``; under ``sharded`` none applies)
    topology: str | None = None
    workers: int = 3
    model: str = "mlp"
    #: the images mlp and cnn train on (``IMAGE_DATA``; None: digits); charlm takes none
    data: str | None = None
    epochs: int = 8
    seed: int = 0
    loss: str = "none"
    out: str = "runs/train"
    aggregator: str = "unbiased"
    batch_size: int = 32
    lr: float = 0.05
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    receive_deadline: float = 20.0
    hadamard: bool = False
    #: broadcast (or all-gather) results under the bound (None: the hook's default -
    #: reliable for DDP, stale for an FSDP2 model's all-gather)
    stale_broadcast: bool | None = None
    steps_per_epoch: int | None = None  # default: one pass over this rank's share
    die_at_round: int | None = None  # testing: rank 1 exits abruptly at this round
    probe_copies_max: int | None = None  # the transport's PROBE copies (None: its default)
    #: the loss guard's rounds above the bound (0: off; None: the hook's default)
    guard_rounds: int | None = None
    checkpoint_every: int = 0  # a checkpoint every this many epochs (0: none)
    resume: str | None = None  # a directory with every rank's checkpoint to start from
    #: authenticate every datagram (the key: from BOUNDEDLOSS_SECRET[_FILE] in the
    #: ranks' environment, else a random one rank 0 hands out); False warns once
    auth: bool = True
    #: where every rank's model, batches and gradient buckets live (``DEVICES``)
    device: str = "cpu"
    #: the dtype of the model's parameters and inputs, and so of the buckets (``PRECISIONS``)
    precision: str = "fp32"
    #: FSDP2 (``fully_shard``) instead of DDP: ``sharding.py``
    sharded: bool = False
    #: receiver-driven credit per receiver, bytes (TransportConfig.credit_bytes; None: off)
    credit_bytes: int | None = None
    #: each receiver sizes the credit budget from the overflows it sees, credit_bytes
    #: its floor (TransportConfig.credit_adaptive)
    credit_adaptive: bool = False
    #: sender-side congestion control (TransportConfig.congestion: off, delay)
    congestion: str = "off"
    #: the MLP's hidden width (``--model mlp``)
    mlp_hidden: int = 256

    def validate(self) -> None:
        try:
            parse_policy(self.policy)
        except ValueError as e:
            raise ValueError(f"--policy: {e}") from None
        if self.topology is not None and self.topology not in TOPOLOGIES:
            raise ValueError(f"--topology must be one of {', '.join(TOPOLOGIES)}")
        for option, value, names in (("--model", self.model, MODELS),
                                     ("--aggregator", self.aggregator, AGGREGATORS),
                                     ("--device", self.device, DEVICES),
                                     ("--precision", self.precision, PRECISIONS)):
            if value not in names:
                raise ValueError(f"{option} must be one of {', '.join(names)}")
        self._check_data()
        from ..protocol import TransportConfig

        try:
            TransportConfig(chunk_bytes=self.chunk_bytes, credit_bytes=self.credit_bytes,
                            credit_adaptive=self.credit_adaptive)
        except ValueError as e:
            raise ValueError(f"--chunk-bytes / --credit: {e}") from None
        try:
            TransportConfig(congestion=self.congestion)
        except ValueError as e:
            raise ValueError(f"--congestion: {e}") from None
        if self.workers < 2:
            raise ValueError("--workers must be >= 2")
        if self.mlp_hidden < 1:
            raise ValueError("--mlp-hidden must be >= 1")
        if self.epochs < 1:
            raise ValueError("--epochs must be >= 1")
        if self.checkpoint_every < 0:
            raise ValueError("--checkpoint-every must be >= 0 (0: no checkpoints)")
        if self.guard_rounds is not None and self.guard_rounds < 0:
            raise ValueError("--guard-rounds must be >= 0 (0: no loss guard)")
        if self.resume is not None and not Path(self.resume).is_dir():
            raise ValueError(f"--resume: {self.resume} is not a directory")
        if self.device == "cuda":
            self._check_cuda()
        if self.sharded:
            self._check_sharded()

    def _check_sharded(self) -> None:
        given = [flag for flag, value in (
            ("--topology", self.topology is not None), ("--hadamard", self.hadamard),
            ("--checkpoint-every", self.checkpoint_every > 0),
            ("--resume", self.resume is not None)) if value]
        if given:
            # (checkpoints: FSDP2's sharded state wants torch.distributed.checkpoint)
            raise ValueError(f"{given[0]} does not apply with --sharded (FSDP2 reduce-scatters "
                             "gradients and all-gathers parameters; no topology, Hadamard "
                             "transform or checkpoints)")
        if parse_policy(self.policy).name == TCP_PS:
            raise ValueError(f"--policy {TCP_PS} is a DDP comm hook: not with --sharded")

    @property
    def topology_name(self) -> str:
        """The collective the gradients take: ``fsdp`` under --sharded; a TCP baseline's
        own (gloo's ring, tcp-ps's server); else the topology (by default the one
        ``default_topology`` gives ``workers``; a job under torchrun, or resumed, reads
        its own from the hook's state)."""
        if self.sharded:
            return "fsdp"
        name = parse_policy(self.policy).name
        if name in TCP_TOPOLOGIES:
            return TCP_TOPOLOGIES[name]
        return default_topology(self.workers) if self.topology is None else self.topology

    def _check_data(self) -> None:
        if self.data is None:
            return
        if self.model not in IMAGE_MODELS:
            raise ValueError(f"--data is for --model {' or '.join(IMAGE_MODELS)}; "
                             f"{self.model} trains on the standard library's text")
        if self.data not in IMAGE_DATA:
            raise ValueError(f"--data must be one of {', '.join(IMAGE_DATA)}")
        try:
            IMAGE_DATA[self.data].check()
        except FileNotFoundError as e:
            raise ValueError(f"--data {self.data}: {e}") from None

    @property
    def data_name(self) -> str:
        """What this run trains on: an ``IMAGE_DATA`` name, or charlm's text."""
        return "stdlib-text" if self.model not in IMAGE_MODELS else self.data or "digits"

    def _check_cuda(self) -> None:
        if parse_policy(self.policy).name == TCP_PS:
            raise ValueError(f"--policy {TCP_PS} runs on the CPU only (gloo's point-to-point "
                             "send and receive take CPU tensors): use --device cpu")
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible "
                             "(torch.cuda.is_available() is False)")

    def guard(self) -> LossGuard | None:
        """The hook's loss guard for this run (None: the hook's default)."""
        from ..collective import LossGuard

        return None if self.guard_rounds is None else LossGuard(rounds=self.guard_rounds)

    def transport(self) -> TransportConfig:
        """The hook's transport with this run's chunk size, deadline and PROBE copies."""
        from ..torch import hook_transport

        copies = {} if self.probe_copies_max is None else {
            "probe_copies_max": self.probe_copies_max}
        return hook_transport(chunk_bytes=self.chunk_bytes,
                              receive_deadline=self.receive_deadline,
                              credit_bytes=self.credit_bytes,
                              credit_adaptive=self.credit_adaptive, congestion=self.congestion,
                              **copies)


#: ``--device`` names
DEVICES = ("cpu", "cuda")
#: ``--precision`` names -> the torch dtype (by name) of the model's parameters and
#: floating inputs; DDP's gradient buckets take it, and the hook carries bfloat16 as is.
#: (Under --sharded the parameters stay float32 and FSDP2's mixed precision computes and
#: reduce-scatters in it: ``sharding.py``.)
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}


# ------------------------------------------------------------------ one rank
Batch = tuple["torch.Tensor", "torch.Tensor"]


@dataclass(frozen=True)
class Placement:
    """Where a rank's model and data live, and the dtype of its floating values."""

    device: torch.device
    dtype: torch.dtype

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on this device, floating values in this dtype (labels and ids keep theirs)."""
        return t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else None)


def placement(cfg: TrainConfig, rank: int) -> Placement:
    """Rank ``rank``'s placement. Under cuda it is ``cuda:{r % device_count}`` with r its
    local rank (torchrun's LOCAL_RANK, else its rank): several ranks may share a GPU, as
    the control plane is gloo and the hook stages buckets through host memory. Under
    --sharded the model stays float32 (FSDP2's master parameters; it casts the inputs)."""
    import torch

    dtype = torch.float32 if cfg.sharded else getattr(torch, PRECISIONS[cfg.precision])
    if cfg.device == "cpu":
        return Placement(torch.device("cpu"), dtype)
    local = int(os.environ.get("LOCAL_RANK", rank))
    return Placement(torch.device("cuda", local % torch.cuda.device_count()), dtype)


@dataclass(frozen=True)
class Workload:
    """What a rank trains: the model, its batches per epoch, and the test metric."""

    model: torch.nn.Module
    batches: Callable[[int], Iterator[Batch]]  # epoch -> this rank's batches
    evaluate: Callable[[torch.nn.Module], float]
    metric_name: str


def _charlm(cfg: TrainConfig, rank: int, world: int, where: Placement) -> Workload:
    import torch

    from ..workloads import charlm

    text = charlm.load_stdlib_text()
    data = charlm.TextData(where.put(text.train), where.put(text.test))
    steps = cfg.steps_per_epoch or 40
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)

    def batches(epoch: int) -> Iterator[Batch]:
        for _ in range(steps):
            yield charlm.batches(data.train, 64, cfg.batch_size, g)

    def evaluate(m: torch.nn.Module) -> float:
        return charlm.perplexity(m, data.test)

    return Workload(charlm.CharLM(), batches, evaluate, "perplexity")


@dataclass(frozen=True)
class ImageSource:
    """An image data set ``--data`` names."""

    #: seed -> the train and test split (the seed fixes a split the data does not)
    load: Callable[[int], ImageData]
    #: raises ``FileNotFoundError`` (one line, saying what to install) if it is missing
    check: Callable[[], None]


def _digits_data(seed: int) -> ImageData:
    from ..workloads import digits

    return digits.load_digits_split(seed)


def _fashion_mnist_data(seed: int) -> ImageData:
    from ..workloads import fashion_mnist

    return fashion_mnist.load_fashion_mnist()


def _fashion_mnist_check() -> None:
    from ..workloads import fashion_mnist

    fashion_mnist.check_installed()


#: ``--data`` names: the images mlp and cnn train on
IMAGE_DATA: dict[str, ImageSource] = {
    "digits": ImageSource(_digits_data, check=lambda: None),  # (ships with scikit-learn)
    "fashion-mnist": ImageSource(_fashion_mnist_data, check=_fashion_mnist_check),
}
#: the CNN's channels per image side: Fashion-MNIST's 28x28 with digits' 16 would cost
#: 4x the arithmetic per step
CNN_CHANNELS = {8: 16, 28: 8}


def _images(cfg: TrainConfig, rank: int, world: int, where: Placement) -> Workload:
    import torch

    from ..workloads import images

    split = IMAGE_DATA[cfg.data_name].load(cfg.seed)
    data = images.ImageData(*(where.put(t) for t in (split.x_train, split.y_train,
                                                     split.x_test, split.y_test)))
    model: torch.nn.Module = (
        images.ImageMLP(data.side, hidden=cfg.mlp_hidden) if cfg.model == "mlp"
        else images.ImageCNN(data.side, CNN_CHANNELS.get(data.side, 16)))
    n = len(data.y_train)
    per_rank = n // world
    steps = cfg.steps_per_epoch or max(1, per_rank // cfg.batch_size)

    def batches(epoch: int) -> Iterator[Batch]:
        # every rank shuffles alike and takes its own share of the epoch's order
        order = np.random.default_rng([cfg.seed, epoch]).permutation(n)
        mine = order[rank * per_rank:(rank + 1) * per_rank]
        for s in range(steps):
            idx = torch.from_numpy(mine[(s * cfg.batch_size) % per_rank:][: cfg.batch_size])
            yield data.x_train[idx], data.y_train[idx]

    def evaluate(m: torch.nn.Module) -> float:
        return images.accuracy(m, data.x_test, data.y_test)

    return Workload(model, batches, evaluate, "accuracy")


#: ``--model`` names: mlp/cnn on images (``--data``), charlm on the standard library's text
MODELS: dict[str, Callable[[TrainConfig, int, int, Placement], Workload]] = {
    "mlp": _images,
    "cnn": _images,
    "charlm": _charlm,
}
#: the models that take ``--data``
IMAGE_MODELS = tuple(name for name, build in MODELS.items() if build is _images)


def _build(cfg: TrainConfig, rank: int, world: int, where: Placement) -> Workload:
    """The workload, its data and its model (in ``where``'s dtype) on ``where``'s device."""
    import torch

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    work = MODELS[cfg.model](cfg, rank, world, where)
    work.model.to(device=where.device, dtype=where.dtype)
    return work


def _per_round(log: list[dict], round_id: int) -> dict:
    """Round ``round_id``'s figures from the hook's round log: its buckets' slowest
    latency, least delivered fraction, and so on. On an FSDP2 model a step's round is its
    gradients' reduce-scatter (each module's ``round_id``-th); the all-gathers count their
    own calls - two a step for a module resharded after forward, and the evaluation's."""
    entries = []
    for e in reversed(log):  # this round's entries are the last ones (a log grows by rounds)
        if e.get("collective", "reduce_scatter") != "reduce_scatter":
            continue
        if e["round"] < round_id:
            break
        if e["round"] == round_id:
            entries.append(e)
    if not entries:
        return {}
    return {
        "comm_ms": max(e["latency_ms"] for e in entries),
        "delivered_fraction": min(e["min_delivered_fraction"] for e in entries),
        "retransmit_rounds": max(e["retransmit_rounds"] for e in entries),
        "bound": entries[0]["bound"],
        "phase": entries[0]["phase"],
        "closed": sorted({r for e in entries for r in e["close_reasons"]}),
        # the loss guard: the worst first-pass loss it was shown, and whether it held a bucket
        "first_pass_loss": max((e["first_pass_loss"] for e in entries
                                if e.get("first_pass_loss") is not None), default=None),
        "guarded": any(e.get("guarded") for e in entries),
    }


def checkpoint_path(directory: str | Path, rank: int) -> Path:
    """Where rank ``rank``'s checkpoint lies in ``directory``."""
    return Path(directory) / f"checkpoint.rank{rank}.pt"


def save_checkpoint(path: Path, checkpoint: dict) -> None:
    """Write ``checkpoint`` with ``torch.save`` so that ``path`` always holds a whole
    one: into a file beside it, then renamed over it (a process killed while writing
    leaves the previous checkpoint)."""
    import torch

    part = path.with_name(path.name + ".part")
    torch.save(checkpoint, part)
    os.replace(part, path)


def _keep_log_until(path: Path, key: str, last: int) -> None:
    """Drop the lines of a JSON-lines log whose ``key`` is past ``last``, and a last line
    a killed writer left half written (nothing if the log is not there)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get(key, last) <= last:
                kept.append(line + "\n")
        except json.JSONDecodeError:
            pass
    path.write_text("".join(kept))


def load_checkpoint(cfg: TrainConfig, rank: int, world: int, uses_hook: bool) -> dict:
    """This rank's checkpoint from ``cfg.resume``, once every rank has found its own of
    the same epoch; ``ValueError`` (one line, on every rank) if not."""
    import torch
    import torch.distributed as dist

    path = checkpoint_path(cfg.resume or ".", rank)
    found: dict | None = None
    problem = ""
    if not path.is_file():
        problem = f"rank {rank} has no {path}"
    else:
        found = torch.load(path)  # (weights_only: plain values and tensors)
        if found["world_size"] != world:
            problem = f"{path} is of a world of {found['world_size']} ranks, not {world}"
        elif (found["hook"] is not None) != uses_hook:
            problem = (f"{path} is of a run {'with' if found['hook'] else 'without'} the "
                       f"bounded-loss hook; --policy {cfg.policy} runs "
                       f"{'with' if uses_hook else 'without'} it")
    seen: list = [None] * world
    dist.all_gather_object(seen, (problem, None if found is None else found["epoch"]))
    problems = [p for p, _ in seen if p]
    if problems:
        raise ValueError(f"--resume: {problems[0]}")
    epochs = [e for _, e in seen]
    if len(set(epochs)) > 1:
        raise ValueError(f"--resume: the ranks' checkpoints are of different epochs {epochs} "
                         "(a run stopped while writing one)")
    assert found is not None
    return found


def train_rank(cfg: TrainConfig, rank: int, world: int, keep_alive: list | None = None) -> dict:
    """Run one rank to the end; rank 0 writes the logs and returns the summary.
    ``keep_alive``: a list that gets the DDP (or FSDP2) model (and with it the process
    group), for a caller that ends the process without tearing them down
    (:func:`run_rank_and_exit`)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ..net.loss import parse_loss_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.receive_deadline * 3 + 30))
    where = placement(cfg, rank)
    on_gpu = where.device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(where.device)  # (for CUDA calls that name no device)
    work = _build(cfg, rank, world, where)
    ddp: torch.nn.Module  # (the model every step runs: DDP's, or the FSDP2-sharded one)
    if cfg.sharded:
        from .sharding import shard

        ddp = shard(work.model, where.device, getattr(torch, PRECISIONS[cfg.precision]))
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(
            work.model, device_ids=[where.device.index] if on_gpu else None)
    if keep_alive is not None:
        keep_alive.append(ddp)
    spec = parse_policy(cfg.policy)
    state = None
    resumed = (load_checkpoint(cfg, rank, world, spec.uses_transport)
               if cfg.resume is not None else None)
    # UDP offload in use at the end, PROBE copies, the data path (None: gloo)
    offload = copies = data_path = auth = None
    drops: dict[str, int] | None = None
    received: int | None = None
    if spec.name == TCP_PS:
        from ..torch.tcp_ps import register_tcp_ps

        register_tcp_ps(cast(torch.nn.parallel.DistributedDataParallel, ddp))
    if spec.uses_transport:
        from .. import torch as bl_torch

        loss = parse_loss_spec(cfg.loss, seed=cfg.seed * 100 + rank).for_rank(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # (topology, Hadamard, stale_broadcast: None where unset, the hook decides -
            # a resumed run's topology its checkpoint's)
            topology = (cfg.topology if cfg.topology is not None or resumed is None
                        else (resumed.get("hook") or {}).get("topology"))
            state = bl_torch.register(
                ddp, spec.make(), aggregator=cfg.aggregator, topology=topology,
                transport=cfg.transport(), hadamard=cfg.hadamard,
                stale_broadcast=cfg.stale_broadcast,
                loss=None if loss.describe().startswith("none") else loss, guard=cfg.guard(),
                auth=cfg.auth,
            )
        for w in caught:  # a run without authentication says so once, in one line, on rank 0
            if not issubclass(w.category, bl_torch.UnauthenticatedWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            elif rank == 0:
                print(w.message, file=sys.stderr, flush=True)
        auth = state.auth
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=0.9)
    milestones = sorted({max(1, int(cfg.epochs * 0.5)), max(1, int(cfg.epochs * 0.75))})
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.2)
    loss_fn = torch.nn.CrossEntropyLoss()
    freeze_heap()  # (every arm alike, as register() does for ours: see boundedloss.heap)
    first_epoch = round_id = 0
    if resumed is not None:
        work.model.load_state_dict(resumed["model"])
        opt.load_state_dict(resumed["optimizer"])
        sched.load_state_dict(resumed["scheduler"])
        if state is not None:
            state.load_state_dict(resumed["hook"])
        first_epoch, round_id = resumed["epoch"] + 1, resumed["round"]
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    # rank 0 logs every round and epoch; the others their own step times too, since a
    # round lasts until its slowest rank is done (a resumed run adds to the logs)
    rounds_path = out / ("rounds.jsonl" if rank == 0 else f"rounds.rank{rank}.jsonl")
    if resumed is not None:  # (what a killed run logged past its checkpoint is done again)
        _keep_log_until(rounds_path, "round", round_id - 1)
        if rank == 0:
            _keep_log_until(out / "epochs.jsonl", "epoch", first_epoch - 1)
    mode = "a" if resumed is not None else "w"
    rounds_log: IO[str] = open(rounds_path, mode)
    epochs_log: IO[str] | None = open(out / "epochs.jsonl", mode) if rank == 0 else None
    progress = _Progress(rank == 0, cfg, first_epoch,
                         cfg.topology_name if state is None else state.topology)
    t_start = time.perf_counter()
    metric = float("nan")
    try:
        for epoch in range(first_epoch, cfg.epochs):
            for x, y in work.batches(epoch):
                if cfg.die_at_round is not None and rank == 1 and round_id == cfg.die_at_round:
                    os._exit(17)  # an abrupt death: no goodbye to anyone
                t0 = time.perf_counter()
                start_mono = time.monotonic()
                opt.zero_grad(set_to_none=True)
                logits = ddp(x).float()  # (the loss in float32 whatever the precision)
                loss_v = loss_fn(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                loss_v.backward()
                opt.step()
                if on_gpu:
                    torch.cuda.synchronize(where.device)  # the step's kernels are done
                step_ms = (time.perf_counter() - t0) * 1e3
                rec: dict[str, Any]
                if rank == 0:
                    # the round's span on the clock every namespace shares (what a
                    # testbed's timed bursts are matched against)
                    rec = {"round": round_id, "epoch": epoch, "step_ms": round(step_ms, 3),
                           "loss": round(loss_v.item(), 5),
                           "wall_s": round(time.perf_counter() - t_start, 4),
                           "start_mono_s": round(start_mono, 6),
                           "end_mono_s": round(time.monotonic(), 6)}
                    if state is not None:
                        rec.update(_per_round(state.round_log, round_id))
                else:
                    rec = {"round": round_id, "step_ms": round(step_ms, 3)}
                    if state is not None:  # a worker's own wait: push out, broadcast in
                        rec["comm_ms"] = _per_round(state.round_log, round_id).get("comm_ms")
                rounds_log.write(json.dumps(rec) + "\n")
                round_id += 1
                progress.step(epoch, loss_v.item())
            sched.step()  # first, so that an LR change marks the coming epoch critical
            decided = state.epoch_end(opt) if state is not None else {}
            if epochs_log is not None or cfg.sharded:
                # (a sharded forward all-gathers: every rank evaluates, rank 0 logs)
                metric = work.evaluate(work.model)
            if epochs_log is not None:
                rec = {"epoch": epoch, work.metric_name: metric,
                       "lr": opt.param_groups[0]["lr"],
                       "wall_s": round(time.perf_counter() - t_start, 4),
                       "grad_norm": decided.get("grad_norm"), "phase": decided.get("phase"),
                       "bound": decided.get("bound"), "lr_changed": decided.get("lr_changed"),
                       # the hook's round counter per bucket (what a resumed run goes on from)
                       "round_counters": (None if state is None else
                                          {str(b): n for b, n in sorted(state.rounds.items())})}
                epochs_log.write(json.dumps(rec) + "\n")
                rounds_log.flush()
                epochs_log.flush()
                progress.epoch(epoch, work.metric_name, metric)
            if cfg.checkpoint_every and (epoch + 1) % cfg.checkpoint_every == 0:
                rounds_log.flush()  # (the logs hold what the checkpoint holds)
                save_checkpoint(checkpoint_path(out, rank), {
                    "epoch": epoch, "round": round_id, "world_size": world,
                    "model": work.model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "hook": None if state is None else state.state_dict()})
                # every rank's file of this epoch is written before any rank goes on, so
                # a run killed later leaves a checkpoint of one epoch on every rank
                dist.barrier()
        wall = time.perf_counter() - t_start
        if state is not None:
            # every rank has finished its last step, so every broadcast has arrived: the
            # server's close() need not wait on STOPs a finished worker may never send
            dist.barrier()
    except RuntimeError:
        if state is not None and state.failure is not None:
            raise state.failure from None  # DDP's re-worded copy hides the type
        raise
    finally:
        progress.close()
        rounds_log.close()
        if epochs_log is not None:
            epochs_log.close()
        if state is not None:
            # (read last: a kernel that refuses a segmented send turns it off mid-run)
            offload = state.endpoint is not None and state.endpoint.segmentation_offload
            copies = state.endpoint.config.probe_copies_max if state.endpoint else None
            data_path = (("native" if state.endpoint.data_path is not None
                          else f"python ({native.status()})") if state.endpoint else None)
            # what this rank's endpoint dropped, by reason (bad_auth: forged datagrams)
            counted = {} if state.endpoint is None else state.endpoint.counters()
            received = counted.get("datagrams_in")
            drops = {k: v for k, v in counted.items() if k in DROP_REASONS and v}
            state.close()
    params = list(work.model.parameters())
    # (what the run resolved: its collective, and whether results crossed under the bound)
    resolved = {"topology": cfg.topology_name if state is None else state.topology,
                "stale_broadcast": cfg.stale_broadcast if state is None else state.stale_broadcast}
    summary = {"config": {**asdict(cfg), "workers": world, **resolved},
               "sharded": cfg.sharded, "data": cfg.data_name,
               "metric_name": work.metric_name,
               "final_metric": metric, "wall_s": wall, "rounds": round_id, "world_size": world,
               "device": str(where.device),
               "gpu": torch.cuda.get_device_name(where.device) if on_gpu else None,
               "parameters": sum(p.numel() for p in params),
               # (DDP's gradient buckets are of the parameters' dtype; FSDP2's
               # reduce-scatter of its mixed precision's)
               "param_dtype": _dtype_name(params[0].dtype),
               "grad_dtype": PRECISIONS[cfg.precision],
               "udp_segmentation_offload": offload, "probe_copies_max": copies,
               "data_path": data_path, "auth": auth, "datagrams_received": received,
               "datagrams_dropped": drops,
               "resumed_from_epoch": None if resumed is None else resumed["epoch"]}
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    dist.destroy_process_group()
    return summary


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Progress:
    """A rich progress bar on rank 0 (plain lines when not on a terminal)."""

    def __init__(self, enabled: bool, cfg: TrainConfig, first_epoch: int = 0,
                 topology: str = ""):
        self.bar: tuple[Progress, TaskID] | None = None
        if not enabled:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                       TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                       transient=False)
        bar.start()
        self.bar = bar, bar.add_task(f"{cfg.policy}/{topology}", total=cfg.epochs,
                                     completed=first_epoch, info="")

    def step(self, epoch: int, loss: float) -> None:
        if self.bar is not None:
            bar, task = self.bar
            bar.update(task, info=f"epoch {epoch + 1} loss {loss:.3f}")

    def epoch(self, epoch: int, name: str, value: float) -> None:
        if self.bar is not None:
            bar, task = self.bar
            bar.update(task, advance=1, info=f"epoch {epoch + 1} {name} {value:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar[0].stop()


# ------------------------------------------------------------------ launch
def run_rank_and_exit(cfg: TrainConfig, rank: int, world: int,
                      report: Callable[[dict], None] | None = None) -> NoReturn:
    """Run one launched rank to the end and exit: 0 (after ``report(summary)``, if
    given), or 1 after one clear line on stderr. What every rank process runs: local
    ranks, testbed ranks, and ``boundedloss train`` under torchrun.

    The process ends with ``os._exit``, its results written and its streams flushed,
    without tearing torch.distributed down: ProcessGroupGloo's destructor joins its
    worker threads while holding the GIL, and a worker still releasing its last work's
    Python state waits for that GIL (pytorch/pytorch#56297) - a deadlock that can leave
    a finished rank, and the comparison waiting for it, hanging. The model (and its
    process group) stays referenced until the exit; the OS reclaims the rest."""
    keep: list = []
    code = 0
    try:
        summary = train_rank(cfg, rank, world, keep_alive=keep)
        if report is not None:
            report(summary)
    except Exception as e:  # noqa: BLE001 - one clear line per failing rank
        sys.stderr.write(f"boundedloss train: rank {rank}: {type(e).__name__}: {e}\n")
        if os.environ.get("BOUNDEDLOSS_DEBUG"):
            traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawned(rank: int, world: int, cfg: TrainConfig, port: int, env: dict) -> None:
    # the launching process's environment now, not the fork server's at its start
    # (e.g. BOUNDEDLOSS_UDP_GSO set between two runs of one process)
    os.environ.clear()
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    run_rank_and_exit(cfg, rank, world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: what every rank imports before it can train: preloaded once in the fork server
RANK_IMPORTS = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
                "boundedloss.torch", "boundedloss.experiments.train")


def _rank_context():
    """Where local ranks are started from: a fork server that has imported torch once
    (``RANK_IMPORTS``) and forks a fresh process per rank, where it is available; else
    spawned interpreters. A rank spawned from scratch spends 3-4 s of CPU importing torch
    (and torch._dynamo, which DDP's constructor loads) - with 8 ranks on 2 cores, most of
    a short run - and a comparison pays it for every arm. (Not ``fork``: the parent may
    have threads by then, and a forked thread's locks can deadlock the child.)"""
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_IMPORTS))
    return ctx


def run_training(cfg: TrainConfig, testbed: Testbed | None = None) -> dict:
    """Train under torchrun (one rank), in a kernel testbed's namespaces (``testbed``: an
    up :class:`~boundedloss.emulate.Testbed`; rank 0 in its server node, rank r in
    worker r-1), or as ``cfg.workers`` local processes."""
    cfg.validate()
    if cfg.auth and parse_policy(cfg.policy).uses_transport:
        secret_from_env()  # a secret that cannot be read: one line now, before any rank
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return train_rank(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    ranks: list[RankProcess]
    if testbed is not None:
        ranks = list(_start_in_testbed(cfg, testbed))
    else:
        ctx = _rank_context()
        port = _free_port()
        env = dict(os.environ)
        local = [ctx.Process(target=_spawned, args=(r, cfg.workers, cfg, port, env),
                             daemon=False) for r in range(cfg.workers)]
        for p in local:
            p.start()
        ranks = list(local)
    grace = 2 * cfg.receive_deadline + 10  # (two receive deadlines: see supervise)
    run = supervise(ranks, grace)
    names = failure_report(ranks, run, grace)
    if names:
        hint = ""
        if testbed is not None:
            first = failed_ranks(ranks, run)[0]
            hint = (f"; rank {first}'s output ended: "
                    f"{last_line(Path(cfg.out) / f'rank{first}.log')!r}; each rank's "
                    f"output is in {Path(cfg.out) / 'rank<r>.log'}")
        raise RuntimeError(f"training failed: {names}{hint}")
    return json.loads((Path(cfg.out) / "summary.json").read_text())


class RankProcess(Protocol):
    """A started rank, as :func:`supervise` sees it: a ``multiprocessing.Process`` or a
    rank in a testbed node."""

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def terminate(self) -> None: ...

    def join(self) -> None: ...


@dataclass(frozen=True)
class Supervision:
    """How a run's ranks ended."""

    #: ranks stopped because they were still running ``grace`` s after another ended
    stopped: frozenset[int]
    #: every rank, in the order it was seen to end (the stopped ones last)
    ended: tuple[int, ...]


def supervise(ranks: Sequence[RankProcess], grace: float) -> Supervision:
    """Wait for every rank. Once one has ended (failed, or finished its work), the
    others get ``grace`` seconds to end too - a failed peer ends their round with
    PeerFailure, and finished ranks end together - and are then stopped: a run never
    hangs."""
    from multiprocessing.connection import wait

    give_up_at: float | None = None
    stopped: set[int] = set()
    ended: list[int] = []
    try:
        while True:
            # a rank is reaped (exitcode polled) only here, where its end is recorded:
            # polling it elsewhere first would let a later rank's end be seen in the same
            # pass and be listed ahead of it
            ended += [r for r, p in enumerate(ranks) if r not in ended and p.exitcode is not None]
            if len(ended) == len(ranks):
                break
            if give_up_at is None and ended:
                give_up_at = time.monotonic() + grace
            if give_up_at is not None and time.monotonic() > give_up_at:
                for r, p in enumerate(ranks):
                    if r not in ended and r not in stopped:
                        p.terminate()
                        stopped.add(r)
            wait([p.sentinel for r, p in enumerate(ranks) if r not in ended],
                 timeout=min(1.0, grace))
    except KeyboardInterrupt:
        for p in ranks:
            p.terminate()
        raise
    for p in ranks:
        p.join()
    ended += [r for r in range(len(ranks)) if r not in ended]
    return Supervision(frozenset(stopped), tuple(ended))


def _how_it_ended(r: int, p: RankProcess, run: Supervision, grace: float) -> str:
    if r in run.stopped:
        return f"rank {r} (stopped: still running {grace:.0f} s after another ended)"
    code = p.exitcode or 0
    if code < 0:
        return f"rank {r} (killed by {signal.Signals(-code).name})"
    return f"rank {r} (exit {code})"


def failed_ranks(ranks: Sequence[RankProcess], run: Supervision) -> list[int]:
    """The ranks that failed (a non-zero exit, or stopped), in the order they ended."""
    return [r for r in run.ended if ranks[r].exitcode != 0 or r in run.stopped]


def last_line(log: Path) -> str:
    """The last line of a rank's output that is not blank - a traceback's is its
    exception (empty if there is none)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def failure_report(ranks: Sequence[RankProcess], run: Supervision, grace: float) -> str:
    """The ranks that failed, the one that failed first named first - the others
    usually failed because of it (a dead peer ends their rounds with PeerFailure):
    ``rank 1 (exit 17) ended first; then rank 0 (exit 1), rank 2 (exit 1)``; empty if
    none failed."""
    failed = failed_ranks(ranks, run)
    if not failed:
        return ""
    first, *rest = failed
    head = _how_it_ended(first, ranks[first], run, grace)
    if not rest:
        return head
    return (f"{head} ended first; then "
            + ", ".join(_how_it_ended(r, ranks[r], run, grace) for r in rest))


class _NamespaceRank:
    """A rank running in a testbed node, with the part of ``multiprocessing.Process``'s
    interface :func:`supervise` uses (the sentinel is a pidfd: readable at exit)."""

    def __init__(self, proc: subprocess.Popen, log: IO[str]):
        self.proc = proc
        self.log = log
        self.sentinel = os.pidfd_open(proc.pid)

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        self.proc.terminate()

    def join(self) -> None:
        self.proc.wait()
        self.log.close()
        os.close(self.sentinel)


def _start_in_testbed(cfg: TrainConfig, testbed: Testbed) -> list[_NamespaceRank]:
    """One ``python -m boundedloss.experiments.train`` per rank, each in its node; the
    rendezvous is at the server node's address, so Gloo's TCP and our UDP both cross the
    testbed's links (and its bottleneck into the server)."""
    nodes = ("server",) + tuple(testbed.workers)
    if cfg.workers > len(nodes):
        raise ValueError(f"the testbed has {len(nodes)} nodes; {cfg.workers} ranks asked")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WORLD_SIZE": str(cfg.workers),
           "MASTER_ADDR": testbed.addresses["server"], "MASTER_PORT": str(_free_port())}
    ranks = []
    for r in range(cfg.workers):
        log = open(out / f"rank{r}.log", "w")
        proc = testbed.run(nodes[r], [sys.executable, "-m", "boundedloss.experiments.train",
                                      json.dumps(asdict(cfg))],
                           env={**env, "RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT)
        ranks.append(_NamespaceRank(proc, log))
    return ranks


def _rank_main(argv: list[str]) -> NoReturn:
    """A rank started by :func:`_start_in_testbed`: the config as JSON, rank and rendezvous
    in the environment."""
    cfg = TrainConfig(**json.loads(argv[0]))
    run_rank_and_exit(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
