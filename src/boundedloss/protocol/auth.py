"""Authenticated datagrams: a MAC on every datagram, keyed per job.

Every datagram of an authenticated endpoint ends in a 24-byte trailer: a 12-byte nonce
and a 12-byte tag. The tag is AES-256-GMAC - AES-GCM with nothing to encrypt, the whole
datagram as associated data, as IPsec's authentication-only ESP uses it (RFC 4543) -
under the job's key and that nonce, over

    source address | destination address | header | payload

where an address is ``identity(peer)``: for an IPv4 ``(host, port)`` the byte 4, the
four address bytes and the port (big-endian), as the compiled data path builds it.
Binding both addresses means a datagram captured on its way from A to B is worth
nothing sent from anywhere else or to anyone else, even with the same round and message
ids (in a parameter server every worker sends the same ids). Binding the header's
session, round and message means a datagram of an earlier round, of another job, or of
a message that has closed matches no open transfer: it is dropped as the core drops any
such datagram (``unknown_message``, ``stale``).

GMAC must never see one nonce twice under one key. Each sealer (an endpoint's Python
core, its compiled data path) draws a random 4-byte prefix and a random 62-bit start
and counts up from there: its own nonces never repeat, and two sealers of a job repeat
one only if their prefixes are equal (2^-32 a pair) and their counted ranges overlap.
The tag is GCM's truncated to 96 bits (SP 800-38D allows it): with it a 1,400-byte chunk,
our header, the trailer and IPv4/UDP's fill a 1,500-byte packet exactly. Each job (each
session) has its own key. Why GMAC and not HMAC-SHA256: on this project's
machines SHA-256 costs 1.0 us per 1,400-byte datagram, more than the rest of the
compiled path's work on it, and GMAC 0.3 us (BENCHMARKS.md).

A datagram whose tag does not verify is counted (``bad_auth``, or ``foreign_session``
when its session is not ours: another job's datagram) and dropped before its header is
even parsed - nothing is written and no state changes. Tags are compared in constant
time (``hmac.compare_digest``; the compiled path uses OpenSSL's ``CRYPTO_memcmp``).

The key: :func:`job_key` derives it with HKDF-SHA256 (RFC 5869) from a secret the user
gives every rank, or from a random one the job's rendezvous hands out, and the session.
Nothing here is a hand-written primitive: HKDF and key checks use the standard
library's ``hmac``; GMAC is OpenSSL's (libcrypto, which Python's ``hashlib`` is built
on), called here through ``ctypes`` and in the compiled path from C.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hmac
import secrets
import socket
import struct
import threading
from collections.abc import Hashable, Sequence

NONCE_BYTES = 12
TAG_BYTES = 12  # (GCM tags truncated to 96 bits)
#: what an authenticated datagram carries after its payload: the nonce, then the tag
TRAILER_BYTES = NONCE_BYTES + TAG_BYTES
KEY_BYTES = 32
_DIGEST = "sha256"
#: what the key derivation and the rendezvous key check put into HMAC besides the key
_SALT = b"boundedloss datagram authentication v1"
_KEY_INFO = b"boundedloss job key"
_CHECK_INFO = b"boundedloss key check"
_EVP_CTRL_GCM_GET_TAG = 0x10


class AuthenticationError(RuntimeError):
    """One line: why the ranks of a job cannot authenticate each other's datagrams."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def ipv4_address(peer: Hashable) -> tuple[int, int] | None:
    """``(ip, port)`` as integers for an ``("a.b.c.d", port)`` peer, else None."""
    if not (isinstance(peer, tuple) and len(peer) == 2 and isinstance(peer[0], str)
            and isinstance(peer[1], int)):
        return None
    try:
        return struct.unpack("!I", socket.inet_aton(peer[0]))[0], peer[1]
    except OSError:
        return None


def identity(peer: Hashable) -> bytes:
    """The bytes an address contributes to a tag. IPv4 ``(host, port)``: 4, the address
    and the port big-endian (7 bytes, as the compiled path builds it); anything else (a
    FakeNetwork's peer names): 0, its repr's length and the repr."""
    address = ipv4_address(peer)
    if address is not None and 0 <= address[1] < 1 << 16:
        return b"\x04" + address[0].to_bytes(4, "big") + address[1].to_bytes(2, "big")
    text = repr(peer).encode()
    return b"\x00" + len(text).to_bytes(2, "big") + text


