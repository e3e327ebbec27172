"""Rates and sizes in tc(8)'s notation, parsed to numbers so a config can be checked
before the kernel sees it (tc's own errors are terse, and some bad values - a burst
smaller than one packet - are accepted and then drop every full-size frame)."""

from __future__ import annotations

import re

_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

# tc(8): "bit or a bare number" is bits per second; "bps" is BYTES per second.
_RATE_UNITS = {
    "": 1, "bit": 1,
    "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 1024, "mibit": 1024**2, "gibit": 1024**3, "tibit": 1024**4,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 1024, "mibps": 8 * 1024**2, "gibps": 8 * 1024**3, "tibps": 8 * 1024**4,
}

# tc(8): "b or a bare number" is bytes; k/kb/m/mb/g/gb are binary multiples of bytes;
# kbit/mbit/gbit are binary multiples of bits.
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3,
    "kbit": 1024 / 8, "mbit": 1024**2 / 8, "gbit": 1024**3 / 8,
}


def parse_rate(text: str | int | float) -> int:
    """Bits per second from ``"100mbit"``, ``"1gbit"``, ``"12.5mbps"`` (bytes/s), a number."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _NUM.match(str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _RATE_UNITS:
            raise ValueError(f"bad rate {text!r}: use e.g. 100mbit, 1gbit, 500kbit")
        value = float(m.group(1)) * _RATE_UNITS[unit]
    if not value > 0:
        raise ValueError(f"bad rate {text!r}: must be > 0")
    return int(round(value))


def parse_size(text: str | int | float) -> int:
    """Bytes from ``"32kb"`` (32768), ``"1500b"``, ``"1m"``, a number."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _NUM.match(str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ValueError(f"bad size {text!r}: use e.g. 32kb, 64k, 1500b")
        value = float(m.group(1)) * _SIZE_UNITS[unit]
    if not value > 0:
        raise ValueError(f"bad size {text!r}: must be > 0")
    return int(round(value))


def format_rate(bits_per_s: float) -> str:
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= mult:
            return f"{bits_per_s / mult:g}{unit}"
    return f"{bits_per_s:g}bit"
