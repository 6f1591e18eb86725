"""A hash table from 64-bit block keys to record slots, looked up and filled many keys at a
time with numpy.

Why not a ``dict``: a Python dict pays a dependent cache miss and a Python int per key, three
times per newly cached block (is it new, insert, and later delete when its record is
recycled); with a dict, ``benchmarks/bench_allocator.py`` measured a much slower allocator
step (the figures are in BENCHMARKS.md). This table is
one flat array probed linearly for all keys of a call at once: one gather reads a window of
``WINDOW`` positions per key, so the cache misses of a call overlap. Checking that new keys
are absent and filing them is one such pass (:meth:`KeyTable.insert_absent`), and a value's
position is remembered (values are distinct record slots), so deleting by value probes
nothing.

Keys are block keys (:mod:`blocktable.allocator.hashing`), already mixed, so their low bits
index the table directly. An **entry** (int64) is ``EMPTY``, ``DELETED`` (a tombstone:
probing continues past it, inserting may reuse it; a deleted key followed by an empty position
needs none) or ``(tag << 32) | value`` for a held key, the tag being the key's top 31 bits.
The keys themselves are kept per value (``key_of_value``) and read only where a tag matches,
so every match is exact, and an entry takes 8 bytes, not 16: the table has eight positions per
key it may hold for the memory of four (key, value) pairs, so fewer homes are taken and probe
runs are shorter. The capacity is a power of two, and the table is rebuilt when tombstones and
keys together fill half of it.
"""

from __future__ import annotations

import numpy as np

from blocktable.allocator.arrays import has_repeats as _repeats

EMPTY = -1
DELETED = -2
WINDOW = 8  # positions probed per gather (8: a window's bool flags are one uint64 word)
SPREAD = 8  # positions per key held at most
_OFFSETS = np.arange(WINDOW)
_U64 = np.uint64
_VALUE_BITS = 32
_VALUE_MASK = (1 << _VALUE_BITS) - 1
_TAG_SHIFT = 33  # a key's tag: its top 31 bits
_S_TAG, _S_VALUE, _MASK_VALUE = _U64(_TAG_SHIFT), np.int64(_VALUE_BITS), np.int64(_VALUE_MASK)
_HIGH = np.int64(~_VALUE_MASK)  # an entry's high half: its key's tag (negative: free)


def _any_per_row(flags: np.ndarray) -> np.ndarray:
    """Per row of a C-contiguous bool ``[n, 8]``, whether any is set (one comparison on the
    rows read as uint64 words: a reduction along short rows costs several times more)."""
    return flags.view(_U64)[:, 0] != 0


def _tags(keys: np.ndarray) -> np.ndarray:
    """The tag of each key (int64, below ``2**31``)."""
    return (keys >> _S_TAG).view(np.int64)


