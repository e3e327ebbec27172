"""The sender's parts, each through its public methods: Recovery (round trips, timeouts,
PROBE copies), Pacer (token bucket, delivery-rate samples), PeerPath (what a peer's
sends and receives leave for the next ones) and the sender's explicit state."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundedloss import wire
from boundedloss.protocol import TransferMux, TransportConfig
from boundedloss.protocol.loss_prior import (
    HORIZON,
    PRIOR_DATAGRAMS,
    QUIET_EVIDENCE,
    LossPrior,
    pass_loss,
)
from boundedloss.protocol.pacing import Pacer
from boundedloss.protocol.path import LOSS_MEMORY, RATE_SAMPLES, PeerPath, RttEstimate
from boundedloss.protocol.recovery import Recovery, _loss_limit, copies_for
from boundedloss.protocol.rtt_prior import RttPrior
from boundedloss.protocol.sender import SendState
from boundedloss.protocol.types import DataRun
from boundedloss.wire import CloseReason, Flag, Kind
from conftest import PROPERTY

CFG = TransportConfig(chunk_bytes=1000, initial_rto=0.05, min_rto=0.002, max_rto=0.5,
                      probe_backoff_limit=2.0, probe_copies_max=32, probe_miss_target=0.01)


# ----------------------------------------------------------------- Recovery
def test_recovery_starts_from_the_initial_rto_or_the_path_round_trip() -> None:
    assert Recovery(CFG).rto == CFG.initial_rto and Recovery(CFG).srtt is None
    r = Recovery(CFG, RttEstimate(srtt=2e-3, rttvar=1e-3))
    assert r.rto == pytest.approx(2e-3 + 4 * 1e-3) == r.rto_base
    assert r.rtt_estimate == RttEstimate(2e-3, 1e-3)


def test_a_send_with_no_round_trip_of_its_own_waits_as_its_endpoint_s_measured() -> None:
    """A cold path's PROBE times out as the endpoint's other paths' round trips call for
    - never later than the initial RTO, and only until it has timed out or measured
    one of its own."""
    prior = RttPrior()
    r = Recovery(CFG, rtt_prior=prior)
    assert r.probe_timeout() == CFG.initial_rto  # (nothing measured anywhere yet)
    Recovery(CFG, rtt_prior=prior).rtt_sample(1e-3)  # another send, to another peer
    assert prior.known and prior.rto(CFG) == pytest.approx(1e-3 + 4 * 0.5e-3)  # RFC 6298
    assert r.probe_timeout() == pytest.approx(1e-3 + 4 * 0.5e-3) == r.rto_base
    r.probe_timed_out()  # backs off from there, and no longer follows the endpoint
    assert r.rto == pytest.approx(2 * 3e-3)
    prior.sample(1e-4)
    assert r.probe_timeout() == pytest.approx(6e-3)
    slow = RttPrior()
    slow.sample(1.0)  # (the endpoint's paths slower than the initial RTO: not waited)
    assert Recovery(CFG, rtt_prior=slow).probe_timeout() == CFG.initial_rto
    own = Recovery(CFG, RttEstimate(srtt=4e-3, rttvar=1e-3), rtt_prior=prior)
    assert own.probe_timeout() == pytest.approx(8e-3)  # (its path's own, not the endpoint's)
    r2 = Recovery(CFG, rtt_prior=prior)
    r2.rtt_sample(0.02)  # its own
    assert r2.probe_timeout() == r2.rto == pytest.approx(0.02 + 4 * 0.01)


def test_recovery_rtt_samples_follow_rfc6298_within_the_clamp() -> None:
    r = Recovery(CFG)
    r.rtt_sample(0.010)
    assert r.rtt_estimate == RttEstimate(0.010, 0.005)
    assert r.rto == pytest.approx(0.010 + 4 * 0.005)
    r.rtt_sample(0.002)
    assert r.srtt == pytest.approx(0.875 * 0.010 + 0.125 * 0.002)
    r.rtt_sample(10.0)  # far beyond max_rto
    assert r.rto == CFG.max_rto
    tiny = Recovery(CFG)
    tiny.rtt_sample(1e-6)
    assert tiny.rto == CFG.min_rto


def test_recovery_backs_off_to_the_limit_and_an_answer_resets_it() -> None:
    r = Recovery(CFG, RttEstimate(srtt=4e-3, rttvar=1e-3))  # rto 8 ms
    r.probe_timed_out()
    assert r.rto == pytest.approx(16e-3) and r.unanswered == 1
    r.probe_timed_out()
    assert r.rto == pytest.approx(16e-3)  # probe_backoff_limit x the round trips' RTO
    r.data_sent(0.0, 10)
    unrepeated, got = r.reply_received(4e-3)
    assert not unrepeated and got == 10 and r.unanswered == 0
    assert r.rto == r.rto_base  # the new sample's RTO, no backoff left


@pytest.mark.parametrize(("q", "copies"), [(0.0, 1), (0.01, 1), (0.5, 7), (0.8, 21),
                                            (0.99, 32), (1.0, 32)])
def test_recovery_copies_for_a_loss_meet_the_miss_target(q: float, copies: int) -> None:
    r = Recovery(CFG)
    assert r.copies_for(q) == copies
    if 1 < copies < CFG.probe_copies_max:  # the fewest copies that meet the target
        assert q ** copies <= CFG.probe_miss_target < q ** (copies - 1)


def test_recovery_sizes_the_next_probe_from_the_last_pass_loss() -> None:
    r = Recovery(CFG)
    r.data_sent(0.0, 100)
    assert r.pass_started_at == 0.0
    r.probe_copies(0.001, first_pass=False)
    r.missing_reported(30)
    r.missing_reported(20)  # a second BITMAP segment of the same answer
    assert r.reply_missing == 50
    assert r.reply_received(2e-3) == (True, 50)
    assert r.pass_started_at is None
    assert r.probe_copies(0.003, first_pass=False) == r.copies_for(0.5) == 7


def _answered_pass(r: Recovery, sent: int, missing: int) -> int:
    """A pass of ``sent`` datagrams whose answer reports ``missing`` of them: the copies
    the next PROBE goes in."""
    r.data_sent(0.0, sent)
    r.probe_copies(0.0, first_pass=False)
    r.missing_reported(missing)
    r.reply_received(1e-3)
    return r.probe_copies(0.002, first_pass=False)


def test_a_short_pass_is_read_against_the_endpoints_recent_loss() -> None:
    """One datagram lost of one is not a path that loses everything (32 copies, each
    answered): where a sixth of what the endpoint sent lately was lost, it reads as a
    third."""
    prior = LossPrior()
    prior.data_sent(600)
    prior.missing_reported(100)
    r = Recovery(CFG, loss_prior=prior)
    copies = _answered_pass(r, sent=1, missing=1)
    q = pass_loss(1, 1, 101 / 601)
    assert q == (1 + PRIOR_DATAGRAMS * 101 / 601) / (1 + PRIOR_DATAGRAMS)
    assert q == pytest.approx(1 / 3, abs=0.01)
    assert copies == r.copies_for(q) == 5 < r.copies_for(1.0) == 32
    # an endpoint that has lost all it sent lately gets no relief
    assert _answered_pass(Recovery(CFG, loss_prior=LossPrior()), sent=1, missing=1) == 32


def test_a_long_pass_keeps_its_own_loss_and_a_sends_later_passes_read_as_it() -> None:
    """A microburst that takes most of a long pass still calls for the copies it did,
    however little the endpoint lost before; and the short passes that end the send
    inside the burst read as the burst the longer ones measured, not as the endpoint's
    quiet past (a few copies there would cost a timeout a pass)."""
    prior = LossPrior()
    prior.data_sent(4000)
    prior.missing_reported(40)
    r = Recovery(CFG, loss_prior=prior)
    first = pass_loss(160, 200, 200 / 4200)  # (the prior counts this pass too)
    assert first == pytest.approx(0.8, abs=0.04)
    copies = _answered_pass(r, sent=200, missing=160)
    assert copies == r.copies_for(first) >= r.copies_for(0.8) - 2
    second = pass_loss(32, 40, first)
    assert _answered_pass(r, sent=40, missing=32) == r.copies_for(second)
    tail = pass_loss(2, 2, second)  # two of two lost: read against the burst
    assert _answered_pass(r, sent=2, missing=2) == r.copies_for(tail) >= r.copies_for(0.8)
    # the same tail pass as a send's first answered one, on the quiet endpoint: few
    assert _answered_pass(Recovery(CFG, loss_prior=prior), sent=2, missing=2) <= 6


def test_the_loss_prior_forgets_by_halves() -> None:
    prior = LossPrior()
    assert prior.rate() == 0.0
    prior.data_sent(HORIZON)
    prior.missing_reported(HORIZON // 2)
    assert prior.rate() == 0.5
    prior.data_sent(HORIZON)  # past the horizon: both counts halve, the rate with them
    assert prior.sent == HORIZON and prior.rate() == pytest.approx(0.25)
    prior.missing_reported(10 * HORIZON)  # (never more than everything)
    assert prior.rate() == 1.0


def _shuttle(a: TransferMux, b: TransferMux, now: float) -> tuple[float, list[wire.Header]]:
    """Deliver what ``a`` (at "a") and ``b`` (at "b") poll to each other, a millisecond a
    turn, until both are quiet; the headers of what ``a`` sent."""
    sent = []
    for _ in range(20):
        moved = False
        for src, dst, name in ((a, b, "a"), (b, a, "b")):
            for parts, _ in src.poll(now):
                data = b"".join(bytes(p) for p in parts)
                if src is a:
                    sent.append(wire.decode(data)[0])
                dst.datagram_received(data, name, now)
                moved = True
        now += 1e-3
        if not moved:
            break
    return now, sent


def _first_pass_ends(a: TransferMux, b: TransferMux, round_id: int, now: float):
    """A 5-chunk message from a to b: how its first pass ended (the last DATA's flags,
    and the PROBEs that went on their own), once it is done."""
    from boundedloss.policy import ReliablePolicy

    rx = b.start_receive("a", round_id, 0, now, policy=ReliablePolicy())
    tx = a.start_send("b", round_id, 0, np.arange(5000, dtype=np.uint8), now)
    now, sent = _shuttle(a, b, now)
    assert tx.result.ok and rx.result.complete
    data = [h for h in sent if h.kind == Kind.DATA]
    return now, data[-1].flags, sum(h.kind == Kind.PROBE for h in sent)


def test_a_warm_send_on_a_path_that_loses_nothing_carries_its_first_probe() -> None:
    """Cold (no round trip measured), a send PROBEs on its own; once the STOP answering
    that PROBE has measured the path, the next send's last DATA carries its PROBE - until
    a send has lost something, when the PROBE goes on its own again (a carried PROBE is
    lost with its DATA: recovery.may_carry_probe)."""
    a, b = TransferMux(7, CFG), TransferMux(7, CFG)
    now, flags, probes = _first_pass_ends(a, b, 1, 0.0)
    assert (flags, probes) == (Flag.NONE, 1) and a.path("b").rtt is not None
    now, flags, probes = _first_pass_ends(a, b, 2, now)
    assert (flags, probes) == (Flag.NONE, 1)  # (measured, but too little sent to read as quiet)
    _answered(a.loss_prior, QUIET_EVIDENCE)  # (as a job's earlier lossless sends)
    now, flags, probes = _first_pass_ends(a, b, 3, now)
    assert (flags, probes) == (Flag.PROBE_CARRIED, 0)
    a.loss_prior.missing_reported(1)  # (an answer reported a chunk missing)
    now, flags, probes = _first_pass_ends(a, b, 4, now)
    assert (flags, probes) == (Flag.NONE, 1)
    counted = a.counters()
    assert (counted["sends_finished"], counted["probes_carried"]) == (4, 1)


def test_recovery_carries_the_first_probe_only_warm_and_where_nothing_was_lost() -> None:
    rtt = RttEstimate(srtt=1e-3, rttvar=5e-4)
    quiet = LossPrior()
    _answered(quiet, QUIET_EVIDENCE)
    assert Recovery(CFG, rtt, loss_prior=quiet).may_carry_probe()
    assert not Recovery(CFG, rtt).may_carry_probe()  # (nothing sent yet: no evidence)
    assert not Recovery(CFG, loss_prior=quiet).may_carry_probe()  # (no round trip measured)
    assert not Recovery(CFG, rtt, reverse_loss=0.02,
                        loss_prior=quiet).may_carry_probe()  # (lost coming back)
    lossy = LossPrior()
    _answered(lossy, QUIET_EVIDENCE)
    lossy.missing_reported(1)
    assert not Recovery(CFG, rtt, loss_prior=lossy).may_carry_probe()  # (lost going there)


def test_a_carried_probe_flags_a_copy_of_the_last_header_not_the_senders() -> None:
    headers = wire.build_data_headers(session=7, round_id=1, message_id=2,
                                      message_bytes=3000, chunk_bytes=1000)
    before = bytes(headers)
    run = DataRun("b", headers.reshape(-1).data, memoryview(bytes(3000)), 1000,
                  np.array([2, 0], dtype=np.int64), last_flags=Flag.PROBE_CARRIED)
    heads = [wire.decode(b"".join(bytes(p) for p in parts))[0] for parts, _ in run.datagrams()]
    assert [(h.index, h.flags) for h in heads] == [(2, Flag.NONE), (0, Flag.PROBE_CARRIED)]
    assert bytes(headers) == before  # (a retransmission of chunk 0 carries nothing)


def _answered(prior: LossPrior, k: int) -> None:
    """A pass of ``k`` DATA datagrams, sent and answered."""
    prior.data_sent(k)
    prior.pass_answered(k)


def test_the_loss_prior_is_quiet_on_evidence_and_two_halvings_after_a_loss() -> None:
    prior = LossPrior()
    assert not prior.quiet()  # (nothing lost, but nothing sent either)
    prior.data_sent(QUIET_EVIDENCE)
    assert not prior.quiet()  # (sent, but not answered: no evidence yet)
    prior.pass_answered(QUIET_EVIDENCE - 1)
    assert not prior.quiet()
    prior.pass_answered(1)
    assert prior.quiet()
    prior.missing_reported(1)
    assert not prior.quiet()
    _answered(prior, HORIZON)  # (halved once: half a datagram lost is still a loss)
    assert not prior.quiet()
    _answered(prior, HORIZON)
    assert prior.quiet()


def test_the_loss_prior_takes_only_answered_passes_as_evidence() -> None:
    """A pass in flight is no evidence of anything; one a STOP ended counts the chunks the
    receive had (a bound met early says nothing of the rest); a BITMAP's pass counts whole,
    its missing chunks reported."""
    mux = TransferMux(7, CFG)
    prior = mux.loss_prior
    whole = mux.start_send("b", 1, 0, np.arange(5000, dtype=np.uint8), 0.0)
    bounded = mux.start_send("c", 1, 0, np.arange(5000, dtype=np.uint8), 0.0)
    mux.poll(0.0)
    assert (prior.sent, prior.answered) == (10, 0)
    mux.datagram_received(_stop(whole, CloseReason.COMPLETE), "b", 1e-3)
    assert prior.answered == 5
    stop = wire.stop_datagram(bounded.message, CloseReason.BOUND_MET, 3)  # (2 not had)
    mux.datagram_received(stop, "c", 1e-3)
    assert whole.done and bounded.done and prior.answered == 8 and prior.missing == 0
    tx = mux.start_send("d", 1, 0, np.arange(3000, dtype=np.uint8), 2e-3)
    mux.poll(2e-3)
    answer = wire.BITMAP_PREFIX.pack(1, 2) + bytes([0b101])  # PROBE 1: chunk 1 missing
    mux.datagram_received(wire.control_datagram(tx.message, Kind.BITMAP, 0, answer,
                                                wire.Flag.FINAL), "d", 3e-3)
    assert (prior.answered, prior.missing) == (11, 1)


def test_a_mux_reads_a_sends_short_pass_against_its_other_sends() -> None:
    """Five one-chunk sends arrive whole (each ends with a STOP, no answer); the sixth
    loses its chunk. The endpoint lost one of six: its next PROBE goes in the copies a
    one-lost-of-one pass read against that calls for, not in 32."""
    mux = TransferMux(7, CFG)
    for m in range(5):
        tx = mux.start_send("b", 1, m, np.arange(100, dtype=np.uint8), 0.0)
        mux.poll(0.0)
        mux.datagram_received(_stop(tx, CloseReason.COMPLETE), "b", 1e-3)
        assert tx.done
    tx = mux.start_send("b", 1, 5, np.arange(100, dtype=np.uint8), 1e-3)
    mux.poll(1e-3)
    answer = wire.BITMAP_PREFIX.pack(1, 0) + bytes([0])  # chunk 0 missing
    mux.datagram_received(wire.control_datagram(tx.message, Kind.BITMAP, 0, answer,
                                                wire.Flag.FINAL), "b", 2e-3)
    kinds = [wire.decode(b"".join(parts))[0].kind for parts, _ in mux.poll(2e-3)]
    expected = tx.recovery.copies_for((1 + PRIOR_DATAGRAMS / 6) / (1 + PRIOR_DATAGRAMS))
    assert kinds == [Kind.DATA] + [Kind.PROBE] * expected and expected == 5


def test_recovery_doubles_the_copies_of_an_unanswered_probe() -> None:
    r = Recovery(CFG)
    assert r.probe_copies(0.0, first_pass=False) == 1
    for expected in (2, 4, 8, 16, 32, 32):
        r.probe_timed_out()
        assert r.probe_copies(0.0, first_pass=False) == expected


def test_a_silent_pass_calls_for_copies_only_once_its_first_ack_is_overdue() -> None:
    """No ACK from a long pass: copies (a microburst may have taken it) only once the
    first ACK it owed is a retransmission timeout late. An ACK owed for less - for a
    round trip, counted from when the pass's first datagram went - may only be behind a
    busy receiver (a CPU-bound host), and 32 copies of a PROBE, each answered, would
    load it more."""
    def silent_pass(probe_at: float) -> tuple[Recovery, int]:
        r = Recovery(CFG, RttEstimate(srtt=1e-3, rttvar=0.25e-3), ack_every=32)
        r.data_sent(0.0, 16)
        r.data_sent(0.010, 112)  # the 32nd datagram, which owes the first ACK, at 10 ms
        return r, r.probe_copies(probe_at, first_pass=False)

    assert silent_pass(0.010)[0].rto_base == pytest.approx(0.002)
    assert silent_pass(0.011)[1] == 1  # owed for 1 ms: in flight, or the receiver busy
    late, copies = silent_pass(0.0125)  # owed for more than the 2 ms RTO
    assert copies == late.copies_for(1 - 32 / 128) > 1


def test_recovery_takes_the_way_back_from_a_receive_until_acks_say_more() -> None:
    r = Recovery(CFG, reverse_loss=0.5)
    assert r.reverse_loss() == 0.5
    r.data_sent(0.0, 64)
    assert r.probe_copies(0.001, first_pass=False) == r.copies_for(0.5)  # no ACK: the hint
    every = CFG.ack_every_for(0)  # (a Recovery not told: a short message's)
    heard = Recovery(CFG)
    heard.data_sent(0.0, 4 * every)
    # the receiver delivered all 4*every datagrams and sent 4 ACKs; one came back
    heard.ack_received(4 * every - 1, 4 * every - 1, 0.001, after_first_pass_probe=False)
    assert heard.reverse_loss() == pytest.approx(0.75)


def test_recovery_acks_behind_a_first_pass_probe_call_for_more_copies_at_once() -> None:
    r = Recovery(CFG)
    r.data_sent(0.0, 64)
    assert r.probe_copies(0.0, first_pass=False) == 1
    assert not r.more_copies_due
    # of 64 datagrams only 32 arrived (forward loss 0.5), every ACK came back
    r.ack_received(63, 31, 0.001, after_first_pass_probe=True)
    assert r.more_copies_due
    more = r.take_more_copies()
    assert 1 + more == r.copies_for(1 - 32 / 64)
    assert not r.more_copies_due and r.take_more_copies() == 0


# -------------------------------------------------------------------- Pacer
def test_pacer_without_a_rate_lets_everything_out() -> None:
    p = Pacer(CFG, 1048, now=0.0)
    assert p.allow(0.0, 500, first_pass=True) == 500 and p.paced_until is None
    assert p.allow(0.0, 500, first_pass=False) == 500  # nothing measured: unpaced


def test_pacer_fixed_rate_is_a_token_bucket() -> None:
    cfg = TransportConfig(chunk_bytes=1000, rate_bps=8 * 1_048_000)  # 1,000 datagrams/s
    p = Pacer(cfg, 1048, now=0.0)
    assert p.allow(0.0, 10, first_pass=True) == 0  # the bucket starts empty
    assert p.paced_until == pytest.approx(1e-3)
    p.timer_fired(0.5e-3)
    assert p.paced_until is not None  # not yet
    p.timer_fired(1e-3)
    assert p.paced_until is None
    assert p.allow(1e-3, 10, first_pass=True) == 1
    # a long pause fills the bucket to its size (64 KB here), not beyond
    assert p.allow(10.0, 1000, first_pass=True) == 64 * 1024 // 1048


def test_pacer_paces_retransmissions_at_the_gain_times_the_best_rate() -> None:
    cfg = TransportConfig(chunk_bytes=1000, retransmit_pacing_gain=0.5)
    p = Pacer(cfg, 1000, now=0.01)
    p.pass_answered(0.01, got=100, started_at=0.0, unrepeated=True, still_queued=0,
                    rto_base=1.0)
    assert p.rate_samples == [pytest.approx(100 * 1000 / 0.01)] == [p.best_rate]
    assert p.allow(0.01, 50, first_pass=True) == 50  # the first pass is never paced
    # retransmissions at 0.5 x 10 MB/s: a bucket of 8 datagrams, empty at first
    assert p.allow(0.01, 50, first_pass=False) == 0
    assert p.paced_until == pytest.approx(0.01 + 1000 / 5e6)
    assert p.allow(0.01 + 8 * 1000 / 5e6, 50, first_pass=False) == 8


def test_pacer_takes_no_sample_from_a_repeated_probe_or_an_empty_pass() -> None:
    p = Pacer(CFG, 1000, now=0.0, best_rate=123.0)
    p.pass_answered(1.0, got=100, started_at=0.0, unrepeated=False, still_queued=0,
                    rto_base=1.0)
    p.pass_answered(1.0, got=0, started_at=0.0, unrepeated=True, still_queued=0, rto_base=1.0)
    p.pass_answered(1.0, got=5, started_at=None, unrepeated=True, still_queued=0, rto_base=1.0)
    assert p.rate_samples == [] and p.best_rate == 123.0


def test_pacer_never_stretches_a_pass_beyond_two_rtos() -> None:
    cfg = TransportConfig(chunk_bytes=1000, retransmit_pacing_gain=1.0)
    p = Pacer(cfg, 1000, now=0.0, best_rate=1000.0)  # 1 datagram per second measured
    p.pass_answered(0.0, got=0, started_at=None, unrepeated=True, still_queued=100,
                    rto_base=0.01)
    # the floor: 100 datagrams in 2 x 10 ms = 5 MB/s, whatever the samples say
    assert p.allow(0.0, 100, first_pass=False) == 0
    assert p.paced_until == pytest.approx(1000 / 5e6)


# ----------------------------------------------------------------- PeerPath
def test_peer_path_keeps_the_latest_round_trip_and_recent_rates() -> None:
    path = PeerPath("b")
    assert path.rtt is None and path.best_rate() is None
    path.send_finished(RttEstimate(1e-3, 5e-4), [10.0, 30.0])
    path.send_finished(None, [20.0])  # a send that measured no round trip keeps the last
    assert path.rtt == RttEstimate(1e-3, 5e-4) and path.best_rate() == 30.0
    path.send_finished(None, [1.0] * RATE_SAMPLES)  # old samples age out
    assert path.best_rate() == 1.0


def test_peer_path_remembers_a_receive_loss_for_a_while() -> None:
    path = PeerPath("b")
    assert path.reverse_loss(0.0) is None
    path.receive_closed(None, 1.0)  # too little to tell: nothing learned
    assert path.reverse_loss(1.0) is None
    path.receive_closed(0.8, 1.0)
    assert path.reverse_loss(1.0 + LOSS_MEMORY) == 0.8
    assert path.reverse_loss(1.0 + LOSS_MEMORY + 1e-6) is None


def test_mux_hands_one_path_per_peer_to_its_sends_and_receives() -> None:
    mux = TransferMux(1, CFG)
    tx = mux.start_send("b", 0, 0, np.zeros(10, np.uint8), 0.0)
    assert tx.path is mux.path("b") and mux.path("b") is not mux.path("c")


# -------------------------------------------------------------- send states
def _stop(tx, reason: CloseReason) -> bytes:
    return wire.stop_datagram(tx.message, reason, tx.count)


def test_send_state_walks_probe_timeout_and_stop() -> None:
    mux = TransferMux(7, CFG)
    tx = mux.start_send("b", 1, 2, np.arange(5000, dtype=np.uint8), 0.0)
    assert tx.state is SendState.SENDING and tx.has_data()
    out = mux.poll(0.0)
    kinds = [wire.decode(b"".join(parts))[0].kind for parts, _ in out]
    assert kinds == [Kind.DATA] * 5 + [Kind.PROBE]  # the pass, then "what is missing?"
    assert tx.state is SendState.AWAITING_REPLY and not tx.has_data()
    deadline = mux.next_deadline()
    assert deadline == pytest.approx(CFG.initial_rto)
    mux.timer_fired(deadline)  # no answer: the PROBE goes again
    assert tx.state is SendState.PROBE_DUE and tx.has_data()
    assert len(mux.poll(deadline)) == 2  # in twice the copies
    assert tx.state is SendState.AWAITING_REPLY
    mux.datagram_received(_stop(tx, CloseReason.COMPLETE), "b", deadline + 1e-3)
    assert tx.state is SendState.DONE and tx.done and tx.result.ok
    assert not tx.has_data() and tx.next_deadline() is None
    assert mux.pop_finished() == [tx.result] and tx.result.transfer_id == tx.transfer_id


def test_send_state_after_an_answer_that_asks_for_chunks() -> None:
    mux = TransferMux(7, CFG)
    tx = mux.start_send("b", 1, 2, np.arange(5000, dtype=np.uint8), 0.0)
    mux.poll(0.0)
    # the answer: chunks 1 and 3 missing (bit set = delivered), FINAL
    bitmap = wire.BITMAP_PREFIX.pack(1, 3) + bytes([0b10101])
    mux.datagram_received(wire.control_datagram(tx.message, Kind.BITMAP, 0, bitmap,
                                                wire.Flag.FINAL), "b", 1e-3)
    assert tx.state is SendState.SENDING
    out = mux.poll(1e-3)
    sent = [wire.decode(b"".join(parts))[0] for parts, _ in out]
    # the missing chunks, then the next PROBE in as many copies as a 2-in-5 loss calls for
    assert [(h.kind, h.index) for h in sent] == (
        [(Kind.DATA, 1), (Kind.DATA, 3)] + [(Kind.PROBE, 2)] * tx.recovery.copies_for(2 / 5))
    assert tx.recovery.copies_for(2 / 5) == 6
    assert tx.state is SendState.AWAITING_REPLY
    assert tx.recovery.srtt == pytest.approx(1e-3)  # the answer was a round-trip sample
    tx.cancel(2e-3)
    assert tx.state is SendState.DONE and not tx.result.ok
    assert math.isclose(tx.result.stats.elapsed, 2e-3)


def test_a_poll_in_runs_hands_out_the_same_datagrams_as_one_by_one() -> None:
    def polled(runs: bool) -> list[bytes]:
        mux = TransferMux(7, CFG)
        mux.start_send("b", 1, 2, np.arange(10_500, dtype=np.uint8), 0.0)
        items = mux.poll(0.0, 8, runs=runs) + mux.poll(0.0, 100, runs=runs)
        flat = []
        for item in items:
            flat += item.datagrams() if isinstance(item, DataRun) else [item]
        return [b"".join(bytes(p) for p in parts) for parts, _ in flat]

    one_by_one = polled(False)
    assert polled(True) == one_by_one
    assert len(one_by_one) == 11 + 1  # every chunk, then the PROBE


@settings(PROPERTY, max_examples=2000)
@given(q=st.floats(0.0, 1.0), copies=st.integers(0, 40), most=st.integers(1, 32),
       target=st.sampled_from([0.001, 0.01, 0.05, 0.3]))
def test_the_loss_limit_decides_exactly_as_copies_for(q, copies, most, target) -> None:
    """Comparing a loss with loss_limit (what lets the compiled path take an ACK) gives
    copies_for's answer "no more than the copies sent" exactly, at every float."""
    limit = _loss_limit(target, most, copies)
    assert (q <= limit) == (copies_for(q, target, most) <= copies)
    if 0 < limit < 1:  # (and it is the largest such float)
        assert copies_for(math.nextafter(limit, 1.0), target, most) > copies


