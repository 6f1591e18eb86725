"""Batched updates: a whole step's row changes for one group, checked, then applied.

:func:`check_group_update` validates everything without touching the table;
:func:`write_group_update` performs the writes. The owner checks every group before writing any,
so a rejected :class:`~blocktable.update.StepUpdate` changes nothing in any group. Both are a
few vectorized numpy calls (:mod:`blocktable._host_loops`).
"""

from __future__ import annotations

import numpy as np

from blocktable import _host_loops as loops
from blocktable._checks import as_index_array, block_id_error, check_block_ids
from blocktable.table import GroupTable
from blocktable.update import RowBlocks, RowEntries

_I32 = np.iinfo(np.int32)
_PARTS = {loops.CLEARED: "update.cleared_rows", loops.ADDED: "added", loops.APPENDED: "appended",
          loops.NULLED: "nulled"}

GroupArrays = tuple[np.ndarray, ...]


def as_int32(name: str, value: object, *, row_bound: int | None = None) -> np.ndarray:
    """A 1-D int32 array of ``value``'s integers (no copy for int32 input), or raise.

    With ``row_bound``, values are rows and an ``IndexError`` names one outside
    ``[0, row_bound)``, so a row never wraps into range.
    """
    if isinstance(value, np.ndarray) and value.dtype == np.int32 and value.ndim == 1:
        return value
    arr = as_index_array(name, value)
    if len(arr):
        lo, hi = int(arr.min()), int(arr.max())
        if row_bound is not None and (lo < 0 or hi >= row_bound):
            raise IndexError(f"{name} holds row {lo if lo < 0 else hi}, outside [0, {row_bound})")
        if lo < _I32.min or hi > _I32.max:
            error = IndexError if name.endswith("block_indices") else ValueError
            raise error(f"{name} holds a value outside the int32 range")
    return arr.astype(np.int32)


def _as_block_ids(name: str, value: object, table: GroupTable) -> np.ndarray:
    """Manager ids as int32, checked against the group's id bound first (never wrapped)."""
    if isinstance(value, np.ndarray) and value.dtype == np.int32 and value.ndim == 1:
        return value  # the compiled check bounds them
    arr = as_index_array(name, value)
    check_block_ids(name, arr, table.block_id_bound, table.num_blocks_declared)
    return arr.astype(np.int32)


def _group_arrays(
    table: GroupTable,
    cleared_rows: np.ndarray,
    added: RowBlocks,
    appended: RowBlocks,
    nulled: RowEntries,
) -> list[np.ndarray]:
    raw = [cleared_rows, added.rows, added.num_manager_blocks, added.block_ids, appended.rows,
           appended.num_manager_blocks, appended.block_ids, nulled.rows, nulled.block_indices]
    if all(type(a) is np.ndarray and a.dtype == np.int32 and a.ndim == 1
           and a.flags.c_contiguous and a.flags.aligned for a in raw):
        arrays = raw  # the allocator's format: nothing to convert
    else:
        g = table.group
        names = ["update.cleared_rows"] + [
            f"{part}[{g}].{field}"
            for part, fields in (("added", ("rows", "num_manager_blocks", "block_ids")),
                                 ("appended", ("rows", "num_manager_blocks", "block_ids")),
                                 ("nulled", ("rows", "block_indices")))
            for field in fields
        ]
        rows = table.max_num_reqs
        arrays = [
            _as_block_ids(name, a, table) if name.endswith("block_ids")
            else as_int32(name, a, row_bound=rows if name.endswith("rows") else None)
            for name, a in zip(names, raw)
        ]
        # (the compiled writer reads whole aligned int32 arrays: a strided or misaligned one
        # is copied, as numpy's twin would read it)
        arrays = [np.require(a, requirements="CA") for a in arrays]
    for rows, other, name in ((1, 2, "added"), (4, 5, "appended"), (7, 8, "nulled")):
        if len(arrays[rows]) != len(arrays[other]):
            field = "block_indices" if name == "nulled" else "num_manager_blocks"
            raise ValueError(
                f"{name}[{table.group}].{field} has {len(arrays[other])} entries but "
                f"{name}[{table.group}].rows has {len(arrays[rows])}"
            )
    return arrays


