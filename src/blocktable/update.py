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

    def __init__(self, rows: np.ndarray = _EMPTY, num_manager_blocks: np.ndarray = _EMPTY,
                 block_ids: np.ndarray = _EMPTY) -> None:
        # (frozen: this is the one write, into the instance dict: the generated __init__
        # calls object.__setattr__ per field, and the allocator makes these every step)
        d = self.__dict__
        d["rows"], d["num_manager_blocks"], d["block_ids"] = rows, num_manager_blocks, block_ids

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

    def __init__(self, rows: np.ndarray = _EMPTY, block_indices: np.ndarray = _EMPTY) -> None:
        d = self.__dict__  # (frozen: as RowBlocks)
        d["rows"], d["block_indices"] = rows, block_indices

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class StepUpdate:
    """One step's changes for every KV cache group (tuples hold one entry per group).

    ``allocator_block_sizes`` (tokens per allocator block, one per group), when set, says which
    allocator the ids came from: the table refuses the update unless each group's
    ``block_size * cp_world_size`` equals it (a block id must mean the same tokens on both
    sides). ``None`` skips that check.

    ``trusted=True`` is a producer's promise (the allocator's ``take_step_update`` makes it)
    that within each group every row appears at most once in ``added`` and at most once in
    ``appended``, and every count is non-negative and the counts sum to the number of ids:
    the table then skips those checks. Whatever the flag, rows and ids are checked against
    the table's bounds and every append against the row's width, before any write.
    """

    cleared_rows: np.ndarray
    added: tuple[RowBlocks, ...]
    appended: tuple[RowBlocks, ...]
    nulled: tuple[RowEntries, ...]
    allocator_block_sizes: tuple[int, ...] | None = None
    trusted: bool = False

    def __init__(self, cleared_rows: np.ndarray, added: tuple[RowBlocks, ...],
                 appended: tuple[RowBlocks, ...], nulled: tuple[RowEntries, ...],
                 allocator_block_sizes: tuple[int, ...] | None = None,
                 trusted: bool = False) -> None:
        d = self.__dict__  # (frozen: as RowBlocks)
        d["cleared_rows"], d["added"], d["appended"], d["nulled"] = (cleared_rows, added,
                                                                     appended, nulled)
        d["allocator_block_sizes"], d["trusted"] = allocator_block_sizes, trusted

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
