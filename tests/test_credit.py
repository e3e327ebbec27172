"""Receiver-driven credit (protocol/credit.py): the shares a receiver grants, the senders
that honour them, and an incast on the simulated network that fits its queue."""

from __future__ import annotations

import pytest

from boundedloss import wire
from boundedloss.policy import ReliablePolicy
from boundedloss.protocol import TransferMux, TransportConfig
from boundedloss.protocol.credit import MIN_SHARE, CreditGrants, ack_cadence
from boundedloss.sim.job import SimJob, run_job
from boundedloss.wire import STOP_PAYLOAD, Flag, Kind
from conftest import SESSION, source_bytes

SERVER = ("10.0.0.1", 9000)


class _Receive:
    """What CreditGrants reads of a receive: its transfer id and its counts' flag."""

    def __init__(self, transfer_id: int):
        self.transfer_id = transfer_id
        self.counts = type("Counts", (), {"parked": False})()


def test_the_budget_is_split_evenly_among_the_receives_heard() -> None:
    grants = CreditGrants(12)
    shares = []
    receives = [_Receive(i) for i in range(4)]
    for r in receives:
        grants.receive_heard(r)
        shares.append(grants.share)
    assert shares == [12, 6, 4, 3]
    assert all(grants.credit(r) == 3 for r in receives)
    grants.receive_heard(receives[0])  # (heard again: nothing changes)
    assert grants.share == 3 and grants.heard == 4
    assert grants.receive_done(receives[1], 0.0) == []
    assert grants.share == 4


def test_past_the_least_share_later_receives_wait_parked_and_are_granted_in_turn() -> None:
    told = []
    grants = CreditGrants(4)
    grants.listener = told.append
    receives = [_Receive(i) for i in range(5)]
    for r in receives:
        grants.receive_heard(r)
    # two hold MIN_SHARE each - the whole budget; the other three wait
    assert grants.share == MIN_SHARE and told == [2]
    assert [grants.credit(r) for r in receives] == [2, 2, 0, 0, 0]
    assert grants.parked == 3
    # one done: the first parked (in the order heard) takes its place
    assert grants.receive_done(receives[0], 0.0) == [receives[2]]
    assert [grants.credit(r) for r in receives[1:]] == [2, 2, 0, 0]
    # a parked one done (closed without credit) frees nothing
    assert grants.receive_done(receives[4], 0.0) == []
    assert grants.receive_done(receives[1], 0.0) == [receives[3]]
    # left alone, the last one gets the whole budget
    assert grants.receive_done(receives[2], 0.0) == []
    assert grants.share == 4 and grants.credit(receives[3]) == 4
    assert grants.receive_done(receives[3], 0.0) == [] and grants.heard == 0


def test_a_budget_below_the_least_share_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        CreditGrants(1)
    with pytest.raises(ValueError, match="two datagrams"):
        TransportConfig(chunk_bytes=1000, credit_bytes=1500)


@pytest.mark.parametrize(("every", "credit", "cadence"),
                         [(32, 200, 32), (32, 100, 25), (32, 10, 2), (32, 3, 1), (32, 0, 1),
                          (32, -1, 1), (4, 100, 4)])
def test_acks_come_four_times_per_credit(every, credit, cadence) -> None:
    assert ack_cadence(every, credit) == cadence


def _sender_and_receiver(credit_bytes: int | None, nbytes: int = 40 * 100):
    cfg = TransportConfig(chunk_bytes=100, credit_bytes=credit_bytes,
                          unscheduled_bytes=3 * 148)
    tx_mux, rx_mux = TransferMux(SESSION, cfg), TransferMux(SESSION, cfg)
    tx = tx_mux.start_send(SERVER, 1, 1, source_bytes(nbytes, 1), 0.0)
    rx = rx_mux.start_receive("worker", 1, 1, 0.0, policy=ReliablePolicy(), nbytes=nbytes)
    return tx_mux, rx_mux, tx, rx


def _data(items: list) -> list:
    return [d for item in items for d in (item.datagrams() if hasattr(item, "datagrams")
                                          else [item])]


