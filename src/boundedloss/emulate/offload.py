"""Wire-size packets on the testbed's links, coalesced on arrival: a device's segmentation
offloads off and its GRO on.

A veth, like a NIC with TSO, passes a 64 KB TCP (or UDP_SEGMENT) super-packet to its
peer in one piece: a qdisc and a drop rule downstream then see one "packet" where a
wire would carry 45, and a random drop takes all 45 at once. With the device's
``tx-tcp-segmentation``, ``tx-tcp6-segmentation`` and ``tx-udp-segmentation`` features
off, the kernel's software GSO cuts every super-packet into MTU-sized packets just
before the device - the sender still pays one system call per super-packet, as with a
NIC, and everything after the link sees wire-size packets. With ``rx-gro`` on, the
device's receive path coalesces the packets that arrive (a veth does GRO only when it is
asked to), as a NIC's driver would, so a receiver pays per super-packet too: TCP, and
UDP for sockets that set UDP_GRO.

The features are set with the ethtool ioctl (``SIOCETHTOOL``: the feature names, then
ETHTOOL_SFEATURES), so no ethtool binary is needed. The ioctl acts on the namespace its
socket was made in: call these in the device's namespace (``netns.call_in``).
"""

from __future__ import annotations

import array
import fcntl
import socket
import struct

SIOCETHTOOL = 0x8946
ETHTOOL_GSTRINGS = 0x1B
ETHTOOL_GSSET_INFO = 0x37
ETHTOOL_GFEATURES = 0x3A
ETHTOOL_SFEATURES = 0x3B
ETH_SS_FEATURES = 4
ETH_GSTRING_LEN = 32

#: the offloads that let a super-packet cross a link whole
SEGMENTATION_FEATURES = ("tx-tcp-segmentation", "tx-tcp6-segmentation",
                         "tx-tcp-ecn-segmentation", "tx-tcp-mangleid-segmentation",
                         "tx-tcp-accecn-segmentation", "tx-udp-segmentation")
#: generic receive offload: coalescing on arrival
GRO = "rx-gro"


def _ioctl(ifname: str, buf: array.array) -> None:
    addr, _ = buf.buffer_info()
    ifreq = struct.pack("16sP", ifname.encode(), addr)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)


def feature_names(ifname: str) -> list[str]:
    """The device's feature names, in the kernel's bit order."""
    info = array.array("B", struct.pack("IIQI", ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_FEATURES, 0))
    _ioctl(ifname, info)
    count = struct.unpack_from("IIQI", info)[3]
    strings = array.array("B", struct.pack("III", ETHTOOL_GSTRINGS, ETH_SS_FEATURES, count)
                          + bytes(count * ETH_GSTRING_LEN))
    _ioctl(ifname, strings)
    raw = strings.tobytes()[12:]
    return [raw[i * ETH_GSTRING_LEN:(i + 1) * ETH_GSTRING_LEN].split(b"\0", 1)[0].decode()
            for i in range(count)]


def active_features(ifname: str) -> dict[str, bool]:
    names = feature_names(ifname)
    blocks = (len(names) + 31) // 32
    buf = array.array("B", struct.pack("II", ETHTOOL_GFEATURES, blocks) + bytes(16 * blocks))
    _ioctl(ifname, buf)
    words = struct.unpack_from(f"{4 * blocks}I", buf, 8)
    active = [words[4 * b + 2] for b in range(blocks)]
    return {n: bool(active[i // 32] >> (i % 32) & 1) for i, n in enumerate(names) if n}


def set_features(ifname: str, wanted: dict[str, bool]) -> dict[str, bool]:
    """Ask for each feature in ``wanted`` on or off (names the device lacks are
    skipped); returns the features as the device then has them."""
    names = feature_names(ifname)
    blocks = (len(names) + 31) // 32
    valid = [0] * blocks
    requested = [0] * blocks
    for i, name in enumerate(names):
        if name in wanted:
            valid[i // 32] |= 1 << (i % 32)
            if wanted[name]:
                requested[i // 32] |= 1 << (i % 32)
    body = b"".join(struct.pack("II", v, r) for v, r in zip(valid, requested))
    buf = array.array("B", struct.pack("II", ETHTOOL_SFEATURES, blocks) + body)
    try:
        _ioctl(ifname, buf)
    except OSError:
        pass  # (a positive return means "some changed differently": read them back)
    return active_features(ifname)


def as_on_a_wire(ifname: str, *, gro: bool) -> dict[str, bool]:
    """Turn ``ifname``'s segmentation offloads off (software GSO stays on) and its GRO
    on or off. A veth coalesces on its peer's receive only when the sending side has
    TSO off too, so both ends of a link need this."""
    return set_features(ifname, {**dict.fromkeys(SEGMENTATION_FEATURES, False), GRO: gro})
