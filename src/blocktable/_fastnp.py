"""numpy functions called without their dispatch layer, for the allocator's per-step checks.

``np.count_nonzero`` is a Python wrapper (``__array_function__`` dispatch, then the keyword
test) around a C function; on the short arrays the allocator tests every step, the wrapper
costs about three times the count. Only plain numpy arrays are passed here.
"""

from __future__ import annotations

try:
    from numpy._core.multiarray import count_nonzero
except ImportError:  # (numpy 1.x, whose private module is numpy.core: the wrapper)
    from numpy import count_nonzero

__all__ = ["count_nonzero"]
