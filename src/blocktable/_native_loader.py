"""The compiled per-step helpers (``blocktable._native``), where the install built them.

The package builds one small C extension when a C compiler is at hand; without one it
installs without it and every caller uses its numpy twin (same results, the tests compare
them). ``BLOCKTABLE_NATIVE=0`` in the environment turns the extension off at import (to
measure or test the numpy path); :func:`native_module` is read when an object that uses it is
made, so a test may also swap :data:`NATIVE` for a while.
"""

from __future__ import annotations

import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("BLOCKTABLE_NATIVE", "1") == "0":
        return None
    try:
        from blocktable import _native
    except ImportError:  # not built here (no compiler at install): numpy stands in
        return None
    return _native


NATIVE: ModuleType | None = _load()


def native_module() -> ModuleType | None:
    """The compiled helpers, or ``None`` where numpy does the work."""
    return NATIVE
