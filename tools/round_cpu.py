"""Where a gradient-exchange round's CPU goes, per rank, on the kernel testbed.

Runs ``bench kernel-loss``'s ranks (4, the testbed's server and three workers) with
each step of the I/O thread and of the collective wrapped in a CPU-time clock
(``time.thread_time``: this thread's user and kernel time, so a ``sendmsg`` that
forwards through the testbed's switch counts the forwarding too), and counts the
datagrams the compiled data path hands to the Python core, by kind. Prints the mean
per rank and round. The wrappers cost about a microsecond a call: read the figures
as shares, and time rounds with ``bench kernel-loss``, not with this.

    python tools/round_cpu.py --system reliable --topology allreduce --auth on
    python tools/round_cpu.py --system dblp --loss 0.05 --rounds 40
    python tools/round_cpu.py --ranks 8 --json round-cpu.json
    python tools/round_cpu.py --profile /tmp/round-profile

``--profile DIR`` runs each rank's I/O thread and main thread under cProfile as well,
writes their statistics to DIR and prints rank 1's: which functions the Python is in.
(The profiler's own cost then counts in every figure; a loaded machine's preemptions in
its times.)

``--json`` adds, per rank and round (mean of the ranks): ``python_ms`` (the I/O thread's
Python and the collective's, the compiled path's and the kernel's steps taken out),
``compiled_ms`` (the compiled path's own work on what it received: tags and copies,
without the core's share), ``kernel_ms`` (the system calls: recvmmsg, the control
datagrams' sendmsg or sendmmsg, select, and the send runs - the compiled path's sealing of a run
cannot be told apart from its sendmsg here, so it counts as the kernel's),
``per_message_us`` (Python CPU per message posted, as a receive or a send) and
``per_control_datagram_us`` (the Python core's CPU per datagram the compiled path handed
it, or took and handed the core a decision about: the DATA that meets a receive's plan, a
STOP - or took and closed the receive of, the core recording its result).

(root, or a user namespace of its own, as ``boundedloss testbed``.)
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: (what is timed, as printed) -> (module, class, method); indented names run inside
#: the one above them
IO_STEPS = {
    "receive (recvmmsg, take)": ("boundedloss.net.udp", "UdpEndpoint", "_receive_native"),
    "  recvmmsg": ("boundedloss.net.native", "NativeDataPath", "read"),
    "  take (tags, copies)": ("boundedloss.net.native", "NativeDataPath", "_take_batch"),
    "    core: handed back": ("boundedloss.protocol.mux", "TransferMux",
                              "authenticated_datagram_received"),
    "    core: handed back (plain)": ("boundedloss.protocol.mux", "TransferMux",
                                      "datagram_received"),
    "    core: a taken one's decision": ("boundedloss.net.native", "NativeDataPath", "_event"),
    "    core: closed in C, recorded": ("boundedloss.protocol.mux", "TransferMux",
                                       "closed_by_data_path"),
    "send runs (tags, sendmsg)": ("boundedloss.net.udp", "UdpEndpoint", "_send_run"),
    "sendmsg (control datagrams)": None,
    "sendmmsg (control datagrams)": ("boundedloss.net.native", "NativeDataPath",
                                     "send_datagrams"),
    "select": None,
    "core: poll": ("boundedloss.protocol.mux", "TransferMux", "poll"),
    "core: next_deadline": ("boundedloss.protocol.mux", "TransferMux", "next_deadline"),
    "core: has_output": ("boundedloss.protocol.mux", "TransferMux", "has_output"),
    "futures resolved": ("boundedloss.net.udp", "UdpEndpoint", "_resolve"),
}
MAIN_STEPS = {
    "collective call": ("boundedloss.collective.transpose", "TransposeAllreduce",
                        "allreduce_mean"),
    "collective call (ps)": ("boundedloss.collective.parameter_server", "ParameterServer",
                             "allreduce_mean"),
    "collective call (two-level)": ("boundedloss.collective.two_level", "TwoLevelAllreduce",
                                    "allreduce_mean"),
    "  post receives": ("boundedloss.collective.base", "Collective", "_post_many"),
    "  post sends": ("boundedloss.net.udp", "UdpEndpoint", "send_many"),
    "  wait for results": ("boundedloss.collective.base", "Collective", "_wait"),
    "  aggregate": ("boundedloss.aggregate", "UnbiasedRescale", "aggregate"),
    "  accept broadcasts": ("boundedloss.collective.base", "Collective", "_accept_broadcast"),
    "  chunk masks to elements": ("boundedloss.collective.base", "Collective", "_elements"),
}
#: the steps that post messages, a batch a call
POSTS = ("  post receives", "  post sends")
KINDS = {1: "DATA", 2: "PROBE", 3: "BITMAP", 4: "STOP", 5: "ACK"}


def _instrument(cpu: collections.Counter, calls: collections.Counter) -> None:
    import importlib
    import socket

    from boundedloss import wire
    from boundedloss.net import udp
    from boundedloss.protocol import mux
    from boundedloss.protocol.receiver import MessageReceiver

    def timed(real, name):
        def call(*a, **k):
            if name.startswith("collective call") and a[2] == 1 and "warm-up" not in cpu:
                # round 0 warms up (its receives are not posted ahead): leave it out
                io_thread = next(t for t in threading.enumerate()
                                 if t.name.startswith("boundedloss"))
                io_cpu = time.clock_gettime(time.pthread_getcpuclockid(io_thread.ident))
                cpu.clear()
                calls.clear()
                cpu["warm-up"] = io_cpu
            t0 = time.thread_time()
            try:
                return real(*a, **k)
            finally:
                cpu[name] += time.thread_time() - t0
                calls[name] += 1
                if name in POSTS:  # (a call posts the receives or sends of a batch)
                    calls[name + ", messages"] += len(a[1])
        return call

    for name, where in {**IO_STEPS, **MAIN_STEPS}.items():
        if where is not None:  # (None: a system call, timed below)
            module, cls, method = where
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, method, timed(getattr(owner, method), name))
    # the I/O loop's own system calls: control datagrams one by one, its sleep
    socket.socket.sendmsg = timed(socket.socket.sendmsg,  # type: ignore[method-assign]
                                  "sendmsg (control datagrams)")
    udp.select.select = timed(udp.select.select, "select")  # type: ignore[attr-defined]

    # (internals, wrapped by name: this tool is the one place that looks inside)
    accept = getattr(mux.TransferMux, "_accept")  # noqa: B009

    def counted(self, data, peer, now):
        try:
            calls["kind " + KINDS.get(wire.parse(data)[0], "?")] += 1
        except wire.MalformedDatagram:
            calls["kind malformed"] += 1
        return accept(self, data, peer, now)

    setattr(mux.TransferMux, "_accept", counted)  # noqa: B010
    data_received = MessageReceiver.data_received

    def classified(self, index, *a, **k):
        calls["DATA " + ("first of its message" if self.first_heard is None
                         else "last" if index == self.count - 1 else "other")] += 1
        return data_received(self, index, *a, **k)

    MessageReceiver.data_received = classified  # type: ignore[method-assign]
    io_loop = getattr(udp.UdpEndpoint, "_io_loop")  # noqa: B009

    def io_timed(self):
        try:
            return io_loop(self)
        finally:
            cpu["I/O thread, all"] = time.thread_time() - cpu["warm-up"]

    setattr(udp.UdpEndpoint, "_io_loop", io_timed)  # noqa: B010


def _profiled(rank_main, argv: list[str], where: Path, who: str) -> None:
    """Run ``rank_main(argv)`` with this thread and the endpoint's I/O thread each under
    a cProfile of its own, written to ``where``."""
    import cProfile

    from boundedloss.net import udp

    io_loop = getattr(udp.UdpEndpoint, "_io_loop")  # noqa: B009

    def io_profiled(self):
        profile = cProfile.Profile()
        try:
            return profile.runcall(io_loop, self)
        finally:
            profile.dump_stats(where / f"io{who}.pstats")

    setattr(udp.UdpEndpoint, "_io_loop", io_profiled)  # noqa: B010
    profile = cProfile.Profile()
    try:
        profile.runcall(rank_main, argv)
    finally:
        profile.dump_stats(where / f"main{who}.pstats")


def rank(argv: list[str]) -> None:
    """One rank: ``bench kernel-loss``'s, instrumented; writes cpu<rank>.json."""
    from boundedloss.bench import kernel_loss

    cpu: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    _instrument(cpu, calls)
    out, who = argv[argv.index("--out") + 1], argv[argv.index("--rank") + 1]
    rounds = int(argv[argv.index("--rounds") + 1])
    if "--profile" in argv:  # (this tool's option, not the rank's)
        at = argv.index("--profile")
        _profiled(kernel_loss.rank_main, argv[:at] + argv[at + 2:], Path(argv[at + 1]), who)
    else:
        kernel_loss.rank_main(argv)
    time.sleep(0.2)  # (the I/O thread ends with the endpoint: let it add its total)
    Path(out, f"cpu{who}.json").write_text(json.dumps({
        "ms": {k: 1e3 * v / rounds for k, v in cpu.items()},
        "calls": {k: v / rounds for k, v in calls.items()}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", default="reliable", help="as bench kernel-loss --systems")
    ap.add_argument("--topology", default="allreduce", choices=["ps", "allreduce", "two-level"])
    ap.add_argument("--auth", default="on", choices=["on", "off"])
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--elements", type=int, default=1 << 20)
    ap.add_argument("--ranks", type=int, default=4, help="world size (2 to 16)")
    ap.add_argument("--mtu", type=int, default=1500,
                    help="the testbed links' MTU (bench kernel-loss's default); chunks follow it")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="also profile each rank's threads (cProfile) into DIR "
                         "(io<rank>.pstats, main<rank>.pstats); prints rank 1's")
    a = ap.parse_args()
    if not 2 <= a.ranks <= 16:
        sys.exit("--ranks must be 2 to 16")
    if a.profile is not None:
        a.profile.mkdir(parents=True, exist_ok=True)
        a.profile = a.profile.resolve()
    from boundedloss.emulate import Testbed, TestbedConfig

    nodes = ["server", *(f"w{i}" for i in range(a.ranks - 1))]
    with tempfile.TemporaryDirectory() as tmp, \
            Testbed(TestbedConfig(workers=a.ranks - 1, mtu=a.mtu)) as tb:
        for node in nodes:
            tb.set_loss(a.loss, node, protocol="all")
        log = open(Path(tmp, "ranks.log"), "w")
        procs = [tb.run(node, [sys.executable, __file__, "--rank", str(r), "--world",
                               str(a.ranks),
                               "--master", tb.addresses["server"], "--port", "29611",
                               "--system", a.system, "--topology", a.topology,
                               "--elements", str(a.elements), "--rounds", str(a.rounds),
                               *([] if a.auth == "on" else ["--no-auth"]), "--out", tmp,
                               *([] if a.profile is None else ["--profile", str(a.profile)])],
                        stdout=log, stderr=subprocess.STDOUT)
                 for r, node in enumerate(nodes)]
        for p in procs:
            if p.wait(timeout=600):
                log.close()
                tail = Path(tmp, "ranks.log").read_text().strip().splitlines()[-5:]
                sys.exit(f"a rank failed (exit {p.returncode}):\n" + "\n".join(tail))
        log.close()
        per_rank = [json.loads(Path(tmp, f"cpu{r}.json").read_text())
                    for r in range(a.ranks)]
    n_ranks = len(per_rank)
    print(f"{a.system} ({a.topology}, auth {a.auth}) at {a.loss:.0%} loss: CPU ms per rank "
          f"and round (mean of {n_ranks} ranks, {a.rounds} rounds), calls per round")
    for title, steps in (("I/O thread", ["I/O thread, all", *IO_STEPS]),
                         ("main thread", list(MAIN_STEPS))):
        print(title)
        for step in steps:
            ms = [rk["ms"].get(step, 0.0) for rk in per_rank]
            n = [rk["calls"].get(step, 0.0) for rk in per_rank]
            if any(ms):
                print(f"  {step:32s} {sum(ms) / n_ranks:7.2f} ms  "
                      f"{sum(n) / n_ranks:7.1f} calls")
    print("datagrams handed to the Python core, per rank and round")
    for kind in [*KINDS.values(), "DATA first of its message", "DATA last", "DATA other"]:
        n = sum(rk["calls"].get(("kind " if " " not in kind else "") + kind, 0.0)
                for rk in per_rank) / n_ranks
        print(f"  {kind:26s} {n:7.1f}")
    n = sum(rk["calls"].get("    core: a taken one's decision", 0.0)
            for rk in per_rank) / n_ranks
    print(f"  {'taken, decision handed':26s} {n:7.1f}   (the DATA that meets a plan, a STOP)")
    n = sum(rk["calls"].get("    core: closed in C, recorded", 0.0) for rk in per_rank) / n_ranks
    print(f"  {'taken, closed in C':26s} {n:7.1f}   (a routine receive's closing DATA)")
    split = where_it_goes(per_rank)
    print("per rank and round: " + ", ".join(
        f"{k} {v:.2f}" for k, v in split.items()))
    if a.profile is not None:
        import pstats
        for thread in ("io", "main"):
            print(f"rank 1's {'I/O' if thread == 'io' else 'main'} thread under cProfile "
                  f"({a.profile / f'{thread}1.pstats'}), the most time of its own:")
            pstats.Stats(str(a.profile / f"{thread}1.pstats")).sort_stats("tottime").print_stats(25)
    if a.json:
        a.json.write_text(json.dumps({
            "system": a.system, "topology": a.topology, "auth": a.auth, "loss": a.loss,
            "mtu": a.mtu,
            "ranks": n_ranks, "rounds": a.rounds, "elements": a.elements, **split,
            "steps_ms": {step: sum(rk["ms"].get(step, 0.0) for rk in per_rank) / n_ranks
                         for step in ["I/O thread, all", *IO_STEPS, *MAIN_STEPS]},
            "calls": {k: sum(rk["calls"].get(k, 0.0) for rk in per_rank) / n_ranks
                      for k in sorted({k for rk in per_rank for k in rk["calls"]})},
        }, indent=2) + "\n")


def where_it_goes(per_rank: list[dict]) -> dict[str, float]:
    """Python, compiled-path and kernel CPU per rank and round (ms), and Python's per
    message and per control datagram (us), from the ranks' step timings."""
    def mean(table: str, key: str) -> float:
        return sum(rk[table].get(key, 0.0) for rk in per_rank) / len(per_rank)

    io_all = mean("ms", "I/O thread, all")
    recv, take = mean("ms", "  recvmmsg"), mean("ms", "  take (tags, copies)")
    # (a datagram the compiled path took but whose decision is the core's - the DATA that
    # meets a plan, a STOP - or whose receive it closed, the core recording the result,
    # counts as one the core handled: its CPU, and one datagram)
    core_back = (mean("ms", "    core: handed back")
                 + mean("ms", "    core: handed back (plain)")
                 + mean("ms", "    core: a taken one's decision")
                 + mean("ms", "    core: closed in C, recorded"))
    sends = mean("ms", "send runs (tags, sendmsg)")
    syscalls = (recv + mean("ms", "sendmsg (control datagrams)")
                + mean("ms", "sendmmsg (control datagrams)") + mean("ms", "select"))
    compiled = take - core_back
    kernel = syscalls + sends
    main_all = sum(mean("ms", step) for step in MAIN_STEPS if step.startswith("collective call"))
    python = (io_all - compiled - kernel) + main_all
    messages = sum(mean("calls", step + ", messages") for step in POSTS)
    handed = (sum(mean("calls", "kind " + k) for k in KINDS.values())
              + mean("calls", "    core: a taken one's decision")
              + mean("calls", "    core: closed in C, recorded"))
    return {
        "python_ms": python, "compiled_ms": compiled, "kernel_ms": kernel,
        "per_message_us": 1e3 * python / messages if messages else float("nan"),
        "per_control_datagram_us": 1e3 * core_back / handed if handed else float("nan"),
    }


if __name__ == "__main__":
    if "--rank" in sys.argv:
        rank(sys.argv[1:])
    else:
        main()
