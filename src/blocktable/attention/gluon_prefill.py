"""The prefill kernel in Gluon for Hopper (sm_90), warp-specialized and persistent: a grid of
about one program per multiprocessor, each taking work items (a query tile of one KV head) in
turn, the launch's next unclaimed one whenever it is ready for more. In a program, one
warpgroup finds each item (its request, bounds and key tiles), describes it to the consumers
in shared memory, copies its queries with the tensor copy engine (TMA) into one of two query
buffers, and its K/V tiles page by page into a ring of shared-memory stages; two consumer
warpgroups, each on its own 64 query rows, run the scores, the online softmax and ``P @ V``
on warpgroup MMA (wgmma), and hand a tile's output rows to the copy engine through their
query buffer when the output's heads lie side by side. Buffers and stages are handed over
by mbarriers: "ready" (the copy engine's byte count) and "empty" (one arrival per consumer),
so the loader runs ahead of both consumers, into the next item's queries and keys while they
finish the last one's, and the two consumers drift apart instead of meeting at every tile:
one's softmax runs while the other's wgmma does; within a consumer, a tile's softmax runs
while ``P @ V`` of the tile before does, and a warp whose rows' running maxima all stay put
(one moves only when a score passes it by a factor of 2**8) leaves its accumulator unscaled.
(That needs the PTX pass of
:mod:`blocktable.attention.gluon_ptx`: as Triton 3.6-3.9 lower warp specialization on Hopper,
ptxas would wait after every wgmma.)

It computes what :mod:`blocktable.attention.triton_prefill` computes, over the same tiles (in
another order: the last tile first, every KV head's side by side) and with the same request
search (a warp's 32 lanes a level; the last level also reads the request's bounds, length and
row), for the cases :func:`supports` and the launcher accept: float16 or bfloat16, head size
64 or 128, a GQA group of at most 8 query heads (padded), a query whose heads lie side by
side, a kernel block size that is a power of two from 16 (pages copied whole or, for pages
longer than a tile, in tile-sized pieces), a cache whose blocks are contiguous
``[block_size, num_kv_heads, head_dim]`` pieces, no context parallelism, no sliding window;
everything else stays on the Triton kernel.

Keys of an item past its last query's causal bound are never read from the cache: a page
chunk wholly past it is copied from outside the tensor (the copy engine fills zeros), and the
one chunk that straddles it is gathered key by key with plain loads (keys past the bound
zero-filled), so a masked score never meets a NaN left in an unused slot. Query rows past
the request read its neighbours' queries (zeros past the batch): rows do not mix, and those
are never stored.

Gluon ships with Triton 3.6 and later (``triton.experimental.gluon``); without it this module
imports and :data:`HAS_GLUON` is false.
"""
from __future__ import annotations

from blocktable._triton import HAS_TRITON
from blocktable.attention import gluon_ptx

HAS_GLUON = False
if HAS_TRITON:  # pragma: no cover - depends on the installed Triton
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            fence_async_shared,
            mbarrier,
            tma,
            warpgroup_mma,
            warpgroup_mma_init,
            warpgroup_mma_wait,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

        _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
        _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
        _partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
        HAS_GLUON = True
    except (ImportError, AttributeError):
        pass

GLUON_HEAD_DIMS = (64, 128)
GLUON_MIN_BLOCK_SIZE = 16
GLUON_DTYPES = ("fp16", "bf16")
_LN_2 = 0.6931471805599453
CONSUMER_ROWS = 64  # one warpgroup's wgmma rows
# Registers of a consumer thread; the loader keeps 3 * 168 - 2 * 216 = 72 of the launch's 168
# per thread of three warpgroups (:mod:`blocktable.attention.gluon_ptx`): the most with which
# neither partition spills.
CONSUMER_REGS = 216
if HAS_GLUON:
    # Before any kernel of ours compiles: Triton 3.7 on keys every kernel's cache on the hook,
    # so a hook installed later would recompile the kernels compiled before it.
    gluon_ptx.install(CONSUMER_REGS)
# Arguments that change from step to step: never a new compilation.
GLUON_DYNAMIC_ARGS = (
    "num_reqs", "num_tokens", "short_query_len", "num_blocks", "num_rows", "width",
    "search_stride", "cache_rows",
)


