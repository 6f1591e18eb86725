"""The fused slot-mapping kernel: every token-slot group and the padded tail in one launch.

Work is split over tokens, not requests: program ``i`` handles tokens ``[i*BLOCK, (i+1)*BLOCK)``
of the whole ``max_num_tokens`` buffer, finds each token's request by binary search over
``query_start_loc``, and writes that token's slot in every group (PAD past ``num_tokens``). The
grid depends only on ``max_num_tokens``, so one compiled kernel and one grid serve every step
(CUDA-graph safe); ``num_tokens`` and ``num_reqs`` are runtime values that never recompile.
"""

from __future__ import annotations

import torch

from blocktable._triton import HAS_TRITON, Launcher, tl, triton
from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID

if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_tokens", "num_reqs"])
    def _slot_mapping_kernel(
        table_ptr,  # int32 [num_entries]: every group's table, then the counts
        params_ptr,  # int64 [NUM_GROUPS, 8]
        query_start_loc_ptr,  # int32 [num_reqs + 1]
        positions_ptr,  # int64 [num_tokens]
        row_of_batch_ptr,  # int32 [num_reqs] (read only when INDEXED)
        out_ptr,  # int64 [NUM_GROUPS, max_num_tokens]
        num_tokens,
        num_reqs,
        max_num_tokens: tl.constexpr,
        max_num_reqs: tl.constexpr,
        NUM_GROUPS: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,
        INDEXED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_buffer = tokens < max_num_tokens
        valid = tokens < num_tokens
        # Binary search: req = the largest r < num_reqs with qsl[r] <= token.
        req = tl.zeros([BLOCK], dtype=tl.int32)
        for step in tl.static_range(SEARCH_STEPS):
            cand = req + (1 << (SEARCH_STEPS - 1 - step))
            start = tl.load(query_start_loc_ptr + cand, mask=valid & (cand < num_reqs), other=0)
            take = valid & (cand < num_reqs) & (start <= tokens)
            req = tl.where(take, cand, req)
        req_start = tl.load(query_start_loc_ptr + req, mask=valid, other=0)
        req_end = tl.load(query_start_loc_ptr + req + 1, mask=valid, other=0)
        valid = valid & (tokens >= req_start) & (tokens < req_end)
        if INDEXED:
            row = tl.load(row_of_batch_ptr + req, mask=valid, other=0).to(tl.int64)
        else:
            row = req.to(tl.int64)
        valid = valid & (row >= 0) & (row < max_num_reqs)
        position = tl.load(positions_ptr + tokens, mask=valid, other=0)
        valid = valid & (position >= 0)
        for g in tl.static_range(NUM_GROUPS):
            p = params_ptr + g * 8
            table_offset = tl.load(p)
            width = tl.load(p + 1)
            counts_offset = tl.load(p + 2)
            kernel_block_size = tl.load(p + 3)
            blocks_per_manager = tl.load(p + 4)
            world = tl.load(p + 5)
            rank = tl.load(p + 6)
            interleave = tl.load(p + 7)
            virtual_block_size = kernel_block_size * blocks_per_manager * world
            v = position % virtual_block_size
            owned = valid & ((v // interleave) % world == rank)
            local = (v // (world * interleave)) * interleave + v % interleave
            block_index = (position // virtual_block_size) * blocks_per_manager + (
                local // kernel_block_size
            )
            num_filled = tl.load(table_ptr + counts_offset + row, mask=owned, other=0)
            owned = owned & (block_index < num_filled) & (block_index < width)
            block_id = tl.load(
                table_ptr + table_offset + row * width + block_index, mask=owned, other=0
            ).to(tl.int64)
            owned = owned & (block_id != NULL_BLOCK_ID)
            slot = block_id * kernel_block_size + local % kernel_block_size
            slot = tl.where(owned, slot, PAD_SLOT_ID)
            tl.store(out_ptr + g * max_num_tokens + tokens, slot, mask=in_buffer)


def search_steps(max_num_reqs: int) -> int:
    """Binary-search steps that reach every request index below ``max_num_reqs``."""
    return max(1, int(max_num_reqs).bit_length())


def launch_slot_mapping(
    flat_table: torch.Tensor,
    params: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    row_of_batch: torch.Tensor | None,
    out: torch.Tensor,
    *,
    max_num_reqs: int,
    block: int = 256,
    num_warps: int = 4,
) -> None:
    """Launch :func:`_slot_mapping_kernel` over ``out`` (int64 ``[num_groups, max_num_tokens]``)."""
    num_groups, max_num_tokens = out.shape
    num_reqs = query_start_loc.numel() - 1
    grid = (triton.cdiv(max_num_tokens, block),)
    _launch(
        grid,
        flat_table,
        params,
        query_start_loc,
        positions,
        row_of_batch if row_of_batch is not None else query_start_loc,
        out,
        positions.numel() if num_reqs > 0 else 0,  # no request: every token is padding
        num_reqs,
        max_num_tokens,
        max_num_reqs,
        num_groups,
        search_steps(max_num_reqs),
        row_of_batch is not None,
        block,
        num_warps=num_warps,
    )


_launch = Launcher(_slot_mapping_kernel, dynamic=(6, 7)) if HAS_TRITON else None
