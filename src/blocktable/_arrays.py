"""Small numpy helpers for ragged (row-after-row) arrays."""

from __future__ import annotations

import numpy as np


def ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(n)`` for each ``n`` in ``lengths`` (int64)."""
    total = int(lengths.sum())
    if _all_ones(lengths, total):  # the common decode step
        return np.zeros(total, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


def ragged_indices(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + n)`` for each pair; int64."""
    if _all_ones(lengths, int(lengths.sum())):
        return starts.astype(np.int64, copy=True)
    return np.repeat(starts.astype(np.int64, copy=False), lengths) + ragged_arange(lengths)


def _all_ones(lengths: np.ndarray, total: int) -> bool:
    """True when every length is 1 (or there are none): a sum of n counts >= 1 equal to n."""
    return total == len(lengths) and (total == 0 or int(lengths.min()) == 1)