def test_a_sender_sends_its_unscheduled_allowance_then_what_each_ack_grants() -> None:
    tx_mux, rx_mux, tx, rx = _sender_and_receiver(credit_bytes=8 * 148)
    first = _data(tx_mux.poll(0.0))
    kinds = [wire.decode(b"".join(parts))[0].kind for parts, _ in first]
    assert kinds == [Kind.DATA] * 3  # the unscheduled allowance, and no more
    acks = []
    for parts, _ in first:
        rx_mux.datagram_received(b"".join(parts), "worker", 0.001)
    for parts, _ in rx_mux.poll(0.001):
        h, payload = wire.decode(b"".join(parts))
        acks.append(h)
        tx_mux.datagram_received(b"".join(parts), SERVER, 0.002)
    # the first DATA is ACKed at once (the grant is news), the next ones every 2 (four
    # ACKs per credit): alone at its receiver, the send has the whole budget
    assert [(h.kind, h.flags & Flag.CREDIT, h.index, h.tseq) for h in acks] == [
        (Kind.ACK, Flag.CREDIT, 8, 0), (Kind.ACK, Flag.CREDIT, 8, 2)]
    assert tx.acks.credit == 8
    more = _data(tx_mux.poll(0.002))
    # 8 in flight beyond the highest the receiver saw (tseq 2): none is, 8 go
    assert len(more) == 8


def test_a_parked_sender_waits_for_its_grant_and_a_lost_one_is_asked_for() -> None:
    cfg = TransportConfig(chunk_bytes=100, credit_bytes=2 * 148, unscheduled_bytes=148)
    server = TransferMux(SESSION, cfg)
    workers = [TransferMux(SESSION, cfg) for _ in range(2)]
    sends = [w.start_send(SERVER, 1, 1, source_bytes(1000, i), 0.0)
             for i, w in enumerate(workers)]
    receives = [server.start_receive(f"w{i}", 1, 1, 0.0, policy=ReliablePolicy(), nbytes=1000)
                for i in range(2)]
    for i, w in enumerate(workers):  # each sends its one unscheduled datagram
        for parts, _ in _data(w.poll(0.0)):
            server.datagram_received(b"".join(parts), f"w{i}", 0.001)
    answers = server.poll(0.001)
    grants = {peer: wire.decode(b"".join(parts))[0].index for parts, peer in answers
              if wire.decode(b"".join(parts))[0].kind == Kind.ACK}
    assert grants == {"w0": 2, "w1": 0}  # the second one heard is parked
    for parts, peer in answers:
        workers[int(peer[1])].datagram_received(b"".join(parts), SERVER, 0.002)
    assert sends[1].acks.credit == 0 and not _data(workers[1].poll(0.002))
    # the grant the server sends it when the first is done is lost; the parked sender's
    # window-stuck PROBE is answered with its grant again
    stuck = workers[1].next_deadline()
    assert stuck is not None
    assert receives[0].grants is not None
    receives[0].grants.receive_done(receives[0], 0.0)  # (the first one's pass is over)
    workers[1].timer_fired(stuck)
    probe = [p for p in workers[1].poll(stuck)]
    assert [wire.decode(b"".join(parts))[0].kind for parts, _ in probe] == [Kind.PROBE]
    server.datagram_received(b"".join(probe[0][0]), "w1", stuck + 0.001)
    answer = [wire.decode(b"".join(parts))[0] for parts, _ in server.poll(stuck + 0.001)]
    assert answer[0].kind == Kind.ACK and answer[0].flags & Flag.CREDIT
    assert answer[0].index == 2  # alone with credit now: the whole budget


def test_an_ack_without_credit_leaves_the_grant_as_it_was() -> None:
    tx_mux, _, tx, _ = _sender_and_receiver(credit_bytes=8 * 148)
    tx_mux.poll(0.0)
    plain = wire.control_datagram(tx.message, Kind.ACK, 0, STOP_PAYLOAD.pack(1), tseq=0)
    tx_mux.datagram_received(plain, SERVER, 0.001)
    assert tx.acks.credit == 3  # (still the unscheduled allowance)


def _incast(credit_bytes: int | None):
    return run_job(SimJob(workers=16, system="reliable", topology="ps", loss=0.0,
                          elements=32768, rounds=6, queue_datagrams=32, link_gbps=10.0,
                          auth=False, credit_bytes=credit_bytes))


def test_credit_keeps_an_incast_inside_the_queue_in_front_of_the_server() -> None:
    """16 workers push 128 KB each at once into a 32-datagram queue on a simulated rack:
    without credit most of the first pass is dropped; with credit (96 KB, under the
    queue's 288 KB) almost none is, and the rounds after the first - whose senders start
    from the grant they learned - run near the link's ideal."""
    blind, credited = _incast(None), _incast(96 * 1024)
    assert blind.queue_drops > 10 * max(1, credited.queue_drops)
    # the ideal round: 15 pushes of 128 KB into the server's 10 Gb/s link, and the
    # broadcast back out of it
    ideal_ms = 2 * 15 * 32768 * 4 * 8 / 10e9 * 1e3
    assert credited.p50_ms <= 1.25 * ideal_ms < blind.p50_ms
