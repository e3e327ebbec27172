"""Receives and sends posted together (``ReceiveBatch``, ``SendBatch``: what an endpoint's
``receive_many`` and ``send_many`` post) share what their size alone decides - and run
exactly as the same posts made one by one."""

from __future__ import annotations

import numpy as np

from boundedloss import wire
from boundedloss.policy import FixedBoundPolicy, ReliablePolicy
from boundedloss.policy.base import MessageInfo, Outcome
from boundedloss.protocol import TransferMux, TransportConfig
from boundedloss.protocol.receiver import ReceiveBatch
from boundedloss.protocol.sender import SendBatch
from boundedloss.wire import Kind

CFG = TransportConfig(chunk_bytes=500, initial_rto=0.01, min_rto=0.002, max_rto=0.1)
SESSION = 11
PEERS = [f"p{i}" for i in range(6)]
#: each peer's message size (two share 3,000 bytes, two 1,234) and whether its chunks
#: carry a critical mask
SIZES = [3000, 3000, 1234, 1234, 777, 2500]
CRITICAL = [False, False, False, False, False, True]
#: the hub's first-pass DATA lost, as (peer, chunk, tseq): the two sends of 3,000 bytes
#: then send chunk 1 again in one poll, each at a tseq of its own
LOST_FROM_HUB = {("p0", 1, 1), ("p1", 0, 0), ("p1", 1, 1), ("p2", 2, 2), ("p5", 0, 0)}


def _payload(i: int) -> np.ndarray:
    return (np.arange(SIZES[i], dtype=np.uint32) * (i + 3)).astype(np.uint8)


def _mask(i: int) -> np.ndarray | None:
    if not CRITICAL[i]:
        return None
    count = wire.chunk_count(SIZES[i], CFG.chunk_bytes)
    return np.arange(count) % 2 == 0


def _exchange(batched: bool, policy) -> tuple[list[bytes], list, list]:
    """A hub posting a receive from each peer and a send to each, batched or one by one;
    the peers doing the same the other way; every datagram delivered but each 5th DATA
    to the hub and those in LOST_FROM_HUB from it (so PROBEs, BITMAPs and
    retransmissions run), timers fired on a virtual clock. What the hub sent, in order,
    and the hub's receive and send results."""
    hub = TransferMux(SESSION, CFG)
    peers = {name: TransferMux(SESSION, CFG) for name in PEERS}
    now = 0.0
    rb = ReceiveBatch() if batched else None
    sb = SendBatch() if batched else None
    receives = [hub.start_receive(name, 4, 9, now, policy=policy, nbytes=SIZES[i],
                                  critical=_mask(i), batch=rb)
                for i, name in enumerate(PEERS)]
    sends = [hub.start_send(name, 4, 10, _payload(i), now, critical=_mask(i), batch=sb)
             for i, name in enumerate(PEERS)]
    for i, mux in enumerate(peers.values()):
        mux.start_send("hub", 4, 9, _payload(i), now, critical=_mask(i))
        mux.start_receive("hub", 4, 10, now, policy=ReliablePolicy(), nbytes=SIZES[i],
                          critical=_mask(i))
    sent: list[bytes] = []
    data_seen = 0
    for _ in range(10_000):
        moved = False
        for parts, peer in hub.poll(now):
            datagram = b"".join(bytes(p) for p in parts)
            sent.append(datagram)
            moved = True
            head = wire.decode(datagram)[0]
            if head.kind == Kind.DATA and (peer, head.index, head.tseq) in LOST_FROM_HUB:
                continue
            peers[peer].datagram_received(datagram, "hub", now)
        for name, mux in peers.items():
            for parts, _ in mux.poll(now):
                datagram = b"".join(bytes(p) for p in parts)
                if datagram[wire.OFFSET["kind"]] == Kind.DATA:
                    data_seen += 1
                    if data_seen % 5 == 0:
                        continue
                hub.datagram_received(datagram, name, now)
                moved = True
        if all(t.result is not None for t in (*receives, *sends)):
            break
        if not moved:
            due = [d for m in (hub, *peers.values()) if (d := m.next_deadline()) is not None]
            now = max(now + 1e-4, min(due))
            for mux in (hub, *peers.values()):
                mux.timer_fired(now)
    else:
        raise AssertionError("the exchange did not finish")
    return sent, [r.result for r in receives], [s.result for s in sends]


