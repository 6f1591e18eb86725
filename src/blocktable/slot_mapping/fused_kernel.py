"""The fused slot-mapping kernel: every token-slot group and the padded tail in one launch.

Work is split over tokens, not requests: program ``i`` handles tokens ``[i*BLOCK, (i+1)*BLOCK)``
of the whole ``max_num_tokens`` buffer and finds each token's request: first the guess
``request = token`` (right for every token of a decode-only batch, checked with two loads), else
a ``RADIX``-ary search over ``query_start_loc`` (``RADIX`` lanes a level, so fewer dependent
loads than a binary search). Then it writes that token's slot in every group at once, as a
``[tokens, groups]`` tile whose loads all issue before the one store (PAD past
``num_tokens``). The grid depends only on ``max_num_tokens``, so one compiled kernel and one
grid serve every step (CUDA-graph safe); ``num_tokens`` and ``num_reqs`` are runtime values
that never recompile. Index math is int32 (the flat table has < 2**31 entries, positions past
2**31 are PAD); when every size is a power of two (``POW2``) it shifts and masks instead of
dividing, and without context parallelism (``HAS_CP`` false) the ownership math is skipped.
"""

from __future__ import annotations

import functools

import torch

from blocktable._triton import HAS_TRITON, Launcher, cdiv, next_power_of_2, tl, triton
from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID

