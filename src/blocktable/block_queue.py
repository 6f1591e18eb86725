"""A queue of free block ids, oldest first, filled and emptied many at a time with numpy.

Prefill frees and evicts hundreds of blocks per step, so every operation takes an array of ids:
``extend`` writes them at the tail, ``pop`` slices them off the head, ``remove`` (a prefix hit
reusing a free cached block) only marks the slot stale. A slot is live while
``position[id] == slot``; ``pop`` skips stale slots, and the array is compacted (live slots moved
to the front, positions rewritten) when the tail reaches its end. A popped id keeps its old
position (a slot before the head, so never live again): ``pop`` writes nothing per id.
``extend`` also takes the blocks of several requests freed together, shared ones repeated: it
finds each id's last occurrence with the positions themselves (no scratch array, no sort) and
leaves the slots of the earlier ones stale.
"""

from __future__ import annotations

import numpy as np

from blocktable._fastnp import count_nonzero


def last_occurrences(ids: np.ndarray) -> np.ndarray:
    """``ids`` without repeats, each value kept where it occurs last, in the original order."""
    if len(ids) < 2:
        return ids
    order = np.argsort(ids, kind="stable")
    s = ids[order]
    last = np.ones(len(ids), dtype=bool)
    last[:-1] = s[:-1] != s[1:]
    return ids[np.sort(order[last])]


class BlockQueue:
    """Block ids ``1 .. num_blocks - 1`` in queue order, each at most once.

    Parameters
    ----------
    num_blocks : int
        Block ids are ``< num_blocks``.
    initial : np.ndarray, optional
        int32 ids queued at the start, oldest first.
    """

    def __init__(self, num_blocks: int, initial: np.ndarray | None = None) -> None:
        # On cpu, block ids. Filled now, not zeroed lazily (np.zeros maps zero pages): the
        # tail walks through the whole array before its first compaction, and each page's
        # first write would otherwise fault inside a release.
        self._slots = np.empty(2 * num_blocks + 2, dtype=np.int32)
        self._slots.fill(0)
        self._position = np.full(num_blocks, -1, dtype=np.int32)  # on cpu, block id -> slot
        self._iota = np.arange(len(self._slots), dtype=np.int32)  # on cpu, slot numbers
        self._head = 0  # first slot not popped
        self._tail = 0  # first unused slot
        self._len = 0  # live slots
        if initial is not None and len(initial):
            self.extend(initial)

    def __len__(self) -> int:
        return self._len

    def ids(self) -> np.ndarray:
        """The queued ids, oldest first (int32, a copy; for checks and tests)."""
        window = self._slots[self._head : self._tail]
        live = self._position[window] == self._iota[self._head : self._tail]
        return window[live]

    def contains(self, block_ids: np.ndarray) -> np.ndarray:
        """Whether each id is queued (bool, same shape)."""
        at = self._position[block_ids]
        inside = (at >= self._head) & (at < self._tail)
        return inside & (self._slots[np.where(inside, at, 0)] == block_ids)

    def extend(self, block_ids: np.ndarray, *, may_repeat: bool = False) -> None:
        """Queue ``block_ids`` (int32 or intp, none of them queued) last, in order.

        With ``may_repeat`` an id may occur several times; it is queued once, where it occurs
        last.
        """
        n = len(block_ids)
        if not n:
            return
        if self._tail + n > len(self._slots):
            self._compact()
            if self._tail + n > len(self._slots):  # more repeats than free slots
                block_ids, may_repeat = last_occurrences(block_ids), False
                n = len(block_ids)
        tail = self._tail
        position, stamps = self._position, self._iota[tail : tail + n]
        self._slots[tail : tail + n] = block_ids
        self._tail = tail + n
        if may_repeat and n > 1:
            # The ids are not queued (position -1, or a slot before the head): the largest
            # stamp an id gets is the slot of its last occurrence, the one it is queued at.
            # The slots of its earlier occurrences stay stale, as if removed (pop skips them).
            np.maximum.at(position, block_ids, stamps)
            self._len += count_nonzero(position.take(block_ids) == stamps)
        else:
            position[block_ids] = stamps
            self._len += n

    def append(self, block_id: int) -> None:
        """Queue one id last."""
        if self._tail == len(self._slots):
            self._compact()
        self._slots[self._tail] = block_id
        self._position[block_id] = self._tail
        self._tail += 1
        self._len += 1

    def remove(self, block_ids: np.ndarray) -> None:
        """Take queued ``block_ids`` (no repeats) out of the queue, wherever they are."""
        self._position[block_ids] = -1
        self._len -= len(block_ids)
        if self._tail - self._head - self._len > max(self._len, 1024):
            self._compact()  # stale slots outnumber live ones: keep pops short

    def pop(self, num_blocks: int) -> np.ndarray:
        """Pop the ``num_blocks`` oldest ids (at most ``len(self)``), oldest first (int32)."""
        if num_blocks <= 0:
            return self._slots[:0].copy()
        head, tail = self._head, self._tail
        end = min(tail, head + num_blocks)
        window = self._slots[head:end]
        # no stale slot between head and tail (nothing removed since): the window is live
        iota = self._iota
        live = tail - head == self._len or count_nonzero(
            self._position[window] == iota[head:end]
        ) == end - head
        if not live:
            # Stale slots in the way: a window wider by the number of stale slots holds enough.
            end = min(tail, head + num_blocks + (tail - head - self._len))
            window = self._slots[head:end]
            live_at = np.flatnonzero(self._position[window] == iota[head:end])
            live_at = live_at[:num_blocks]
            taken = window[live_at]
            end = head + int(live_at[-1]) + 1
        else:
            taken = window.copy()
        self._head = end  # (the taken ids' positions now lie before the head: not live)
        self._len -= num_blocks
        return taken

    def _compact(self) -> None:
        live = self.ids()
        n = len(live)
        self._slots[:n] = live
        self._position.fill(-1)  # (popped ids kept old positions, which would become live)
        self._position[live] = self._iota[:n]
        self._head, self._tail = 0, n
