"""Giving blocks back to the pools: a leaving request's whole row, or the blocks that left a
sliding window."""

from __future__ import annotations

import numpy as np

from blocktable.allocator.journal import StepJournal
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.request import RequestState
from blocktable.allocator.rowstate import RowState
from blocktable.constants import NULL_BLOCK_ID


def release_rows(state: RowState, pools: tuple[BlockPool, ...],
                 reqs: list[RequestState]) -> list[int]:
    """Give the blocks of ``reqs`` (running, distinct) back to ``pools`` and stop their rows in
    ``state``; returns the rows, for the row allocator. Per group: a reversed slice of each
    request's row (tail first, read through memoryviews), one concatenation and one release."""
    rows = [req.row for req in reqs]
    for pool, arena, row_len, num_skipped in zip(
        pools, state.blocks, state.row_len_mvs, state.num_skipped_mvs
    ):
        parts = []
        for row in rows:
            n, skip = row_len[row], num_skipped[row]
            if n > skip:
                parts.append(arena[row, n - 1 : skip - 1 if skip else None : -1])
        if parts:
            ids = np.concatenate(parts, dtype=np.intp)
            pool.release(ids, may_repeat=len(parts) > 1)
    state.stop(rows)
    return rows


def release_outside_window(state: RowState, journal: StepJournal, pool: BlockPool, g: int,
                           block_size: int, window: int, reqs: list[RequestState]) -> None:
    """Release the blocks of group ``g`` that left each request's window of ``window`` tokens,
    oldest first, nulling their entries (journaled).

    Oldest first: a later hit at the end of a shared prompt reads the blocks just before it,
    and this queues the prompt's head ahead of them for eviction (newest first would queue the
    request's private tail ahead instead; ``benchmarks/bench_window_order.py`` compares the
    two).
    """
    released: list[np.ndarray] = []
    for req in reqs:
        row = req.row
        first = int(state.num_skipped[g, row])
        skip = max(0, (int(state.num_computed[row]) - window + 1) // block_size)
        if skip <= first:
            continue
        entries = state.blocks[g][row]
        released.append(entries[first:skip].copy())  # oldest first
        entries[first:skip] = NULL_BLOCK_ID
        for i in range(first, skip):
            journal.null(row, g, i)
        state.num_skipped[g, row] = skip
    if released:
        ids = released[0] if len(released) == 1 else np.concatenate(released)
        pool.release(ids, may_repeat=len(released) > 1)
