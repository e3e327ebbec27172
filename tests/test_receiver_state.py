"""The receiver's explicit state: what moves a receive from state to state, what each
state lets a met bound do, and the counters the compiled data path shares with it."""

from __future__ import annotations

import pytest

from boundedloss import wire
from boundedloss.policy import ClosePlan, MessageInfo, Policy
from boundedloss.protocol import CloseReason, MessageReceiver, TransportConfig
from boundedloss.protocol.receiver import (
    _TRANSITIONS,
    ReceiveEvent,
    ReceiveState,
)
from boundedloss.wire import Flag, Kind

CHUNK = 1000
SESSION = 0x1234


class HalfAfter(Policy):
    """Half the chunks are enough; whatever arrived is taken ``accept_after`` s in."""

    def __init__(self, accept_after: float | None = None):
        self.accept_after = accept_after

    def plan(self, info: MessageInfo) -> ClosePlan:
        return ClosePlan(min_delivered=info.chunk_count // 2, bound=0.5,
                         accept_after=self.accept_after)


def _receiver(policy: Policy, nbytes: int | None = 10 * CHUNK) -> MessageReceiver:
    return MessageReceiver(peer="p", session=SESSION, round_id=1, message_id=2,
                           policy=policy, config=TransportConfig(chunk_bytes=CHUNK),
                           now=0.0, nbytes=nbytes)


def _data(rx: MessageReceiver, index: int, now: float, out: list) -> None:
    rx.data_received(index, CHUNK, index, bytes(wire.HEADER_BYTES + CHUNK), now, out)


def _final_probe(rx: MessageReceiver, now: float, out: list) -> None:
    rx.probe_received(1, Flag.FINAL, now, out)


def _stops(out: list) -> list[bytes]:
    return [parts[0] for parts, _ in out if wire.parse(parts[0])[0] == Kind.STOP]


def test_a_met_bound_waits_for_the_first_pass_then_the_final_probe_closes():
    """In its first pass a receive whose bound is met keeps taking DATA (it costs
    nothing); the sender's FINAL PROBE moves it on, and the met bound closes it."""
    rx = _receiver(HalfAfter())
    out: list = []
    assert rx.state is ReceiveState.FIRST_PASS and not rx.counts.early_stop
    for i in range(6):
        _data(rx, i, 0.1, out)
    assert rx.state is ReceiveState.FIRST_PASS and rx.result is None
    _final_probe(rx, 0.2, out)
    assert rx.state is ReceiveState.CLOSED
    assert rx.result.close_reason is CloseReason.BOUND_MET and len(_stops(out)) == 1


def test_the_final_probe_before_the_bound_leaves_it_waiting_and_free_to_stop():
    rx = _receiver(HalfAfter())
    out: list = []
    _data(rx, 0, 0.1, out)
    _final_probe(rx, 0.2, out)
    assert rx.state is ReceiveState.SENDER_DONE and rx.counts.early_stop
    _final_probe(rx, 0.3, out)  # a later pass's PROBE is FINAL too
    assert rx.state is ReceiveState.SENDER_DONE
    for i in range(1, 4):
        _data(rx, i, 0.4, out)
    assert rx.state is ReceiveState.SENDER_DONE  # 4 of 10: the bound needs 5
    _data(rx, 4, 0.5, out)
    assert rx.state is ReceiveState.CLOSED and rx.result.close_reason is CloseReason.BOUND_MET


def test_the_acceptance_deadline_takes_what_arrived():
    rx = _receiver(HalfAfter(accept_after=1.0))
    out: list = []
    _data(rx, 0, 0.1, out)
    rx.timer_fired(1.0, out)
    assert rx.state is ReceiveState.CLOSED
    assert rx.result.close_reason is CloseReason.ACCEPT_DEADLINE
    assert rx.result.stats.delivered == 1


def test_a_receive_posted_without_a_size_waits_for_its_geometry():
    rx = _receiver(HalfAfter(), nbytes=None)
    out: list = []
    assert rx.state is ReceiveState.SIZELESS and rx.next_deadline() is not None
    rx.close_if_done(0.0, out)  # no plan yet: nothing to close on
    assert rx.state is ReceiveState.SIZELESS
    assert rx.geometry_matches(10 * CHUNK, CHUNK, 0.1, out)
    assert rx.state is ReceiveState.FIRST_PASS and rx.count == 10


def test_a_closed_receive_stays_closed():
    rx = _receiver(HalfAfter())
    out: list = []
    rx.cancel(0.1, out)
    assert rx.state is ReceiveState.CLOSED and rx.next_deadline() is None
    rx.timer_fired(99.0, out)
    rx.cancel(0.2, out)
    assert rx.result.close_reason is CloseReason.CANCELLED and _stops(out) == []


def test_every_state_but_closed_can_close_and_closed_goes_nowhere():
    for state in ReceiveState:
        closes = _TRANSITIONS.get((state, ReceiveEvent.CLOSED))
        if state is ReceiveState.CLOSED:
            assert not [key for key in _TRANSITIONS if key[0] is state]
        else:
            assert closes is ReceiveState.CLOSED, state
    # the two ways past the first pass, in either order, end where a met bound closes
    for a, b in ((ReceiveEvent.SENDER_DONE, ReceiveEvent.ACCEPT_DEADLINE),
                 (ReceiveEvent.ACCEPT_DEADLINE, ReceiveEvent.SENDER_DONE)):
        state = _TRANSITIONS[(ReceiveState.FIRST_PASS, a)]
        assert _TRANSITIONS[(state, b)] is ReceiveState.ACCEPTING


def test_an_event_with_no_transition_is_a_loud_error():
    rx = _receiver(HalfAfter())
    with pytest.raises(AssertionError, match="no transition"):
        rx._transition(ReceiveEvent.SIZED)  # noqa: SLF001 - (sized twice)
