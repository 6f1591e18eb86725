"""The varlen paged attention kernel: prefill, chunks over cached prefixes, any query length.

The grid is ``(cdiv(num_tokens, BLOCK_Q) + num_reqs, num_kv_heads)``, from shapes only: a
program's ``BLOCK_M`` rows are ``BLOCK_Q`` query tokens times the query heads of one KV head,
so one K/V load serves the GQA group. Request ``r`` owns the query tiles
``[qsl[r] // BLOCK_Q + r, qsl[r+1] // BLOCK_Q + r + 1)`` (at least
``ceil(query_len / BLOCK_Q)`` of them); a program finds its request with a ``RADIX``-ary
search over ``query_start_loc`` on the device, and tiles past the last request zero the pad
tokens. Programs run in reverse tile order so the longest (last) tiles of a causal prefill
start first. Requests of at most ``short_query_len`` tokens are left to the decode kernel.
"""

from __future__ import annotations

from blocktable._triton import HAS_TRITON, tl, triton
from blocktable.attention.triton_tiles import (
    attend_segments,
    local_len,
    store_rows,
    zero_rows,
)

PREFILL_DYNAMIC_ARGS = (
    "window", "num_reqs", "num_tokens", "short_query_len", "num_blocks", "num_rows", "width",
    "cp_world", "cp_rank", "cp_interleave", "cp_block", "search_stride",
)

