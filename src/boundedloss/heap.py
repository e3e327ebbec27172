"""Keeping the garbage collector's full collections off the data plane's path.

The endpoint's I/O thread runs the Python protocol core, so it needs the GIL. A full
(oldest-generation) collection holds the GIL while it walks every object the process
tracks - in a process that has imported torch and built a model, hundreds of thousands
of them: 72-87 ms on the kernel testbed's 4-rank allreduce of 4 MB (rounds of about
28 ms), where no datagram is taken or answered meanwhile and a peer's PROBE waits out
its timeout. (Gloo moves its bytes in threads of its own that hold no GIL.)

``freeze_heap`` moves everything alive now - the modules, the model, the optimizer -
into the permanent generation (``gc.freeze``), which no collection walks again. Those
objects are still freed by reference counting; only a reference cycle among them would
never be collected.
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Collect what is garbage now, then leave every object alive out of all later
    collections (call once the job is set up: imports, model, optimizer)."""
    gc.collect()
    gc.freeze()
