"""How a test's spawned rank ends: as ``boundedloss train``'s ranks do (``os._exit``,
streams flushed), not through interpreter shutdown.

A Gloo process group that something still holds (FSDP2's device mesh, a hook state) is
alive while Python finalizes; its worker thread may then drop its last work, whose
tensors hold Python objects, and that decref cannot take the GIL: the thread is
unwound, and a C++ unwind through it aborts the rank ("terminate called without an
active exception") after every check passed."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn


def ends_with_os_exit(rank_main: Callable[..., Any]) -> Callable[..., NoReturn]:
    """``rank_main`` run to the end, then the process exits 0; 1 after its traceback."""

    @functools.wraps(rank_main)
    def run(*args: Any) -> NoReturn:
        code = 0
        try:
            rank_main(*args)
        except BaseException:  # noqa: BLE001 - the traceback is the test's output
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    return run
