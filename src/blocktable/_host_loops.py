"""Compiled host loops (numba) for the per-step hot path: batched updates and commit staging.

A step's update touches a few hundred entries; in numpy that is ~20 calls of ~1-2 µs each, in a
compiled loop it is a few microseconds in all. Every function here is plain loops over numpy
arrays; the pure-Python model in ``tests/`` defines what they must do.

Error reporting: checks return ``(code, part, index, value, bound)`` instead of raising (numba
cannot format our messages); :mod:`blocktable.batch` turns a nonzero code into the exception.
"""

from __future__ import annotations

from numba import njit

OK = 0
ROW_RANGE = 1  # part, i, row, bound
ROW_TWICE = 2  # part, i, row
NEG_COUNT = 3  # part, i, count
ID_RANGE = 4  # part, i, id, bound
ID_SUM = 5  # part, number of ids, sum of counts
WIDTH = 6  # row, kernel blocks, width
NULL_RANGE = 7  # i, block index, row, blocks in row

CLEARED, ADDED, APPENDED, NULLED = 0, 1, 2, 3


@njit(cache=True)
def _check_rows(rows, num_rows, part, unique, seen):  # type: ignore[no-untyped-def]
    for i in range(len(rows)):
        r = rows[i]
        if r < 0 or r >= num_rows:
            for j in range(i):
                seen[rows[j]] = False
            return ROW_RANGE, part, i, r, num_rows
        if unique and seen[r]:
            for j in range(i):
                seen[rows[j]] = False
            return ROW_TWICE, part, i, r, 0
        seen[r] = True
    for i in range(len(rows)):
        seen[rows[i]] = False
    return OK, 0, 0, 0, 0


@njit(cache=True)
def _check_blocks(rows, num, ids, max_id, part, num_rows, seen):  # type: ignore[no-untyped-def]
    res = _check_rows(rows, num_rows, part, True, seen)
    if res[0] != OK:
        return res
    total = 0
    for i in range(len(num)):
        if num[i] < 0:
            return NEG_COUNT, part, i, num[i], 0
        total += num[i]
    if total != len(ids):
        return ID_SUM, part, len(ids), total, 0
    bad = False
    for i in range(len(ids)):  # one branch-free pass; find the culprit only on failure
        bad |= (ids[i] < 0) | (ids[i] >= max_id)
    if bad:
        for i in range(len(ids)):
            if ids[i] < 0 or ids[i] >= max_id:
                return ID_RANGE, part, i, ids[i], max_id
    return OK, 0, 0, 0, 0


@njit(cache=True)
def check_group_update(  # type: ignore[no-untyped-def]
    counts, width, k, max_id, cleared, add_rows, add_num, add_ids,
    app_rows, app_num, app_ids, null_rows, null_blocks, scratch, seen,
):
    """Validate one group's part of a step update against ``counts``; writes nothing visible.

    ``scratch`` (int64 ``[num_rows]``) and ``seen`` (bool ``[num_rows]``, all False) are work
    space; ``seen`` is left all False.
    """
    num_rows = len(counts)
    res = _check_rows(cleared, num_rows, CLEARED, False, seen)
    if res[0] != OK:
        return res
    res = _check_blocks(add_rows, add_num, add_ids, max_id, ADDED, num_rows, seen)
    if res[0] != OK:
        return res
    res = _check_blocks(app_rows, app_num, app_ids, max_id, APPENDED, num_rows, seen)
    if res[0] != OK:
        return res
    res = _check_rows(null_rows, num_rows, NULLED, False, seen)
    if res[0] != OK:
        return res
    # the rows' counts after the update, in scratch (only touched rows are read)
    for rows in (cleared, add_rows, app_rows, null_rows):
        for i in range(len(rows)):
            scratch[rows[i]] = counts[rows[i]]
    for i in range(len(cleared)):
        scratch[cleared[i]] = 0
    for i in range(len(add_rows)):
        scratch[add_rows[i]] = add_num[i] * k
    for i in range(len(app_rows)):
        scratch[app_rows[i]] += app_num[i] * k
    for rows in (add_rows, app_rows):
        for i in range(len(rows)):
            if scratch[rows[i]] > width:
                return WIDTH, 0, rows[i], scratch[rows[i]], width
    for i in range(len(null_rows)):
        j = null_blocks[i]
        if j < 0 or j * k >= scratch[null_rows[i]]:
            return NULL_RANGE, i, j, null_rows[i], scratch[null_rows[i]] // k
    return OK, 0, 0, 0, 0


@njit(cache=True, inline="always")
def _log(journal, journal_len, start, length):  # type: ignore[no-untyped-def]
    """Journal the run of ``length`` flat indices from ``start``; past capacity, overflow.

    ``journal`` is int64 ``[capacity, 2]`` (start, length); ``journal_len`` int64 ``[2]`` holds
    the number of runs and of indices, or -1 runs after an overflow.
    """
    n = journal_len[0]
    if n < 0 or length <= 0:
        return
    total = journal_len[1] + length
    if n >= journal.shape[0] or total > journal.shape[0]:
        journal_len[0] = -1  # overflow: the commit copies row spans instead
        return
    journal[n, 0] = start
    journal[n, 1] = length
    journal_len[0] = n + 1
    journal_len[1] = total


