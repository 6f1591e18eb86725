"""Vectorized host work of the per-step hot path: batched updates and commit staging.

Plain numpy, no compiler: a step's update is a few dozen numpy calls whatever its size, with
fast paths for the common shapes (empty parts, one block per row, rows of equal length). The
pure-Python model in ``tests/`` defines what these functions must do.

Error reporting: checks return ``(code, part, index, value, bound)`` instead of raising;
:mod:`blocktable.batch` turns a nonzero code into the exception that names the argument.
"""

from __future__ import annotations

import numpy as np

OK = 0
ROW_RANGE = 1  # part, i, row, bound
ROW_TWICE = 2  # part, i, row
NEG_COUNT = 3  # part, i, count
ID_RANGE = 4  # part, i, id, bound
ID_SUM = 5  # part, number of ids, sum of counts
WIDTH = 6  # row, kernel blocks, width
NULL_RANGE = 7  # i, block index, row, blocks in row

CLEARED, ADDED, APPENDED, NULLED = 0, 1, 2, 3

Result = tuple[int, int, int, int, int]
_PASS: Result = (OK, 0, 0, 0, 0)
_U32 = np.dtype(np.uint32)


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def _out_of_range(values: np.ndarray, bound: int) -> bool:
    """Whether an int32 value lies outside ``[0, bound)`` (one reduction: negatives wrap to
    values >= 2**31 as uint32, and ``bound <= 2**31``)."""
    return bool(values.view(_U32).max() >= bound)


def _check_rows(rows: np.ndarray, num_rows: int, part: int, unique: bool,
                seen: np.ndarray) -> Result:
    """int32 rows in ``[0, num_rows)`` and, with ``unique``, listed once. ``seen`` (bool
    ``[num_rows]``, all False) is work space, left all False."""
    n = len(rows)
    if n == 0:
        return _PASS
    if _out_of_range(rows, num_rows):
        i = _first((rows < 0) | (rows >= num_rows))
        return ROW_RANGE, part, i, int(rows[i]), num_rows
    if unique and n > 1:
        if num_rows <= 64 * n:  # a histogram is cheaper than two scatters into `seen`
            distinct = np.count_nonzero(np.bincount(rows, minlength=num_rows))
        else:
            seen[rows] = True
            distinct = np.count_nonzero(seen)
            seen[rows] = False
        if distinct != n:
            order = np.argsort(rows, kind="stable")
            twice = order[1:][rows[order[1:]] == rows[order[:-1]]]
            i = int(twice.min())  # the first listing that repeats an earlier row
            return ROW_TWICE, part, i, int(rows[i]), 0
    return _PASS


def _check_blocks(rows: np.ndarray, num: np.ndarray, ids: np.ndarray, max_id: int, part: int,
                  num_rows: int, seen: np.ndarray, trusted: bool) -> Result:
    res = _check_rows(rows, num_rows, part, not trusted, seen)
    if res[0] != OK:
        return res
    n = len(num)
    if trusted:  # the producer promised the counts
        total = len(ids)
    elif n and np.count_nonzero(num == 1) == n:  # one block a row (decode steps)
        total = n
    elif n:
        if num.min() < 0:
            i = _first(num < 0)
            return NEG_COUNT, part, i, int(num[i]), 0
        total = int(num.sum())
    else:
        total = 0
    if total != len(ids):
        return ID_SUM, part, len(ids), total, 0
    if total and _out_of_range(ids, max_id):
        i = _first((ids < 0) | (ids >= max_id))
        return ID_RANGE, part, i, int(ids[i]), max_id
    return _PASS


