"""The batched torch attention (the CPU engine's) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from blocktable.attention import paged_attention_reference
from blocktable.attention.torch_paged import plan_torch_attention, torch_paged_attention


def _random_step(seed: int, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 block_size: int, query_lens: list[int], seq_lens: list[int]):
    gen = torch.Generator().manual_seed(seed)
    head_dim, num_blocks = 8, 256
    num_reqs = len(seq_lens)
    width = max(-(-s // block_size) for s in seq_lens) + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen,
                          dtype=torch.float64).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen,
                          dtype=torch.float64).to(dtype)
    # distinct random blocks per row, rows shuffled (indexed mode), one spare row
    ids = torch.randperm(num_blocks - 1, generator=gen)[: (num_reqs + 1) * width] + 1
    block_table = ids.view(num_reqs + 1, width).to(torch.int32)
    row_of_batch = torch.randperm(num_reqs + 1, generator=gen)[:num_reqs].to(torch.int32)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    num_tokens = int(qsl[-1])
    query = torch.randn(num_tokens + 2, num_heads, head_dim, generator=gen,
                        dtype=torch.float64).to(dtype)  # two pad rows at the end
    return (query, k_cache, v_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32),
            qsl, row_of_batch)


CASES = [  # (query_lens, seq_lens)
    ([1, 1, 1], [5, 9, 1]),  # decode, unequal lengths
    ([1, 1], [8, 8]),  # decode, equal lengths (no mask)
    ([7], [7]),  # a whole prompt
    ([3, 1, 5, 1], [10, 4, 5, 17]),  # chunks and decodes mixed
    ([12, 1], [30, 30]),
]


@pytest.mark.parametrize("query_lens,seq_lens", CASES)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_torch_paged_attention_matches_reference(query_lens, seq_lens, heads, block_size):
    num_heads, num_kv_heads = heads
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        q, kc, vc, table, lens, qsl, rows = _random_step(
            len(seq_lens) + block_size, dtype, num_heads, num_kv_heads, block_size,
            query_lens, seq_lens)
        plan = plan_torch_attention(table, lens, qsl, block_size, row_of_batch=rows)
        got = torch_paged_attention(q, kc, vc, plan, scale=0.3)
        want = paged_attention_reference(q, kc, vc, table, lens, qsl, scale=0.3,
                                         row_of_batch=rows)
        assert got.dtype == dtype and got.shape == q.shape
        assert isinstance(want, torch.Tensor)
        torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=tol)
        assert not got[int(qsl[-1]):].any()  # pad rows are zeros


def test_plan_groups_split_decode_from_prefill():
    _, _, _, table, lens, qsl, rows = _random_step(0, torch.float32, 4, 2, 4, [3, 1, 1],
                                                   [9, 4, 6])
    plan = plan_torch_attention(table, lens, qsl, 4, row_of_batch=rows)
    assert [g.max_query_len for g in plan.groups] == [1, 3]
    assert [g.slots.shape[0] for g in plan.groups] == [2, 1]
    assert plan.groups[0].token_index.tolist() == [3, 4]
    assert plan.groups[1].token_index.tolist() == [0, 1, 2]
