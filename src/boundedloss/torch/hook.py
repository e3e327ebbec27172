"""The DDP comm hook and its state object (as torch's PowerSGD hook: a pure hook
function, every tunable and per-bucket memory in one documented, picklable state).

    state = boundedloss.torch.register(ddp_model, policy="dblp")
    state = boundedloss.torch.register(fully_shard(model), policy="dblp")  # FSDP2

``register`` is collective: every rank calls it after ``init_process_group``. It binds a
UDP endpoint on the address this rank uses to reach the others, publishes it on
torch.distributed's store, agrees on a random 64-bit session token (carried in every
datagram) and on the key that authenticates every datagram, builds the collective and
registers :func:`comm_hook` - or, on an FSDP2 model, installs the bounded-loss
reduce-scatter and all-gather on each of its FSDP modules (``fsdp.py``). The Gloo
process group stays the control plane (rendezvous, the end-of-epoch phase agreement)
and the reliable baseline.
"""

from __future__ import annotations

import dataclasses
import numbers
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from ..aggregate import Aggregator, make_aggregator
from ..collective import (
    BFLOAT16,
    NO_GUARD,
    TOPOLOGIES,
    Collective,
    LossGuard,
    LossGuards,
    MemoryKey,
    RoundStats,
    TwoLevelAllreduce,
    default_topology,
    widen,
)
from ..collective.base import is_bfloat16
from ..heap import freeze_heap
from ..net.loss import LossModel
from ..net.udp import UdpEndpoint
from ..policy import Policy, ReliablePolicy, make_policy
from ..policy._params import non_negative_int
from ..protocol import TransportConfig, TransportError
from ..protocol.auth import TRAILER_BYTES
from ..protocol.path import PeerPath
from .fsdp import FSDP_TOPOLOGY, check_modules, fsdp_modules, install, is_all_gather_slot
from .rendezvous import (
    agree_chunk_bytes,
    agree_session,
    default_store,
    exchange_addresses,
    local_ip,
    rendezvous_auth,
)
from .tensors import MESSAGE_DTYPES, as_message, as_tensor

_REGISTRATIONS = 0  # distinct store keys when a process registers more than once


class UnauthenticatedWarning(UserWarning):
    """A job runs with ``auth=False``: its datagrams are not authenticated."""


UNAUTHENTICATED_MESSAGE = (
    "boundedloss: datagrams are not authenticated (auth=False / --no-auth): anyone who "
    "can send to this job's UDP ports can write into its gradients")
_WARNED_UNAUTHENTICATED = False  # once per process, however many registrations


def warn_unauthenticated() -> None:
    """Warn (once per process) that this process runs without authentication."""
    global _WARNED_UNAUTHENTICATED
    if not _WARNED_UNAUTHENTICATED:
        _WARNED_UNAUTHENTICATED = True
        warnings.warn(UNAUTHENTICATED_MESSAGE, UnauthenticatedWarning, stacklevel=3)

#: receives one endpoint of the hook may hold open: every bucket of every peer, both
#: phases, posted a round ahead - far more than a point-to-point transfer needs
HOOK_MAX_OPEN_RECEIVES = 4096


def hook_transport(**changes: Any) -> TransportConfig:
    """The transport the hook runs on: :class:`TransportConfig`'s defaults with
    ``changes`` applied, except that unless given, a sender gives up on a silent peer
    only after the receive deadline (``peer_timeout = receive_deadline``: a peer
    still computing its backward pass is slow, not dead, and its own receives fail it
    at that deadline anyway) and up to :data:`HOOK_MAX_OPEN_RECEIVES` receives are
    open at once."""
    config = TransportConfig(**changes)
    own: dict[str, Any] = {}
    if "peer_timeout" not in changes:
        own["peer_timeout"] = config.receive_deadline
    if "max_open_receives" not in changes:
        own["max_open_receives"] = HOOK_MAX_OPEN_RECEIVES
    return dataclasses.replace(config, **own)


