"""The peer-to-peer merge kernel: push, flag, wait, merge, in one Triton launch per rank.

Every rank runs the same grid of ``P`` programs. Program ``p`` owns the token tiles
``p, p + P, p + 2P, ...`` (a tile is ``TOK`` whole tokens, every head) on every rank, so the
program ``p`` of each rank only ever talks to the programs ``p`` of the others:

1. wait until every peer's program ``p`` has finished reading what this program pushed to it
   in the previous call (the peer's *done* flag, in this rank's buffer);
2. push: store this rank's partial output rows and LSEs of its tiles into each peer's symmetric
   buffer, slot ``rank`` (only the heads that peer merges, or every head);
3. raise the *ready* flag of this program in every peer's buffer (release, system scope);
4. wait for every peer's *ready* flag in this rank's buffer (acquire, system scope);
5. merge its tiles: this rank's own rows from the caller's tensors, the peers' from this rank's
   buffer, the same float32 online max/sum as the collective merge, one rounding at the end;
6. raise the *done* flag in every peer's buffer; remember the call count.

Flags hold the call count (the *epoch*) of program ``p``, kept on the device (so a CUDA graph
replays correctly): ``ready == e`` and ``done == e - 1`` are exactly what a waiter needs, and a
flag is only ever written by one program of one rank. The buffer layout does not depend on the
number of tokens of a call, so calls of any size follow each other safely. The grid must fit on
the GPU at once (every program spins on its peer's): ``P`` is at most a few programs per SM.

A wait that lasts longer than ``TIMEOUT_NS`` (a dead or absent peer) executes ``trap``: the
kernel fails, and the CUDA context with it, instead of hanging.
"""

from __future__ import annotations

