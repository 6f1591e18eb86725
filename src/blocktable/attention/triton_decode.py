"""Triton kernels of paged decode attention, and the function that launches them.

One program per (request, KV head, split) computes all query heads of that KV head's group at
once, walking its share of the request's blocks through the block table with an online softmax
in float32. Only blocks holding visible positions (inside the sliding window and before
``seq_len``) are visited and masked positions are never loaded, so out-of-window
``NULL_BLOCK_ID`` entries and the null block's contents never reach the output.

When requests x KV heads are too few to fill the GPU, each request's blocks are split over
``num_kv_splits`` programs (flash-decoding) and a second kernel combines their partial sums.
"""

from __future__ import annotations

import functools

import torch

from blocktable._triton import HAS_TRITON, interpreting, next_power_of_2, tl, triton

if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        out_ptr,
        partial_acc_ptr,  # float32 [num_reqs, num_heads, NUM_SPLITS, BLOCK_D], if NUM_SPLITS > 1
        partial_m_ptr,  # float32 [num_reqs, num_heads, NUM_SPLITS]: running max of the scores
        partial_l_ptr,  # float32 [num_reqs, num_heads, NUM_SPLITS]: softmax denominator
        query_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_table_ptr,
        seq_lens_ptr,
        scale,
        sliding_window,  # 0: full attention
        num_blocks,
        width,
        num_heads,
        head_dim,
        out_stride_b,
        out_stride_h,
        out_stride_d,
        query_stride_b,
        query_stride_h,
        query_stride_d,
        k_cache_stride_b,
        k_cache_stride_s,
        k_cache_stride_h,
        k_cache_stride_d,
        v_cache_stride_b,
        v_cache_stride_s,
        v_cache_stride_h,
        v_cache_stride_d,
        block_table_stride_r,
        block_table_stride_c,
        GROUP_SIZE: tl.constexpr,  # query heads per KV head
        BLOCK_G: tl.constexpr,  # GROUP_SIZE padded to a power of two >= 16 (tl.dot's minimum)
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        BLOCK_D: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,  # upcast dot operands (Triton's interpreter cannot dot bf16)
        NUM_SPLITS: tl.constexpr,  # programs sharing one request's blocks (flash-decoding)
    ):
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + req)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_SIZE)
        heads = kv_head * GROUP_SIZE + g
        qo_mask = (g[:, None] < GROUP_SIZE) & (d[None, :] < head_dim)
        q = tl.load(
            query_ptr
            + req.to(tl.int64) * query_stride_b
            + heads[:, None] * query_stride_h
            + d[None, :] * query_stride_d,
            mask=qo_mask,
            other=0.0,
        )
        if DOT_IN_FP32:
            q = q.to(tl.float32)

        # Visible positions: [window_start, seq_len).
        window_start = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
        first_block = window_start // BLOCK_SIZE
        # Never read past the row, whatever seq_len says.
        end_block = tl.minimum(tl.cdiv(seq_len, BLOCK_SIZE), width)
        if NUM_SPLITS > 1:  # this program's share of the visible blocks, sized per request
            split = tl.program_id(2)
            blocks_per_split = tl.cdiv(end_block - first_block, NUM_SPLITS)
            first_block = first_block + split * blocks_per_split
            end_block = tl.minimum(first_block + blocks_per_split, end_block)

        m = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)  # finite: exp(m - m_new) is never NaN
        l = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        row_ptr = block_table_ptr + req.to(tl.int64) * block_table_stride_r
        for j in range(first_block, end_block):
            block_id = tl.load(row_ptr + j * block_table_stride_c).to(tl.int64)
            # A corrupt id outside the cache is never dereferenced: its positions count as past
            # the end. (Folded into a bound because tensor & scalar-bool breaks the interpreter.)
            pos_end = tl.where((block_id >= 0) & (block_id < num_blocks), seq_len, 0)
            pos = j * BLOCK_SIZE + n
            n_mask = (pos >= window_start) & (pos < pos_end)
            kv_mask = n_mask[None, :] & (d[:, None] < head_dim)
            k_t = tl.load(  # [BLOCK_D, BLOCK_SIZE]
                k_cache_ptr
                + block_id * k_cache_stride_b
                + n[None, :] * k_cache_stride_s
                + kv_head * k_cache_stride_h
                + d[:, None] * k_cache_stride_d,
                mask=kv_mask,
                other=0.0,
            )
            if DOT_IN_FP32:
                k_t = k_t.to(tl.float32)
            s = tl.dot(q, k_t, input_precision="ieee") * scale  # [BLOCK_G, BLOCK_SIZE], float32
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(  # [BLOCK_SIZE, BLOCK_D]
                v_cache_ptr
                + block_id * v_cache_stride_b
                + n[:, None] * v_cache_stride_s
                + kv_head * v_cache_stride_h
                + d[None, :] * v_cache_stride_d,
                mask=n_mask[:, None] & (d[None, :] < head_dim),
                other=0.0,
            )
            if DOT_IN_FP32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m = m_new

        if NUM_SPLITS == 1:
            # seq_len 0 (a pad row) visits no block: l stays 0 and the output is 0.
            out = tl.where(l[:, None] > 0, acc / tl.maximum(l, 1.0e-30)[:, None], 0.0)
            tl.store(
                out_ptr
                + req.to(tl.int64) * out_stride_b
                + heads[:, None] * out_stride_h
                + d[None, :] * out_stride_d,
                out.to(out_ptr.dtype.element_ty),
                mask=qo_mask,
            )
        else:
            partial = (req.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G]
            g_mask = g < GROUP_SIZE
            tl.store(partial_m_ptr + partial, m, mask=g_mask)
            tl.store(partial_l_ptr + partial, l, mask=g_mask)
            tl.store(
                partial_acc_ptr + partial[:, None] * BLOCK_D + d[None, :], acc, mask=g_mask[:, None]
            )

    @triton.jit
    def _combine_splits_kernel(
        out_ptr,
        partial_acc_ptr,
        partial_m_ptr,
        partial_l_ptr,
        head_dim,
        out_stride_b,
        out_stride_h,
        out_stride_d,
        NUM_SPLITS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per (request, query head): rescale each split's sums to the common max.
        req = tl.program_id(0)
        head = tl.program_id(1)
        first = (req.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
        s = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, BLOCK_D)
        m = tl.load(partial_m_ptr + first + s)
        l = tl.load(partial_l_ptr + first + s)
        acc = tl.load(partial_acc_ptr + (first + s)[:, None] * BLOCK_D + d[None, :])
        weight = tl.exp(m - tl.max(m, axis=0))  # empty splits: m = -1e30, l = 0, acc = 0
        l_sum = tl.sum(l * weight, axis=0)
        out = tl.sum(acc * weight[:, None], axis=0) / tl.maximum(l_sum, 1.0e-30)
        tl.store(
            out_ptr + req.to(tl.int64) * out_stride_b + head * out_stride_h + d * out_stride_d,
            out.to(out_ptr.dtype.element_ty),
            mask=d < head_dim,
        )


MAX_KV_SPLITS = 64


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_kv_splits(
    num_reqs: int, num_kv_heads: int, width: int, device: torch.device
) -> int:
    """Splits per request so that about two programs run per multiprocessor.

    Depends on shapes only (never on ``seq_lens``), so a captured CUDA graph stays valid. A
    split gets at least 8 blocks of the widest possible row. 1 off CUDA.
    """
    if device.type != "cuda":
        return 1
    programs = num_reqs * num_kv_heads
    wanted = -(-2 * _num_sms(device) // programs)
    cap = min(MAX_KV_SPLITS, max(1, width // 8))
    splits = 1
    while splits < wanted and splits * 2 <= cap:
        splits *= 2
    return splits


def launch_paged_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_kv_splits: int,
) -> None:
    """Launch the decode kernel(s) on checked inputs (see :func:`paged_decode_attention`)."""
    num_reqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    block_d = max(16, next_power_of_2(head_dim))
    if num_kv_splits > 1:
        partial_acc = torch.empty(
            (num_reqs, num_heads, num_kv_splits, block_d), dtype=torch.float32, device=query.device
        )
        partial_m = torch.empty(partial_acc.shape[:3], dtype=torch.float32, device=query.device)
        partial_l = torch.empty_like(partial_m)
    else:
        partial_acc = partial_m = partial_l = out  # not touched
    _paged_decode_kernel[(num_reqs, num_kv_heads, num_kv_splits)](
        out,
        partial_acc,
        partial_m,
        partial_l,
        query,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        scale,
        sliding_window or 0,
        num_blocks,
        block_table.shape[1],
        num_heads,
        head_dim,
        *out.stride(),
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_table.stride(),
        GROUP_SIZE=group_size,
        BLOCK_G=max(16, next_power_of_2(group_size)),
        BLOCK_SIZE=block_size,
        BLOCK_D=block_d,
        DOT_IN_FP32=query.dtype == torch.bfloat16 and interpreting(),
        NUM_SPLITS=num_kv_splits,
    )
    if num_kv_splits > 1:
        _combine_splits_kernel[(num_reqs, num_heads)](
            out,
            partial_acc,
            partial_m,
            partial_l,
            head_dim,
            *out.stride(),
            NUM_SPLITS=num_kv_splits,
            BLOCK_D=block_d,
        )
