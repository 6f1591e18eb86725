"""The local math of the attention merge: one Triton launch on CUDA, the same in torch on CPU.

Three operations, each reading and writing the merger's flat persistent buffers in the layouts
the collectives want (so no layout copy is needed around them):

- :meth:`MergeKernels.correct` (all-gather and all-reduce patterns): from every rank's LSE
  ``lse_all`` (float32 ``[world, T, H]``) compute the merged LSE and scale this rank's partial
  output by ``exp(lse_rank - lse)``, written head-group-major ``[H // hpg, T, hpg, D]`` (the
  reduce-scatter's chunks are then head slices; ``hpg = H`` gives ``[T, H, D]``).
- :meth:`MergeKernels.pack` (all-to-all pattern): lay out ``out`` and ``lse`` as one chunk per
  destination rank, the LSE beside the output (:class:`A2ALayout`).
- :meth:`MergeKernels.merge` (all-to-all pattern): merge the chunks received from every rank
  into this rank's head slice ``[T, hpr, D]`` and its LSE.

Accumulation is float32; a row whose weight is zero contributes exactly nothing (garbage or NaN
in an empty shard's output row never leaks into the result).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blocktable._triton import (
    HAS_TRITON,
    Launcher,
    cdiv,
    next_power_of_2,
    resolve_backend,
    tl,
    triton,
)

NEG_INF = float("-inf")
# Elements a program handles: ROWS (token, head) rows of BLOCK_D.
_TILE_ELEMS = 4096


@dataclass(frozen=True)
class A2ALayout:
    """Where each rank's chunk of the all-to-all buffer keeps its output and its LSE.

    The buffer holds ``world`` chunks of ``num_tokens * chunk_pitch`` elements (of the output
    dtype); chunk ``w`` goes to rank ``w`` and holds, for heads ``[w*hpr, (w+1)*hpr)``, the
    output as ``[num_tokens, out_pitch]`` (the first ``hpr * head_dim`` of each row used) then
    the float32 LSE as ``[num_tokens, lse_pitch]`` (the first ``hpr`` used). Pitches are padded
    to 16 bytes so every chunk and region stays 16-byte aligned for any ``num_tokens``.
    """

    world_size: int
    heads_per_rank: int
    head_dim: int
    elem_bytes: int

    @property
    def out_pitch(self) -> int:
        """Output elements per token in a chunk."""
        nbytes = self.heads_per_rank * self.head_dim * self.elem_bytes
        return -(-nbytes // 16) * 16 // self.elem_bytes

    @property
    def lse_pitch(self) -> int:
        """float32 LSE values per token in a chunk."""
        return -(-self.heads_per_rank // 4) * 4

    @property
    def chunk_pitch(self) -> int:
        """Elements (of the output dtype) per token in a chunk."""
        return self.out_pitch + self.lse_pitch * 4 // self.elem_bytes

    @property
    def out_f32(self) -> int:
        """``out_pitch`` in float32 units (the LSE region starts ``num_tokens * out_f32`` in)."""
        return self.out_pitch * self.elem_bytes // 4

    @property
    def chunk_f32(self) -> int:
        """``chunk_pitch`` in float32 units."""
        return self.chunk_pitch * self.elem_bytes // 4

    def numel(self, num_tokens: int) -> int:
        """Elements of the whole buffer (every chunk) for ``num_tokens`` tokens."""
        return self.world_size * num_tokens * self.chunk_pitch


if HAS_TRITON:
    _NEG_INF = tl.constexpr(NEG_INF)  # kernels read globals only as constexprs

    @triton.jit(do_not_specialize=["num_tokens"])
    def _correct_kernel(
        out_ptr,  # [T, H, D] (strided), the partial output of this rank
        lse_all_ptr,  # float32 [WORLD, T, H], every rank's LSE
        dst_ptr,  # [H // HPG, T, HPG, D], out dtype
        lse_out_ptr,  # float32 [T, H] (written when WRITE_LSE)
        num_tokens,
        stride_out_t,
        stride_out_h,
        WORLD: tl.constexpr,
        RANK: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        HPG: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr,
        WRITE_LSE: tl.constexpr,
        OUT_ALIGNED: tl.constexpr,  # only keys the launcher cache on out_ptr's alignment
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # row = t * H + h
        num_rows = num_tokens * NUM_HEADS
        valid = rows < num_rows
        t = rows // NUM_HEADS
        h = rows % NUM_HEADS
        m = tl.full([ROWS], _NEG_INF, tl.float32)
        s = tl.zeros([ROWS], tl.float32)
        own = tl.full([ROWS], _NEG_INF, tl.float32)
        for w in tl.static_range(WORLD):  # online max and sum, one load per rank
            lse_w = tl.load(lse_all_ptr + w * num_rows + rows, mask=valid, other=_NEG_INF)
            m_new = tl.maximum(m, lse_w)
            base = tl.where(m_new == _NEG_INF, 0.0, m_new)  # all -inf so far: exp() gives 0
            s = s * tl.exp(m - base) + tl.exp(lse_w - base)
            m = m_new
            if w == RANK:
                own = lse_w
        s_safe = tl.where(s > 0, s, 1.0)
        factor = tl.exp(own - tl.where(m == _NEG_INF, 0.0, m)) / s_safe
        d = tl.arange(0, BLOCK_D)
        mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        src = t.to(tl.int64) * stride_out_t + h.to(tl.int64) * stride_out_h
        o = tl.load(out_ptr + src[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.where(factor[:, None] > 0, o * factor[:, None], 0.0)
        g = h // HPG
        dst = g.to(tl.int64) * (num_tokens * (HPG * HEAD_DIM)) + (t * HPG + h % HPG) * HEAD_DIM
        tl.store(dst_ptr + dst[:, None] + d[None, :], y.to(dst_ptr.dtype.element_ty), mask=mask)
        if WRITE_LSE:
            tl.store(lse_out_ptr + rows, tl.where(s > 0, m + tl.log(s_safe), _NEG_INF), mask=valid)

    @triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["lse_ptr"])
    def _pack_kernel(
        out_ptr,  # [T, H, D] (strided)
        lse_ptr,  # float32 [T, H] (strided)
        send_ptr,  # the all-to-all buffer, out dtype
        send_f32_ptr,  # the same buffer seen as float32
        num_tokens,
        stride_out_t,
        stride_out_h,
        stride_lse_t,
        stride_lse_h,
        NUM_HEADS: tl.constexpr,
        HPR: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        OUT_PITCH: tl.constexpr,
        LSE_PITCH: tl.constexpr,
        CHUNK_PITCH: tl.constexpr,
        OUT_F32: tl.constexpr,
        CHUNK_F32: tl.constexpr,
        ROWS: tl.constexpr,
        OUT_ALIGNED: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        valid = rows < num_tokens * NUM_HEADS
        t = rows // NUM_HEADS
        h = rows % NUM_HEADS
        w = h // HPR
        hs = h % HPR
        d = tl.arange(0, BLOCK_D)
        mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        src = t.to(tl.int64) * stride_out_t + h.to(tl.int64) * stride_out_h
        o = tl.load(out_ptr + src[:, None] + d[None, :], mask=mask, other=0.0)
        dst = w.to(tl.int64) * (num_tokens * CHUNK_PITCH) + t * OUT_PITCH + hs * HEAD_DIM
        tl.store(send_ptr + dst[:, None] + d[None, :], o, mask=mask)
        lse = tl.load(lse_ptr + t * stride_lse_t + h * stride_lse_h, mask=valid, other=_NEG_INF)
        lse_dst = w * (num_tokens * CHUNK_F32) + num_tokens * OUT_F32 + t * LSE_PITCH + hs
        tl.store(send_f32_ptr + lse_dst, lse, mask=valid)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _merge_kernel(
        recv_ptr,  # the received all-to-all buffer, out dtype
        recv_f32_ptr,  # the same buffer seen as float32
        dst_ptr,  # [>= DST_SLOT + 1, T, HPR, D], out dtype
        lse_out_ptr,  # float32 [>= DST_SLOT + 1, T, HPR] (written when WRITE_LSE)
        num_tokens,
        WORLD: tl.constexpr,
        HPR: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        OUT_PITCH: tl.constexpr,
        LSE_PITCH: tl.constexpr,
        CHUNK_PITCH: tl.constexpr,
        OUT_F32: tl.constexpr,
        CHUNK_F32: tl.constexpr,
        DST_SLOT: tl.constexpr,
        ROWS: tl.constexpr,
        WRITE_LSE: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # row = t * HPR + hs
        valid = rows < num_tokens * HPR
        t = rows // HPR
        hs = rows % HPR
        d = tl.arange(0, BLOCK_D)
        mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        m = tl.full([ROWS], _NEG_INF, tl.float32)
        s = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        for w in tl.static_range(WORLD):
            lse_at = w * (num_tokens * CHUNK_F32) + num_tokens * OUT_F32 + t * LSE_PITCH + hs
            lse_w = tl.load(recv_f32_ptr + lse_at, mask=valid, other=_NEG_INF)
            at = w * (num_tokens * CHUNK_PITCH) + t * OUT_PITCH + hs * HEAD_DIM
            o = tl.load(recv_ptr + at[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, lse_w)
            base = tl.where(m_new == _NEG_INF, 0.0, m_new)
            keep = tl.exp(m - base)
            add = tl.exp(lse_w - base)
            s = s * keep + add
            acc = acc * keep[:, None] + tl.where(add[:, None] > 0, o * add[:, None], 0.0)
            m = m_new
        s_safe = tl.where(s > 0, s, 1.0)
        res = acc / s_safe[:, None]
        dst = DST_SLOT * (num_tokens * (HPR * HEAD_DIM)) + rows * HEAD_DIM
        tl.store(dst_ptr + dst[:, None] + d[None, :], res.to(dst_ptr.dtype.element_ty), mask=mask)
        if WRITE_LSE:
            lse = tl.where(s > 0, m + tl.log(s_safe), _NEG_INF)
            tl.store(lse_out_ptr + DST_SLOT * (num_tokens * HPR) + rows, lse, mask=valid)


def _rows_per_program(head_dim: int) -> int:
    return max(1, min(64, _TILE_ELEMS // next_power_of_2(head_dim)))


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def merge_weights(lse_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged LSE and each rank's normalized weight ``exp(lse_r - lse)``, in torch.

    ``lse_all`` is float32 ``[world, ...]``; returns ``lse [...]`` (``-inf`` where every rank is
    ``-inf``) and ``weight [world, ...]`` (0 there).
    """
    m = lse_all.amax(dim=0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(lse_all - m)
    s = e.sum(dim=0)
    weight = torch.where(s > 0, e / s, torch.zeros_like(e))
    return m + torch.log(s), weight


class MergeKernels:
    """The three local operations of the merge, on one backend (``"triton"`` or ``"torch"``).

    One instance per merger: its launchers' caches are keyed without the tensors' dtypes, so an
    instance must always see the same output dtype.

    Parameters
    ----------
    backend : str
        ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.
    device : torch.device
        Where the tensors live.
    """

    def __init__(self, backend: str, device: torch.device) -> None:
        self.backend = resolve_backend(backend, device)
        if self.backend == "triton":
            self._correct = Launcher(_correct_kernel, dynamic=(4,))
            self._pack = Launcher(_pack_kernel, dynamic=(4,))
            self._merge = Launcher(_merge_kernel, dynamic=(4,))

    def correct(
        self,
        out: torch.Tensor,
        lse_all: torch.Tensor,
        dst: torch.Tensor,
        lse_out: torch.Tensor | None,
        *,
        rank: int,
        world_size: int,
        heads_per_group: int,
    ) -> None:
        """Scale this rank's ``out`` by its merge weight into ``dst``; merged LSE to ``lse_out``.

        Parameters
        ----------
        out : torch.Tensor
            ``[T, H, D]``, unit stride in the last dim.
        lse_all : torch.Tensor
            float32, flat, at least ``world_size * T * H``: every rank's LSE as ``[world, T, H]``.
        dst : torch.Tensor
            ``out``'s dtype, flat, at least ``T * H * D``: written as ``[H // hpg, T, hpg, D]``.
        lse_out : torch.Tensor or None
            float32, flat, at least ``T * H``: the merged LSE ``[T, H]``.
        """
        num_tokens, num_heads, head_dim = out.shape
        if num_tokens == 0:
            return
        if self.backend == "torch":
            lse, weight = merge_weights(lse_all[: world_size * num_tokens * num_heads].view(
                world_size, num_tokens, num_heads))
            factor = weight[rank][..., None]
            y = torch.where(factor > 0, out.float() * factor, torch.zeros((), device=out.device))
            view = dst[: num_tokens * num_heads * head_dim].view(
                num_heads // heads_per_group, num_tokens, heads_per_group, head_dim)
            view.copy_(y.unflatten(1, (num_heads // heads_per_group, heads_per_group)).transpose(0, 1))
            if lse_out is not None:
                lse_out[: num_tokens * num_heads].view(num_tokens, num_heads).copy_(lse)
            return
        rows = _rows_per_program(head_dim)
        self._correct(
            (cdiv(num_tokens * num_heads, rows),),
            out, lse_all, dst, lse_all if lse_out is None else lse_out,
            num_tokens, out.stride(0), out.stride(1),
            world_size, rank, num_heads, heads_per_group, head_dim, next_power_of_2(head_dim),
            rows, lse_out is not None, _aligned(out),
        )

    def pack(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        send: torch.Tensor,
        send_f32: torch.Tensor,
        layout: A2ALayout,
    ) -> None:
        """Write ``out`` ``[T, H, D]`` and ``lse`` float32 ``[T, H]`` into the all-to-all buffer
        ``send`` (flat, ``out``'s dtype; ``send_f32`` is the same memory seen as float32)."""
        num_tokens, num_heads, head_dim = out.shape
        if num_tokens == 0:
            return
        world, hpr = layout.world_size, layout.heads_per_rank
        if self.backend == "torch":
            chunks = send[: layout.numel(num_tokens)].view(world, num_tokens * layout.chunk_pitch)
            outs = chunks[:, : num_tokens * layout.out_pitch].view(world, num_tokens, -1)
            outs[:, :, : hpr * head_dim].view(world, num_tokens, hpr, head_dim).copy_(
                out.unflatten(1, (world, hpr)).transpose(0, 1))
            self._lse_region(send_f32, layout, num_tokens).copy_(
                lse.unflatten(1, (world, hpr)).transpose(0, 1))
            return
        rows = _rows_per_program(head_dim)
        self._pack(
            (cdiv(num_tokens * num_heads, rows),),
            out, lse, send, send_f32,
            num_tokens, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            num_heads, hpr, head_dim, next_power_of_2(head_dim), layout.out_pitch,
            layout.lse_pitch, layout.chunk_pitch, layout.out_f32, layout.chunk_f32, rows,
            _aligned(out),
        )

    def merge(
        self,
        recv: torch.Tensor,
        recv_f32: torch.Tensor,
        dst: torch.Tensor,
        lse_out: torch.Tensor | None,
        layout: A2ALayout,
        *,
        num_tokens: int,
        dst_slot: int,
    ) -> None:
        """Merge the received chunks into ``dst`` (flat; slot ``dst_slot`` of
        ``[*, T, hpr, D]``) and the merged LSE into ``lse_out`` (flat; slot ``dst_slot`` of
        ``[*, T, hpr]``)."""
        if num_tokens == 0:
            return
        world, hpr, head_dim = layout.world_size, layout.heads_per_rank, layout.head_dim
        if self.backend == "torch":
            chunks = recv[: layout.numel(num_tokens)].view(world, num_tokens * layout.chunk_pitch)
            outs = chunks[:, : num_tokens * layout.out_pitch].view(world, num_tokens, -1)
            o = outs[:, :, : hpr * head_dim].view(world, num_tokens, hpr, head_dim).float()
            lse, weight = merge_weights(self._lse_region(recv_f32, layout, num_tokens))
            w = weight[..., None]
            res = torch.where(w > 0, o * w, torch.zeros((), device=o.device)).sum(dim=0)
            n = num_tokens * hpr
            dst[dst_slot * n * head_dim: (dst_slot + 1) * n * head_dim].view_as(res).copy_(res)
            if lse_out is not None:
                lse_out[dst_slot * n: (dst_slot + 1) * n].view_as(lse).copy_(lse)
            return
        rows = _rows_per_program(head_dim)
        self._merge(
            (cdiv(num_tokens * hpr, rows),),
            recv, recv_f32, dst, recv_f32 if lse_out is None else lse_out,
            num_tokens, world, hpr, head_dim, next_power_of_2(head_dim), layout.out_pitch,
            layout.lse_pitch, layout.chunk_pitch, layout.out_f32, layout.chunk_f32, dst_slot,
            rows, lse_out is not None,
        )

    @staticmethod
    def _lse_region(buf_f32: torch.Tensor, layout: A2ALayout, num_tokens: int) -> torch.Tensor:
        """The LSE region of every chunk, ``[world, T, hpr]`` (a strided view of ``buf_f32``)."""
        chunks = buf_f32[: layout.world_size * num_tokens * layout.chunk_f32].view(
            layout.world_size, num_tokens * layout.chunk_f32)
        start = num_tokens * layout.out_f32
        region = chunks[:, start: start + num_tokens * layout.lse_pitch]
        return region.view(layout.world_size, num_tokens, layout.lse_pitch)[:, :, : layout.heads_per_rank]