#: transport settings a caller might pass to ``register`` as keywords: they belong in
#: ``transport=`` (refused with a message that says so, not taken for policy keywords)
_TRANSPORT_KEYWORDS = tuple(f.name for f in dataclasses.fields(TransportConfig))

#: what ``BoundedLossState.state_dict()`` writes under "format" (and load reads)
STATE_DICT_FORMAT = "boundedloss.hook/1"
_STATE_DICT_KEYS = ("format", "topology", "hadamard", "world_size", "rank", "policy", "epoch",
                    "rounds", "last_lrs", "round_sq", "memory", "guard", "paths")


def default_guard(policy: Policy) -> LossGuard:
    """The loss guard a job runs with unless it sets one: on (``LossGuard()``) for a
    bounded policy, off for ``reliable`` (nothing to tighten)."""
    return NO_GUARD if isinstance(policy, ReliablePolicy) else LossGuard()


@dataclass
class BoundedLossState:
    """Everything the hook needs. ``state_dict()`` / ``load_state_dict()`` checkpoint it
    as PyTorch does (plain values ``torch.save`` writes); it also pickles: the process
    group, the socket and the threads are left out; policy state (e.g. DBLP's phase
    history), round counters, per-bucket memory (previous aggregates for stale fill),
    the loss guard's state and what was learned of each peer's path are kept."""

    policy: Policy
    aggregator: Aggregator
    #: the collective ("ps", "allreduce"; "fsdp": an FSDP2 model's reduce-scatter and
    #: all-gather)
    topology: str = "ps"
    #: the endpoint's settings (chunk size, receive deadline, PROBE copies, ...)
    transport: TransportConfig = field(default_factory=hook_transport)
    stale_broadcast: bool = False
    hadamard: bool = False
    rounds: dict[int, int] = field(default_factory=dict)  # bucket index -> next round id
    round_log: list[dict] = field(default_factory=list)
    epoch: int = 0
    #: the loss guard's setting: a bucket whose measured loss stays above the bound is
    #: received reliably until it falls back (``register`` picks ``default_guard``)
    guard: LossGuard = field(default_factory=LossGuard)
    #: this rank and the world it ran in (set by register; None before)
    rank: int | None = None
    world_size: int | None = None
    #: how the job authenticates its datagrams, as register agreed it: "secret" (a key
    #: from BOUNDEDLOSS_SECRET), "random" (a random key handed out on the store) or
    #: "off"; None before register. (The key itself is the endpoint's, never kept here.)
    auth: str | None = None
    #: the collective's per-bucket memory, the loss guard's per-bucket state and what
    #: the endpoint learned of each peer's path (by rank), as of the last pickling or
    #: load_state_dict before register (which restores them)
    memory: dict[MemoryKey, np.ndarray] = field(default_factory=dict, repr=False)
    guards: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    paths: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    failure: BaseException | None = field(default=None, repr=False)
    # runtime only
    process_group: Any = field(default=None, repr=False)
    endpoint: UdpEndpoint | None = field(default=None, repr=False)
    collective: Collective | None = field(default=None, repr=False)
    executor: ThreadPoolExecutor | None = field(default=None, repr=False)
    _round_sq: dict[int, float] = field(default_factory=dict, repr=False)
    _lock: Any = field(default_factory=threading.Lock, repr=False)
    _last_lrs: list[float] | None = field(default=None, repr=False)
    #: bucket index -> a reusable pinned host buffer for a bucket on an accelerator
    _staging: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    _RUNTIME = ("process_group", "endpoint", "collective", "executor", "_lock", "failure",
                "_staging")

    def __getstate__(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}
        d["memory"], d["guards"], d["paths"] = self._learned()
        return d

    def __setstate__(self, d: dict) -> None:
        # (a state pickled before the guard and the paths were kept has none)
        d = {"guard": LossGuard(), "rank": None, "world_size": None, "guards": {},
             "paths": {}, "auth": None, **d}
        self.__dict__.update(d)
        for k in self._RUNTIME:
            self.__dict__[k] = None
        self._lock = threading.Lock()
        self._staging = {}

    @property
    def sharded(self) -> bool:
        """Registered on an FSDP2 model: each rank reduces a shard of the gradient."""
        return self.topology == FSDP_TOPOLOGY

    def _learned(self) -> tuple[dict[MemoryKey, np.ndarray], dict[int, dict[str, Any]],
                                dict[int, dict[str, Any]]]:
        """The collective's memory (an FSDP2 job's all-gathered parameters left out: see
        ``fsdp.is_all_gather_slot``), the guard's state and the paths: the live ones
        once registered, else what was kept."""
        coll, endpoint = self.collective, self.endpoint
        if coll is None or endpoint is None:
            memory, guards, paths = dict(self.memory), dict(self.guards), dict(self.paths)
        else:
            memory, guards = dict(coll.memory), coll.guard.state_dict()
            paths = {r: endpoint.path_state(peer) for r, peer in enumerate(coll.peers)
                     if r != coll.rank}
        if self.sharded:
            memory = {k: v for k, v in memory.items() if not is_all_gather_slot(k)}
        return memory, guards, paths

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's hook state as plain values - numbers, strings, lists, dicts and
        CPU tensors, no sockets or process groups - for ``torch.save`` beside the
        model's and the optimizer's (``torch.load`` reads it back with its default
        ``weights_only=True``). Take it between steps, as the model's.

        It holds: the policy's ``state_dict()`` (its parameters and what it learned -
        DBLP's phase, detector and history); the round counter per bucket (``rounds``),
        ``epoch``, the learning rates last seen (``last_lrs``) and this epoch's squared
        gradient norms so far (``round_sq``); the collective's per-bucket memory
        (``memory``: previous aggregates for stale fill, as tensors; an FSDP2 job's
        all-gathered parameters are the model's checkpoint's, and the first all-gather
        after a load is received reliably); the loss guard's
        per-bucket state (``guard``); and what the endpoint learned of each peer's
        path (``paths``, by peer rank - addresses change on a restart: round trip and
        delivery rates). Also the job's shape (``topology``, ``hadamard``,
        ``world_size``, ``rank``), so that loading it into another job is refused.

        Not kept: the session token (a new job draws its own, and datagrams of the old
        one are dropped as foreign), sockets, addresses, the process group, threads,
        receives in flight, ``round_log`` (a log; the runner writes it out), the loss a
        receive saw lately (it stands for half a second of a clock the next process
        does not share), and the job's configuration (transport, aggregator, loss
        guard setting: given to ``register`` again)."""
        memory, guards, paths = self._learned()
        with self._lock:
            round_sq = dict(self._round_sq)
        by_bucket: dict[int, dict[str, torch.Tensor]] = {}
        for (bucket, role), values in memory.items():
            by_bucket.setdefault(bucket, {})[role] = _memory_tensor(values)
        return {
            "format": STATE_DICT_FORMAT, "topology": self.topology, "hadamard": self.hadamard,
            "world_size": self.world_size, "rank": self.rank,
            "policy": self.policy.state_dict(), "epoch": self.epoch,
            "rounds": dict(self.rounds),
            "last_lrs": None if self._last_lrs is None else list(self._last_lrs),
            "round_sq": round_sq, "memory": by_bucket, "guard": guards, "paths": paths,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of this rank of a job of the same shape - all of
        it, or nothing and a one-line ``ValueError`` (another policy's, topology's,
        world's or rank's state_dict, or a value refused). Once registered, it applies
        to the live collective and endpoint: the next round continues with the same
        round counters, phase, bound, memory, guard and paths."""
        loaded = _checked_state_dict(self, state)
        self.policy.load_state_dict(state["policy"])  # (all or nothing, and last to fail)
        self.epoch = loaded.epoch
        self.rounds = loaded.rounds
        self._last_lrs = loaded.last_lrs
        with self._lock:
            self._round_sq = loaded.round_sq
        coll, endpoint = self.collective, self.endpoint
        if coll is None or endpoint is None:
            self.memory, self.guards, self.paths = loaded.memory, loaded.guards, loaded.paths
            self.rank, self.world_size = loaded.rank, loaded.world_size
            return
        coll.memory.clear()
        coll.memory.update(loaded.memory)
        coll.guard.load_state_dict(loaded.guards)
        for r, path in loaded.paths.items():
            endpoint.load_path_state(coll.peers[r], path)

    def host_buffer(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """Where bucket ``index``'s values are exchanged from: the bucket itself on the
        CPU; else a pinned host buffer, reused across rounds, holding a copy of it (the
        copy waits for the kernels that wrote the gradient)."""
        if flat.device.type == "cpu":
            return flat
        with self._lock:
            buf = self._staging.get(index)
            if buf is None or buf.numel() != flat.numel() or buf.dtype != flat.dtype:
                buf = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
                self._staging[index] = buf
        buf.copy_(flat)
        return buf

    # ---------------------------------------------------------------- logging
    @property
    def phase(self) -> str | None:
        phase = self.policy.phase
        return None if phase is None else phase.value

    @property
    def bound(self) -> float | None:
        return self.policy.bound

    def record(self, stats: RoundStats, grad_sq: float | None,
               collective: str | None = None) -> None:
        """Log one collective call (a bucket of a round); ``grad_sq`` is its result's
        squared L2 norm - of a gradient; None for parameters - summed per round into the
        epoch's gradient norm. ``collective`` (an FSDP2 job's "reduce_scatter" or
        "all_gather") is logged with it."""
        bound = self.bound
        entry: dict[str, Any] = {
            "round": stats.round_id,
            "bucket": stats.bucket,
            "epoch": self.epoch,
            "latency_ms": round(stats.latency_s * 1e3, 3),
            "delivered_fraction": round(stats.delivered_fraction, 6),
            "min_delivered_fraction": round(stats.min_delivered_fraction, 6),
            "retransmit_rounds": stats.retransmit_rounds,
            "bound": bound if bound is not None else stats.bound,
            "phase": self.phase,
            "close_reasons": list(stats.close_reasons),
            "deadline_closed": stats.deadline_closed,
            # what the network lost before any recovery (the loss guard's measure), and
            # whether the guard held the bucket to reliable receives
            "first_pass_loss": (None if stats.first_pass_loss is None
                                else round(stats.first_pass_loss, 6)),
            "guarded": stats.guarded,
        }
        if collective is not None:
            entry["collective"] = collective
        with self._lock:
            self.round_log.append(entry)
            if grad_sq is not None:
                self._round_sq[stats.round_id] = (self._round_sq.get(stats.round_id, 0.0)
                                                  + grad_sq)

    # ------------------------------------------------------------ epoch ends
    @property
    def epoch_rounds(self) -> int:
        """Rounds whose gradients were exchanged since the last :meth:`epoch_end` (kept
        by ``state_dict()``): 0 when there is no epoch to end."""
        with self._lock:
            return len(self._round_sq)

    def epoch_end(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """Call on every rank at the end of each epoch.

        Feeds the policy (DBLP's critical-regime detector) the epoch's mean gradient L2
        norm - rank 0's measurement, broadcast over the Gloo control plane so that every
        rank switches phase at the same round - and tells it about learning-rate
        changes. (On an FSDP2 model each rank holds a shard of each round's gradient:
        the ranks' squared norms are summed per round first.) Returns what was decided,
        for the log."""
        with self._lock:
            round_sq = dict(self._round_sq)
            self._round_sq.clear()
        if self.sharded and dist.is_initialized():
            parts: list[Any] = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(parts, round_sq, group=self.process_group)
            round_sq = {}
            for part in parts:
                for r, sq in part.items():
                    round_sq[r] = round_sq.get(r, 0.0) + sq
        norms = [v ** 0.5 for v in round_sq.values()]
        local = float(np.mean(norms)) if norms else 0.0
        box = [local]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0, group=self.process_group)
        norm = float(box[0])
        lr_changed = False
        if optimizer is not None:
            lrs = [g["lr"] for g in optimizer.param_groups]
            # at the first epoch end, compare with the LR a scheduler started from
            before = self._last_lrs or [g.get("initial_lr", g["lr"])
                                        for g in optimizer.param_groups]
            lr_changed = lrs != before
            self._last_lrs = lrs
        if lr_changed:
            self.policy.lr_changed()
        self.policy.epoch_end(norm)
        self.epoch += 1
        return {"epoch": self.epoch, "grad_norm": norm, "lr_changed": lr_changed,
                "phase": self.phase, "bound": self.bound}

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if self.collective is not None:
            self.collective.close()
        if self.endpoint is not None:
            self.endpoint.close()


@dataclass(frozen=True)
class _LoadedState:
    """A hook state_dict's own values (its policy's aside), checked and converted."""

    epoch: int
    rounds: dict[int, int]
    last_lrs: list[float] | None
    round_sq: dict[int, float]
    memory: dict[MemoryKey, np.ndarray]
    guards: dict[int, dict[str, Any]]
    paths: dict[int, dict[str, Any]]
    rank: int | None
    world_size: int | None


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _checked_state_dict(owner: BoundedLossState, state: Any) -> _LoadedState:
    """``state`` checked against ``owner``'s job and converted; a one-line
    ``ValueError`` for anything that does not fit (nothing is changed by this)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a boundedloss hook state_dict is a dict, got {type(state).__name__}")
    if state.get("format") != STATE_DICT_FORMAT:
        raise ValueError(f"not a boundedloss hook state_dict (format {state.get('format')!r}, "
                         f"expected {STATE_DICT_FORMAT!r})")
    missing = [k for k in _STATE_DICT_KEYS if k not in state]
    unknown = sorted(set(state) - set(_STATE_DICT_KEYS))
    if missing or unknown:
        raise ValueError("hook state_dict: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else [])
            + ([f"unknown {', '.join(unknown)}"] if unknown else [])))
    if state["topology"] != owner.topology:
        raise ValueError(f"state_dict of a job on topology {state['topology']!r} cannot be "
                         f"loaded into one on {owner.topology!r}")
    if bool(state["hadamard"]) != owner.hadamard:
        raise ValueError(f"state_dict of a job with hadamard={bool(state['hadamard'])} cannot "
                         f"be loaded into one with hadamard={owner.hadamard}")
    coll = owner.collective
    rank, world = (coll.rank, coll.world_size) if coll is not None else (owner.rank,
                                                                        owner.world_size)
    if state["world_size"] is not None and world is not None and state["world_size"] != world:
        raise ValueError(f"state_dict of a world of {state['world_size']} ranks cannot be "
                         f"loaded into a world of {world}")
    if state["rank"] is not None and rank is not None and state["rank"] != rank:
        raise ValueError(f"state_dict of rank {state['rank']} cannot be loaded into rank "
                         f"{rank}: each rank saves and loads its own")
    try:
        rounds = {non_negative_int("bucket", b): non_negative_int("round", r)
                  for b, r in state["rounds"].items()}
        lrs = state["last_lrs"]
        memory = {(non_negative_int("bucket", b), str(role)): _memory_array(t)
                  for b, roles in state["memory"].items() for role, t in roles.items()}
        guards = LossGuards()
        guards.load_state_dict(state["guard"])  # (checks it)
        paths = {}
        for r, path in state["paths"].items():
            r = non_negative_int("peer rank", r)
            if r == state["rank"] or (world is not None and r >= world):
                raise ValueError(f"a path to rank {r} from rank {state['rank']} "
                                 f"in a world of {world}")
            PeerPath(r).load_state_dict(path)  # (checks it)
            paths[r] = dict(path)
        return _LoadedState(
            epoch=non_negative_int("epoch", state["epoch"]), rounds=rounds,
            last_lrs=None if lrs is None else [_number("lr", x) for x in lrs],
            round_sq={non_negative_int("round", r): _number("squared norm", x)
                      for r, x in state["round_sq"].items()},
            memory=memory, guards=guards.state_dict(), paths=paths,
            rank=rank if rank is not None else state["rank"],
            world_size=world if world is not None else state["world_size"])
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"hook state_dict: {first}") from None


def _memory_tensor(values: np.ndarray) -> torch.Tensor:
    """A memory slot as a CPU tensor of its own dtype (bfloat16 words as bfloat16)."""
    if is_bfloat16(values.dtype):
        return torch.from_numpy(values.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(values, copy=True))


def _memory_array(t: Any) -> np.ndarray:
    """A memory slot back as the collective keeps it (bfloat16 as BFLOAT16 words)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in MESSAGE_DTYPES:
        raise ValueError(f"memory values must be float tensors, got {t!r:.60}")
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(BFLOAT16)
    return t.numpy().copy()


def comm_hook(state, bucket):  # no annotations: DDP checks them, and ours are strings
    """DDP comm hook ``(BoundedLossState, dist.GradBucket) -> Future[Tensor]``: the
    bucket's mean over ranks, through the bounded-loss collective."""
    tensor = bucket.buffer()
    index = bucket.index()
    round_id = state.rounds.get(index, 0)
    state.rounds[index] = round_id + 1
    fut = torch.futures.Future()

    def work() -> None:
        try:
            flat = tensor.detach().reshape(-1)
            host = state.host_buffer(index, flat)
            mean, stats = state.collective.allreduce_mean(as_message(host), round_id, index)
            host.copy_(as_tensor(mean, host.dtype))
            if host is not flat:
                flat.copy_(host)  # back to the bucket's own device, before DDP reads it
            wide = widen(mean)
            state.record(stats, float(np.dot(wide, wide)))
            fut.set_result(tensor)
        except BaseException as e:  # noqa: BLE001 - handed to DDP, which re-raises
            state.failure = e  # DDP re-raises it re-worded; keep the original for callers
            fut.set_exception(e)

    state.executor.submit(work)
    return fut


def register(
    model: torch.nn.Module,
    policy: str | Policy = "dblp",
    *,
    aggregator: str | Aggregator = "unbiased",
    topology: str | None = None,
    transport: TransportConfig | None = None,
    stale_broadcast: bool | None = None,
    hadamard: bool = False,
    loss: LossModel | None = None,
    process_group: Any = None,
    state: BoundedLossState | None = None,
    guard: LossGuard | None = None,
    auth: bool = True,
    freeze: bool = True,
    **policy_kw: Any,
) -> BoundedLossState:
    """Make ``model`` - a ``DistributedDataParallel`` one, or one sharded with FSDP2's
    ``fully_shard`` - exchange gradients (and an FSDP2 model's parameters) over the
    bounded-loss transport.

    DDP: a comm hook averages each bucket over ``topology`` ("ps", "allreduce" or
    "two-level"; by default the one :func:`~boundedloss.collective.default_topology`
    gives the world: the transpose allreduce up to 8 ranks, two levels above); the
    results travel back reliably unless ``stale_broadcast``. FSDP2:
    every FSDP module in ``model`` gets a bounded-loss reduce-scatter (each shard's mean
    over the contributions that arrived) and all-gather (a missing piece of a parameter
    shard keeps its last value; ``stale_broadcast=False`` receives every shard
    reliably instead) - see ``boundedloss.torch.fsdp``; ``topology`` and ``hadamard``
    do not apply there. float32, float16 and bfloat16 (``MixedPrecisionPolicy``) alike.

    Collective: call on every rank. ``transport`` sets the endpoint (default:
    :func:`hook_transport`, i.e. ``TransportConfig``'s defaults with the hook's own,
    and chunks as large as the path MTU between the ranks allows - one packet each, at
    most a 9,000-byte jumbo frame's; ``hook_transport(chunk_bytes=8192)`` to set one:
    a chunk the path cannot carry is then a one-line error). ``policy_kw`` go to
    :func:`make_policy` when ``policy`` is a name. ``guard`` sets the loss guard
    (default: :func:`default_guard` - ``LossGuard()`` for a bounded policy, off for
    reliable; ``LossGuard(rounds=0)`` turns it off). ``state`` resumes from a
    pickled state (its policy, aggregator, transport, guard, round counters, memory
    and paths are kept; the rest is rebuilt); or register afresh and call
    ``state.load_state_dict(...)`` with a ``state_dict()`` saved by ``torch.save``.

    ``auth`` (default True): every datagram carries a nonce and a tag (AES-256-GMAC over
    both addresses, the header and the payload; 24 bytes in all) under a
    per-job key; a datagram whose tag does not verify is counted (``bad_auth``) and
    dropped before anything is written. The key is derived (HKDF-SHA256) from the
    session and a secret: ``BOUNDEDLOSS_SECRET`` (the secret) or
    ``BOUNDEDLOSS_SECRET_FILE`` (a file holding it), the same on every rank; without
    either, rank 0 draws a random one. Every rank checks at rendezvous that all ranks
    hold the same key (and agree on ``auth``); if not, every rank fails with a one-line
    :class:`~boundedloss.protocol.auth.AuthenticationError` naming the ranks that
    differ. ``state.auth`` says which ("secret", "random", "off").

    What it protects: with a secret, the data plane is safe from anyone who lacks the
    secret. Without one, the random key travels over torch.distributed's store (its
    TCPStore) in plaintext, so it protects the data plane only from those who cannot
    read the store's TCP traffic or connect to its port. ``auth=False`` authenticates
    nothing - anyone who can send to the job's UDP ports can write into its gradients -
    and warns once per process (:class:`UnauthenticatedWarning`).

    ``freeze`` (default True): once registered, every object alive in the process - the
    model, the optimizer, torch's modules - is left out of the garbage collector's later
    full collections (``boundedloss.heap.freeze_heap``, ``gc.freeze``). The transport's
    I/O thread needs the GIL, and a full collection over torch's objects holds it for
    tens of milliseconds (72-87 ms measured mid-round, where rounds take 28 ms); frozen
    objects are still freed by reference counting. ``freeze=False`` leaves the collector
    as it was."""
    global _REGISTRATIONS
    moved = sorted(set(policy_kw) & set(_TRANSPORT_KEYWORDS))
    if moved:
        raise TypeError(f"register() takes {', '.join(moved)} in transport=, e.g. "
                        f"transport=hook_transport({moved[0]}=...)")
    if policy_kw and not isinstance(policy, str):
        raise TypeError(f"policy keywords {sorted(policy_kw)} given with a policy object; "
                        "configure the object instead")
    modules = [] if isinstance(model, torch.nn.parallel.DistributedDataParallel) else (
        fsdp_modules(model))
    if modules:
        if topology not in (None, FSDP_TOPOLOGY):
            raise ValueError(f"topology={topology!r} does not apply to an FSDP2 model: its "
                             "gradients are reduce-scattered and its parameters all-gathered")
        if hadamard:
            raise ValueError("hadamard=True does not apply to an FSDP2 model: each rank "
                             "reduces a shard, and a shard of the transform cannot be decoded")
        topology = FSDP_TOPOLOGY
        stale_broadcast = True if stale_broadcast is None else stale_broadcast
    else:
        if topology is not None and topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, "
                             f"got {topology!r}")
        if not hasattr(model, "register_comm_hook"):
            raise TypeError("register() takes a DistributedDataParallel model or one sharded "
                            f"with FSDP2's fully_shard, got {type(model).__name__}")
        stale_broadcast = bool(stale_broadcast)
    if not dist.is_initialized():
        raise RuntimeError("boundedloss.torch.register needs torch.distributed initialised first")
    rank = dist.get_rank(process_group)
    world = dist.get_world_size(process_group)
    if modules:
        check_modules(modules, world)
    store = default_store()
    _REGISTRATIONS += 1
    prefix = f"boundedloss/{_REGISTRATIONS}"
    if not auth:
        warn_unauthenticated()
    if state is None:
        if transport is None:  # chunks follow the path MTU (and leave room for the tag)
            transport = hook_transport(chunk_bytes=agree_chunk_bytes(
                store, prefix, rank, world, local_ip(), trailer=TRAILER_BYTES if auth else 0))
        the_policy = make_policy(policy, **policy_kw) if isinstance(policy, str) else policy
        state = BoundedLossState(
            policy=the_policy,
            aggregator=make_aggregator(aggregator) if isinstance(aggregator, str) else aggregator,
            topology=default_topology(world) if topology is None else topology,
            transport=transport, stale_broadcast=stale_broadcast,
            hadamard=hadamard, guard=default_guard(the_policy) if guard is None else guard,
        )
    else:
        if state.sharded != bool(modules):
            raise ValueError(f"a state of a job on topology {state.topology!r} cannot be "
                             f"registered on {'an FSDP2' if modules else 'a DDP'} model")
        if guard is not None:
            state.guard = guard
        if state.world_size is not None and state.world_size != world:
            raise ValueError(f"a state of a world of {state.world_size} ranks cannot be "
                             f"registered in a world of {world}")
        if state.rank is not None and state.rank != rank:
            raise ValueError(f"rank {state.rank}'s state cannot be registered on rank {rank}: "
                             "each rank resumes its own")

    session = agree_session(store, prefix, rank)
    # (a rank whose auth or secret differs fails here, on every rank, before any UDP)
    job_auth = rendezvous_auth(store, prefix, rank, world, session, enabled=auth)
    endpoint = UdpEndpoint(local_ip(), 0, session=session, config=state.transport, loss=loss,
                           name=f"boundedloss-udp-r{rank}", auth_key=job_auth.key)
    peers = exchange_addresses(store, prefix, rank, world, endpoint.address)
    try:
        for peer in peers:
            if peer != endpoint.address:
                endpoint.check_path(peer)  # a chunk the path cannot carry: say so now
    except TransportError:
        endpoint.close()
        raise
    # (FSDP's halves in two levels where the world has them: O(sqrt N) messages a rank)
    make = TwoLevelAllreduce if state.sharded else TOPOLOGIES[state.topology]
    collective = make(
        endpoint, rank, peers, policy=state.policy, aggregator=state.aggregator,
        stale_broadcast=state.stale_broadcast, hadamard=state.hadamard, session=session,
        guard=state.guard,
    )
    collective.memory.update(state.memory)
    collective.guard.load_state_dict(state.guards)
    for r, path in state.paths.items():
        if r != rank and r < world:
            endpoint.load_path_state(peers[r], path)
    state.rank, state.world_size = rank, world
    state.auth = job_auth.mode
    state.process_group = process_group
    state.endpoint = endpoint
    state.collective = collective
    if modules:
        install(modules, state)  # (FSDP calls them synchronously: no executor)
    else:
        state.executor = ThreadPoolExecutor(max_workers=4,
                                            thread_name_prefix="boundedloss-hook")
        cast(torch.nn.parallel.DistributedDataParallel, model).register_comm_hook(
            state, comm_hook)
    if freeze:
        freeze_heap()
    return state


__all__ = ["HOOK_MAX_OPEN_RECEIVES", "STATE_DICT_FORMAT", "BoundedLossState", "LossGuard",
           "UnauthenticatedWarning", "comm_hook", "default_guard", "hook_transport",
           "register", "warn_unauthenticated"]