if HAS_TRITON:

    def _prefill_kernel(
        out_ptr,  # [num_tokens, num_heads, head_dim]
        lse_ptr,  # float32 [num_tokens, num_heads] (read only when HAS_LSE)
        query_ptr,  # [num_tokens, num_heads, head_dim]
        k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
        v_cache_ptr,
        table_ptr,  # int32 [num_rows, width]
        seq_lens_ptr,  # int32 [num_reqs]
        qsl_ptr,  # int32 [num_reqs + 1]
        row_of_batch_ptr,  # int32 [num_reqs] (read only when INDEXED)
        qk_scale,
        window,
        num_reqs,
        num_tokens,
        short_query_len,
        num_blocks,
        num_rows,
        width,
        cp_world,
        cp_rank,
        cp_interleave,
        cp_block,
        search_stride,  # RADIX ** (levels - 1)
        out_stride_t, out_stride_h, out_stride_d,
        lse_stride_t, lse_stride_h,
        q_stride_t, q_stride_h, q_stride_d,
        k_stride_b, k_stride_s, k_stride_h, k_stride_d,
        v_stride_b, v_stride_s, v_stride_h, v_stride_d,
        table_stride_r, table_stride_c,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,  # BLOCK_M // GROUP_PAD query tokens per tile
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        RADIX: tl.constexpr,
        INDEXED: tl.constexpr,
        HAS_CP: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_LSE: tl.constexpr,
        DOT_FP32: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        IDS_MODE: tl.constexpr,  # how tiles read block ids (attend_tiles)
        SAME_KV: tl.constexpr,  # v_cache has k_cache's strides: one offset computation for both
        DTYPE: tl.constexpr,  # the cache's dtype name: part of the launcher's key
    ):
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        kv_head = tl.program_id(1)  # rows are (token, query head of the group)
        qi = rows // GROUP_PAD
        g = rows % GROUP_PAD
        heads = kv_head * GROUP + g
        head_ok = g < GROUP

        # The request: the largest r <= num_reqs with qsl[r] // BLOCK_Q + r <= tile.
        lanes = tl.arange(0, RADIX)
        req = tile * 0
        stride = search_stride
        while stride > 0:
            cand = req + lanes * stride
            ok = cand <= num_reqs
            first = tl.load(qsl_ptr + cand, mask=ok, other=0) // BLOCK_Q + cand
            hits = tl.sum((ok & (first <= tile)).to(tl.int32), 0)
            req = req + (hits - 1) * stride
            stride = stride // RADIX
        # The request's scalars, loaded together before any branch (one memory round trip;
        # a pad tile, req == num_reqs, reads only qsl).
        real = req < num_reqs
        q_start = tl.load(qsl_ptr + req)
        q_end = tl.load(qsl_ptr + req + 1, mask=real, other=0)
        seq_len = tl.load(seq_lens_ptr + req, mask=real, other=0)
        row = req
        if INDEXED:
            row = tl.load(row_of_batch_ptr + req, mask=real, other=0)
        if req == num_reqs:  # past the last request: zero the pad tokens of this tile
            tokens = (tile - num_reqs) * BLOCK_Q + qi
            pad = head_ok & (tokens >= q_start) & (tokens < num_tokens)
            zero_rows(
                out_ptr, lse_ptr, tokens, heads, pad, out_stride_t, out_stride_h,
                out_stride_d, lse_stride_t, lse_stride_h, BLOCK_M, BLOCK_D, HEAD_DIM, HAS_LSE,
            )
            return
        query_len = q_end - q_start
        j = tile - q_start // BLOCK_Q - req  # the tile's index in its request
        if query_len <= short_query_len or j * BLOCK_Q >= query_len:
            return
        row_ok = (row >= 0) & (row < num_rows)
        row = tl.where(row_ok, row, 0)
        # Never read past the row, whatever seq_len says.
        kv_cap = tl.minimum(
            local_len(seq_len, cp_world, cp_rank, cp_interleave, cp_block, HAS_CP),
            width * BLOCK_SIZE,
        )
        kv_cap = tl.where(row_ok, kv_cap, 0)
        _prefill_tile(
            j * BLOCK_Q, qi, heads, head_ok, q_start, query_len, seq_len, row, kv_cap,
            out_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, table_ptr, qk_scale, window,
            num_blocks, cp_world, cp_rank, cp_interleave, cp_block, kv_head,
            out_stride_t, out_stride_h, out_stride_d, lse_stride_t, lse_stride_h,
            q_stride_t, q_stride_h, q_stride_d, k_stride_b, k_stride_s, k_stride_h, k_stride_d,
            v_stride_b, v_stride_s, v_stride_h, v_stride_d, table_stride_r, table_stride_c,
            BLOCK_M, BLOCK_Q, BLOCK_N, HEAD_DIM, BLOCK_D, BLOCK_SIZE, HAS_CP, HAS_WINDOW,
            HAS_LSE, DOT_FP32, NUM_STAGES, IDS_MODE, SAME_KV,
        )

    @triton.jit
    def _prefill_tile(
        i0, qi, heads, head_ok, q_start, query_len, seq_len, row, kv_cap,
        out_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, table_ptr, qk_scale, window,
        num_blocks, cp_world, cp_rank, cp_interleave, cp_block, kv_head,
        out_stride_t, out_stride_h, out_stride_d, lse_stride_t, lse_stride_h,
        q_stride_t, q_stride_h, q_stride_d, k_stride_b, k_stride_s, k_stride_h, k_stride_d,
        v_stride_b, v_stride_s, v_stride_h, v_stride_d, table_stride_r, table_stride_c,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HAS_CP: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_LSE: tl.constexpr,
        DOT_FP32: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        IDS_MODE: tl.constexpr,
        SAME_KV: tl.constexpr,
    ):
        """Query tokens ``[i0, i0 + BLOCK_Q)`` of one request (rows ``qi``, heads ``heads``)
        against their visible keys; stores their output rows (and LSE)."""
        tok_i = i0 + qi
        row_valid = (tok_i < query_len) & head_ok
        q_pos = seq_len - query_len + tok_i
        row_hi = tl.minimum(
            local_len(q_pos + 1, cp_world, cp_rank, cp_interleave, cp_block, HAS_CP), kv_cap
        )
        row_hi = tl.where(row_valid, row_hi, 0)
        q_min = seq_len - query_len + i0
        q_max = seq_len - query_len + tl.minimum(i0 + BLOCK_Q, query_len) - 1
        kv_end = tl.minimum(
            local_len(q_max + 1, cp_world, cp_rank, cp_interleave, cp_block, HAS_CP), kv_cap
        )
        full_hi = tl.minimum(
            local_len(q_min + 1, cp_world, cp_rank, cp_interleave, cp_block, HAS_CP), kv_cap
        )
        if HAS_WINDOW:
            row_lo = local_len(q_pos - window + 1, cp_world, cp_rank, cp_interleave, cp_block,
                               HAS_CP)
            kv_lo = local_len(q_min - window + 1, cp_world, cp_rank, cp_interleave, cp_block,
                              HAS_CP)
            full_lo = local_len(q_max - window + 1, cp_world, cp_rank, cp_interleave, cp_block,
                                HAS_CP)
        else:
            row_lo = tok_i * 0
            kv_lo = 0
            full_lo = 0

        tokens = q_start + tok_i
        d = tl.arange(0, BLOCK_D)
        q_mask = row_valid[:, None]
        if HEAD_DIM != BLOCK_D:
            q_mask = q_mask & (d[None, :] < HEAD_DIM)
        q = tl.load(
            query_ptr
            + tokens.to(tl.int64)[:, None] * q_stride_t
            + heads[:, None] * q_stride_h
            + d[None, :] * q_stride_d,
            mask=q_mask,
            other=0.0,
        )
        if DOT_FP32:
            q = q.to(tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: exp2(m - m_new) not NaN
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        table_row_ptr = table_ptr + row.to(tl.int64) * table_stride_r
        k_base = k_cache_ptr + kv_head * k_stride_h
        v_base = v_cache_ptr + kv_head * v_stride_h
        acc, m_i, l_i = attend_segments(
            acc, m_i, l_i, q, row_lo, row_hi, (kv_lo // BLOCK_N) * BLOCK_N, kv_end, kv_lo,
            full_lo, full_hi, kv_cap, table_row_ptr, table_stride_c, k_base, v_base,
            k_stride_b, k_stride_s, k_stride_d, v_stride_b, v_stride_s, v_stride_d,
            num_blocks, qk_scale, HAS_WINDOW, BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_SIZE,
            DOT_FP32, NUM_STAGES, IDS_MODE, SAME_KV,
        )
        store_rows(
            out_ptr, lse_ptr, acc, m_i, l_i, tokens, heads, row_valid, out_stride_t,
            out_stride_h, out_stride_d, lse_stride_t, lse_stride_h, BLOCK_D, HEAD_DIM, HAS_LSE,
        )

    _UNALIGNED = ["lse_ptr", "table_ptr", "seq_lens_ptr", "qsl_ptr", "row_of_batch_ptr"]
    # Two compilations of one kernel: query, output and caches 16-byte aligned (vector loads), or
    # not (the launcher picks one by looking at the pointers).
    prefill_kernel = triton.jit(
        do_not_specialize=list(PREFILL_DYNAMIC_ARGS), do_not_specialize_on_alignment=_UNALIGNED
    )(_prefill_kernel)
    prefill_kernel_unaligned = triton.jit(
        do_not_specialize=list(PREFILL_DYNAMIC_ARGS),
        do_not_specialize_on_alignment=[
            *_UNALIGNED, "out_ptr", "query_ptr", "k_cache_ptr", "v_cache_ptr"
        ],
    )(_prefill_kernel)