if HAS_TRITON:
    _NULL = tl.constexpr(NULL_BLOCK_ID)  # kernels read globals only as constexprs
    _PAD = tl.constexpr(PAD_SLOT_ID)

    @triton.jit(
        do_not_specialize=["num_tokens", "num_reqs"],
        do_not_specialize_on_alignment=["query_start_loc_ptr", "positions_ptr", "row_of_batch_ptr"],
    )
    def _slot_mapping_kernel(
        table_ptr,  # int32 [num_entries]: every group's table, then the counts
        params_ptr,  # int32 [NUM_GROUPS, 12] (see params.pack_params)
        query_start_loc_ptr,  # int32 [num_reqs + 1]
        positions_ptr,  # int64 [num_tokens]
        row_of_batch_ptr,  # int32 [num_reqs] (read only when INDEXED)
        out_ptr,  # int64 [NUM_GROUPS, max_num_tokens]
        num_tokens,
        num_reqs,
        max_num_tokens: tl.constexpr,
        max_num_reqs: tl.constexpr,
        NUM_GROUPS: tl.constexpr,
        GROUPS: tl.constexpr,  # NUM_GROUPS rounded up to a power of two
        RADIX: tl.constexpr,
        LEVELS: tl.constexpr,
        INDEXED: tl.constexpr,
        POW2: tl.constexpr,
        HAS_CP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_buffer = tokens < max_num_tokens
        valid = tokens < num_tokens
        # Loads that do not depend on the request come first, so their latency overlaps.
        position = tl.load(positions_ptr + tokens, mask=valid, other=-1)
        # Guess req = token (true for every token of a decode-only prefix of the batch): it is
        # right exactly when qsl[token] <= token < qsl[token + 1].
        guess_ok = valid & (tokens < num_reqs)
        g_start = tl.load(query_start_loc_ptr + tokens, mask=guess_ok, other=1)
        g_end = tl.load(query_start_loc_ptr + tokens + 1, mask=guess_ok, other=0)
        found = guess_ok & (g_start <= tokens) & (tokens < g_end)
        # Otherwise: req = the largest r < num_reqs with qsl[r] <= token, RADIX lanes a level.
        search = valid & (found == 0)
        req = tl.zeros([BLOCK], dtype=tl.int32)
        lanes = tl.arange(0, RADIX)
        for level in tl.static_range(LEVELS):
            stride = RADIX ** (LEVELS - 1 - level)
            cand = req[:, None] + lanes[None, :] * stride
            ok = search[:, None] & (cand < num_reqs)
            start = tl.load(query_start_loc_ptr + cand, mask=ok, other=0)
            hits = tl.sum((ok & (start <= tokens[:, None])).to(tl.int32), axis=1)
            req = req + tl.maximum(hits - 1, 0) * stride
        req_start = tl.load(query_start_loc_ptr + req, mask=search, other=0)
        req_end = tl.load(query_start_loc_ptr + req + 1, mask=search, other=0)
        req = tl.where(found, tokens, req)
        valid = found | (search & (tokens >= req_start) & (tokens < req_end))
        if INDEXED:
            row = tl.load(row_of_batch_ptr + req, mask=valid, other=0)
        else:
            row = req
        valid = valid & (row >= 0) & (row < max_num_reqs)
        valid = valid & (position >= 0) & (position < 2147483648)
        pos = position.to(tl.int32)
        # Every group at once, as [BLOCK, GROUPS] tensors: all loads are issued before the one
        # store (a store between them would serialize the groups' memory round trips).
        g = tl.arange(0, GROUPS)
        g_ok = g < NUM_GROUPS
        p = params_ptr + g * 12
        table_offset = tl.load(p, mask=g_ok, other=0)[None, :]
        width = tl.load(p + 1, mask=g_ok, other=0)[None, :]
        counts_offset = tl.load(p + 2, mask=g_ok, other=0)[None, :]
        kernel_block_size = tl.load(p + 3, mask=g_ok, other=1)[None, :]
        pos = pos[:, None]
        row = row[:, None]
        owned = valid[:, None] & g_ok[None, :]
        if HAS_CP:
            world = tl.load(p + 5, mask=g_ok, other=1)[None, :]
            rank = tl.load(p + 6, mask=g_ok, other=0)[None, :]
            if POW2:
                k_log = tl.load(p + 8, mask=g_ok, other=0)[None, :]
                kpm_log = tl.load(p + 9, mask=g_ok, other=0)[None, :]
                w_log = tl.load(p + 10, mask=g_ok, other=0)[None, :]
                i_log = tl.load(p + 11, mask=g_ok, other=0)[None, :]
                virt_log = k_log + kpm_log + w_log
                v = pos & ((1 << virt_log) - 1)
                owned = owned & (((v >> i_log) & (world - 1)) == rank)
                local = ((v >> (w_log + i_log)) << i_log) | (v & ((1 << i_log) - 1))
                block_index = ((pos >> virt_log) << kpm_log) + (local >> k_log)
                offset = local & (kernel_block_size - 1)
            else:
                blocks_per_manager = tl.load(p + 4, mask=g_ok, other=1)[None, :]
                interleave = tl.load(p + 7, mask=g_ok, other=1)[None, :]
                virtual_block_size = kernel_block_size * blocks_per_manager * world
                v = pos % virtual_block_size
                owned = owned & ((v // interleave) % world == rank)
                local = (v // (world * interleave)) * interleave + v % interleave
                block_index = (pos // virtual_block_size) * blocks_per_manager + (
                    local // kernel_block_size
                )
                offset = local % kernel_block_size
        else:
            if POW2:
                k_log = tl.load(p + 8, mask=g_ok, other=0)[None, :]
                block_index = pos >> k_log
                offset = pos & (kernel_block_size - 1)
            else:
                block_index = pos // kernel_block_size
                offset = pos % kernel_block_size
        # The count and the entry are loaded together (the entry's mask does not wait for the
        # count): entries past the count are null on the device anyway.
        in_row = owned & (block_index < width)
        num_filled = tl.load(table_ptr + counts_offset + row, mask=owned, other=0)
        block_id = tl.load(table_ptr + table_offset + row * width + block_index, mask=in_row,
                           other=0)
        owned = in_row & (block_index < num_filled) & (block_id != _NULL)
        slot = tl.where(owned, block_id.to(tl.int64) * kernel_block_size + offset, _PAD)
        tl.store(out_ptr + g[None, :] * max_num_tokens + tokens[:, None], slot,
                 mask=in_buffer[:, None] & g_ok[None, :])

    _launch = Launcher(_slot_mapping_kernel, dynamic=(6, 7))


@functools.lru_cache(maxsize=64)
def search_levels(max_num_reqs: int, radix: int) -> int:
    """Levels of a ``radix``-ary search that reach every request index below ``max_num_reqs``."""
    levels, reach = 1, radix
    while reach < max_num_reqs:
        levels += 1
        reach *= radix
    return levels


# Chosen with benchmarks/tune_slot_kernel.py on an H200 (the sweep: BENCHMARKS.md at 7aa778c):
# tokens per program, search radix, warps.
DEFAULT_BLOCK = 128
DEFAULT_RADIX = 4
DEFAULT_NUM_WARPS = 4


def launch_slot_mapping(
    flat_table: torch.Tensor,
    params: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    row_of_batch: torch.Tensor | None,
    out: torch.Tensor,
    *,
    max_num_reqs: int,
    pow2: bool,
    has_cp: bool,
    block: int = DEFAULT_BLOCK,
    radix: int = DEFAULT_RADIX,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> None:
    """Launch :func:`_slot_mapping_kernel` over ``out`` (int64 ``[num_groups, max_num_tokens]``)."""
    num_groups, max_num_tokens = out.shape
    num_reqs = query_start_loc.numel() - 1
    _launch(
        (cdiv(max_num_tokens, block),),
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
        next_power_of_2(num_groups),
        radix,
        search_levels(max_num_reqs, radix),
        row_of_batch is not None,
        pow2,
        has_cp,
        block,
        num_warps=num_warps,
    )
