"""The journal of row changes between two steps, turned into one :class:`StepUpdate`.

Rather than logging every operation, the journal remembers, for each row touched since the last
:meth:`StepJournal.take`, which request held it and how long its rows were at the first touch.
At ``take`` time it diffs that against the live state, so any sequence of operations within a
step (admit then allocate, allocate then free, free then reuse the row for another request)
collapses to its net effect:

* a row whose holder left and that is now free          -> ``cleared_rows``
* a row held by a different request than at the start    -> ``added`` (the whole row, every
  group; a request admitted and allocated in the same step appears only here, with its cached
  hits and its new blocks together)
* a row held by the same request                         -> ``appended`` (ids past the old
  length) and ``nulled`` (old entries that left a sliding window); ids appended and released in
  the same step are appended as ``NULL_BLOCK_ID``.

A row never appears in both ``cleared_rows`` and ``added``: ``added`` replaces it fully.

The update carries :class:`~blocktable.update.AllocatorFacts` (rows in range and listed once,
the largest appended id, one id per appended row) and its arrays are read-only, so those facts
stay true: the captured step skips the checks they settle.
"""

from __future__ import annotations

import numpy as np

from blocktable.allocator.rowstate import RowState
from blocktable.update import AllocatorFacts, RowBlocks, RowEntries, StepUpdate

_EMPTY = np.zeros(0, dtype=np.int32)
_EMPTY.flags.writeable = False
_NO_BLOCKS = RowBlocks()  # frozen, holding the shared empty array: one instance serves all
_NO_ENTRIES = RowEntries()
_EMPTY_INTP = np.zeros(0, dtype=np.intp)


