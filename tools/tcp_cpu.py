"""What TCP costs this machine's CPU on the kernel testbed: the simulator's TCP hosts'
costs (gloo's ring and tcp-ps), measured.

1. A bulk transfer: one TCP stream from a worker's namespace to the server's, through
   the testbed's switch, ``--bulk-mb`` of it, three times (the median): the CPU a byte
   costs its sender and its receiver (``getrusage``: every thread's user and system time, which on
   this kernel holds the softirq work done in each process's context - the switch's
   forwarding and the receiver's TCP input mostly run in the sender's).
2. ``bench kernel-loss``'s ranks for gloo's allreduce and for tcp-ps, each rank's CPU
   over the exchange call of every round but the first. A byte costs what it cost the
   bulk transfer (``byte_out``, ``byte_in``); what gloo's ring spends beyond its bytes
   is its steps' own (``message_main``, per message sent or received, its waits
   included). tcp-ps, with other bytes and messages per rank, is the check.

Prints the costs and each rank's CPU a round beside what the costs predict, and writes
them (``--json``); ``boundedloss sim`` reads the result as its TCP hosts' preset
(``sim.job.MEASURED_TCP_COSTS``).

    python tools/tcp_cpu.py --json benchmarks/tcp-cpu-1500.json

(root, or a user namespace of its own, as ``boundedloss testbed``.)
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PORT = 29631
BLOCK = 1 << 20
BULK_RUNS = 3


def _cpu() -> float:
    """This process's CPU seconds so far, every thread's user and system time."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bulk_receive(out: str, nbytes: int) -> None:
    """(In the server's namespace) take ``nbytes`` from one connection; write the CPU."""
    with socket.create_server(("0.0.0.0", PORT)) as srv:
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(BLOCK)
            got, t0 = 0, _cpu()
            while got < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                got += n
            Path(out, "bulk-in.json").write_text(json.dumps({"cpu": _cpu() - t0, "bytes": got}))


def bulk_send(out: str, server: str, nbytes: int) -> None:
    """(In a worker's namespace) send ``nbytes`` to the server; write the CPU."""
    for _ in range(100):  # (the receiver may not listen yet)
        try:
            conn = socket.create_connection((server, PORT))
            break
        except OSError:
            time.sleep(0.05)
    else:
        sys.exit("the bulk receiver never listened")
    with conn:
        block = bytes(BLOCK)
        sent, t0 = 0, _cpu()
        while sent < nbytes:
            conn.sendall(block)
            sent += BLOCK
        conn.shutdown(socket.SHUT_WR)
        cpu = _cpu() - t0
        conn.recv(1)  # (the receiver closes once it has it all)
    Path(out, "bulk-out.json").write_text(json.dumps({"cpu": cpu, "bytes": sent}))


def rank(argv: list[str]) -> None:
    """One rank of ``bench kernel-loss`` (gloo or tcp-ps) with its exchange calls' CPU
    counted, round 0 left out; writes cpu<rank>.json."""
    import torch.distributed as dist

    from boundedloss.bench import kernel_loss
    from boundedloss.torch import tcp_ps

    spent: list[float] = []

    def counted(real):
        def call(*a, **k):
            t0 = _cpu()
            try:
                return real(*a, **k)
            finally:
                spent.append(_cpu() - t0)
        return call

    dist.all_reduce = counted(dist.all_reduce)
    tcp_ps.average_through_server = counted(tcp_ps.average_through_server)
    out, who = argv[argv.index("--out") + 1], argv[argv.index("--rank") + 1]
    kernel_loss.rank_main(argv)
    Path(out, f"cpu{who}.json").write_text(json.dumps({"cpu": spent[1:]}))


