"""The compiled slot mapping (``blocktable._compiled``), where the install built it.

``BLOCKTABLE_COMPILED=0`` in the environment turns it off at import (to measure or test the
numpy path). Tables and steps read :data:`COMPILED` when they are made, so a test may also
swap it while it builds them.
"""

from __future__ import annotations

import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("BLOCKTABLE_COMPILED", "1") == "0":
        return None
    try:
        from blocktable import _compiled
    except ImportError:  # not built here (no C compiler at install): numpy does the work
        return None
    return _compiled


COMPILED: ModuleType | None = _load()


def describe() -> str:
    """Which slot mapping the CPU backend runs, for ``blocktable --version`` and reports."""
    if COMPILED is not None:
        return "compiled"
    if os.environ.get("BLOCKTABLE_COMPILED", "1") == "0":
        return "numpy, BLOCKTABLE_COMPILED=0"
    return "numpy, not built at install"