def _same_results(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        for field in ("close_reason", "stats", "bound", "peer", "round_id", "message_id"):
            if hasattr(x, field):
                assert getattr(x, field) == getattr(y, field), field
        if hasattr(x, "delivered"):  # (a receive: the chunks that came, where they landed)
            assert np.array_equal(x.delivered, y.delivered)
            cb = x.chunk_bytes
            for i in np.flatnonzero(x.delivered):
                assert bytes(x.data[i * cb:(i + 1) * cb]) == bytes(y.data[i * cb:(i + 1) * cb])


def test_posts_made_together_run_as_the_same_posts_made_one_by_one() -> None:
    for policy in (FixedBoundPolicy(0.3), ReliablePolicy()):
        one_by_one = _exchange(False, policy)
        together = _exchange(True, policy)
        assert one_by_one[0] == together[0]  # every datagram the hub sent, byte for byte
        _same_results(one_by_one[1], together[1])
        _same_results(one_by_one[2], together[2])
        # (the bound let some receives close short: the plans mattered; and the sends
        # retransmitted, each at tseqs of its own)
        if policy.bound:
            assert any(r.stats.delivered < r.stats.chunks for r in together[1])
        assert len({s.stats.datagrams for s in together[2]}) > 2


class _Counting(FixedBoundPolicy):
    """MLT's plan, counting how often it is asked."""

    def __init__(self, p: float):
        super().__init__(p)
        self.planned = 0

    def plan(self, info: MessageInfo):
        self.planned += 1
        return super().plan(info)


class _Learning(_Counting):
    """The same, learning from outcomes (as LTP's Early Close does)."""

    def observe(self, outcome: Outcome) -> None:
        pass


def test_a_batch_plans_once_a_size_unless_the_policy_learns_or_the_chunks_are_critical() -> None:
    hub = TransferMux(SESSION, CFG)
    policy = _Counting(0.2)
    batch = ReceiveBatch()
    receives = [hub.start_receive(name, 1, 2, 0.0, policy=policy, nbytes=SIZES[i],
                                  critical=_mask(i), batch=batch)
                for i, name in enumerate(PEERS)]
    # 3,000, 1,234 and 777 bytes once each, and the critical receive its own
    assert policy.planned == 4
    assert receives[0].plan is receives[1].plan and receives[2].plan is receives[3].plan
    assert receives[0].plan is not receives[2].plan
    # the next batch asks again (the policy may have moved between them)
    again = hub.start_receive("q", 1, 2, 0.0, policy=policy, nbytes=3000, batch=ReceiveBatch())
    assert policy.planned == 5 and again.plan is not receives[0].plan

    learning = _Learning(0.2)
    batch = ReceiveBatch()
    for name in PEERS:
        hub.start_receive(name, 2, 2, 0.0, policy=learning, nbytes=3000, batch=batch)
    assert learning.planned == len(PEERS)


def test_sends_of_one_size_share_their_control_header_not_their_data_headers() -> None:
    hub = TransferMux(SESSION, CFG)
    batch = SendBatch()
    a = hub.start_send("p0", 1, 3, _payload(0), 0.0, batch=batch)
    b = hub.start_send("p1", 1, 3, _payload(1), 0.0, batch=batch)
    assert a.message is b.message  # (a PROBE's header: the same message, the same size)
    # each writes its own tseqs: b's first pass does not touch a's DATA headers
    out_a = [b"".join(bytes(p) for p in parts) for parts, peer in hub.poll(0.0)
             if peer == "p0"]
    assert [wire.decode(d)[0].tseq for d in out_a if d[wire.OFFSET["kind"]] == Kind.DATA] == \
        list(range(a.count))
