"""UdpEndpoint over real sockets on loopback: behaviour, not speed."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundedloss.net import native
from boundedloss.net.loss import Bernoulli
from boundedloss.net.udp import GSO_MAX_BYTES, GSO_MAX_SEGMENTS, UdpEndpoint, segment_run
from boundedloss.policy import ClosePlan, FixedBoundPolicy, ReliablePolicy
from boundedloss.protocol import CloseReason, SendStatus, TransportConfig, TransportError
from conftest import run_behind_a_narrow_path

SESSION = 0x5EED_0000_0000_0001


def _cfg(**kw) -> TransportConfig:
    base = dict(chunk_bytes=1400, peer_timeout=5.0, receive_deadline=10.0)
    base.update(kw)
    return TransportConfig(**base)


def test_two_process_transfer_is_bit_exact():
    """A sender in another OS process; the message arrives bit-exact."""
    nbytes = 3_000_001
    with UdpEndpoint(session=SESSION, config=_cfg()) as rx:
        script = textwrap.dedent(
            f"""
            import json, sys, numpy as np
            from boundedloss.net.udp import UdpEndpoint
            from boundedloss.protocol import TransportConfig
            cfg = TransportConfig(chunk_bytes=1400, peer_timeout=5.0)
            with UdpEndpoint(session={SESSION}, config=cfg) as ep:
                print(json.dumps(ep.address), flush=True)
                sys.stdin.readline()  # wait until the receive is posted
                data = np.random.default_rng(7).integers(0, 256, {nbytes}, dtype=np.uint8)
                res = ep.send(tuple({list(rx.address)}), data, message_id=3, round_id=1).result(30)
                print(json.dumps([res.status.value, res.stats.datagrams]), flush=True)
            """
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            peer = tuple(json.loads(proc.stdout.readline()))
            fut = rx.receive(peer, message_id=3, round_id=1, nbytes=nbytes)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            res = fut.result(30)
            status, datagrams = json.loads(proc.stdout.readline())
        finally:
            proc.stdin.close()
            proc.wait(10)
    expected = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    assert status == "stopped" and proc.returncode == 0
    assert res.close_reason == CloseReason.COMPLETE
    assert np.array_equal(res.data, expected)
    assert datagrams >= res.stats.chunks


@pytest.mark.parametrize("chunk_bytes", [1400, 8192])  # long runs and short ones (offload)
def test_reliable_under_injected_loss_and_bounded_meets_bound(chunk_bytes):
    data = np.random.default_rng(1).standard_normal(400_000).astype(np.float32)
    with (
        UdpEndpoint(session=SESSION, config=_cfg(chunk_bytes=chunk_bytes)) as a,
        UdpEndpoint(session=SESSION, config=_cfg(chunk_bytes=chunk_bytes),
                    loss=Bernoulli(0.05, seed=2)) as b,
    ):
        out = np.zeros_like(data)
        f_rx = b.receive(a.address, message_id=1, out=out, policy=ReliablePolicy())
        f_tx = a.send(b.address, data, message_id=1)
        res = f_rx.result(30)
        assert f_tx.result(30).ok
        assert res.complete and np.array_equal(out, data)
        assert b.counters()["injected_loss"] > 0

        out2 = np.zeros_like(data)
        f_rx = b.receive(a.address, message_id=2, out=out2, policy=FixedBoundPolicy(0.05))
        a.send(b.address, data, message_id=2)
        res = f_rx.result(30)
        chunks = res.stats.chunks
        assert res.delivered.sum() >= np.ceil(0.95 * chunks)
        mask = res.delivered_bytes_mask()
        assert np.array_equal(out2.view(np.uint8)[mask], data.view(np.uint8)[mask])


def test_many_messages_many_peers_concurrently():
    cfg = _cfg(chunk_bytes=4096)
    rng = np.random.default_rng(3)
    with (
        UdpEndpoint(session=SESSION, config=cfg) as a,
        UdpEndpoint(session=SESSION, config=cfg) as b,
        UdpEndpoint(session=SESSION, config=cfg, loss=Bernoulli(0.02, seed=5)) as c,
    ):
        eps = [a, b, c]
        sent, futs = {}, []
        for i, src in enumerate(eps):
            for j, dst in enumerate(eps):
                if i == j:
                    continue
                for m in range(4):
                    data = rng.integers(0, 256, int(rng.integers(1, 300_000)), dtype=np.uint8)
                    sent[(i, j, m)] = data
                    futs.append(((i, j, m), dst.receive(src.address, message_id=m, round_id=7,
                                                        nbytes=data.nbytes)))
        for (i, j, m), data in sent.items():
            eps[i].send(eps[j].address, data, message_id=m, round_id=7)
        for key, fut in futs:
            res = fut.result(30)
            assert res.complete and np.array_equal(res.data, sent[key]), key


def test_dead_receiver_fails_the_send_within_peer_timeout():
    dead = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dead.bind(("127.0.0.1", 0))  # bound but never answers
    with UdpEndpoint(session=SESSION, config=_cfg(peer_timeout=0.5)) as a:
        res = a.send(dead.getsockname(), np.ones(100_000, np.uint8), message_id=1).result(5)
    dead.close()
    assert res.status == SendStatus.PEER_SILENT
    assert 0.5 <= res.stats.elapsed < 3.0


def test_dead_sender_closes_the_receive_at_its_deadline():
    with UdpEndpoint(session=SESSION, config=_cfg(receive_deadline=0.4)) as b:
        res = b.receive(("127.0.0.1", 9), message_id=1, nbytes=10_000).result(5)
    assert res.close_reason == CloseReason.DEADLINE
    assert res.delivered.sum() == 0


class _NeedsNothing(ReliablePolicy):
    def plan(self, info):
        return ClosePlan(min_delivered=0, bound=1.0)


def test_a_receive_wakes_the_io_thread_only_for_what_it_must_act_on_first():
    """Posting a receive wakes the I/O thread (a pass of its loop) only when it has
    something to send for it, or a timer due before the thread wakes anyway - and then
    the receive still closes on time."""
    idle_for = 1.0  # (the I/O thread's longest sleep)
    with UdpEndpoint(session=7, config=TransportConfig(receive_deadline=0.3)) as short, \
            UdpEndpoint(session=7) as long:
        give_up = time.monotonic() + 5
        while min(short.sleeps_until, long.sleeps_until) < time.monotonic() + idle_for / 2:
            assert time.monotonic() < give_up, "an idle I/O thread did not go to sleep"
            time.sleep(0.01)  # (until both threads sleep, up to idle_for)

        def wakes():
            return short.counters()["io_wakeups"], long.counters()["io_wakeups"]

        quiet = long.receive(("127.0.0.1", 9), message_id=1, nbytes=100)  # deadline 30 s
        assert wakes() == (0, 0)
        started = time.monotonic()
        due = short.receive(("127.0.0.1", 9), message_id=1, nbytes=100)  # deadline 0.3 s
        assert wakes() == (1, 0)
        assert due.result(timeout=5).close_reason == CloseReason.DEADLINE
        assert time.monotonic() - started < 0.3 + idle_for / 2
        # a receive whose plan needs nothing is met at once, with a STOP to send
        met = long.receive(("127.0.0.1", 9), message_id=2, nbytes=100,
                           policy=_NeedsNothing())
        assert met.result(timeout=5).close_reason == CloseReason.BOUND_MET
        assert wakes() == (1, 1)
        long.cancel(quiet)


def test_garbage_datagrams_are_counted_and_the_endpoint_keeps_working():
    rng = np.random.default_rng(9)
    data = rng.integers(0, 256, 200_000, dtype=np.uint8)
    with (UdpEndpoint(session=SESSION, config=_cfg()) as a,
          UdpEndpoint(session=SESSION, config=_cfg()) as b):
        fut = b.receive(a.address, message_id=1, nbytes=data.nbytes)
        junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for n in (0, 1, 47, 48, 49, 1500, 9000):
            for _ in range(20):
                junk.sendto(rng.integers(0, 256, n, dtype=np.uint8).tobytes(), b.address)
        a.send(b.address, data, message_id=1)
        res = fut.result(30)
        junk.close()
        counters = b.counters()
    assert res.complete and np.array_equal(res.data, data)
    assert sum(v for k, v in counters.items() if k != "datagrams_in") >= 140


def test_close_fails_open_futures():
    ep = UdpEndpoint(session=SESSION, config=_cfg())
    fut = ep.receive(("127.0.0.1", 9), message_id=1, nbytes=10)
    ep.close()
    with pytest.raises(TransportError):
        fut.result(1)
    with pytest.raises(TransportError):
        ep.send(("127.0.0.1", 9), b"x", message_id=2)


# ------------------------------------------------------ UDP segmentation offload
# stretches of datagrams of one size to one peer, as a sender's passes come out
_stretch = st.tuples(st.sampled_from([("a", 1), ("b", 2)]),
                     st.sampled_from([(48, 1400), (48, 700), (60,), (48, 8192), (48, 30000)]),
                     st.integers(1, 100))


@settings(max_examples=300, deadline=None)
@given(st.lists(_stretch, min_size=1, max_size=8))
def test_segment_runs_cover_the_batch_in_runs_the_kernel_takes(stretches):
    spec = [(peer, sizes) for peer, sizes, n in stretches for _ in range(n)]
    batch = [(tuple(b"x" * n for n in sizes), peer) for peer, sizes in spec]
    size_of = [sum(sizes) for _, sizes in spec]
    pos = 0
    while pos < len(batch):
        end, size = segment_run(batch, pos)
        assert pos < end <= len(batch) and size == size_of[pos]
        run = range(pos, end)
        assert all(batch[i][1] == batch[pos][1] for i in run)  # one peer
        assert all(size_of[i] == size for i in run[:-1]) and size_of[end - 1] <= size
        assert end - pos <= GSO_MAX_SEGMENTS and sum(size_of[i] for i in run) <= GSO_MAX_BYTES
        if end < len(batch) and size_of[end - 1] == size:  # a run ends for a reason
            nxt = end
            assert (batch[nxt][1] != batch[pos][1] or size_of[nxt] > size
                    or end - pos == GSO_MAX_SEGMENTS or (end - pos + 1) * size > GSO_MAX_BYTES)
        pos = end


def _transfer(cfg, nbytes=1_000_000, **endpoint_kw):
    data = np.random.default_rng(11).integers(0, 256, nbytes, dtype=np.uint8)
    with (UdpEndpoint(session=SESSION, config=cfg, **endpoint_kw) as a,
          UdpEndpoint(session=SESSION, config=cfg) as b):
        f_rx = b.receive(a.address, message_id=1, nbytes=nbytes)
        res_tx = a.send(b.address, data, message_id=1).result(30)
        res = f_rx.result(30)
        assert res_tx.ok and res.complete and np.array_equal(res.data, data)
        return a, res_tx


def test_segmented_sends_arrive_as_the_same_datagrams():
    """With offload, a pass of full chunks leaves in a few system calls (or, where the
    kernel refuses offload, the endpoint says so and sends datagram by datagram)."""
    a, tx = _transfer(_cfg(), segmentation_offload=True)
    counters = a.counters()
    if counters.get("io_gso_refused"):
        assert not a.segmentation_offload and counters["sendmsg_calls"] >= tx.stats.datagrams
    else:
        assert a.segmentation_offload
        # 715 datagrams, runs of at most 45 (1,448-byte segments in 64 KB), plus probes
        assert counters["sendmsg_calls"] < tx.stats.datagrams / 10


@pytest.mark.parametrize("native_path", ["0", "1"])
def test_without_offload_datagrams_go_one_per_call_or_in_sendmmsg_batches(monkeypatch,
                                                                          native_path):
    """The Python path sends a datagram per call; the compiled one up to 64 per
    sendmmsg."""
    monkeypatch.setenv("BOUNDEDLOSS_UDP_GSO", "0")
    monkeypatch.setenv("BOUNDEDLOSS_NATIVE", native_path)
    a, tx = _transfer(_cfg())
    assert not a.segmentation_offload
    counters = a.counters()
    if counters["native_data_path"]:
        assert tx.stats.datagrams / 64 <= counters["sendmsg_calls"] < tx.stats.datagrams / 10
    else:
        assert native_path == "0" or not native.enabled()
        assert counters["sendmsg_calls"] >= tx.stats.datagrams


def test_refused_offload_falls_back_without_losing_a_datagram(monkeypatch):
    import boundedloss.net.udp as udp

    # the kernel answers an unknown SOL_UDP control message with EINVAL, as it does a
    # device without offload (EIO) or a segment over the MTU
    monkeypatch.setenv("BOUNDEDLOSS_NATIVE", "0")
    monkeypatch.setattr(udp, "UDP_SEGMENT", 9999)
    a, tx = _transfer(_cfg(), segmentation_offload=True)
    assert not a.segmentation_offload and a.counters()["io_gso_refused"] == 1


class _RefusingOffload:
    """The compiled dispatcher, but a segmented send fails with EINVAL, as the kernel
    answers one to a device without offload."""

    def __init__(self, real):
        self.real = real
        self.refused = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def send_run(self, sock, ip, port, headers, payload, indices, start, cb, nbytes, segment,
                 last_flags):
        if segment and len(indices) - start > 1:
            self.refused += 1
            return start, errno.EINVAL, len(indices), 0
        return self.real.send_run(sock, ip, port, headers, payload, indices, start, cb,
                                  nbytes, segment, last_flags)


@pytest.mark.skipif(not native.enabled(), reason=f"compiled data path: {native.status()}")
def test_refused_offload_falls_back_in_the_compiled_path_too():
    data = np.random.default_rng(12).integers(0, 256, 500_000, dtype=np.uint8)
    with (UdpEndpoint(session=SESSION, config=_cfg(), segmentation_offload=True) as a,
          UdpEndpoint(session=SESSION, config=_cfg()) as b):
        refusing = a.data_path.dispatcher = _RefusingOffload(a.data_path.dispatcher)
        f_rx = b.receive(a.address, message_id=1, nbytes=data.nbytes)
        assert a.send(b.address, data, message_id=1).result(30).ok
        res = f_rx.result(30)
        assert res.complete and np.array_equal(res.data, data)
    assert refusing.refused == 1 and not a.segmentation_offload
    assert a.counters()["io_gso_refused"] == 1


def test_a_bug_in_the_io_thread_fails_every_caller_at_once_with_its_cause():
    """A policy whose ``observe`` raises kills the endpoint's I/O thread; the receive
    waiting on it, and every later call, must fail with that error at once - not wait
    out a timeout and read as a dead peer - and the endpoint must still close."""

    class BrokenPolicy(ReliablePolicy):
        def observe(self, outcome):
            raise ZeroDivisionError("a bug in the policy")

    with UdpEndpoint(session=SESSION, config=_cfg()) as tx, \
            UdpEndpoint(session=SESSION, config=_cfg()) as rx:
        got = rx.receive(tx.address, message_id=1, nbytes=40_000, policy=BrokenPolicy())
        tx.send(rx.address, np.ones(10_000, np.float32), message_id=1)
        with pytest.raises(TransportError, match="ZeroDivisionError: a bug in the policy") as e:
            got.result(timeout=30)  # (raises at once; the timeout is only a backstop)
        assert isinstance(e.value.__cause__, ZeroDivisionError)
        with pytest.raises(TransportError, match="a bug in the policy"):
            rx.receive(tx.address, message_id=2, nbytes=40_000)
        with pytest.raises(TransportError, match="a bug in the policy"):
            rx.send(tx.address, np.ones(10, np.float32), message_id=3)
    assert rx.sock.fileno() == -1  # closed all the same


_MTU_SCRIPT = textwrap.dedent("""
    import json, numpy as np
    from boundedloss.net.udp import ChunkTooLarge, UdpEndpoint
    from boundedloss.protocol import TransportConfig
    def snmp():
        lines = [l.split() for l in open("/proc/net/snmp") if l.startswith("Ip:")]
        return dict(zip(lines[0][1:], map(int, lines[1][1:])))
    out = {}
    try:
        with UdpEndpoint(session=1, config=TransportConfig(chunk_bytes=1425)) as a:
            a.send(("127.0.0.1", 9), np.zeros(10, np.uint8), message_id=1)
    except ChunkTooLarge as e:
        out["error"] = str(e)
    data = np.random.default_rng(3).integers(0, 256, 2_000_000, dtype=np.uint8)
    cfg = TransportConfig(chunk_bytes=1424)
    before = snmp()
    with UdpEndpoint(session=1, config=cfg) as a, UdpEndpoint(session=1, config=cfg) as b:
        f = b.receive(a.address, message_id=1, nbytes=data.nbytes)
        a.send(b.address, data, message_id=1).result(30)
        res = f.result(30)
        out["complete"] = bool(res.complete and np.array_equal(res.data, data))
    after = snmp()
    out["fragments"] = after["FragCreates"] - before["FragCreates"]
    print(json.dumps(out))
