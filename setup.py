"""The optional compiled helpers: the package's metadata lives in pyproject.toml.

``blocktable._native`` (one C file, the CPython API only) speeds up the per-step host loops.
It is optional: where no C compiler is found the install goes on without it and the package
uses its numpy twins, with the same results.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "blocktable._native",
            sources=["src/blocktable/_native.c"],
            optional=True,  # no compiler: install without it (numpy stands in)
        )
    ]
)
