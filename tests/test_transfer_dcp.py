"""A context-parallel (DCP) decode side: each rank receives only the chunks it owns, mapped by
the table's own CP slot formula; checked token by token against the slot reference, and
across spawned processes against the prefill side's cache."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from blocktable.constants import PAD_SLOT_ID
from blocktable.slot_mapping.reference import slot_of_position
from blocktable.transfer.plan import dcp_chunk_rows_many


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(1, 1), (2, 1), (2, 2), (2, 4), (3, 2), (4, 1)]),
       st.sampled_from([(4, 1), (4, 2), (8, 2), (8, 4)]),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), max_size=4),
       st.integers(0, 2**31 - 1))
@example((2, 2), (4, 2), [(0, 16), (1, 5)], 0)
def test_dcp_chunks_land_where_the_table_puts_each_token(
        world_interleave: tuple[int, int], sizes: tuple[int, int],
        reqs: list[tuple[int, int]], seed: int) -> None:
    """Every token of every request: exactly one rank holds it, at the slot the table's CP
    slot formula (the reference, with kernel blocks of either size) gives that rank."""
    world, interleave = world_interleave
    block_size, kernel_block_size = sizes
    if block_size % interleave:
        return
    chunk = np.gcd(interleave, kernel_block_size)
    virtual = block_size * world
    rng = np.random.default_rng(seed)
    # the hit (first tokens) is whole chunks; the blocks cover exactly first + num tokens
    firsts = [f * chunk * 3 for f, _ in reqs]
    nums = [n for _, n in reqs]
    ids_per_req = [rng.permutation(np.arange(1, 60))[: -(-(f + n) // virtual)]
                   for f, n in zip(firsts, nums)]
    counts = np.array([ids.size for ids in ids_per_req], dtype=np.int64)
    starts = np.cumsum(counts) - counts
    flat = np.concatenate(ids_per_req) if reqs else np.zeros(0, np.int64)
    owners, rows, row_starts = dcp_chunk_rows_many(
        flat, starts, counts, block_size, world, interleave, chunk, np.array(firsts, np.int64),
        np.array(nums, np.int64))
    assert owners.size == rows.size == row_starts[-1]
    per_manager = block_size // kernel_block_size
    for i, (ids, first, num) in enumerate(zip(ids_per_req, firsts, nums)):
        kernel_ids = (ids[:, None] * per_manager + np.arange(per_manager)).ravel()
        for p in range(first, first + num):
            j = row_starts[i] + (p - first) // chunk
            slots = [slot_of_position(p, kernel_ids, kernel_ids.size,
                                      kernel_block_size=kernel_block_size,
                                      manager_block_size=block_size, cp_world_size=world,
                                      cp_rank=r, cp_interleave=interleave)
                     for r in range(world)]
            held = [r for r, s in enumerate(slots) if s != PAD_SLOT_ID]
            assert held == [owners[j]]
            assert rows[j] * chunk + (p - first) % chunk == slots[held[0]]


def test_dcp_chunk_rows_refuse_bad_sizes() -> None:
    one = np.zeros(1, np.int64)
    args: dict[str, Any] = {"block_ids": np.array([3]), "block_starts": one,
                            "block_counts": np.ones(1, np.int64), "first_tokens": one,
                            "num_tokens": np.array([4])}
    with pytest.raises(ValueError, match=r"chunk_tokens \(3\) must divide interleave \(2\)"):
        dcp_chunk_rows_many(block_size=4, world_size=2, interleave=2, chunk_tokens=3, **args)
    with pytest.raises(ValueError, match=r"interleave the block size \(4\)"):
        dcp_chunk_rows_many(block_size=4, world_size=2, interleave=8, chunk_tokens=2, **args)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        dcp_chunk_rows_many(block_size=4, world_size=0, interleave=2, chunk_tokens=2, **args)
    with pytest.raises(ValueError, match="holds 1 blocks of 8 tokens; tokens up to 9 need 2"):
        dcp_chunk_rows_many(block_size=4, world_size=2, interleave=2, chunk_tokens=2,
                            **{**args, "num_tokens": np.array([9])})
