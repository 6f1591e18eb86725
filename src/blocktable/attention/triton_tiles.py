"""Triton building blocks shared by the prefill and decode kernels.

A *tile* is ``BLOCK_M`` rows of queries against ``BLOCK_N`` keys. Rows pack the query heads of
one KV head: row ``m`` is query token ``m // GROUP_PAD`` of the tile and query head
``kv_head * GROUP + m % GROUP_PAD`` (rows with ``m % GROUP_PAD >= GROUP`` are padding), so one
load of a K/V tile serves the whole group. Keys are *local* positions (see
:mod:`blocktable.attention.cp_layout`); key ``l`` is read from
``cache[block_table[row, l // BLOCK_SIZE], l % BLOCK_SIZE]``, one block id per key, so tiles
are independent of the cache's block size.

Every row sees the local keys ``[row_lo, row_hi)``: causal and sliding-window masks by
*global* position become a key range because global positions grow with local ones, and
``local_len(p)`` (how many of this rank's keys lie before global position ``p``) turns a global
bound into a local one. Tiles wholly inside every row's range skip the mask.
"""

from __future__ import annotations

from blocktable._triton import HAS_TRITON, tl, triton

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453

if HAS_TRITON:
    _LN_2 = tl.constexpr(LN_2)

    @triton.jit
    def local_len(pos, cp_world, cp_rank, cp_interleave, cp_block, HAS_CP: tl.constexpr):
        """This rank's keys at global positions ``[0, pos)`` (``pos`` clamped at 0)."""
        pos = tl.maximum(pos, 0)
        if HAS_CP:
            virtual = cp_block * cp_world
            stride = cp_world * cp_interleave
            rem = pos % virtual
            in_round = tl.minimum(
                tl.maximum(rem % stride - cp_rank * cp_interleave, 0), cp_interleave
            )
            pos = (pos // virtual) * cp_block + (rem // stride) * cp_interleave + in_round
        return pos

    @triton.jit
    def _attend_tile(
        acc,
        m_i,
        l_i,
        next_ids,
        q,
        row_lo,
        row_hi,
        start,
        kv_lo,
        kv_cap,
        table_row_ptr,
        table_stride_c,
        k_base,
        v_base,
        k_stride_b,
        k_stride_s,
        k_stride_d,
        v_stride_b,
        v_stride_s,
        v_stride_d,
        num_blocks,
        qk_scale,
        MASKED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        DOT_FP32: tl.constexpr,
        IDS_MODE: tl.constexpr,
        SAME_KV: tl.constexpr,
        LOWER: tl.constexpr,
    ):
        """The key tile at ``start`` of :func:`attend_tiles`; returns the updated ``acc, m_i,
        l_i`` and, with ``IDS_MODE`` 0, the next tile's block ids (``next_ids`` holds this
        tile's)."""
        n = tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        keys = start + n
        if IDS_MODE == 0:
            block_id = next_ids
            next_keys = keys + BLOCK_N
            next_ids = tl.load(
                table_row_ptr + (next_keys // BLOCK_SIZE) * table_stride_c,
                mask=(next_keys >= kv_lo) & (next_keys < kv_cap),
                other=-1,
            )
        elif IDS_MODE == 1:
            block_id = tl.load(
                table_row_ptr + (keys // BLOCK_SIZE) * table_stride_c,
                mask=(keys >= kv_lo) & (keys < kv_cap),
                other=-1,
            )
        else:
            PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
            page = start // BLOCK_SIZE + tl.arange(0, PAGES)
            page_ids = tl.load(
                table_row_ptr + page * table_stride_c,
                mask=(page * BLOCK_SIZE < kv_cap) & ((page + 1) * BLOCK_SIZE > kv_lo),
                other=-1,
            )
            block_id = tl.reshape(
                tl.broadcast_to(page_ids[:, None], (PAGES, BLOCK_SIZE)), (BLOCK_N,)
            )
        if MASKED:
            in_row = (keys >= kv_lo) & (keys < kv_cap)
        else:  # every key of an unmasked tile lies in the row
            in_row = keys < kv_cap
        kv_ok = in_row & (block_id >= 0) & (block_id < num_blocks)
        # An id outside the cache is never dereferenced: its K and V read as zeros (a NaN
        # there would poison P @ V even with its scores masked).
        block_id = tl.where(kv_ok, block_id, 0).to(tl.int64)
        if IDS_MODE == 2:  # tiles start at multiples of BLOCK_N, hence of BLOCK_SIZE
            offset = n % BLOCK_SIZE
        else:
            offset = keys % BLOCK_SIZE
        kv_mask = kv_ok[:, None]
        if HEAD_DIM != BLOCK_D:
            kv_mask = kv_mask & (d[None, :] < HEAD_DIM)
        k_off = block_id[:, None] * k_stride_b + offset[:, None] * k_stride_s + d[None, :] * k_stride_d
        k = tl.load(k_base + k_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        if MASKED:  # (row bounds lie inside [kv_lo, kv_cap): kv_ok adds nothing for them)
            if LOWER:
                visible = (keys[None, :] >= row_lo[:, None]) & (keys[None, :] < row_hi[:, None])
            else:
                visible = keys[None, :] < row_hi[:, None]
        # The scale rides in one FMA per score (qk_scale > 0, so max commutes with it), and
        # P @ V accumulates into the rescaled accumulator in place.
        if MASKED:
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if SAME_KV:  # V laid out like K: the same offsets
            v_off = k_off
        else:
            v_off = (
                block_id[:, None] * v_stride_b + offset[:, None] * v_stride_s
                + d[None, :] * v_stride_d
            )
        v = tl.load(v_base + v_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        return acc, m_new, l_i, next_ids

    @triton.jit
    def attend_tiles(
        acc,
        m_i,
        l_i,
        q,
        row_lo,
        row_hi,
        kv_start,
        kv_end,
        kv_lo,
        kv_cap,
        table_row_ptr,
        table_stride_c,
        k_base,
        v_base,
        k_stride_b,
        k_stride_s,
        k_stride_d,
        v_stride_b,
        v_stride_s,
        v_stride_d,
        num_blocks,
        qk_scale,  # scale * log2(e): scores live in the log2 domain
        MASKED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        DOT_FP32: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        IDS_MODE: tl.constexpr,
        SAME_KV: tl.constexpr,
        LOWER: tl.constexpr,
    ):
        """Online softmax over the key tiles starting at ``kv_start, kv_start + BLOCK_N, ...``
        below ``kv_end``. Unmasked (``MASKED`` false) tiles must be visible to every row. Keys
        outside ``[kv_lo, kv_cap)`` are never loaded (entries before a window may be null).

        IDS_MODE 0: the block ids of tile i+1 are loaded while tile i computes (a loop-carried
        prefetch). 1: each tile loads its ids (one per key) in the loop, which lets the
        software pipeliner issue the table and K/V loads stages ahead. 2: as 1 with one id per
        block (BLOCK_SIZE divides BLOCK_N), broadcast over its keys. ``SAME_KV``: V has K's strides (one offset
        computation serves both loads). ``LOWER``: rows have a lower key bound (``row_lo``, a
        sliding window); else masked tiles compare keys with ``row_hi`` only."""
        n = tl.arange(0, BLOCK_N)
        next_ids = n
        if IDS_MODE == 0:
            next_keys = kv_start + n
            next_ids = tl.load(
                table_row_ptr + (next_keys // BLOCK_SIZE) * table_stride_c,
                mask=(next_keys >= kv_lo) & (next_keys < kv_cap),
                other=-1,
            )
        if IDS_MODE == 0:
            for start in tl.range(kv_start, kv_end, BLOCK_N, num_stages=NUM_STAGES):
                acc, m_i, l_i, next_ids = _attend_tile(
                    acc, m_i, l_i, next_ids, q, row_lo, row_hi, start, kv_lo, kv_cap,
                    table_row_ptr, table_stride_c, k_base, v_base, k_stride_b, k_stride_s,
                    k_stride_d, v_stride_b, v_stride_s, v_stride_d, num_blocks, qk_scale,
                    MASKED, BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_SIZE, DOT_FP32, IDS_MODE, SAME_KV,
                    LOWER,
                )
        else:
            for start in tl.range(kv_start, kv_end, BLOCK_N, num_stages=NUM_STAGES):
                acc, m_i, l_i, _ = _attend_tile(
                    acc, m_i, l_i, next_ids, q, row_lo, row_hi, start, kv_lo, kv_cap,
                    table_row_ptr, table_stride_c, k_base, v_base, k_stride_b, k_stride_s,
                    k_stride_d, v_stride_b, v_stride_s, v_stride_d, num_blocks, qk_scale,
                    MASKED, BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_SIZE, DOT_FP32, IDS_MODE, SAME_KV,
                    LOWER,
                )
        return acc, m_i, l_i

    @triton.jit
    def attend_segments(
        acc,
        m_i,
        l_i,
        q,
        row_lo,
        row_hi,
        kv_start,
        kv_end,
        kv_lo,
        full_lo,
        full_hi,
        kv_cap,
        table_row_ptr,
        table_stride_c,
        k_base,
        v_base,
        k_stride_b,
        k_stride_s,
        k_stride_d,
        v_stride_b,
        v_stride_s,
        v_stride_d,
        num_blocks,
        qk_scale,
        HAS_WINDOW: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        DOT_FP32: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        IDS_MODE: tl.constexpr,
        SAME_KV: tl.constexpr,
    ):
        """Keys ``[max(kv_start, kv_lo), kv_end)`` (``kv_start`` a multiple of ``BLOCK_N``) in
        three runs:
        masked tiles before ``full_lo`` (the window's edge), unmasked tiles inside
        ``[full_lo, full_hi)`` (seen by every row), masked tiles after (the causal diagonal).
        ``SAME_KV``: as in :func:`attend_tiles`."""
        a1 = kv_start
        if HAS_WINDOW:
            a1 = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, kv_start), kv_end)
            acc, m_i, l_i = attend_tiles(
                acc, m_i, l_i, q, row_lo, row_hi, kv_start, a1, kv_lo, kv_cap, table_row_ptr,
                table_stride_c, k_base, v_base, k_stride_b, k_stride_s, k_stride_d, v_stride_b,
                v_stride_s, v_stride_d, num_blocks, qk_scale, True, BLOCK_N, BLOCK_D, HEAD_DIM,
                BLOCK_SIZE, DOT_FP32, NUM_STAGES, IDS_MODE, SAME_KV, HAS_WINDOW,
            )
        b1 = tl.maximum(tl.minimum((full_hi // BLOCK_N) * BLOCK_N, kv_end), a1)
        acc, m_i, l_i = attend_tiles(
            acc, m_i, l_i, q, row_lo, row_hi, a1, b1, kv_lo, kv_cap, table_row_ptr, table_stride_c,
            k_base, v_base, k_stride_b, k_stride_s, k_stride_d, v_stride_b, v_stride_s,
            v_stride_d, num_blocks, qk_scale, False, BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_SIZE,
            DOT_FP32, NUM_STAGES, IDS_MODE, SAME_KV, HAS_WINDOW,
        )
        acc, m_i, l_i = attend_tiles(
            acc, m_i, l_i, q, row_lo, row_hi, b1, kv_end, kv_lo, kv_cap, table_row_ptr,
            table_stride_c, k_base, v_base, k_stride_b, k_stride_s, k_stride_d, v_stride_b,
            v_stride_s, v_stride_d, num_blocks, qk_scale, True, BLOCK_N, BLOCK_D, HEAD_DIM,
            BLOCK_SIZE, DOT_FP32, NUM_STAGES, IDS_MODE, SAME_KV, HAS_WINDOW,
        )
        return acc, m_i, l_i

    @triton.jit
    def store_rows(
        out_ptr,
        lse_ptr,
        acc,
        m_i,
        l_i,
        tokens,
        heads,
        row_ok,
        out_stride_t,
        out_stride_h,
        out_stride_d,
        lse_stride_t,
        lse_stride_h,
        BLOCK_D: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HAS_LSE: tl.constexpr,
    ):
        """Normalize and store rows; a row that saw no key gets zeros and LSE ``-inf``."""
        d = tl.arange(0, BLOCK_D)
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        tokens = tokens.to(tl.int64)
        mask = row_ok[:, None]
        if HEAD_DIM != BLOCK_D:
            mask = mask & (d[None, :] < HEAD_DIM)
        tl.store(
            out_ptr
            + tokens[:, None] * out_stride_t
            + heads[:, None] * out_stride_h
            + d[None, :] * out_stride_d,
            o.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
        if HAS_LSE:
            lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN_2, float("-inf"))
            tl.store(lse_ptr + tokens * lse_stride_t + heads * lse_stride_h, lse, mask=row_ok)

    @triton.jit
    def zero_rows(
        out_ptr,
        lse_ptr,
        tokens,
        heads,
        row_ok,
        out_stride_t,
        out_stride_h,
        out_stride_d,
        lse_stride_t,
        lse_stride_h,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HAS_LSE: tl.constexpr,
    ):
        """Zeros (and LSE ``-inf``) for pad tokens."""
        zero = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        store_rows(
            out_ptr, lse_ptr, zero, m_i, m_i, tokens, heads, row_ok, out_stride_t, out_stride_h,
            out_stride_d, lse_stride_t, lse_stride_h, BLOCK_D, HEAD_DIM, HAS_LSE,
        )
