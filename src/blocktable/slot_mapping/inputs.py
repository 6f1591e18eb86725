"""Checks of a slot-mapping call's inputs, and debug mode's report of unmapped tokens."""

from __future__ import annotations

import numpy as np
import torch

from blocktable._checks import check_row_of_batch, check_tensor
from blocktable.constants import PAD_SLOT_ID
from blocktable.slot_mapping.params import SlotGroupParams
from blocktable.slot_mapping.reference import slot_of_position


class SlotMappingError(ValueError):
    """Debug mode found tokens with a negative position or a position past their row's blocks."""


def check_slot_inputs(
    qsl: torch.Tensor,
    positions: torch.Tensor,
    row_of_batch: torch.Tensor | None,
    qsl_cpu: torch.Tensor | None,
    *,
    device: torch.device,
    max_num_reqs: int,
    max_num_tokens: int,
    check_device_values: bool,
    row_of_batch_cpu: np.ndarray | torch.Tensor | None = None,
) -> None:
    """Raise if the inputs of :meth:`MultiGroupBlockTable.compute_slot_mapping` are bad.

    Types, shapes, devices and sizes are always checked. The *values* of ``query_start_loc``
    (starts at 0, never decreases, ends at ``num_tokens``) are checked from ``qsl_cpu`` when
    given or when the tensors are on the CPU, and ``row_of_batch``'s rows from
    ``row_of_batch_cpu`` or a CPU ``row_of_batch``; values of device tensors only with
    ``check_device_values`` (debug mode: a device-to-host copy).
    """
    # The common case in one cheap test; the helper then names what is wrong.
    if not (isinstance(qsl, torch.Tensor) and qsl.dtype == torch.int32 and qsl.dim() == 1
            and qsl.device == device):
        check_tensor("query_start_loc", qsl, dtype=torch.int32, ndim=1, device=device)
    if not (isinstance(positions, torch.Tensor) and positions.dtype == torch.int64
            and positions.dim() == 1 and positions.device == device):
        check_tensor("positions", positions, dtype=torch.int64, ndim=1, device=device)
    num_reqs = qsl.numel() - 1
    num_tokens = positions.numel()
    if num_reqs < 0:
        raise ValueError("query_start_loc must have num_reqs + 1 >= 1 entries, got 0")
    if num_reqs > max_num_reqs:
        raise ValueError(
            f"query_start_loc describes {num_reqs} requests, more than max_num_reqs="
            f"{max_num_reqs}"
        )
    if num_tokens > max_num_tokens:
        raise ValueError(
            f"positions holds {num_tokens} tokens, more than max_num_batched_tokens="
            f"{max_num_tokens}"
        )
    host_qsl = None
    if qsl_cpu is not None:
        if not (isinstance(qsl_cpu, torch.Tensor) and qsl_cpu.dtype == torch.int32
                and qsl_cpu.shape == qsl.shape and qsl_cpu.device.type == "cpu"):
            check_tensor("query_start_loc_cpu", qsl_cpu, dtype=torch.int32,
                         shape=[num_reqs + 1], device="cpu")
        host_qsl = qsl_cpu
    elif qsl.device.type == "cpu" or check_device_values:
        host_qsl = qsl.cpu()
    if host_qsl is not None:
        q = host_qsl.numpy()
        decreasing = bool((q[1:] < q[:-1]).any())
        if int(q[0]) != 0 or int(q[-1]) != num_tokens or decreasing:
            raise ValueError(
                "query_start_loc must start at 0, never decrease and end at num_tokens="
                f"{num_tokens} (positions.numel()), got first {int(q[0])}, last {int(q[-1])}"
                + (", decreasing" if decreasing else "")
            )
    if row_of_batch is not None:
        check_row_of_batch(row_of_batch, row_of_batch_cpu, num_reqs=num_reqs,
                           max_num_reqs=max_num_reqs, device=device, debug=check_device_values)
    elif row_of_batch_cpu is not None:
        raise ValueError("row_of_batch_cpu is given without row_of_batch")


def _owned(position: int, p: SlotGroupParams) -> bool:
    """Whether this rank owns the token at ``position`` (whatever the table holds)."""
    if position < 0:
        return False
    v = position % (p.manager_block_size * p.cp_world_size)
    return (v // p.cp_interleave) % p.cp_world_size == p.cp_rank


def report_unmapped_tokens(
    flat_table: np.ndarray,
    params: list[SlotGroupParams],
    groups: list[int],
    max_num_reqs: int,
    qsl: torch.Tensor,
    positions: torch.Tensor,
    row_of_batch: torch.Tensor | None,
) -> None:
    """Raise :class:`SlotMappingError` naming tokens with a negative position (always an engine
    bug) and tokens this rank owns that have no block.

    ``flat_table`` is a host copy of the committed device buffer, so the report describes what
    the kernel read: a position past the row's filled blocks, or in a null block.
    """
    q = qsl.cpu().numpy()
    pos = positions.cpu().numpy()
    rows = None if row_of_batch is None else row_of_batch.cpu().numpy()
    negative = [
        (t, r, r if rows is None else int(rows[r]), int(pos[t]))
        for r in range(len(q) - 1)
        for t in range(int(q[r]), int(q[r + 1]))
        if pos[t] < 0
    ]
    problems = []
    for g, p in zip(groups, params):
        table = flat_table[p.table_offset : p.table_offset + max_num_reqs * p.width]
        table = table.reshape(max_num_reqs, p.width)
        counts = flat_table[p.counts_offset : p.counts_offset + max_num_reqs]
        for r in range(len(q) - 1):
            row = r if rows is None else int(rows[r])
            for t in range(int(q[r]), int(q[r + 1])):
                if not _owned(int(pos[t]), p):
                    continue
                slot = slot_of_position(
                    int(pos[t]), table[row], int(counts[row]),
                    kernel_block_size=p.kernel_block_size,
                    manager_block_size=p.manager_block_size,
                    cp_world_size=p.cp_world_size, cp_rank=p.cp_rank,
                    cp_interleave=p.cp_interleave,
                )
                if slot == PAD_SLOT_ID:
                    problems.append((g, t, r, row, int(pos[t])))
    parts = []
    if negative:
        shown = ", ".join(f"token {t} (request {r}, row {row}, position {p})"
                          for t, r, row, p in negative[:8])
        parts.append(
            f"{len(negative)} token(s) have a negative position (mapped to PAD_SLOT_ID): "
            f"{shown}" + (" ..." if len(negative) > 8 else "")
        )
    if problems:
        shown = ", ".join(
            f"group {g} token {t} (request {r}, row {row}, position {p})"
            for g, t, r, row, p in problems[:8]
        )
        parts.append(
            f"{len(problems)} token(s) lie past their row's blocks (mapped to PAD_SLOT_ID): "
            f"{shown}" + (" ..." if len(problems) > 8 else "")
        )
    if parts:
        raise SlotMappingError("; ".join(parts))