def hkdf_sha256(secret: bytes, info: bytes, *, salt: bytes = _SALT) -> bytes:
    """RFC 5869's HKDF with SHA-256, one 32-byte block: extract, then expand."""
    prk = hmac.digest(salt, secret, _DIGEST)
    return hmac.digest(prk, info + b"\x01", _DIGEST)


def job_key(secret: bytes, session: int) -> bytes:
    """The 32-byte key of the job with this ``session``, from ``secret``: each job
    (each session) gets its own, so nothing of one job verifies in another."""
    if not secret:
        raise AuthenticationError("the secret is empty")
    return hkdf_sha256(secret, _KEY_INFO + session.to_bytes(8, "little"))


def key_check(key: bytes) -> str:
    """What a rank publishes at rendezvous to show it holds the job's key without
    giving it away: HMAC of a fixed string under the key, hex."""
    return hmac.digest(key, _CHECK_INFO, _DIGEST).hex()


class NonceSequence:
    """A sealer's nonces: a random 4-byte prefix, then a big-endian 64-bit counter from
    a random start below 2^62 (so it never wraps)."""

    def __init__(self, seed: bytes | None = None):
        seed = secrets.token_bytes(NONCE_BYTES) if seed is None else seed
        if len(seed) != NONCE_BYTES:
            raise ValueError(f"a nonce seed is {NONCE_BYTES} bytes")
        self.prefix = seed[:4]
        self.counter = int.from_bytes(seed[4:], "big") >> 2

    def next(self) -> bytes:
        n = self.counter
        self.counter = n + 1
        return self.prefix + n.to_bytes(8, "big")


def _libcrypto() -> ctypes.CDLL:
    """OpenSSL's libcrypto - the one Python's hashlib loaded, where it can be found."""
    global _LIB, _LIB_PATH
    if _LIB is not None:
        return _LIB
    path = None
    try:
        import _hashlib  # noqa: F401 - loads the libcrypto Python was built with

        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps
                         if "libcrypto" in line.rsplit("/", 1)[-1]), None)
    except (ImportError, OSError):
        pass
    path = path or ctypes.util.find_library("crypto")
    if path is None:
        raise AuthenticationError("authenticated datagrams need OpenSSL's libcrypto (the "
                                  "library Python's hashlib uses); it was not found")
    lib = ctypes.CDLL(path)
    _LIB_PATH = path
    vp, cp, ip = ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)
    lib.EVP_CIPHER_CTX_new.restype = vp
    lib.EVP_CIPHER_CTX_new.argtypes = []
    lib.EVP_CIPHER_CTX_free.argtypes = [vp]
    lib.EVP_aes_256_gcm.restype = vp
    lib.EVP_aes_256_gcm.argtypes = []
    lib.EVP_EncryptInit_ex.argtypes = [vp, vp, vp, cp, cp]
    lib.EVP_EncryptUpdate.argtypes = [vp, vp, ip, cp, ctypes.c_int]
    lib.EVP_EncryptFinal_ex.argtypes = [vp, cp, ip]
    lib.EVP_CIPHER_CTX_ctrl.argtypes = [vp, ctypes.c_int, ctypes.c_int, vp]
    _LIB = lib
    return lib


_LIB: ctypes.CDLL | None = None
_LIB_PATH = ""  # the file _LIB was loaded from


def backend() -> str:
    """One line: the libcrypto that seals and opens datagrams here - its version and its
    file (``AuthenticationError`` where there is none)."""
    lib = _libcrypto()
    version = None
    for name in ("OpenSSL_version", "SSLeay_version"):  # (OpenSSL >= 1.1, and before)
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_int]
            version = fn(0)  # OPENSSL_VERSION: "OpenSSL 3.0.11 19 Sep 2023"
            break
    text = version.decode(errors="replace") if version else "an unknown libcrypto"
    return f"{text} ({_LIB_PATH})"


