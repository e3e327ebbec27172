"""What every collective shares: peers, message ids, pre-posted receives, round stats,
the loss guard's say in which policy a receive runs under (``guard.py``).

A collective decides *who sends what to whom*; the policy (when a receive is done) and
the aggregator (what a hole becomes) are handed to it. It runs on one UdpEndpoint per
rank; ``peers[r]`` is rank r's UDP address (published at rendezvous).

Receives are posted one round ahead: when a rank finishes bucket b of round t it posts
the receives of bucket b for round t+1 (DDP buckets have the same size every round), so
that a fast peer's first datagrams never find nobody listening. The hard receive
deadline therefore covers the time between rounds too; it is the failure detector
(a dead peer ends the round with PeerFailure within ``receive_deadline``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ..aggregate import Aggregator, HadamardDispersion, element_mask, fill_holes, message_seed
from ..net.endpoint import Endpoint
from ..policy.base import Policy
from ..policy.reliable import ReliablePolicy
from ..protocol import CloseReason, ReceiveResult, TransportError
from .guard import NO_GUARD, LossGuard, LossGuards

PUSH, PULL = 0, 1  # message phases: contributions in, results out

#: a bucket's memory slot: (bucket, role), the role saying whose value it is
#: ("aggregate", "broadcast", "shard", "gather<rank>")
MemoryKey = tuple[int, str]


class PeerFailure(TransportError):
    """A peer stopped answering: the round cannot finish."""


#: bfloat16 words on the wire: numpy has no bfloat16, so they travel as uint16 marked by
#: this dtype's metadata, and are widened to float32 to be aggregated
BFLOAT16 = np.dtype(np.uint16, metadata={"bfloat16": True})


def is_bfloat16(dtype: np.dtype) -> bool:
    return bool(dtype.metadata and dtype.metadata.get("bfloat16"))


def widen(values: np.ndarray) -> np.ndarray:
    """Values to aggregate: 16-bit floats (and bfloat16 words) as float32, the rest as
    they are."""
    if is_bfloat16(values.dtype):
        return (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if values.dtype.kind == "f" and values.dtype.itemsize < 4:
        return values.astype(np.float32)
    return values


def narrow(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Aggregated values back in the message's dtype (bfloat16: rounded to nearest even,
    as torch rounds)."""
    if is_bfloat16(dtype):
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded[np.isnan(values)] = 0x7FC0  # (a quiet NaN stays a NaN)
        return rounded.view(dtype)
    return values.astype(dtype, copy=False)


def message_id(bucket: int, phase: int) -> int:
    return bucket * 2 + phase


@dataclass(frozen=True)
class RoundStats:
    """One collective call on one rank, for the per-round log."""

    round_id: int
    bucket: int
    latency_s: float
    delivered_fraction: float  # mean over the receives this rank made
    min_delivered_fraction: float
    retransmit_rounds: int  # max over this rank's receives and the sends it waited for
    bound: float  # the loss bound in force for contributions this round
    close_reasons: tuple[str, ...]
    #: what the loss guard was shown: the first pass's loss (TransferStats.first_pass_loss,
    #: what the network lost before any recovery), mean over this call's contributions -
    #: a parameter-server worker's broadcast, if stale - received under the job's policy
    #: or the guard in its place; None when there were none
    first_pass_loss: float | None = None
    #: the loss guard held this bucket: its receives were reliable instead of bounded
    guarded: bool = False

    @property
    def deadline_closed(self) -> bool:
        """A receive of this call closed at its hard deadline, with what had arrived."""
        return CloseReason.DEADLINE.name.lower() in self.close_reasons


