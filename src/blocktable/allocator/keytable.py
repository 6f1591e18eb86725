"""A hash table from 64-bit block keys to record slots, looked up and filled with numpy.

A Python dict pays a dependent cache miss and a Python int per key, three times per newly
cached block (is it new, insert, and later delete when its record is recycled). This table is
two flat arrays probed linearly for all keys of a call at once: one gather reads a window of
``WINDOW`` positions per key, so the cache misses of a call overlap.

Keys are block keys (:mod:`blocktable.allocator.hashing`), already mixed, so their low bits
index the table directly. ``values[pos]`` is a record slot (>= 0), ``EMPTY`` or ``DELETED``
(a tombstone: probing continues past it, inserting may reuse it; a deleted key followed by an
empty position needs none). The capacity is a power of two, at least four times the most keys
held, and the table is rebuilt when tombstones and keys together fill half of it, so probe
runs stay short.
"""

from __future__ import annotations

import numpy as np

from blocktable.allocator.arrays import has_repeats as _repeats

EMPTY = -1
DELETED = -2
WINDOW = 8  # positions probed per gather
_OFFSETS = np.arange(WINDOW)
_U64 = np.uint64


class KeyTable:
    """Distinct uint64 keys -> int64 values (>= 0), on cpu.

    Parameters
    ----------
    max_keys : int
        The most keys held at once (the capacity is ``>= 4 * max_keys``).
    """

    def __init__(self, max_keys: int) -> None:
        capacity = 1 << max(4, (4 * max(max_keys, 1) - 1).bit_length())
        self._mask = _U64(capacity - 1)
        self.keys = np.zeros(capacity, dtype=_U64)  # key at each position
        self.values = np.full(capacity, EMPTY, dtype=np.int64)  # value, EMPTY or DELETED
        self.num_keys = 0
        self._num_deleted = 0

    def __len__(self) -> int:
        return self.num_keys

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every ``(keys, values)`` held (for checks)."""
        held = self.values >= 0
        return self.keys[held], self.values[held]

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        """Where each key sits, -1 where absent (int64)."""
        n = len(keys)
        found = np.full(n, -1, dtype=np.int64)
        if not n:
            return found
        mask = int(self._mask)
        start = (keys & self._mask).astype(np.int64)
        # most keys are settled at their home position (a hit, or empty: absent)
        v = self.values[start]
        hit = (v >= 0) & (self.keys[start] == keys)
        found[hit] = start[hit]
        rest = ~hit & (v != EMPTY)
        if not rest.any():
            return found
        todo = np.flatnonzero(rest)
        want, start = keys[todo], start[todo] + 1
        while True:
            pos = (start[:, None] + _OFFSETS) & mask
            v = self.values[pos]
            hit = (v >= 0) & (self.keys[pos] == want[:, None])
            stop = hit | (v == EMPTY)
            at = stop.argmax(axis=1)
            rows = np.arange(len(todo))
            done = stop[rows, at]
            found_here = done & hit[rows, at]
            found[todo[found_here]] = pos[rows, at][found_here]
            if done.all():
                return found
            todo, want, start = todo[~done], want[~done], start[~done] + WINDOW

    def get(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key, -1 where absent (int64 ``[len(keys)]``)."""
        pos = self._positions(keys)
        out = self.values[np.maximum(pos, 0)]
        out[pos < 0] = -1
        return out

    def get_one(self, key: int) -> int:
        """:meth:`get` of one key (a Python loop: cheaper than numpy calls for one key)."""
        mask, values, keys = int(self._mask), self.values, self.keys
        pos = key & mask
        while True:
            value = int(values[pos])
            if value == EMPTY:
                return -1
            if value >= 0 and int(keys[pos]) == key:
                return value
            pos = (pos + 1) & mask

    def insert_one(self, key: int, value: int) -> None:
        """:meth:`insert` of one key that is not held."""
        if 2 * (self.num_keys + self._num_deleted + 1) > len(self.values):
            self._rebuild(1)
        mask, values = int(self._mask), self.values
        pos = key & mask
        while values[pos] >= 0:
            pos = (pos + 1) & mask
        if values[pos] == DELETED:
            self._num_deleted -= 1
        self.keys[pos] = key
        values[pos] = value
        self.num_keys += 1

    def insert_absent(self, keys: np.ndarray, values: np.ndarray) -> bool:
        """File ``keys`` (``values`` distinct) if none is held and none repeats (return True);
        else change nothing and return False.

        One pass over the table for the common case, new keys whose home position is empty
        (an empty home proves a key absent): the check and the insert read the same positions.
        """
        n = len(keys)
        if not n:
            return True
        if 2 * (self.num_keys + self._num_deleted + n) > len(self.values):
            self._rebuild(n)
        tkeys, tvalues = self.keys, self.values
        home = (keys & self._mask).astype(np.int64)
        empty = tvalues[home] == EMPTY
        if empty.all():
            probe = None
        else:
            # occupied homes: probe for the key (held: refuse), then insert these with the rest
            probe = np.flatnonzero(~empty)
            if (self._positions(keys[probe]) >= 0).any() or _repeats(keys[probe]):
                return False
            home_at = np.flatnonzero(empty)
            home, keys_e, values_e = home[home_at], keys[home_at], values[home_at]
        if probe is None:
            keys_e, values_e = keys, values
        # of several keys with one empty home, one write survives: it is placed there
        tvalues[home] = values_e
        won = tvalues[home] == values_e
        if won.all():
            tkeys[home] = keys_e
            self.num_keys += len(keys_e)
            if probe is not None:
                self.insert(keys[probe], values[probe])
            return True
        wpos = home[won]
        tkeys[wpos] = keys_e[won]
        lost = np.flatnonzero(~won)
        lost_keys = keys_e[lost]
        if (tkeys[home[lost]] == lost_keys).any() or _repeats(lost_keys):
            tvalues[wpos] = EMPTY  # a key given twice: undo
            return False
        self.num_keys += len(wpos)
        rest = lost_keys, values_e[lost]
        if probe is not None:
            rest = (
                np.concatenate((rest[0], keys[probe])),
                np.concatenate((rest[1], values[probe])),
            )
        self.insert(*rest)
        return True

    def insert(self, keys: np.ndarray, values: np.ndarray) -> None:
        """File distinct keys that are not held yet."""
        n = len(keys)
        if not n:
            return
        if 2 * (self.num_keys + self._num_deleted + n) > len(self.values):
            self._rebuild(n)
        tkeys, tvalues, mask = self.keys, self.values, int(self._mask)
        start = (keys & self._mask).astype(np.int64)
        # most keys find their home position free: of several keys wanting one position, the
        # last write wins, and the keys whose write survived are placed
        home = np.flatnonzero(tvalues[start] < 0)
        hpos = start[home]
        tkeys[hpos] = keys[home]
        won = tkeys[hpos] == keys[home]
        wpos = hpos[won]
        self._num_deleted -= int(np.count_nonzero(tvalues[wpos] == DELETED))
        tvalues[wpos] = values[home[won]]
        placed = np.zeros(n, dtype=bool)
        placed[home[won]] = True
        todo = np.flatnonzero(~placed)
        start = start[todo]
        while len(todo):
            pos = (start[:, None] + _OFFSETS) & mask
            free = tvalues[pos] < 0
            has = free.any(axis=1)
            at = free.argmax(axis=1)
            cand = np.flatnonzero(has)
            cpos = pos[cand, at[cand]]
            # several keys may want one free position: the first (in key order) takes it
            order = np.argsort(cpos, kind="stable")
            first = np.ones(len(cand), dtype=bool)
            first[1:] = cpos[order[1:]] != cpos[order[:-1]]
            winners = cand[order[first]]
            wpos = cpos[order[first]]
            self._num_deleted -= int(np.count_nonzero(tvalues[wpos] == DELETED))
            tkeys[wpos] = keys[todo[winners]]
            tvalues[wpos] = values[todo[winners]]
            placed = np.zeros(len(todo), dtype=bool)
            placed[winners] = True
            # losers retry from the same start (that position is taken now); full windows
            # move on
            start = np.where(has, start, start + WINDOW)[~placed]
            todo = todo[~placed]
        self.num_keys += n

    def delete(self, keys: np.ndarray) -> None:
        """Remove held keys (every one must be held)."""
        pos = self._positions(keys)
        # no probe passes a position followed by an empty one: it can become empty itself
        last = self.values[(pos + 1) & int(self._mask)] == EMPTY
        self.values[pos] = np.where(last, EMPTY, DELETED)
        self.num_keys -= len(keys)
        self._num_deleted += len(keys) - int(np.count_nonzero(last))

    def clear(self) -> None:
        self.values[:] = EMPTY
        self.num_keys = self._num_deleted = 0

    def _rebuild(self, extra: int) -> None:
        """Drop tombstones (and grow when the keys alone would fill a quarter of the table)."""
        keys, values = self.items()
        capacity = len(self.values)
        while 4 * (len(keys) + extra) > capacity:
            capacity *= 2
        self._mask = _U64(capacity - 1)
        self.keys = np.zeros(capacity, dtype=_U64)
        self.values = np.full(capacity, EMPTY, dtype=np.int64)
        self.num_keys = self._num_deleted = 0
        self.insert(keys, values)
