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

A row never appears in both ``cleared_rows`` and ``added``: ``added`` replaces it fully. The
update is built with ``trusted=True``: its rows are table rows, each listed once per part and
disjoint across the parts, its counts sum to its ids and its ids are ids of the group's pool.
Its arrays are read-only views of one immutable buffer, so nobody can break those promises
after the fact.
"""

from __future__ import annotations

import numpy as np

from blocktable import _compiled_loader as _loader
from blocktable.allocator.rowstate import RowState
from blocktable.update import RowBlocks, RowEntries, StepUpdate

_EMPTY32 = np.zeros(0, dtype=np.int32)
_EMPTY32.flags.writeable = False
_NO_BLOCKS = RowBlocks(_EMPTY32, _EMPTY32, _EMPTY32)  # (frozen: one serves every update)
_NO_ENTRIES = RowEntries(_EMPTY32, _EMPTY32)


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
        # on cpu, [num_rows]: a row was touched in this step when its stamp is `_stamp`;
        # take() moves `_stamp` on, so nothing is reset per row
        self.touched = np.zeros(num_rows, dtype=np.int64)
        self._stamp = 1
        self.start_gen = np.zeros(num_rows, dtype=np.int64)  # holder at the first touch
        self.start_len = np.zeros((num_groups, num_rows), dtype=np.int64)  # its row lengths
        self._order: list[np.ndarray] = []  # the touched rows, in batches (distinct overall)
        # row -> per group, old entries nulled since the first touch (same holder only)
        self._nulled: dict[int, list[list[int]]] = {}
        # the compiled diff of the touched rows, where the install built it (else numpy)
        compiled = _loader.COMPILED
        self._compiled_diff = None if compiled is None else compiled.journal_diff

    def touch(self, rows: list[int] | np.ndarray) -> None:
        """Remember ``rows`` (distinct table rows) as they are now, before their first change
        in this step; rows touched before in this step are left as they were."""
        rows = np.asarray(rows, dtype=np.intp)
        fresh = rows[self.touched.take(rows) != self._stamp]
        if not len(fresh):
            return
        self.touched[fresh] = self._stamp
        self.start_gen[fresh] = self.rows.holder_gen.take(fresh)
        for start_len, row_len in zip(self.start_len, self.rows.row_len):
            start_len[fresh] = row_len.take(fresh)
        self._order.append(fresh)

    def null(self, row: int, group: int, block_index: int) -> None:
        """Record that entry ``block_index`` of ``group`` in ``row`` (touched, held by the same
        request since) became the null block."""
        if (
            self.start_gen[row] == self.rows.holder_gen[row]
            and block_index < self.start_len[group, row]
        ):
            if row not in self._nulled:
                self._nulled[row] = [[] for _ in range(self.num_groups)]
            self._nulled[row][group].append(block_index)

    def take(self, allocator_block_sizes: tuple[int, ...] | None = None) -> StepUpdate:
        """The net change of every touched row (``allocator_block_sizes`` stamped on it); then
        reset. A fixed handful of numpy calls per group, whatever the number of rows."""
        order, self._order = self._order, []
        self._stamp += 1
        G = self.num_groups
        if not order and not self._nulled:  # nothing touched
            return StepUpdate(_EMPTY32, (_NO_BLOCKS,) * G, (_NO_BLOCKS,) * G,
                              (_NO_ENTRIES,) * G, allocator_block_sizes, trusted=True)
        if self._compiled_diff is not None:
            return self._take_compiled(allocator_block_sizes)
        # rows in order: the same update whichever calls (batched or not) touched them
        touched = np.sort(order[0] if len(order) == 1 else np.concatenate(order))
        state = self.rows
        live = state.holder_gen.take(touched)
        start = self.start_gen.take(touched)
        if not self._nulled and (live == start).all() and live.all():
            # every touched row is still held by its first holder and nothing left a window:
            # rows only grew (decode steps, prefill chunks)
            return self._take_growth(touched, allocator_block_sizes)
        held = live != 0
        cleared = touched[~held & (start != 0)]
        added = touched[held & (live != start)]
        kept = touched[held & (live == start)]
        parts: list[np.ndarray] = [cleared, added]  # packed into one buffer below
        for g in range(G):
            counts = state.row_len[g, added]
            parts += [counts, state.gather(g, added, np.zeros_like(counts), counts)]
            parts += self._grown(g, kept)
        parts += self._null_parts()
        self._nulled = {}
        views = iter(_frozen_int32(parts))
        cleared_rows, added_rows = next(views), next(views)
        added_blocks, appended_blocks = [], []
        for _ in range(G):
            counts, ids = next(views), next(views)
            added_blocks.append(RowBlocks(added_rows, counts, ids))
            appended_blocks.append(RowBlocks(next(views), next(views), next(views)))
        nulled = [RowEntries(next(views), next(views)) for _ in range(G)]
        return StepUpdate(
            cleared_rows,
            tuple(added_blocks),
            tuple(appended_blocks),
            tuple(nulled),
            allocator_block_sizes,
            trusted=True,
        )

    def _take_compiled(self, allocator_block_sizes: tuple[int, ...] | None) -> StepUpdate:
        """:meth:`take` through the compiled diff (one pass over the touched stamps, the same
        parts in the same order as the numpy classification below)."""
        state = self.rows
        assert self._compiled_diff is not None
        flat, lengths = self._compiled_diff(self.touched, self._stamp - 1, self.start_gen,
                                            state.holder_gen, self.start_len, state.row_len,
                                            state.blocks)
        flat.flags.writeable = False  # (its views cannot be made writable)
        views, at = [], 0
        for n in lengths:
            views.append(flat[at : at + n] if n else _EMPTY32)
            at += n
        G = self.num_groups
        cleared_rows, added_rows = views[0], views[1]
        # empty parts are the shared empty ones (most steps only grow rows)
        added_blocks = (tuple(RowBlocks(added_rows, views[2 + 5 * g], views[3 + 5 * g])
                              for g in range(G)) if lengths[1] else (_NO_BLOCKS,) * G)
        appended_blocks = tuple(RowBlocks(*views[4 + 5 * g : 7 + 5 * g]) if lengths[4 + 5 * g]
                                else _NO_BLOCKS for g in range(G))
        if self._nulled:
            nulls = iter(_frozen_int32(self._null_parts()))
            self._nulled = {}
            nulled = tuple(RowEntries(next(nulls), next(nulls)) for _ in range(G))
        else:
            nulled = (_NO_ENTRIES,) * G
        return StepUpdate(cleared_rows, added_blocks, appended_blocks, nulled,
                          allocator_block_sizes, trusted=True)

    def _grown(self, group: int, kept: np.ndarray) -> list[np.ndarray]:
        """Rows of ``kept`` (held by their first holder) that grew in ``group``: the rows, how
        many entries each gained and those entries."""
        old = self.start_len[group].take(kept)
        grew = self.rows.row_len[group].take(kept)
        grew -= old
        if not len(grew) or grew.min() <= 0:
            grown = grew > 0
            kept, grew, old = kept[grown], grew[grown], old[grown]
        return [kept, grew, self.rows.gather(group, kept, old, grew)]

    def _take_growth(self, touched: np.ndarray,
                     allocator_block_sizes: tuple[int, ...] | None) -> StepUpdate:
        """:meth:`take` when every touched row only grew: appended entries, nothing else."""
        views = iter(_frozen_int32([a for g in range(self.num_groups)
                                    for a in self._grown(g, touched)]))
        appended = tuple(RowBlocks(next(views), next(views), next(views))
                         for _ in range(self.num_groups))
        G = self.num_groups
        return StepUpdate(_EMPTY32, (_NO_BLOCKS,) * G, appended, (_NO_ENTRIES,) * G,
                          allocator_block_sizes, trusted=True)

    def _null_parts(self) -> list[np.ndarray]:
        """Per group, the rows and indices of old entries nulled in rows still held by their
        first holder (sorted by row, in the order they were nulled)."""
        gens = self.rows.holder_gen
        out = []
        for g in range(self.num_groups):
            rows: list[int] = []
            indices: list[int] = []
            for row in sorted(self._nulled):
                if gens[row] == self.start_gen[row]:
                    nulled = self._nulled[row][g]
                    rows += [row] * len(nulled)
                    indices += nulled
            out += [np.array(rows, dtype=np.intp), np.array(indices, dtype=np.intp)]
        return out


def _frozen_int32(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """``arrays`` (integers) as int32 read-only views of one read-only buffer (a view of a
    read-only array cannot be made writable); empty ones are one shared empty array."""
    flat = np.concatenate(arrays, dtype=np.int32, casting="unsafe")
    flat.flags.writeable = False  # (its views cannot be made writable)
    out, at = [], 0
    for a in arrays:
        n = len(a)
        out.append(flat[at : at + n] if n else _EMPTY32)
        at += n
    return out
