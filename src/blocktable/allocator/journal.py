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

import struct
from collections.abc import Sequence

import numpy as np

from blocktable.allocator.request import RequestState
from blocktable.update import AllocatorFacts, RowBlocks, RowEntries, StepUpdate

_EMPTY = np.zeros(0, dtype=np.int32)
_EMPTY.flags.writeable = False
_NO_BLOCKS = RowBlocks()  # frozen, holding the shared empty array: one instance serves all
_NO_ENTRIES = RowEntries()


def _int32(values: list[int]) -> np.ndarray:
    """A read-only int32 array of ``values``; empty lists share one empty array.

    ``struct.pack`` converts a list of ints in one C loop, about twice as fast as
    ``np.fromiter``; the array's memory is an immutable ``bytes`` object, so nobody can make it
    writable again (the update's facts stay true).
    """
    if not values:
        return _EMPTY
    return np.frombuffer(struct.pack(f"={len(values)}i", *values), dtype=np.int32)


def _row_blocks(rows: list[int], counts: list[int], ids: list[np.ndarray]) -> RowBlocks:
    if not rows:
        return _NO_BLOCKS
    joined = b"".join([a.tobytes() for a in ids])  # a copy, in immutable memory
    return RowBlocks(_int32(rows), _int32(counts), np.frombuffer(joined, dtype=np.int32))


def _packed(ints: list[int], sizes: tuple[int, ...], arrays: list[np.ndarray]) -> list[np.ndarray]:
    """``ints`` cut into parts of ``sizes``, then ``arrays`` joined as one more part: int32
    arrays, all read-only views of one immutable buffer built by one ``struct.pack`` (about a
    microsecond for a decode step's few dozen ints); empty parts are the shared empty array."""
    data = struct.pack(f"={len(ints)}i", *ints)
    if arrays:
        data = b"".join([data, *(a.tobytes() for a in arrays)])
    if not data:
        return [_EMPTY] * (len(sizes) + 1)
    flat = np.frombuffer(data, dtype=np.int32)  # read-only: its memory is a bytes object
    out, at = [], 0
    for n in (*sizes, len(flat) - len(ints)):
        out.append(flat[at : at + n] if n else _EMPTY)
        at += n
    return out


