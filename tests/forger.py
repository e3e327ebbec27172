"""An attacker on the same host as a job (root: CAP_NET_RAW), for tests only.

It sniffs the loopback interface for the job's datagrams and, for every DATA datagram
it sees, forges DATA of the same message - the right session, round, message, geometry
and source address, a payload of NaNs - for the chunks after it (which have likely not
arrived yet) and for the next round, and sends them with the real sender's address
(a raw IP socket writes its own IP header). Without authentication the receiver takes
them as the sender's chunks; with it they fail their tag. It writes no valid tag: it
does not know the job's key, only what one datagram shows.
"""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np

from boundedloss import wire
from boundedloss.protocol.auth import TRAILER_BYTES

MAGIC = struct.pack("<H", wire.MAGIC)
ETH_P_ALL = 0x0003
HEADER_BYTES = wire.HEADER_BYTES
KIND_DATA = int(wire.Kind.DATA)
OFF_ROUND, OFF_INDEX, OFF_PLEN = (wire.OFFSET[f] for f in ("round", "index", "plen"))
OFF_CBYTES = wire.OFFSET["cbytes"]
NAN = struct.pack("<f", float("nan"))


def _ip_header(src: bytes, dst: bytes, length: int) -> bytes:
    # version/IHL, TOS, total length, id, flags/fragment, TTL, protocol UDP, checksum
    # (the kernel fills in the length and checksum for IP_HDRINCL), addresses
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + length, 0, 0x4000, 64, 17, 0, src, dst)


class Forger:
    """Start it, let the job run, stop it: ``sent`` forged datagrams, ``seen`` real ones."""

    def __init__(self, ahead: int = 8, every: int = 4):
        self.ahead = ahead  # chunks forged after each one seen
        self.every = every  # forge on every ``every``-th DATA datagram seen
        self.seen = 0
        self.sent = 0
        self._stop = threading.Event()
        self._sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self._sniff.bind(("lo", 0))
        self._sniff.settimeout(0.2)
        self._raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        self._raw.setsockopt(socket.IPPROTO_IP, socket.IP_HDRINCL, 1)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Forger:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._sniff.close()
        self._raw.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame, addr = self._sniff.recvfrom(70000)
            except TimeoutError:
                continue
            except OSError:
                return
            if addr[2] != socket.PACKET_HOST or len(frame) < 14 + 20 + 8 + HEADER_BYTES:
                continue
            ip = frame[14:]
            ihl = (ip[0] & 0x0F) * 4
            if ip[9] != 17:
                continue
            src, dst = ip[12:16], ip[16:20]
            sport, dport = struct.unpack_from("!HH", ip, ihl)
            body = ip[ihl + 8:]
            if body[:2] != MAGIC or body[3] != KIND_DATA:
                continue
            plen = struct.unpack_from("<H", body, OFF_PLEN)[0]
            payload = body[HEADER_BYTES:HEADER_BYTES + plen]
            if payload[:4] == NAN:
                continue  # (one of ours, looped back)
            self.seen += 1
            if self.seen % self.every:
                continue
            # an authenticated job's datagrams end in a trailer: forge its length
            # (a run sent with UDP_SEGMENT crosses loopback whole: the next datagram's
            # header follows the first one's end)
            end = HEADER_BYTES + plen
            t = TRAILER_BYTES
            trailer = t if len(body) == end + t or body[end + t:end + t + 2] == MAGIC else 0
            self._forge(bytearray(body[:HEADER_BYTES]), trailer, src, dst, sport, dport)

    def _forge(self, head: bytearray, trailer: int, src: bytes, dst: bytes, sport: int,
               dport: int) -> None:
        index, count = struct.unpack_from("<II", head, OFF_INDEX)
        cbytes = struct.unpack_from("<I", head, OFF_CBYTES)[0]
        nan = (NAN * (cbytes // 4 + 1))[:cbytes]
        rnd = struct.unpack_from("<I", head, OFF_ROUND)[0]
        for r, first in ((rnd, index + 1), (rnd + 1, 0)):
            struct.pack_into("<I", head, OFF_ROUND, r)
            for i in range(first, min(count - 1, first + self.ahead)):  # full chunks only
                struct.pack_into("<I", head, OFF_INDEX, i)
                struct.pack_into("<H", head, OFF_PLEN, cbytes)
                # random bytes where an authenticated datagram has its nonce and tag
                datagram = bytes(head) + nan + np.random.bytes(trailer)
                udp = struct.pack("!HHHH", sport, dport, 8 + len(datagram), 0)
                try:
                    self._raw.sendto(_ip_header(src, dst, 8 + len(datagram)) + udp + datagram,
                                     (socket.inet_ntoa(dst), 0))
                    self.sent += 1
                except OSError:
                    pass
