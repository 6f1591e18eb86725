"""Host side of a captured step: apply the step's update to the host table (the truth) and stage
the changed entries as ``(flat index, value)`` pairs for the device.

A decode step (each listed row gains exactly one manager block, and rows of finished requests
may be cleared, nothing else changes) takes a dedicated path, :class:`DecodeStager`: about a
dozen numpy calls per group that check everything, stage the pairs (a cleared row: its filled
entries and its count, all zero), then write the host table with one ``put`` of those pairs,
bypassing the commit journal. An update built by the allocator's journal carries
:class:`~blocktable.update.AllocatorFacts`: its rows are in range and listed once and its ids
come from the allocator, so the stager skips those checks (about a third of its calls) and also
takes its admitted rows (``added``: each row's ids, the entries past them that held ids before
set to null, its count) and rows gaining several blocks (a chunk of a prefill). Where the
compiled loops are built (:mod:`blocktable._native_loader`), an allocator's update of one group
is checked, staged and written by one compiled call instead (``stage_appends`` for the decode
lane, ``stage_group`` for cleared, added and appended rows); what it refuses takes the path
below. Every other update goes through :meth:`MultiGroupBlockTable.apply` (which checks, writes
and journals) and the journal is drained into the staging buffer, exactly as
:meth:`MultiGroupBlockTable.commit` would.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from blocktable._host_loops import fill_staging, kernel_ids, runs_into, small_sum
from blocktable.group_layout import check_update_block_sizes
from blocktable.multi_group import MultiGroupBlockTable
from blocktable.update import AllocatorFacts, PackedStepUpdate, RowBlocks, StepUpdate

_I32 = np.dtype(np.int32)
_U32 = np.dtype(np.uint32)


def largest(a: np.ndarray) -> Any:  # a numpy scalar of a's dtype, compared with ints
    """The largest entry of a non-empty 1-D array. ``a[a.argmax()]`` rather than a reduction:
    in an engine's loop, where numpy's code has left the CPU caches between steps, an argmax
    costs about half of ``np.maximum.reduce`` (whose ufunc machinery is larger)."""
    return a[a.argmax()]


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
    # int32 [width - k + 1]: c + k for each count c with room for k more kernel blocks; a
    # take from it is the new count and the room check in one call (it raises past the end)
    plus_k: np.ndarray
    # width, table_offset and counts_offset as 0-d int32 arrays: a ufunc converts a Python
    # int operand on every call (about a third more with cold caches)
    width_0d: np.ndarray
    table_offset_0d: np.ndarray
    counts_offset_0d: np.ndarray


class _Added(NamedTuple):
    """Rows of one group replaced by an update of the allocator's journal."""

    ref: _GroupRef
    part: RowBlocks
    new: np.ndarray  # int32 [n]: kernel blocks each row gets
    stale: np.ndarray  # int32 [n]: entries past ``new`` that hold ids now (0 if none)
    num_stale: int

    @property
    def num_pairs(self) -> int:
        return len(self.part.block_ids) * self.ref.k + self.num_stale + len(self.part.rows)


class _Grown(NamedTuple):
    """Rows of one group that gain several blocks, in an update of the allocator's journal."""

    ref: _GroupRef
    part: RowBlocks
    filled: np.ndarray  # int32 [n]: kernel blocks each row holds now
    new: np.ndarray  # int32 [n]: kernel blocks each row gains
    after: np.ndarray  # int32 [n]: filled + new

    @property
    def num_pairs(self) -> int:
        return len(self.part.block_ids) * self.ref.k + len(self.part.rows)


def _is_int32(a: object) -> bool:
    return type(a) is np.ndarray and a.dtype is _I32 and a.ndim == 1