class Tally:
    """What one rank's receives of one collective call add up to, for RoundStats."""

    def __init__(self) -> None:
        self.fractions: list[float] = []
        self.reasons: list[str] = []
        self.rounds = 0
        self.bound = 0.0
        self.first_pass_losses: list[float] = []  # of the receives the guard watches
        #: what the loss guard was shown (see Collective._guard_round)
        self.first_pass_loss: float | None = None
        self.guarded = False

    def add(self, res: ReceiveResult, posted: Posted) -> None:
        self.fractions.append(res.stats.delivered_fraction)
        self.reasons.append(res.close_reason.name.lower())
        self.rounds = max(self.rounds, res.stats.retransmit_rounds)
        self.bound = max(self.bound, res.bound)
        loss = res.stats.first_pass_loss
        if posted.watched and loss is not None:
            self.first_pass_losses.append(loss)
        self.guarded = self.guarded or posted.guarded

    def stats(self, round_id: int, bucket: int, latency_s: float) -> RoundStats:
        return RoundStats(
            round_id=round_id, bucket=bucket, latency_s=latency_s,
            delivered_fraction=float(np.mean(self.fractions)) if self.fractions else 1.0,
            min_delivered_fraction=float(np.min(self.fractions)) if self.fractions else 1.0,
            retransmit_rounds=self.rounds, bound=self.bound, close_reasons=tuple(self.reasons),
            first_pass_loss=self.first_pass_loss, guarded=self.guarded,
        )


@dataclass(frozen=True)
class Posted:
    """A receive posted for one (bucket, phase, peer) of a round, and the policy it runs
    under."""

    round_id: int
    nbytes: int
    policy: Policy
    future: Future
    #: it runs under the job's policy, or reliably in its place for the loss guard: the
    #: receives whose loss the guard watches
    watched: bool
    #: reliably, for the loss guard (the job's policy would take part of the message)
    guarded: bool
    #: where it lands: a piece of the array the round's result is gathered into (see
    #: ``Collective._gather_target``), or None: a buffer of its own
    into: np.ndarray | None = None