from blocktable._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    _NEG_INF = tl.constexpr(float("-inf"))

    @triton.jit
    def _globaltimer():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def _trap():
        tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _wait_flag(flag_ptr, expected, TIMEOUT_NS: tl.constexpr):
        """Spin until ``*flag_ptr == expected`` (acquire, system scope); trap past the timeout.

        The poll is a compare-and-swap of ``expected`` with itself: it never changes another
        value, so it cannot lose the owner's concurrent write.
        """
        seen = tl.atomic_cas(flag_ptr, expected, expected, sem="acquire", scope="sys")
        if TIMEOUT_NS > 0:
            start = _globaltimer()
            while seen != expected:
                seen = tl.atomic_cas(flag_ptr, expected, expected, sem="acquire", scope="sys")
                if _globaltimer() - start > TIMEOUT_NS:
                    _trap()
        else:
            while seen != expected:
                seen = tl.atomic_cas(flag_ptr, expected, expected, sem="acquire", scope="sys")

    @triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["lse_ptr"])
    def _p2p_merge_kernel(
        out_ptr,  # [T, H, D] (strided), this rank's partial output
        lse_ptr,  # float32 [T, H] (strided), its LSE
        sym_out_ptr,  # this rank's symmetric buffer, seen as the out dtype
        sym_f32_ptr,  # the same buffer seen as float32
        sym_i32_ptr,  # the same buffer seen as int32 (flags at its start)
        delta16_ptr,  # int64 [WORLD]: peer buffer address minus this one's, in 16-byte units
        epoch_ptr,  # int32 [P]: calls made by each program
        res_ptr,  # [T, HR, D] contiguous, the merged output of this rank's heads
        res_lse_ptr,  # float32 [T, HR] (written when WRITE_LSE)
        num_tokens,
        stride_out_t,
        stride_out_h,
        stride_lse_t,
        stride_lse_h,
        WORLD: tl.constexpr,
        RANK: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HPR: tl.constexpr,  # heads merged by each rank when not ALL_HEADS
        ALL_HEADS: tl.constexpr,  # every rank merges every head
        HR: tl.constexpr,  # heads merged here: NUM_HEADS if ALL_HEADS else HPR
        HEAD_LO: tl.constexpr,  # the first of them: 0 if ALL_HEADS else RANK * HPR
        TOK: tl.constexpr,  # tokens per tile
        PUSH_ROWS: tl.constexpr,  # next_power_of_2(TOK * NUM_HEADS)
        MERGE_ROWS: tl.constexpr,  # next_power_of_2(TOK * HR)
        MAX_TOKENS: tl.constexpr,
        LSE_OFF: tl.constexpr,  # float32 offset of the LSE slots [WORLD, MAX_TOKENS, H]
        OUT_OFF: tl.constexpr,  # out-dtype offset of the output slots [WORLD, MAX_TOKENS, H, D]
        ELEMS_16B: tl.constexpr,  # out-dtype elements in 16 bytes
        WRITE_LSE: tl.constexpr,
        TIMEOUT_NS: tl.constexpr,
        OUT_ALIGNED: tl.constexpr,  # only keys the launcher cache on out_ptr's alignment
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        epoch = tl.load(epoch_ptr + pid) + 1
        ready_at = pid * WORLD  # flags [2, P, WORLD] int32: ready, then done
        done_at = (nprog + pid) * WORLD
        num_tiles = (num_tokens + TOK - 1) // TOK

        # 1. Every peer has read what this program pushed last call.
        for q in tl.static_range(WORLD):
            if q != RANK:
                _wait_flag(sym_i32_ptr + done_at + q, epoch - 1, TIMEOUT_NS)
        tl.debug_barrier()

        # 2. Push this rank's rows (the heads each peer merges) into the peers' slot RANK.
        j = tl.arange(0, PUSH_ROWS)
        d = tl.arange(0, BLOCK_D)
        tile = pid
        while tile < num_tiles:
            t = tile * TOK + j // NUM_HEADS
            h = j % NUM_HEADS
            valid = (j < TOK * NUM_HEADS) & (t < num_tokens)
            mask = valid[:, None] & (d[None, :] < HEAD_DIM)
            src = t.to(tl.int64) * stride_out_t + h.to(tl.int64) * stride_out_h
            o = tl.load(out_ptr + src[:, None] + d[None, :], mask=mask, other=0.0)
            lse = tl.load(lse_ptr + t.to(tl.int64) * stride_lse_t + h * stride_lse_h, mask=valid,
                          other=_NEG_INF)
            row = (RANK * MAX_TOKENS + t.to(tl.int64)) * NUM_HEADS + h
            for q in tl.static_range(WORLD):
                if q != RANK:
                    delta = tl.load(delta16_ptr + q)
                    if ALL_HEADS:
                        mine = valid
                    else:
                        mine = valid & (h // HPR == q)
                    out_q = sym_out_ptr + delta * ELEMS_16B + OUT_OFF
                    tl.store(out_q + row[:, None] * HEAD_DIM + d[None, :], o,
                             mask=mine[:, None] & (d[None, :] < HEAD_DIM))
                    tl.store(sym_f32_ptr + delta * 4 + LSE_OFF + row, lse, mask=mine)
            tile += nprog
        tl.debug_barrier()

        # 3. Ready flags up (release: the pushes above are visible first), 4. peers' awaited.
        for q in tl.static_range(WORLD):
            if q != RANK:
                delta = tl.load(delta16_ptr + q)
                tl.atomic_xchg(sym_i32_ptr + delta * 4 + ready_at + RANK, epoch, sem="release",
                               scope="sys")
        for q in tl.static_range(WORLD):
            if q != RANK:
                _wait_flag(sym_i32_ptr + ready_at + q, epoch, TIMEOUT_NS)
        tl.debug_barrier()

        # 5. Merge this program's tiles: float32 online max and sum over the ranks.
        k = tl.arange(0, MERGE_ROWS)
        tile = pid
        while tile < num_tiles:
            t = tile * TOK + k // HR
            hl = k % HR
            h = HEAD_LO + hl
            valid = (k < TOK * HR) & (t < num_tokens)
            mask = valid[:, None] & (d[None, :] < HEAD_DIM)
            t64 = t.to(tl.int64)
            m = tl.full([MERGE_ROWS], _NEG_INF, tl.float32)
            s = tl.zeros([MERGE_ROWS], tl.float32)
            acc = tl.zeros([MERGE_ROWS, BLOCK_D], tl.float32)
            for w in tl.static_range(WORLD):
                if w == RANK:
                    lse_w = tl.load(lse_ptr + t64 * stride_lse_t + h * stride_lse_h, mask=valid,
                                    other=_NEG_INF)
                    src = t64 * stride_out_t + h.to(tl.int64) * stride_out_h
                    o = tl.load(out_ptr + src[:, None] + d[None, :], mask=mask, other=0.0)
                else:
                    row = (w * MAX_TOKENS + t64) * NUM_HEADS + h
                    lse_w = tl.load(sym_f32_ptr + LSE_OFF + row, mask=valid, other=_NEG_INF,
                                    cache_modifier=".cg")
                    o = tl.load(sym_out_ptr + OUT_OFF + row[:, None] * HEAD_DIM + d[None, :],
                                mask=mask, other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m, lse_w)
                base = tl.where(m_new == _NEG_INF, 0.0, m_new)  # all -inf so far: exp() gives 0
                keep = tl.exp(m - base)
                add = tl.exp(lse_w - base)
                s = s * keep + add
                acc = acc * keep[:, None] + tl.where(add[:, None] > 0,
                                                     o.to(tl.float32) * add[:, None], 0.0)
                m = m_new
            s_safe = tl.where(s > 0, s, 1.0)
            res = acc / s_safe[:, None]
            dst = (t64 * HR + hl) * HEAD_DIM
            tl.store(res_ptr + dst[:, None] + d[None, :], res.to(res_ptr.dtype.element_ty),
                     mask=mask)
            if WRITE_LSE:
                tl.store(res_lse_ptr + t64 * HR + hl, tl.where(s > 0, m + tl.log(s_safe),
                                                                _NEG_INF), mask=valid)
            tile += nprog
        tl.debug_barrier()

        # 6. Done reading the peers' pushes: tell them (release orders the loads above first).
        for q in tl.static_range(WORLD):
            if q != RANK:
                delta = tl.load(delta16_ptr + q)
                tl.atomic_xchg(sym_i32_ptr + delta * 4 + done_at + RANK, epoch, sem="release",
                               scope="sys")
        tl.store(epoch_ptr + pid, epoch)