class StepJournal:
    """Rows touched since the last :meth:`take`, with their holder and lengths at first touch.

    Kept in arrays indexed by row (``rows``: the manager's :class:`RowState`): a touch of many
    rows is one gather and a few scatters, and ``take`` reads the live state of every touched
    row with gathers (holder generations tell a row's first holder from the live one).
    """

    def __init__(self, num_groups: int, rows: RowState) -> None:
        self.num_groups = num_groups
        self.rows = rows
        num_rows = rows.num_rows
        self.touched = np.zeros(num_rows, dtype=bool)  # on cpu, [num_rows]
        self.start_gen = np.zeros(num_rows, dtype=np.int64)  # holder at the first touch
        self.start_len = np.zeros((num_groups, num_rows), dtype=np.int64)  # its row lengths
        self.num_touched = 0
        # row -> per group, old entries nulled since the first touch (same holder only)
        self._nulled: dict[int, list[list[int]]] = {}

    def touch(self, row: int) -> None:
        """Remember ``row`` as it is now, before its first change in this step."""
        if not self.touched[row]:
            self.touched[row] = True
            self.start_gen[row] = self.rows.holder_gen[row]
            self.start_len[:, row] = self.rows.row_len[:, row]
            self.num_touched += 1

    def touch_many(self, rows: np.ndarray, *, lengths: bool = True) -> None:
        """:meth:`touch` of distinct ``rows`` (intp). ``lengths=False`` when the rows are freed
        now or are free (their lengths at the first touch are never read: such a row ends
        cleared or added, never appended to)."""
        new = rows[~self.touched[rows]]
        if len(new):
            self.touched[new] = True
            self.start_gen[new] = self.rows.holder_gen[new]
            if lengths:
                self.start_len[:, new] = self.rows.row_len[:, new]
            self.num_touched += len(new)

    def null(self, row: int, group: int, block_index: int) -> None:
        """Record that entry ``block_index`` of ``group`` in ``row`` (touched, held by the same
        request since) became the null block."""
        if self.start_gen[row] == self.rows.holder_gen[row] and block_index < self.start_len[
            group, row
        ]:
            if row not in self._nulled:
                self._nulled[row] = [[] for _ in range(self.num_groups)]
            self._nulled[row][group].append(block_index)

    def take(self, allocator_block_sizes: tuple[int, ...] | None = None) -> StepUpdate:
        """The net change of every touched row; reset.

        ``allocator_block_sizes`` is stamped on the update. A fixed handful of numpy calls per
        group, whatever the number of touched rows.
        """
        num_groups = self.num_groups
        state = self.rows
        if self.num_touched:
            touched = np.flatnonzero(self.touched)
            self.touched[touched] = False
            self.num_touched = 0
        else:
            touched = _EMPTY_INTP
        live = state.holder_gen[touched]
        start = self.start_gen[touched]
        same = live == start
        if same.all() and live.all():  # every touched row kept its holder (a decode step)
            cleared = added = _EMPTY_INTP
            kept = touched
        else:
            held = live != 0
            cleared = touched[~held & (start != 0)]
            added = touched[~same & held]
            kept = touched[same & held]
        arrays: list[np.ndarray] = [cleared, added]  # packed into one buffer below
        largest_id: list[int] = []
        one_each: list[bool] = []
        largest_added: list[int] = []
        num_appended: list[int] = []
        for g in range(num_groups):
            row_len = state.row_len[g]
            if len(added):
                counts = row_len[added]
                arrays += [counts, state.gather(g, added, np.zeros_like(counts), counts)]
                largest_added.append(int(counts.max()))
            else:
                arrays += [_EMPTY_INTP, _EMPTY_INTP]
                largest_added.append(-1)
            old = self.start_len[g, kept]
            grew = row_len[kept] - old
            if len(kept) and (grew == 1).all():  # one block each (a decode step)
                rows, num, ids = kept, grew, state.blocks[g][kept, old]
            else:
                at = np.flatnonzero(grew > 0)
                rows, num, old = kept[at], grew[at], old[at]
                ids = state.gather(g, rows, old, num)
            arrays += [rows, num, ids]
            num_appended.append(len(rows))
            one_each.append(len(ids) == len(rows))
            largest_id.append(int(ids.max()) if len(ids) else -1)
        for rows, indices in self._null_parts(num_groups):
            arrays += [rows, indices]
        self._nulled = {}
        views = _frozen_int32(arrays)
        cleared_rows, added_rows = views[0], views[1]
        at = 2
        added_blocks, appended_blocks = [], []
        for g in range(num_groups):
            counts, add_ids, rows, num, ids = views[at : at + 5]
            at += 5
            added_blocks.append(RowBlocks(added_rows, counts, add_ids) if len(added) else _NO_BLOCKS)
            appended_blocks.append(RowBlocks(rows, num, ids) if num_appended[g] else _NO_BLOCKS)
        nulled_entries = []
        for _ in range(num_groups):
            rows, indices = views[at], views[at + 1]
            at += 2
            nulled_entries.append(RowEntries(rows, indices) if len(rows) else _NO_ENTRIES)
        update = StepUpdate(
            cleared_rows,
            tuple(added_blocks),
            tuple(appended_blocks),
            tuple(nulled_entries),
            allocator_block_sizes,
        )
        object.__setattr__(update, "facts", AllocatorFacts(
            state.num_rows, tuple(largest_id), tuple(one_each), tuple(largest_added)))
        return update

    def _null_parts(self, num_groups: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per group, the rows and indices of old entries nulled in rows still held by their
        first holder (sorted by row, in the order they were nulled)."""
        if not self._nulled:
            return [(_EMPTY_INTP, _EMPTY_INTP)] * num_groups
        gens = self.rows.holder_gen
        out = []
        for g in range(num_groups):
            rows: list[int] = []
            indices: list[int] = []
            for row in sorted(self._nulled):
                if gens[row] == self.start_gen[row]:
                    nulled = self._nulled[row][g]
                    rows += [row] * len(nulled)
                    indices += nulled
            out.append((np.array(rows, dtype=np.intp), np.array(indices, dtype=np.intp)))
        return out


def _frozen_int32(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """``arrays`` (integers) as int32 read-only views of one immutable buffer (a ``bytes``
    object, so nobody can make them writable again); empty ones are the shared empty array."""
    flat = np.concatenate(arrays, dtype=np.int32, casting="unsafe")
    if not len(flat):
        return [_EMPTY] * len(arrays)
    flat = np.frombuffer(flat.tobytes(), dtype=np.int32)
    out, at = [], 0
    for a in arrays:
        n = len(a)
        out.append(flat[at : at + n] if n else _EMPTY)
        at += n
    return out