class DecodeStager:
    """The decode fast path of one table: check, stage the pairs, write the host table.

    Parameters
    ----------
    table : MultiGroupBlockTable
        The table whose host buffer (entries and counts) the decode steps write.
    native : module or None
        The compiled loops (:mod:`blocktable._native_loader`), or ``None``: numpy.
    mirror : np.ndarray or None
        int32, on cpu, as long as the host buffer: every write a staged step makes to the host
        buffer is made here too (the CPU backend's device table, so its step scatters nothing
        the stager staged). The general path (:func:`stage_general`) does not write it.
    """

    def __init__(self, table: MultiGroupBlockTable, native: ModuleType | None = None,
                 mirror: np.ndarray | None = None) -> None:
        st = table.storage
        self.table = table
        self.native = native
        self.mirror = mirror
        self.refs = []
        for t in table.tables:
            if t is None:
                continue
            counts_offset = st.counts_offset + t.group * table.max_num_reqs
            self.refs.append(_GroupRef(
                t.group, t.num_kernel_blocks, t.width, t.k, t.block_id_bound, t.offset,
                counts_offset, np.arange(t.k, t.width + 1, dtype=np.int32),
                np.array(t.width, np.int32), np.array(t.offset, np.int32),
                np.array(counts_offset, np.int32),
            ))
        self.num_groups = len(table.specs)
        self.num_rows = table.max_num_reqs
        self._ref_of: list[_GroupRef | None] = [None] * self.num_groups
        for ref in self.refs:
            self._ref_of[ref.group] = ref
        # int32 ones as bytes: a part's manager-block counts are all 1 iff their bytes match
        self._ones = np.ones(table.max_num_reqs, dtype=np.int32).tobytes()
        self._sizes_ok: tuple[int, ...] | None = None  # block sizes that passed the check
        self._storage = table.storage
        self._one_group = self.num_groups == 1
        # the one-group compiled calls' table arguments, bound once: width, k, table and
        # counts offsets, rows, id bound, and the mirror if any (None: numpy, or no table for
        # the group)
        ref0 = self._ref_of[0]
        self._group_args = None if native is None or ref0 is None else (
            ref0.width, ref0.k, ref0.table_offset, ref0.counts_offset, self.num_rows,
            ref0.block_id_bound, *(() if mirror is None else (mirror,)))

    def _listed(self, rows: object) -> np.ndarray | None:
        """How often each table row appears in ``rows`` (int64 ``[max_num_reqs]``), or
        ``None`` when the general path must look (not int32, or a row out of range)."""
        if not _is_int32(rows):
            return None
        try:  # negative rows raise
            listed = np.bincount(rows, minlength=self.num_rows)  # type: ignore[arg-type]
        except ValueError:
            return None
        return listed if len(listed) == self.num_rows else None

    def _filled(self, ref: _GroupRef, part: RowBlocks) -> np.ndarray | None:
        """The rows' filled kernel blocks if ``part`` is a valid one-block-per-row append;
        ``None`` when the general path must look (another shape, or an error it will name)."""
        rows, ids = part.rows, part.block_ids
        n = len(rows)
        if not (_is_int32(rows) and _is_int32(ids) and len(ids) == n):
            return None
        num = part.num_manager_blocks
        if not _is_int32(num) or num.tobytes() != self._ones[: 4 * n]:
            return None  # a count other than 1 (or more rows than the table has)
        if largest(ids.view(_U32)) >= ref.block_id_bound:  # negative ids wrap past the bound
            return None
        try:  # one histogram checks the range (negative rows raise) and that no row repeats
            listed = np.bincount(rows, minlength=self.num_rows)
        except ValueError:
            return None
        if len(listed) != self.num_rows or (n > 1 and largest(listed) > 1):
            return None
        return ref.counts.take(rows)  # the room for the new blocks: checked when staged

    def _filled_trusted(self, ref: _GroupRef, part: RowBlocks, facts: AllocatorFacts,
                        g: int) -> np.ndarray | None:
        """:meth:`_filled` for an update of the allocator's journal: its rows are in range and
        distinct, so only the facts of the table (ids below its bound, room in the rows) are
        checked (each appended row gains one block: ``facts.one_block_each[g]``). A bound on
        the ids past the table's (a pool larger than the table): :meth:`_filled` reads them."""
        if not 0 <= facts.ids_at_most[g] < ref.block_id_bound:
            return self._filled(ref, part)
        return ref.counts.take(part.rows)  # the room for the new blocks: checked when staged

    def _added_trusted(self, ref: _GroupRef, part: RowBlocks, facts: AllocatorFacts,
                       g: int) -> _Added | None:
        """What replacing ``part``'s rows (of an update of the allocator's journal: rows in
        range, listed once, counts matching the ids) writes, or ``None`` when the table refuses
        it (the general path names the error): a row longer than the width, an id past the
        table's bound."""
        rows, num, ids = part.rows, part.num_manager_blocks, part.block_ids
        most = facts.largest_added_count[g]
        if most < 0:
            most = int(largest(num))
        if most * ref.k > ref.width:
            return None
        if not 0 <= facts.ids_at_most[g] < ref.block_id_bound and len(ids) and (
            largest(ids.view(_U32)) >= ref.block_id_bound  # a looser bound than the table's
        ):
            return None
        old = ref.counts.take(rows)  # filled kernel blocks now
        new = num if ref.k == 1 else num * ref.k
        stale = old
        num_stale = small_sum(old)
        if num_stale:  # entries past the new count that hold ids now become null
            stale = old - new
            np.maximum(stale, 0, out=stale)
            num_stale = small_sum(stale)
        return _Added(ref, part, new, stale, num_stale)

    def _grown_trusted(self, ref: _GroupRef, part: RowBlocks, facts: AllocatorFacts,
                       g: int) -> _Grown | None:
        """What appending several blocks per row writes (an update of the allocator's journal:
        rows in range and listed once, counts matching the ids), or ``None`` when the table
        refuses it: an id past the table's bound, a row past its width."""
        rows, num, ids = part.rows, part.num_manager_blocks, part.block_ids
        largest_id = facts.ids_at_most[g]
        if not 0 <= largest_id < ref.block_id_bound:  # not recorded, or a looser bound: look
            largest_id = int(largest(ids.view(_U32))) if len(ids) else 0
        if largest_id >= ref.block_id_bound:
            return None
        filled = ref.counts.take(rows)
        new = num if ref.k == 1 else num * ref.k
        after = filled + new
        if largest(after) > ref.width:
            return None
        return _Grown(ref, part, filled, new, after)

    def stage(self, update: StepUpdate, pairs: np.ndarray, max_pairs: int) -> int:
        """Apply a decode step's update and stage its pairs in ``pairs`` (int32
        ``[2*max_pairs]``: indices, then values).

        Returns the number of pairs, or -1 (nothing written) when the update is not a valid
        decode step (rows gaining one block each, other rows cleared; with the allocator's
        facts, rows replaced or gaining several blocks too) that fits ``max_pairs`` next to no
        other pending change.

        An update with :class:`~blocktable.update.AllocatorFacts` (built by the allocator's
        journal) skips the checks the facts settle: the range and repeats of its rows, one id
        per appended row. What only the table knows (each row's filled entries against its
        width, ids below its bound) is checked on every update.
        """
        facts = update.facts
        if (facts is not None and self._one_group and facts.num_rows <= self.num_rows
                and not self._storage.changed):
            # One group from the allocator's journal; with the compiled loops, the checks (ids,
            # room) and the writes are one call per lane (inlined: a Python call costs about a
            # microsecond with cold caches)
            args = self._group_args
            if args is None:
                if facts.appends_only:  # the decode lane, with numpy
                    return self._stage_trusted_appends(update, facts, pairs, max_pairs)
            else:
                # every lane (and the paths they fall back to) checks the block sizes and
                # waits for the device's read of the host buffer: both once, here
                if update.allocator_block_sizes != self._sizes_ok:
                    self._check_block_sizes(update)
                st = self._storage
                if st.host_read_event is not None:
                    st.before_host_write()
                native: ModuleType = self.native  # type: ignore[assignment]
                if type(update) is PackedStepUpdate:
                    # admissions and finishes: the journal's packed buffer, staged as it is
                    num_staged: int = native.stage_packed(
                        st.host, pairs, max_pairs, update.packed_data, update.packed_sizes,
                        *args)
                    return num_staged if num_staged >= 0 else -1  # refused: the general path
                if facts.appends_only:  # the decode lane: rows gaining one block each
                    part = update.appended[0]
                    rows = part.rows
                    if len(rows) * (args[1] + 1) > max_pairs:
                        return self._stage_trusted_appends(update, facts, pairs, max_pairs)
                    num_staged = native.stage_appends(st.host, pairs, rows, part.block_ids,
                                                      *args)
                    return num_staged if num_staged >= 0 else -1  # refused: the general path
                added, appended, nulled = update.added, update.appended, update.nulled
                if (len(added) == len(appended) == len(nulled) == 1
                        and not len(nulled[0].rows)):  # cleared, added and appended rows
                    a, p = added[0], appended[0]
                    num_staged = native.stage_group(
                        st.host, pairs, max_pairs, update.cleared_rows, a.rows,
                        a.num_manager_blocks, a.block_ids, p.rows, p.num_manager_blocks,
                        p.block_ids, *args)
                    return num_staged if num_staged >= 0 else -1  # refused: the general path
        table = self.table
        st = table.storage
        G = self.num_groups
        added, appended, nulled = update.added, update.appended, update.nulled
        if st.changed or not (len(added) == len(appended) == len(nulled) == G):
            return -1
        if facts is not None and facts.num_rows > self.num_rows:
            facts = None  # rows of a larger allocator: check them
        total = 0
        cleared = update.cleared_rows
        listed_cleared = None
        clear_rows: np.ndarray = cleared
        clears: list[tuple[_GroupRef, np.ndarray, int]] = []
        if len(cleared):
            if facts is None:
                listed_cleared = self._listed(cleared)
                if listed_cleared is None:
                    return -1
                clear_rows = np.flatnonzero(listed_cleared)  # int64, distinct
            for group_ref in self.refs:
                old = group_ref.counts.take(clear_rows)  # kernel blocks to zero, then counts
                num_zeroed = small_sum(old)
                clears.append((group_ref, old, num_zeroed))
                total += num_zeroed + len(clear_rows)
        staged = []
        adds: list[_Added] = []
        grows: list[_Grown] = []
        try:  # a part that is not RowBlocks/RowEntries: the general path names the error
            for g in range(G):
                if len(nulled[g].rows):
                    return -1
                if len(added[g].rows):  # admitted requests: only from the journal
                    ref = self._ref_of[g]
                    if facts is None or ref is None:
                        return -1
                    add = self._added_trusted(ref, added[g], facts, g)
                    if add is None:
                        return -1
                    adds.append(add)
                    total += add.num_pairs
                part = appended[g]
                if not len(part.rows):
                    continue
                ref = self._ref_of[g]
                if ref is None:
                    return -1  # ids for a group without a table
                if facts is not None and not facts.one_block_each[g]:
                    grow = self._grown_trusted(ref, part, facts, g)
                    if grow is None:
                        return -1
                    grows.append(grow)
                    total += grow.num_pairs
                    continue
                if facts is not None:
                    filled = self._filled_trusted(ref, part, facts, g)
                else:
                    filled = self._filled(ref, part)
                if filled is None:
                    return -1
                if listed_cleared is not None and largest(listed_cleared.take(part.rows)):
                    return -1  # a row cleared and appended to: the general path orders them
                staged.append((ref, part, filled))
                total += len(part.rows) * (ref.k + 1)
        except AttributeError:
            return -1
        if total > max_pairs:
            return -1
        self._check_block_sizes(update)
        st.before_host_write()
        index, value = pairs[:total], pairs[total : 2 * total]
        at = 0
        for group_ref, old, num_zeroed in clears:  # entries [0, count) and the count become 0
            if num_zeroed:
                starts = clear_rows * group_ref.width_0d
                starts += group_ref.table_offset_0d
                runs_into(index[at : at + num_zeroed], starts, old)
                value[at : at + num_zeroed] = 0
                at += num_zeroed
            num_rows = len(clear_rows)
            np.add(clear_rows, group_ref.counts_offset_0d, out=index[at : at + num_rows],
                   casting="unsafe")  # < 2**31: an index of the flat buffer
            value[at : at + num_rows] = 0
            at += num_rows
        for add in adds:  # entries [0, new) get the ids, [new, old) become 0, counts new
            ref, rows = add.ref, add.part.rows
            starts = rows * ref.width_0d
            if ref.table_offset:
                starts += ref.table_offset_0d
            num_ids = len(add.part.block_ids) * ref.k
            runs_into(index[at : at + num_ids], starts, add.new)
            value[at : at + num_ids] = kernel_ids(add.part.block_ids, ref.k)
            at += num_ids
            if add.num_stale:
                starts += add.new
                runs_into(index[at : at + add.num_stale], starts, add.stale)
                value[at : at + add.num_stale] = 0
                at += add.num_stale
            np.add(rows, ref.counts_offset_0d, out=index[at : at + len(rows)])
            value[at : at + len(rows)] = add.new
            at += len(rows)
        for grow in grows:  # entries [filled, after) get the ids, counts after
            ref, rows = grow.ref, grow.part.rows
            starts = rows * ref.width_0d
            if ref.table_offset:
                starts += ref.table_offset_0d
            starts += grow.filled
            num_ids = len(grow.part.block_ids) * ref.k
            runs_into(index[at : at + num_ids], starts, grow.new)
            value[at : at + num_ids] = kernel_ids(grow.part.block_ids, ref.k)
            at += num_ids
            np.add(rows, ref.counts_offset_0d, out=index[at : at + len(rows)])
            value[at : at + len(rows)] = grow.after
            at += len(rows)
        for ref, part, filled in staged:
            at = _stage_appends(ref, part, filled, index, value, at)
            if at < 0:
                return -1  # an append past the row's width: the general path names it
        # nothing written to the table so far; the counts are views of the flat host buffer:
        # one put writes entries and counts
        st.host.put(index, value)
        if self.mirror is not None:
            self.mirror.put(index, value)
        return total

    def _check_block_sizes(self, update: StepUpdate) -> None:
        """Raise unless the update's allocator block sizes match the table's groups (checked
        once per distinct sizes: an engine's updates all carry the same)."""
        sizes = update.allocator_block_sizes
        if sizes is not None and sizes != self._sizes_ok:
            check_update_block_sizes(self.table.specs, self.table.cp, update)
            self._sizes_ok = sizes if type(sizes) is tuple else None

    def _stage_trusted_appends(self, update: StepUpdate, facts: AllocatorFacts,
                               pairs: np.ndarray, max_pairs: int) -> int:
        """:meth:`stage` of a decode step of one group from the allocator's journal with numpy
        (without the compiled loops, or past ``max_pairs``): each appended row gains one block,
        no row is cleared, added or nulled (the engine's common step, without the general
        loop's bookkeeping)."""
        part = update.appended[0]
        ref = self._ref_of[0]
        n = len(part.rows)
        total = 0
        filled = None
        if n:
            if ref is None:
                return -1  # ids for a group without a table
            total = n * (ref.k + 1)
            if total > max_pairs:
                return -1
            filled = self._filled_trusted(ref, part, facts, 0)
            if filled is None:
                return -1
        self._check_block_sizes(update)
        if ref is None or filled is None:
            return 0  # nothing appended
        st = self.table.storage
        st.before_host_write()
        index, value = pairs[:total], pairs[total : 2 * total]
        if _stage_appends(ref, part, filled, index, value, 0) < 0:
            return -1  # an append past the row's width: the general path names it
        st.host.put(index, value)
        if self.mirror is not None:
            self.mirror.put(index, value)
        return total