""")


def test_a_chunk_never_fragments_and_one_too_large_for_the_path_is_refused():
    """In a network namespace of its own whose loopback has a 1,500-byte MTU: a 1,425-byte
    chunk (a 1,501-byte packet) is a one-line error naming the MTU; 1,424-byte chunks go
    through without a single IP fragment."""
    proc = run_behind_a_narrow_path(_MTU_SCRIPT, mtu=1500)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] == ("chunk size 1,425 B does not fit one packet to 127.0.0.1:9: the "
                            "path MTU is 1,500 B, so chunks can be at most 1,424 B (set "
                            "TransportConfig.chunk_bytes)")
    assert out["complete"] and out["fragments"] == 0


def _bare_ranks(world: int, nbytes: int = 300_000):
    from boundedloss.bench.bare_udp import BareExchange

    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(world)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    peers = [s.getsockname() for s in socks]
    return socks, [BareExchange(s, r, peers, nbytes, 1400, 1424, deadline_s=0.5)
                   for r, s in enumerate(socks)]


def test_the_bare_loop_moves_every_datagram_of_a_lossless_round():
    """bench kernel-loss's machine limit (bare-udp): three ranks exchange two rounds of a
    transpose allreduce's datagrams, each rank's phases counting exactly what its peers
    sent it, runs coalesced or not."""
    import threading

    socks, ranks = _bare_ranks(3)
    got: dict[int, list[float]] = {r: [] for r in range(3)}

    def run(r: int) -> None:
        for t in range(2):
            got[r].append(ranks[r].exchange(t))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    for s in socks:
        s.close()
    assert got == {r: [1.0, 1.0] for r in range(3)}
    # (a fraction is capped at 1: what was expected must be all that was sent - a third
    # of 300,000 B to each peer, 72 chunks of 1,400 B, the last one shorter)
    assert ranks[0].per_peer == 72


def test_the_bare_loop_says_what_did_not_arrive():
    """A peer that never sends (half of what every phase expects is lost): the round ends
    at its deadline with half of it."""
    import threading

    socks, ranks = _bare_ranks(3)  # rank 2 stays silent
    got: list[float] = []
    th = threading.Thread(target=lambda: got.append(ranks[1].exchange(0)))
    th.start()
    try:
        assert ranks[0].exchange(0) == pytest.approx(0.5)
        th.join(30)
        assert got == [pytest.approx(0.5)]
    finally:
        for s in socks:
            s.close()


def test_the_bare_loop_counts_a_coalesced_run_by_its_tags():
    """A run read in one piece counts each segment under its own round and phase: a
    run of one tag at once, a run across a phase's end segment by segment."""
    import struct

    from boundedloss.bench.bare_udp import BareExchange
    from boundedloss.net.udp import SOL_UDP, UDP_SEGMENT

    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    loop = BareExchange(rx, 0, [rx.getsockname(), ("127.0.0.1", 9)], 1000, 100, 108)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    seg = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", 108))]

    def run(*tags):
        return b"".join(struct.pack("<II", *t) + bytes(100) for t in tags)

    try:
        tx.sendmsg([run((1, 0), (1, 0), (1, 0))], seg, 0, rx.getsockname())
        tx.sendmsg([run((2, 0), (2, 0), (2, 1), (2, 1))], seg, 0, rx.getsockname())
        deadline = time.monotonic() + 5
        while sum(loop.counts.values()) < 7 and time.monotonic() < deadline:
            loop.drain()
        assert dict(loop.counts) == {(1, 0): 3, (2, 0): 2, (2, 1): 2}
    finally:
        tx.close()
        rx.close()


