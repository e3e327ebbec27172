"""Authenticated datagrams: a MAC on every datagram, keyed per job.

Every datagram of an authenticated endpoint ends in a 16-byte tag: HMAC-SHA256,
truncated to 128 bits (as RFC 4868 truncates it for IPsec), over

    source address | destination address | header | payload

where an address is ``identity(peer)``: for an IPv4 ``(host, port)`` the byte 4, the
four address bytes and the port (big-endian), as the compiled data path builds it.
Binding both addresses means a datagram captured on its way from A to B is worth
nothing sent from anywhere else or to anyone else, even with the same round and message
ids (in a parameter server every worker sends the same ids). Binding the header's
session, round and message means a datagram of an earlier round, of another job, or of
a message that has closed matches no open transfer: it is dropped as the core drops any
such datagram (``unknown_message``, ``stale``).

A datagram whose tag does not verify is counted (``bad_auth``, or ``foreign_session``
when its session is not ours: another job's datagram) and dropped before its header is
even parsed - nothing is written and no state changes. The comparison is constant-time
(``hmac.compare_digest``; the compiled path uses OpenSSL's ``CRYPTO_memcmp``).

The key: :func:`job_key` derives it with HKDF-SHA256 (RFC 5869) from a secret the user
gives every rank, or from a random one the job's rendezvous hands out, and the session.
Only the standard library's ``hmac``/``hashlib`` (OpenSSL underneath) and, in the
compiled path, OpenSSL's EVP_MAC compute anything here.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
from collections.abc import Hashable, Sequence

TAG_BYTES = 16
KEY_BYTES = 32
ALGORITHM = "hmac-sha256-128"
_DIGEST = "sha256"
#: what the key derivation and the rendezvous key check put into HMAC besides the key
_SALT = b"boundedloss datagram authentication v1"
_KEY_INFO = b"boundedloss job key"
_CHECK_INFO = b"boundedloss key check"


class AuthenticationError(RuntimeError):
    """One line: why the ranks of a job cannot authenticate each other's datagrams."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def identity(peer: Hashable) -> bytes:
    """The bytes an address contributes to a tag. IPv4 ``(host, port)``: 4, the address
    and the port big-endian (7 bytes, as the compiled path builds it); anything else (a
    FakeNetwork's peer names): 0, its repr's length and the repr."""
    if (isinstance(peer, tuple) and len(peer) == 2 and isinstance(peer[0], str)
            and isinstance(peer[1], int) and 0 <= peer[1] < 1 << 16):
        try:
            return b"\x04" + socket.inet_aton(peer[0]) + peer[1].to_bytes(2, "big")
        except OSError:
            pass
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


class DatagramAuth:
    """Seals and opens one endpoint's datagrams (``local``: its own address)."""

    tag_bytes = TAG_BYTES

    def __init__(self, key: bytes, local: Hashable):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a datagram key is {KEY_BYTES} bytes, not {len(key)}")
        self.key = bytes(key)
        self.local = local
        self._local = identity(local)
        self._peers: dict[Hashable, bytes] = {}

    def _peer(self, peer: Hashable) -> bytes:
        ident = self._peers.get(peer)
        if ident is None:
            if len(self._peers) > 4096:  # (forged source addresses cannot grow it without end)
                self._peers.clear()
            ident = self._peers[peer] = identity(peer)
        return ident

    def tag(self, parts: Sequence, source: bytes, destination: bytes) -> bytes:
        msg = b"".join((source, destination, *parts))
        return hmac.digest(self.key, msg, _DIGEST)[:TAG_BYTES]

    def seal(self, parts: tuple, peer: Hashable) -> tuple:
        """The datagram ``parts`` to ``peer`` with its tag as one more part."""
        return (*parts, self.tag(parts, self._local, self._peer(peer)))

    def open(self, data, peer: Hashable) -> memoryview | None:
        """``data`` from ``peer`` without its tag, or None if the tag does not verify
        (or the datagram is too short to hold one)."""
        view = memoryview(data)
        n = len(view) - TAG_BYTES
        if n < 0:
            return None
        body = view[:n]
        expected = self.tag((body,), self._peer(peer), self._local)
        if not hmac.compare_digest(expected, view[n:]):
            return None
        return body


def secret_digest(secret: bytes) -> str:
    """A short fingerprint of a secret for messages (never the secret itself)."""
    return hashlib.sha256(_SALT + secret).hexdigest()[:12]
