"""The journal of row changes between two steps, turned into one :class:`StepUpdate`.

Rather than logging every operation, the journal remembers which request held each row and how
long its rows were at the last :meth:`StepJournal.take`. The next ``take`` diffs that against
the live state (holder generations are never reused, so a row that changed hands differs), so
any sequence of operations within a step (admit then allocate, allocate then free, free then
reuse the row for another request) collapses to its net effect, and the operations themselves
record nothing:

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
    """Every row's holder and lengths at the last :meth:`take`, to diff the live state against.

    Kept in arrays indexed by row (``rows``: the manager's :class:`RowState`): ``take`` finds
    the rows whose holder or lengths changed by comparing every row, reads their live state
    (holder generations tell a row's holder at the last take from the live one), then copies
    the live state as the next start. The operations themselves record nothing (but entries
    nulled in a row, see :meth:`null`). Where the install built the compiled part the whole
    take is one compiled pass over the rows; else a few numpy calls per group.
    """

    def __init__(self, num_groups: int, rows: RowState) -> None:
        self.num_groups = num_groups
        self.rows = rows
        num_rows = rows.num_rows
        self.start_gen = np.zeros(num_rows, dtype=np.int64)  # holder at the last take
        self.start_len = np.zeros((num_groups, num_rows), dtype=np.int64)  # its row lengths
        # row -> per group, old entries nulled since the last take (same holder only)
        self._nulled: dict[int, list[list[int]]] = {}
        self._bind()
        self._no_blocks = (_NO_BLOCKS,) * num_groups
        self._no_entries = (_NO_ENTRIES,) * num_groups

    def _bind(self) -> None:
        """The compiled diff of every row, bound to these arrays (the row state's are never
        reallocated), where the install built it (else numpy)."""
        compiled, rows = _loader.COMPILED, self.rows
        self._compiled_diff = None if compiled is None else compiled.JournalDiff(
            self.start_gen, rows.holder_gen, self.start_len, rows.row_len,
            _EMPTY32, RowBlocks, _NO_BLOCKS, StepUpdate).diff

    def __getstate__(self) -> dict[str, object]:  # the compiled diff is bound, not pickled
        return {k: v for k, v in self.__dict__.items() if k != "_compiled_diff"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._bind()

    def null(self, row: int, group: int, block_index: int) -> None:
        """Record that entry ``block_index`` of ``group`` in ``row`` became the null block (kept
        where the row is held by its holder at the last take and the entry is older)."""
        if (
            self.start_gen[row] == self.rows.holder_gen[row]
            and block_index < self.start_len[group, row]
        ):
            if row not in self._nulled:
                self._nulled[row] = [[] for _ in range(self.num_groups)]
            self._nulled[row][group].append(block_index)

    def take(self, allocator_block_sizes: tuple[int, ...] | None = None) -> StepUpdate:
        """The net change of every row since the last take (``allocator_block_sizes`` stamped on
        it); the live state becomes the next start. On an error (a corrupt row state) nothing
        changes."""
        # the nulled entries first: they are kept by the holders at the start
        nulled = self._null_update() if self._nulled else self._no_entries
        diff = self._compiled_diff  # (it builds the update itself: no tuple of parts between)
        if diff is not None:
            update = diff(self.rows.blocks, nulled, allocator_block_sizes)
        else:
            # (trusted passed by position: a class called with a keyword builds a dict for it)
            update = StepUpdate(*self._numpy_diff(), nulled, allocator_block_sizes, True)
        if self._nulled:
            self._nulled = {}
        return update

    def _numpy_diff(self) -> tuple[np.ndarray, tuple[RowBlocks, ...], tuple[RowBlocks, ...]]:
        """The numpy twin of the compiled diff: compare every row with its start, diff the
        changed ones, then copy the live state as the next start."""
        state = self.rows
        changed = state.holder_gen != self.start_gen
        for start_len, row_len in zip(self.start_len, state.row_len):
            changed |= start_len != row_len
        rows = np.flatnonzero(changed)
        if not len(rows):  # nothing changed
            return _EMPTY32, self._no_blocks, self._no_blocks
        out = self._diff(rows)
        np.copyto(self.start_gen, state.holder_gen)
        np.copyto(self.start_len, state.row_len)
        return out

    def _null_update(self) -> tuple[RowEntries, ...]:
        """Per group, the entries nulled since the last take, as the update's part."""
        nulls = _frozen_int32(self._null_parts())
        return tuple([RowEntries(nulls[2 * g], nulls[2 * g + 1]) for g in range(self.num_groups)])

    def _diff(self, changed: np.ndarray
              ) -> tuple[np.ndarray, tuple[RowBlocks, ...], tuple[RowBlocks, ...]]:
        """The diff of the changed rows ``changed`` (intp, in order): the cleared rows, and
        per group the added rows (whole) and the rows that grew."""
        state = self.rows
        live = state.holder_gen.take(changed)
        start = self.start_gen.take(changed)
        held = live != 0
        cleared = changed[~held & (start != 0)]
        new_holder = changed[held & (live != start)]
        kept = changed[held & (live == start)]
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
        """Rows of ``kept`` (held by their holder at the start) that grew in ``group``: the rows, how
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
        holder at the last take (sorted by row, in the order they were nulled)."""
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