def test_a_batch_of_sends_or_receives_is_posted_at_once_or_not_at_all():
    """send_many and receive_many post a message to several peers with one wake of the
    I/O thread; where one of the batch cannot start, those started before it are
    cancelled and the error raised, so that nothing runs without its future."""
    rng = np.random.default_rng(3)
    x, y = (rng.integers(0, 256, n, dtype=np.uint8) for n in (30_000, 7_000))
    with UdpEndpoint(session=SESSION, config=_cfg()) as a, \
            UdpEndpoint(session=SESSION, config=_cfg()) as b, \
            UdpEndpoint(session=SESSION, config=_cfg()) as c:
        (at_b,) = b.receive_many([(a.address, x.nbytes)], message_id=1, round_id=4)
        (at_c,) = c.receive_many([(a.address, y.nbytes)], message_id=1, round_id=4)
        woken = a.counters()["io_wakeups"]
        sent = a.send_many([(b.address, x), (c.address, y)], message_id=1, round_id=4)
        assert a.counters()["io_wakeups"] == woken + 1
        assert all(f.result(30).ok for f in sent)
        assert np.array_equal(at_b.result(30).data, x) and np.array_equal(at_c.result(30).data, y)
        with pytest.raises(TransportError, match="already being sent"):
            a.send_many([(c.address, y), (b.address, x), (b.address, x)], message_id=2)
        assert a.mux.open_sends == 0
        before = b.mux.open_receives
        with pytest.raises(TransportError, match="already open"):
            b.receive_many([(a.address, 10), (c.address, 10), (a.address, 10)], message_id=3)
        assert b.mux.open_receives == before
