"""The queue of free cached blocks, least recently used first, emptied many at a time.

An ``OrderedDict`` pays ~100 ns per block to pop or delete; prefill evicts hundreds of blocks
per step. This queue is a flat list read through a head index, so :meth:`LruQueue.pop_front`
takes ``n`` blocks with one list slice. Removing a block from the middle (a prefix hit reuses a
free cached block) does not shift the list: the slot becomes *stale*, its position goes to a
heap, and ``pop_front`` skips it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

_COMPACT_MIN = 4096  # popped (or stale) slots tolerated before the list is compacted


class LruQueue:
    """Block ids in queue order with O(1) append, O(log n) removal, O(n) bulk pop (C loops).

    Slots have absolute positions (``base + list index``) that dropping popped slots does not
    change, so ``_pos`` and the stale heap survive it; when stale slots outnumber live ones,
    :meth:`_drop_stale` renumbers the live slots past every old position.
    """

    def __init__(self, num_blocks: int) -> None:
        self._ids: list[int] = []  # slots, stale ones included; _ids[i] is at base + i
        self._base = 0  # absolute position of _ids[0]
        self._head = 0  # list index of the oldest slot not popped yet
        self._pos = [-1] * num_blocks  # block id -> absolute position of its live slot
        self._stale: list[int] = []  # heap: absolute positions of removed blocks' slots
        self._len = 0  # live slots

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        """The queued ids, oldest first (O(slots); for checks and tests)."""
        pos, start = self._pos, self._base + self._head
        live = [b for i, b in enumerate(self._ids[self._head :], start) if pos[b] == i]
        return iter(live)

    def append(self, block_id: int) -> None:
        """Queue ``block_id`` last (it must not be queued)."""
        self._pos[block_id] = self._base + len(self._ids)
        self._ids.append(block_id)
        self._len += 1

    def extend(self, block_ids: list[int]) -> None:
        """Queue ``block_ids`` last, in order (none of them queued)."""
        pos = self._pos
        for i, block_id in enumerate(block_ids, self._base + len(self._ids)):
            pos[block_id] = i
        self._ids += block_ids
        self._len += len(block_ids)

    def remove(self, block_id: int) -> None:
        """Take a queued ``block_id`` out of the queue, wherever it is."""
        heapq.heappush(self._stale, self._pos[block_id])
        self._pos[block_id] = -1
        self._len -= 1
        if len(self._stale) > _COMPACT_MIN and len(self._stale) > self._len:
            self._drop_stale()  # blocks removed and queued again would grow the list forever

    def pop_one(self) -> int:
        """Pop the oldest id (the queue must not be empty); the decode fast path."""
        head, stale = self._head, self._stale
        while stale and stale[0] == self._base + head:
            heapq.heappop(stale)
            head += 1
        block_id = self._ids[head]
        self._len -= 1
        self._advance(head + 1)
        return block_id

    def pop_front(self, num_blocks: int) -> list[int]:
        """Pop the ``num_blocks`` oldest ids (at most ``len(self)``), oldest first.

        Popped ids keep their old position in ``_pos``: it lies before the head, where no
        live slot is, so it can never be mistaken for a live one.
        """
        ids, head, base, stale = self._ids, self._head, self._base, self._stale
        end = head + num_blocks
        if stale and stale[0] < base + end:
            # Skip the stale slots in the window; each one widens the window by one slot.
            skipped = set()
            while stale and stale[0] < base + end:
                skipped.add(heapq.heappop(stale))
                end += 1
            taken = [b for i, b in enumerate(ids[head:end], base + head) if i not in skipped]
        else:
            taken = ids[head:end]
        self._len -= num_blocks
        self._advance(end)
        return taken

    def _advance(self, head: int) -> None:
        """Move the head to list index ``head``; drop popped slots once they are most of it."""
        if head >= _COMPACT_MIN and 2 * head >= len(self._ids):
            del self._ids[:head]
            self._base += head
            head = 0
        self._head = head

    def _drop_stale(self) -> None:
        """Rebuild the list from the live slots only (amortized: stale slots outnumber them).

        New positions start past every old one, so no old position left in ``_pos`` (of a
        popped id) can match a new slot.
        """
        live = list(self)
        self._base += len(self._ids)
        self._ids, self._head, self._stale = live, 0, []
        pos = self._pos
        for i, block_id in enumerate(live, self._base):
            pos[block_id] = i
