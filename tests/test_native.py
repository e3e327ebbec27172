"""The compiled data path against the Python reference.

- ``classify`` (the native header check) agrees with ``wire.parse`` on every datagram;
- differential: two TransferMux cores, one with the native data path attached, fed the
  same datagram sequences (valid, malformed, foreign, duplicated, reordered, lost,
  mutated) end with identical delivered flags, destination bytes, counters, results and
  outgoing datagrams;
- fuzz: over a million random and mutated datagrams through the native copy, with guard
  bytes around the destination: no crash, no byte written outside it;
- the same, authenticated: the tags the compiled path builds and checks are the Python
  reference's, byte for byte, and a million mutated sealed datagrams write nothing
  anywhere but what verifies.

Skipped, with the reason, where the extension is not built.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundedloss import wire
from boundedloss.aggregate import HadamardDispersion
from boundedloss.net import native
from boundedloss.net.loss import Bernoulli
from boundedloss.policy import ClosePlan, EarlyClosePolicy, FixedBoundPolicy, ReliablePolicy
from boundedloss.protocol import TransferMux, TransportConfig, auth
from boundedloss.protocol.auth import TRAILER_BYTES, DatagramAuth, job_key
from boundedloss.wire import HEADER_BYTES, DropReason, Flag, Kind, MalformedDatagram
from conftest import PROPERTY, SENTINEL, SESSION, load_tool, source_bytes

# (the reference's tags through ctypes, not the compiled module: conftest.ctypes_gmac)
pytestmark = [pytest.mark.skipif(native.status().startswith("python ("),
                                 reason=f"compiled data path: {native.status()}"),
              pytest.mark.usefixtures("ctypes_gmac")]

#: auth's own choice of Gmac, as imported (the module's fixture replaces it)
_COMPILED_GMAC = auth.compiled_gmac
PEER = ("10.1.2.3", 4000)
#: the receiving endpoint's own address (what an authenticated receiver's tags cover)
LOCAL = ("10.1.2.4", 5000)
KEY = job_key(b"test secret", SESSION)
GUARD = 64
OTHER = 8  # another message of the same round, from the same peer
needs_openssl = pytest.mark.skipif(not native.authenticates(),
                                   reason=f"compiled data path: {native.AUTH_FALLBACK}")


def _parse_reason(data: bytes) -> str | None:
    try:
        wire.parse(data)
    except MalformedDatagram as e:
        return e.reason.value
    return None


def _mutate(rng: np.random.Generator, d: bytes) -> bytes:
    """One of: flip bytes in the header, a random header field, a new length."""
    b = bytearray(d)
    what = rng.integers(4)
    if what == 0:
        for _ in range(rng.integers(1, 4)):
            b[rng.integers(min(len(b), HEADER_BYTES))] = rng.integers(256)
    elif what == 1:
        name = list(wire.OFFSET)[rng.integers(len(wire.OFFSET))]
        off, size = wire.OFFSET[name], wire.FIELD_BYTES[name]
        b[off : off + size] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    elif what == 2:
        b = b[: rng.integers(len(b) + 1)]
    else:
        b += rng.integers(0, 256, rng.integers(1, 16), dtype=np.uint8).tobytes()
    return bytes(b)


def _message(nbytes: int, chunk_bytes: int, seed: int, auth: bool = False,
             message_id: int = 7) -> list[bytes]:
    """Every datagram a real sender puts out for a message, first pass and FINAL PROBE
    (``auth``: sealed, from PEER to LOCAL)."""
    sender = TransferMux(SESSION, TransportConfig(chunk_bytes=chunk_bytes),
                         auth=DatagramAuth(KEY, PEER) if auth else None)
    sender.start_send(LOCAL if auth else PEER, 3, message_id, source_bytes(nbytes, seed), 0.0)
    return [b"".join(bytes(p) for p in parts) for parts, _ in sender.poll(0.0, 1 << 20)]


def _carrying(d: bytes) -> bytes:
    """``d`` flagged PROBE_CARRIED, if it is a DATA datagram (else as it is)."""
    b = bytearray(d)
    if len(b) >= HEADER_BYTES and b[wire.OFFSET["kind"]] == Kind.DATA:
        b[wire.OFFSET["flags"]] |= Flag.PROBE_CARRIED
    return bytes(b)


def _carried(datagrams: list[bytes]) -> list[bytes]:
    """A message's first pass as a warm sender on a path that loses nothing sends it
    (MessageSender; test_sender_units): its PROBE carried by its last DATA."""
    *data, probe = datagrams
    assert probe[wire.OFFSET["kind"]] == Kind.PROBE and data[-1][wire.OFFSET["kind"]] == Kind.DATA
    return [*data[:-1], _carrying(data[-1])]


def test_classify_agrees_with_wire_parse() -> None:
    rng = np.random.default_rng(5)
    seeds = _message(5000, 64, 1) + [
        wire.control_datagram(wire.Header(Kind.BITMAP, SESSION, 1, 2, 0, 100, 100, 1), k, i, p)
        for k, i, p in [(Kind.BITMAP, 0, b"\0" * 9), (Kind.STOP, 1, b"\0" * 4),
                        (Kind.ACK, 0, b"\0" * 4), (Kind.BITMAP, 8, b"\0" * 20)]]
    seen = set()
    for i in range(100_000):
        d = seeds[i % len(seeds)]
        if i % 7:
            d = _mutate(rng, d)
        expected = _parse_reason(d)
        assert native.module().classify(d) == expected, (d.hex(), expected)
        seen.add(expected)
    assert {None, "short", "bad_magic", "bad_version", "bad_kind", "bad_length",
            "bad_geometry"} <= seen


# ------------------------------------------------------------------ differential
#: under credit (protocol/credit.py), the tests' budgets in datagrams: one that grants
#: the receive a share of its own (its ACKs then come every share / 2), and the least
#: one, which parks the receive behind another heard first (UNPARK ends that one's pass)
CREDIT_BUDGETS = {"share": 7, "parked": 2}


def _twin(policy_factory, nbytes: int, chunk_bytes: int, critical: np.ndarray | None,
          sized: bool, auth: bool = False, credit: str | None = None):
    budget = None if credit is None else CREDIT_BUDGETS[credit] * (chunk_bytes + HEADER_BYTES)
    cfg = TransportConfig(chunk_bytes=chunk_bytes, receive_deadline=5.0, credit_bytes=budget)
    side = []
    for use_native in (False, True):
        mux = TransferMux(SESSION, cfg, auth=DatagramAuth(KEY, LOCAL) if auth else None)
        path = native.NativeDataPath(mux) if use_native else None
        big = np.full(nbytes + 2 * GUARD, SENTINEL, dtype=np.uint8)
        out = big[GUARD : GUARD + nbytes] if sized else None
        if credit == "parked":  # another sender, heard first, holds the whole budget
            mux.start_receive(PEER, 3, OTHER, 0.0, policy=ReliablePolicy(), nbytes=nbytes)
            first = _message(nbytes, chunk_bytes, 0, auth, message_id=OTHER)[0]
            (mux.datagram_received if path is None else path.take)(first, PEER, 0.0)
            mux.poll(0.0)
        rx = mux.start_receive(PEER, 3, 7, 0.0, policy=policy_factory(), out=out,
                               critical=critical)
        side.append((mux, path, big, rx))
    return side


def _feed(side, datagrams: list[bytes], poll_every: int) -> list[list[bytes]]:
    """Feed both cores the same datagrams; return what each sent, poll by poll."""
    sent: list[list[bytes]] = [[], []]
    for k, d in enumerate(datagrams):
        t = 0.001 * (k + 1)
        for j, (mux, path, _, _) in enumerate(side):
            if path is None:
                mux.datagram_received(d, PEER, t)
            else:
                path.take(d, PEER, t)
            if k % poll_every == poll_every - 1:
                sent[j].extend(b"".join(bytes(p) for p in parts) for parts, _ in mux.poll(t))
    for j, (mux, _, _, _) in enumerate(side):
        deadline = mux.next_deadline()
        if deadline is not None:
            mux.timer_fired(deadline)
        sent[j].extend(b"".join(bytes(p) for p in parts) for parts, _ in mux.poll(99.0))
    return sent


def _same(side, sent) -> None:
    (m0, _, big0, rx0), (m1, _, big1, rx1) = side
    assert sent[0] == sent[1]
    assert m0.counters() == m1.counters()
    assert (rx0.result is None) == (rx1.result is None)
    assert rx0.first_heard == rx1.first_heard  # (a policy's clock and its outcome's time)
    assert (rx0.probes, rx0.retransmit_rounds) == (rx1.probes, rx1.retransmit_rounds)
    if rx0.result is not None:
        r0, r1 = rx0.result, rx1.result
        assert r0.close_reason == r1.close_reason and r0.stats == r1.stats
        assert np.array_equal(r0.delivered, r1.delivered)
        got = r0.delivered_bytes_mask()  # (a receive posted without a size: np.empty)
        assert np.array_equal(r0.data[got], r1.data[got])
    assert np.array_equal(rx0.delivered_mask(), rx1.delivered_mask())
    assert np.array_equal(big0, big1)
    assert (big1[:GUARD] == SENTINEL).all() and (big1[-GUARD:] == SENTINEL).all()


def _reorder(datagrams: list[bytes], op: str, arg: int) -> bool:
    """What the network does to a stream: ``drop``, ``dup`` or ``swap`` datagrams (True
    if ``op`` was one of them)."""
    i = arg % len(datagrams)
    if op == "drop":
        del datagrams[i]
    elif op == "dup":
        datagrams.insert(arg % (len(datagrams) + 1), datagrams[i])
    elif op == "swap":
        j = (arg * 7919) % len(datagrams)
        datagrams[i], datagrams[j] = datagrams[j], datagrams[i]
    else:
        return False
    return True


POLICIES = {
    "reliable": ReliablePolicy,
    "mlt": lambda: FixedBoundPolicy(0.1),
    "ltp": lambda: EarlyClosePolicy(),
}


def _final_probe(count: int, nbytes: int, chunk_bytes: int, seq: int = 9,
                 final: bool = True, message_id: int = 7) -> bytes:
    """The sender's FINAL PROBE for the tests' message (``final=False``: a PROBE sent
    while its window is shut)."""
    h = wire.Header(Kind.PROBE, SESSION, 3, message_id, 1, count, nbytes, chunk_bytes)
    return wire.control_datagram(h, Kind.PROBE, seq, flags=Flag.FINAL if final else Flag.NONE)


@settings(PROPERTY, max_examples=400)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    nbytes=st.integers(0, 3000),
    chunk_bytes=st.sampled_from([1, 7, 64, 250]),
    seed=st.integers(0, 2**16),
    ops=st.lists(st.tuples(st.sampled_from(["drop", "dup", "swap", "mutate", "foreign",
                                            "other", "probe", "probe", "probe_later",
                                            "probe_open", "unpark", "carry"]),
                           st.integers(0, 10_000)), max_size=40),
    sized=st.booleans(),
    with_critical=st.booleans(),
    poll_every=st.integers(1, 40),
    credit=st.sampled_from([None, None, "share", "parked"]),
)
def test_native_matches_python_datagram_for_datagram(policy, nbytes, chunk_bytes, seed, ops,
                                                     sized, with_critical, poll_every,
                                                     credit) -> None:
    """Both cores take and refuse the same datagrams and send the same answers - under
    credit, the same grants in ACKs as often, the receive parked or not."""
    datagrams = _message(nbytes, chunk_bytes, seed)
    count = wire.chunk_count(nbytes, chunk_bytes)
    rng = np.random.default_rng(seed)
    critical = (rng.random(count) < 0.2) if with_critical and sized else None
    for op, arg in ops:
        i = arg % len(datagrams)
        if _reorder(datagrams, op, arg):
            pass
        elif op == "mutate":
            datagrams[i] = _mutate(rng, datagrams[i])
        elif op == "foreign":  # the right datagram, another job's session
            b = bytearray(datagrams[i])
            if len(b) >= HEADER_BYTES:
                b[wire.OFFSET["session"]] ^= 1
            datagrams.insert(i, bytes(b))
        elif op == "other":  # another message, nobody posted a receive for it
            b = bytearray(datagrams[i])
            if len(b) >= HEADER_BYTES:
                b[wire.OFFSET["message"]] ^= 1
            datagrams.insert(i, bytes(b))
        elif op == "probe":  # a FINAL PROBE, early
            datagrams.insert(i, _final_probe(count, nbytes, chunk_bytes))
        elif op == "unpark":  # the other message's first pass is over: its credit is free
            datagrams.insert(i, _final_probe(count, nbytes, chunk_bytes, message_id=OTHER))
        elif op == "carry":  # a DATA that carries the first PROBE, anywhere in the pass
            datagrams.insert(i, _carrying(datagrams[i]))
        else:  # a later pass's FINAL PROBE, or one sent with the window shut
            datagrams.insert(i, _final_probe(count, nbytes, chunk_bytes, seq=10 + arg % 5,
                                             final=op == "probe_later"))
        if not datagrams:
            break
    side = _twin(POLICIES[policy], nbytes, chunk_bytes, critical, sized, credit=credit)
    sent = _feed(side, datagrams, poll_every)
    _same(side, sent)


def _sealed_probe(count: int, nbytes: int, chunk_bytes: int) -> bytes:
    parts = (_final_probe(count, nbytes, chunk_bytes),)
    return b"".join(DatagramAuth(KEY, PEER).seal(parts, LOCAL))


@needs_openssl
@settings(PROPERTY, max_examples=300)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    nbytes=st.integers(0, 3000),
    chunk_bytes=st.sampled_from([1, 7, 64, 250]),
    seed=st.integers(0, 2**16),
    ops=st.lists(st.tuples(st.sampled_from(["drop", "dup", "swap", "mutate", "tag", "payload",
                                            "unsealed", "elsewhere", "probe"]),
                           st.integers(0, 10_000)), max_size=40),
    sized=st.booleans(),
    poll_every=st.integers(1, 40),
    credit=st.sampled_from([None, "share", "parked"]),
)
def test_native_matches_python_authenticated(policy, nbytes, chunk_bytes, seed, ops, sized,
                                             poll_every, credit) -> None:
    """Authenticated, both cores take and refuse the same datagrams - forged ones (a
    flipped tag or payload byte, no tag, a mutated header, sealed for another receiver)
    among them - and send the same sealed ACKs (under credit, with the same grants),
    STOPs and BITMAPs."""
    datagrams = _message(nbytes, chunk_bytes, seed, auth=True)
    count = wire.chunk_count(nbytes, chunk_bytes)
    rng = np.random.default_rng(seed)
    for op, arg in ops:
        i = arg % len(datagrams)
        b = bytearray(datagrams[i])
        if _reorder(datagrams, op, arg):
            pass
        elif op == "mutate":  # (a header changed under its tag)
            datagrams.insert(i, _mutate(rng, datagrams[i]))
        elif op == "tag" and b:  # (a mutation may have cut a datagram to nothing)
            b[-1 - arg % min(len(b), TRAILER_BYTES)] ^= 1 << (arg % 8)  # (nonce or tag)
            datagrams.insert(i, bytes(b))
        elif op == "payload" and len(b) > HEADER_BYTES + TRAILER_BYTES:
            b[HEADER_BYTES + arg % (len(b) - HEADER_BYTES - TRAILER_BYTES)] ^= 0x80
            datagrams.insert(i, bytes(b))
        elif op == "unsealed":  # a forger without the key: a valid header, no tag
            datagrams.insert(i, bytes(b[:-TRAILER_BYTES]))
        elif op == "elsewhere":  # sealed by the same sender, for another receiver
            body = (bytes(b[:-TRAILER_BYTES]),)
            datagrams.insert(i, b"".join(DatagramAuth(KEY, PEER).seal(body, ("10.9.9.9", 1))))
        elif op == "probe":
            datagrams.insert(i, _sealed_probe(count, nbytes, chunk_bytes))
        if not datagrams:
            break
    side = _twin(POLICIES[policy], nbytes, chunk_bytes, None, sized, auth=True, credit=credit)
    sent = _feed(side, datagrams, poll_every)
    _same(side, _opened(sent))


def _opened(sent: list[list[bytes]]) -> list[list[bytes]]:
    """What each core sent (to PEER, sealed), each datagram checked and without its
    trailer: the cores seal with nonces of their own, so only that much is alike."""
    opener = DatagramAuth(KEY, PEER)
    bodies = [[opener.open(d, LOCAL) for d in side] for side in sent]
    assert all(b is not None for side in bodies for b in side)
    return [[bytes(b) for b in side] for side in bodies]  # type: ignore[arg-type]


@needs_openssl
def test_the_compiled_tag_is_the_python_tag() -> None:
    rng = np.random.default_rng(11)
    disp = native.module().Dispatcher(SESSION)
    disp.authenticate(KEY, *native.ipv4_address(LOCAL), bytes(12))
    for n in [0, 1, 47, 48, 64, 1400, 9000, 65000]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        src, dst = ("10.0.0.1", int(rng.integers(1 << 16))), ("192.168.7.9", 65535)
        trailer = DatagramAuth(KEY, src).seal((data,), dst)[-1]
        nonce, tag = trailer[:12], trailer[12:]
        assert disp.tag(data, nonce, *native.ipv4_address(src), *native.ipv4_address(dst)) == tag
    with pytest.raises(ValueError):
        disp.authenticate(KEY, 1, 2, bytes(12))  # once
    with pytest.raises(ValueError):
        native.module().Dispatcher(SESSION).authenticate(b"short", 1, 2, bytes(12))
    with pytest.raises(ValueError):
        native.module().Dispatcher(SESSION).authenticate(KEY, 1, 2, bytes(11))


@needs_openssl
@settings(PROPERTY, max_examples=500)
@given(key=st.binary(min_size=32, max_size=32), nonce=st.binary(min_size=12, max_size=12),
       size=st.integers(0, 9100), seed=st.integers(0, 2**16))
def test_thecompiled_gmac_tags_as_openssl_through_ctypes(key, nonce, size, seed) -> None:
    """The compiled Gmac the Python core uses where the extension is built gives
    the ctypes reference's tag for any key, nonce and data up to a jumbo datagram (the
    reference here: the module's tests run with ctypes_gmac)."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    reference = auth.Gmac(key)
    assert not reference.compiled  # (ctypes: the fixture holds)
    compiled = native.module().Gmac(key)
    assert compiled.tag(nonce, data) == reference.tag(nonce, data)
    assert compiled.tag(nonce, memoryview(data)) == reference.tag(nonce, data)


