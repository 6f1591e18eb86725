"""A whole scheduling step's changes to the block table, as flat numpy arrays.

The allocator (:mod:`blocktable.allocator`) produces a :class:`StepUpdate`; the table applies it
in one vectorized call (:meth:`blocktable.MultiGroupBlockTable.apply`). Block ids here are
*manager* block ids: the table expands them to kernel blocks itself.

Order of application inside one update: ``cleared_rows`` first, then ``added`` (each listed row
is replaced by exactly the given ids), then ``appended`` (ids go after the row's current tail,
which may have just been set by ``added``), then ``nulled`` (entries set to the null block, e.g.
blocks that left a sliding window). Within ``added`` and within ``appended`` a row appears at
most once per group; ``nulled`` may list a row once per entry it nulls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int32)
_I32 = np.iinfo(np.int32)


def _int32(values: object) -> np.ndarray:
    """``values`` as an int32 array when they are integers that fit; otherwise as given (never
    wrapped: the table names the bad value when it applies the update)."""
    arr = np.asarray(values)
    if arr.size == 0:
        return _EMPTY
    if arr.dtype == np.int32:
        return arr  # nothing to convert (the allocator's arrays)
    if arr.dtype.kind in "iu" and _I32.min <= int(arr.min()) and int(arr.max()) <= _I32.max:
        return arr.astype(np.int32, copy=False)
    return arr


@dataclass(frozen=True)
class RowBlocks:
    """Manager block ids for several rows of one KV cache group, flattened row after row.

    Attributes
    ----------
    rows : np.ndarray
        int32 ``[n]``, table rows.
    num_manager_blocks : np.ndarray
        int32 ``[n]``, how many manager blocks each row gets.
    block_ids : np.ndarray
        int32 ``[num_manager_blocks.sum()]``, the ids, those of ``rows[0]`` first.
    """

    rows: np.ndarray = field(default_factory=lambda: _EMPTY)
    num_manager_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)
    block_ids: np.ndarray = field(default_factory=lambda: _EMPTY)

    @classmethod
    def from_lists(cls, rows: Sequence[int], ids_per_row: Sequence[Sequence[int]]) -> RowBlocks:
        """Build from a row list and one id list per row (convenience, not the hot path)."""
        if len(rows) != len(ids_per_row):
            raise ValueError(
                f"rows and ids_per_row must have the same length, got {len(rows)} and "
                f"{len(ids_per_row)}"
            )
        num = [len(ids) for ids in ids_per_row]
        flat = [b for ids in ids_per_row for b in ids]
        return cls(_int32(rows), _int32(num), _int32(flat))

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class RowEntries:
    """Single entries of one group's rows: ``(rows[i], block_indices[i])``.

    ``block_indices`` are logical *manager* block indices (``position // manager_block_size``
    on this rank).
    """

    rows: np.ndarray = field(default_factory=lambda: _EMPTY)
    block_indices: np.ndarray = field(default_factory=lambda: _EMPTY)

    def __len__(self) -> int:
        return len(self.rows)


class AllocatorFacts(NamedTuple):
    """What an allocator guarantees about a :class:`StepUpdate` it built from its own state.

    Only :meth:`blocktable.allocator.KVCacheManager.take_step_update` attaches these (its
    arrays are read-only); a table may then skip the checks they make redundant. Facts about
    the table itself (a row's filled entries, the table's width and block-id bound) are never
    taken on trust.
    """

    num_rows: int  # every row in cleared_rows, added and appended is in [0, num_rows)
    # cleared_rows, added and appended list disjoint rows, each row at most once; every part's
    # counts are >= 1 (appended) or >= 0 (added) and sum to its number of ids
    # per group: no id in added or appended is larger (the largest id of the allocator's pool,
    # which bounds every id it hands out); -1 if unknown
    ids_at_most: tuple[int, ...]
    one_block_each: tuple[bool, ...]  # per group: each appended row gains exactly one id
    largest_added_count: tuple[int, ...]  # per group: most ids an added row gets, -1 if unknown
    # one group, and its only change is appended rows gaining one id each (a decode step):
    # nothing cleared, added or nulled
    appends_only: bool = False


@dataclass(frozen=True)
class StepUpdate:
    """One step's changes for every KV cache group (tuples hold one entry per group).

    ``allocator_block_sizes`` (tokens per allocator block, one per group), when set, says which
    allocator the ids came from: the table refuses the update unless each group's
    ``block_size * cp_world_size`` equals it (a block id must mean the same tokens on both
    sides). ``None`` skips that check.

    Trust: an update returned by the allocator's ``take_step_update`` carries
    :class:`AllocatorFacts` (its arrays are read-only), and the captured step skips the checks
    those facts settle (rows in range and distinct, ids in range, one id per appended row);
    the table-side checks (an append past a row's width) always run. Every other update, and
    any copy, pickle or ``dataclasses.replace`` of a trusted one, is checked in full.
    """

    cleared_rows: np.ndarray
    added: tuple[RowBlocks, ...]
    appended: tuple[RowBlocks, ...]
    nulled: tuple[RowEntries, ...]
    allocator_block_sizes: tuple[int, ...] | None = None
    trusted: bool = False
    # set by the allocator's journal only; not an init argument, so replace() drops it
    facts: AllocatorFacts | None = field(default=None, init=False, repr=False, compare=False)

    def __reduce__(self) -> tuple[type, tuple]:
        """Copies and pickles hold the same arrays or writable copies of them: never facts."""
        return (StepUpdate, (self.cleared_rows, self.added, self.appended, self.nulled,
                             self.allocator_block_sizes, self.trusted))

    @classmethod
    def empty(cls, num_groups: int) -> StepUpdate:
        return cls(
            cleared_rows=_EMPTY,
            added=tuple(RowBlocks() for _ in range(num_groups)),
            appended=tuple(RowBlocks() for _ in range(num_groups)),
            nulled=tuple(RowEntries() for _ in range(num_groups)),
        )

    @classmethod
    def make(
        cls,
        num_groups: int,
        *,
        cleared_rows: object = (),
        added: Sequence[RowBlocks] | None = None,
        appended: Sequence[RowBlocks] | None = None,
        nulled: Sequence[RowEntries] | None = None,
    ) -> StepUpdate:
        """Build an update; parts left out are empty."""
        return cls(
            cleared_rows=_int32(cleared_rows),
            added=tuple(added) if added is not None else tuple(RowBlocks() for _ in range(num_groups)),
            appended=tuple(appended)
            if appended is not None
            else tuple(RowBlocks() for _ in range(num_groups)),
            nulled=tuple(nulled) if nulled is not None else tuple(RowEntries() for _ in range(num_groups)),
        )

    @property
    def num_groups(self) -> int:
        return len(self.added)


def trusted_row_blocks(rows: np.ndarray, num_manager_blocks: np.ndarray,
                       block_ids: np.ndarray) -> RowBlocks:
    """``RowBlocks(rows, num_manager_blocks, block_ids)`` without the frozen dataclass's
    ``__init__`` (three ``object.__setattr__`` calls): for the allocator's journal, whose
    arrays are already int32 and read-only. The same object as the plain constructor makes."""
    part = object.__new__(RowBlocks)
    fields = part.__dict__
    fields["rows"] = rows
    fields["num_manager_blocks"] = num_manager_blocks
    fields["block_ids"] = block_ids
    return part


def trusted_update(
    cleared_rows: np.ndarray,
    added: tuple[RowBlocks, ...],
    appended: tuple[RowBlocks, ...],
    nulled: tuple[RowEntries, ...],
    allocator_block_sizes: tuple[int, ...] | None,
    facts: AllocatorFacts,
) -> StepUpdate:
    """A :class:`StepUpdate` carrying the allocator's ``facts``, built without the frozen
    dataclass's ``__init__`` (its per-field ``object.__setattr__`` calls cost about a
    microsecond per update, in every engine step). Only the allocator's journal calls it, with
    read-only arrays its facts describe."""
    update = object.__new__(StepUpdate)
    fields = update.__dict__
    fields["cleared_rows"] = cleared_rows
    fields["added"] = added
    fields["appended"] = appended
    fields["nulled"] = nulled
    fields["allocator_block_sizes"] = allocator_block_sizes
    fields["facts"] = facts
    return update


_PACKED_FIELDS = frozenset(("cleared_rows", "added", "appended", "nulled"))


class PackedStepUpdate(StepUpdate):
    """A one-group :class:`StepUpdate` whose arrays are cut from one packed buffer at first read.

    Only the allocator's journal makes these (:func:`packed_update`), for steps that admit or
    finish requests: the captured step stages the packed buffer in one compiled call and never
    builds the arrays. Reading any field builds them all, as read-only int32 views of the
    buffer, and from then on the object is an ordinary trusted :class:`StepUpdate`: equal,
    copied, pickled and replaced the same way.

    The buffer (``bytes``, int32) holds the cleared rows, the added rows, their counts, the
    appended rows, their counts, the appended ids, then the added ids; ``packed_sizes`` holds
    the lengths of its first six parts.
    """

    packed_data: bytes
    packed_sizes: tuple[int, int, int, int, int, int]

    def __getattr__(self, name: str) -> object:
        # called only for a field not yet built (the others are in the instance's __dict__)
        if name not in _PACKED_FIELDS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        fields = self.__dict__
        if "packed_data" not in fields:  # (an instance not made by packed_update)
            raise AttributeError(name)
        cleared, a_rows, a_counts, p_rows, p_counts, p_ids, a_ids = cut_packed(
            fields["packed_data"], fields["packed_sizes"])
        fields["cleared_rows"] = cleared
        fields["added"] = (trusted_row_blocks(a_rows, a_counts, a_ids) if len(a_rows)
                           else NO_ROW_BLOCKS,)
        fields["appended"] = (trusted_row_blocks(p_rows, p_counts, p_ids) if len(p_rows)
                              else NO_ROW_BLOCKS,)
        fields["nulled"] = (NO_ROW_ENTRIES,)
        return fields[name]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepUpdate):
            return NotImplemented
        # the dataclass's own comparison, for a plain StepUpdate as well
        return (self.cleared_rows, self.added, self.appended, self.nulled,
                self.allocator_block_sizes) == (other.cleared_rows, other.added, other.appended,
                                                other.nulled, other.allocator_block_sizes)

    __hash__ = StepUpdate.__hash__


FROZEN_EMPTY = np.zeros(0, dtype=np.int32)  # read-only: one empty array serves every update
FROZEN_EMPTY.flags.writeable = False
NO_ROW_BLOCKS = RowBlocks(FROZEN_EMPTY, FROZEN_EMPTY, FROZEN_EMPTY)  # frozen: shared as well
NO_ROW_ENTRIES = RowEntries(FROZEN_EMPTY, FROZEN_EMPTY)


def packed_update(data: bytes, sizes: tuple[int, int, int, int, int, int],
                  allocator_block_sizes: tuple[int, ...] | None,
                  facts: AllocatorFacts) -> PackedStepUpdate:
    """A :class:`PackedStepUpdate` of ``data`` (int32 bytes, laid out as that class says) and
    the lengths ``sizes`` of its first six parts, with the allocator's ``facts``."""
    update = object.__new__(PackedStepUpdate)
    fields = update.__dict__
    fields["packed_data"] = data
    fields["packed_sizes"] = sizes
    fields["allocator_block_sizes"] = allocator_block_sizes
    fields["facts"] = facts
    return update


def cut_packed(data: bytes, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """``data`` (int32) cut into parts of ``sizes``, then the rest as one more part: int32
    arrays, read-only views of ``data``; empty parts are one shared read-only empty array."""
    if not data:
        return [FROZEN_EMPTY] * (len(sizes) + 1)
    flat = np.frombuffer(data, dtype=np.int32)  # read-only: its memory is a bytes object
    out, at = [], 0
    for n in sizes:
        out.append(flat[at : at + n] if n else FROZEN_EMPTY)
        at += n
    out.append(flat[at:] if at < len(flat) else FROZEN_EMPTY)
    return out
