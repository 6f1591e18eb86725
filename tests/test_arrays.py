"""Ragged-array helpers against a plain-Python reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from blocktable._arrays import ragged_arange, ragged_indices


@given(st.lists(st.tuples(st.integers(-50, 50), st.integers(0, 4)), max_size=12))
def test_ragged_indices_match_python(pairs):
    starts = np.array([s for s, _ in pairs], dtype=np.int64)
    lengths = np.array([n for _, n in pairs], dtype=np.int64)
    want = [s + i for s, n in pairs for i in range(n)]
    assert ragged_indices(starts, lengths).tolist() == want
    assert ragged_arange(lengths).tolist() == [i for _, n in pairs for i in range(n)]
