"""Shared helpers for the transport-core tests (wire, protocol, fake network).

Everything here is deterministic: hypothesis runs derandomized (``PROPERTY``), random
data comes from seeded numpy generators, and time is virtual.

``Tap`` is a FakeNetwork route that counts and logs every datagram by kind and loses
the ones a test picks - the tool for tests that must lose a *particular* control
datagram (the FakeNetwork's loss models are kind-blind).
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from boundedloss import wire
from boundedloss.net.fake import Datagram, FakeNetwork

#: Base settings for every property test in these files: reproducible, no deadline
#: (a lossy transfer's real time varies on a noisy 2-core machine), no example database.
PROPERTY = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SESSION = 0x5EED_0000_CAFE_F00D

# Sentinel for destination buffers: sources are drawn from 0..254, so a chunk that
# still holds 255 anywhere was never written, and a written chunk always differs.
SENTINEL = 0xFF


def load_tool(name: str):
    """``tools/<name>.py`` as a module (the tools are scripts, not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ctypes_gmac():
    """The Python core's tags through ctypes, as with ``BOUNDEDLOSS_NATIVE=0``: where the
    compiled path is held to the Python reference, the reference's tags must not come
    from the compiled module too."""
    from boundedloss.protocol import auth

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(auth, "compiled_gmac", lambda key: None)
        yield


def two_racks_with_a_narrow_spine(net: FakeNetwork, session: int, address) -> tuple:
    """On ``net``: two racks whose spine links carry 100 Mbit/s into 4-datagram queues,
    and an endpoint in each (``address(0)`` with a 10 Gb/s uplink, ``address(1)``).
    ``(runtime, a, b)``."""
    from boundedloss.net.fabric import Fabric, FabricProfile
    from boundedloss.net.fake import NodeProfile
    from boundedloss.net.simulated import SimEndpoint, SimRuntime

    net.fabric = Fabric(FabricProfile(uplink_bps=1e8, queue_datagrams=4), racks=2)
    rt = SimRuntime(net)
    a = SimEndpoint(rt, address(0), session=session, profile=NodeProfile(up_bps=1e10))
    b = SimEndpoint(rt, address(1), session=session)
    net.fabric.place(a.address, 0)
    net.fabric.place(b.address, 1)
    return rt, a, b


def spawn_transfer(rt, a, b, payload, message_id: int = 1) -> tuple:
    """Programs on the SimRuntime ``rt``: endpoint ``a`` sends ``payload`` to ``b``, and
    ``b`` receives it; the two programs (sender's, receiver's), their results once run."""
    sent = rt.spawn(lambda: a.send(b.address, payload, message_id=message_id).result())
    got = rt.spawn(lambda: b.receive(a.address, message_id=message_id,
                                     nbytes=payload.nbytes).result())
    return sent, got


def source_bytes(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` random bytes that never contain SENTINEL."""
    return np.random.default_rng(seed).integers(0, SENTINEL, size=nbytes, dtype=np.uint8)


def chunk_slices(nbytes: int, chunk_bytes: int) -> list[slice]:
    count = wire.chunk_count(nbytes, chunk_bytes)
    return [slice(i * chunk_bytes, min((i + 1) * chunk_bytes, nbytes)) for i in range(count)]


def chunks_equal(src: np.ndarray, dst: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """Bool per chunk: does the destination chunk equal the source chunk byte for byte?"""
    s = np.asarray(src).reshape(-1).view(np.uint8)
    d = np.asarray(dst).reshape(-1).view(np.uint8)
    assert s.nbytes == d.nbytes
    return np.array(
        [np.array_equal(s[sl], d[sl]) for sl in chunk_slices(s.nbytes, chunk_bytes)],
        dtype=bool,
    )


def kind_of(data: bytes) -> wire.Kind:
    return wire.decode(data)[0].kind


@dataclass(frozen=True)
class Carried:
    """One datagram a tapped network carried, in the order they left."""

    departed: float
    src: Hashable
    dst: Hashable
    kind: wire.Kind
    lost: bool  # lost by the tap (its ``drop`` picked it)


class Tap:
    """Installed as ``net``'s route: every datagram is counted per (src, kind) in
    ``sent`` and logged in ``log``; those that ``drop(datagram, nth)`` picks are lost
    (``nth``: how many datagrams of that kind ``src`` has sent, this one included) and
    counted per kind in ``lost``; the rest take the route that was there before."""

    def __init__(self, net: FakeNetwork, drop: Callable[[Datagram, int], bool] | None = None):
        self.drop = drop
        self.then = net.route
        self.sent: Counter[tuple[Hashable, wire.Kind]] = Counter()
        self.lost: Counter[wire.Kind] = Counter()
        self.log: list[Carried] = []
        net.route = self

    def __call__(self, datagram: Datagram) -> Sequence[float]:
        kind = datagram.kind
        self.sent[(datagram.src, kind)] += 1
        lost = self.drop is not None and self.drop(datagram, self.sent[(datagram.src, kind)])
        self.log.append(Carried(datagram.departed, datagram.src, datagram.dst, kind, lost))
        if lost:
            self.lost[kind] += 1
            return ()
        return self.then(datagram)

    def departures(self, src: Hashable, kind: wire.Kind) -> list[float]:
        """When each datagram of ``kind`` from ``src`` left, in order."""
        return [c.departed for c in self.log if c.src == src and c.kind == kind]


def run_behind_a_narrow_path(script: str, mtu: int = 1500) -> subprocess.CompletedProcess:
    """Run the Python ``script`` in a user and network namespace of its own whose
    loopback has the given MTU (so a path to 127.0.0.1 is that narrow); a pytest skip,
    saying why, where the kernel gives no unprivileged namespaces."""
    # (loopback's MTU set over rtnetlink, as the testbed sets links: no ip binary)
    narrow = ("from pyroute2 import IPRoute\n"
              "with IPRoute() as _ipr:\n"
              f"    _ipr.link('set', index=_ipr.link_lookup(ifname='lo')[0], mtu={mtu},"
              " state='up')\n")
    cmd = ["unshare", "--user", "--map-root-user", "--net", sys.executable, "-c",
           narrow + script]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("unshare is not installed")
    if proc.returncode != 0 and "unshare" in proc.stderr:
        pytest.skip(f"no user and network namespace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    return proc


def same_state_dict(a, b) -> bool:
    """Equal state_dicts (nested dicts, lists, tensors): tensors by dtype and value, the
    rest by ==."""
    import torch  # (here: most tests never need it)

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state_dict(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_state_dict(x, y) for x, y in zip(a, b))
    return a == b
