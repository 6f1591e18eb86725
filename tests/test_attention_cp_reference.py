"""The reference attention under context parallelism: sharded keys, global causal masks, LSE.

Each rank's cache holds the keys it owns at local positions; the per-rank outputs merged by
their log-sum-exp must equal attention over the unsharded sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktable.attention import paged_attention_reference
from blocktable.attention.cp_layout import global_positions, local_seq_len
from blocktable.config import CPConfig
from blocktable.slot_mapping.reference import slot_of_position


def _merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    lse = torch.stack([x.double() for x in lses])  # [W, T, H]
    m = lse.max(dim=0).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = m + (lse - m).exp().sum(0).log()
    weights = torch.where(torch.isfinite(lse), (lse - total).exp(), 0.0)
    return (weights[..., None] * torch.stack([o.double() for o in outs])).sum(0)


@pytest.mark.parametrize(
    ("world", "interleave", "manager_block_size", "kernel_block_size"),
    [(1, 1, 4, 4), (2, 1, 4, 4), (2, 2, 4, 4), (2, 4, 8, 4), (4, 1, 8, 2), (3, 2, 6, 3)],
)
@pytest.mark.parametrize("window", [None, 5])
def test_sharded_attention_merges_to_unsharded(
    world: int, interleave: int, manager_block_size: int, kernel_block_size: int, window: int | None
) -> None:
    gen = torch.Generator().manual_seed(world * 100 + interleave * 10 + manager_block_size)
    num_heads, num_kv_heads, head_dim = 4, 2, 8
    # (seq_len, query_len): decode, prefill, a chunk over a cached prefix, a request shorter
    # than interleave * world (some ranks hold nothing), an empty request.
    reqs = [(37, 1), (13, 13), (29, 7), (2, 2), (0, 0)]
    total = sum(q for _, q in reqs)
    qsl = torch.tensor(np.cumsum([0] + [q for _, q in reqs]), dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in reqs], dtype=torch.int32)
    query = torch.randn(total, num_heads, head_dim, generator=gen, dtype=torch.float64)
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
            for s, _ in reqs]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
              for s, _ in reqs]

    # Unsharded: request r's positions in consecutive blocks of one cache.
    width = 24  # kernel blocks per row: 37 tokens at kernel block 2 need 19
    full_k = torch.zeros(1 + len(reqs) * width, kernel_block_size, num_kv_heads, head_dim,
                         dtype=torch.float64)
    full_v = torch.zeros_like(full_k)
    full_table = torch.zeros(len(reqs), width, dtype=torch.int32)
    for r, (s, _) in enumerate(reqs):
        full_table[r] = torch.arange(1 + r * width, 1 + (r + 1) * width, dtype=torch.int32)
        for p in range(s):
            full_k[full_table[r, p // kernel_block_size], p % kernel_block_size] = keys[r][p]
            full_v[full_table[r, p // kernel_block_size], p % kernel_block_size] = values[r][p]
    expected, expected_lse = paged_attention_reference(
        query, full_k, full_v, full_table, seq_lens, qsl, sliding_window=window, return_lse=True
    )

    outs, lses = [], []
    k = manager_block_size // kernel_block_size
    for rank in range(world):
        cp = CPConfig(world, rank, interleave)
        cache_k = torch.full_like(full_k, float("nan"))  # a read of an unwritten slot poisons
        cache_v = torch.full_like(full_v, float("nan"))
        table = full_table.clone()
        # Scrambled block order per rank: only the table says where things are.
        for r, (s, _) in enumerate(reqs):
            perm = torch.randperm(width // k, generator=gen)
            ids = (full_table[r].view(-1, k)[perm]).reshape(-1)
            table[r] = ids
            row = table[r].numpy()
            for p in range(s):
                slot = slot_of_position(
                    p, row, width, kernel_block_size=kernel_block_size,
                    manager_block_size=manager_block_size, cp_world_size=world, cp_rank=rank,
                    cp_interleave=interleave,
                )
                if slot >= 0:
                    cache_k[slot // kernel_block_size, slot % kernel_block_size] = keys[r][p]
                    cache_v[slot // kernel_block_size, slot % kernel_block_size] = values[r][p]
        out, lse = paged_attention_reference(
            query, cache_k, cache_v, table, seq_lens, qsl, sliding_window=window, cp=cp,
            cp_block_size=manager_block_size, return_lse=True,
        )
        assert not out.isnan().any()
        outs.append(out)
        lses.append(lse)
    merged = _merge(outs, lses)
    # The LSE travels in float32 (as kernels return it): merged to ~1e-7 relative.
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-6)
    merged_lse = torch.logsumexp(torch.stack([x.double() for x in lses]), dim=0)
    torch.testing.assert_close(merged_lse.float(), expected_lse, rtol=1e-5, atol=1e-5)


def test_local_layout_partitions_the_sequence() -> None:
    for world, interleave, block in [(2, 1, 4), (2, 2, 4), (4, 2, 8), (3, 3, 6)]:
        for seq_len in range(60):
            seen = []
            for rank in range(world):
                kw = {"world_size": world, "rank": rank, "interleave": interleave,
                      "manager_block_size": block}
                n = local_seq_len(seq_len, **kw)
                pos = global_positions(np.arange(n), **kw)
                assert (np.diff(pos) > 0).all()
                owners = (pos % (block * world)) // interleave % world
                assert (owners == rank).all()
                seen.extend(pos.tolist())
            assert sorted(seen) == list(range(seq_len))


def test_empty_shard_gives_minus_inf_lse_and_zeros() -> None:
    # A 1-token request with interleave 2, world 2: rank 1 holds nothing.
    k = torch.randn(2, 4, 1, 8)
    out, lse = paged_attention_reference(
        torch.randn(1, 2, 8), k, k.clone(), torch.tensor([[1]], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        cp=CPConfig(2, 1, 2), return_lse=True,
    )
    assert torch.isneginf(lse).all()
    assert (out == 0).all()


def test_bad_cp_arguments() -> None:
    k = torch.randn(2, 4, 1, 8)
    args = (torch.randn(1, 1, 8), k, k, torch.tensor([[1]], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="cp_block_size=6 must be a multiple"):
        paged_attention_reference(*args, cp=CPConfig(2, 0, 2), cp_block_size=6)
    with pytest.raises(ValueError, match="interleave=8 must divide cp_block_size=4"):
        paged_attention_reference(*args, cp=CPConfig(2, 0, 8))
    with pytest.raises(IndexError, match=r"row_of_batch\[0\]=3 is out of range"):
        paged_attention_reference(*args, row_of_batch=torch.tensor([3], dtype=torch.int32))