def supports(dtype_name: str, head_dim: int, cp_world: int, window: int) -> str | None:
    """``None`` when the Gluon kernel serves inputs of this dtype, head size, context
    parallel world and sliding window, else the reason it does not (the launcher checks the
    device, the cache's block layout and the alignments)."""
    if not HAS_GLUON:
        return "the Gluon kernel needs triton.experimental.gluon with Hopper TMA and mbarriers"
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
    _ROWS = gl.constexpr(CONSUMER_ROWS)
    # An item description's kind: nothing to compute, pad rows past the last request, rows
    # to compute, or the program's end.
    _IDLE = gl.constexpr(0)
    _PAD = gl.constexpr(1)
    _BUSY = gl.constexpr(2)
    _DONE = gl.constexpr(3)
    _LANES = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # 32 values, one warp's lanes
    CONSUMER_REGS_C = gl.constexpr(CONSUMER_REGS)
    _STALE_LOG2 = gl.constexpr(8.0)
    # A thread's two rows (its pack of 2 of a row vector): 1.0 for every lane of the warp
    # when any lane has a row with alpha < 1, else 0.0.
    _VOTE_ASM = gl.constexpr(
        "{ .reg .pred p, q; setp.lt.f32 p, $2, 0f3F800000; setp.lt.f32 q, $3, 0f3F800000; "
        "or.pred p, p, q; vote.sync.any.pred p, p, 0xffffffff; "
        "selp.f32 $0, 0f3F800000, 0f00000000, p; mov.f32 $1, $0; }")
    # 16 accumulator elements ($0-$15, tied to their inputs) times their rows' alpha
    # ($32-$47), skipped when the warp's vote ($48, the same in all 16) is 0; ${:uid} gives
    # each copy of the asm its own label.
    _RESCALE_ASM = gl.constexpr(
        "{ .reg .pred p; setp.ne.f32 p, $48, 0f00000000; @!p bra.uni SKIP${:uid}; "
        + "".join(f"mul.f32 ${e}, ${e}, ${32 + e}; " for e in range(16)) + "SKIP${:uid}: }")
    _RESCALE_CONSTRAINTS = gl.constexpr(
        ",".join(["=f"] * 16 + [str(e) for e in range(16)] + ["f"] * 32))

    @gluon.constexpr_function
    def _mma_layout(n):
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16]
        )

    @gluon.constexpr_function
    def _rows_layout(width, num_warps):
        """Blocked layout of ``[rows, width]`` tiles: 16-byte vectors along the head."""
        vec = min(8, width)
        cols = max(1, min(32, width // vec))
        return gl.BlockedLayout([1, vec], [32 // cols, cols], [num_warps, 1], [1, 0])

    @gluon.jit
    def _load_partition(
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, meta, q_ready, q_empty, ready, empty,
        table_ptr, table_stride_r, table_stride_c, k_cache_ptr, v_cache_ptr, k_stride_b,
        k_stride_s, v_stride_b, v_stride_s, num_blocks, cache_rows, qsl_ptr, seq_lens_ptr,
        row_of_batch_ptr, num_reqs, num_tokens, short_query_len, num_rows, width,
        search_stride, num_kv_heads, work_ptr,
        GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, BLOCK_Q: gl.constexpr,
        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        RADIX: gl.constexpr, INDEXED: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):
        """The loader warpgroup: for each of the program's work items, describe it to the
        consumers in ``meta`` and copy its query tile into one of two query buffers (handed
        over by ``q_ready``/``q_empty``), then for each key tile wait until both consumers
        released its stage and copy its K and V page chunks into it. The ring's tiles and the
        query buffers are counted across the items, so the loader runs into the next item's
        queries and keys while the consumers finish the last one's.

        The program's first item is its id; each next one is the next unclaimed item of the
        launch (``work_ptr``, int32 ``[2]``: the items claimed past the grid's first, the
        programs done; zero at the launch, zeroed again by its last program), so a program
        that finishes early takes more and no fixed share leaves some idle while others run.
        The next item is claimed and found (its request, bounds and key tiles) as soon as the
        current one's first key tile is on its way: its last tile's stage frees late, and the
        claim's and the search's trips to memory would then hold up the next queries."""
        TOK: gl.constexpr = _ROWS // GROUP_PAD  # tokens of a consumer's rows
        Q_BYTES: gl.constexpr = 2 * _ROWS * HEAD_DIM * 2
        num_items = (gl.cdiv(num_tokens, BLOCK_Q) + num_reqs) * num_kv_heads
        ring = 0  # tiles loaded so far
        j = 0  # items described so far
        w = gl.program_id(0)
        tile, kv_head, req, q_start, q_end, seq_len, row = _find_item(
            gl.minimum(w, num_items - 1), num_kv_heads, qsl_ptr, seq_lens_ptr,
            row_of_batch_ptr, num_reqs, num_tokens, search_stride, BLOCK_Q, RADIX, INDEXED)
        while w < num_items:
            busy, i0, prefix, kv_cap, kv_end, n_tiles, row = _item_bounds(
                tile, req, q_start, q_end, seq_len, row, num_reqs, short_query_len,
                num_rows, width, BLOCK_Q, BLOCK_N, BLOCK_SIZE)
            b = j % 2
            mbarrier.wait(q_empty.index(b), ((j // 2) & 1) ^ 1)
            # _PAD past the last request, _BUSY for rows to compute, else _IDLE (0)
            kind = _PAD * (req == num_reqs).to(gl.int32) + _BUSY * busy.to(gl.int32)
            _describe(meta.index(b), kind, tile, kv_head, q_start, q_end - q_start, prefix,
                      kv_cap, i0, n_tiles)
            _partition_barrier()  # every warp's stores before the arrival
            mbarrier.expect(q_ready.index(b), Q_BYTES, pred=busy)
            mbarrier.arrive(q_ready.index(b), pred=not busy)
            if busy:
                # Each consumer's rows: GROUP_PAD heads of TOK tokens, head-major (one box
                # per head). Rows past the request read its neighbours' queries, rows past
                # the batch or the heads zeros: rows do not mix, and those are never stored.
                for h in gl.static_range(2):
                    t0 = q_start + i0 + h * TOK
                    for g in gl.static_range(GROUP_PAD):
                        _tma_load(q_desc, [t0, (kv_head * GROUP + g) * HEAD_DIM],
                                  q_ready.index(b), q_smem.index(2 * b + h).slice(g * TOK, TOK))
            table_row_ptr = table_ptr + row.to(gl.int64) * table_stride_r
            split = gl.minimum(n_tiles, 1)  # the tiles copied before the next item is found
            _load_tiles(k_desc, v_desc, k_smem, v_smem, ready, empty, table_row_ptr,
                        table_stride_c, k_cache_ptr, v_cache_ptr, k_stride_b, k_stride_s,
                        v_stride_b, v_stride_s, num_blocks, cache_rows, kv_head, kv_end,
                        ring, 0, split, BLOCK_N, HEAD_DIM, BLOCK_SIZE, NUM_STAGES)
            item_kv_head, item_kv_end, item_tiles = kv_head, kv_end, n_tiles
            # (relaxed: the claim orders no other access; acquire-release adds GPU-wide fences)
            w = gl.num_programs(0) + gl.atomic_add(work_ptr, 1, sem="relaxed")
            tile, kv_head, req, q_start, q_end, seq_len, row = _find_item(
                gl.minimum(w, num_items - 1), num_kv_heads, qsl_ptr, seq_lens_ptr,
                row_of_batch_ptr, num_reqs, num_tokens, search_stride, BLOCK_Q, RADIX,
                INDEXED)
            _load_tiles(k_desc, v_desc, k_smem, v_smem, ready, empty, table_row_ptr,
                        table_stride_c, k_cache_ptr, v_cache_ptr, k_stride_b, k_stride_s,
                        v_stride_b, v_stride_s, num_blocks, cache_rows, item_kv_head,
                        item_kv_end, ring, split, item_tiles, BLOCK_N, HEAD_DIM, BLOCK_SIZE,
                        NUM_STAGES)
            ring += item_tiles
            j += 1
        # The end, as an item of its own kind.
        b = j % 2
        mbarrier.wait(q_empty.index(b), ((j // 2) & 1) ^ 1)
        _describe(meta.index(b), _DONE, 0, 0, 0, 0, 0, 0, 0, 0)
        _partition_barrier()
        mbarrier.arrive(q_ready.index(b))
        # The last program to get here zeroes the counters for the next launch: every
        # program has made its last claim by then.
        if gl.atomic_add(work_ptr + 1, 1, sem="relaxed") == gl.num_programs(0) - 1:
            gl.atomic_xchg(work_ptr, 0, sem="relaxed")
            gl.atomic_xchg(work_ptr + 1, 0, sem="relaxed")

    @gluon.jit
    def _describe(meta, kind, tile, kv_head, q_start, query_len, prefix, kv_cap, i0,
                  n_tiles):
        """A work item's description into ``meta`` (int32 ``[32]`` in shared memory): field
        ``i`` at lane ``i``, read back by :func:`_field` (the consumers read each field where
        they use it)."""
        lanes = gl.arange(0, 32, layout=_LANES)
        fields = gl.where(lanes == 0, kind, 0)
        fields = gl.where(lanes == 1, tile, fields)
        fields = gl.where(lanes == 2, kv_head, fields)
        fields = gl.where(lanes == 3, q_start, fields)
        fields = gl.where(lanes == 4, query_len, fields)
        fields = gl.where(lanes == 5, prefix, fields)
        fields = gl.where(lanes == 6, kv_cap, fields)
        fields = gl.where(lanes == 7, i0, fields)
        fields = gl.where(lanes == 8, n_tiles, fields)
        meta.store(fields)

    @gluon.jit
    def _field(fields, lanes, i: gl.constexpr):
        """Field ``i`` of a description loaded from shared memory, as a scalar."""
        return gl.sum(gl.where(lanes == i, fields, 0), 0)

    @gluon.jit
    def _load_tiles(
        k_desc, v_desc, k_smem, v_smem, ready, empty, table_row_ptr, table_stride_c,
        k_cache_ptr, v_cache_ptr, k_stride_b, k_stride_s, v_stride_b, v_stride_s,
        num_blocks, cache_rows, kv_head, kv_end, ring, first, n_tiles,
        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        NUM_STAGES: gl.constexpr,
    ):
        """Key tiles ``first`` to ``n_tiles - 1`` of a work item into the ring, its tile 0
        into the ring's ``ring``-th use of a stage."""
        CH: gl.constexpr = BLOCK_SIZE if BLOCK_SIZE < BLOCK_N else BLOCK_N
        NCH: gl.constexpr = BLOCK_N // CH
        TILE_BYTES: gl.constexpr = 2 * BLOCK_N * HEAD_DIM * 2
        CHUNK_BYTES: gl.constexpr = 2 * CH * HEAD_DIM * 2
        col = kv_head * HEAD_DIM
        for i in range(first, n_tiles):
            stage = (ring + i) % NUM_STAGES
            start = i * BLOCK_N
            # The tile's block ids, loaded side by side before the stage's wait: the tile then
            # waits for one load's latency (under the wait), not for one per chunk in a row
            # between the copies (a tuple built in a static_range keeps them apart).
            pages = ()
            for c in gl.static_range(NCH):
                t0 = start + c * CH
                pages = pages + (gl.load(table_row_ptr + (t0 // BLOCK_SIZE) * table_stride_c,
                                         mask=t0 + CH <= kv_end, other=-1),)
            mbarrier.wait(empty.index(stage), (((ring + i) // NUM_STAGES) & 1) ^ 1)
            # The chunk holding kv_end (when kv_end is not on a chunk edge) is gathered key by
            # key and stored before the stage's one arrival (below), every warp's stores made
            # visible to the tensor cores first: the phase cannot complete without them.
            straddle = (kv_end > start) & (kv_end < start + BLOCK_N) & (kv_end % CH != 0)
            for c in gl.static_range(NCH):
                t0 = start + c * CH
                if (t0 < kv_end) & (t0 + CH > kv_end):
                    _gather_chunk(k_smem.index(stage).slice(c * CH, CH),
                                  v_smem.index(stage).slice(c * CH, CH), t0, kv_end,
                                  table_row_ptr, table_stride_c, k_cache_ptr + col,
                                  v_cache_ptr + col, num_blocks, k_stride_b, k_stride_s,
                                  v_stride_b, v_stride_s, CH, HEAD_DIM, BLOCK_SIZE)
            if straddle:  # every warp's stores done before the arrival
                fence_async_shared()
                _partition_barrier()
            mbarrier.expect(ready.index(stage), TILE_BYTES - CHUNK_BYTES, pred=straddle)
            mbarrier.expect(ready.index(stage), TILE_BYTES, pred=not straddle)
            for c in gl.static_range(NCH):
                t0 = start + c * CH
                whole = t0 + CH <= kv_end
                page = pages[c]
                ok = whole & (page >= 0) & (page < num_blocks)
                # Outside the tensor (zeros) for a chunk past kv_end or a bad block id; no copy
                # for the gathered chunk (predicated, not branched: the copies issue together).
                row = gl.where(ok, page * BLOCK_SIZE + t0 % BLOCK_SIZE, cache_rows)
                copy = whole | (t0 >= kv_end)
                _tma_load(k_desc, [row, col], ready.index(stage),
                          k_smem.index(stage).slice(c * CH, CH), pred=copy)
                _tma_load(v_desc, [row, col], ready.index(stage),
                          v_smem.index(stage).slice(c * CH, CH), pred=copy)

    @gluon.jit
    def _gather_chunk(
        k_dst, v_dst, t0, kv_end, table_row_ptr, table_stride_c, k_base, v_base, num_blocks,
        k_stride_b, k_stride_s, v_stride_b, v_stride_s,
        CH: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ):
        """Keys ``[t0, t0 + CH)`` and their values loaded and stored into the stage; keys from
        ``kv_end`` on and keys in a block id outside ``[0, num_blocks)`` zero-filled, never
        read."""
        LD: gl.constexpr = _rows_layout(HEAD_DIM, 4)
        t = t0 + gl.arange(0, CH, layout=gl.SliceLayout(1, LD))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
        in_row = t < kv_end
        ids = gl.load(table_row_ptr + (t // BLOCK_SIZE) * table_stride_c, mask=in_row, other=0)
        ok = in_row & (ids >= 0) & (ids < num_blocks)
        ids = gl.where(ok, ids, 0).to(gl.int64)
        slot = t % BLOCK_SIZE
        mask = gl.expand_dims(ok, 1)
        k_ptrs = k_base + gl.expand_dims(ids * k_stride_b + slot * k_stride_s, 1) \
            + gl.expand_dims(d, 0)
        v_ptrs = v_base + gl.expand_dims(ids * v_stride_b + slot * v_stride_s, 1) \
            + gl.expand_dims(d, 0)
        k_dst.store(gl.load(k_ptrs, mask=mask, other=0.0))
        v_dst.store(gl.load(v_ptrs, mask=mask, other=0.0))

    @gluon.jit
    def _softmax(s, m_i, l_i, start, row_hi, full_hi, qk_scale,
                 BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr):
        """One tile's online-softmax update: ``(p, alpha, m_i, l_i)``. A row's running max
        ``m_i`` (log2 units) moves only when the tile's max passes it by more than
        ``_STALE_LOG2``: ``p`` stays at most ``2**_STALE_LOG2``, which ``p``'s 16-bit floats and
        the float32 sums hold without loss of relative precision, and the rows whose max
        stays put have ``alpha`` exactly 1, so :func:`_rescale` can skip them."""
        if start + BLOCK_N > full_hi:  # a row of the tile misses some of its keys
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
            visible = gl.expand_dims(start + cols, 0) < gl.expand_dims(row_hi, 1)
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_new = gl.where(m_new > m_i + _STALE_LOG2, m_new, m_i)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _rescale(acc, alpha):
        """``acc * alpha[:, None]`` (``acc`` ``[64, HEAD_DIM]`` float32 in the wgmma
        accumulator's layout, ``alpha`` ``[64]`` its rows' factors), with the multiplies
        skipped by every warp whose 16 rows all have ``alpha`` 1: past a request's first
        tiles, most rows' max has settled (see :func:`_softmax`), and the multiplies were
        the largest share of a tile's arithmetic outside the products. Gluon branches only
        on values uniform over the partition, so the per-warp branch is PTX: a vote over
        the warp, then a skip over the multiplies of each 16 of the thread's elements."""
        need = gl.inline_asm_elementwise(_VOTE_ASM, "=f,=f,f,f", [alpha], dtype=gl.float32,
                                         is_pure=True, pack=2)
        alpha_2d, _ = gl.broadcast(gl.expand_dims(alpha, 1), acc)
        need_2d, _ = gl.broadcast(gl.expand_dims(need, 1), acc)
        return gl.inline_asm_elementwise(_RESCALE_ASM, _RESCALE_CONSTRAINTS,
                                         [acc, alpha_2d, need_2d], dtype=gl.float32,
                                         is_pure=True, pack=16)

    @gluon.jit
    def _consume_item(
        half: gl.constexpr, q_rows, k_smem, v_smem, ready, empty, out_ptr, o_desc, lse_ptr,
        q_start, query_len, prefix, kv_cap, i0, ring, n_tiles_all, kv_head, qk_scale,
        out_stride_t, out_stride_h, lse_stride_t, lse_stride_h,
        GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_LSE: gl.constexpr,
        TMA_OUT: gl.constexpr,
    ):
        """One warpgroup on its 64 rows of a work item's query tile (``q_rows``, in shared
        memory: ``GROUP_PAD`` heads of the tile's tokens ``[i0 + half * TOK, i0 + half * TOK
        + TOK)``, head-major), whose ``n_tiles_all`` key tiles come through the ring from its
        ``ring``-th stage use on."""
        M: gl.constexpr = _ROWS
        TOK: gl.constexpr = _ROWS // GROUP_PAD
        S_LAYOUT: gl.constexpr = _mma_layout(BLOCK_N)
        O_LAYOUT: gl.constexpr = _mma_layout(HEAD_DIM)
        LD: gl.constexpr = _rows_layout(HEAD_DIM, 4)
        dtype: gl.constexpr = q_rows.dtype

        # This warpgroup's rows: row r holds head r // TOK of the group, token r % TOK.
        rows_o = gl.arange(0, M, layout=gl.SliceLayout(1, LD))
        d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
        g_o = rows_o // TOK
        heads_o = kv_head * GROUP + g_o
        tok_i_o = i0 + half * TOK + rows_o % TOK
        valid_o = (tok_i_o < query_len) & (g_o < GROUP)
        tokens_o = (q_start + tok_i_o).to(gl.int64)
        io_mask = gl.expand_dims(valid_o, 1) & gl.expand_dims(d_o >= 0, 0)

        rows_s = gl.arange(0, M, layout=gl.SliceLayout(1, S_LAYOUT))
        tok_i_s = i0 + half * TOK + rows_s % TOK
        valid_s = (tok_i_s < query_len) & (rows_s // TOK < GROUP)
        row_hi = gl.where(valid_s, gl.minimum(prefix + tok_i_s + 1, kv_cap), 0)
        # This warpgroup's keys: those every row sees (no mask) and those any row sees.
        first_tok = i0 + half * TOK
        last_tok = gl.minimum(i0 + half * TOK + TOK - 1, query_len - 1)
        full_hi = gl.minimum(prefix + first_tok + 1, kv_cap)
        my_end = gl.maximum(gl.minimum(prefix + last_tok + 1, kv_cap), 0)
        n_tiles = gl.minimum(gl.cdiv(my_end, BLOCK_N), n_tiles_all)
        n_tiles = gl.where(first_tok < query_len, n_tiles, 0)  # no row of ours is a token

        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT,
                                                     k_width=2)
        acc = gl.zeros([M, HEAD_DIM], gl.float32, O_LAYOUT)
        m_i = gl.full([M], -1.0e30, gl.float32, gl.SliceLayout(1, S_LAYOUT))
        l_i = gl.zeros([M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
        zero_s = gl.zeros([M, BLOCK_N], gl.float32, S_LAYOUT)
        # P of the P @ V product in flight, named in the waits that may retire it: a wgmma
        # reads its register operands until then.
        p_op = gl.zeros([M, BLOCK_N], dtype, P_LAYOUT)
        if n_tiles > 0:
            # (No proxy fence after a stage's wait: the loader's warps fence their plain
            # stores of a straddling chunk before the stage's arrival, where a writer must.)
            mbarrier.wait(ready.index(ring % NUM_STAGES), (ring // NUM_STAGES) & 1)
            s = warpgroup_mma(q_rows, k_smem.index(ring % NUM_STAGES).permute((1, 0)),
                              zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            acc = warpgroup_mma_init(acc)  # the loop carries it in flight
            for i in range(n_tiles - 1):
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, i * BLOCK_N, row_hi, full_hi,
                                              qk_scale, BLOCK_N, S_LAYOUT)
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
                if i > 0:  # P @ V of tile i - 1 retired: its stage goes back to the loader
                    mbarrier.arrive(empty.index((ring + i - 1) % NUM_STAGES))
                p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
                alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))
                acc = _rescale(acc, alpha_o)
                nxt = (ring + i + 1) % NUM_STAGES
                mbarrier.wait(ready.index(nxt), ((ring + i + 1) // NUM_STAGES) & 1)
                s_next = warpgroup_mma(q_rows, k_smem.index(nxt).permute((1, 0)), zero_s,
                                       use_acc=False, is_async=True)
                acc = warpgroup_mma(p_op, v_smem.index((ring + i) % NUM_STAGES), acc,
                                    is_async=True)
                s, p_op = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, p_op))
            last = n_tiles - 1
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, last * BLOCK_N, row_hi, full_hi,
                                          qk_scale, BLOCK_N, S_LAYOUT)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            if last > 0:
                mbarrier.arrive(empty.index((ring + last - 1) % NUM_STAGES))
            p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))
            acc = _rescale(acc, alpha_o)
            acc = warpgroup_mma(p_op, v_smem.index((ring + last) % NUM_STAGES), acc,
                                is_async=True)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            mbarrier.arrive(empty.index((ring + last) % NUM_STAGES))
        # Tiles the other warpgroup still needs: released in turn (each after it landed, so
        # no arrival ever counts toward a later use of the stage).
        for i in range(ring + n_tiles, ring + n_tiles_all):
            mbarrier.wait(ready.index(i % NUM_STAGES), (i // NUM_STAGES) & 1)
            mbarrier.arrive(empty.index(i % NUM_STAGES))

        # Normalize and store; a row that saw no key gets zeros and LSE -inf.
        seen = l_i > 0
        l_o = gl.convert_layout(gl.where(seen, l_i, 1.0), gl.SliceLayout(1, O_LAYOUT))
        o = (acc / gl.expand_dims(l_o, 1)).to(dtype)
        if TMA_OUT and (first_tok + TOK <= query_len):
            # Every row a token of the request: the rows through the query buffer (its
            # last product retired) and out by the copy engine, a box per head, so the
            # warpgroup issues a few copies instead of a store per 16 bytes.
            q_rows.store(o)
            fence_async_shared()
            _partition_barrier()  # every warp's rows in place before the copy reads them
            for g in gl.static_range(GROUP):
                _tma_store(o_desc, [q_start + first_tok, (kv_head * GROUP + g) * HEAD_DIM],
                           q_rows.slice(g * TOK, TOK))
            tma.store_wait(0)
            _partition_barrier()  # read before the buffer goes back to the loader
        else:
            o_ptrs = out_ptr + gl.expand_dims(tokens_o * out_stride_t + heads_o * out_stride_h,
                                              1) + gl.expand_dims(d_o, 0)
            gl.store(o_ptrs, gl.convert_layout(o, LD), mask=io_mask)
        if HAS_LSE:
            lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * _LN_2_C,
                           float("-inf"))
            lse = gl.convert_layout(lse, gl.SliceLayout(1, LD))
            gl.store(lse_ptr + tokens_o * lse_stride_t + heads_o * lse_stride_h, lse,
                     mask=valid_o)

    @gluon.jit
    def _consumer_partition(
        half: gl.constexpr, q_smem, k_smem, v_smem, meta, q_ready, q_empty, ready, empty,
        out_ptr, o_desc, lse_ptr, qk_scale, num_reqs, num_tokens,
        out_stride_t, out_stride_h, lse_stride_t, lse_stride_h,
        GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, BLOCK_Q: gl.constexpr,
        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HAS_LSE: gl.constexpr,
        NUM_STAGES: gl.constexpr, TMA_OUT: gl.constexpr,
    ):
        """One consumer warpgroup over the program's work items, as the loader describes
        them (in its order), to the last one's end."""
        ring = 0  # tiles consumed so far
        j = 0  # items taken so far
        kind = _IDLE
        while kind != _DONE:
            b = j % 2
            mbarrier.wait(q_ready.index(b), (j // 2) & 1)
            lanes = gl.arange(0, 32, layout=_LANES)
            fields = meta.index(b).load(_LANES)
            kind = _field(fields, lanes, 0)
            tile = _field(fields, lanes, 1)
            kv_head = _field(fields, lanes, 2)
            q_start = _field(fields, lanes, 3)
            n_tiles = _field(fields, lanes, 8)
            if kind == _PAD:
                _zero_pad_rows(half, out_ptr, lse_ptr, tile, kv_head, q_start, num_reqs,
                               num_tokens, out_stride_t, out_stride_h, lse_stride_t,
                               lse_stride_h, out_ptr.dtype.element_ty, GROUP, GROUP_PAD,
                               BLOCK_Q, HEAD_DIM, HAS_LSE)
            elif kind == _BUSY:
                _consume_item(half, q_smem.index(2 * b + half), k_smem, v_smem, ready, empty,
                              out_ptr, o_desc, lse_ptr, q_start, _field(fields, lanes, 4),
                              _field(fields, lanes, 5), _field(fields, lanes, 6),
                              _field(fields, lanes, 7), ring, n_tiles, kv_head, qk_scale,
                              out_stride_t, out_stride_h, lse_stride_t, lse_stride_h,
                              GROUP, GROUP_PAD, BLOCK_N, HEAD_DIM, NUM_STAGES, HAS_LSE,
                              TMA_OUT)
            mbarrier.arrive(q_empty.index(b))
            ring += n_tiles
            j += 1

    @gluon.jit
    def _find_item(
        w, num_kv_heads, qsl_ptr, seq_lens_ptr, row_of_batch_ptr, num_reqs, num_tokens,
        search_stride, BLOCK_Q: gl.constexpr, RADIX: gl.constexpr, INDEXED: gl.constexpr,
    ):
        """Work item ``w``: its query tile and KV head, the tile's request (``num_reqs`` for
        a tile past the last request) with its token bounds, length and table row.

        The i-th item takes tile T - 1 - i // H of KV head i % H: the last tiles first (a
        request's last are its heaviest under the causal mask), every head's side by side,
        so that the items running at once read the same slots of every head's keys."""
        tile = gl.cdiv(num_tokens, BLOCK_Q) + num_reqs - 1 - w // num_kv_heads
        kv_head = w % num_kv_heads
        # The request: the largest r <= num_reqs with qsl[r] // BLOCK_Q + r <= tile, RADIX
        # candidates a level (one warp's lanes, the same in every warp: no reduction crosses
        # warps). The last level reads each candidate's bounds, length and row beside its
        # start, so the request's own come from its lane, not from another trip to memory.
        lanes = gl.arange(0, RADIX, layout=_LANES)
        req = tile * 0
        stride = search_stride
        while stride > 1:
            cand = req + lanes * stride
            ok = cand <= num_reqs
            first = gl.load(qsl_ptr + cand, mask=ok, other=0) // BLOCK_Q + cand
            hits = gl.sum((ok & (first <= tile)).to(gl.int32), 0)
            req = req + (hits - 1) * stride
            stride = stride // RADIX
        cand = req + lanes
        ok = cand <= num_reqs
        real_c = cand < num_reqs
        starts = gl.load(qsl_ptr + cand, mask=ok, other=0)
        ends = gl.load(qsl_ptr + cand + 1, mask=real_c, other=0)
        lens = gl.load(seq_lens_ptr + cand, mask=real_c, other=0)
        # Lane 0 always counts: the level before left req where it holds.
        hits = gl.sum((ok & (starts // BLOCK_Q + cand <= tile)).to(gl.int32), 0)
        mine = lanes == hits - 1
        req = req + hits - 1
        q_start = gl.sum(gl.where(mine, starts, 0), 0)
        q_end = gl.sum(gl.where(mine, ends, 0), 0)
        seq_len = gl.sum(gl.where(mine, lens, 0), 0)
        row = req
        if INDEXED:
            rows = gl.load(row_of_batch_ptr + cand, mask=real_c, other=0)
            row = gl.sum(gl.where(mine, rows, 0), 0)
        return tile, kv_head, req, q_start, q_end, seq_len, row

    @gluon.jit
    def _item_bounds(
        tile, req, q_start, q_end, seq_len, row, num_reqs, short_query_len, num_rows, width,
        BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ):
        """Whether this kernel computes the work item's rows, their first token in the request,
        the request's cached prefix, its keys' cap (never past the table row), the item's key
        end and key tiles (0 when not computed), and the row (0 for a row outside the table,
        whose cap is 0)."""
        query_len = q_end - q_start
        j = tile - q_start // BLOCK_Q - req  # the tile's index in its request
        i0 = j * BLOCK_Q
        busy = (req < num_reqs) & (query_len > short_query_len) & (i0 < query_len)
        row_ok = (row >= 0) & (row < num_rows)
        kv_cap = gl.where(row_ok, gl.minimum(seq_len, width * BLOCK_SIZE), 0)
        prefix = seq_len - query_len
        kv_end = gl.maximum(gl.minimum(prefix + gl.minimum(i0 + BLOCK_Q, query_len), kv_cap), 0)
        n_tiles = gl.where(busy, gl.cdiv(kv_end, BLOCK_N), 0)
        return busy, i0, prefix, kv_cap, kv_end, n_tiles, gl.where(row_ok, row, 0)

    @gluon.jit
    def _zero_pad_rows(
        half: gl.constexpr, out_ptr, lse_ptr, tile, kv_head, q_start, num_reqs, num_tokens,
        out_stride_t, out_stride_h, lse_stride_t, lse_stride_h, dtype: gl.constexpr,
        GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, BLOCK_Q: gl.constexpr,
        HEAD_DIM: gl.constexpr, HAS_LSE: gl.constexpr,
    ):
        """A tile past the last request: this warpgroup's rows of its pad tokens (from
        ``q_start``, the batch's last token, on) zeroed, their LSE -inf."""
        M: gl.constexpr = _ROWS
        LD: gl.constexpr = _rows_layout(HEAD_DIM, 4)
        rows_o = half * M + gl.arange(0, M, layout=gl.SliceLayout(1, LD))
        d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
        g_o = rows_o % GROUP_PAD
        heads_o = kv_head * GROUP + g_o
        tokens = (tile - num_reqs) * BLOCK_Q + rows_o // GROUP_PAD
        pad = (g_o < GROUP) & (tokens >= q_start) & (tokens < num_tokens)
        tok64 = tokens.to(gl.int64)
        o_ptrs = out_ptr + gl.expand_dims(tok64 * out_stride_t + heads_o * out_stride_h, 1) \
            + gl.expand_dims(d_o, 0)
        gl.store(o_ptrs, gl.zeros([M, HEAD_DIM], dtype, LD),
                 mask=gl.expand_dims(pad, 1) & gl.expand_dims(d_o >= 0, 0))
        if HAS_LSE:
            gl.store(lse_ptr + tok64 * lse_stride_t + heads_o * lse_stride_h,
                     gl.full([M], float("-inf"), gl.float32, gl.SliceLayout(1, LD)), mask=pad)

    # Pointers whose alignment varies (views of the caller's metadata): never specialized on,
    # so that one compilation serves them all (the launcher keeps it). Output and caches are
    # 16-byte aligned (the launcher checks), the work counters an allocation's base.
    @gluon.jit(do_not_specialize=list(GLUON_DYNAMIC_ARGS),
               do_not_specialize_on_alignment=[
                   "lse_ptr", "table_ptr", "seq_lens_ptr", "qsl_ptr", "row_of_batch_ptr"])
    def gluon_prefill_kernel(
        out_ptr, lse_ptr, q_desc, o_desc, k_desc, v_desc, k_cache_ptr, v_cache_ptr, table_ptr,
        seq_lens_ptr, qsl_ptr, row_of_batch_ptr, work_ptr, qk_scale, num_reqs, num_tokens,
        short_query_len, num_blocks, num_rows, width, search_stride, cache_rows, num_kv_heads,
        out_stride_t, out_stride_h,
        lse_stride_t, lse_stride_h,
        k_stride_b, k_stride_s,
        v_stride_b, v_stride_s,
        table_stride_r, table_stride_c,
        GROUP: gl.constexpr, GROUP_PAD: gl.constexpr, BLOCK_Q: gl.constexpr,
        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
        RADIX: gl.constexpr, INDEXED: gl.constexpr, HAS_LSE: gl.constexpr,
        NUM_STAGES: gl.constexpr, TMA_OUT: gl.constexpr,
    ):
        # Work items (query tile, KV head) shared out among a grid of G programs, each
        # program's first its id and the rest claimed as programs finish (none claimed
        # when G is the item count): a program's loader runs into its next item's queries
        # and keys while the consumers finish the last one's.
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [_ROWS, HEAD_DIM], gl.float16)
        KV_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [BLOCK_N, HEAD_DIM], gl.float16)
        # two query buffers of two consumers' rows each, and each buffer's item description
        q_smem = gl.allocate_shared_memory(dtype, [4, _ROWS, HEAD_DIM], Q_SMEM)
        meta = gl.allocate_shared_memory(
            gl.int32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_SMEM)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_SMEM)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
        for s in gl.static_range(2):
            mbarrier.init(q_ready.index(s), count=1)
            mbarrier.init(q_empty.index(s), count=2)

        # (Each partition's arguments written out: a tuple built by concatenation here
        # loses the constexpr-ness of its elements.)
        gl.warp_specialize(
            [
                (_load_partition, (
                    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, meta, q_ready, q_empty,
                    ready, empty, table_ptr, table_stride_r, table_stride_c, k_cache_ptr,
                    v_cache_ptr, k_stride_b, k_stride_s, v_stride_b, v_stride_s, num_blocks,
                    cache_rows, qsl_ptr, seq_lens_ptr, row_of_batch_ptr, num_reqs, num_tokens,
                    short_query_len, num_rows, width, search_stride, num_kv_heads,
                    work_ptr, GROUP, GROUP_PAD, BLOCK_Q, BLOCK_N, HEAD_DIM, BLOCK_SIZE, RADIX,
                    INDEXED, NUM_STAGES,
                )),
                (_consumer_partition, (
                    0, q_smem, k_smem, v_smem, meta, q_ready, q_empty, ready, empty, out_ptr,
                    o_desc, lse_ptr, qk_scale, num_reqs, num_tokens, out_stride_t,
                    out_stride_h, lse_stride_t, lse_stride_h, GROUP, GROUP_PAD, BLOCK_Q,
                    BLOCK_N, HEAD_DIM, HAS_LSE, NUM_STAGES, TMA_OUT,
                )),
                (_consumer_partition, (
                    1, q_smem, k_smem, v_smem, meta, q_ready, q_empty, ready, empty, out_ptr,
                    o_desc, lse_ptr, qk_scale, num_reqs, num_tokens, out_stride_t,
                    out_stride_h, lse_stride_t, lse_stride_h, GROUP, GROUP_PAD, BLOCK_Q,
                    BLOCK_N, HEAD_DIM, HAS_LSE, NUM_STAGES, TMA_OUT,
                )),
            ],
            [4, 4],
            [CONSUMER_REGS_C, CONSUMER_REGS_C],
        )