def _stage_appends(ref: _GroupRef, part: RowBlocks, filled: np.ndarray, index: np.ndarray,
                   value: np.ndarray, at: int) -> int:
    """Stage, from ``at`` on, the pairs of ``part``'s rows gaining one manager block each
    (``filled``: their filled kernel blocks now): the new entries, then the counts. Returns
    where the next pairs go, or -1 when a row has no room for the block (nothing is written to
    the table; some pairs may be)."""
    rows, ids, k = part.rows, part.block_ids, ref.k
    n = len(rows)
    starts = index[at : at + n] if k == 1 else np.empty(n, dtype=np.int32)
    np.multiply(rows, ref.width_0d, out=starts)  # int32: the buffer has < 2**31 entries
    np.add(starts, filled, out=starts)
    if ref.table_offset:
        np.add(starts, ref.table_offset_0d, out=starts)
    if k == 1:
        value[at : at + n] = ids
    else:
        index[at : at + n * k] = (starts[:, None] + np.arange(k, dtype=np.int32)).ravel()
        value[at : at + n * k] = kernel_ids(ids, k)
    at += n * k
    np.add(rows, ref.counts_offset_0d, out=index[at : at + n])
    try:  # counts are >= 0: a count without room for k more is past plus_k's end
        ref.plus_k.take(filled, out=value[at : at + n])
    except IndexError:
        return -1
    return at + n


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
