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
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from blocktable.allocator.request import RequestState
from blocktable.update import RowBlocks, RowEntries, StepUpdate

_EMPTY = np.zeros(0, dtype=np.int32)


def _int32(values: list[int]) -> np.ndarray:
    """A writable int32 copy of ``values``; empty lists share one empty array.

    ``struct.pack`` converts a list of ints in one C loop, about twice as fast as
    ``np.fromiter`` (rows and counts; block ids are sliced from the rows' arrays).
    """
    if not values:
        return _EMPTY
    packed = bytearray(struct.pack(f"={len(values)}i", *values))
    return np.frombuffer(packed, dtype=np.int32)


def _row_blocks(rows: list[int], counts: list[int], ids: list[np.ndarray]) -> RowBlocks:
    if not rows:
        return RowBlocks()
    return RowBlocks(_int32(rows), _int32(counts), np.concatenate(ids))  # a copy


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

    def take(self, holders: Sequence[RequestState | None]) -> StepUpdate:
        """The net change of every touched row (``holders[row]`` is the live holder); reset."""
        num_groups = self.num_groups
        cleared: list[int] = []
        add_rows: list[int] = []
        add_counts: list[list[int]] = [[] for _ in range(num_groups)]
        add_ids: list[list[np.ndarray]] = [[] for _ in range(num_groups)]
        app_rows: list[list[int]] = [[] for _ in range(num_groups)]
        app_counts: list[list[int]] = [[] for _ in range(num_groups)]
        app_ids: list[list[np.ndarray]] = [[] for _ in range(num_groups)]
        null_rows: list[list[int]] = [[] for _ in range(num_groups)]
        null_idx: list[list[int]] = [[] for _ in range(num_groups)]
        nulled = self._nulled
        groups = range(num_groups)
        if num_groups == 1 and not nulled:  # the common case, without the loops over groups
            app_rows0, app_counts0, app_ids0 = app_rows[0], app_counts[0], app_ids[0]
            for row, (start, lengths) in self.marks.items():
                live = holders[row]
                if live is start:
                    if live is not None:
                        n, old = live.row_len[0], lengths[0]
                        if n > old:
                            app_rows0.append(row)
                            app_counts0.append(n - old)
                            app_ids0.append(live.block_buf[0][old:n])
                elif live is None:
                    cleared.append(row)
                else:
                    add_rows.append(row)
                    add_counts[0].append(live.row_len[0])
                    add_ids[0].append(live.blocks(0))
            marks: dict[int, tuple[RequestState | None, tuple[int, ...]]] = {}
        else:
            marks = self.marks
        for row, (start, lengths) in marks.items():
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
                if row in nulled:
                    for g, indices in enumerate(nulled[row]):
                        null_rows[g] += [row] * len(indices)
                        null_idx[g] += indices
            else:
                add_rows.append(row)
                for g in groups:
                    add_counts[g].append(live.row_len[g])
                    add_ids[g].append(live.blocks(g))
        self.marks = {}
        self._nulled = {}
        return StepUpdate.make(
            num_groups,
            cleared_rows=_int32(cleared),
            added=[_row_blocks(add_rows, add_counts[g], add_ids[g]) for g in range(num_groups)],
            appended=[
                _row_blocks(app_rows[g], app_counts[g], app_ids[g]) for g in range(num_groups)
            ],
            nulled=[
                RowEntries(_int32(null_rows[g]), _int32(null_idx[g]))
                if null_rows[g]
                else RowEntries()
                for g in range(num_groups)
            ],
        )
