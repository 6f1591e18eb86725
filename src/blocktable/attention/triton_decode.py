"""The decode kernels: requests of at most ``BLOCK_Q`` query tokens, KV split over programs.

One program per (request, KV head, split) holds all of the request's query tokens and the
query heads of its KV head in one ``BLOCK_M``-row tile (decode: one token, the GQA group), and
walks its share of the request's visible keys through the block table. With one split it
writes the output directly; with more (flash-decoding) each split writes its normalized
partial output and log2-sum-exp into a workspace, and the last split of each (request, KV
head) to finish merges them (an atomic counter; or, for grids too large for the fused
combine, :func:`combine_kernel` in a second launch) and produces the log-sum-exp. The split
count is a runtime argument: changing it never recompiles. Requests longer than ``BLOCK_Q``
are left to the prefill kernel.
"""

from __future__ import annotations

import functools

import torch

from blocktable._triton import HAS_TRITON, tl, triton
from blocktable.attention.kernel_config import DECODE_LONG_SPLIT_KEYS, FUSED_COMBINE_MAX_PROGRAMS
from blocktable.attention.triton_tiles import (
    LN_2,
    attend_segments,
    local_len,
    store_rows,
    zero_rows,
)

DECODE_DYNAMIC_ARGS = (
    "window", "num_reqs", "num_tokens", "num_splits", "max_splits", "num_blocks", "num_rows",
    "width", "cp_world", "cp_rank", "cp_interleave", "cp_block",
)
COMBINE_DYNAMIC_ARGS = ("num_splits", "max_splits")