@needs_openssl
def test_thecompiled_gmac_refuses_what_is_not_a_key_or_nonce() -> None:
    gmac = native.module().Gmac
    for key in (b"", bytes(31), bytes(33)):
        with pytest.raises(ValueError, match="32 bytes"):
            gmac(key)
    g = gmac(bytes(32))
    for nonce in (b"", bytes(11), bytes(13)):
        with pytest.raises(ValueError, match="12 bytes"):
            g.tag(nonce, b"x")
    with pytest.raises(RuntimeError, match="not given a key"):
        gmac.__new__(gmac).tag(bytes(12), b"")
    with pytest.raises(TypeError):
        g.tag(bytes(12), "text")
    # a key given again replaces the first: its tags are the new key's
    g.__init__(bytes(range(32)))
    assert g.tag(bytes(12), b"") == auth.Gmac(bytes(range(32))).tag(bytes(12), b"")


def test_the_python_core_tags_through_thecompiled_gmac_where_built() -> None:
    """Outside this module's reference fixture, Gmac takes the compiled one - unless the
    compiled code is off (BOUNDEDLOSS_NATIVE=0), where it is ctypes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(auth, "compiled_gmac", _COMPILED_GMAC)
        assert auth.Gmac(bytes(32)).compiled is native.authenticates()
        mp.setenv("BOUNDEDLOSS_NATIVE", "0")
        assert not auth.Gmac(bytes(32)).compiled


@needs_openssl
def test_the_compiled_path_seals_the_cores_control_datagrams_as_the_core_would() -> None:
    """With the compiled path attached, the core's control datagrams (PROBE, STOP,
    BITMAP) are sealed there, by the sealer of the path's ACKs: each opens under the
    Python reference's DatagramAuth at the peer, and one changed in flight does not."""
    peer = ("10.1.2.5", 6000)
    mux = TransferMux(SESSION, TransportConfig(chunk_bytes=1400),
                      auth=DatagramAuth(KEY, LOCAL))
    path = native.NativeDataPath(mux)
    at_peer = DatagramAuth(KEY, peer)
    probe = wire.control_datagram(wire.Header(Kind.PROBE, SESSION, 1, 2, 0, 3, 3000, 1400),
                                  Kind.PROBE, 1)
    counters = []
    for parts in [(probe,), (probe[:20], probe[20:]), (probe + bytes(8),)]:
        sealed = path.seal(parts, peer)
        assert sealed[:-1] == parts and len(sealed[-1]) == TRAILER_BYTES
        data = b"".join(sealed)
        assert at_peer.open(data, LOCAL) == b"".join(parts)
        assert at_peer.open(data[:-1] + bytes([data[-1] ^ 1]), LOCAL) is None
        assert at_peer.open(data, ("10.1.2.6", 5000)) is None  # (the tag covers the source)
        counters.append(int.from_bytes(sealed[-1][4:12], "big"))
    # the mux's own PROBE: sealed by the same sealer (its nonces go on counting)
    mux.start_send(peer, 1, 2, np.zeros(3000, np.uint8), 0.0)
    out = mux.poll(0.0, runs=True)
    control = [item for item in out if isinstance(item, tuple)]
    assert len(control) == 1 and at_peer.open(b"".join(control[0][0]), LOCAL) is not None
    counters.append(int.from_bytes(control[0][0][-1][4:12], "big"))
    assert counters == list(range(counters[0], counters[0] + 4))


