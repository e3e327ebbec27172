"""The compiled data path (boundedloss._native), built from source by ``pip install``.

It is optional: where it cannot build (no compiler, no Python headers, not Linux) the
install goes on and boundedloss runs its pure-Python path, saying so
(``boundedloss.native.STATUS``). ``BOUNDEDLOSS_NATIVE_CFLAGS`` adds compiler flags,
e.g. the AddressSanitizer build in docs/native.md.
"""

import os
import shlex

from setuptools import Extension, setup

extra = shlex.split(os.environ.get("BOUNDEDLOSS_NATIVE_CFLAGS", ""))
setup(
    ext_modules=[
        Extension(
            "boundedloss._native",
            ["src/boundedloss/_native.c"],
            # -ffp-contract=off: no fused multiply-adds, so the transform rounds exactly as
            # numpy's does
            extra_compile_args=["-O3", "-ffp-contract=off", "-std=c11", "-Wall", *extra],
            extra_link_args=[a for a in extra if a.startswith("-fsanitize")],
            optional=True,
        )
    ]
)
