"""Small helpers on int id arrays."""

from __future__ import annotations

import numpy as np


def has_repeats(ids: np.ndarray) -> bool:
    """Whether some value occurs twice in ``ids``."""
    if len(ids) < 2:
        return False
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


def last_occurrences(ids: np.ndarray) -> np.ndarray:
    """``ids`` without repeats, each value kept where it occurs last, in the original order."""
    if len(ids) < 2:
        return ids
    order = np.argsort(ids, kind="stable")
    s = ids[order]
    last = np.ones(len(ids), dtype=bool)
    last[:-1] = s[:-1] != s[1:]
    return ids[np.sort(order[last])]
