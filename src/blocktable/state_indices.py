"""State-index view for Mamba-like groups: the block holding each request's last token."""

from __future__ import annotations

import torch

from blocktable.constants import NULL_BLOCK_ID


def gather_state_indices(
    table: torch.Tensor,
    counts: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    row_of_batch: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Write each request's state block (and the speculative blocks after it) into ``out``.

    ``out[i, s] = table[row_i, (seq_lens[i] - 1) // block_size + s]`` (the index clamped at 0),
    or ``NULL_BLOCK_ID`` past the row's filled entries, for pad rows ``i >= num_reqs`` and for
    a row outside ``[0, max_num_reqs)`` (read as an empty row: no device-side assert).

    Parameters
    ----------
    table : torch.Tensor
        int32 ``[max_num_reqs, width]`` device table of the state group.
    counts : torch.Tensor
        int32 ``[max_num_reqs]`` filled entries per row, same device.
    seq_lens : torch.Tensor
        int32 ``[num_reqs]`` tokens per request, same device.
    row_of_batch : torch.Tensor or None
        int32 ``[num_reqs]`` rows (indexed mode) or ``None`` (row = batch index).
    out : torch.Tensor
        int32 ``[num_reqs_padded, 1 + num_speculative_blocks]``.
    """
    num_reqs = seq_lens.numel()
    num_cols = out.shape[1]
    if row_of_batch is None:
        rows = torch.arange(num_reqs, device=table.device)
        live = None
    else:
        rows = row_of_batch.long()
        live = (rows >= 0) & (rows < table.shape[0])
        rows = torch.where(live, rows, 0)
    first = ((seq_lens.long() - 1) // block_size).clamp(min=0)
    cols = first[:, None] + torch.arange(num_cols, device=table.device)[None, :]
    filled = cols < counts[rows].long()[:, None]
    if live is not None:
        filled &= live[:, None]
    ids = table[rows[:, None], cols.clamp(max=table.shape[1] - 1)]
    out[:num_reqs] = torch.where(filled, ids, NULL_BLOCK_ID)
    out[num_reqs:] = NULL_BLOCK_ID
