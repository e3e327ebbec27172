"""The compiled data path (boundedloss._native), built from source by ``pip install``.

It is optional: where it cannot build (no compiler, no Python headers, not Linux) the
install goes on and boundedloss runs its pure-Python path, saying so
(``boundedloss.native.STATUS``). ``BOUNDEDLOSS_NATIVE_CFLAGS`` adds compiler flags,
e.g. the AddressSanitizer build in docs/native.md.

Authenticated datagrams on the compiled path use the system's OpenSSL (libcrypto, which
Python's own hashlib links): where its headers are missing it builds without, and an
authenticated endpoint then takes the Python path and says so.
``BOUNDEDLOSS_NATIVE_OPENSSL=0`` builds without it on purpose.
"""

import copy
import os
import shlex
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

extra = shlex.split(os.environ.get("BOUNDEDLOSS_NATIVE_CFLAGS", ""))
OPENSSL = os.environ.get("BOUNDEDLOSS_NATIVE_OPENSSL", "1").strip().lower() not in (
    "0", "no", "off", "false")


class BuildWithOpenSSL(build_ext):
    """Build the data path with OpenSSL's libcrypto where it compiles and links, and
    without it where not."""

    def build_extension(self, ext):
        if OPENSSL and ext.name == "boundedloss._native":
            with_ssl = copy.deepcopy(ext)
            with_ssl.define_macros = [*ext.define_macros, ("BL_OPENSSL", "1")]
            with_ssl.libraries = [*ext.libraries, "crypto"]
            try:
                return super().build_extension(with_ssl)
            except Exception as e:  # noqa: BLE001 - any compiler or linker failure
                print(f"boundedloss: building the data path without OpenSSL ({e}); "
                      "authenticated datagrams will take the Python path")
        return super().build_extension(ext)


setup(
    cmdclass={"build_ext": BuildWithOpenSSL},
    ext_modules=[
        Extension(
            "boundedloss._native",
            # one concern per file; native.h holds what they share
            sorted(str(p) for p in Path("src/native").glob("*.c")),
            depends=sorted(str(p) for p in Path("src/native").glob("*.h")),
            # -ffp-contract=off: no fused multiply-adds, so the transform rounds exactly as
            # numpy's does
            extra_compile_args=["-O3", "-ffp-contract=off", "-std=c11", "-Wall", *extra],
            extra_link_args=[a for a in extra if a.startswith("-fsanitize")],
            optional=True,
        )
    ],
)
