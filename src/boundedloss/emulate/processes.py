"""Processes inside the testbed's namespaces: commands started in a node (and ended at
teardown), the bounded traffic tools (``traffic.py``), and ending whatever is left in
a namespace."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import netns
from .errors import TestbedError
from .topology import NODE_IFACE

TRAFFIC = Path(__file__).with_name("traffic.py")



def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is as good as gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def end_pids(pids: list[int], grace_s: float = 1.0) -> None:
    """SIGTERM these pids, then SIGKILL whatever is still alive after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in pids if alive(p)]
        if not live:
            return
        for p in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in live):
            time.sleep(0.02)


def node_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a command in a node gets: ``env`` (default: ours) with
    ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME`` = eth0, the node's one interface (Gloo
    otherwise binds to what the host name resolves to - 127.0.0.1 or a root namespace
    address - and a rendezvous across namespaces times out). An explicit ``env`` keeps
    its own values; the inherited environment is overridden."""
    node = dict(GLOO_SOCKET_IFNAME=NODE_IFACE, TP_SOCKET_IFNAME=NODE_IFACE)
    if env is None:
        return {**os.environ, **node}
    return {**node, **env}


class ProcessRunner:
    """Starts commands inside namespaces and remembers them, so that :meth:`end_all`
    can end what is still running."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []

    def run(self, namespace: str, argv: list[str], **popen_kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``namespace``; the environment is ``node_env(env)``."""
        popen_kw["env"] = node_env(popen_kw.get("env"))
        p = subprocess.Popen(netns.enter_argv(namespace, argv), **popen_kw)
        self._procs = [q for q in self._procs if q.poll() is None] + [p]
        return p

    def call(self, namespace: str, argv: list[str], *, timeout: float = 30.0,
             check: bool = False, where: str = "") -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``namespace`` to completion (bounded by ``timeout``),
        capturing text output."""
        what = f"{shlex.join(map(str, argv))} in {where or namespace}"
        try:
            p = subprocess.run(netns.enter_argv(namespace, argv), capture_output=True,
                               text=True, timeout=timeout, env=node_env())
        except subprocess.TimeoutExpired:
            raise TestbedError(f"{what} timed out after {timeout:g} s") from None
        if check and p.returncode != 0:
            why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
            raise TestbedError(f"{what} failed: {why}")
        return p

    def end_all(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                end_pids([p.pid], grace_s=0.5)
            with contextlib.suppress(Exception):
                p.wait(timeout=1)
        self._procs.clear()


def sink_argv(port: int, *, idle: float, max_time: float, expect: int | None) -> list[str]:
    argv = [sys.executable, str(TRAFFIC), "sink", "--port", str(port), "--idle", str(idle),
            "--max-time", str(max_time)]
    if expect is not None:
        argv += ["--expect", str(expect)]
    return argv


def send_argv(dst: str, port: int, *, count: int | None, size: int, rate_mbit: float | None,
              duration: float, flow: int) -> list[str]:
    argv = [sys.executable, str(TRAFFIC), "send", "--dst", dst, "--port", str(port),
            "--size", str(size), "--duration", str(duration), "--flow", str(flow)]
    if count is not None:
        argv += ["--count", str(count)]
    if rate_mbit:
        argv += ["--rate-mbit", str(rate_mbit)]
    return argv


class TrafficProcess:
    """A running ``traffic.py`` sender or sink. ``wait()`` returns its JSON report; it is
    bounded by the tool's own time bound plus a margin, after which it is killed."""

    def __init__(self, proc: subprocess.Popen, *, bound_s: float, what: str):
        self.proc = proc
        self.bound_s = bound_s
        self.what = what
        self.result: dict | None = None

    def wait_until_ready(self, timeout: float) -> None:
        """Block until the tool prints ``READY`` on stdout (a sink once it is bound); a
        tool that exits first, or stays silent for ``timeout`` s, is a TestbedError."""
        import selectors

        stdout, stderr = self.proc.stdout, self.proc.stderr
        if stdout is None or stderr is None:
            raise TestbedError(f"{self.what} was started without stdout/stderr pipes: "
                               "nothing to wait on")
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.stop()
                    raise TestbedError(f"{self.what} did not start within {timeout:g} s")
                line = stdout.readline()
                if line.strip() == b"READY":
                    return
                if not line:
                    err = stderr.read().decode(errors="replace").strip()
                    last = err.splitlines()[-1] if err else "no output"
                    raise TestbedError(f"{self.what} exited: {last}")

    @property
    def done(self) -> bool:
        return self.proc.poll() is not None

    def wait(self, timeout: float | None = None) -> dict:
        if self.result is not None:
            return self.result
        timeout = self.bound_s + 10.0 if timeout is None else timeout
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise TestbedError(f"{self.what} still running after {timeout:g} s; "
                               "ended it") from None
        text = out.decode(errors="replace").strip().splitlines()
        try:
            self.result = json.loads(text[-1])
        except (IndexError, ValueError):
            why = err.decode(errors="replace").strip().splitlines()
            raise TestbedError(f"{self.what} failed (exit {self.proc.returncode}): "
                               f"{why[-1] if why else 'no output'}") from None
        return self.result

    def stop(self) -> None:
        if self.proc.poll() is None:
            end_pids([self.proc.pid], grace_s=0.5)
        with contextlib.suppress(Exception):
            self.proc.communicate(timeout=1)

    def __enter__(self) -> TrafficProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
