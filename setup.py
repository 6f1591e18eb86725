"""The compiled part of blocktable: the package's metadata lives in pyproject.toml.

``blocktable._compiled`` (one Cython file, typed memoryviews, no numpy headers, no CUDA
headers) runs the step's host loops and launches the captured step's CUDA graph through the
driver. Where a C compiler is found it is built, and a failed build fails
the install loudly; where none is found (or ``BLOCKTABLE_NO_COMPILE=1``) the package installs
without it and numpy does the same work with the same results. ``blocktable --version`` says
which one runs.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig

from setuptools import Extension, setup


def _have_c_compiler() -> bool:
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(compiler.split()[0]) is not None


def _extensions() -> list[Extension]:
    if os.environ.get("BLOCKTABLE_NO_COMPILE") == "1":
        print("blocktable: BLOCKTABLE_NO_COMPILE=1, installing without the compiled slot "
              "mapping (numpy does its work)", file=sys.stderr)
        return []
    if not _have_c_compiler():
        print("blocktable: no C compiler found, installing without the compiled slot mapping "
              "(numpy does its work; install gcc or clang and Python's headers to build it)",
              file=sys.stderr)
        return []
    from Cython.Build import cythonize

    macros, libraries = [], []
    if _have_openssl():
        # SHA-256 of a block by OpenSSL's one-shot call: no Python call per block
        macros.append(("BT_HAVE_OPENSSL", "1"))
        libraries.append("crypto")
    if sys.platform.startswith("linux"):
        libraries.append("dl")  # dlsym of the loaded CUDA driver (in libc from glibc 2.34)
    # -O2 (after Python's own -O3): the engine step's code runs once per step with cold
    # caches, where -O3's unrolled and vectorized copies of its short loops cost more cache
    # lines fetched than the instructions they save
    args = [] if sys.platform == "win32" else ["-O2"]
    return cythonize(
        [Extension("blocktable._compiled", ["src/blocktable/_compiled.pyx"],
                   define_macros=macros, libraries=libraries, extra_compile_args=args)],
        compiler_directives={"language_level": 3},
    )


def _have_openssl() -> bool:
    """Whether OpenSSL's headers are installed (``BLOCKTABLE_NO_OPENSSL=1``: don't look);
    without them SHA-256 block hashes call ``hashlib`` once per block."""
    if os.environ.get("BLOCKTABLE_NO_OPENSSL") == "1":
        return False
    dirs = [sysconfig.get_config_var("INCLUDEDIR") or "", "/usr/include", "/usr/local/include"]
    return any(os.path.exists(os.path.join(d, "openssl", "sha.h")) for d in dirs if d)


setup(ext_modules=_extensions())
