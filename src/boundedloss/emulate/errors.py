"""The one error the testbed raises to its users."""

from __future__ import annotations


class TestbedError(RuntimeError):
    """A one-line, user-facing reason the testbed cannot do what was asked."""

    __test__ = False  # keep pytest from collecting it when a test module imports it

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line