def check_group_update(
    table: GroupTable,
    cleared_rows: np.ndarray,
    added: RowBlocks,
    appended: RowBlocks,
    nulled: RowEntries,
    trusted: bool = False,
) -> GroupArrays:
    """Validate one group's changes against ``table``; return the arrays to write."""
    arrays = _group_arrays(table, cleared_rows, added, appended, nulled)
    if table.writer is not None:
        code, part, i, value, bound = table.writer.apply(*arrays, write=False)
    else:
        code, part, i, value, bound = loops.check_group_update(  # type: ignore[call-arg]
            table.num_kernel_blocks, table.width, table.k, table.block_id_bound, *arrays,
            table.scratch_counts, table.scratch_seen, trusted,
        )
    if code != loops.OK:
        raise _error(table.group, code, part, i, value, bound, table.num_blocks_declared)
    return tuple(arrays)


def apply_group_update(
    table: GroupTable,
    cleared_rows: np.ndarray,
    added: RowBlocks,
    appended: RowBlocks,
    nulled: RowEntries,
    trusted: bool = False,
) -> None:
    """Check and apply in one call (a table with one group: nothing else to wait for)."""
    st = table.storage
    writer = table.writer
    if writer is not None:
        try:  # the allocator's format (int32 arrays) goes straight to the compiled writer
            code, part, i, value, bound = writer.apply(
                cleared_rows, added.rows, added.num_manager_blocks, added.block_ids,
                appended.rows, appended.num_manager_blocks, appended.block_ids, nulled.rows,
                nulled.block_indices)
        except (TypeError, ValueError):
            # anything else is converted first, and a bad argument is named: the writer
            # refused it before writing
            arrays = _group_arrays(table, cleared_rows, added, appended, nulled)
            code, part, i, value, bound = writer.apply(*arrays)
    else:
        arrays = _group_arrays(table, cleared_rows, added, appended, nulled)
        code, part, i, value, bound = loops.check_and_write_group_update(  # type: ignore[call-arg]
            table.block_table_np.reshape(-1), table.num_kernel_blocks, table.width, table.k,
            table.block_id_bound, table.offset, *arrays, table.scratch_counts,
            table.scratch_seen, st.dirty_rows[table.group], st.journal, st.journal_len, trusted,
        )
    if code != loops.OK:
        raise _error(table.group, code, part, i, value, bound, table.num_blocks_declared)
    st.changed = True


def write_group_update(table: GroupTable, arrays: GroupArrays) -> None:
    """Apply arrays returned by :func:`check_group_update`; records them for the next commit."""
    st = table.storage
    if table.writer is not None:  # (checks again: cheap, and the call stays all-or-nothing)
        table.writer.apply(*arrays)
    else:
        loops.write_group_update(  # type: ignore[call-arg]
            table.block_table_np.reshape(-1), table.num_kernel_blocks, table.width, table.k,
            table.offset, *arrays, st.dirty_rows[table.group], st.journal, st.journal_len,
        )
    st.changed = True


def _error(g: int, code: int, part: int, i: int, value: int, bound: int, declared: bool) -> Exception:
    name = _PARTS.get(part, "update")
    if part != loops.CLEARED:
        name = f"{name}[{g}]"
    if code == loops.ROW_RANGE:
        rows = name if part == loops.CLEARED else f"{name}.rows"
        return IndexError(f"{rows} holds row {value}, outside [0, {bound})")
    if code == loops.ROW_TWICE:
        return ValueError(f"{name}.rows lists a row twice (row {value})")
    if code == loops.NEG_COUNT:
        return ValueError(f"{name}.num_manager_blocks holds a negative count {value}")
    if code == loops.ID_SUM:
        return ValueError(f"{name}.block_ids has {i} ids but {name}.num_manager_blocks sums to {value}")
    if code == loops.ID_RANGE:
        return block_id_error(f"{name}.block_ids", value, bound, declared)
    if code == loops.WIDTH:
        return ValueError(
            f"step update: row {i} of group {g} would hold {value} kernel blocks, more than the "
            f"row width {bound}"
        )
    if code == loops.NULL_RANGE:
        return IndexError(
            f"nulled[{g}].block_indices[{part}]={i} is outside row {value}'s [0, {bound}) blocks"
        )
    return ValueError(f"step update rejected (code {code})")