@settings(PROPERTY, max_examples=150)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    chunks=st.integers(1, 400),
    chunk_bytes=st.sampled_from([16, 250, 1400]),
    seed=st.integers(0, 2**16),
    runs=st.lists(st.integers(1, 64), min_size=1, max_size=30),
    loss=st.sampled_from([0.0, 0.05, 0.3]),
    mangle=st.integers(0, 3),
    auth=st.booleans() if native.authenticates() else st.just(False),
)
def test_native_matches_python_on_gro_runs_of_every_length(policy, chunks, chunk_bytes, seed,
                                                           runs, loss, mangle, auth) -> None:
    """Batches as a socket hands them over - GRO runs of 1 to 64 equal-sized datagrams
    (the last may be shorter), a loss model deciding per datagram, authenticated or
    not - against the Python core fed the same datagrams one by one."""
    nbytes = chunks * chunk_bytes - (seed % chunk_bytes)
    datagrams = _message(nbytes, chunk_bytes, seed, auth=auth)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(datagrams)).tolist() + rng.integers(
        len(datagrams), size=len(datagrams) // 4).tolist()  # reordered, some twice
    stream = [datagrams[i] for i in order]
    for _ in range(mangle):  # a few malformed ones among them
        k = int(rng.integers(len(stream)))
        stream[k] = _mutate(rng, stream[k])
    messages, pos = [], 0
    for k in runs * (1 + len(stream) // max(1, sum(runs))):
        if pos >= len(stream):
            break
        size = len(stream[pos])
        run = [stream[pos]]
        pos += 1
        while pos < len(stream) and len(run) < k and len(stream[pos]) <= size \
                and (size + 1) * (len(run) + 1) <= 65536:
            run.append(stream[pos])
            pos += 1
            if len(run[-1]) < size:
                break  # a short datagram closes a run
        messages.append((b"".join(run), size) if len(run) > 1 else run[0])
    side = _twin(POLICIES[policy], nbytes, chunk_bytes, None, True, auth=auth)
    (ref, _, _, _), (mux, path, _, _) = side
    ref_loss = Bernoulli(loss, seed=seed) if loss else None
    nat_loss = Bernoulli(loss, seed=seed) if loss else None
    for lo in range(0, len(messages), 64):
        batch = messages[lo : lo + 64]
        t = 0.001 * (lo + 1)
        for m in batch:
            data, size = (m if isinstance(m, tuple) else (m, len(m)))
            for off in range(0, max(len(data), 1), max(size, 1)):
                d = data[off : off + size]
                if ref_loss is not None and ref_loss.drop(t, -1):
                    ref.drops[DropReason.INJECTED_LOSS] += 1
                    continue
                ref.datagram_received(d, PEER, t)
        path.take_batch(batch, PEER, t, nat_loss)
    sent = [[b"".join(bytes(p) for p in parts) for parts, _ in m.poll(99.0)] for m in (ref, mux)]
    _same(side, _opened(sent) if auth else sent)


def test_closed_receives_are_remembered_and_forgotten_alike() -> None:
    """The compiled path answers for the closed receives the mux remembers - a PROBE with
    the STOP at once, DATA with it at most once per min_rto, both counted stale - and
    not for those it has forgotten (the oldest past closed_memory, or one posted again),
    exactly as the Python core does."""
    cfg = TransportConfig(chunk_bytes=64, closed_memory=2, min_rto=0.002)
    messages = {}
    for msg in range(1, 5):
        sender = TransferMux(SESSION, cfg)
        sender.start_send(PEER, 3, msg, source_bytes(64 * 4, msg), 0.0)
        messages[msg] = [b"".join(bytes(p) for p in parts) for parts, _ in sender.poll(0.0)]
    side = []
    for use_native in (False, True):
        mux = TransferMux(SESSION, cfg)
        path = native.NativeDataPath(mux) if use_native else None
        side.append((mux, path))

    def feed(d: bytes, t: float) -> list[list[bytes]]:
        sent = []
        for mux, path in side:
            if path is None:
                mux.datagram_received(d, PEER, t)
            else:
                path.take(d, PEER, t)
            sent.append([b"".join(bytes(p) for p in parts) for parts, _ in mux.poll(t)])
        assert sent[0] == sent[1]
        assert side[0][0].counters() == side[1][0].counters()
        return sent[0]

    t = 0.0
    for msg, datagrams in messages.items():  # each closes complete; 3 and 4 remembered
        for mux, _ in side:
            mux.start_receive(PEER, 3, msg, t, policy=ReliablePolicy(), nbytes=64 * 4)
        for d in datagrams:
            t += 0.001
            feed(d, t)
    for msg, datagrams in messages.items():  # late DATA and PROBEs, each close in turn
        for d in [datagrams[0], datagrams[1], datagrams[-1], datagrams[2]]:
            t += 0.0015
            answered = feed(d, t)
            # (the first late DATA gets the STOP, the next not within min_rto; a PROBE
            # gets it at once)
            assert bool(answered) == (msg >= 3 and (d is datagrams[0] or d is datagrams[-1]))
    counters = side[1][0].counters()
    # (each first pass's own PROBE came after its close: 4 more stale)
    assert counters["stale"] == 4 + 8 and counters["unknown_message"] == 8
    # posted again: the new receive takes its DATA (and is remembered when it closes)
    for mux, _ in side:
        mux.start_receive(PEER, 3, 4, t, policy=ReliablePolicy(), nbytes=64 * 4)
    for d in messages[4]:
        t += 0.001
        feed(d, t)
    results = [mux.pop_finished() for mux, _ in side]
    assert [r.stats for r in results[0]] == [r.stats for r in results[1]]
    assert results[1][-1].complete


@pytest.mark.parametrize("carried", [False, True])
def test_native_answers_later_probes_as_python_would(carried: bool) -> None:
    """With chunks missing, the first FINAL PROBE goes to the core (the receive's state
    changes) - whole, or carried by the last DATA, which the compiled path takes,
    handing the core the PROBE alone; a later pass's FINAL PROBE, and one sent with the
    window shut, are answered by the compiled path - the same BITMAPs, counters and
    result."""
    datagrams = _message(100 * 64, 64, 5)
    data, probes = (_carried(datagrams), []) if carried else (datagrams[:-1], datagrams[-1:])
    kept = [d for k, d in enumerate(data) if k % 7]  # (every 7th chunk lost, not the last)
    later = [_final_probe(100, 100 * 64, 64, seq=10), _final_probe(100, 100 * 64, 64,
                                                                   seq=11, final=False)]
    side = _twin(ReliablePolicy, 100 * 64, 64, None, True)
    sent = _feed(side, [*kept, *probes, *later, *later], 1)
    _same(side, sent)
    mux, path = side[1][0], side[1][1]
    handed = len(kept) + len(probes) + 4 - path.counters()["datagrams_in"]
    # (the first FINAL PROBE: whole, or as an event after the DATA that carried it)
    assert (handed, mux.decisions_in) == ((0, 1) if carried else (1, 0))
    bitmaps = [d for d in sent[1] if d[wire.OFFSET["kind"]] == Kind.BITMAP]
    assert len(bitmaps) == 5 and side[1][3].retransmit_rounds == 5  # (seq 9, 10, 11, 10, 11)


class _AcceptsAfter(ReliablePolicy):
    """Every chunk, or what has arrived 10 ms after the receive opened."""

    def plan(self, info):
        return ClosePlan(min_delivered=info.chunk_count, bound=0.0, accept_after=0.01)


def test_native_answers_probes_while_accepting_as_python_would() -> None:
    """A receive past its acceptance deadline that still waits for critical chunks
    (ACCEPTING) answers a later FINAL PROBE, and a window-shut one, from the compiled
    path with the core's BITMAPs; the first FINAL one is the core's."""
    datagrams = _message(100 * 64, 64, 6)
    data = datagrams[:-1]
    kept = [d for k, d in enumerate(data) if k % 5]  # (every 5th lost, chunk 0 among them)
    critical = np.zeros(100, dtype=bool)
    critical[0] = True
    side = _twin(_AcceptsAfter, 100 * 64, 64, critical, True)
    sent = _feed(side, kept, 1)
    for mux, _, _, _ in side:  # (the acceptance deadline passes: ACCEPTING, chunk 0 missing)
        mux.timer_fired(0.5)
    assert [rx.state.name for *_, rx in side] == ["ACCEPTING", "ACCEPTING"]
    probes = [_final_probe(100, 100 * 64, 64, seq=9), _final_probe(100, 100 * 64, 64, seq=10),
              _final_probe(100, 100 * 64, 64, seq=11, final=False)]
    before = side[1][1].counters()["datagrams_in"]
    later = _feed(side, probes, 1)
    _same(side, [a + b for a, b in zip(sent, later)])
    assert side[1][1].counters()["datagrams_in"] - before == 2  # (all but the first FINAL)
    assert side[1][3].probes == 3  # (and _feed's last timer closed it at its deadline)
    assert sum(d[wire.OFFSET["kind"]] == Kind.BITMAP for d in later[1]) == 3


@pytest.mark.parametrize("carried", [False, True])
def test_native_takes_the_data_python_would_have(carried: bool) -> None:
    """The point of it: a receive's DATA never reaches the Python core - the one that
    meets the plan is taken too, and the core told to close the receive - nor does the
    PROBE that comes after the close (its STOP is said again by the compiled path), or
    one the closing DATA carried (the close's STOP answers it)."""
    datagrams = _message(100 * 64, 64, 3)
    if carried:
        datagrams = _carried(datagrams)
    side = _twin(ReliablePolicy, 100 * 64, 64, None, True)
    sent = _feed(side, datagrams, 10)
    mux, path = side[1][0], side[1][1]
    assert side[1][3].result.complete
    taken = path.counters()["datagrams_in"]
    assert taken == len(datagrams) == 100 + (not carried) and mux.datagrams_in == 0
    assert mux.decisions_in == 1  # (the close)
    assert mux.counters()["datagrams_in"] == len(datagrams)
    assert mux.counters().get("stale", 0) == (not carried)
    stops = [d[wire.OFFSET["kind"]] for d in sent[1]].count(Kind.STOP)
    assert stops == 1 + (not carried)  # (the close's, and the PROBE's answer)


@pytest.mark.parametrize("reason", ["COMPLETE", "BOUND_MET", "ACCEPT_DEADLINE"])
def test_a_routine_receive_closes_in_the_compiled_path_as_the_core_would(reason: str) -> None:
    """A receive whose close decides nothing (no credit, a policy that does not learn) is
    closed by the compiled path itself when a DATA meets its plan - for each reason a
    DATA can meet it for - with the STOP, result and counters the Python core's close
    has, and remembered alike (its STOP said again to a later PROBE)."""
    data = _message(100 * 64, 64, 11)[:-1]  # (the sender's PROBE left out)
    if reason == "COMPLETE":
        side = _twin(ReliablePolicy, 100 * 64, 64, None, True)
        sent = _feed(side, data, 7)
    elif reason == "BOUND_MET":  # 85 of 100, the FINAL PROBE, then the 90th meets it
        side = _twin(lambda: FixedBoundPolicy(0.1), 100 * 64, 64, None, True)
        sent = _feed(side, [*data[:85], _final_probe(100, 100 * 64, 64), *data[85:95]], 3)
    else:  # past the acceptance deadline, the critical chunk 0 still missing; then it comes
        critical = np.zeros(100, dtype=bool)
        critical[0] = True
        side = _twin(_AcceptsAfter, 100 * 64, 64, critical, True)
        sent = _feed(side, data[1:60], 5)
        for mux, _, _, _ in side:
            mux.timer_fired(0.5)
        later = _feed(side, [data[0]], 1)
        sent = [a + b for a, b in zip(sent, later)]
    late = _feed(side, [_final_probe(100, 100 * 64, 64, seq=30)], 1)  # (answered: STOP)
    _same(side, [a + b for a, b in zip(sent, late)])
    (_, _, _, python_rx), (mux, _, _, rx) = side
    assert rx.result.close_reason == python_rx.result.close_reason == getattr(
        wire.CloseReason, reason)
    assert rx.counts.closes_here and rx.counts.closed  # (closed there, not by the core)
    assert mux.decisions_in == 1  # (the close, recorded)
    assert [d[wire.OFFSET["kind"]] for d in late[1]] == [Kind.STOP]
    assert rx.stop == python_rx.stop


def test_a_receive_closed_there_is_recorded_before_the_batch_goes_on() -> None:
    """Within one batch (one recvmmsg's), a receive the compiled path closes is recorded
    by the core - and with it the oldest closed receive forgotten (``closed_memory``) -
    before the next datagram is taken: a PROBE for the forgotten one then finds nothing,
    as on the Python path, instead of its STOP said again."""
    cfg = TransportConfig(chunk_bytes=64, closed_memory=1, receive_deadline=5.0)
    first, second = _message(640, 64, 1, message_id=7), _message(640, 64, 2, message_id=8)
    late = _final_probe(10, 640, 64, seq=20, message_id=7)
    said, counted = [], []
    for use_native in (False, True):
        mux = TransferMux(SESSION, cfg)
        path = native.NativeDataPath(mux) if use_native else None
        for message_id in (7, 8):
            mux.start_receive(PEER, 3, message_id, 0.0, policy=ReliablePolicy(), nbytes=640)
        for d in first[:-1]:  # (message 7 closes, and is remembered)
            mux.datagram_received(d, PEER, 0.001) if path is None else path.take(d, PEER, 0.001)
        mux.poll(0.001)
        batch = [*second[:-1], late]  # (message 8 closes: 7 is forgotten; then its PROBE)
        if path is None:
            for d in batch:
                mux.datagram_received(d, PEER, 0.002)
        else:
            path.take_batch(batch, PEER, 0.002)
        said.append([b"".join(parts) for parts, _ in mux.poll(0.002)])
        counted.append(mux.counters())
    assert said[0] == said[1] and counted[0] == counted[1]
    assert [d[wire.OFFSET["message"]] for d in said[1]] == [8]  # (8's STOP; none for 7)
    assert counted[1]["unknown_message"] == 1


def test_only_routine_receives_close_in_the_compiled_path() -> None:
    """Closing decides something - the credit passed on, a policy that learns told the
    outcome - or nothing remembers the closed receive: the core closes it, as before."""
    def opened(policy, **config) -> bool:
        mux = TransferMux(SESSION, TransportConfig(chunk_bytes=64, **config))
        native.NativeDataPath(mux)
        rx = mux.start_receive(PEER, 3, 7, 0.0, policy=policy, nbytes=640)
        return bool(rx.counts.closes_here)

    assert opened(ReliablePolicy()) and opened(FixedBoundPolicy(0.1))
    assert not opened(EarlyClosePolicy())  # (it learns from each outcome)
    assert not opened(ReliablePolicy(), credit_bytes=64 * 1024)
    assert not opened(ReliablePolicy(), closed_memory=0)


# ------------------------------------------------------------------------ fuzz
def _fuzzed_send(rng: np.random.Generator, ip: int, port: int, count: int, nbytes: int,
                 chunk_bytes: int, auth: bool = False):
    """A send of the fuzzed message's geometry (round 3, message 7) registered for its
    ACKs - checking the loss they imply or not - and a few ACKs for it, of every tseq and
    delivered count (``auth``: sealed from PEER to LOCAL)."""
    sent = native.module().Send()
    sent.bind(ip, port, 3, 7, count, nbytes, chunk_bytes)
    sent.next_tseq = int(rng.integers(0, 2 * count + 1))
    sent.ack_every, sent.loss_limit = int(rng.integers(1, 9)), 0.01
    sent.check_loss = bool(rng.integers(2))
    head = wire.Header(Kind.ACK, SESSION, 3, 7, 0, count, nbytes, chunk_bytes)
    acks = [wire.control_datagram(head, Kind.ACK, 0,
                                  wire.STOP_PAYLOAD.pack(int(rng.integers(1 << 32))),
                                  tseq=int(rng.integers(1 << 32)))
            for _ in range(4)]
    if auth:
        acks = [b"".join(DatagramAuth(KEY, PEER).seal((a,), LOCAL)) for a in acks]
    return sent, acks


def _check_fuzzed_send(sent, acks_fed: int) -> None:
    """The window never moved past what was sent; no more ACKs counted than came."""
    assert 0 <= sent.acked <= max(sent.next_tseq, 0)
    assert sent.acks_heard <= acks_fed


def _fuzz_rows(rng: np.random.Generator, valid: list[bytes], n: int, stride: int):
    """``n`` datagrams as rows of ``stride`` bytes and their lengths: valid ones of the
    message, and mutated ones - bytes flipped, a header field set at random, cut short,
    run long, or random bytes of random length."""
    base = np.zeros((len(valid), stride), dtype=np.uint8)
    for j, d in enumerate(valid):
        base[j, : min(len(d), stride)] = np.frombuffer(d[:stride], dtype=np.uint8)
    base_len = np.array([min(len(d), stride) for d in valid], dtype=np.int64)
    pick = rng.integers(len(valid), size=n)
    rows = base[pick]
    lengths = base_len[pick]
    how = rng.integers(8, size=n)
    flip = np.flatnonzero(how == 1)
    for _ in range(3):
        rows[flip, rng.integers(HEADER_BYTES, size=flip.size)] = rng.integers(
            256, size=flip.size, dtype=np.uint8)
    field = np.flatnonzero(how == 2)
    names = list(wire.OFFSET)
    which = rng.integers(len(names), size=field.size)
    for k, name in enumerate(names):
        r = field[which == k]
        off, size = wire.OFFSET[name], wire.FIELD_BYTES[name]
        rows[r, off : off + size] = rng.integers(256, size=(r.size, size), dtype=np.uint8)
    cut = np.flatnonzero(how == 3)
    lengths[cut] = rng.integers(0, lengths[cut] + 1)
    longer = np.flatnonzero(how == 4)
    lengths[longer] = np.minimum(stride, lengths[longer] + rng.integers(1, 17, longer.size))
    noise = np.flatnonzero(how == 5)
    rows[noise] = rng.integers(256, size=(noise.size, stride), dtype=np.uint8)
    lengths[noise] = rng.integers(0, stride + 1, noise.size)
    return rows, lengths.astype(np.uint32)


def test_fuzz_a_million_datagrams_never_write_outside_the_destination() -> None:
    rng = np.random.default_rng(2026)
    disp = native.module().Dispatcher(SESSION)
    ip, port = native.ipv4_address(PEER)
    total = acks_taken = closed_here = 0
    sub = 5_000
    while total < 1_000_000:
        chunk_bytes = int(rng.choice([1, 3, 64, 512, 1400]))
        nbytes = int(rng.integers(0, 40 * chunk_bytes + 1))
        count = wire.chunk_count(nbytes, chunk_bytes)
        big = np.full(nbytes + 2 * GUARD, SENTINEL, dtype=np.uint8)
        delivered = bytearray(count)
        crit = rng.random(count) < 0.3
        shared = native.module().Receive()
        shared.heard = True
        shared.need = count + 1  # never met: the fuzz stays inside the data path
        ack = wire.control_datagram(wire.Header(Kind.ACK, SESSION, 3, 7, 0, count, nbytes,
                                                chunk_bytes), Kind.ACK, 0, bytes(4))
        shared.bind(PEER, ip, port, 3, 7, count, nbytes, chunk_bytes, 4,
                    big[GUARD : GUARD + nbytes], delivered,
                    bytearray(crit.astype(np.uint8).tobytes()), ack)
        closes = rng.random() < 0.5  # (met, it closes here: what comes later is stale)
        if closes:
            shared.need = int(rng.integers(0, count + 1))
            shared.early_stop, shared.accepting = bool(rng.integers(2)), bool(rng.integers(2))
            shared.close_here(0.001)
        disp.register(shared)
        sent, acks = _fuzzed_send(rng, ip, port, count, nbytes, chunk_bytes)
        disp.register_send(sent)
        valid = _message(nbytes, chunk_bytes, int(rng.integers(1 << 30))) + acks
        stride = HEADER_BYTES + chunk_bytes + 16
        rows, lengths = _fuzz_rows(rng, valid, 50_000, stride)
        out: list = []
        for lo in range(0, len(lengths), sub):
            delivered[:] = bytes(count)  # so that every sub-batch copies again
            shared.delivered_count, shared.critical_missing = 0, int(crit.sum())
            part, plen = rows[lo : lo + sub], lengths[lo : lo + sub]
            i = 0
            while i < len(plen):  # a handed-back datagram is the Python core's: skip it
                i = disp.take_rows(part, stride, plen, ip, port, out, i) + 1
            assert shared.delivered_count <= count
            assert shared.critical_missing >= 0
        if closes and shared.closed:  # its STOP, as the core's close builds it
            (key, reason, stop), = [(e[:3], e[3], e[4]) for e in disp.closed()]
            assert key == (PEER, 3, 7) and reason in (1, 2, 3)
            kind, flags, _, _, rnd, msg, index, *_, tseq = wire.parse(stop)
            assert (kind, flags, rnd, msg, index, tseq) == (Kind.STOP, 0, 3, 7, reason, 0)
            assert wire.STOP_PAYLOAD.unpack(stop[HEADER_BYTES:])[0] <= count
            assert all(o[0][0] == stop for o in out if o[0][0][wire.OFFSET["kind"]] == Kind.STOP)
            closed_here += 1
        disp.unregister(shared)
        disp.unregister_send(sent)
        _check_fuzzed_send(sent, int((rows[:, wire.OFFSET['kind']] == Kind.ACK).sum()))
        acks_taken += sent.acks_heard
        assert (big[:GUARD] == SENTINEL).all() and (big[-GUARD:] == SENTINEL).all()
        total += len(lengths)
    counts = disp.counters()
    assert counts["taken"] > 500_000 and counts["bad_geometry"] > 0 and counts["short"] > 0
    assert acks_taken > 1000  # (the ACKs of a registered send, taken here)
    assert closed_here >= 3  # (and receives closed here, their late datagrams stale)


@needs_openssl
def test_fuzz_a_million_sealed_datagrams_write_only_what_verifies() -> None:
    """Authenticated: a million sealed datagrams of a message, most of them mutated (a
    header byte, a field, the length, noise) - only the untouched ones are taken; the
    rest are counted and write nothing, and nothing lands outside the destination."""
    rng = np.random.default_rng(2027)
    disp = native.module().Dispatcher(SESSION)
    disp.authenticate(KEY, *native.ipv4_address(LOCAL), bytes(12))
    ip, port = native.ipv4_address(PEER)
    total = delivered_total = acks_taken = closed_here = 0
    while total < 1_000_000:
        chunk_bytes = int(rng.choice([1, 64, 512, 1400]))
        nbytes = int(rng.integers(1, 40 * chunk_bytes + 1))
        count = wire.chunk_count(nbytes, chunk_bytes)
        big = np.full(nbytes + 2 * GUARD, SENTINEL, dtype=np.uint8)
        delivered = bytearray(count)
        shared = native.module().Receive()
        shared.heard = True
        shared.need = count + 1
        ack = wire.control_datagram(wire.Header(Kind.ACK, SESSION, 3, 7, 0, count, nbytes,
                                                chunk_bytes), Kind.ACK, 0, bytes(4))
        shared.bind(PEER, ip, port, 3, 7, count, nbytes, chunk_bytes, 4,
                    big[GUARD : GUARD + nbytes], delivered, None, ack)
        if rng.random() < 0.5:  # (met, it closes here: its STOP goes out sealed)
            shared.need = int(rng.integers(0, count + 1))
            shared.close_here(0.001)
        disp.register(shared)
        sent, acks = _fuzzed_send(rng, ip, port, count, nbytes, chunk_bytes, auth=True)
        disp.register_send(sent)
        seed = int(rng.integers(1 << 30))
        valid = _message(nbytes, chunk_bytes, seed, auth=True) + acks
        stride = HEADER_BYTES + chunk_bytes + TRAILER_BYTES + 16
        rows, lengths = _fuzz_rows(rng, valid, 100_000, stride)
        out: list = []
        i = 0
        while i < len(lengths):
            i = disp.take_rows(rows, stride, lengths, ip, port, out, i) + 1
        disp.unregister(shared)
        disp.unregister_send(sent)
        _check_fuzzed_send(sent, int((rows[:, wire.OFFSET['kind']] == Kind.ACK).sum()))
        acks_taken += sent.acks_heard
        # only datagrams that verify are written: every chunk holds the message's own
        # bytes or was never touched
        assert (big[:GUARD] == SENTINEL).all() and (big[-GUARD:] == SENTINEL).all()
        dest, source = big[GUARD : GUARD + nbytes], np.asarray(source_bytes(nbytes, seed))
        got = np.repeat(np.frombuffer(bytes(delivered), np.uint8), chunk_bytes)[:nbytes] == 1
        assert np.array_equal(dest[got], source.view(np.uint8)[got])
        assert (dest[~got] == SENTINEL).all()
        for item in out:
            if len(item) == 3:  # sealed here (and marked so): its ACKs, a close's STOP
                assert item[2] is True
                assert DatagramAuth(KEY, item[1]).open(b"".join(item[0]), LOCAL) is not None
            else:  # a STOP said again once closed here: the core seals what it polls
                assert shared.closed and item[0][0][wire.OFFSET["kind"]] == Kind.STOP
        closed_here += shared.closed
        delivered_total += shared.delivered_count
        total += len(lengths)
    counts = disp.counters()
    # (of the mutated ones, those whose session field changed count as another job's)
    assert counts["bad_auth"] + counts["foreign_session"] > 400_000 and counts["short"] > 0
    assert "bad_geometry" not in counts and "bad_magic" not in counts  # (the tag goes first)
    assert delivered_total > 0 and acks_taken > 100 and closed_here >= 1


# --------------------------------------------------------------------- Hadamard
@pytest.mark.parametrize("block", [1, 4, 16, 64, 1 << 10, 1 << 16])
def test_hadamard_gives_the_same_bits_compiled_and_in_numpy(block, monkeypatch) -> None:
    """Same operations in the same order: every dtype, tails of every length, and a
    destination that is not 16-byte aligned."""
    rng = np.random.default_rng(block)
    had = HadamardDispersion(block=block)
    for n in (0, 1, 3, 17, 1000, 3 * block + 5, (1 << 17) + 12345):
        for dtype in (np.float16, np.float32, np.float64, np.int32):
            x = (rng.standard_normal(n) * 10).astype(dtype)
            got = {}
            for flag in ("0", "1"):
                monkeypatch.setenv("BOUNDEDLOSS_NATIVE", flag)
                y = had.encode(x, 7)
                got[flag] = (y.tobytes(), had.decode(y, 7, n).tobytes())
            assert got["0"] == got["1"], (n, dtype)
    monkeypatch.setenv("BOUNDEDLOSS_NATIVE", "1")
    raw = np.random.default_rng(1).standard_normal(4 * block + 1).astype(np.float32)
    unaligned = raw[1:]  # 4 bytes past numpy's alignment
    expected = unaligned.copy()
    monkeypatch.setenv("BOUNDEDLOSS_NATIVE", "0")
    expected = had.transform(expected, expected.size).copy()
    monkeypatch.setenv("BOUNDEDLOSS_NATIVE", "1")
    assert had.transform(unaligned, unaligned.size).tobytes() == expected.tobytes()


def test_bad_arguments_are_errors_not_crashes() -> None:
    """Sizes whose products overflow, or a chunk size no datagram can have, are refused
    with ValueError before any pointer arithmetic (each of these once crashed)."""
    ext = native.module()
    with pytest.raises(ValueError):
        ext.fwht(bytearray(64), 1 << 62, 4)
    disp = ext.Dispatcher(SESSION)
    with pytest.raises(ValueError):
        disp.take_rows(bytes(128), (1 << 62) + 64, np.array([48, 48], np.uint32).tobytes(),
                       1, 2, [], 0)
    with pytest.raises(ValueError):
        disp.take_rows(bytes(128), 64, b"\0\0\0", 1, 2, [], 0)  # lengths not uint32s
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        with pytest.raises(ValueError):
            disp.send_run(s, 0x7F000001, 9, bytes(48), bytes(10), np.zeros(1, np.int64), 0,
                          1 << 31, 10, True, 0)
        with pytest.raises(ValueError):  # (flags are 16 bits)
            disp.send_run(s, 0x7F000001, 9, bytes(48), bytes(10), np.zeros(1, np.int64), 0,
                          10, 10, True, 1 << 16)


def test_a_send_set_up_oddly_never_crashes_the_data_path() -> None:
    """A Send made without __init__, or told to read the loss at ack_every 0, takes an
    ACK without crashing (the latter hands it to the core, which owns that decision)."""
    ext = native.module()
    disp = ext.Dispatcher(SESSION)
    ip, port = native.ipv4_address(PEER)
    bare = ext.Send.__new__(ext.Send)
    bare.bind(ip, port, 3, 7, 1, 10, 10)
    odd = ext.Send()
    odd.bind(ip, port, 3, 8, 1, 10, 10)
    odd.ack_every, odd.check_loss = 0, True
    taken = []
    for sent, msg in ((bare, 7), (odd, 8)):
        disp.register_send(sent)
        ack = wire.control_datagram(wire.Header(Kind.ACK, SESSION, 3, msg, 0, 1, 10, 10),
                                    Kind.ACK, 0, wire.STOP_PAYLOAD.pack(1), tseq=0)
        taken.append(disp.take(ack, ip, port, [], 1.0))
    assert taken == [True, False] and bare.blocked_since is None and bare.acks_heard == 1


def test_a_polls_control_datagrams_go_out_as_they_are_a_sendmmsg_at_a_time() -> None:
    """send_datagrams sends a poll's datagrams - one piece or several gathered, to several
    peers - byte for byte and in order, up to the first it does not send (a DataRun,
    a peer that is not IPv4), and refuses bad items with an error, not a crash."""
    from boundedloss.protocol.types import DataRun

    disp = native.module().Dispatcher(SESSION)
    rng = np.random.default_rng(4)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as a, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as b:
        for s in (a, b):
            s.bind(("127.0.0.1", 0))
            s.settimeout(5)
        peers = [a.getsockname(), b.getsockname()]
        datagrams = [rng.integers(0, 256, int(rng.integers(1, 300)), np.uint8).tobytes()
                     for _ in range(150)]
        batch: list = [((d,) if k % 3 else (d[:7], memoryview(d)[7:]), peers[k % 2])
                       for k, d in enumerate(datagrams)]
        run = DataRun(peers[0], b"", b"", 1, np.zeros(0, np.int64))
        batch[100:100] = [run]
        end, err, calls = disp.send_datagrams(tx, batch, 0)
        assert (end, err, calls) == (100, 0, 2)  # (64 and 36: sendmmsg's limit)
        end, err, calls = disp.send_datagrams(tx, batch, 101)
        assert (end, err, calls) == (151, 0, 1)
        for k, d in enumerate(datagrams):
            got, src = (a, b)[k % 2].recvfrom(4096)
            assert got == d and src[1] == tx.getsockname()[1]
        assert disp.send_datagrams(tx, [((b"x",), ("::1", 5))], 0) == (0, 0, 0)
        with pytest.raises(TypeError):
            disp.send_datagrams(tx, [((12,), peers[0])], 0)  # a part that is no buffer
        with pytest.raises(ValueError):
            disp.send_datagrams(tx, batch, len(batch) + 1)
        with pytest.raises(TypeError):
            disp.send_datagrams(tx, tuple(batch), 0)


@needs_openssl
def test_control_datagrams_sealed_as_they_go_verify_as_the_cores_seal_would() -> None:
    """send_datagrams with ``seal`` (a ``poll(sealed=False)``'s batch) seals each datagram
    of one or two pieces as it sends it - what arrives verifies under the Python
    reference's DatagramAuth, from the sender's address, byte for byte the core's
    datagram - and sends one marked sealed already (an ACK the path built) as it is."""
    disp = native.module().Dispatcher(SESSION)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
        for s in (tx, rx):
            s.bind(("127.0.0.1", 0))
        rx.settimeout(5)
        src, dst = tx.getsockname(), rx.getsockname()
        disp.authenticate(KEY, *native.ipv4_address(src), bytes(12))
        with pytest.raises(ValueError):  # (no key: nothing to seal with)
            native.module().Dispatcher(SESSION).send_datagrams(tx, [], 0, True)
        bodies = [bytes(range(k, k + 40)) for k in range(3)]
        sealed = b"".join(DatagramAuth(KEY, src).seal((bodies[2],), dst))
        batch = [((bodies[0],), dst), ((bodies[1][:9], memoryview(bodies[1])[9:]), dst),
                 ((sealed,), dst, True)]
        assert disp.send_datagrams(tx, batch, 0, True) == (3, 0, 1)
        opener = DatagramAuth(KEY, dst)
        for body in bodies:
            got, _ = rx.recvfrom(4096)
            assert len(got) == len(body) + TRAILER_BYTES
            assert bytes(opener.open(got, src)) == body
        # three pieces are more than it seals: Python's to send
        assert disp.send_datagrams(tx, [((b"a", b"b", b"c"), dst)], 0, True) == (0, 0, 0)


@pytest.mark.parametrize("authenticated", [False, pytest.param(True, marks=needs_openssl)])
def test_the_message_cost_tool_carries_each_message_through_its_four_phases(authenticated):
    """tools/message_cost.py: every round's message completes (it raises if not), with
    the compiled path taking what it takes on a rank, and each phase is timed."""
    tool = load_tool("message_cost")
    us = tool.measure(3 * 1400 + 8, 20, authenticated)
    assert set(us) == set(tool.PHASES) and all(v > 0 for v in us.values())
    held = tool.held(4096, 50, authenticated)
    # (what an open message holds: a simulated job holds millions; 3.3 KB a receive and
    # 3.0 a send before their slots - 1.9 and 2.8 at 06d7598)
    assert held["receive_buffer_bytes"] == 4096
    assert 500 < held["receive_bytes"] < 2500 and 500 < held["send_bytes"] < 3300
