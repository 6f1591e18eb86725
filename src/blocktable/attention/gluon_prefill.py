"""The prefill kernel in Gluon for Hopper (sm_90): warpgroup MMA (wgmma) on tiles that
``cp.async`` gathers from the paged cache into swizzled shared memory, several stages deep.

It computes what :mod:`blocktable.attention.triton_prefill` computes, on the same grid and
with the same request search (``(cdiv(num_tokens, BLOCK_Q) + num_reqs, num_kv_heads)``
programs, run in reverse tile order; a program's ``BLOCK_M`` rows are ``BLOCK_Q`` query
tokens times the padded GQA group of one KV head), for the cases it supports: float16 or
bfloat16, a power-of-two head size from 16 to 128, no context parallelism and no sliding
window (:func:`supports` says which; everything else stays on the Triton kernel). The keys
of a tile are gathered through the block table one key at a time, so any kernel block size
works. Tiles whose keys every row of the tile sees skip the causal mask.

Gluon ships with Triton 3.6 and later (``triton.experimental.gluon``); without it this
module imports and :data:`HAS_GLUON` is false.
"""

from __future__ import annotations

from blocktable._triton import HAS_TRITON

HAS_GLUON = False
if HAS_TRITON:  # pragma: no cover - depends on the installed Triton
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            async_copy,
            fence_async_shared,
            warpgroup_mma,
            warpgroup_mma_init,
            warpgroup_mma_wait,
        )

        # Names that later Tritons changed (3.6 on the GPU machine; CI compiles with newer).
        _async_load = getattr(async_copy, "async_load", None) or (
            async_copy.async_copy_global_to_shared
        )
        _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
        HAS_GLUON = True
    except (ImportError, AttributeError):
        pass

GLUON_DTYPES = ("fp16", "bf16")
# Arguments that change from step to step: never a new compilation.
GLUON_DYNAMIC_ARGS = (
    "num_reqs", "num_tokens", "short_query_len", "num_blocks", "num_rows", "width",
    "search_stride",
)
GLUON_HEAD_DIMS = (16, 32, 64, 128)
LOG2_E = 1.4426950408889634
_LN_2 = 0.6931471805599453


def supports(dtype_name: str, head_dim: int, cp_world: int, window: int) -> str | None:
    """``None`` when the Gluon kernel serves these inputs, else the reason it does not."""
    if not HAS_GLUON:
        return "triton.experimental.gluon is not available (Triton >= 3.6 needed)"
    if dtype_name not in GLUON_DTYPES:
        return f"dtype {dtype_name} (the Gluon kernel takes {GLUON_DTYPES})"
    if head_dim not in GLUON_HEAD_DIMS:
        return f"head_dim {head_dim} (the Gluon kernel takes {GLUON_HEAD_DIMS})"
    if cp_world > 1:
        return "context parallelism (the Gluon kernel reads unsharded rows)"
    if window > 0:
        return "a sliding window"
    return None


