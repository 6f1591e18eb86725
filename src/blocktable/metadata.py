"""The hand-off to attention: per group, the block table view and slot mapping of one step,
plus the host-side mirrors planners read without a device-to-host copy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """What one KV cache group's attention reads in one step.

    Groups share every field but ``group``, ``block_table_tensor``, ``slot_mapping`` and
    ``num_kernel_blocks_cpu``; :meth:`for_group` swaps those in and rebuilds nothing else.

    Attributes
    ----------
    num_reqs, num_reqs_padded, num_tokens : int
        Requests in the batch, rows the attention view has (pad rows hold the null block),
        scheduled tokens.
    query_start_loc : torch.Tensor
        int32 ``[num_reqs + 1]`` on the device.
    query_start_loc_cpu : torch.Tensor or None
        The same on the host.
    seq_lens : torch.Tensor or None
        int32 ``[num_reqs]`` tokens in the KV cache per request after this step, device.
    seq_lens_cpu : torch.Tensor or None
        The same on the host.
    block_table_tensor : torch.Tensor
        int32 ``[num_reqs_padded, width]`` on the device (kernel block ids).
    slot_mapping : torch.Tensor or None
        int64 ``[max_num_batched_tokens]`` on the device (``None`` for state groups).
    num_kernel_blocks_cpu : np.ndarray or None
        int32 ``[num_reqs]`` on the host: filled kernel blocks of each request's row. ``None``
        in indexed mode on CUDA without a host copy of ``row_of_batch``.
    """

    group: int
    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor | None
    seq_lens: torch.Tensor | None
    seq_lens_cpu: torch.Tensor | None
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor | None
    num_kernel_blocks_cpu: np.ndarray | None

    def for_group(
        self,
        group: int,
        block_table_tensor: torch.Tensor,
        slot_mapping: torch.Tensor | None,
        num_kernel_blocks_cpu: np.ndarray | None,
    ) -> AttentionMetadata:
        """This step's metadata for another group: only its table and slots change."""
        return dataclasses.replace(
            self,
            group=group,
            block_table_tensor=block_table_tensor,
            slot_mapping=slot_mapping,
            num_kernel_blocks_cpu=num_kernel_blocks_cpu,
        )
