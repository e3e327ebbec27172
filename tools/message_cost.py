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
