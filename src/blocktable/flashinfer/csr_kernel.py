"""The Triton kernel that writes FlashInfer's CSR page table, one program per request.

Launched through the cached :class:`~blocktable._triton.Launcher` (no argument binding per
call). Every pointer may be any slice of a caller's buffer, so none is specialized on its
alignment; the kernel reads and writes int32 elements one by one anyway.
"""

from __future__ import annotations

import torch

from blocktable._triton import HAS_TRITON, Launcher, tl, triton

if HAS_TRITON:

    @triton.jit(
        do_not_specialize_on_alignment=[
            "block_table_ptr", "seq_lens_ptr", "kv_indptr_ptr", "kv_indices_ptr",
            "kv_last_page_len_ptr",
        ],
    )
    def _flashinfer_page_table_kernel(
        block_table_ptr,
        seq_lens_ptr,
        kv_indptr_ptr,
        kv_indices_ptr,
        kv_last_page_len_ptr,
        width,
        page_size,
        indices_capacity,
        block_table_stride_r,
        block_table_stride_c,
        BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        # One program per request. Each sums the page counts of the requests before it:
        # O(num_reqs) per program, cheaper than a second launch for a scan at any batch size
        # an engine runs.
        req = tl.program_id(0)
        before = tl.zeros([BLOCK_R], dtype=tl.int32)
        for r0 in range(0, req, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            seq_len = tl.maximum(tl.load(seq_lens_ptr + r, mask=r < req, other=0), 0)
            before += tl.minimum(tl.cdiv(seq_len, page_size), width)
        start = tl.sum(before, axis=0)

        seq_len = tl.maximum(tl.load(seq_lens_ptr + req), 0)
        # Never read past the row, whatever seq_len says.
        num_pages = tl.minimum(tl.cdiv(seq_len, page_size), width)
        last_page_len = tl.minimum(seq_len - (num_pages - 1) * page_size, page_size)
        tl.store(kv_last_page_len_ptr + req, tl.where(num_pages > 0, last_page_len, 0))
        tl.store(kv_indptr_ptr + req + 1, start + num_pages)
        if req == 0:
            tl.store(kv_indptr_ptr, 0)

        row_ptr = block_table_ptr + req.to(tl.int64) * block_table_stride_r
        for p0 in range(0, num_pages, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            # Writes past the buffer are dropped (the host checks capacity where it can).
            mask = (p < num_pages) & (start + p < indices_capacity)
            ids = tl.load(row_ptr + p * block_table_stride_c, mask=mask)
            tl.store(kv_indices_ptr + start + p, ids, mask=mask)

    _launch = Launcher(_flashinfer_page_table_kernel)

_BLOCK_R = 1024
_BLOCK_P = 1024


def launch_flashinfer_page_table(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
) -> None:
    """One launch over ``seq_lens.shape[0] >= 1`` requests, on checked inputs."""
    stride_r, stride_c = block_table.stride()
    _launch(
        (seq_lens.shape[0],),
        block_table,
        seq_lens,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        block_table.shape[1],
        page_size,
        kv_indices.shape[0],
        stride_r,
        stride_c,
        _BLOCK_R,
        _BLOCK_P,
    )
