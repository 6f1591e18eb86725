"""Per-group parameters of the slot-mapping math, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotGroupParams:
    """How one token-slot group turns positions into slots.

    All sizes in tokens except ``width`` (kernel blocks per row). ``table_offset`` and
    ``counts_offset`` index the flat table buffer (:class:`blocktable.storage.TableStorage`).
    """

    table_offset: int
    width: int
    counts_offset: int
    kernel_block_size: int
    manager_block_size: int
    cp_world_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1

    @property
    def blocks_per_manager_block(self) -> int:
        return self.manager_block_size // self.kernel_block_size


NUM_PARAM_FIELDS = 8


def pack_params(groups: list[SlotGroupParams], device: torch.device) -> torch.Tensor:
    """int64 ``[num_groups, 8]`` on ``device``: one row of parameters per group, for kernels."""
    rows = [
        [
            g.table_offset,
            g.width,
            g.counts_offset,
            g.kernel_block_size,
            g.blocks_per_manager_block,
            g.cp_world_size,
            g.cp_rank,
            g.cp_interleave,
        ]
        for g in groups
    ]
    if not rows:
        return torch.zeros(0, NUM_PARAM_FIELDS, dtype=torch.int64, device=device)
    return torch.tensor(rows, dtype=torch.int64, device=device)
