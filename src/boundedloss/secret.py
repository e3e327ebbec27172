"""Where a rank's secret for authenticated datagrams comes from: the environment
(``BOUNDEDLOSS_SECRET``, or a file ``BOUNDEDLOSS_SECRET_FILE`` names). Apart from
``boundedloss.torch`` so that a command can check it before it starts any rank without
importing torch; ``boundedloss.torch.rendezvous`` derives the job's key from it."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .protocol.auth import AuthenticationError

#: where a rank's secret comes from: the secret itself, or a file that holds it
SECRET_ENV = "BOUNDEDLOSS_SECRET"
SECRET_FILE_ENV = "BOUNDEDLOSS_SECRET_FILE"
#: a secret file longer than this is not a secret file (``/dev/zero``, a disk image)
SECRET_FILE_MAX_BYTES = 1 << 16


def read_secret_file(path: str, what: str = SECRET_FILE_ENV) -> bytes:
    """The secret in the file at ``path``: its bytes, less a trailing newline. A
    one-line AuthenticationError naming ``what`` and the path if it cannot be read or
    holds nothing."""
    if not path:
        raise AuthenticationError(f"{what} is empty: name the file that holds the secret")
    try:
        with open(path, "rb") as f:
            data = f.read(SECRET_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise AuthenticationError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if len(data) > SECRET_FILE_MAX_BYTES:
        raise AuthenticationError(f"{what}: {path} is larger than {SECRET_FILE_MAX_BYTES:,} "
                                  "bytes: not a secret file")
    data = data.removesuffix(b"\n").removesuffix(b"\r")
    if not data:
        raise AuthenticationError(f"{what}: {path} is empty")
    return data


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret this rank was given - ``BOUNDEDLOSS_SECRET`` (as UTF-8) or the file
    ``BOUNDEDLOSS_SECRET_FILE`` names (:func:`read_secret_file`) - or None if neither
    is set. ``environ``: where to look (default ``os.environ``). A one-line
    AuthenticationError if both are set, or the secret is empty or unreadable."""
    env = os.environ if environ is None else environ
    value, path = env.get(SECRET_ENV), env.get(SECRET_FILE_ENV)
    if value is not None and path is not None:
        raise AuthenticationError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set one")
    if path is not None:
        return read_secret_file(path)
    if value is None:
        return None
    if not value:  # (an unset shell variable expanded: not a choice to run without one)
        raise AuthenticationError(f"{SECRET_ENV} is set but empty: give the secret, or unset it")
    return value.encode("utf-8", "surrogateescape")
