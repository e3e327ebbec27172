"""Whether the compiled extension (``boundedloss._native``) is built and in use.

``pip install`` builds it from source where it can (setup.py); where it cannot, and
wherever ``BOUNDEDLOSS_NATIVE=0``, boundedloss runs its pure-Python path - the
reference the compiled one is tested against - and ``status()`` says why.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from . import wire
from .protocol.auth import TRAILER_BYTES

#: the reasons the compiled path may close a receive for, itself (Receive.close_here)
_CLOSES_HERE = (wire.CloseReason.COMPLETE, wire.CloseReason.BOUND_MET,
                wire.CloseReason.ACCEPT_DEADLINE)


def _load() -> tuple[ModuleType | None, str]:
    try:
        _native = importlib.import_module("boundedloss._native")
    except ImportError as e:
        return None, f"the compiled extension is not built ({e})"
    if (dict(_native.LAYOUT) != wire.OFFSET or _native.HEADER_BYTES != wire.HEADER_BYTES
            or _native.TRAILER_BYTES != TRAILER_BYTES or _native.VERSION != wire.VERSION
            or getattr(_native, "FLAG_PROBE_CARRIED", None) != wire.Flag.PROBE_CARRIED
            or any(getattr(_native, f"CLOSE_{r.name}", None) != r.value
                   for r in _CLOSES_HERE)):
        return None, ("the compiled extension's header, version, trailer or close reasons "
                      "differ from wire's and auth's: rebuild it")
    return _native, "built"


_NATIVE, _WHY = _load()


def module() -> ModuleType:
    """The compiled extension itself (its Dispatcher, Receive, classify and fwht)."""
    if _NATIVE is None:
        raise RuntimeError(status())
    return _NATIVE


def enabled() -> bool:
    """Whether the compiled code is used (new endpoints' data path, the transform)."""
    return _NATIVE is not None and os.environ.get("BOUNDEDLOSS_NATIVE", "1").strip().lower() \
        not in ("0", "no", "off", "false")


def authenticates() -> bool:
    """Whether the compiled data path can verify and seal authenticated datagrams (it
    was built with OpenSSL's headers)."""
    return _NATIVE is not None and bool(getattr(_NATIVE, "AUTH", 0))


AUTH_FALLBACK = ("the compiled data path was built without OpenSSL's headers (libssl-dev), "
                 "so authenticated datagrams take the Python path")


def status() -> str:
    """One line: which path is used - ``native``, or ``python (why)``."""
    if _NATIVE is None:
        return f"python ({_WHY})"
    return "native" if enabled() else "python (BOUNDEDLOSS_NATIVE=0)"


