"""Host side of a captured step: apply the step's update to the host table (the truth) and
stage the changed entries as ``(flat index, value)`` pairs for the device.

A decode step (each listed row gains exactly one manager block, nothing else changes) takes a
dedicated path: about a dozen numpy calls that check everything, then write the host table,
the counts and the pairs, bypassing the commit journal. Every other update goes through
:meth:`MultiGroupBlockTable.apply` (which checks, writes and journals) and the journal is
drained into the staging buffer, exactly as :meth:`MultiGroupBlockTable.commit` would.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from blocktable._host_loops import fill_staging, kernel_ids
from blocktable.group_layout import check_update_block_sizes
from blocktable.multi_group import MultiGroupBlockTable
from blocktable.update import RowBlocks, StepUpdate

_U32 = np.dtype(np.uint32)
FULL = -1  # the pairs did not fit: the table's own commit moved them


class _GroupRef(NamedTuple):
    """Where one group with a table lives in the flat host buffer."""

    group: int
    counts: np.ndarray  # on cpu, int32 [max_num_reqs]: view of the host counts
    width: int  # kernel blocks per row
    k: int  # kernel blocks per manager block
    block_id_bound: int  # manager ids lie in [0, bound)
    table_offset: int  # of the group's table in the flat buffer
    counts_offset: int  # of the group's counts in the flat buffer


def group_refs(table: MultiGroupBlockTable) -> list[_GroupRef]:
    st = table.storage
    refs = []
    for t in table.tables:
        if t is None:
            continue
        refs.append(_GroupRef(
            t.group, t.num_kernel_blocks, t.width, t.k, t.block_id_bound, t.offset,
            st.counts_offset + t.group * table.max_num_reqs,
        ))
    return refs


def _is_int32(a: object) -> bool:
    return type(a) is np.ndarray and a.dtype == np.int32 and a.ndim == 1


def _decode_rows(ref: _GroupRef, part: RowBlocks, num_rows: int) -> np.ndarray | None:
    """The rows' filled kernel blocks if ``part`` is a valid one-block-per-row append; ``None``
    when the general path must look (another shape, or an error it will name)."""
    rows, num, ids = part.rows, part.num_manager_blocks, part.block_ids
    n = len(rows)
    if not (_is_int32(rows) and _is_int32(num) and _is_int32(ids)) or len(ids) != n:
        return None
    if np.count_nonzero(num == 1) != n or ids.view(_U32).max() >= ref.block_id_bound:
        return None
    try:  # one histogram checks the range (negative rows raise) and that no row repeats
        listed = np.bincount(rows, minlength=num_rows)
    except ValueError:
        return None
    if len(listed) != num_rows or (n > 1 and np.count_nonzero(listed) != n):
        return None
    filled = ref.counts.take(rows)
    if filled.max() > ref.width - ref.k:
        return None
    return filled


def stage_decode(
    table: MultiGroupBlockTable, refs: list[_GroupRef], update: StepUpdate, pairs: np.ndarray,
    max_pairs: int,
) -> int:
    """Apply a decode step's update and stage its pairs in ``pairs`` (int32 ``[2*max_pairs]``).

    Returns the number of pairs, or -1 (nothing written) when the update is not a valid decode
    step that fits ``max_pairs`` next to no other pending change.
    """
    st = table.storage
    num_groups = len(table.specs)
    if st.changed or len(update.cleared_rows) or not (
        len(update.added) == len(update.appended) == len(update.nulled) == num_groups
    ):
        return -1
    for g in range(num_groups):
        if len(update.added[g]) or len(update.nulled[g]):
            return -1
    num_rows = table.max_num_reqs
    plans = []
    total = 0
    for ref in refs:
        part = update.appended[ref.group]
        if not len(part):
            continue
        filled = _decode_rows(ref, part, num_rows)
        if filled is None:
            return -1
        plans.append((ref, part, filled))
        total += len(part) * (ref.k + 1)
    if len(plans) != sum(len(p) > 0 for p in update.appended):
        return -1  # ids for a group without a table: the general path names the error
    if total > max_pairs:
        return -1
    if update.allocator_block_sizes is not None:
        check_update_block_sizes(table.specs, table.cp, update)
    st.before_host_write()
    host = st.host
    index, value = pairs[:total], pairs[total : 2 * total]
    at = 0
    for ref, part, filled in plans:
        rows, ids, k = part.rows, part.block_ids, ref.k
        n = len(rows)
        if k == 1:  # the entries' flat indices, written straight into the staging buffer
            starts = index[at : at + n]
            np.multiply(rows, ref.width, out=starts)  # int32: the buffer has < 2**31 entries
            starts += filled
            if ref.table_offset:
                starts += np.int32(ref.table_offset)
            host.put(starts, ids)
            value[at : at + n] = ids
        else:
            starts = rows * np.int32(ref.width) + filled + np.int32(ref.table_offset)
            entries = (starts[:, None] + np.arange(k, dtype=np.int32)).reshape(-1)
            kids = kernel_ids(ids, k)
            host.put(entries, kids)
            index[at : at + n * k] = entries
            value[at : at + n * k] = kids
        at += n * k
        filled += np.int32(k)
        ref.counts.put(rows, filled)
        np.add(rows, ref.counts_offset, out=index[at : at + n])
        value[at : at + n] = filled
        at += n
    return total


def stage_general(table: MultiGroupBlockTable, update: StepUpdate, pairs: np.ndarray,
                  max_pairs: int) -> int:
    """Apply any update with :meth:`MultiGroupBlockTable.apply` (checks first, raises before
    any write) and drain every pending change into ``pairs``.

    Returns the number of pairs, or :data:`FULL` when they exceed ``max_pairs``: then the
    table's own :meth:`~MultiGroupBlockTable.commit` has moved them (on the current stream,
    before the step's device work).
    """
    table.apply(update)
    st = table.storage
    if not st.changed:
        return 0
    n = fill_staging(st.journal, st.journal_len, st.dirty_rows, st.counts_offset, st.host,
                     pairs, max_pairs)
    if n < 0:
        table.commit()
        return FULL
    st.changed = False  # fill_staging reset the dirty rows and the journal
    return n