def check_group_update(
    counts: np.ndarray, width: int, k: int, max_id: int,
    cleared: np.ndarray, add_rows: np.ndarray, add_num: np.ndarray, add_ids: np.ndarray,
    app_rows: np.ndarray, app_num: np.ndarray, app_ids: np.ndarray,
    null_rows: np.ndarray, null_blocks: np.ndarray, scratch: np.ndarray, seen: np.ndarray,
    trusted: bool = False,
) -> Result:
    """Validate one group's part of a step update against ``counts``; writes nothing visible.

    ``scratch`` (int64 ``[num_rows]``) and ``seen`` (bool ``[num_rows]``, all False) are work
    space; ``seen`` is left all False. ``trusted``: rows listed once per part and counts that
    sum to the ids are taken as promised (see :class:`~blocktable.update.StepUpdate`).
    """
    num_rows = len(counts)
    res = _check_rows(cleared, num_rows, CLEARED, False, seen)
    if res[0] != OK:
        return res
    res = _check_blocks(add_rows, add_num, add_ids, max_id, ADDED, num_rows, seen, trusted)
    if res[0] != OK:
        return res
    res = _check_blocks(app_rows, app_num, app_ids, max_id, APPENDED, num_rows, seen, trusted)
    if res[0] != OK:
        return res
    res = _check_rows(null_rows, num_rows, NULLED, False, seen)
    if res[0] != OK:
        return res
    if not (len(cleared) or len(add_rows) or len(null_rows)):
        # appends only (a decode step): counts after = counts + appended
        if len(app_rows):
            after = counts.take(app_rows) + app_num.astype(np.int64) * k
            if after.max() > width:
                i = _first(after > width)
                return WIDTH, 0, int(app_rows[i]), int(after[i]), width
        return _PASS
    # the rows' counts after the update, in scratch (only touched rows are read)
    for rows in (add_rows, app_rows, null_rows):
        if len(rows):
            scratch[rows] = counts[rows]
    if len(cleared):
        scratch[cleared] = 0
    if len(add_rows):
        scratch[add_rows] = add_num.astype(np.int64) * k
    if len(app_rows):
        scratch[app_rows] += app_num.astype(np.int64) * k
    for rows in (add_rows, app_rows):
        if len(rows):
            after = scratch[rows]
            if after.max() > width:
                i = _first(after > width)
                return WIDTH, 0, int(rows[i]), int(after[i]), width
    if len(null_rows):
        j = null_blocks.astype(np.int64)
        filled = scratch[null_rows]
        bad = (j < 0) | (j * k >= filled)
        if bad.any():
            i = _first(bad)
            return NULL_RANGE, i, int(j[i]), int(null_rows[i]), int(filled[i]) // k
    return _PASS


def runs(starts: np.ndarray, lengths: np.ndarray, total: int) -> np.ndarray:
    """int64 ``[total]``: the flat indices ``starts[i] .. starts[i]+lengths[i]-1``, run after run.

    ``lengths`` are >= 0 and sum to ``total``.
    """
    n = len(starts)
    if total == n and (n == 0 or lengths.min() == 1):
        return starts.astype(np.int64, copy=False)
    ends = np.cumsum(lengths)
    shift = np.repeat(starts.astype(np.int64) - (ends - lengths), lengths)
    shift += np.arange(total, dtype=np.int64)
    return shift


_FEW_RUNS = 16  # runs_into lists the indices in Python up to this many runs ...
_FEW_RUN_INDICES = 128  # ... and this many indices