@njit(cache=True, inline="always")
def _write_kernel_ids(table, base, manager_ids, k):  # type: ignore[no-untyped-def]
    """``table[base:]`` = the kernel ids of ``manager_ids`` (``k`` each; null stays null)."""
    if k == 1:
        table[base : base + len(manager_ids)] = manager_ids
        return
    for j in range(len(manager_ids)):
        b = manager_ids[j]
        for q in range(k):
            table[base + j * k + q] = 0 if b == 0 else b * k + q


@njit(cache=True)
def write_group_update(  # type: ignore[no-untyped-def]
    table, counts, width, k, offset, cleared, add_rows, add_num, add_ids,
    app_rows, app_num, app_ids, null_rows, null_blocks, dirty, journal, journal_len,
):
    """Apply a checked update to one group's flat host ``table`` (int32 ``[rows*width]``).

    Manager ids become ``k`` kernel ids each (the null block stays null). Every written run of
    entries goes to the ``journal`` as flat indices (``offset`` + local index); touched rows
    are marked in ``dirty``.
    """
    for i in range(len(cleared)):
        r = cleared[i]
        base = r * width
        for c in range(counts[r]):
            table[base + c] = 0
        _log(journal, journal_len, offset + base, counts[r])
        counts[r] = 0
        dirty[r] = True
    pos = 0
    for i in range(len(add_rows)):
        r = add_rows[i]
        base = r * width
        new = add_num[i] * k
        old = counts[r]
        _write_kernel_ids(table, base, add_ids[pos : pos + add_num[i]], k)
        pos += add_num[i]
        if old > new:
            table[base + new : base + old] = 0
        _log(journal, journal_len, offset + base, max(new, old))
        counts[r] = new
        dirty[r] = True
    pos = 0
    for i in range(len(app_rows)):
        r = app_rows[i]
        base = r * width + counts[r]
        _write_kernel_ids(table, base, app_ids[pos : pos + app_num[i]], k)
        pos += app_num[i]
        _log(journal, journal_len, offset + base, app_num[i] * k)
        counts[r] += app_num[i] * k
        dirty[r] = True
    for i in range(len(null_rows)):
        r = null_rows[i]
        base = r * width + null_blocks[i] * k
        for q in range(k):
            table[base + q] = 0
        _log(journal, journal_len, offset + base, k)
        dirty[r] = True


@njit(cache=True)
def fill_staging(  # type: ignore[no-untyped-def]
    journal, journal_len, dirty, counts_offset, host, staging, capacity,
):
    """Gather a commit's ``(flat index, value)`` pairs into ``staging``; reset the changes.

    ``staging`` (int32 ``[2*capacity]``) receives the indices first, then the values. Entries
    are the journal's runs plus the count of every dirty row (``dirty`` bool
    ``[groups, rows]``); on success ``dirty`` and the journal are reset. Returns the number of
    pairs, or -1 (nothing written or reset) when they exceed ``capacity`` or the journal
    overflowed.
    """
    num_runs = journal_len[0]
    if num_runs < 0:
        return -1
    num_groups, num_rows = dirty.shape
    total = journal_len[1]
    for g in range(num_groups):
        for r in range(num_rows):
            if dirty[g, r]:
                total += 1
    if total > capacity:
        return -1
    i = 0
    for run in range(num_runs):
        start = journal[run, 0]
        for c in range(journal[run, 1]):
            staging[i] = start + c
            i += 1
    for g in range(num_groups):
        for r in range(num_rows):
            if dirty[g, r]:
                staging[i] = counts_offset + g * num_rows + r
                dirty[g, r] = False
                i += 1
    for i in range(total):
        staging[total + i] = host[staging[i]]
    journal_len[0] = 0
    journal_len[1] = 0
    return total


@njit(cache=True)
def check_and_write_group_update(  # type: ignore[no-untyped-def]
    table, counts, width, k, max_id, offset, cleared, add_rows, add_num, add_ids,
    app_rows, app_num, app_ids, null_rows, null_blocks, scratch, seen, dirty, journal,
    journal_len,
):
    """:func:`check_group_update`, then (only if it passed) :func:`write_group_update`: one
    call for a one-group table's whole step."""
    res = check_group_update(
        counts, width, k, max_id, cleared, add_rows, add_num, add_ids,
        app_rows, app_num, app_ids, null_rows, null_blocks, scratch, seen,
    )
    if res[0] == OK:
        write_group_update(
            table, counts, width, k, offset, cleared, add_rows, add_num, add_ids,
            app_rows, app_num, app_ids, null_rows, null_blocks, dirty, journal, journal_len,
        )
    return res
