"""Small sort-based helpers on int id arrays (``np.unique`` costs ~1 ms a call here)."""

from __future__ import annotations

import numpy as np


def has_repeats(ids: np.ndarray) -> bool:
    """Whether some value occurs twice in ``ids``."""
    if len(ids) < 2:
        return False
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


def distinct_counts(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``ids`` (ascending) and how often each occurs (int32)."""
    s = np.sort(ids)
    starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1])))
    counts = np.diff(np.append(starts, len(s))).astype(np.int32)
    return s[starts], counts


def last_occurrences(ids: np.ndarray) -> np.ndarray:
    """``ids`` without repeats, each value kept where it occurs last, in the original order."""
    if len(ids) < 2:
        return ids
    order = np.argsort(ids, kind="stable")
    s = ids[order]
    last = np.ones(len(ids), dtype=bool)
    last[:-1] = s[:-1] != s[1:]
    return ids[np.sort(order[last])]


def decrement(counts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``counts[i] -= 1`` for every entry of ``ids`` (repeats allowed); return the ids that
    reached 0, without repeats, in the order of their last occurrence in ``ids``."""
    order = np.argsort(ids, kind="stable")
    s = ids[order]
    last = np.ones(len(ids), dtype=bool)
    last[:-1] = s[:-1] != s[1:]
    ends = np.flatnonzero(last)
    distinct = s[ends]
    repeats = np.diff(ends, prepend=-1)
    counts[distinct] -= repeats.astype(counts.dtype)
    zero = counts[distinct] == 0
    return ids[np.sort(order[ends[zero]])]