class Collective(abc.ABC):
    """Base class: posting ahead, waiting, failure detection, optional Hadamard."""

    def __init__(
        self,
        endpoint: Endpoint,
        rank: int,
        peers: Sequence[tuple[str, int]],
        *,
        policy: Policy,
        aggregator: Aggregator,
        stale_broadcast: bool = False,
        hadamard: bool = False,
        session: int = 0,
        guard: LossGuard = NO_GUARD,
    ):
        if not 0 <= rank < len(peers) or len(peers) < 2:
            raise ValueError(f"rank {rank} of a world of {len(peers)} (need >= 2)")
        self.endpoint = endpoint
        self.rank = rank
        self.world_size = len(peers)
        self.peers = [tuple(p) for p in peers]
        self.policy = policy
        self.aggregator = aggregator
        self.stale_broadcast = stale_broadcast
        self.hadamard = HadamardDispersion() if hadamard else None
        self.session = session
        #: the loss guard: which buckets' receives are reliable for now (off by default
        #: here; the DDP hook turns it on for bounded policies)
        self.guard = LossGuards(guard, f"rank {rank}")
        self._reliable = ReliablePolicy()  # (stateless: one for every reliable receive)
        self._pending: dict[tuple[int, int, int], Posted] = {}  # (bucket, phase, peer)
        #: post the next round's receives during this one (see the module's docstring);
        #: False before a job's last round, where nothing would use them
        self.post_ahead = True
        #: per-bucket memory, (bucket, role) -> last round's value: the aggregate this
        #: rank made, or the broadcast it accepted (stale fill and bounded drift start
        #: from it; a checkpoint keeps it)
        self.memory: dict[MemoryKey, np.ndarray] = {}
        self._timeout = endpoint.config.receive_deadline + endpoint.config.peer_timeout
        self._full_masks: dict[int, np.ndarray] = {}  # size -> every element arrived
        #: (bucket, role) -> (round, array): where the pieces of a round that receives
        #: posted ahead gather land (``_gather_target``)
        self._targets: dict[MemoryKey, tuple[int, np.ndarray]] = {}

    # ------------------------------------------------------------- receiving
    def _receive_policy(self, bucket: int, phase: int,
                        remembered: bool = True) -> tuple[Policy, bool]:
        """The policy a receive of ``bucket``'s ``phase`` runs under, and whether the job's
        policy would run there (the loss guard watches those): contributions (PUSH) the
        job's, results (PULL) reliably unless ``stale_broadcast`` - and, where the job's
        would run, reliably while the loss guard holds the bucket. ``remembered=False``:
        a result with no last value to keep where a piece is missing (an all-gather's
        first round) is received reliably."""
        if phase == PULL and not (self.stale_broadcast and remembered):
            return self._reliable, False
        return (self._reliable if self.guard.holds(bucket) else self.policy), True

    def _post(self, peer_rank: int, bucket: int, phase: int, round_id: int,
              nbytes: int, remembered: bool = True, into: np.ndarray | None = None) -> Posted:
        return self._post_many({peer_rank: nbytes}, bucket, phase, round_id, remembered,
                               None if into is None else {peer_rank: into})[peer_rank]

    def _post_many(self, nbytes: dict[int, int], bucket: int, phase: int,
                   round_id: int, remembered: bool = True,
                   into: dict[int, np.ndarray] | None = None) -> dict[int, Posted]:
        """Post the receives of ``bucket``'s ``phase`` from each peer rank in ``nbytes``
        (its size), at once (``remembered``: see ``_receive_policy``; ``into``: where
        each lands, by rank, if not in a buffer of its own)."""
        policy, watched = self._receive_policy(bucket, phase, remembered)
        dest = [None] * len(nbytes) if into is None else [into[r] for r in nbytes]
        futures = self.endpoint.receive_many(
            [(self.peers[r], n) for r, n in nbytes.items()],
            message_id=message_id(bucket, phase), round_id=round_id, policy=policy,
            into=dest)
        guarded = watched and policy is not self.policy
        return {r: Posted(round_id, n, policy, fut, watched, guarded=guarded, into=d)
                for (r, n), fut, d in zip(nbytes.items(), futures, dest)}

    def _take(self, peer_rank: int, bucket: int, phase: int, round_id: int,
              nbytes: int, remembered: bool = True, into: np.ndarray | None = None) -> Posted:
        """The receive for this round from ``peer_rank`` (``_take_many`` of one)."""
        return self._take_many({peer_rank: nbytes}, bucket, phase, round_id,
                               {peer_rank: remembered},
                               None if into is None else {peer_rank: into})[peer_rank]

    def _take_many(self, nbytes: dict[int, int], bucket: int, phase: int, round_id: int,
                   remembered: Mapping[int, bool] | None = None,
                   into: Mapping[int, np.ndarray] | None = None) -> dict[int, Posted]:
        """This round's receive from each peer rank in ``nbytes`` (its size), in its order:
        posted ahead last round, or posted now - those together, one batch for each run
        of ranks alike in ``remembered`` (see ``_receive_policy``; True by default), so
        that a size's receives share one plan (``Endpoint.receive_many``); ``into``: where
        each posted now lands, if not in a buffer of its own."""
        taken: dict[int, Posted] = {}
        run: dict[int, int] = {}
        run_remembered = True

        def post_run() -> None:
            taken.update(self._post_many(
                run, bucket, phase, round_id, run_remembered,
                None if into is None else {r: into[r] for r in run}))
            run.clear()

        for peer_rank, size in nbytes.items():
            alike = True if remembered is None else remembered[peer_rank]
            pending = self._posted_ahead(peer_rank, bucket, phase, round_id, size, alike)
            if pending is not None:
                taken[peer_rank] = pending
                continue
            if run and alike != run_remembered:
                post_run()
            run[peer_rank], run_remembered = size, alike
        if run:
            post_run()
        return {r: taken[r] for r in nbytes}

    def _posted_ahead(self, peer_rank: int, bucket: int, phase: int, round_id: int,
                      nbytes: int, remembered: bool) -> Posted | None:
        """The receive posted ahead last round for this one from ``peer_rank``, if it
        will do; None where one must be posted now."""
        pending = self._pending.pop((bucket, phase, peer_rank), None)
        if pending is None:
            return None
        same = pending.round_id == round_id and pending.nbytes == nbytes
        if same and pending.policy is self._receive_policy(bucket, phase, remembered)[0]:
            return pending
        # Posted for another round or size (DDP rebuilds its buckets after the first
        # iteration), or under a policy the loss guard has since changed (its state
        # loaded between rounds) or that no longer fits the memory (a checkpoint
        # without it loaded): cancel it - silently, the peer's probe finds the new
        # one - unless it had closed already.
        self.endpoint.cancel(pending.future)
        if same and pending.future.result(self._timeout).close_reason != (
                CloseReason.CANCELLED):
            return pending  # it had closed already: the peer will not send it again
        return None

    def _post_ahead(self, nbytes: dict[int, int], bucket: int, phase: int,
                    round_id: int, into: dict[int, np.ndarray] | None = None) -> None:
        """Post next round's receives now (see the module's docstring), from each peer
        rank in ``nbytes`` (its size; ``into``: where each lands, if not in a buffer of
        its own) - unless ``post_ahead`` is off."""
        if not self.post_ahead:
            return
        for peer_rank, posted in self._post_many(nbytes, bucket, phase, round_id,
                                                 into=into).items():
            self._pending[(bucket, phase, peer_rank)] = posted

    # ------------------------------------------------------ gathering in place
    def _in_place(self) -> bool:
        """Whether results are gathered where they land: when they are received
        reliably (no ``stale_broadcast``), every piece arrives whole and none needs a
        last value kept, so the receives write straight into the round's result -
        no buffer of their own, no copy."""
        return not self.stale_broadcast

    def _gather_target(self, key: MemoryKey, round_id: int, size: int,
                       dtype: np.dtype) -> np.ndarray:
        """The array (``size`` of ``dtype``) a round's result of ``key`` (bucket, role)
        is gathered into: the one the receives posted ahead for it write into, if it is
        this round's and of that size and type, or else a new one."""
        held = self._targets.pop(key, None)
        if held is not None:
            held_round, target = held
            if (held_round == round_id and target.size == size and target.dtype == dtype
                    and target.dtype.metadata == dtype.metadata):
                return target
        return np.empty(size, dtype=dtype)

    def _post_target_ahead(self, key: MemoryKey, round_id: int, size: int, dtype: np.dtype,
                           bounds: dict[int, tuple[int, int]]) -> dict[int, np.ndarray] | None:
        """Round ``round_id``'s array for ``key`` (bucket, role), ``size`` of ``dtype``,
        and each other rank's piece of it by ``bounds``: where the receives posted ahead
        land. None where results are not gathered in place or nothing is posted ahead."""
        if not (self.post_ahead and self._in_place()):
            return None
        target = np.empty(size, dtype=dtype)
        self._targets[key] = (round_id, target)
        return {r: target[lo:hi] for r, (lo, hi) in bounds.items() if r != self.rank}

    def _wait(self, posted: Posted, what: str) -> ReceiveResult:
        try:
            res = posted.future.result(timeout=self._timeout)
        except TimeoutError:
            raise PeerFailure(f"{what}: no result within {self._timeout:.0f} s") from None
        if res.close_reason == CloseReason.DEADLINE and not res.delivered.any():
            raise PeerFailure(
                f"{what}: nothing arrived within the {self.endpoint.config.receive_deadline:g} s "
                "receive deadline - is the peer alive?"
            )
        if (res.close_reason == CloseReason.DEADLINE and res.bound == 0.0 and not res.complete
                and not posted.guarded):
            # a receive that tolerates no loss never hands on part of a message (one the
            # loss guard made reliable does: the job's policy tolerates loss)
            raise PeerFailure(
                f"{what}: {res.stats.delivered} of {res.stats.chunks} chunks arrived within "
                f"the {self.endpoint.config.receive_deadline:g} s receive deadline, and this "
                "receive tolerates no loss - is the peer alive, and can the path carry it in "
                "that time?"
            )
        return res

    def _guard_round(self, bucket: int, round_id: int, tally: Tally) -> None:
        """This call's first receives under the job's policy (the contributions; a
        parameter-server worker's broadcast) are in: show their mean first-pass loss to
        the loss guard - before the bucket's next receives are posted, so that they run
        under what it decides."""
        losses = tally.first_pass_losses
        tally.first_pass_loss = float(np.mean(losses)) if losses else None
        self.guard.observe(bucket, round_id, tally.first_pass_loss, self.policy.bound)

    def _wait_sends(self, futures: list[tuple[int, Future]]) -> int:
        rounds = 0
        for peer_rank, fut in futures:
            try:
                res = fut.result(timeout=self._timeout)
            except TimeoutError:
                raise PeerFailure(f"send to rank {peer_rank} did not finish") from None
            if not res.ok:
                raise PeerFailure(
                    f"rank {peer_rank} at {self.peers[peer_rank]} stopped answering "
                    f"({res.status.value} after {res.stats.elapsed:.1f} s)"
                )
            rounds = max(rounds, res.stats.retransmit_rounds)
        return rounds

    def _reduce(self, own: np.ndarray, posted: dict[int, Posted], round_id: int, bucket: int,
                what: str, tally: Tally, memory_key: MemoryKey,
                guard: bool = True) -> np.ndarray:
        """Aggregate ``own`` with what arrived from each peer in ``posted`` (posting
        each peer's receive for the next round as soon as this one is in). ``guard``:
        show these receives' loss to the loss guard (once a call: a call that reduces
        twice shows it the first)."""
        contributions = [widen(own)]  # (16-bit values are aggregated in float32)
        masks = [self._every_element(own.size)]  # (shared, read-only: every element)
        for peer_rank, receive in posted.items():
            res = self._wait(
                receive, f"{what} from rank {peer_rank} (round {round_id}, bucket {bucket})")
            values, mask = self._elements(res, own.size, own.dtype)
            contributions.append(widen(values))
            masks.append(mask)
            tally.add(res, receive)
        if guard:
            self._guard_round(bucket, round_id, tally)
        # (no peer sends its next before it has this round's result)
        self._post_ahead(dict.fromkeys(posted, own.nbytes), bucket, PUSH, round_id + 1)
        previous = self._remembered(memory_key, own.shape)
        agg = self.aggregator.aggregate(contributions, masks,
                                        previous=None if previous is None else widen(previous))
        agg = np.ascontiguousarray(narrow(np.asarray(agg), own.dtype))
        self.memory[memory_key] = agg
        return agg

    def _remembered(self, memory_key: MemoryKey, shape: tuple) -> np.ndarray | None:
        """Last round's value for this bucket - unless the bucket changed size (DDP
        rebuilds its buckets after the first iteration): then there is none."""
        previous = self.memory.get(memory_key)
        return previous if previous is not None and previous.shape == shape else None

    def _accept_broadcast(self, res: ReceiveResult, size: int, dtype,
                          memory_key: MemoryKey) -> np.ndarray:
        """A received result: lost values keep their previous value (bounded drift)."""
        values, mask = self._elements(res, size, dtype)
        # (every chunk delivered: the shared all-true mask, not scanned again)
        if mask is self._full_masks.get(size) or mask.all():
            result = values  # (the receive's own buffer, which nothing writes any more)
        else:  # (the lost values filled in the receive's own buffer, as above)
            result = fill_holes(values, mask, self._remembered(memory_key, values.shape))
        if self.stale_broadcast:  # (the only reader: a piece that did not arrive)
            self.memory[memory_key] = result
        return result

    # ----------------------------------------------------------------- masks
    def _elements(self, res: ReceiveResult, n: int, dtype) -> tuple[np.ndarray, np.ndarray]:
        values = res.data.view(dtype)[:n]
        if res.delivered.all():  # (every chunk: one shared, read-only mask per size)
            return values, self._every_element(n)
        mask = element_mask(res.delivered, res.chunk_bytes, n, np.dtype(dtype).itemsize)
        return values, mask

    def _every_element(self, n: int) -> np.ndarray:
        mask = self._full_masks.get(n)
        if mask is None:
            if len(self._full_masks) > 64:  # (DDP's buckets: a handful of sizes)
                self._full_masks.clear()
            mask = self._full_masks[n] = np.ones(n, dtype=bool)
            mask.flags.writeable = False
        return mask

    # -------------------------------------------------------------- hadamard
    def _encode(self, x: np.ndarray, round_id: int, bucket: int) -> np.ndarray:
        if self.hadamard is None:
            return x
        seed = message_seed(self.session, round_id, bucket)
        return narrow(self.hadamard.encode(widen(x), seed), x.dtype)

    def _decode(self, y: np.ndarray, round_id: int, bucket: int, n: int) -> np.ndarray:
        if self.hadamard is None:
            return y
        seed = message_seed(self.session, round_id, bucket)
        return narrow(self.hadamard.decode(widen(y), seed, n), y.dtype)

    @abc.abstractmethod
    def allreduce_mean(self, x: np.ndarray, round_id: int,
                       bucket: int = 0) -> tuple[np.ndarray, RoundStats]:
        """The mean of every rank's ``x`` (1-D float array) - as far as it arrived;
        each topology (ParameterServer, TransposeAllreduce, TwoLevelAllreduce) is one way
        of computing it."""

    def close(self) -> None:
        for pending in self._pending.values():
            self.endpoint.cancel(pending.future)
        self._pending.clear()
        self._targets.clear()

    def _clock(self) -> float:
        """Now, on the endpoint's clock (virtual on a simulated network)."""
        return self.endpoint.clock()
