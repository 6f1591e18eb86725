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
        self._bind()
        self._no_blocks = (_NO_BLOCKS,) * num_groups
        self._no_entries = (_NO_ENTRIES,) * num_groups

    def _bind(self) -> None:
        """The compiled diff of the touched rows, bound to these arrays (the row state's are
        never reallocated), where the install built it (else numpy)."""
        compiled, rows = _loader.COMPILED, self.rows
        self._compiled_diff = None if compiled is None else compiled.JournalDiff(
            self.touched, self.start_gen, rows.holder_gen, self.start_len, rows.row_len,
            _EMPTY32, RowBlocks, _NO_BLOCKS).diff

    def __getstate__(self) -> dict[str, object]:  # the compiled diff is bound, not pickled
        return {k: v for k, v in self.__dict__.items() if k != "_compiled_diff"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._bind()

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
        if not order and not self._nulled:  # nothing touched
            return StepUpdate(_EMPTY32, self._no_blocks, self._no_blocks, self._no_entries,
                              allocator_block_sizes, trusted=True)
        if self._compiled_diff is not None:
            cleared_rows, added, appended = self._compiled_diff(self._stamp - 1,
                                                                self.rows.blocks)
        else:
            cleared_rows, added, appended = self._diff(order)
        if self._nulled:
            nulls = _frozen_int32(self._null_parts())
            self._nulled = {}
            nulled = tuple([RowEntries(nulls[2 * g], nulls[2 * g + 1])
                            for g in range(self.num_groups)])
        else:
            nulled = self._no_entries
        return StepUpdate(cleared_rows, added, appended, nulled, allocator_block_sizes,
                          trusted=True)

    def _diff(self, order: list[np.ndarray]
              ) -> tuple[np.ndarray, tuple[RowBlocks, ...], tuple[RowBlocks, ...]]:
        """The numpy twin of the compiled diff of the touched rows ``order`` (in batches):
        the cleared rows, and per group the added rows (whole) and the rows that grew."""
        # rows in order: the same update whichever calls (batched or not) touched them
        touched = np.sort(order[0] if len(order) == 1 else np.concatenate(order))
        state = self.rows
        live = state.holder_gen.take(touched)
        start = self.start_gen.take(touched)
        held = live != 0
        cleared = touched[~held & (start != 0)]
        new_holder = touched[held & (live != start)]
        kept = touched[held & (live == start)]
        arrays: list[np.ndarray] = [cleared, new_holder]  # packed into one buffer below
        for g in range(self.num_groups):
            counts = state.row_len[g, new_holder]
            arrays += [counts, state.gather(g, new_holder, np.zeros_like(counts), counts)]
            arrays += self._grown(g, kept)
        parts = _frozen_int32(arrays)
        G = self.num_groups
        added = (tuple([RowBlocks(parts[1], parts[2 + 5 * g], parts[3 + 5 * g])
                        for g in range(G)]) if len(parts[1]) else self._no_blocks)
        appended = tuple([RowBlocks(parts[4 + 5 * g], parts[5 + 5 * g], parts[6 + 5 * g])
                          if len(parts[4 + 5 * g]) else _NO_BLOCKS for g in range(G)])
        return parts[0], added, appended

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
