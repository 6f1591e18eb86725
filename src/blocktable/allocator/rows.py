"""Table rows in indexed mode: each running request holds one row for its whole lifetime."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from blocktable.allocator.errors import OutOfRowsError

T = TypeVar("T")


class RowAllocator(Generic[T]):
    """Rows ``0 .. num_rows - 1``; :meth:`take_many` hands out the lowest free rows.

    Lowest-first keeps the held rows dense at the top of the table, so a table committing
    ``[0, max held row]`` moves little. The free rows are a heap: a step frees and takes a few
    rows, and a heap push or pop (a few hundred ns) is cheaper than any numpy call.
    """

    def __init__(self, num_rows: int) -> None:
        self.holders: list[T | None] = [None] * num_rows  # row -> holder
        self._free = list(range(num_rows))  # heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    def check_free(self, what: str, num_rows: int = 1) -> None:
        """Raise :class:`OutOfRowsError` naming ``what`` if fewer than ``num_rows`` are free."""
        num_free = len(self._free)
        if num_free >= num_rows:
            return
        if num_rows == 1:
            raise OutOfRowsError(f"no free row for {what}: all {len(self.holders)} held")
        raise OutOfRowsError(
            f"no {num_rows} free rows for {what}: {num_free} free of {len(self.holders)}"
        )

    def take_many(self, holders: Sequence[T]) -> list[int]:
        """Give the lowest free rows to ``holders``, in order (ascending rows); raises
        :class:`OutOfRowsError` (nothing taken) when fewer rows are free than holders."""
        free = self._free
        if len(holders) > len(free):
            self.check_free("the requests", len(holders))
        pop, held, rows = heapq.heappop, self.holders, []
        for holder in holders:
            row = pop(free)
            held[row] = holder
            rows.append(row)
        return rows

    def release_many(self, rows: Iterable[int]) -> None:
        """Free ``rows`` (held, distinct)."""
        held, free, push = self.holders, self._free, heapq.heappush
        for row in rows:
            held[row] = None
            push(free, row)

    def free_rows(self) -> list[int]:
        """The free rows (for checks)."""
        return list(self._free)