def compiled_gmac(key: bytes):
    """The compiled extension's Gmac under ``key`` (the same tags from OpenSSL's GCM,
    without ctypes' calls: 0.3 us a tag where ctypes takes several), or None where it is
    not built with OpenSSL or not in use (``BOUNDEDLOSS_NATIVE=0``: the reference path)."""
    from .. import native  # (not at import: boundedloss.native imports this module)

    if not (native.enabled() and native.authenticates()):
        return None
    return native.module().Gmac(key)


class Gmac:
    """AES-256-GMAC under one key (OpenSSL's AES-GCM with associated data only)."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a datagram key is {KEY_BYTES} bytes, not {len(key)}")
        compiled = compiled_gmac(bytes(key))
        #: the tags come from the compiled module (else from OpenSSL through ctypes)
        self.compiled = compiled is not None
        if compiled is not None:
            self.tag = compiled.tag  # type: ignore[method-assign]
            self._ctx = None
            return
        self._lib = lib = _libcrypto()
        self._ctx = lib.EVP_CIPHER_CTX_new()
        if not self._ctx or lib.EVP_EncryptInit_ex(self._ctx, lib.EVP_aes_256_gcm(), None,
                                                   bytes(key), None) != 1:
            raise AuthenticationError("OpenSSL's AES-256-GCM is not available")
        self._len = ctypes.c_int()
        self._end = ctypes.create_string_buffer(16)
        self._tag = ctypes.create_string_buffer(TAG_BYTES)
        self._lock = threading.Lock()  # (one OpenSSL context: one datagram at a time)

    def tag(self, nonce: bytes, data: bytes) -> bytes:
        lib, ctx, n = self._lib, self._ctx, ctypes.byref(self._len)
        with self._lock:
            if (lib.EVP_EncryptInit_ex(ctx, None, None, None, nonce) != 1
                    or lib.EVP_EncryptUpdate(ctx, None, n, data, len(data)) != 1
                    or lib.EVP_EncryptFinal_ex(ctx, self._end, n) != 1
                    or lib.EVP_CIPHER_CTX_ctrl(ctx, _EVP_CTRL_GCM_GET_TAG, TAG_BYTES,
                                               self._tag) != 1):
                raise AuthenticationError("OpenSSL's AES-256-GCM failed")
            return self._tag.raw

    def __del__(self) -> None:
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx:
            self._lib.EVP_CIPHER_CTX_free(ctx)


class DatagramAuth:
    """Seals and opens one endpoint's datagrams (``local``: its own address)."""

    trailer_bytes = TRAILER_BYTES

    def __init__(self, key: bytes, local: Hashable):
        self._gmac = Gmac(key)
        self.key = bytes(key)
        self.local = local
        self._local = identity(local)
        self._peers: dict[Hashable, bytes] = {}
        self.nonces = NonceSequence()

    def _peer(self, peer: Hashable) -> bytes:
        ident = self._peers.get(peer)
        if ident is None:
            if len(self._peers) > 4096:  # (forged source addresses cannot grow it without end)
                self._peers.clear()
            ident = self._peers[peer] = identity(peer)
        return ident

    def tag(self, nonce: bytes, parts: Sequence, source: bytes, destination: bytes) -> bytes:
        return self._gmac.tag(nonce, b"".join((source, destination, *parts)))

    def seal(self, parts: tuple, peer: Hashable) -> tuple:
        """The datagram ``parts`` to ``peer`` with its trailer (nonce, tag) as one more
        part."""
        nonce = self.nonces.next()
        return (*parts, nonce + self.tag(nonce, parts, self._local, self._peer(peer)))

    def open(self, data, peer: Hashable) -> memoryview | None:
        """``data`` from ``peer`` without its trailer, or None if the tag does not
        verify (or the datagram is too short to hold a trailer)."""
        view = memoryview(data)
        n = len(view) - TRAILER_BYTES
        if n < 0:
            return None
        body = view[:n]
        nonce = bytes(view[n : n + NONCE_BYTES])
        expected = self.tag(nonce, (body,), self._peer(peer), self._local)
        if not hmac.compare_digest(expected, view[n + NONCE_BYTES :]):
            return None
        return body