# ---------------------------------------------------------------- SendQueue
class _EagerQueue:
    """The send queue as a set of waiting chunks, marked at every step: what SendQueue,
    which marks nothing until its first requeue, must answer alike."""

    def __init__(self, order: list[int]):
        self.order, self.waiting = list(order), set(order)

    def take(self, k: int) -> list[int]:
        batch, self.order = self.order[:k], self.order[k:]
        self.waiting -= set(batch)
        return batch

    def requeue(self, missing: list[int]) -> int:
        fresh = [c for c in missing if c not in self.waiting]
        self.waiting |= set(fresh)
        self.order += fresh
        return len(fresh)


@settings(PROPERTY, max_examples=300)
@given(count=st.integers(1, 40), critical=st.booleans(), data=st.data())
def test_send_queue_takes_and_requeues_as_a_queue_marked_at_every_step(
        count: int, critical: bool, data) -> None:
    from boundedloss.protocol.sender import SendQueue

    mask = (np.array(data.draw(st.lists(st.booleans(), min_size=count, max_size=count)))
            if critical else None)
    queue = SendQueue(count, mask)
    model = _EagerQueue(queue.order.tolist())
    for _ in range(data.draw(st.integers(1, 12))):
        if data.draw(st.booleans()) and len(queue):
            k = data.draw(st.integers(1, len(queue)))
            batch = queue.take(k)
            assert batch.tolist() == model.take(k)
            assert queue.holds_last(batch) == (count - 1 in batch.tolist())
        else:
            missing = sorted(data.draw(st.sets(st.integers(0, count - 1))))
            assert queue.requeue(np.array(missing, dtype=np.int64)) == model.requeue(missing)
        assert queue.order[queue.pos:].tolist() == model.order
        if not len(queue) and data.draw(st.booleans()):
            queue.drained()
