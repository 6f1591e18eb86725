"""Indexed mode: gather table rows into batch order on the device (pad rows = null block)."""

from __future__ import annotations

import torch

from blocktable._triton import HAS_TRITON, Launcher, cdiv, next_power_of_2, tl, triton
from blocktable.constants import NULL_BLOCK_ID


def gather_rows(
    backend: str, table: torch.Tensor, row_of_batch: torch.Tensor, out: torch.Tensor
) -> None:
    """``out[i] = table[row_of_batch[i]]`` for ``i < num_reqs``; ``out[num_reqs:] = NULL``.

    A row outside ``[0, max_num_reqs)`` reads as an empty row (all ``NULL_BLOCK_ID``): no
    read outside the table, no device-side assert.

    Parameters
    ----------
    table : torch.Tensor
        int32 ``[max_num_reqs, width]`` device table.
    row_of_batch : torch.Tensor
        int32 ``[num_reqs]`` rows, same device.
    out : torch.Tensor
        int32 ``[num_reqs_padded, width]``, contiguous rows, same device.
    """
    num_reqs = row_of_batch.numel()
    if backend == "triton":
        width = table.shape[1]
        block = min(1024, next_power_of_2(max(width, 16)))
        grid = (out.shape[0], cdiv(width, block))
        if out.shape[0] == 0:
            return
        _launch_gather(grid, table, row_of_batch, out, num_reqs, width, table.shape[0], block)
        return
    rows = row_of_batch.long()
    live = (rows >= 0) & (rows < table.shape[0])
    gathered = table[torch.where(live, rows, 0)]
    out[:num_reqs] = torch.where(live[:, None], gathered, NULL_BLOCK_ID)
    out[num_reqs:] = NULL_BLOCK_ID


if HAS_TRITON:
    _NULL = tl.constexpr(NULL_BLOCK_ID)  # kernels read globals only as constexprs

    # table: a group's view inside the flat buffer; row_of_batch: the caller's tensor. Neither
    # address is specialized on its alignment (the cached launcher does not key on it).
    @triton.jit(
        do_not_specialize=["num_reqs"],
        do_not_specialize_on_alignment=["table_ptr", "row_of_batch_ptr"],
    )
    def _gather_rows_kernel(
        table_ptr, row_of_batch_ptr, out_ptr, num_reqs, width, max_num_reqs, BLOCK: tl.constexpr
    ):
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < width
        row = tl.load(row_of_batch_ptr + i, mask=i < num_reqs, other=-1).to(tl.int64)
        row = tl.full([BLOCK], 0, tl.int64) + row  # a vector, so the mask below is one
        live = (row >= 0) & (row < max_num_reqs)
        ids = tl.load(table_ptr + row * width + cols, mask=in_row & live, other=_NULL)
        tl.store(out_ptr + i * width + cols, ids, mask=in_row)

    _launch_gather = Launcher(_gather_rows_kernel, dynamic=(3,))