if HAS_GLUON:  # pragma: no cover - compiled for the GPU only
    _LN_2_C = gl.constexpr(_LN_2)

    @gluon.constexpr_function
    def _rows_layout(width, num_warps):
        """Blocked layout of ``[rows, width]`` tiles: 16-byte vectors along the head."""
        vec = min(8, width)
        cols = max(1, min(32, width // vec))
        return gl.BlockedLayout([1, vec], [32 // cols, cols], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def _mma_layout(n, num_warps):
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16]
        )

    @gluon.constexpr_function
    def _smem_layout(rows, width, bitwidth):
        return gl.NVMMASharedLayout.get_default_for(
            [rows, width], gl.float16 if bitwidth == 16 else gl.float32
        )

    @gluon.jit
    def _issue_kv(
        k_smem, v_smem, stage, start, kv_end, table_row_ptr, table_stride_c, k_base, v_base,
        num_blocks, k_stride_b, k_stride_s, v_stride_b, v_stride_s,
        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        LD: gl.constexpr,
    ):
        """Start the copy of keys ``[start, start + BLOCK_N)`` (and their values) into
        ``stage``; keys past ``kv_end`` or in a block id outside ``[0, num_blocks)`` are
        zero-filled, never read."""
        t = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
        in_row = t < kv_end
        ids = gl.load(table_row_ptr + (t // BLOCK_SIZE) * table_stride_c, mask=in_row, other=0)
        ok = in_row & (ids >= 0) & (ids < num_blocks)
        ids = gl.where(ok, ids, 0).to(gl.int64)
        slot = t % BLOCK_SIZE
        mask = gl.expand_dims(ok, 1)  # constant along the head: 16-byte copies
        k_ptrs = k_base + gl.expand_dims(ids * k_stride_b + slot * k_stride_s, 1) \
            + gl.expand_dims(d, 0)
        v_ptrs = v_base + gl.expand_dims(ids * v_stride_b + slot * v_stride_s, 1) \
            + gl.expand_dims(d, 0)
        _async_load(k_smem.index(stage), k_ptrs, mask=mask)
        _async_load(v_smem.index(stage), v_ptrs, mask=mask)

    @gluon.jit
    def _attend(
        acc, m_i, l_i, q_smem, k_smem, v_smem, lo, hi, kv_end, row_hi, it,
        table_row_ptr, table_stride_c, k_base, v_base, num_blocks,
        k_stride_b, k_stride_s, v_stride_b, v_stride_s, qk_scale,
        MASKED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr,
        LD: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
        n_tiles_total,
    ):
        """Online softmax over key tiles ``[lo, hi)`` (``it`` counts tiles from the first
        of the program, whose copies were started ``NUM_STAGES - 1`` tiles ahead)."""
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=O_LAYOUT, k_width=2
        )
        dtype: gl.constexpr = q_smem.dtype
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        for start in range(lo, hi, BLOCK_N):
            stage = it % NUM_STAGES
            async_copy.wait_group(NUM_STAGES - 2)
            fence_async_shared()
            _cta_barrier()  # every warp's copies landed; every warp left the tile before
            nxt = it + NUM_STAGES - 1
            if nxt < n_tiles_total:
                _issue_kv(
                    k_smem, v_smem, nxt % NUM_STAGES, nxt * BLOCK_N, kv_end, table_row_ptr,
                    table_stride_c, k_base, v_base, num_blocks, k_stride_b, k_stride_s,
                    v_stride_b, v_stride_s, BLOCK_N, HEAD_DIM,
                    BLOCK_SIZE, LD,
                )
            async_copy.commit_group()
            k_tile = k_smem.index(stage)
            s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
            s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = s * qk_scale
            if MASKED:
                visible = gl.expand_dims(start + cols, 0) < gl.expand_dims(row_hi, 1)
                s = gl.where(visible, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))
            acc = acc * gl.expand_dims(alpha_o, 1)
            p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
            acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            it += 1
        return acc, m_i, l_i, it

    @gluon.jit
    def _attend_pipelined(
        q_smem, k_smem, v_smem, n_tiles, full_hi, kv_end, row_hi,
        table_row_ptr, table_stride_c, k_base, v_base, num_blocks,
        k_stride_b, k_stride_s, v_stride_b, v_stride_s, qk_scale,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, LD: gl.constexpr,
        S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
    ):
        """Online softmax over the program's ``n_tiles`` key tiles, the scores of tile
        ``i + 1`` and the ``P @ V`` product of tile ``i`` in flight on the tensor cores while
        the softmax of tile ``i + 1`` runs; the causal mask only on tiles past ``full_hi``.
        Needs ``NUM_STAGES >= 3`` (the copies of tiles ``0 .. NUM_STAGES - 2`` started)."""
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=O_LAYOUT, k_width=2
        )
        dtype: gl.constexpr = q_smem.dtype
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, O_LAYOUT)
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, gl.SliceLayout(1, S_LAYOUT))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
        acc = warpgroup_mma_init(acc)  # the loop carries it in flight
        # P (in registers) of the P @ V product in flight. A wgmma reads its register operands
        # until the wait that retires it, so P is named in that wait's deps: registers the
        # allocator sees dead after the wgmma get reused (without this, the next tile's mask
        # and row max overwrote P in the sm_90 SASS while the tensor cores still read it).
        p_op = gl.zeros([BLOCK_M, BLOCK_N], dtype, P_LAYOUT)

        async_copy.wait_group(NUM_STAGES - 2)  # tile 0
        fence_async_shared()
        _cta_barrier()
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        for i in range(n_tiles):
            start = i * BLOCK_N
            if start + BLOCK_N > full_hi:  # a row of the tile misses some of its keys
                visible = gl.expand_dims(start + cols, 0) < gl.expand_dims(row_hi, 1)
                s = gl.where(visible, s, float("-inf"))
            # Scaled once per row, not per score: exp2(s * scale - m) is one FMA per score.
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            # P @ V of tile i - 1 retires; only then is tile i's P packed into registers.
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))
            acc = acc * gl.expand_dims(alpha_o, 1)
            # Tile i + 1 landed (tiles up to i + NUM_STAGES - 2 are committed); every warp
            # is done with tile i - 1, whose stage the copy of tile i + NUM_STAGES - 1 takes.
            async_copy.wait_group(NUM_STAGES - 3)
            fence_async_shared()
            _cta_barrier()
            nxt = i + NUM_STAGES - 1
            if nxt < n_tiles:
                _issue_kv(
                    k_smem, v_smem, nxt % NUM_STAGES, nxt * BLOCK_N, kv_end, table_row_ptr,
                    table_stride_c, k_base, v_base, num_blocks, k_stride_b, k_stride_s,
                    v_stride_b, v_stride_s, BLOCK_N, HEAD_DIM, BLOCK_SIZE, LD,
                )
            async_copy.commit_group()
            # (Past the last tile this multiplies a stale stage; its scores are never used.)
            s_next = warpgroup_mma(q_smem, k_smem.index((i + 1) % NUM_STAGES).permute((1, 0)),
                                   zero_s, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index(i % NUM_STAGES), acc, is_async=True)
            s, p_op = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, p_op))
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        return acc, m_i, l_i

    @gluon.jit(do_not_specialize=list(GLUON_DYNAMIC_ARGS))
    def gluon_prefill_kernel(
        out_ptr, lse_ptr, query_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_lens_ptr,
        qsl_ptr, row_of_batch_ptr, qk_scale, num_reqs, num_tokens, short_query_len,
        num_blocks, num_rows, width, search_stride,
        out_stride_t, out_stride_h,
        lse_stride_t, lse_stride_h,
        q_stride_t, q_stride_h,
        k_stride_b, k_stride_s, k_stride_h,
        v_stride_b, v_stride_s, v_stride_h,
        table_stride_r, table_stride_c,
        GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_SIZE: gl.constexpr, RADIX: gl.constexpr, INDEXED: gl.constexpr,
        HAS_LSE: gl.constexpr, NUM_STAGES: gl.constexpr, PIPELINED: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        LD: gl.constexpr = _rows_layout(HEAD_DIM, num_warps)
        S_LAYOUT: gl.constexpr = _mma_layout(BLOCK_N, num_warps)
        O_LAYOUT: gl.constexpr = _mma_layout(HEAD_DIM, num_warps)
        dtype: gl.constexpr = query_ptr.dtype.element_ty
        Q_SMEM: gl.constexpr = _smem_layout(BLOCK_M, HEAD_DIM, 16)
        KV_SMEM: gl.constexpr = _smem_layout(BLOCK_N, HEAD_DIM, 16)

        tile = gl.num_programs(0) - 1 - gl.program_id(0)
        kv_head = gl.program_id(1)

        # The request: the largest r <= num_reqs with qsl[r] // BLOCK_Q + r <= tile.
        lanes = gl.arange(0, RADIX, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        req = tile * 0
        stride = search_stride
        while stride > 0:
            cand = req + lanes * stride
            ok = cand <= num_reqs
            first = gl.load(qsl_ptr + cand, mask=ok, other=0) // BLOCK_Q + cand
            hits = gl.sum((ok & (first <= tile)).to(gl.int32), 0)
            req = req + (hits - 1) * stride
            stride = stride // RADIX
        real = req < num_reqs
        q_start = gl.load(qsl_ptr + req)
        q_end = gl.load(qsl_ptr + req + 1, mask=real, other=0)
        seq_len = gl.load(seq_lens_ptr + req, mask=real, other=0)
        row = req
        if INDEXED:
            row = gl.load(row_of_batch_ptr + req, mask=real, other=0)

        rows_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
        d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
        g_o = rows_o % GROUP_PAD
        heads_o = kv_head * GROUP + g_o
        if req == num_reqs:  # past the last request: zero the pad tokens of this tile
            tokens = (tile - num_reqs) * BLOCK_Q + rows_o // GROUP_PAD
            pad = (g_o < GROUP) & (tokens >= q_start) & (tokens < num_tokens)
            tok64 = tokens.to(gl.int64)
            o_ptrs = out_ptr + gl.expand_dims(tok64 * out_stride_t + heads_o * out_stride_h, 1) \
                + gl.expand_dims(d_o, 0)
            zero = gl.zeros([BLOCK_M, HEAD_DIM], dtype, LD)
            gl.store(o_ptrs, zero, mask=gl.expand_dims(pad, 1) & gl.expand_dims(d_o >= 0, 0))
            if HAS_LSE:
                gl.store(lse_ptr + tok64 * lse_stride_t + heads_o * lse_stride_h,
                         gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, LD)),
                         mask=pad)
            return
        query_len = q_end - q_start
        j = tile - q_start // BLOCK_Q - req  # the tile's index in its request
        if query_len <= short_query_len or j * BLOCK_Q >= query_len:
            return
        row_ok = (row >= 0) & (row < num_rows)
        row = gl.where(row_ok, row, 0)
        kv_cap = gl.minimum(seq_len, width * BLOCK_SIZE)  # never past the row
        kv_cap = gl.where(row_ok, kv_cap, 0)
        i0 = j * BLOCK_Q
        prefix = seq_len - query_len
        # Keys every row sees (unmasked tiles) and keys any row sees.
        full_hi = gl.minimum(prefix + i0 + 1, kv_cap)
        kv_end = gl.minimum(prefix + gl.minimum(i0 + BLOCK_Q, query_len), kv_cap)
        n_full = full_hi // BLOCK_N
        n_tiles = gl.cdiv(kv_end, BLOCK_N)

        # The query tile into shared memory (rows: token, then head of the group).
        tok_i_o = i0 + rows_o // GROUP_PAD
        valid_o = (tok_i_o < query_len) & (g_o < GROUP)
        tokens_o = (q_start + tok_i_o).to(gl.int64)
        q_ptrs = query_ptr + gl.expand_dims(tokens_o * q_stride_t + heads_o * q_stride_h, 1) \
            + gl.expand_dims(d_o, 0)
        io_mask = gl.expand_dims(valid_o, 1) & gl.expand_dims(d_o >= 0, 0)
        q = gl.load(q_ptrs, mask=io_mask, other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], Q_SMEM, q)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_SMEM)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_SMEM)

        table_row_ptr = table_ptr + row.to(gl.int64) * table_stride_r
        k_base = k_cache_ptr + kv_head * k_stride_h
        v_base = v_cache_ptr + kv_head * v_stride_h
        for s in gl.static_range(NUM_STAGES - 1):
            if s < n_tiles:
                _issue_kv(
                    k_smem, v_smem, s, s * BLOCK_N, kv_end, table_row_ptr, table_stride_c,
                    k_base, v_base, num_blocks, k_stride_b, k_stride_s,
                    v_stride_b, v_stride_s, BLOCK_N, HEAD_DIM, BLOCK_SIZE, LD,
                )
            async_copy.commit_group()

        # The rows' own causal bound, in the score layout.
        rows_s = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_LAYOUT))
        tok_i_s = i0 + rows_s // GROUP_PAD
        valid_s = (tok_i_s < query_len) & (rows_s % GROUP_PAD < GROUP)
        row_hi = gl.where(valid_s, gl.minimum(prefix + tok_i_s + 1, kv_cap), 0)

        if PIPELINED:
            acc, m_i, l_i = _attend_pipelined(
                q_smem, k_smem, v_smem, n_tiles, full_hi, kv_end, row_hi, table_row_ptr,
                table_stride_c, k_base, v_base, num_blocks, k_stride_b, k_stride_s,
                v_stride_b, v_stride_s, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_SIZE,
                NUM_STAGES, LD, S_LAYOUT, O_LAYOUT,
            )
        else:
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, O_LAYOUT)
            m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, gl.SliceLayout(1, S_LAYOUT))
            l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
            it = 0
            acc, m_i, l_i, it = _attend(
                acc, m_i, l_i, q_smem, k_smem, v_smem, 0, n_full * BLOCK_N, kv_end, row_hi, it,
                table_row_ptr, table_stride_c, k_base, v_base, num_blocks,
                k_stride_b, k_stride_s, v_stride_b, v_stride_s, qk_scale,
                False, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_SIZE, NUM_STAGES, LD, S_LAYOUT,
                O_LAYOUT, n_tiles,
            )
            acc, m_i, l_i, it = _attend(
                acc, m_i, l_i, q_smem, k_smem, v_smem, n_full * BLOCK_N, n_tiles * BLOCK_N,
                kv_end, row_hi, it, table_row_ptr, table_stride_c, k_base, v_base, num_blocks,
                k_stride_b, k_stride_s, v_stride_b, v_stride_s, qk_scale,
                True, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_SIZE, NUM_STAGES, LD, S_LAYOUT,
                O_LAYOUT, n_tiles,
            )
        async_copy.wait_group(0)

        # Normalize and store; a row that saw no key gets zeros and LSE -inf.
        seen = l_i > 0
        l_o = gl.convert_layout(gl.where(seen, l_i, 1.0), gl.SliceLayout(1, O_LAYOUT))
        o = acc / gl.expand_dims(l_o, 1)
        o = gl.convert_layout(o.to(dtype), LD)
        o_ptrs = out_ptr + gl.expand_dims(tokens_o * out_stride_t + heads_o * out_stride_h, 1) \
            + gl.expand_dims(d_o, 0)
        gl.store(o_ptrs, o, mask=io_mask)
        if HAS_LSE:
            lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * _LN_2_C,
                           float("-inf"))
            lse = gl.convert_layout(lse, gl.SliceLayout(1, LD))
            gl.store(lse_ptr + tokens_o * lse_stride_t + heads_o * lse_stride_h, lse,
                     mask=valid_o)
