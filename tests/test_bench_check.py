"""The attention benchmarks' correctness check: a NaN in a checked output is an error, never 0.

``Batch.check`` compares a few requests' last queries with float32 attention and keeps the
largest error; Python's ``max(0.0, nan)`` is ``0.0``, so a NaN row once read as a perfect match.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_attention import MAX_ABS_ERR, Batch, Shape

SHAPE = Shape(num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32)


def _attention(batch: Batch) -> torch.Tensor:
    """Causal attention of every query, in float64, one request at a time."""
    out = torch.zeros_like(batch.query)
    qsl = batch.query_start_loc.tolist()
    group = SHAPE.num_heads // SHAPE.num_kv_heads
    for r, (s, q) in enumerate(zip(batch.seq_lens_list, batch.query_lens_list)):
        blocks = batch.block_table[r, : math.ceil(s / SHAPE.page_size)].long()
        k = batch.k_cache[blocks].flatten(0, 1)[:s].double().repeat_interleave(group, 1)
        v = batch.v_cache[blocks].flatten(0, 1)[:s].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", batch.query[qsl[r] : qsl[r + 1]].double(), k)
        pos = torch.arange(s - q, s)
        scores = scores.masked_fill(torch.arange(s)[None, :] > pos[:, None], float("-inf"))
        probs = (scores / math.sqrt(SHAPE.head_dim)).softmax(-1)
        out[qsl[r] : qsl[r + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def test_a_right_output_passes_and_a_nan_in_any_checked_request_fails() -> None:
    batch = Batch(SHAPE, [9, 13, 6], [9, 5, 6], "cpu", seed=3)
    out = _attention(batch)
    assert batch.check(out) <= 1e-5
    for token in (8, 13, 19):  # the last query of the first, middle and last request
        bad = out.clone()
        bad[token, 1, 3] = float("nan")
        err = batch.check(bad)
        assert math.isnan(err)
        assert not err <= MAX_ABS_ERR  # the benchmarks' failure test
    off = out.clone()
    off[13, 0, 0] += 0.5
    assert abs(batch.check(off) - 0.5) < 1e-5