def moved(system: str, rank_: int, ranks: int, nbytes: int) -> tuple[int, int, int]:
    """(bytes out, bytes in, messages sent and received) of one rank in one exchange."""
    if system == "gloo":  # the ring: 2(N - 1) steps, a chunk of nbytes/N out and in each
        steps = 2 * (ranks - 1)
        chunk = -(-nbytes // ranks)
        return steps * chunk, steps * chunk, 2 * steps
    workers = ranks - 1  # tcp-ps: every gradient into rank 0, the mean back
    if rank_ == 0:
        return workers * nbytes, workers * nbytes, 2 * workers
    return nbytes, nbytes, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--elements", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--bulk-mb", type=int, default=512)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from boundedloss.emulate import Testbed, TestbedConfig

    nodes = ["server", *(f"w{i}" for i in range(a.ranks - 1))]
    nbytes = 4 * a.elements
    with tempfile.TemporaryDirectory() as tmp, \
            Testbed(TestbedConfig(workers=a.ranks - 1, mtu=a.mtu)) as tb:
        bulk = a.bulk_mb << 20
        samples = []
        for _ in range(BULK_RUNS):
            receiver = tb.run("server", [sys.executable, __file__, "--bulk-receive", tmp,
                                         str(bulk)])
            sender = tb.run("w0", [sys.executable, __file__, "--bulk-send", tmp,
                                   tb.addresses["server"], str(bulk)])
            if sender.wait(timeout=600) or receiver.wait(timeout=60):
                sys.exit("the bulk transfer failed")
            out_ = json.loads(Path(tmp, "bulk-out.json").read_text())
            in_ = json.loads(Path(tmp, "bulk-in.json").read_text())
            samples.append((out_["cpu"] / out_["bytes"], in_["cpu"] / in_["bytes"]))
        # (the median run: a process that runs beside it takes some of the softirq
        # work into its own account)
        byte_out, byte_in = sorted(samples)[len(samples) // 2]
        per_rank: dict[str, list[float]] = {}
        for system in ("gloo", "tcp-ps"):
            log = open(Path(tmp, "ranks.log"), "w")
            procs = [tb.run(node, [sys.executable, __file__, "--rank", str(r), "--world",
                                   str(a.ranks), "--master", tb.addresses["server"],
                                   "--port", "29612", "--system", system,
                                   "--elements", str(a.elements), "--rounds", str(a.rounds),
                                   "--out", tmp], stdout=log, stderr=subprocess.STDOUT)
                     for r, node in enumerate(nodes)]
            for p in procs:
                if p.wait(timeout=600):
                    log.close()
                    sys.exit(f"a {system} rank failed:\n"
                             + Path(tmp, "ranks.log").read_text()[-2000:])
            log.close()
            per_rank[system] = [
                sum(c := json.loads(Path(tmp, f"cpu{r}.json").read_text())["cpu"]) / len(c)
                for r in range(a.ranks)]
    # A byte costs what it cost the bulk transfer; gloo's ring spends the rest of its
    # CPU on its steps (each rank the same bytes and messages): its message cost. tcp-ps
    # is the check (its rows' "model ms").
    rows = []
    for system, cpus in per_rank.items():
        for r, cpu in enumerate(cpus):
            out_b, in_b, msgs = moved(system, r, a.ranks, nbytes)
            rows.append({"system": system, "rank": r, "cpu_ms": 1e3 * cpu, "bytes_out": out_b,
                         "bytes_in": in_b, "messages": msgs})
    gloo = [row for row in rows if row["system"] == "gloo"]
    message_main = max(0.0, sum(
        (1e-3 * row["cpu_ms"] - row["bytes_out"] * byte_out - row["bytes_in"] * byte_in)
        / row["messages"] for row in gloo) / len(gloo))
    costs = {"byte_out": byte_out, "byte_in": byte_in, "message_main": message_main}
    print(f"{'system':>7} {'rank':>4} | {'CPU ms a round':>14} {'MB out':>7} {'messages':>8} "
          f"{'model ms':>8}")
    for row in rows:
        model = (row["bytes_out"] * byte_out + row["bytes_in"] * byte_in
                 + row["messages"] * message_main)
        print(f"{row['system']:>7} {row['rank']:>4} | {row['cpu_ms']:14.2f} "
              f"{row['bytes_out'] / 1e6:7.2f} {row['messages']:8d} {1e3 * model:8.2f}")
    print(f"costs: byte_out {1e9 * byte_out:.3f} ns/B, byte_in {1e9 * byte_in:.3f} ns/B "
          f"(a bulk transfer of {a.bulk_mb} MB at MTU {a.mtu}), message_main "
          f"{1e6 * message_main:.1f} us (gloo's CPU the bytes leave)")
    if a.json:
        a.json.write_text(json.dumps({
            "ranks": a.ranks, "mtu": a.mtu, "elements": a.elements, "rounds": a.rounds,
            "bulk_mb": a.bulk_mb, "bulk": samples, "costs": costs, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank(sys.argv[1:])
    elif "--bulk-receive" in sys.argv:
        i = sys.argv.index("--bulk-receive")
        bulk_receive(sys.argv[i + 1], int(sys.argv[i + 2]))
    elif "--bulk-send" in sys.argv:
        i = sys.argv.index("--bulk-send")
        bulk_send(sys.argv[i + 1], sys.argv[i + 2], int(sys.argv[i + 3]))
    else:
        main()
