"""The DDP comm hook and its state object (as torch's PowerSGD hook: a pure hook
function, every tunable and per-bucket memory in one documented, picklable state).

    state = boundedloss.torch.register(ddp_model, policy="dblp")

``register`` is collective: every rank calls it after ``init_process_group``. It binds a
UDP endpoint on the address this rank uses to reach the others, publishes it on
torch.distributed's store, agrees on a random 64-bit session token (carried in every
datagram), builds the collective and registers :func:`comm_hook`. The Gloo process group
stays the control plane (rendezvous, the end-of-epoch phase agreement) and the reliable
baseline.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..aggregate import Aggregator, make_aggregator
from ..collective import BFLOAT16, TOPOLOGIES, Collective, MemoryKey, RoundStats, widen
from ..net.loss import LossModel
from ..net.udp import UdpEndpoint
from ..policy import Policy, make_policy
from ..protocol import TransportConfig, TransportError
from .rendezvous import (
    agree_chunk_bytes,
    agree_session,
    default_store,
    exchange_addresses,
    local_ip,
)

_REGISTRATIONS = 0  # distinct store keys when a process registers more than once

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


@dataclass
class BoundedLossState:
    """Everything the hook needs. Picklable for checkpoints: the process group, the
    socket and the threads are not pickled; policy state (e.g. DBLP's phase history),
    round counters and per-bucket memory (previous aggregates for stale fill) are."""

    policy: Policy
    aggregator: Aggregator
    topology: str = "ps"
    #: the endpoint's settings (chunk size, receive deadline, PROBE copies, ...)
    transport: TransportConfig = field(default_factory=hook_transport)
    stale_broadcast: bool = False
    hadamard: bool = False
    rounds: dict[int, int] = field(default_factory=dict)  # bucket index -> next round id
    round_log: list[dict] = field(default_factory=list)
    epoch: int = 0
    #: the collective's per-bucket memory, as of the last pickling (restored at register)
    memory: dict[MemoryKey, np.ndarray] = field(default_factory=dict, repr=False)
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
        if self.collective is not None:
            d["memory"] = dict(self.collective.memory)
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        for k in self._RUNTIME:
            self.__dict__[k] = None
        self._lock = threading.Lock()
        self._staging = {}

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

    def record(self, stats: RoundStats, grad_sq: float) -> None:
        """Log one collective call (a bucket of a round); ``grad_sq`` is its result's
        squared L2 norm, summed per round into the epoch's gradient norm."""
        bound = self.bound
        entry = {
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
        }
        with self._lock:
            self.round_log.append(entry)
            self._round_sq[stats.round_id] = self._round_sq.get(stats.round_id, 0.0) + grad_sq

    # ------------------------------------------------------------ epoch ends
    def epoch_end(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """Call on every rank at the end of each epoch.

        Feeds the policy (DBLP's critical-regime detector) the epoch's mean gradient L2
        norm - rank 0's measurement, broadcast over the Gloo control plane so that every
        rank switches phase at the same round - and tells it about learning-rate
        changes. Returns what was decided, for the log."""
        with self._lock:
            norms = [v ** 0.5 for v in self._round_sq.values()]
            self._round_sq.clear()
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


#: dtypes that travel as they are (numpy has them); bfloat16 travels as BFLOAT16 words;
#: anything else as float32
_NATIVE_DTYPES = (torch.float32, torch.float64, torch.float16)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU bucket as the message the collective sends: 16-bit floats in their own
    dtype (half the bytes; aggregated in float32), bfloat16 as its 16-bit words."""
    if t.dtype in _NATIVE_DTYPES:
        return t.numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.float().numpy()


def _as_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The collective's result as a tensor of the bucket's dtype."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


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
            mean, stats = state.collective.allreduce_mean(_as_numpy(host), round_id, index)
            host.copy_(_as_tensor(mean, host.dtype))
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
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    policy: str | Policy = "dblp",
    *,
    aggregator: str | Aggregator = "unbiased",
    topology: str = "ps",
    transport: TransportConfig | None = None,
    stale_broadcast: bool = False,
    hadamard: bool = False,
    loss: LossModel | None = None,
    process_group: Any = None,
    state: BoundedLossState | None = None,
    **policy_kw: Any,
) -> BoundedLossState:
    """Make ``ddp_model`` exchange gradients over the bounded-loss transport.

    Collective: call on every rank. ``transport`` sets the endpoint (default:
    :func:`hook_transport`, i.e. ``TransportConfig``'s defaults with the hook's own,
    and chunks as large as the path MTU between the ranks allows - one packet each, at
    most a 9,000-byte jumbo frame's; ``hook_transport(chunk_bytes=8192)`` to set one:
    a chunk the path cannot carry is then a one-line error). ``policy_kw`` go to
    :func:`make_policy` when ``policy`` is a name. ``state`` resumes from a
    checkpointed state (its policy, aggregator, transport, round counters and memory
    are kept; the rest is rebuilt)."""
    global _REGISTRATIONS
    moved = sorted(set(policy_kw) & set(_TRANSPORT_KEYWORDS))
    if moved:
        raise TypeError(f"register() takes {', '.join(moved)} in transport=, e.g. "
                        f"transport=hook_transport({moved[0]}=...)")
    if policy_kw and not isinstance(policy, str):
        raise TypeError(f"policy keywords {sorted(policy_kw)} given with a policy object; "
                        "configure the object instead")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
    if not dist.is_initialized():
        raise RuntimeError("boundedloss.torch.register needs torch.distributed initialised first")
    rank = dist.get_rank(process_group)
    world = dist.get_world_size(process_group)
    store = default_store()
    _REGISTRATIONS += 1
    prefix = f"boundedloss/{_REGISTRATIONS}"
    if state is None:
        if transport is None:  # chunks follow the path MTU
            transport = hook_transport(
                chunk_bytes=agree_chunk_bytes(store, prefix, rank, world, local_ip()))
        state = BoundedLossState(
            policy=make_policy(policy, **policy_kw) if isinstance(policy, str) else policy,
            aggregator=make_aggregator(aggregator) if isinstance(aggregator, str) else aggregator,
            topology=topology, transport=transport, stale_broadcast=stale_broadcast,
            hadamard=hadamard,
        )

    session = agree_session(store, prefix, rank)
    endpoint = UdpEndpoint(local_ip(), 0, session=session, config=state.transport, loss=loss,
                           name=f"boundedloss-udp-r{rank}")
    peers = exchange_addresses(store, prefix, rank, world, endpoint.address)
    try:
        for peer in peers:
            if peer != endpoint.address:
                endpoint.check_path(peer)  # a chunk the path cannot carry: say so now
    except TransportError:
        endpoint.close()
        raise
    collective = TOPOLOGIES[state.topology](
        endpoint, rank, peers, policy=state.policy, aggregator=state.aggregator,
        stale_broadcast=state.stale_broadcast, hadamard=state.hadamard, session=session,
    )
    collective.memory.update(state.memory)
    state.process_group = process_group
    state.endpoint = endpoint
    state.collective = collective
    state.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="boundedloss-hook")
    ddp_model.register_comm_hook(state, comm_hook)
    return state


__all__ = ["HOOK_MAX_OPEN_RECEIVES", "BoundedLossState", "comm_hook", "hook_transport",
           "register"]
