"""The single-group block table users build directly: :class:`BlockTable`.

It is the one-group view (:class:`~blocktable.table.GroupTable`) over a private one-group
:class:`~blocktable.multi_group.MultiGroupBlockTable`, to which it forwards ``commit`` and
``compute_slot_mapping``.
"""

from __future__ import annotations

import torch

from blocktable.config import CPConfig, GroupSpec
from blocktable.multi_group import MultiGroupBlockTable
from blocktable.table import GroupTable


class BlockTable(GroupTable):
    """Rows of kernel block ids for one KV cache group, with their own buffers, commit and
    slot mapping (vLLM's ``BlockTable``)."""

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        *,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 8192,
        device: str | torch.device = "cpu",
        kernel_block_size: int | None = None,
        max_num_blocks: int | None = None,
        num_blocks: int | None = None,
        cp: CPConfig | None = None,
        backend: str = "auto",
        commit_staging_entries: int | None = None,
        debug: bool = False,
    ) -> None:
        """Standalone single-group table.

        Everything after ``max_num_reqs`` is keyword-only: vLLM's ``BlockTable`` takes
        ``max_num_blocks_per_req`` third, where a positional ``max_model_len`` would silently
        give another width (``blocktable.compat.BlockTable`` takes vLLM's positional form).
        ``block_size``, ``kernel_block_size``, ``max_num_blocks`` (the width in manager
        blocks) and ``num_blocks`` as in :class:`GroupSpec`, the rest as in
        :class:`MultiGroupBlockTable`.
        """
        spec = GroupSpec(
            block_size=block_size,
            kernel_block_size=kernel_block_size,
            max_num_blocks=max_num_blocks,
            num_blocks=num_blocks,
        )
        owner = MultiGroupBlockTable(
            [spec], max_num_reqs, max_model_len, max_num_batched_tokens, device, cp=cp,
            backend=backend, commit_staging_entries=commit_staging_entries, debug=debug,
        )
        super().__init__(owner, 0)


__all__ = ["BlockTable"]
