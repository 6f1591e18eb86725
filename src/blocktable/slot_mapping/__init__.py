"""Slot mapping: position -> KV slot for every scheduled token (``docs/layout.md``).

``reference`` defines the math in plain Python; ``torch_impl`` is the CPU backend (numpy);
``fused_kernel`` is the fused one-launch kernel for CUDA (and CPU under the interpreter).
"""

from __future__ import annotations

import torch

from blocktable.slot_mapping.inputs import SlotMappingError
from blocktable.slot_mapping.params import SlotGroupParams, pack_params
from blocktable.slot_mapping.reference import slot_mapping_reference, slot_of_position
from blocktable.slot_mapping.torch_impl import slot_mapping_torch


def compute_slots(
    backend: str,
    flat_table: torch.Tensor,
    params: list[SlotGroupParams],
    packed_params: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    row_of_batch: torch.Tensor | None,
    out: torch.Tensor,
    *,
    max_num_reqs: int,
    pow2: bool = False,
    has_cp: bool = True,
) -> None:
    """Fill ``out`` (int64 ``[num_groups, max_num_tokens]``) with the chosen backend.

    ``pow2`` (every size a power of two) and ``has_cp`` (some group sharded over ranks) select
    the Triton kernel's cheaper index math; the defaults are always correct.
    """
    if not params:
        return
    if backend == "triton":
        from blocktable.slot_mapping.fused_kernel import launch_slot_mapping

        launch_slot_mapping(
            flat_table, packed_params, query_start_loc, positions, row_of_batch, out,
            max_num_reqs=max_num_reqs,
            pow2=pow2,
            has_cp=has_cp,
        )
    else:
        slot_mapping_torch(flat_table, params, query_start_loc, positions, row_of_batch, out,
                           max_num_reqs=max_num_reqs)


__all__ = [
    "SlotGroupParams",
    "SlotMappingError",
    "compute_slots",
    "pack_params",
    "slot_mapping_reference",
    "slot_mapping_torch",
    "slot_of_position",
]
