"""What one message costs the Python core, phase by phase, on an idle CPU.

Two cores (TransferMux), each with the compiled data path attached as a rank's is, and
nothing else: no socket, no threads, no collective. Each round posts a receive on one
and a send on the other, feeds the receiver the message's DATA (the compiled path takes
all but the last datagram; that one, which closes the receive, goes to the core), then
feeds the sender what the receiver answered (its ACKs taken by the compiled path, its
STOP by the core). Timed, per message (median over the rounds after a warm-up):

- ``post receive``: ``start_receive`` (the receive, its plan, the compiled path's
  Receive bound and registered);
- ``post send``: ``start_send`` (the send, its headers, recovery, pacing, the compiled
  path's Send);
- ``close receive``: the closing DATA datagram through the compiled path to the core:
  its result, its STOP, the policy's outcome, the receive remembered as closed;
- ``finish send``: the receiver's answers through the compiled path, the STOP to the
  core: the send's result.

A rank spends several times these on a loaded machine (``tools/round_cpu.py``: the
cores' caches are shared with the other ranks); this is the floor the Python objects
of a message set, which is what a per-message engine in C would take away.

With ``--memory`` it says instead what an open message holds: the bytes of Python
objects (and the compiled path's) allocated by posting ``--rounds`` receives and as
many sends and kept while they are open, per message (``tracemalloc``) - a receive's
besides its destination buffer, which it reports apart. What a simulated job of
millions of open messages needs (``boundedloss sim``'s memory floor) is mostly these.

    python tools/message_cost.py
    python tools/message_cost.py --auth --bytes 4096 --json message-cost.json
    python tools/message_cost.py --memory --bytes 4096
    python tools/message_cost.py --auth --bytes 4096 --rounds 20000 --open 1,10,100,1000,5000
    python tools/message_cost.py --auth --bytes 4096 --rounds 400 --peers 63

``--open`` asks instead what a message costs (all four phases, mean) when N are posted,
fed and finished together: the caches a message's objects meet with that many others
open, as a rank's meet them in a round of a large world.

``--peers`` asks what posting a round's receives from N peers and its sends to them
costs a message: one by one, and batched as an endpoint posts them (the receives of one
size share their geometry and the policy's plan, the sends their geometry).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from boundedloss.native import enabled, status
from boundedloss.net.native import NativeDataPath
from boundedloss.policy.reliable import ReliablePolicy
from boundedloss.protocol.auth import DatagramAuth
from boundedloss.protocol.mux import TransferMux
from boundedloss.protocol.types import TransportConfig
from boundedloss.wire import OFFSET, Kind

SESSION = 7
A, B = ("10.0.0.1", 5000), ("10.0.0.2", 5000)
KIND_AT = OFFSET["kind"]
PHASES = ("post receive", "post send", "close receive", "finish send")
POSTS = ("post receive, one by one", "post send, one by one",
         "post receive, batched", "post send, batched")
KEY = bytes(range(32))


def core(local, config: TransportConfig, auth: bool, compiled: bool = True) -> TransferMux:
    """A rank's core at ``local``, with the compiled data path attached as a rank's is."""
    mux = TransferMux(SESSION, config, auth=DatagramAuth(KEY, local) if auth else None)
    if compiled:
        NativeDataPath(mux)
    return mux


def measure(nbytes: int, rounds: int, auth: bool) -> dict[str, float]:
    """Median microseconds of each phase per message (the first fifth of the rounds
    left out as a warm-up)."""
    config = TransportConfig()
    sender, receiver = core(A, config, auth), core(B, config, auth)
    # (the Python path builds the DATA datagrams to feed in)
    twin = core(A, config, auth, compiled=False)
    payload = np.arange(nbytes // 4, dtype=np.float32)
    policy = ReliablePolicy()
    took: dict[str, list[float]] = {p: [] for p in PHASES}
    clock = time.perf_counter
    now = 0.0
    for r in range(1, rounds + 1):
        now += 0.01
        t = clock()
        rx = receiver.start_receive(A, r, 1, now, policy=policy, nbytes=payload.nbytes)
        took["post receive"].append(clock() - t)
        t = clock()
        tx = sender.start_send(B, r, 1, payload, now)
        took["post send"].append(clock() - t)
        feed = twin.start_send(B, r, 1, payload, now)
        data = [b"".join(parts) for parts, _ in twin.poll(now, limit=1 << 20)]
        data = [d for d in data if d[KIND_AT] == Kind.DATA]  # (the twin's PROBE is not fed)
        assert receiver.data_path is not None and sender.data_path is not None
        for datagram in data[:-1]:
            receiver.data_path.take(datagram, A, now)
        t = clock()
        receiver.data_path.take(data[-1], A, now)
        took["close receive"].append(clock() - t)
        answers = [b"".join(parts) for parts, _ in receiver.poll(now)]
        t = clock()
        for datagram in answers:
            sender.data_path.take(datagram, B, now)
        took["finish send"].append(clock() - t)
        if rx.result is None or tx.result is None:
            raise RuntimeError(f"round {r}: the message did not complete")
        twin.cancel_send(feed, now)
        for mux in (sender, receiver, twin):
            mux.pop_finished()
            mux.poll(now, runs=True)
    skip = rounds // 5
    return {p: 1e6 * statistics.median(v[skip:]) for p, v in took.items()}


def measure_open(nbytes: int, rounds: int, auth: bool, at_once: int) -> float:
    """Mean microseconds of all four phases a message, with ``at_once`` messages posted,
    then fed, then finished together (``rounds`` batches): what a message costs when its
    objects share the caches with that many others, as a rank's do mid-round."""
    config = TransportConfig(max_open_receives=at_once + 64)
    sender, receiver = core(A, config, auth), core(B, config, auth)
    twin = core(A, config, auth, compiled=False)
    payload = np.arange(nbytes // 4, dtype=np.float32)
    policy = ReliablePolicy()
    clock = time.perf_counter
    assert receiver.data_path is not None and sender.data_path is not None
    spent, now, r = 0.0, 0.0, 0
    for _ in range(rounds):
        now += 0.01
        ids = range(r, r + at_once)
        r += at_once
        t = clock()
        rxs = [receiver.start_receive(A, i, 1, now, policy=policy, nbytes=payload.nbytes)
               for i in ids]
        txs = [sender.start_send(B, i, 1, payload, now) for i in ids]
        spent += clock() - t
        feeds = [twin.start_send(B, i, 1, payload, now) for i in ids]
        data = [b"".join(parts) for parts, _ in twin.poll(now, limit=1 << 30)]
        data = [d for d in data if d[KIND_AT] == Kind.DATA]
        t = clock()
        for datagram in data:
            receiver.data_path.take(datagram, A, now)
        for parts, _ in receiver.poll(now, limit=1 << 30):
            sender.data_path.take(b"".join(parts), B, now)
        spent += clock() - t
        if any(x.result is None for x in [*rxs, *txs]):
            raise RuntimeError("a message did not complete")
        for feed in feeds:
            twin.cancel_send(feed, now)
        for mux in (sender, receiver, twin):
            mux.pop_finished()
            mux.poll(now, runs=True)
    return 1e6 * spent / r


def measure_posts(nbytes: int, rounds: int, auth: bool, peers: int) -> dict[str, float]:
    """Median microseconds a message of posting a round's receives from ``peers`` peers
    and its sends to them: one by one, and as an endpoint posts them (a ``ReceiveBatch``
    and a ``SendBatch``, one geometry and plan per size), interleaved round by round."""
    # (imported here: the other measures run against trees from before the batches)
    from boundedloss.protocol.receiver import ReceiveBatch
    from boundedloss.protocol.sender import SendBatch

    config = TransportConfig(max_open_receives=peers + 64)
    mux = core(A, config, auth)
    others = [(f"10.0.{1 + i // 250}.{1 + i % 250}", 5000) for i in range(peers)]
    payload = np.arange(nbytes // 4, dtype=np.float32)
    policy = ReliablePolicy()
    clock = time.perf_counter
    took: dict[str, list[float]] = {p: [] for p in POSTS}
    now = 0.0
    for r in range(1, rounds + 1):
        now += 0.01
        for batched in (False, True):
            rb = ReceiveBatch() if batched else None
            t = clock()
            rxs = [mux.start_receive(p, r, int(batched), now, policy=policy,
                                     nbytes=payload.nbytes, batch=rb) for p in others]
            took[POSTS[2 * batched]].append((clock() - t) / peers)
            sb = SendBatch() if batched else None
            t = clock()
            txs = [mux.start_send(p, r, int(batched), payload, now, batch=sb) for p in others]
            took[POSTS[2 * batched + 1]].append((clock() - t) / peers)
            for rx in rxs:
                mux.cancel_receive(rx, now)
            for tx in txs:
                mux.cancel_send(tx, now)
            mux.pop_finished()
            mux.poll(now, runs=True)
    skip = rounds // 5
    return {p: 1e6 * statistics.median(v[skip:]) for p, v in took.items()}


def held(nbytes: int, count: int, auth: bool) -> dict[str, float]:
    """Bytes an open receive (its destination buffer apart) and an open send hold, per
    message, over ``count`` of each posted on two cores (nothing sent or received)."""
    import tracemalloc

    config = TransportConfig(max_open_receives=count + 64)
    sender, receiver = core(A, config, auth), core(B, config, auth)
    payload = np.zeros(nbytes // 4, dtype=np.float32)
    policy = ReliablePolicy()
    for r in range(32):  # (a warm-up: the caches and tables a first message fills)
        receiver.cancel_receive(receiver.start_receive(A, r, 2, 0.0, policy=policy,
                                                       nbytes=payload.nbytes), 0.0)
        sender.cancel_send(sender.start_send(B, r, 2, payload, 0.0), 0.0)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        receives = [receiver.start_receive(A, r, 1, 0.0, policy=policy, nbytes=payload.nbytes)
                    for r in range(count)]
        after_receives = tracemalloc.get_traced_memory()[0]
        sends = [sender.start_send(B, r, 1, payload, 0.0) for r in range(count)]
        after_sends = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(receives) == len(sends) == count
    buffer = payload.nbytes
    return {"receive_bytes": (after_receives - start) / count - buffer,
            "receive_buffer_bytes": buffer, "send_bytes": (after_sends - after_receives) / count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=262144, help="message size")
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--auth", action="store_true", help="authenticated datagrams")
    ap.add_argument("--memory", action="store_true",
                    help="what an open message holds, instead of what it costs")
    ap.add_argument("--open", type=str, default=None, metavar="N,...",
                    help="instead: the cost of a message (all four phases, mean) with N "
                         "posted and completed at once, for each N")
    ap.add_argument("--peers", type=int, default=None, metavar="N",
                    help="instead: what posting a round's receives from N peers and its "
                         "sends to them costs a message, one by one and batched as an "
                         "endpoint posts them")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    if a.bytes < 8 or a.rounds < 10:
        raise SystemExit("--bytes must be at least 8 and --rounds at least 10")
    if not enabled():
        raise SystemExit(f"the compiled data path is needed: {status()}")
    if a.memory:
        figures = held(a.bytes, a.rounds, a.auth)
        print(f"An open message of {a.bytes:,} B, auth {'on' if a.auth else 'off'} "
              f"(mean of {a.rounds} of each):")
        print(f"  receive  {figures['receive_bytes']:7.0f} B "
              f"(and its {figures['receive_buffer_bytes']:,} B destination buffer)")
        print(f"  send     {figures['send_bytes']:7.0f} B")
        if a.json:
            a.json.write_text(json.dumps({"bytes": a.bytes, "auth": a.auth, "count": a.rounds,
                                          **figures}, indent=2) + "\n")
        return
    if a.peers is not None:
        if a.peers < 1:
            raise SystemExit("--peers takes a count of at least 1")
        posts = measure_posts(a.bytes, a.rounds, a.auth, a.peers)
        print(f"Posting a round's messages of {a.bytes:,} B with {a.peers} peers, auth "
              f"{'on' if a.auth else 'off'}, per message (median of "
              f"{a.rounds - a.rounds // 5} rounds):")
        for phase, v in posts.items():
            print(f"  {phase:26s} {v:7.1f} us")
        if a.json:
            a.json.write_text(json.dumps({"bytes": a.bytes, "auth": a.auth, "rounds": a.rounds,
                                          "peers": a.peers, "us": posts}, indent=2) + "\n")
        return
    if a.open:
        counts = [int(n) for n in a.open.split(",")]
        if any(n < 1 for n in counts):
            raise SystemExit("--open takes counts of at least 1")
        per = {n: measure_open(a.bytes, max(1, a.rounds // n), a.auth, n) for n in counts}
        print(f"A message of {a.bytes:,} B, auth {'on' if a.auth else 'off'}, all four "
              "phases (mean), with N open at once:")
        for n, v in per.items():
            print(f"  N = {n:6,d} {v:7.1f} us")
        if a.json:
            a.json.write_text(json.dumps({"bytes": a.bytes, "auth": a.auth, "messages": a.rounds,
                                          "us_with_open": per}, indent=2) + "\n")
        return
    us = measure(a.bytes, a.rounds, a.auth)
    print(f"Python core per message, {a.bytes:,} B, auth {'on' if a.auth else 'off'} "
          f"(median of {a.rounds - a.rounds // 5} rounds):")
    for phase, v in us.items():
        print(f"  {phase:14s} {v:7.1f} us")
    print(f"  {'all four':14s} {sum(us.values()):7.1f} us")
    if a.json:
        a.json.write_text(json.dumps({"bytes": a.bytes, "auth": a.auth, "rounds": a.rounds,
                                      "us": us, "total_us": sum(us.values())}, indent=2) + "\n")


if __name__ == "__main__":
    main()