def runs_into(out: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Write :func:`runs` of ``starts`` and ``lengths`` into ``out`` (``[lengths.sum()]``).

    A few short runs (a small step's rows) are listed by a Python loop: with the caches cold, as
    in an engine's step, that costs about a third of the vectorized path's half-dozen calls.
    """
    if len(starts) <= _FEW_RUNS and len(out) <= _FEW_RUN_INDICES:
        flat: list[int] = []
        for start, length in zip(starts.tolist(), lengths.tolist()):
            flat += range(start, start + length)
        out[:] = flat
    else:
        out[:] = runs(starts, lengths, len(out))


def small_sum(a: np.ndarray) -> int:
    """The sum of a short integer array as a Python int: ``sum(a.tolist())`` for a few entries
    (cheaper than a reduction with cold caches), ``np.add.reduce`` past them."""
    return sum(a.tolist()) if len(a) <= _FEW_RUNS else int(np.add.reduce(a))


def _log(journal: np.ndarray, journal_len: np.ndarray, starts: np.ndarray,
         lengths: np.ndarray) -> None:
    """Journal the runs ``(starts[i], lengths[i])`` of flat indices; past capacity, overflow.

    ``journal`` is int64 ``[capacity, 2]`` (start, length); ``journal_len`` int64 ``[2]`` holds
    the number of runs and of indices, or -1 runs after an overflow. Empty runs are skipped.
    """
    num_runs = int(journal_len[0])
    if num_runs < 0 or len(lengths) == 0:
        return
    if lengths.min() <= 0:
        keep = lengths > 0
        starts, lengths = starts[keep], lengths[keep]
        if len(lengths) == 0:
            return
    end = num_runs + len(lengths)
    total = int(journal_len[1]) + int(lengths.sum())
    if end > len(journal) or total > len(journal):
        journal_len[0] = -1  # overflow: the commit copies row spans instead
        return
    journal[num_runs:end, 0] = starts
    journal[num_runs:end, 1] = lengths
    journal_len[0] = end
    journal_len[1] = total


def _distinct(rows: np.ndarray) -> np.ndarray:
    """``rows`` without repeats, sorted (``np.unique`` costs ~100x more on tiny arrays)."""
    if len(rows) < 2:
        return rows
    rows = np.sort(rows)
    keep = np.empty(len(rows), dtype=bool)
    keep[0] = True
    np.not_equal(rows[1:], rows[:-1], out=keep[1:])
    return rows[keep]


def _log_same(journal: np.ndarray, journal_len: np.ndarray, starts: np.ndarray, offset: int,
              length: int) -> None:
    """:func:`_log` for runs that all have ``length`` > 0 entries, at ``starts + offset``."""
    num_runs = int(journal_len[0])
    if num_runs < 0:
        return
    end = num_runs + len(starts)
    total = int(journal_len[1]) + length * len(starts)
    if end > len(journal) or total > len(journal):
        journal_len[0] = -1
        return
    journal[num_runs:end, 0] = starts
    journal[num_runs:end, 0] += offset
    journal[num_runs:end, 1] = length
    journal_len[0] = end
    journal_len[1] = total


def kernel_ids(manager_ids: np.ndarray, k: int) -> np.ndarray:
    """int32: each manager id ``b`` as ``b*k .. b*k+k-1`` (null stays null)."""
    if k == 1:
        return manager_ids
    out = manager_ids[:, None] * np.int32(k) + np.arange(k, dtype=np.int32)
    out[manager_ids == 0] = 0
    return out.reshape(-1)


def _write_rows(table: np.ndarray, width: int, rows: np.ndarray, num: np.ndarray,
                ids: np.ndarray, old: np.ndarray) -> None:
    """Replace ``rows`` of the flat ``table`` by ``num[i]`` ids each; entries up to ``old[i]``
    past them become null."""
    m = len(rows)
    table2d = table.reshape(-1, width)
    most = int(num.max())
    if most == int(num.min()):  # rows of equal length: one 2-D assignment
        if most:
            table2d[rows, :most] = ids.reshape(m, most)
        tail = old > most
        if tail.any():
            stale = int(old.max())
            table2d[rows[tail], most:stale] = 0  # entries past a row's count are null already
        return
    span = max(most, int(old.max()))
    if m * span <= 4 * len(ids) + 4096:
        # pad every row to the longest with nulls: past a row's old count they already are
        padded = np.zeros((m, span), dtype=table.dtype)
        padded[np.arange(span) < num[:, None]] = ids
        table2d[rows, :span] = padded
        return
    starts = rows.astype(np.int64) * width
    table[runs(starts, num, len(ids))] = ids
    gap = np.maximum(old - num, 0)
    if gap.any():
        table[runs(starts + num, gap, int(gap.sum()))] = 0


def write_group_update(
    table: np.ndarray, counts: np.ndarray, width: int, k: int, offset: int,
    cleared: np.ndarray, add_rows: np.ndarray, add_num: np.ndarray, add_ids: np.ndarray,
    app_rows: np.ndarray, app_num: np.ndarray, app_ids: np.ndarray,
    null_rows: np.ndarray, null_blocks: np.ndarray,
    dirty: np.ndarray, journal: np.ndarray, journal_len: np.ndarray,
) -> None:
    """Apply a checked update to one group's flat host ``table`` (int32 ``[rows*width]``).

    Manager ids become ``k`` kernel ids each (the null block stays null). Every written run of
    entries goes to the ``journal`` as flat indices (``offset`` + local index); touched rows
    are marked in ``dirty``.
    """
    if len(cleared):
        rows = _distinct(cleared)  # a row may be listed twice; clear (and journal) it once
        old = counts[rows].astype(np.int64)
        starts = rows.astype(np.int64) * width
        if old.any():
            table[runs(starts, old, int(old.sum()))] = 0
        _log(journal, journal_len, starts + offset, old)
        counts[rows] = 0
        dirty[rows] = True
    if len(add_rows):
        num = add_num.astype(np.int64) * k
        old = counts[add_rows].astype(np.int64)
        _write_rows(table, width, add_rows, num, kernel_ids(add_ids, k), old)
        _log(journal, journal_len, add_rows.astype(np.int64) * width + offset,
             np.maximum(num, old))
        counts[add_rows] = num
        dirty[add_rows] = True
    if len(app_rows) and np.count_nonzero(app_num == 1) == len(app_rows):  # decode steps
        filled = counts[app_rows]
        starts = app_rows * width  # int32: the flat table has < 2**31 entries
        starts += filled
        if k == 1:
            table[starts] = app_ids
        else:
            table[(starts[:, None] + np.arange(k, dtype=np.int32)).reshape(-1)] = kernel_ids(
                app_ids, k
            )
        _log_same(journal, journal_len, starts, offset, k)
        filled += k
        counts[app_rows] = filled
        dirty[app_rows] = True
    elif len(app_rows):
        num = app_num.astype(np.int64) * k
        starts = app_rows.astype(np.int64) * width + counts[app_rows]
        table[runs(starts, num, len(app_ids) * k)] = kernel_ids(app_ids, k)
        _log(journal, journal_len, starts + offset, num)
        counts[app_rows] += num.astype(counts.dtype)
        dirty[app_rows] = True
    if len(null_rows):
        starts = null_rows.astype(np.int64) * width + null_blocks.astype(np.int64) * k
        lengths = np.full(len(starts), k, dtype=np.int64)
        table[runs(starts, lengths, len(starts) * k)] = 0
        _log(journal, journal_len, starts + offset, lengths)
        dirty[null_rows] = True


def fill_staging(
    journal: np.ndarray, journal_len: np.ndarray, dirty: np.ndarray, counts_offset: int,
    host: np.ndarray, staging: np.ndarray, capacity: int,
) -> int:
    """Gather a commit's ``(flat index, value)`` pairs into ``staging``; reset the changes.

    ``staging`` (int32 ``[1 + 2*capacity]``) receives the number of pairs, then the indices,
    then the values. Entries are the journal's runs plus the count of every dirty row
    (``dirty`` bool ``[groups, rows]``); on success ``dirty`` and the journal are reset.
    Returns the number of pairs, or -1 (nothing written or reset) when they exceed
    ``capacity`` or the journal overflowed.
    """
    num_runs = int(journal_len[0])
    if num_runs < 0:
        return -1
    num_indices = int(journal_len[1])
    flat_dirty = dirty.reshape(-1)
    dirty_rows = flat_dirty.nonzero()[0]
    total = num_indices + len(dirty_rows)
    if total > capacity:
        return -1
    index = staging[1 : 1 + total]
    if num_runs == num_indices:  # runs of one entry each (journaled runs are never empty)
        index[:num_indices] = journal[:num_runs, 0]
    elif num_runs:
        index[:num_indices] = runs(journal[:num_runs, 0], journal[:num_runs, 1], num_indices)
    # dirty[g, r] is row r of group g: its count sits at counts_offset + g * num_rows + r
    index[num_indices:] = dirty_rows
    index[num_indices:] += counts_offset
    flat_dirty.put(dirty_rows, False)
    host.take(index, out=staging[1 + total : 1 + 2 * total])
    staging[0] = total
    journal_len[0] = 0
    journal_len[1] = 0
    return total


def _append_one_block(
    table: np.ndarray, counts: np.ndarray, width: int, k: int, max_id: int,
    rows: np.ndarray, num: np.ndarray, ids: np.ndarray, dirty: np.ndarray,
    journal: np.ndarray, journal_len: np.ndarray, trusted: bool,
) -> bool:
    """A decode step's update for a table at offset 0 (one group): one manager block appended to
    each of ``rows``. Writes and returns True only when every check passes; returns False,
    having written nothing, when the general path must look (an error, or another shape).

    Array methods (``take``/``put``) cost a third of fancy indexing for arrays this small.
    """
    n = len(rows)
    if len(ids) != n or np.count_nonzero(num == 1) != n:
        return False
    if _out_of_range(rows, len(counts)):
        return False
    filled = counts.take(rows)
    if not trusted and np.count_nonzero(np.bincount(rows, minlength=len(counts))) != n:
        return False  # a row listed twice
    if _out_of_range(ids, max_id) or filled.max() > width - k:
        return False
    num_runs = int(journal_len[0])
    end = num_runs + n
    total = int(journal_len[1]) + n * k
    starts = rows * width  # int32: the flat table has < 2**31 entries
    starts += filled
    if k == 1:
        table.put(starts, ids)
    else:
        table.put((starts[:, None] + np.arange(k, dtype=np.int32)).reshape(-1), kernel_ids(ids, k))
    if num_runs >= 0 and (end > len(journal) or total > len(journal)):
        journal_len[0] = -1  # overflow: the commit copies row spans instead
    elif num_runs >= 0:
        journal[num_runs:end, 0] = starts
        journal[num_runs:end, 1] = k
        journal_len[0] = end
        journal_len[1] = total
    filled += k
    counts.put(rows, filled)
    dirty.put(rows, True)
    return True


def check_and_write_group_update(
    table: np.ndarray, counts: np.ndarray, width: int, k: int, max_id: int, offset: int,
    cleared: np.ndarray, add_rows: np.ndarray, add_num: np.ndarray, add_ids: np.ndarray,
    app_rows: np.ndarray, app_num: np.ndarray, app_ids: np.ndarray,
    null_rows: np.ndarray, null_blocks: np.ndarray, scratch: np.ndarray, seen: np.ndarray,
    dirty: np.ndarray, journal: np.ndarray, journal_len: np.ndarray, trusted: bool = False,
) -> Result:
    """:func:`check_group_update`, then (only if it passed) :func:`write_group_update`: one
    call for a one-group table's whole step."""
    if (offset == 0 and len(app_rows) and not (len(cleared) or len(add_rows) or len(null_rows))
            and _append_one_block(table, counts, width, k, max_id, app_rows, app_num, app_ids,
                                  dirty, journal, journal_len, trusted)):
        return _PASS
    res = check_group_update(
        counts, width, k, max_id, cleared, add_rows, add_num, add_ids,
        app_rows, app_num, app_ids, null_rows, null_blocks, scratch, seen, trusted,
    )
    if res[0] == OK:
        write_group_update(
            table, counts, width, k, offset, cleared, add_rows, add_num, add_ids,
            app_rows, app_num, app_ids, null_rows, null_blocks, dirty, journal, journal_len,
        )
    return res
