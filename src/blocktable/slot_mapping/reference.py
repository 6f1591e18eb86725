"""Plain-Python reference of the slot mapping: the definition every fast path must equal."""

from __future__ import annotations

import numpy as np

from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID


def slot_of_position(
    position: int,
    row_block_ids: np.ndarray,
    num_filled: int,
    *,
    kernel_block_size: int,
    manager_block_size: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
) -> int:
    """Slot of one token at ``position`` in a row, or ``PAD_SLOT_ID``.

    Ownership under CP is decided in manager-block units: the token's offset ``v`` in its
    virtual block of ``manager_block_size * cp_world_size`` tokens belongs to rank
    ``(v // interleave) % world``, at local offset ``(v // (world*interleave)) * interleave +
    v % interleave`` of this rank's manager block. PAD when another rank owns the token, the
    position is negative, lies past the row's ``num_filled`` kernel blocks, or its block is null.
    """
    if position < 0:
        return PAD_SLOT_ID
    virtual_block_size = manager_block_size * cp_world_size
    v = position % virtual_block_size
    if (v // cp_interleave) % cp_world_size != cp_rank:
        return PAD_SLOT_ID
    local = (v // (cp_world_size * cp_interleave)) * cp_interleave + v % cp_interleave
    blocks_per_manager = manager_block_size // kernel_block_size
    block_index = (position // virtual_block_size) * blocks_per_manager + local // kernel_block_size
    if block_index >= num_filled:
        return PAD_SLOT_ID
    block_id = int(row_block_ids[block_index])
    if block_id == NULL_BLOCK_ID:
        return PAD_SLOT_ID
    return block_id * kernel_block_size + local % kernel_block_size


def slot_mapping_reference(
    table: np.ndarray,
    counts: np.ndarray,
    query_start_loc: np.ndarray,
    positions: np.ndarray,
    *,
    max_num_tokens: int,
    kernel_block_size: int,
    manager_block_size: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    row_of_batch: np.ndarray | None = None,
) -> np.ndarray:
    """Slot of every scheduled token, padded to ``max_num_tokens`` with ``PAD_SLOT_ID``.

    Parameters
    ----------
    table : np.ndarray
        int32 ``[max_num_reqs, width]`` kernel block ids.
    counts : np.ndarray
        int32 ``[max_num_reqs]`` filled entries per row.
    query_start_loc : np.ndarray
        int32 ``[num_reqs + 1]``: request ``r`` owns tokens ``[qsl[r], qsl[r+1])``.
    positions : np.ndarray
        int64 ``[num_tokens]`` token positions in their requests.
    row_of_batch : np.ndarray or None
        int32 ``[num_reqs]`` table row of each batch entry (indexed mode); ``None`` means row
        ``r`` for request ``r`` (condensed mode).

    Returns
    -------
    np.ndarray
        int64 ``[max_num_tokens]``.
    """
    out = np.full(max_num_tokens, PAD_SLOT_ID, dtype=np.int64)
    for r in range(len(query_start_loc) - 1):
        row = r if row_of_batch is None else int(row_of_batch[r])
        for t in range(int(query_start_loc[r]), int(query_start_loc[r + 1])):
            out[t] = slot_of_position(
                int(positions[t]),
                table[row],
                int(counts[row]),
                kernel_block_size=kernel_block_size,
                manager_block_size=manager_block_size,
                cp_world_size=cp_world_size,
                cp_rank=cp_rank,
                cp_interleave=cp_interleave,
            )
    return out
