"""Vectorized torch slot mapping: the CPU backend, bit-identical to the reference."""

from __future__ import annotations

import torch

from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from blocktable.slot_mapping.params import SlotGroupParams


def slot_mapping_torch(
    flat_table: torch.Tensor,
    params: list[SlotGroupParams],
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    row_of_batch: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Fill ``out[g, :]`` with group ``g``'s slots, PAD past the tokens; all groups at once.

    Parameters
    ----------
    flat_table : torch.Tensor
        int32 ``[num_entries]``, the flat table buffer (tables and counts).
    query_start_loc : torch.Tensor
        int32 ``[num_reqs + 1]``, on ``flat_table``'s device.
    positions : torch.Tensor
        int64 ``[num_tokens]``.
    row_of_batch : torch.Tensor or None
        int32 ``[num_reqs]`` rows (indexed mode) or ``None`` (row = batch index).
    out : torch.Tensor
        int64 ``[len(params), max_num_tokens]``, written in full.
    """
    out.fill_(PAD_SLOT_ID)
    num_tokens = positions.numel()
    num_reqs = query_start_loc.numel() - 1
    if num_tokens == 0 or num_reqs <= 0:
        return
    device = positions.device
    tokens = torch.arange(num_tokens, device=device, dtype=torch.int64)
    qsl = query_start_loc.to(torch.int64)
    req = torch.searchsorted(qsl[1:], tokens, right=True)
    valid = (req < num_reqs) & (tokens >= qsl[0])
    req = req.clamp(max=num_reqs - 1)
    row = req if row_of_batch is None else row_of_batch.to(torch.int64)[req]
    pos = positions.clamp(min=0)
    valid &= positions >= 0
    for g, p in enumerate(params):
        if p.cp_world_size == 1:  # every token is this rank's: fewer ops (each costs µs on CPU)
            owned = valid.clone()  # updated in place below; valid serves every group
            local = pos
            block_index = pos // p.kernel_block_size
        else:
            virtual_block_size = p.manager_block_size * p.cp_world_size
            v = pos % virtual_block_size
            owned = valid & ((v // p.cp_interleave) % p.cp_world_size == p.cp_rank)
            local = (v // (p.cp_world_size * p.cp_interleave)) * p.cp_interleave + (
                v % p.cp_interleave
            )
            block_index = (pos // virtual_block_size) * p.blocks_per_manager_block + local // (
                p.kernel_block_size
            )
        num_filled = flat_table[p.counts_offset + row].to(torch.int64)
        owned &= block_index < num_filled
        block_index = block_index.clamp(max=p.width - 1)
        block_id = flat_table[p.table_offset + row * p.width + block_index].to(torch.int64)
        owned &= block_id != NULL_BLOCK_ID
        slot = block_id * p.kernel_block_size + local % p.kernel_block_size
        out[g, :num_tokens] = torch.where(owned, slot, PAD_SLOT_ID)
