"""Small helpers on int id arrays: sort-based, or sort-free with a scratch array (``np.unique``
costs ~1 ms a call here)."""

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


class LastSeen:
    """Scratch for :meth:`last_occurrences` of ids below ``size``: no sort, a few array passes.

    ``stamp[id]`` holds the largest stamp given to ``id`` so far. Stamps only grow, so a call
    never clears it; they are views of one preallocated ``arange`` (no allocation per call),
    and when they run out the scratch starts over (one fill of ``stamp``, at most once per
    ``size`` ids stamped).
    """

    def __init__(self, size: int) -> None:
        self.stamp = np.zeros(size, dtype=np.int32)  # on cpu, int32 [size]
        self._iota = np.arange(max(size, 4096) + 1, dtype=np.int32)  # on cpu, the stamps
        self._next = 1

    def stamps(self, n: int) -> np.ndarray:
        """``n`` fresh stamps, each larger than every stamp given before (int32 ``[n]``)."""
        start = self._next
        if start + n > len(self._iota):
            if n + 1 > len(self._iota):
                self._iota = np.arange(2 * n + 2, dtype=np.int32)
            self.stamp.fill(0)
            start = 1
        self._next = start + n
        return self._iota[start : start + n]

    def last_occurrences(self, ids: np.ndarray) -> np.ndarray:
        """:func:`last_occurrences` of ``ids`` (each ``< size``)."""
        if len(ids) < 2:
            return ids
        stamps = self.stamps(len(ids))
        np.maximum.at(self.stamp, ids, stamps)
        return ids.compress(self.stamp.take(ids) == stamps)
