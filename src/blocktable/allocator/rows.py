"""Table rows in indexed mode: each running request holds one row for its whole lifetime."""

from __future__ import annotations

import heapq
from typing import Generic, TypeVar

from blocktable.allocator.errors import OutOfRowsError

T = TypeVar("T")


class RowAllocator(Generic[T]):
    """Rows ``0 .. num_rows - 1``; :meth:`take` hands out the lowest free row.

    Lowest-first keeps the held rows dense at the top of the table, so a table committing
    ``[0, max held row]`` moves little.
    """

    def __init__(self, num_rows: int) -> None:
        self.holders: list[T | None] = [None] * num_rows  # row -> holder
        self._free = list(range(num_rows))  # heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    def check_free(self, what: str) -> None:
        """Raise :class:`OutOfRowsError` naming ``what`` if no row is free."""
        if not self._free:
            raise OutOfRowsError(f"no free row for {what}: all {len(self.holders)} held")

    def take(self, holder: T) -> int:
        """Give the lowest free row to ``holder`` (call :meth:`check_free` first)."""
        row = heapq.heappop(self._free)
        self.holders[row] = holder
        return row

    def release(self, row: int) -> None:
        self.holders[row] = None
        heapq.heappush(self._free, row)

    def free_rows(self) -> list[int]:
        """The free rows (for checks)."""
        return list(self._free)
