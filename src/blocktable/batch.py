"""Batched updates: a whole step's row changes for one group, checked then applied vectorized.

:func:`plan_group_update` validates everything and computes the writes without touching the
table; :func:`write_group_update` performs them. The owner plans every group before writing any,
so a rejected :class:`~blocktable.update.StepUpdate` changes nothing in any group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blocktable._checks import as_index_array
from blocktable._arrays import ragged_indices
from blocktable.constants import NULL_BLOCK_ID
from blocktable.table import BlockTable
from blocktable.update import RowBlocks, RowEntries


@dataclass
class GroupPlan:
    """The writes one group's part of a step update makes (all arrays int64 unless noted)."""

    cleared: np.ndarray  # rows emptied first
    added_rows: np.ndarray
    added_counts: np.ndarray  # kernel blocks per added row
    added_ids: np.ndarray  # int32 kernel ids, flattened
    appended_rows: np.ndarray
    appended_counts: np.ndarray
    appended_ids: np.ndarray  # int32
    nulled_rows: np.ndarray
    nulled_cols: np.ndarray  # first kernel column of each nulled manager block


def _check_rows(name: str, rows: object, bound: int, unique: bool) -> np.ndarray:
    arr = as_index_array(name, rows)
    if len(arr):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= bound:
            raise IndexError(f"{name} holds row {lo if lo < 0 else hi}, outside [0, {bound})")
        if unique and len(arr) > 1:
            ordered = np.sort(arr)
            if (ordered[1:] == ordered[:-1]).any():
                raise ValueError(f"{name} lists a row twice")
    return arr


_NONE = np.zeros(0, dtype=np.int64)


def _check_blocks(name: str, part: RowBlocks, table: BlockTable) -> tuple[np.ndarray, ...]:
    if len(part.rows) == 0 and len(part.num_blocks) == 0 and len(part.block_ids) == 0:
        return _NONE, _NONE, _NONE.astype(np.int32)
    rows = _check_rows(f"{name}.rows", part.rows, table.max_num_reqs, unique=True)
    num = as_index_array(f"{name}.num_blocks", part.num_blocks)
    if len(num) != len(rows):
        raise ValueError(
            f"{name}.num_blocks has {len(num)} entries but {name}.rows has {len(rows)}"
        )
    if len(num) and int(num.min()) < 0:
        raise ValueError(f"{name}.num_blocks holds a negative count {int(num.min())}")
    ids = table.kernel_ids(part.block_ids, f"{name}.block_ids")
    if int(num.sum()) * table.k != len(ids):
        raise ValueError(
            f"{name}.block_ids has {len(ids) // table.k} ids but {name}.num_blocks sums to "
            f"{int(num.sum())}"
        )
    return rows, num * table.k, ids


def plan_group_update(
    table: BlockTable,
    cleared_rows: np.ndarray,
    added: RowBlocks,
    appended: RowBlocks,
    nulled: RowEntries,
) -> GroupPlan:
    """Validate one group's changes against ``table`` (``cleared_rows`` already checked)."""
    g = table.group
    add_rows, add_counts, add_ids = _check_blocks(f"added[{g}]", added, table)
    app_rows, app_counts, app_ids = _check_blocks(f"appended[{g}]", appended, table)
    if len(cleared_rows) or len(add_rows):
        counts = table.num_blocks_per_row.astype(np.int64)
        counts[cleared_rows] = 0
        counts[add_rows] = add_counts
        counts[app_rows] += app_counts
        touched = np.arange(len(counts))
    else:  # the common decode step: only appends, so only their rows can overflow
        touched = app_rows
        counts = table.num_blocks_per_row[app_rows].astype(np.int64) + app_counts
    if len(counts) and int(counts.max()) > table.width:
        i = int(np.argmax(counts))
        raise ValueError(
            f"step update: row {int(touched[i])} of group {g} would hold {int(counts[i])} kernel "
            f"blocks, more than the row width {table.width}"
        )
    if len(nulled.rows) == 0 and len(nulled.block_indices) == 0:
        return GroupPlan(cleared_rows, add_rows, add_counts, add_ids, app_rows, app_counts,
                         app_ids, _NONE, _NONE)
    if not (len(cleared_rows) or len(add_rows)):
        counts = table.num_blocks_per_row.astype(np.int64)
        counts[app_rows] += app_counts
    null_rows = _check_rows(f"nulled[{g}].rows", nulled.rows, table.max_num_reqs, unique=False)
    null_blocks = as_index_array(f"nulled[{g}].block_indices", nulled.block_indices)
    if len(null_blocks) != len(null_rows):
        raise ValueError(
            f"nulled[{g}].block_indices has {len(null_blocks)} entries but nulled[{g}].rows has "
            f"{len(null_rows)}"
        )
    null_cols = null_blocks * table.k
    if len(null_cols):
        bad = (null_blocks < 0) | (null_cols >= counts[null_rows])
        if bad.any():
            i = int(np.argmax(bad))
            raise IndexError(
                f"nulled[{g}].block_indices[{i}]={int(null_blocks[i])} is outside row "
                f"{int(null_rows[i])}'s [0, {int(counts[null_rows[i]]) // table.k}) blocks"
            )
    return GroupPlan(
        cleared_rows, add_rows, add_counts, add_ids, app_rows, app_counts, app_ids,
        null_rows, null_cols,
    )


def write_group_update(table: BlockTable, plan: GroupPlan) -> None:
    """Apply a plan made by :func:`plan_group_update` (vectorized; records it for commit)."""
    flat = table.block_table_np.reshape(-1)
    counts = table.num_blocks_per_row
    storage, g, width, offset = table.storage, table.group, table.width, table.offset

    def write(rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray, values: object) -> None:
        local = ragged_indices(rows * width + starts, lengths)
        flat[local] = values
        storage.record(g, rows, local + offset)

    if len(plan.cleared):
        write(plan.cleared, np.zeros(len(plan.cleared), np.int64),
              counts[plan.cleared].astype(np.int64), NULL_BLOCK_ID)
        counts[plan.cleared] = 0
    if len(plan.added_rows):
        rows, new = plan.added_rows, plan.added_counts
        old = counts[rows].astype(np.int64)
        tail = old > new  # entries past the new ids that held old ones become null
        if tail.any():
            write(rows[tail], new[tail], old[tail] - new[tail], NULL_BLOCK_ID)
        write(rows, np.zeros(len(rows), np.int64), new, plan.added_ids)
        counts[rows] = new
    if len(plan.appended_rows):
        rows = plan.appended_rows
        start = counts[rows].astype(np.int64)
        write(rows, start, plan.appended_counts, plan.appended_ids)
        counts[rows] = start + plan.appended_counts
    if len(plan.nulled_rows):
        k = np.full(len(plan.nulled_rows), table.k, np.int64)
        write(plan.nulled_rows, plan.nulled_cols, k, NULL_BLOCK_ID)