if HAS_TRITON:
    _LN_2 = tl.constexpr(LN_2)

    @triton.jit
    def merge_splits(
        out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, slot, token, kv_head, num_heads, num_splits,
        max_splits, out_stride_t, out_stride_h, out_stride_d, lse_stride_t, lse_stride_h,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_LSE: tl.constexpr,
    ):
        """Merge the ``num_splits`` partials of workspace row ``slot`` for the ``GROUP`` query
        heads of ``kv_head`` and store the output (and LSE) of ``token``. Each step loads
        ``SPLITS_PAD`` splits of every head at once (``[GROUP_PAD, SPLITS_PAD, BLOCK_D]``), the
        LSEs and the partial outputs independently of each other: one round trip to L2 per
        step."""
        g = tl.arange(0, GROUP_PAD)
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        head_ok = g < GROUP
        base = (slot.to(tl.int64) * num_heads + heads) * max_splits  # [GROUP_PAD]
        m_h = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
        l_h = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
        for c in range(0, num_splits, SPLITS_PAD):
            ok = head_ok[:, None] & (c + sp < num_splits)[None, :]  # [GROUP_PAD, SPLITS_PAD]
            at = base[:, None] + c + sp[None, :]
            # .cg: from L2, where the other programs' partials are (never a stale L1 line).
            lse_s = tl.load(part_lse_ptr + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o_s = tl.load(
                part_o_ptr + at[:, :, None] * BLOCK_D + d[None, None, :],
                mask=ok[:, :, None],
                other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.maximum(m_h, tl.max(lse_s, 1))
            w = tl.exp2(lse_s - m_new[:, None])  # 0 for splits that saw no key
            alpha = tl.exp2(m_h - m_new)
            l_h = l_h * alpha + tl.sum(w, 1)
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 1)
            m_h = m_new
        tokens = token + g * 0
        store_rows(
            out_ptr, lse_ptr, acc, m_h, l_h, tokens, heads, head_ok, out_stride_t, out_stride_h,
            out_stride_d, lse_stride_t, lse_stride_h, BLOCK_D, HEAD_DIM, HAS_LSE,
        )

    def _decode_kernel(
        out_ptr,  # [num_tokens, num_heads, head_dim]
        lse_ptr,  # float32 [num_tokens, num_heads] (when HAS_LSE)
        part_o_ptr,  # float32 [num_reqs * SLOTS, num_heads, max_splits, BLOCK_D] (when SPLIT)
        part_lse_ptr,  # float32 [num_reqs * SLOTS, num_heads, max_splits], log2 domain
        counter_ptr,  # int32 [num_reqs * num_kv_heads], zero between calls (FUSED_COMBINE)
        query_ptr,
        k_cache_ptr,
        v_cache_ptr,
        table_ptr,
        seq_lens_ptr,
        qsl_ptr,  # int32 [num_reqs + 1] (when HAS_QSL; else token r is request r's query)
        row_of_batch_ptr,
        qk_scale,
        window,
        num_reqs,
        num_tokens,
        num_splits,
        max_splits,
        num_blocks,
        num_rows,
        width,
        cp_world,
        cp_rank,
        cp_interleave,
        cp_block,
        out_stride_t, out_stride_h, out_stride_d,
        lse_stride_t, lse_stride_h,
        q_stride_t, q_stride_h, q_stride_d,
        k_stride_b, k_stride_s, k_stride_h, k_stride_d,
        v_stride_b, v_stride_s, v_stride_h, v_stride_d,
        table_stride_r, table_stride_c,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        SLOTS: tl.constexpr,  # workspace rows per request: BLOCK_Q, or 1 without qsl
        PAD_ITERS: tl.constexpr,  # pad tokens zeroed per extra program, in BLOCK_Q steps
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HAS_QSL: tl.constexpr,
        INDEXED: tl.constexpr,
        HAS_CP: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_LSE: tl.constexpr,
        SPLIT: tl.constexpr,
        DOT_FP32: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        IDS_MODE: tl.constexpr,  # how tiles read block ids (attend_tiles)
        FUSED_COMBINE: tl.constexpr,  # the last split to finish merges (no combine launch)
        SPLITS_PAD: tl.constexpr,  # splits merged per load (when FUSED_COMBINE)
        SAME_KV: tl.constexpr,  # V laid out like K (with the fused combine only)
        DTYPE: tl.constexpr,
    ):
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        rows = tl.arange(0, BLOCK_M)
        qi = rows // GROUP_PAD
        g = rows % GROUP_PAD
        heads = kv_head * GROUP + g
        head_ok = (g < GROUP) & (qi < BLOCK_Q)
        # Issued before the query range is known, so that the two loads overlap (extra programs
        # read nothing).
        is_req = req < num_reqs
        seq_len = tl.load(seq_lens_ptr + req, mask=is_req, other=0)
        row = req
        if INDEXED:
            row = tl.load(row_of_batch_ptr + req, mask=is_req, other=0)
        if HAS_QSL:
            if req >= num_reqs:  # extra programs: zero PAD_ITERS * BLOCK_Q tokens each
                if split == 0:
                    first_pad = tl.load(qsl_ptr + num_reqs)
                    base = (req - num_reqs) * (PAD_ITERS * BLOCK_Q)
                    for it in range(PAD_ITERS):
                        tokens = base + it * BLOCK_Q + qi
                        pad = head_ok & (tokens >= first_pad) & (tokens < num_tokens)
                        zero_rows(
                            out_ptr, lse_ptr, tokens, heads, pad, out_stride_t, out_stride_h,
                            out_stride_d, lse_stride_t, lse_stride_h, BLOCK_M, BLOCK_D,
                            HEAD_DIM, HAS_LSE,
                        )
                return
            q_start = tl.load(qsl_ptr + req)
            query_len = tl.load(qsl_ptr + req + 1) - q_start
            if query_len > BLOCK_Q:
                return
        else:
            q_start = req
            query_len = 1

        row_ok = (row >= 0) & (row < num_rows)
        row = tl.where(row_ok, row, 0)
        kv_cap = tl.minimum(
            local_len(seq_len, cp_world, cp_rank, cp_interleave, cp_block, HAS_CP),
            width * BLOCK_SIZE,
        )
        kv_cap = tl.where(row_ok, kv_cap, 0)

        row_valid = (qi < query_len) & head_ok
        q_pos = seq_len - query_len + qi
        row_hi = tl.minimum(
            local_len(q_pos + 1, cp_world, cp_rank, cp_interleave, cp_block, HAS_CP), kv_cap
        )
        row_hi = tl.where(row_valid, row_hi, 0)
        q_min = seq_len - query_len
        full_hi = tl.minimum(
            local_len(q_min + 1, cp_world, cp_rank, cp_interleave, cp_block, HAS_CP), kv_cap
        )
        if HAS_WINDOW:
            row_lo = local_len(q_pos - window + 1, cp_world, cp_rank, cp_interleave, cp_block,
                               HAS_CP)
            kv_lo = local_len(q_min - window + 1, cp_world, cp_rank, cp_interleave, cp_block,
                              HAS_CP)
            full_lo = local_len(seq_len - window, cp_world, cp_rank, cp_interleave, cp_block,
                                HAS_CP)
        else:
            row_lo = qi * 0
            kv_lo = 0
            full_lo = 0
        # This split's share of the key tiles [kv_lo, kv_cap).
        kv_start = (kv_lo // BLOCK_N) * BLOCK_N
        kv_end = kv_cap
        if SPLIT:
            tiles_per_split = tl.cdiv(tl.cdiv(kv_cap - kv_start, BLOCK_N), num_splits)
            kv_start = kv_start + split * tiles_per_split * BLOCK_N
            kv_end = tl.minimum(kv_start + tiles_per_split * BLOCK_N, kv_cap)

        tokens = q_start + qi
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
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = attend_segments(
            acc, m_i, l_i, q, row_lo, row_hi, kv_start, kv_end, kv_lo, full_lo, full_hi,
            kv_cap, table_ptr + row.to(tl.int64) * table_stride_r, table_stride_c,
            k_cache_ptr + kv_head * k_stride_h, v_cache_ptr + kv_head * v_stride_h,
            k_stride_b, k_stride_s, k_stride_d, v_stride_b, v_stride_s, v_stride_d,
            num_blocks, qk_scale, HAS_WINDOW, BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_SIZE,
            DOT_FP32, NUM_STAGES, IDS_MODE, SAME_KV,
        )
        if SPLIT:
            num_heads = tl.num_programs(1) * GROUP
            slot = req * SLOTS + qi
            part = (slot.to(tl.int64) * num_heads + heads) * max_splits + split
            seen = l_i > 0
            lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse2, mask=row_valid)
            tl.store(
                part_o_ptr + part[:, None] * BLOCK_D + d[None, :],
                acc / tl.where(seen, l_i, 1.0)[:, None],
                mask=row_valid[:, None],
            )
            if FUSED_COMBINE:
                # Every thread's partials are written before one release-add counts this split;
                # the split that counts last (acquire) merges them and re-arms the counter.
                tl.debug_barrier()
                counter = counter_ptr + req * tl.num_programs(1) + kv_head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == num_splits - 1:
                    for i in tl.static_range(SLOTS):
                        if i < query_len:
                            merge_splits(
                                out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, req * SLOTS + i,
                                q_start + i, kv_head, num_heads, num_splits, max_splits,
                                out_stride_t, out_stride_h, out_stride_d, lse_stride_t,
                                lse_stride_h, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, SPLITS_PAD,
                                HAS_LSE,
                            )
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        else:
            store_rows(
                out_ptr, lse_ptr, acc, m_i, l_i, tokens, heads, row_valid, out_stride_t,
                out_stride_h, out_stride_d, lse_stride_t, lse_stride_h, BLOCK_D, HEAD_DIM,
                HAS_LSE,
            )

    @triton.jit(do_not_specialize=list(COMBINE_DYNAMIC_ARGS),
                do_not_specialize_on_alignment=["out_ptr", "lse_ptr", "qsl_ptr"])
    def combine_kernel(
        out_ptr,
        lse_ptr,
        part_o_ptr,
        part_lse_ptr,
        qsl_ptr,
        num_splits,
        max_splits,
        out_stride_t, out_stride_h, out_stride_d,
        lse_stride_t, lse_stride_h,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        SLOTS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_QSL: tl.constexpr,
        HAS_LSE: tl.constexpr,
        SPLITS_PAD: tl.constexpr,  # splits of every head merged per load
        DTYPE: tl.constexpr,
    ):
        # One program per (workspace row, KV head): merge the splits of GROUP query heads.
        slot = tl.program_id(0)
        kv_head = tl.program_id(1)
        req = slot // SLOTS
        i = slot % SLOTS
        if HAS_QSL:
            q_start = tl.load(qsl_ptr + req)
            query_len = tl.load(qsl_ptr + req + 1) - q_start
            if query_len > BLOCK_Q:
                return
        else:
            q_start = req
            query_len = 1
        if i >= query_len:
            return
        merge_splits(
            out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, slot, q_start + i, kv_head,
            tl.num_programs(1) * GROUP, num_splits, max_splits, out_stride_t, out_stride_h,
            out_stride_d, lse_stride_t, lse_stride_h, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D,
            SPLITS_PAD, HAS_LSE,
        )

    _UNALIGNED = [
        "lse_ptr", "table_ptr", "seq_lens_ptr", "qsl_ptr", "row_of_batch_ptr", "part_o_ptr",
        "part_lse_ptr", "counter_ptr",
    ]
    decode_kernel = triton.jit(
        do_not_specialize=list(DECODE_DYNAMIC_ARGS), do_not_specialize_on_alignment=_UNALIGNED
    )(_decode_kernel)
    decode_kernel_unaligned = triton.jit(
        do_not_specialize=list(DECODE_DYNAMIC_ARGS),
        do_not_specialize_on_alignment=[
            *_UNALIGNED, "out_ptr", "query_ptr", "k_cache_ptr", "v_cache_ptr"
        ],
    )(_decode_kernel)


MAX_KV_SPLITS = 32  # more splits only add merge work (measured: BENCHMARKS.md)
MERGE_CHUNK = 16  # at most this many splits per load of the merge
MERGE_TILE_ELEMENTS = 8192  # ... and at most this many floats per load (64 a thread at 4 warps)


@functools.lru_cache(maxsize=64)
def merge_chunk(group_pad: int, block_d: int) -> int:
    """Splits per ``[group_pad, splits, block_d]`` load of the merge: a power of two."""
    return max(1, min(MERGE_CHUNK, MERGE_TILE_ELEMENTS // (group_pad * block_d)))
MIN_KEYS_PER_SPLIT = 256
FULL_WAVE = 0.9  # a grid of at least this share of two programs per multiprocessor fills it


@functools.lru_cache
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_kv_splits(
    num_reqs: int, num_kv_heads: int, width: int, device: torch.device, block_size: int = 16
) -> int:
    """Splits per request so that about two programs run per multiprocessor.

    Depends on shapes only (never on ``seq_lens``), so a captured CUDA graph stays valid: a
    power of two, at most ``MAX_KV_SPLITS`` (32), each split covering at least 256 keys of
    the widest possible row (``width * block_size``). The wanted count is rounded to the power
    of two above, or to the one below (at least 2) when that grid fills at least ``FULL_WAVE``
    of two programs per multiprocessor and its splits are short or fused: there the extra
    splits cost more merge work than the fuller grid gains, while long unfused splits and
    grids short of a wave want the splits above (the measurements are in BENCHMARKS.md).
    1 off CUDA.
    """
    if device.type != "cuda" or num_reqs == 0:
        return 1
    programs = num_reqs * num_kv_heads
    target = 2 * num_sms(device)
    wanted = -(-target // programs)
    cap = min(MAX_KV_SPLITS, max(1, width * block_size // MIN_KEYS_PER_SPLIT))
    splits = 1
    while splits < wanted and splits * 2 <= cap:
        splits *= 2
    below = splits // 2
    if splits >= wanted and below >= 2 and below * programs >= FULL_WAVE * target and (
        programs <= FUSED_COMBINE_MAX_PROGRAMS
        or width * block_size // below < DECODE_LONG_SPLIT_KEYS
    ):
        return below
    return splits