class KeyTable:
    """Distinct uint64 keys -> distinct int64 values in ``[0, num_values)``, on cpu.

    Parameters
    ----------
    max_keys : int
        The most keys held at once (the capacity is ``>= 8 * max_keys``).
    num_values : int, optional
        Values are below this (default ``max_keys``; at most ``2**32``).
    """

    def __init__(self, max_keys: int, num_values: int | None = None) -> None:
        num_values = max(max_keys, 1) if num_values is None else num_values
        if num_values > 1 << _VALUE_BITS:
            raise ValueError(f"num_values must be <= 2**32, got {num_values}")
        # value -> its position, and the key filed with it (meaningful for held values only)
        self.where = np.zeros(num_values, np.int64)
        self.key_of_value = np.zeros(num_values, np.uint64)
        self._alloc(1 << max(4, (SPREAD * max(max_keys, 1) - 1).bit_length()))
        self.num_keys = 0
        self._num_deleted = 0

    def __len__(self) -> int:
        return self.num_keys

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every ``(keys, values)`` held (for checks: a key whose entry's tag is not its own
        is reported with its bits flipped)."""
        entries = self.entries[self.entries >= 0]
        values = entries & _MASK_VALUE
        keys = self.key_of_value[values]
        bad = _tags(keys) != entries >> _S_VALUE
        keys[bad] = ~keys[bad]
        return keys, values

    # ----------------------------------------------------------------- lookup
    def _scan(self, keys: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Where each key sits, -1 where absent (int64), probing window after window from
        ``start`` (int64 ``[len(keys)]``: the key's home, or a position its run goes on at).

        A match is exact: the tag (a free entry's high half is negative, never a tag), then
        the key filed with the entry's value. A run ends at its first empty position.
        """
        mask = self._int_mask
        found = np.full(len(keys), -1, dtype=np.int64)
        todo = np.arange(len(keys))
        tags = _tags(keys)
        while True:
            v = self.entries.take(start[:, None] + _OFFSETS, mode="wrap")
            same = v >> _S_VALUE == tags[:, None]
            if np.count_nonzero(same):
                rows, cols = np.nonzero(same)
                same[rows, cols] = self.key_of_value[v[rows, cols] & _MASK_VALUE] == keys[rows]
            stop = same | (v == EMPTY)
            at = stop.argmax(axis=1)
            rows = np.arange(len(todo))
            done = stop[rows, at]
            hit = done & same[rows, at]
            found[todo[hit]] = (start[hit] + at[hit]) & mask
            if np.count_nonzero(done) == len(done):
                return found
            more = ~done
            todo, keys, tags, start = todo[more], keys[more], tags[more], start[more] + WINDOW

    def get(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key, -1 where absent (int64 ``[len(keys)]``; ``keys`` uint64)."""
        if not len(keys):
            return np.zeros(0, dtype=np.int64)
        start = (keys & self._mask).view(np.int64)
        # most keys are settled at their home position (a hit, or empty: absent); a held
        # entry matches exactly when the key filed with its value is the key (no tag step)
        home = self.entries[start]
        out = home & _MASK_VALUE  # (garbage where not held: replaced below)
        hit = home >= 0
        hit &= self.key_of_value.take(out, mode="clip") == keys
        if np.count_nonzero(hit) == len(hit):  # (count_nonzero: cheaper than all() on bools)
            return out
        miss = ~hit
        out[miss] = -1
        rest = home != EMPTY  # the probe run goes on
        rest &= miss
        if np.count_nonzero(rest):
            [todo] = rest.nonzero()
            pos = self._scan(keys[todo], start[todo] + 1)
            held = pos >= 0
            out[todo[held]] = self.entries[pos[held]] & _MASK_VALUE
        return out

    def get_one(self, key: int) -> int:
        """:meth:`get` of one key (a Python loop: cheaper than numpy calls for one key; it
        reads through memoryviews, which give Python ints four times faster than indexing)."""
        mask, entries, key_of_value = self._int_mask, self._entries_view, self._key_view
        pos = key & mask
        while True:
            entry = entries[pos]
            if entry == EMPTY:
                return -1
            # (no tag test: a held entry's key is read at once, cheaper in Python)
            if entry >= 0 and key_of_value[entry & _VALUE_MASK] == key:
                return entry & _VALUE_MASK
            pos = (pos + 1) & mask

    # ----------------------------------------------------------------- insertion
    def insert_one(self, key: int, value: int) -> None:
        """:meth:`insert` of one key that is not held."""
        if 2 * (self.num_keys + self._num_deleted + 1) > len(self.entries):
            self._rebuild(1)
        mask, entries = self._int_mask, self._entries_view
        pos = key & mask
        while entries[pos] >= 0:
            pos = (pos + 1) & mask
        if entries[pos] == DELETED:
            self._num_deleted -= 1
        entries[pos] = (key >> _TAG_SHIFT) << _VALUE_BITS | value
        self._key_view[value] = key
        self.where[value] = pos
        self.num_keys += 1

    def insert_absent(self, keys: np.ndarray, values: np.ndarray) -> bool:
        """File ``keys`` if none is held and none repeats (return True); else change nothing
        and return False.

        One windowed pass: a key is absent when its probe run reaches an empty position
        without it, and it goes to the first free position of that run (keys of this call
        wanting one position: one of them gets it, the others are filed one by one).
        """
        n = len(keys)
        if not n:
            return True
        if 2 * (self.num_keys + self._num_deleted + n) > len(self.entries):
            self._rebuild(n)
        entries = self.entries
        cand = (keys & self._mask).view(np.int64)  # where each key goes: its home first
        old = entries[cand]
        new = (keys >> _S_TAG).view(np.int64)  # the tags, then shifted: the entries' high half
        new <<= _S_VALUE
        # (nonzero of a 1-D array: one C call, flatnonzero is several in Python)
        [busy] = (old != EMPTY).nonzero()
        if len(busy) and not self._first_free(keys, new, busy, cand, old):
            return False  # a key is held
        new |= values
        # of several keys wanting one position, one write survives
        entries[cand] = new
        won = entries[cand] == new
        if np.count_nonzero(won) == n:
            self.key_of_value[values] = keys
            self._placed(cand, values, old)
            return True
        [lost] = (~won).nonzero()
        wvalues = values[won]
        old_keys = self.key_of_value[wvalues]
        self.key_of_value[wvalues] = keys[won]
        lost_keys = keys[lost]
        winner_keys = self.key_of_value[entries[cand[lost]] & _MASK_VALUE]
        if (winner_keys == lost_keys).any() or _repeats(lost_keys):  # a key given twice
            entries[cand] = old  # undo
            self.key_of_value[wvalues] = old_keys
            return False
        self._placed(cand[won], wvalues, old[won])
        for key, value in zip(lost_keys.tolist(), values[lost].tolist()):
            self.insert_one(key, value)  # absent and distinct, so filed one by one
        return True

    def _first_free(
        self,
        keys: np.ndarray,
        high: np.ndarray,
        busy: np.ndarray,
        cand: np.ndarray,
        old: np.ndarray,
    ) -> bool:
        """For the keys ``busy`` (indices into ``keys``; ``high``: their entries' high half,
        the tag shifted) whose home is taken: False if one is held; else set ``cand`` to the
        first free position of its probe run (``old``: what that position holds), scanning
        window after window until the run's empty position.

        A key's 8 flags of a window are one uint64 word (a bool row read as such), so "any
        in the window" is one comparison, not a reduction along the rows.
        """
        mask = self._int_mask
        entries = self.entries
        todo, start = busy, cand[busy]
        found = None  # a free position was seen (after the first window)
        while True:
            # (a take wrapping around the table: the positions masked by the gather itself)
            v = entries.take(start[:, None] + _OFFSETS, mode="wrap")
            # a key sits only in its own run, so a match anywhere in the window means held
            # (a free position's high half is negative, never a tag's)
            same = (v & _HIGH) == high[todo][:, None]
            if np.count_nonzero(same):
                rows, cols = np.nonzero(same)
                filed = self.key_of_value[v[rows, cols] & _MASK_VALUE]
                if (filed == keys[todo[rows]]).any():
                    return False
            ends = (v == EMPTY).view(_U64)[:, 0]  # nonzero: the run ends in this window
            free = v < 0
            first = start + free.argmax(axis=1)  # (where a window has no free position: junk)
            first &= mask
            if found is None and np.count_nonzero(ends) == len(todo):
                # usually: every run ends in its first window
                cand[todo] = first
                old[todo] = entries[first]
                return True
            more = ends == 0  # the run goes on past this window
            num_more = np.count_nonzero(more)
            new = _any_per_row(free)
            if found is not None:
                new &= ~found[todo]
            first = first[new]
            cand[todo[new]] = first
            old[todo[new]] = entries[first]
            if not num_more:
                return True
            if found is None:
                found = np.zeros(len(keys), dtype=bool)
            found[todo[new]] = True
            todo, start = todo[more], start[more] + WINDOW

    def _placed(self, pos: np.ndarray, values: np.ndarray, old: np.ndarray) -> None:
        """Bookkeeping of keys just written at ``pos`` (``old``: what each position held)."""
        self.where[values] = pos
        self.num_keys += len(pos)
        if self._num_deleted:
            self._num_deleted -= int(np.count_nonzero(old == DELETED))

    def delete_values(self, values: np.ndarray) -> None:
        """Remove the keys holding these values (every one must be held); no probing."""
        self._delete_at(self.where[values])

    def _delete_at(self, pos: np.ndarray) -> None:
        # no probe passes a position followed by an empty one: it can become empty itself
        last = self.entries.take(pos + 1, mode="wrap") == EMPTY  # (wrap: the mask, in the take)
        self.entries[pos] = last - 2  # EMPTY (-1) where last, else DELETED (-2)
        self.num_keys -= len(pos)
        self._num_deleted += len(pos) - int(np.count_nonzero(last))

    def clear(self) -> None:
        self.entries[:] = EMPTY
        self.num_keys = self._num_deleted = 0

    def _rebuild(self, extra: int) -> None:
        """Drop tombstones (and grow when the keys alone would fill 1/SPREAD of the table)."""
        values = self.entries[self.entries >= 0] & _MASK_VALUE
        keys = self.key_of_value[values]
        capacity = len(self.entries)
        while SPREAD * (len(keys) + extra) > capacity:
            capacity *= 2
        self._alloc(capacity)
        self.num_keys = self._num_deleted = 0
        self.insert_absent(keys, values)  # (distinct, and the table is empty)

    def __getstate__(self) -> dict[str, object]:  # memoryviews do not pickle or copy
        state = dict(self.__dict__)
        del state["_entries_view"], state["_key_view"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._views()

    def _alloc(self, capacity: int) -> None:
        self.entries = np.full(capacity, EMPTY, dtype=np.int64)
        self._mask = _U64(capacity - 1)
        self._int_mask = capacity - 1
        self._views()

    def _views(self) -> None:
        """Memoryviews of the entries and keys, read as Python ints by the scalar paths."""
        self._entries_view, self._key_view = self.entries.data, self.key_of_value.data
