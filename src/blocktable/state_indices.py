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
    or ``NULL_BLOCK_ID`` past the row's filled entries and for pad rows ``i >= num_reqs``.

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
    rows = (
        torch.arange(num_reqs, device=table.device)
        if row_of_batch is None
        else row_of_batch.long()
    )
    first = ((seq_lens.long() - 1) // block_size).clamp(min=0)
    cols = first[:, None] + torch.arange(num_cols, device=table.device)[None, :]
    filled = cols < counts[rows].long()[:, None]
    ids = table[rows[:, None], cols.clamp(max=table.shape[1] - 1)]
    out[:num_reqs] = torch.where(filled, ids, NULL_BLOCK_ID)
    out[num_reqs:] = NULL_BLOCK_ID
