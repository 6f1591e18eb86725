"""The CPU backend of the slot mapping: vectorized numpy on the CPU tensors' memory.

Bit-identical to :mod:`blocktable.slot_mapping.reference`. It computes on the numpy views of
the CPU tensors (``tensor.numpy()`` shares memory) rather than with torch ops: a step's slot
mapping is a few dozen small element-wise ops, and torch would hand each to its intra-op thread
pool, whose wake-ups cost more than the work (on a busy 2-core machine a 256-token mapping took
milliseconds instead of microseconds). numpy runs them on the calling thread, so the cost does
not depend on ``torch.get_num_threads()``. Tables on an accelerator use the Triton kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from blocktable.slot_mapping.params import SlotGroupParams

_U32 = np.dtype(np.uint32)


def slot_mapping_torch(
    flat_table: torch.Tensor,
    params: list[SlotGroupParams],
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    row_of_batch: torch.Tensor | None,
    out: torch.Tensor,
    *,
    max_num_reqs: int | None = None,
) -> None:
    """Fill ``out[g, :]`` with group ``g``'s slots, PAD past the tokens; all groups at once.

    Never reads outside the table: a batch entry whose ``row_of_batch`` lies outside
    ``[0, max_num_reqs)`` is an empty row (all its tokens ``PAD_SLOT_ID``), and so is every
    token that ``query_start_loc`` assigns to no request.

    Parameters
    ----------
    flat_table : torch.Tensor
        int32 ``[num_entries]``, the flat table buffer (tables and counts).
    params : list of SlotGroupParams
        One entry per token-slot group, the row of ``out`` it fills.
    query_start_loc : torch.Tensor
        int32 ``[num_reqs + 1]``, on ``flat_table``'s device.
    positions : torch.Tensor
        int64 ``[num_tokens]``, same device.
    row_of_batch : torch.Tensor or None
        int32 ``[num_reqs]`` rows (indexed mode) or ``None`` (row = batch index), same device.
    out : torch.Tensor
        int64 ``[len(params), max_num_tokens]``, same device, written in full.
    max_num_reqs : int or None
        Rows of each group's table. ``None``: only rows whose count lies inside
        ``flat_table`` are read (reads stay inside the buffer, not necessarily the group).
    """
    if max_num_reqs is None:
        max_num_reqs = _rows_from_layout(params, flat_table.numel())
    if flat_table.device.type != "cpu":
        raise ValueError("the numpy slot mapping runs on CPU tensors; on an accelerator the "
                         "table uses its Triton kernel")
    slot_mapping_numpy(
        flat_table.numpy(), params, query_start_loc.numpy(), positions.numpy(),
        None if row_of_batch is None else row_of_batch.numpy(), out.numpy(), max_num_reqs,
    )


def _rows_from_layout(params: list[SlotGroupParams], num_entries: int) -> int:
    """A row bound that keeps every count read inside the buffer (the real one is smaller)."""
    return max(0, min((num_entries - p.counts_offset for p in params), default=0))


def _token_rows(
    qsl: np.ndarray, num_tokens: int, rows_of_batch: np.ndarray | None, max_num_reqs: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """int64 table row of every token, and a bool mask of the tokens that have none (``None``:
    every token has one)."""
    num_reqs = len(qsl) - 1
    tokens = np.arange(num_tokens, dtype=qsl.dtype)
    req = qsl[1:].searchsorted(tokens, side="right")  # int64
    no_row = None
    if not (qsl[0] == 0 and qsl[num_reqs] == num_tokens):
        # not a well-formed batch: a token before qsl[0] or past qsl[-1] has no request
        no_row = (req >= num_reqs) | (tokens < qsl[0])
        np.minimum(req, num_reqs - 1, out=req)
    # (well formed: qsl[-1] == num_tokens > every token, so req < num_reqs already)
    if rows_of_batch is None:
        rows = req  # < num_reqs
        checked = num_reqs <= max_num_reqs
    else:
        rows = rows_of_batch.take(req).astype(np.int64)
        checked = False
    if not checked and rows.view(np.uint64).max() >= max_num_reqs:
        bad = (rows < 0) | (rows >= max_num_reqs)  # an empty row: never a read outside
        no_row = bad if no_row is None else no_row | bad
        rows[bad] = 0
    return rows, no_row


def slot_mapping_numpy(
    flat_table: np.ndarray,
    params: list[SlotGroupParams],
    qsl: np.ndarray,
    positions: np.ndarray,
    rows_of_batch: np.ndarray | None,
    out: np.ndarray,
    max_num_reqs: int,
) -> None:
    """:func:`slot_mapping_torch` on numpy arrays (same shapes and dtypes), on one thread."""
    num_tokens = len(positions)
    out[:, num_tokens:] = PAD_SLOT_ID
    if num_tokens == 0 or len(qsl) < 2 or max_num_reqs <= 0:
        out[:, :num_tokens] = PAD_SLOT_ID
        return
    rows, no_slot = _token_rows(qsl, num_tokens, rows_of_batch, max_num_reqs)
    pos = positions
    if pos.min() < 0:  # a negative position has no slot
        no_slot = pos < 0 if no_slot is None else no_slot | (pos < 0)
        pos = np.maximum(pos, 0)
    for g, p in enumerate(params):
        _group_slots(flat_table, p, max_num_reqs, rows, pos, no_slot, out[g, :num_tokens])


def _group_slots(
    flat_table: np.ndarray, p: SlotGroupParams, max_num_reqs: int, rows: np.ndarray,
    pos: np.ndarray, no_slot: np.ndarray | None, out: np.ndarray,
) -> None:
    """One group's slots of tokens at ``pos`` (>= 0) in table ``rows`` into ``out``;
    ``PAD_SLOT_ID`` where ``no_slot`` is set."""
    kbs = p.kernel_block_size
    if p.cp_world_size == 1:
        if kbs & (kbs - 1) == 0:
            block_index = pos >> (kbs.bit_length() - 1)
            offset = pos & (kbs - 1)
        else:
            block_index, offset = np.divmod(pos, kbs)
    else:
        virtual_block_size = p.manager_block_size * p.cp_world_size
        v = pos % virtual_block_size
        other = (v // p.cp_interleave) % p.cp_world_size != p.cp_rank
        no_slot = other if no_slot is None else no_slot | other
        local = (v // (p.cp_world_size * p.cp_interleave)) * p.cp_interleave + (
            v % p.cp_interleave
        )
        block_index = (pos // virtual_block_size) * p.blocks_per_manager_block + local // kbs
        offset = local % kbs
    # views of this group's counts and table: "clip" keeps every read inside them
    counts = flat_table[p.counts_offset : p.counts_offset + max_num_reqs]
    table = flat_table[p.table_offset : p.table_offset + max_num_reqs * p.width]
    past = block_index >= counts.take(rows, mode="clip")
    no_slot = past if no_slot is None else past | no_slot
    # A block index past the row's count may read another row's entry: it is PAD anyway.
    entry = rows * p.width
    entry += block_index
    block_id = table.take(entry, mode="clip")
    no_slot |= block_id == NULL_BLOCK_ID
    np.multiply(block_id, kbs, out=out)
    out += offset
    np.putmask(out, no_slot, PAD_SLOT_ID)
