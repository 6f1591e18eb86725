"""The prefix index of one pool: content records found by block key, verified exactly.

A **record** (a slot in these arrays) describes one block content: its unique content id
(``cid``, never reused), the content id of its parent (the previous block of the prefix; the
first block's parent is ``-(namespace id)``), its token ids, and its *holder*, the block that
holds it now (0 once the block was evicted: the record is then *dead*). ``slot_of_key`` (a
:mod:`blocktable.key_table`) maps a block key (:mod:`blocktable.block_hashing`) to the record
slot filed under it; ``key[slot]`` is the key a record is filed under (so a record leaves by
its slot).

A lookup (:func:`blocktable.allocator.prefix.find_hits`, for all prompts of a call at once)
shares block ``i`` of a prompt only when the record found under key ``i`` holds
exactly the prompt's tokens of block ``i`` and its parent content id is the content id verified
for block ``i - 1``: by induction the whole prefix is equal, whatever the keys. Dead records keep
their content (tokens, parent id), so the prefix *before* a sliding window is still verified
exactly after its blocks were evicted; only the blocks a group needs must be alive.

Dead records are kept up to ``max_records`` records in all (``max(2 * num_blocks, 4096)`` by
default) and then recycled, least recently killed first; a record whose parent was recycled
can no longer be reached (a cache miss, never a wrong hit). When a content is computed whose
key is filed under a *different* content (a key collision, or the same tokens under a parent
whose record was recycled), the new content takes the key: the old record leaves the index.
"""

from __future__ import annotations

import numpy as np

from blocktable._fastnp import count_nonzero
from blocktable.key_table import new_key_table

_MIN_RECORDS = 4096
RECORDS_PER_BLOCK = 2  # dead records are kept up to this many records per block