class StepJournal:
    """Rows touched since the last :meth:`take`, with their holder and lengths at first touch."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        # row -> (holder at first touch or None, its row lengths per group)
        self.marks: dict[int, tuple[RequestState | None, tuple[int, ...]]] = {}
        # row -> per group, old entries nulled since the first touch (same holder only)
        self._nulled: dict[int, list[list[int]]] = {}

    def touch(self, row: int, holder: RequestState | None) -> None:
        """Remember ``row`` as it is now, before its first change in this step."""
        if row not in self.marks:
            lengths = () if holder is None else tuple(holder.row_len)
            self.marks[row] = (holder, lengths)

    def null(self, req: RequestState, group: int, block_index: int) -> None:
        """Record that ``req``'s entry ``block_index`` of ``group`` became the null block."""
        holder, lengths = self.marks[req.row]
        if holder is req and block_index < lengths[group]:
            if req.row not in self._nulled:
                self._nulled[req.row] = [[] for _ in range(self.num_groups)]
            self._nulled[req.row][group].append(block_index)

    def take(
        self,
        holders: Sequence[RequestState | None],
        allocator_block_sizes: tuple[int, ...] | None = None,
    ) -> StepUpdate:
        """The net change of every touched row (``holders[row]`` is the live holder); reset.

        ``allocator_block_sizes`` is stamped on the update. Costs Python work per *touched*
        row only, and a fixed handful of numpy calls.
        """
        if self.num_groups == 1 and not self._nulled:
            update = self._take_one_group(holders, allocator_block_sizes)
        else:
            update = self._take_general(holders, allocator_block_sizes)
        self.marks = {}
        self._nulled = {}
        return update

    def _take_one_group(
        self, holders: Sequence[RequestState | None], sizes: tuple[int, ...] | None
    ) -> StepUpdate:
        """:meth:`take` for one group without nulled entries (every decode step): appended ids
        are read as Python ints, and the rows, counts and ids of the whole step become int32
        arrays in one numpy call (read-only views of one buffer)."""
        cleared: list[int] = []
        add_rows: list[int] = []
        add_counts: list[int] = []
        add_ids: list[np.ndarray] = []
        app_rows: list[int] = []
        app_counts: list[int] = []
        app_ids: list[int] = []
        one_each = True
        for row, (start, lengths) in self.marks.items():
            live = holders[row]
            if live is start:
                if live is not None:
                    n, old = live.row_len[0], lengths[0]
                    if n > old:
                        app_rows.append(row)
                        app_counts.append(n - old)
                        if n - old == 1:
                            app_ids.append(live.block_buf[0].item(old))
                        else:
                            one_each = False
                            app_ids += live.block_buf[0][old:n].tolist()
            elif live is None:
                cleared.append(row)
            else:
                add_rows.append(row)
                add_counts.append(live.row_len[0])
                add_ids.append(live.blocks(0))
        cleared_rows, a_rows, a_counts, p_rows, p_counts, p_ids, a_ids = _packed(
            cleared + add_rows + add_counts + app_rows + app_counts + app_ids,
            (len(cleared), len(add_rows), len(add_rows), len(app_rows), len(app_rows),
             len(app_ids)), add_ids)
        added = RowBlocks(a_rows, a_counts, a_ids) if add_rows else _NO_BLOCKS
        appended = RowBlocks(p_rows, p_counts, p_ids) if app_rows else _NO_BLOCKS
        update = StepUpdate(cleared_rows, (added,), (appended,), (_NO_ENTRIES,), sizes)
        object.__setattr__(update, "facts", AllocatorFacts(
            len(holders), (max(app_ids) if app_ids else -1,), (one_each,),
            (max(add_counts) if add_counts else -1,)))
        return update

    def _take_general(
        self, holders: Sequence[RequestState | None], sizes: tuple[int, ...] | None
    ) -> StepUpdate:
        """:meth:`take` for several groups or with nulled entries."""
        num_groups = self.num_groups
        groups = range(num_groups)
        cleared: list[int] = []
        add_rows: list[int] = []
        add_counts: list[list[int]] = [[] for _ in groups]
        add_ids: list[list[np.ndarray]] = [[] for _ in groups]
        app_rows: list[list[int]] = [[] for _ in groups]
        app_counts: list[list[int]] = [[] for _ in groups]
        app_ids: list[list[np.ndarray]] = [[] for _ in groups]
        one_each = [True] * num_groups
        null_rows: list[list[int]] = [[] for _ in groups]
        null_idx: list[list[int]] = [[] for _ in groups]
        nulled = self._nulled
        for row, (start, lengths) in self.marks.items():
            live = holders[row]
            if live is None:
                if start is not None:
                    cleared.append(row)
            elif live is start:
                for g in groups:
                    n, old = live.row_len[g], lengths[g]
                    if n > old:
                        app_rows[g].append(row)
                        app_counts[g].append(n - old)
                        app_ids[g].append(live.block_buf[g][old:n])
                        if n - old > 1:
                            one_each[g] = False
                if row in nulled:
                    for g, indices in enumerate(nulled[row]):
                        null_rows[g] += [row] * len(indices)
                        null_idx[g] += indices
            else:
                add_rows.append(row)
                for g in groups:
                    add_counts[g].append(live.row_len[g])
                    add_ids[g].append(live.blocks(g))
        update = StepUpdate(
            _int32(cleared),
            tuple(_row_blocks(add_rows, add_counts[g], add_ids[g]) for g in groups),
            tuple(_row_blocks(app_rows[g], app_counts[g], app_ids[g]) for g in groups),
            tuple(RowEntries(_int32(null_rows[g]), _int32(null_idx[g])) if null_rows[g]
                  else _NO_ENTRIES for g in groups),
            sizes,
        )
        unknown = (-1,) * num_groups  # the ids are arrays here: the table checks their range
        object.__setattr__(update, "facts", AllocatorFacts(
            len(holders), unknown, tuple(one_each), unknown))
        return update
