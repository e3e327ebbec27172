"""Bounded UDP traffic tools, run *inside* a testbed namespace as a plain script:

    python traffic.py send --dst 10.201.0.1 --port 9000 --count 20000 ...
    python traffic.py sink --port 9000 --idle 0.5 --max-time 10

Standard library only (it starts in a fresh interpreter in each namespace, so it stays
quick to start and needs nothing from the package). Every loop is bounded twice: by a
datagram count and by wall-clock time. Each tool prints one JSON object on stdout.

Datagram layout: ``<4sHI`` = magic ``b"BLTR"``, flow id (u16), sequence number (u32),
then zero padding up to ``--size`` bytes of UDP payload.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import socket
import struct
import sys
import time

MAGIC = b"BLTR"
HEADER = struct.Struct("<4sHI")
#: Bytes a UDP payload grows by on an IPv4 Ethernet link: 14 Ethernet + 20 IP + 8 UDP.
#: tbf meters skb->len, which at a veth's egress includes the 14-byte Ethernet header.
WIRE_OVERHEAD = 42
MAX_DURATION_S = 600.0
MAX_COUNT = 100_000_000


def _rcvbuf_errors() -> int:
    """UDP RcvbufErrors of the current network namespace (per-netns /proc/net/snmp)."""
    try:
        with open("/proc/net/snmp") as f:
            lines = [ln.split() for ln in f if ln.startswith("Udp:")]
        names, values = lines[0], lines[1]
        return int(values[names.index("RcvbufErrors")])
    except (OSError, IndexError, ValueError):
        return -1


def send(dst: str, port: int, count: int, size: int, rate_mbit: float | None,
         duration: float, flow: int) -> dict:
    """Send up to ``count`` datagrams of ``size`` payload bytes to ``dst:port``, paced to
    ``rate_mbit`` (counting the 42 bytes of headers a frame adds) when given, and stop
    after ``duration`` seconds in any case."""
    if not 0 < count <= MAX_COUNT:
        raise SystemExit(f"count must be in 1..{MAX_COUNT}")
    if not 0 < duration <= MAX_DURATION_S:
        raise SystemExit(f"duration must be in (0, {MAX_DURATION_S}] s")
    size = max(size, HEADER.size)
    pad = bytes(size - HEADER.size)
    pps = rate_mbit * 1e6 / 8 / (size + WIRE_OVERHEAD) if rate_mbit else None
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    addr = (dst, port)
    sent = errors = 0
    start = time.monotonic()
    deadline = start + duration
    batch = 64
    while sent < count:
        now = time.monotonic()
        if now >= deadline:
            break
        if pps is not None:
            allowed = min(count, int((now - start) * pps) + 1)
            if allowed <= sent:
                time.sleep(min(0.0005, max(0.0, (sent + 1) / pps - (now - start))))
                continue
        else:
            allowed = min(count, sent + batch)
        while sent < allowed:
            try:
                s.sendto(HEADER.pack(MAGIC, flow, sent) + pad, addr)
            except OSError as e:  # ENOBUFS, EAGAIN, ICMP-reported errors: count, go on
                errors += 1
                if e.errno in (errno.ENOBUFS, errno.EAGAIN):
                    time.sleep(0.0002)
                if errors > count:  # nothing is getting out: give up, still bounded
                    break
            sent += 1
        if errors > count:
            break
    elapsed = time.monotonic() - start
    s.close()
    return {"sent": sent, "errors": errors, "elapsed_s": elapsed, "size": size,
            "flow": flow, "dst": dst, "port": port}


def sink(port: int, bind: str, idle: float, max_time: float, expect: int | None) -> dict:
    """Receive on ``bind:port`` until ``expect`` datagrams arrived, nothing arrived for
    ``idle`` seconds after the first one, or ``max_time`` passed. Prints ``READY`` on
    stdout once bound, so a caller can start the sender without racing the bind."""
    if not 0 < max_time <= MAX_DURATION_S:
        raise SystemExit(f"max-time must be in (0, {MAX_DURATION_S}] s")
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:  # root may exceed rmem_max: keep socket-buffer drops out of loss measurements
        s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 64 << 20)
    except OSError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    s.bind((bind, port))
    rcvbuf_errors_0 = _rcvbuf_errors()
    print("READY", flush=True)
    start = time.monotonic()
    deadline = start + max_time
    flows: dict[int, set[int]] = {}
    received = bad = payload_bytes = 0
    first = last = None
    buf = bytearray(65536)
    while True:
        now = time.monotonic()
        if now >= deadline or (expect is not None and received >= expect):
            break
        wait = deadline - now
        if last is not None:
            wait = min(wait, last + idle - now)
            if wait <= 0:
                break
        s.settimeout(max(wait, 1e-3))
        try:
            n = s.recv_into(buf)
        except TimeoutError:
            continue
        t = time.monotonic()
        if first is None:
            first = t
        last = t
        received += 1
        payload_bytes += n
        if n >= HEADER.size:
            magic, flow, seq = HEADER.unpack_from(buf)
            if magic == MAGIC:
                flows.setdefault(flow, set()).add(seq)
                continue
        bad += 1
    s.close()
    span = (last - first) if first is not None and last is not None else 0.0
    return {
        "received": received,
        "bad": bad,
        "payload_bytes": payload_bytes,
        "wire_bytes": payload_bytes + WIRE_OVERHEAD * received,
        "first_s": (first - start) if first is not None else None,
        "span_s": span,
        "flows": {str(f): {"unique": len(seqs), "max_seq": max(seqs)} for f, seqs in flows.items()},
        "rcvbuf_errors": (_rcvbuf_errors() - rcvbuf_errors_0) if rcvbuf_errors_0 >= 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="traffic.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ps = sub.add_parser("send")
    ps.add_argument("--dst", required=True)
    ps.add_argument("--port", type=int, required=True)
    ps.add_argument("--count", type=int)
    ps.add_argument("--size", type=int, default=1200)
    ps.add_argument("--rate-mbit", type=float)
    ps.add_argument("--duration", type=float, default=10.0)
    ps.add_argument("--flow", type=int, default=0)
    pk = sub.add_parser("sink")
    pk.add_argument("--port", type=int, required=True)
    pk.add_argument("--bind", default="0.0.0.0")
    pk.add_argument("--idle", type=float, default=0.5)
    pk.add_argument("--max-time", type=float, default=10.0)
    pk.add_argument("--expect", type=int)
    a = p.parse_args(argv)
    if a.cmd == "send":
        count = a.count
        if count is None:
            if not a.rate_mbit:
                p.error("send needs --count, or --rate-mbit to derive it from --duration")
            frame = max(a.size, HEADER.size) + WIRE_OVERHEAD
            count = math.ceil(a.duration * a.rate_mbit * 1e6 / 8 / frame)
        out = send(a.dst, a.port, count, a.size, a.rate_mbit, a.duration, a.flow)
    else:
        out = sink(a.port, a.bind, a.idle, a.max_time, a.expect)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