class PrefixIndex:
    """Records of block contents for one pool of ``block_size``-token blocks (all on cpu).

    Parameters
    ----------
    num_blocks : int
        Pool size (live records never outnumber its blocks).
    block_size : int
        Tokens per block.
    max_records : int, optional
        Records kept, live or dead (default ``max(2 * num_blocks, 4096)``, counting host
        blocks as blocks); at least ``num_blocks + num_host_blocks``.
    num_host_blocks : int
        Blocks of the pool's host tier (:mod:`blocktable.host_tier`); when positive
        every record also notes the host block holding a copy (``host_block``), and a record
        with a host copy is never recycled.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_records: int | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        num_blocks += num_host_blocks  # records a live or host copy may pin
        if max_records is None:
            max_records = max(RECORDS_PER_BLOCK * num_blocks, _MIN_RECORDS)
        self.block_size = block_size
        self.max_records = max(int(max_records), num_blocks)
        capacity = min(self.max_records, max(num_blocks, 64))
        self.slot_of_key = new_key_table(capacity)  # block key -> record slot
        self.cid = np.zeros(capacity, dtype=np.int64)  # content id, 0 = unused slot
        self.parent = np.zeros(capacity, dtype=np.int64)  # parent's content id
        self.tokens = np.zeros((capacity, block_size), dtype=np.int64)
        self._row_dtype = np.dtype((np.void, 8 * block_size))  # a token row as one item
        self._token_rows = self.tokens.view(self._row_dtype).reshape(-1)  # a view of tokens
        self.holder = np.zeros(capacity, dtype=np.int32)  # block holding it, 0 = dead
        # host block holding a copy, 0 = none (None: the pool has no host tier)
        self.host_block = np.zeros(capacity, dtype=np.int32) if num_host_blocks else None
        self.key = np.zeros(self.max_records, dtype=np.uint64)  # per slot, its key if filed
        self.hashes: list[object] = [None] * capacity  # block hash, when not the key
        self.any_hashes = False  # whether hashes holds anything
        # unused slots, a stack: the top is _free[_num_free - 1]
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._num_free = capacity
        # slots in the order they died (may repeat or be revived): _dead[_dead_head:_dead_tail]
        self._dead = np.zeros(1024, dtype=np.int64)
        self._dead_head = 0  # _dead[:_dead_head] were examined already
        self._dead_tail = 0
        self.next_cid = 1
        self.num_records = 0

    def __len__(self) -> int:
        return self.num_records

    # ----------------------------------------------------------------- lookup
    def find(self, keys: np.ndarray | list[int]) -> np.ndarray:
        """Record slot of each key, -1 where none (int64 ``[len(keys)]``)."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        slots = np.empty(len(keys), dtype=np.int64)
        self.slot_of_key.find(keys, slots)
        return slots

    def find_one(self, key: int) -> int:
        """Record slot of ``key``, -1 where none."""
        return self.slot_of_key.get(key, -1)

    def file_absent(self, keys: np.ndarray, slots: np.ndarray) -> bool:
        """File ``keys`` (uint64 ``[n]``) under ``slots`` (int64 ``[n]``) and return True if
        none is filed yet and none repeats; else change nothing and return False."""
        if not self.slot_of_key.insert_absent(keys, slots):
            return False
        self.key[slots] = keys
        return True

    def file_one(self, key: int, slot: int) -> None:
        """File ``key`` (not filed yet) under ``slot``."""
        self.slot_of_key.insert(key, slot)
        self.key[slot] = key

    def unfile(self, slots: np.ndarray) -> None:
        """Remove the keys filed under ``slots`` (int64, each filed)."""
        self.slot_of_key.remove(self.key[slots])

    # ----------------------------------------------------------------- records
    def write_tokens(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """``self.tokens[slots] = tokens`` (``slots``: distinct, int64 ``[n]``; ``tokens``:
        int64 ``[n, block_size]``), as one ``put`` of whole rows, each one item (numpy's
        row-wise assignment of 2-D rows costs about three times as much, a fancy-index
        assignment of the same items about 1.5 times: ``put`` copies such items faster)."""
        rows = np.ascontiguousarray(tokens, dtype=np.int64).view(self._row_dtype).reshape(-1)
        self._token_rows.put(slots, rows)

    def __getstate__(self) -> dict[str, object]:  # a view would pickle as a copy
        state = dict(self.__dict__)
        del state["_token_rows"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._token_rows = self.tokens.view(self._row_dtype).reshape(-1)

    def take_slots(self, num: int) -> np.ndarray:
        """``num`` unused slots (int64), recycling dead records or growing the arrays."""
        while self._num_free < num:
            capacity = len(self.cid)
            if capacity < self.max_records:
                self._grow(min(self.max_records, max(2 * capacity, capacity + num)))
            elif not self._recycle(num - self._num_free):
                raise AssertionError("no dead record to recycle")  # live <= num_blocks
        top = self._num_free
        self._num_free = top - num
        self.num_records += num
        return self._free[top - num : top][::-1].copy()

    def untake_slots(self, slots: np.ndarray) -> None:
        """Give back the slots of the last :meth:`take_slots`, unused (the stack is as before)."""
        self._num_free += len(slots)
        self.num_records -= len(slots)

    def drop(self, slots: np.ndarray) -> None:
        """Forget records now (they leave the index; their slots become unused)."""
        self.unfile(slots)
        self.cid[slots] = 0
        self.holder[slots] = 0
        if self.any_hashes:
            for slot in slots.tolist():
                self.hashes[slot] = None
        n, top = len(slots), self._num_free
        self._free[top : top + n] = slots
        self._num_free = top + n
        self.num_records -= n

    def kill(self, slots: np.ndarray) -> None:
        """Their blocks were evicted: the records stay, dead, until recycled."""
        self.holder[slots] = 0
        n, tail = len(slots), self._dead_tail
        if tail + n > len(self._dead):
            live = self._dead[self._dead_head : tail]  # drop the examined part, maybe grow
            size = 2 * (len(live) + n)
            if size <= len(self._dead):
                # Room once the examined part is dropped: move the rest to the front in place
                # (a new array's pages would fault in again, a few at every later kill).
                self._dead[: len(live)] = live  # (numpy copies overlapping slices safely)
            else:
                dead = np.zeros(size, dtype=np.int64)
                dead[: len(live)] = live
                self._dead = dead
            self._dead_head, tail = 0, len(live)
        self._dead[tail : tail + n] = slots
        self._dead_tail = tail + n

    def _recycle(self, want: int) -> bool:
        """Drop at least ``want`` dead records, those that died first (False if none left)."""
        found = 0
        while found < want and self._dead_head < self._dead_tail:
            head = self._dead_head
            batch = self._dead[head : min(self._dead_tail, head + max(2 * want, 1024))]
            self._dead_head = head + len(batch)
            # still dead: not revived, not dropped (a slot dropped and reused is alive or dies
            # again later, with a later entry)
            holder = self.holder
            keep = self.cid[batch] != 0
            keep &= holder[batch] == 0
            if self.host_block is not None:  # (killed again when the host copy goes)
                keep &= self.host_block[batch] == 0
            # (usually all are kept: no copy; count_nonzero is cheaper than boolean indexing)
            if count_nonzero(keep) < len(batch):
                batch = batch[keep]
            if len(batch) > 1:
                # each slot once: a dead record's holder entry is 0 and drop() writes 0
                # again, so it serves as scratch (of repeated writes to one entry, one
                # survives; which one only orders the free slots)
                marks = np.arange(-1, -1 - len(batch), -1, dtype=holder.dtype)
                holder[batch] = marks
                once = holder[batch] == marks
                if count_nonzero(once) < len(batch):
                    batch = batch[once]
            if len(batch):
                self.drop(batch)
                found += len(batch)
        return found > 0

    def _grow(self, capacity: int) -> None:
        old = len(self.cid)
        for name in ("cid", "parent", "holder", "host_block"):  # (`key`: full size already)
            arr = getattr(self, name)
            if arr is None:
                continue
            new = np.zeros(capacity, dtype=arr.dtype)
            new[:old] = arr
            setattr(self, name, new)
        tokens = np.zeros((capacity, self.block_size), dtype=np.int64)
        tokens[:old] = self.tokens
        self.tokens = tokens
        self._token_rows = tokens.view(self._row_dtype).reshape(-1)
        self.hashes += [None] * (capacity - old)
        free = np.empty(capacity, dtype=np.int64)  # the new slots at the bottom of the stack
        free[: capacity - old] = np.arange(capacity - 1, old - 1, -1)
        free[capacity - old : capacity - old + self._num_free] = self._free[: self._num_free]
        self._free = free
        self._num_free += capacity - old

    def live_slots(self) -> np.ndarray:
        """Slots of live records (for checks)."""
        return np.flatnonzero((self.cid != 0) & (self.holder != 0))

    def findable(self, slots: np.ndarray) -> np.ndarray:
        """Per slot, nonzero when its content is on the device or on the host (int32)."""
        if self.host_block is None:
            return self.holder[slots]
        return self.holder[slots] | self.host_block[slots]

    def clear(self) -> None:
        """Forget every record."""
        self.slot_of_key.clear()
        self.cid[:] = 0
        self.holder[:] = 0
        if self.host_block is not None:
            self.host_block[:] = 0
        self.hashes = [None] * len(self.cid)
        self._free = np.arange(len(self.cid) - 1, -1, -1, dtype=np.int64)
        self._num_free = len(self.cid)
        self._dead_head = self._dead_tail = 0
        self.num_records = 0
