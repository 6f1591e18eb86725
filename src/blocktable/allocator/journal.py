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
a bound on the ids, one id per appended row) and its arrays are read-only, so those facts
stay true: the captured step skips the checks they settle. A step of a few touched rows of one
group, diffed by the compiled loops, comes as a :class:`~blocktable.update.PackedStepUpdate`:
its arrays are cut from one buffer only when read.
"""

from __future__ import annotations

import struct
from types import ModuleType

import numpy as np

from blocktable import _native_loader as _loader
from blocktable.allocator.rowstate import RowState
from blocktable.update import FROZEN_EMPTY as _EMPTY
from blocktable.update import NO_ROW_BLOCKS as _NO_BLOCKS
from blocktable.update import NO_ROW_ENTRIES as _NO_ENTRIES
from blocktable.update import (
    AllocatorFacts,
    RowBlocks,
    RowEntries,
    StepUpdate,
    packed_update,
    trusted_row_blocks,
    trusted_update,
)
from blocktable.update import cut_packed as _cut

_EMPTY_INTP = np.zeros(0, dtype=np.intp)
_FEW_ROWS = 128  # take() loops in Python over at most this many touched rows (one group)
_FEW_BATCHED = 8  # batched rows diffed in that loop rather than joined as arrays


class StepJournal:
    """Rows touched since the last :meth:`take`, with their holder and lengths at first touch.

    Kept in arrays indexed by row (``rows``: the manager's :class:`RowState`): a touch of many
    rows is one gather and a few scatters, and ``take`` reads the live state of every touched
    row with gathers (holder generations tell a row's first holder from the live one).

    Batched allocations (:meth:`touch_many` with the blocks they append) are also kept as they
    were made: when no other change reaches their rows before ``take`` (a decode step), those
    arrays are the rows' net change and ``take`` reads nothing per row. Any later touch of such
    a row marks the batches stale, and ``take`` diffs their rows like any other.
    """

    def __init__(self, num_groups: int, rows: RowState, id_bounds: tuple[int, ...]) -> None:
        self.num_groups = num_groups
        self.rows = rows
        # per group: the largest id of the group's pool, which bounds every id of an update
        # (its facts state it: nobody reads the ids for their largest)
        self.ids_at_most = tuple(bound - 1 for bound in id_bounds)
        # the facts of an update that is one batch (a decode step), by "one block each"
        # by (one block each, most added, nothing cleared)
        self._few_facts: dict[tuple[bool, int, bool], AllocatorFacts] = {}
        # by allocator block sizes: the update of a step that changed nothing
        self._empty_updates: dict[tuple[int, ...] | None, StepUpdate] = {}
        self._batch_facts = {
            each: AllocatorFacts(rows.num_rows, self.ids_at_most, (each,), (-1,), each)
            for each in (True, False)
        }
        num_rows = rows.num_rows
        # on cpu, [num_rows]: the row was first touched in this step when its stamp is
        # `_stamp` (by touch or touch_leaving) or `_stamp + 1` (by touch_many); older stamps
        # are untouched rows (take moves `_stamp` on: nothing to reset per row)
        self.touched = np.zeros(num_rows, dtype=np.int64)
        self._stamp = 2
        self.start_gen = np.zeros(num_rows, dtype=np.int64)  # holder at the first touch
        self.start_len = np.zeros((num_groups, num_rows), dtype=np.int64)  # its row lengths
        self.order: list[int] = []  # the touched rows, in the order of their first touch
        # row -> per group, old entries nulled since the first touch (same holder only)
        self._nulled: dict[int, list[list[int]]] = {}
        # touch_many's blocks appended (rows as int32, counts, ids) with their rows as intp,
        # and whether a row of theirs was touched again since
        self._batches: list[tuple[RowBlocks, np.ndarray]] = []
        self._batches_stale = False
        self._num_batched = 0  # rows in _batches
        self._views()

    def _views(self) -> None:
        # Scalar paths read and write through memoryviews (Python ints, no numpy scalars);
        # none of these arrays is ever reallocated.
        self._touched_mv = self.touched.data
        self._start_gen_mv = self.start_gen.data
        self._gen_mv = self.rows.holder_gen.data
        # per group: [row] (the row state's are rebuilt with it)
        self._start_len_mvs = [a.data for a in self.start_len]

    def __getstate__(self) -> dict[str, object]:  # memoryviews do not pickle or copy
        return {k: v for k, v in self.__dict__.items() if not k.endswith(("_mv", "_mvs"))}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._views()

    def touch(self, row: int) -> None:
        """Remember ``row`` as it is now, before its first change in this step."""
        stamp, touched = self._stamp, self._touched_mv[row]
        if touched < stamp:
            self._touched_mv[row] = stamp
            self._start_gen_mv[row] = self._gen_mv[row]
            for start_len, row_len in zip(self._start_len_mvs, self.rows.row_len_mvs):
                start_len[row] = row_len[row]
            self.order.append(row)
        elif touched != stamp:  # a batch's row
            self._batches_stale = True

    def touch_leaving(self, rows: list[int]) -> None:
        """:meth:`touch` of rows whose requests leave now, or came in free (distinct ints):
        their lengths at the first touch are never read (each row ends cleared, or added if
        another request takes it). One call for all of a batch's rows, compiled when built."""
        native = _loader.NATIVE
        if native is not None:
            if native.touch_rows(
                self.touched, self.start_gen, self.rows.holder_gen, self._stamp, rows, self.order
            ):
                self._batches_stale = True
            return
        stamp, touched, start_gen = self._stamp, self._touched_mv, self._start_gen_mv
        gen, order = self._gen_mv, self.order
        for row in rows:
            was = touched[row]
            if was < stamp:
                touched[row] = stamp
                start_gen[row] = gen[row]
                order.append(row)
            elif was != stamp:  # a batch's row
                self._batches_stale = True

    def touch_many(self, rows: np.ndarray, blocks: RowBlocks) -> None:
        """:meth:`touch` of distinct ``rows`` (intp ``[n]``, held, group 0 of one group) before
        ``blocks.num_manager_blocks[i]`` blocks (>= 1) are appended to row ``rows[i]``:
        ``blocks`` holds the same rows (int32), the counts and the ids, read-only views of an
        immutable buffer (a decode step's update is this object itself). Kept until
        :meth:`take`."""
        stamp = self._stamp
        touched = self.touched
        was = touched.take(rows)
        at_stamp = np.array(stamp)  # (a 0-d operand costs a ufunc less than a Python int)
        keep = was < at_stamp
        if np.count_nonzero(keep) < len(rows):
            # rows touched before: only the others are a batch (theirs diffed)
            if np.count_nonzero(was > at_stamp):  # a batch's row
                self._batches_stale = True
            rows = rows[keep]
            if not len(rows):
                return
            counts, ids = blocks.num_manager_blocks, blocks.block_ids
            ids = ids[keep if len(counts) == len(ids) else keep.repeat(counts)]
            data = b"".join((blocks.rows[keep], counts[keep], ids))  # type: ignore[arg-type]
            rows32, counts, ids = _cut(data, (len(rows), len(rows)))
            blocks = trusted_row_blocks(rows32, counts, ids)
        touched[rows] = stamp + 1
        self.start_gen[rows] = self.rows.holder_gen.take(rows)
        self.start_len[0][rows] = self.rows.row_len[0].take(rows)
        self._batches.append((blocks, rows))
        self._num_batched += len(rows)

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
        """The net change of every touched row; reset.

        ``allocator_block_sizes`` is stamped on the update. A fixed handful of numpy calls per
        group, whatever the number of touched rows.
        """
        batches = self._batches
        if (len(batches) == 1 and not self.order and not (self._batches_stale or self._nulled)
                and self.num_groups == 1):
            # A decode step (checked first): the batch's own blocks, immutable, are the update's
            # appended blocks; nothing is read per row.
            self._stamp += 2  # every row untouched from now on
            [(appended, _)] = batches
            self._batches = []
            self._num_batched = 0
            each = len(appended.block_ids) == len(appended.rows)  # one block each
            return trusted_update(_EMPTY, (_NO_BLOCKS,), (appended,), (_NO_ENTRIES,),
                                  allocator_block_sizes, self._batch_facts[each])
        order = self.order
        native = _loader.NATIVE
        if (order and not batches and native is not None and not self._nulled
                and self.num_groups == 1 and len(order) <= _FEW_ROWS):
            self._stamp += 2  # requests admitted or finished: a few rows, compiled
            return self._take_packed(native, allocator_block_sizes)
        if not (batches or order or self._nulled):  # nothing changed: one object serves
            self._stamp += 2
            empty = self._empty_updates.get(allocator_block_sizes)
            if empty is None:
                empty = self._empty_updates[allocator_block_sizes] = self._empty_update(
                    allocator_block_sizes)
            return empty
        num_groups = self.num_groups
        state = self.rows
        order = self.order
        self._stamp += 2
        if batches and (
            self._batches_stale
            or num_groups > 1
            or self._nulled
            or self._num_batched <= _FEW_BATCHED
        ):
            self._unbatch()  # their rows are diffed with the others
            order = self.order
        if num_groups == 1 and len(order) <= _FEW_ROWS and not self._nulled:
            return self._take_few(allocator_block_sizes)
        if self._batches:
            self._unbatch()
            order = self.order
        if order:
            touched = np.array(sorted(order), dtype=np.intp)
            self.order = []
        else:
            touched = _EMPTY_INTP
        live = state.holder_gen[touched]
        start = self.start_gen[touched]
        same = live == start
        n = len(touched)
        if np.count_nonzero(same) == n and np.count_nonzero(live) == n:  # kept holders (decode)
            cleared = added = _EMPTY_INTP
            kept = touched
        else:
            held = live != 0
            cleared = touched[~held & (start != 0)]
            added = touched[~same & held]
            kept = touched[same & held]
        arrays: list[np.ndarray] = [cleared, added]  # packed into one buffer below
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
            if len(kept) and np.count_nonzero(grew == 1) == len(kept):  # one block each (decode)
                rows, num, ids = kept, grew, state.blocks[g][kept, old]
            else:
                grown = np.flatnonzero(grew > 0)
                rows, num, old = kept[grown], grew[grown], old[grown]
                ids = state.gather(g, rows, old, num)
            arrays += [rows, num, ids]
            num_appended.append(len(rows))
            one_each.append(len(ids) == len(rows))
        for rows, indices in self._null_parts(num_groups):
            arrays += [rows, indices]
        self._nulled = {}
        views = _frozen_int32(arrays)
        cleared_rows, added_rows = views[0], views[1]
        at = 2
        added_blocks, appended_blocks = [], []
        for g in range(num_groups):
            counts, add_ids, app_rows, num, ids = views[at : at + 5]
            at += 5
            added_blocks.append(
                trusted_row_blocks(added_rows, counts, add_ids) if len(added) else _NO_BLOCKS
            )
            appended_blocks.append(
                trusted_row_blocks(app_rows, num, ids) if num_appended[g] else _NO_BLOCKS
            )
        nulled_entries = []
        for _ in range(num_groups):
            null_rows, indices = views[at], views[at + 1]
            at += 2
            nulled_entries.append(RowEntries(null_rows, indices) if len(null_rows) else _NO_ENTRIES)
        appends_only = (num_groups == 1 and one_each[0] and not (len(cleared) or len(added))
                        and nulled_entries[0] is _NO_ENTRIES)
        facts = AllocatorFacts(state.num_rows, self.ids_at_most, tuple(one_each),
                               tuple(largest_added), appends_only)
        return trusted_update(cleared_rows, tuple(added_blocks), tuple(appended_blocks),
                              tuple(nulled_entries), allocator_block_sizes, facts)

    def _empty_update(self, sizes: tuple[int, ...] | None) -> StepUpdate:
        """The update of a step that changed no row (immutable: handed out again and again)."""
        G = self.num_groups
        facts = AllocatorFacts(self.rows.num_rows, self.ids_at_most, (True,) * G, (-1,) * G,
                               G == 1)
        return trusted_update(_EMPTY, (_NO_BLOCKS,) * G, (_NO_BLOCKS,) * G, (_NO_ENTRIES,) * G,
                              sizes, facts)

    def _unbatch(self) -> None:
        """Hand the batches' rows to the diff of every touched row."""
        for _, rows in self._batches:
            self.order += rows.tolist()
        self._batches = []
        self._batches_stale = False
        self._num_batched = 0

    def _take_few(self, sizes: tuple[int, ...] | None) -> StepUpdate:
        """:meth:`take` of a few touched rows of one group without nulled entries (a decode
        step of an engine), and of batches no other change reached: a Python loop over the
        rows through memoryviews costs less than the vectorized path's fixed two dozen numpy
        calls, every int of the update is packed by one ``struct.pack``, and the batches'
        arrays are appended as they are. (Without batches, where the package's compiled loops
        are built, :meth:`take` makes one compiled call, ``diff_rows``, instead.)"""
        rows = self.order  # in the order of their first touch
        batches = self._batches
        native = _loader.NATIVE
        if rows and native is not None and not batches:
            return self._take_packed(native, sizes)
        cleared: list[int] = []
        add_rows: list[int] = []
        add_counts: list[int] = []
        add_ids: list[memoryview] = []
        app_rows: list[int] = []
        app_counts: list[int] = []
        app_ids: list[int] = []
        one_each = True
        if rows:
            self.order = []
            one_each = self._diff_few(rows, cleared, add_rows, add_counts, add_ids, app_rows,
                                      app_counts, app_ids)
        if batches:  # appended after the rows diffed above, as they are
            self._batches = []
            self._num_batched = 0
            for blocks, _ in batches:
                one_each = one_each and len(blocks.rows) == len(blocks.block_ids)
            cleared_rows, a_rows, a_counts, a_ids, p_rows, p_counts, p_ids = _joined(
                cleared + add_rows + add_counts,
                (len(cleared), len(add_rows), len(add_rows)),
                add_ids,
                [app_rows, app_counts, app_ids],
                batches,
            )
        else:
            cleared_rows, a_rows, a_counts, p_rows, p_counts, p_ids, a_ids = _packed(
                cleared + add_rows + add_counts + app_rows + app_counts + app_ids,
                (
                    len(cleared),
                    len(add_rows),
                    len(add_rows),
                    len(app_rows),
                    len(app_rows),
                    len(app_ids),
                ),
                add_ids,
            )
        return self._few_update(cleared_rows, a_rows, a_counts, a_ids, p_rows, p_counts, p_ids,
                                one_each, max(add_counts) if add_counts else -1, sizes)

    def _few_update(self, cleared_rows: np.ndarray, a_rows: np.ndarray, a_counts: np.ndarray,
                    a_ids: np.ndarray, p_rows: np.ndarray, p_counts: np.ndarray,
                    p_ids: np.ndarray, one_each: bool, most_added: int,
                    sizes: tuple[int, ...] | None) -> StepUpdate:
        """The update of one group from its parts (int32, read-only), with its facts (made
        once per distinct ``(one_each, most_added, nothing cleared)``)."""
        key = (one_each, most_added, len(cleared_rows) == 0)
        facts = self._few_facts.get(key) or self._new_few_facts(key)
        return trusted_update(
            cleared_rows,
            (trusted_row_blocks(a_rows, a_counts, a_ids) if len(a_rows) else _NO_BLOCKS,),
            (trusted_row_blocks(p_rows, p_counts, p_ids) if len(p_rows) else _NO_BLOCKS,),
            (_NO_ENTRIES,),
            sizes,
            facts,
        )

    def _take_packed(self, native: ModuleType, sizes: tuple[int, ...] | None) -> StepUpdate:
        """:meth:`_take_few` of touched rows and no batch, by the compiled ``diff_rows``: the
        update keeps its one packed buffer, and its arrays are cut from it only if someone
        reads them (the captured step stages the buffer as it is)."""
        rows = self.order
        self.order = []
        data, part_sizes, each, most = native.diff_rows(
            rows, self._gen_mv, self._start_gen_mv, self.rows.row_len_mvs[0],
            self._start_len_mvs[0], self.rows.blocks[0])
        key = (each, most, part_sizes[0] == 0)
        facts = self._few_facts.get(key) or self._new_few_facts(key)
        return packed_update(data, part_sizes, sizes, facts)

    def _new_few_facts(self, key: tuple[bool, int, bool]) -> AllocatorFacts:
        """The facts of a one-group update, made once per distinct ``(one_each, most_added,
        nothing cleared)``."""
        one_each, most_added, none_cleared = key
        facts = self._few_facts[key] = AllocatorFacts(
            self.rows.num_rows, self.ids_at_most, (one_each,), (most_added,),
            one_each and most_added < 0 and none_cleared)
        return facts

    def _diff_few(self, rows: list[int], cleared: list[int], add_rows: list[int],
                  add_counts: list[int], add_ids: list[memoryview], app_rows: list[int],
                  app_counts: list[int], app_ids: list[int]) -> bool:
        """Sort ``rows`` (touched, group 0 of one group) into the lists by their net change;
        True if every appended row gained exactly one block."""
        gen, start_gen = self._gen_mv, self._start_gen_mv
        row_len, start_len = self.rows.row_len_mvs[0], self._start_len_mvs[0]
        arena = self.rows.blocks[0]
        item = arena.item
        width = arena.shape[1]
        # the arena's int32 cells, flat: an added row's ids are a slice of it, joined into the
        # update as they are (cheaper than a numpy row slice and its tobytes); made at the first
        # added row (the casts cost several us with cold caches: decode steps add no row)
        cells = None
        one_each = True
        for row in rows:
            live = gen[row]
            if live == start_gen[row]:
                if live:
                    n, old = row_len[row], start_len[row]
                    if n > old:
                        app_rows.append(row)
                        app_counts.append(n - old)
                        if n - old == 1:
                            app_ids.append(item(row, old))
                        else:
                            one_each = False
                            app_ids += arena[row, old:n].tolist()
            elif live:
                n = row_len[row]
                add_rows.append(row)
                add_counts.append(n)
                if cells is None:
                    cells = arena.data.cast("B").cast("i")
                add_ids.append(cells[row * width : row * width + n])
            else:
                cleared.append(row)
        return one_each

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


def _joined(
    head: list[int],
    head_sizes: tuple[int, ...],
    buffers: list[memoryview],
    lists: list[list[int]],
    batches: list[tuple[RowBlocks, np.ndarray]],
) -> list[np.ndarray]:
    """int32 arrays, all read-only views of one immutable buffer: ``head`` cut into parts of
    ``head_sizes``; ``buffers`` (int32) joined as one part; then, for ``k`` in 0, 1, 2,
    ``lists[k]`` followed by every batch's rows (``k`` = 0), counts (1) or ids (2) as one
    part. Empty parts are the shared empty array."""
    pieces: list[object] = [struct.pack(f"={len(head)}i", *head)] if head else []
    pieces += buffers
    sizes = [*head_sizes, sum(map(len, buffers))]
    for k, ints in enumerate(lists):
        size = len(ints)
        if size:
            pieces.append(struct.pack(f"={size}i", *ints))
        for blocks, _ in batches:
            array = (blocks.rows, blocks.num_manager_blocks, blocks.block_ids)[k]
            size += len(array)
            pieces.append(array)  # (bytes.join reads an int32 array's buffer as it is)
        sizes.append(size)
    flat = np.frombuffer(b"".join(pieces), dtype=np.int32)  # type: ignore[arg-type]
    out, at = [], 0
    for n in sizes:
        out.append(flat[at : at + n] if n else _EMPTY)
        at += n
    return out


def _packed(ints: list[int], sizes: tuple[int, ...], buffers: list[memoryview]) -> list[np.ndarray]:
    """``ints`` cut into parts of ``sizes``, then ``buffers`` (int32) joined as one more part:
    int32 arrays, all read-only views of one immutable buffer built by one ``struct.pack``
    (about a microsecond for a decode step's few dozen ints); empty parts are the shared empty
    array."""
    data = struct.pack(f"={len(ints)}i", *ints)
    if buffers:
        data = b"".join([data, *buffers])
    return _cut(data, sizes)
