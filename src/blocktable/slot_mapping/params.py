"""Per-group parameters of the slot-mapping math, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


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

    @property
    def powers_of_two(self) -> bool:
        """Every size is a power of two, so the kernel may shift and mask instead of divide."""
        return all(
            _is_pow2(n)
            for n in (
                self.kernel_block_size,
                self.blocks_per_manager_block,
                self.cp_world_size,
                self.cp_interleave,
            )
        )


NUM_PARAM_FIELDS = 12


def pack_params(groups: list[SlotGroupParams], device: torch.device) -> torch.Tensor:
    """int32 ``[num_groups, 12]`` on ``device``: one row of parameters per group, for kernels.

    Fields: table offset, width, counts offset, kernel block size ``K``, kernel blocks per
    manager block ``k``, CP world ``W``, rank, interleave ``I``, then ``log2`` of ``K``, ``k``,
    ``W`` and ``I`` (0 where not a power of two).
    """
    rows = []
    for g in groups:
        sizes = (g.kernel_block_size, g.blocks_per_manager_block, g.cp_world_size, g.cp_interleave)
        logs = [n.bit_length() - 1 if _is_pow2(n) else 0 for n in sizes]
        rows.append([g.table_offset, g.width, g.counts_offset, *sizes[:3], g.cp_rank,
                     g.cp_interleave, *logs])
    if not rows:
        return torch.zeros(0, NUM_PARAM_FIELDS, dtype=torch.int32, device=device)
    return torch.tensor(rows, dtype=torch.int32, device=device)
