"""A hash table from 64-bit block keys to record slots, looked up and filled with numpy.

A Python dict pays a dependent cache miss and a Python int per key, three times per newly
cached block (is it new, insert, and later delete when its record is recycled). This table is
two flat arrays probed linearly for all keys of a call at once: one gather reads a window of
``WINDOW`` positions per key, so the cache misses of a call overlap. Checking that new keys
are absent and filing them is one such pass (:meth:`KeyTable.insert_absent`), and a value's
position is remembered (values are distinct record slots), so deleting by value probes
nothing.

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
WINDOW = 8  # positions probed per gather (8: a window's bool flags are one uint64 word)
_OFFSETS = np.arange(WINDOW)
_FEW = 32  # runs past the first window scanned on in Python rather than in another pass
_U64 = np.uint64


def _any_per_row(flags: np.ndarray) -> np.ndarray:
    """Per row of a C-contiguous bool ``[n, 8]``, whether any is set (one comparison on the
    rows read as uint64 words: a reduction along short rows costs several times more)."""
    return flags.view(_U64)[:, 0] != 0


class KeyTable:
    """Distinct uint64 keys -> distinct int64 values in ``[0, num_values)``, on cpu.

    Parameters
    ----------
    max_keys : int
        The most keys held at once (the capacity is ``>= 4 * max_keys``).
    num_values : int, optional
        Values are below this (default ``max_keys``).
    """

    def __init__(self, max_keys: int, num_values: int | None = None) -> None:
        capacity = 1 << max(4, (4 * max(max_keys, 1) - 1).bit_length())
        self._mask = _U64(capacity - 1)
        self._alloc(capacity)
        # value -> its position (meaningful for held values only)
        self.where = np.zeros(max(max_keys, 1) if num_values is None else num_values, np.int64)
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
        start = (keys & self._mask).view(np.int64)
        # most keys are settled at their home position (a hit, or empty: absent)
        v = self.values[start]
        hit = (v >= 0) & (self.keys[start] == keys)
        found[hit] = start[hit]
        rest = ~hit & (v != EMPTY)
        if not rest.any():
            return found
        todo = np.flatnonzero(rest)
        found[todo] = self._probe(keys[todo], start[todo] + 1)
        return found

    def _probe(self, keys: np.ndarray, start: np.ndarray) -> np.ndarray:
        """Where each key sits, -1 where absent, probing from ``start`` (int64) on."""
        mask = int(self._mask)
        found = np.full(len(keys), -1, dtype=np.int64)
        todo = np.arange(len(keys))
        while True:
            pos = (start[:, None] + _OFFSETS) & mask
            v = self.values[pos]
            hit = (v >= 0) & (self.keys[pos] == keys[todo, None])
            stop = hit | (v == EMPTY)
            at = stop.argmax(axis=1)
            rows = np.arange(len(todo))
            done = stop[rows, at]
            found_here = done & hit[rows, at]
            found[todo[found_here]] = pos[rows, at][found_here]
            if done.all():
                return found
            todo, start = todo[~done], start[~done] + WINDOW

    def get(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key, -1 where absent (int64 ``[len(keys)]``)."""
        if not len(keys):
            return np.zeros(0, dtype=np.int64)
        start = (keys & self._mask).view(np.int64)
        # most keys are settled at their home position (a hit, or empty: absent)
        out = self.values[start]
        hit = self.keys[start] == keys
        hit &= out >= 0
        if hit.all():
            return out
        rest = out != EMPTY  # the probe run goes on
        miss = ~hit
        out[miss] = -1
        rest &= miss
        if rest.any():
            todo = np.flatnonzero(rest)
            pos = self._probe(keys[todo], start[todo] + 1)
            found = pos >= 0
            out[todo[found]] = self.values[pos[found]]
        return out

    def get_one(self, key: int) -> int:
        """:meth:`get` of one key (a Python loop: cheaper than numpy calls for one key; it
        reads through memoryviews, which give Python ints four times faster than indexing)."""
        mask, values, keys = self._int_mask, self._values_view, self._keys_view
        pos = key & mask
        while True:
            value = values[pos]
            if value == EMPTY:
                return -1
            if value >= 0 and keys[pos] == key:
                return value
            pos = (pos + 1) & mask

    def insert_one(self, key: int, value: int) -> None:
        """:meth:`insert` of one key that is not held."""
        if 2 * (self.num_keys + self._num_deleted + 1) > len(self.values):
            self._rebuild(1)
        mask, values = self._int_mask, self.values
        view = self._values_view
        pos = key & mask
        while view[pos] >= 0:
            pos = (pos + 1) & mask
        if view[pos] == DELETED:
            self._num_deleted -= 1
        self.keys[pos] = key
        values[pos] = value
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
        if 2 * (self.num_keys + self._num_deleted + n) > len(self.values):
            self._rebuild(n)
        tkeys, tvalues = self.keys, self.values
        cand = (keys & self._mask).view(np.int64)  # where each key goes: its home first
        old = tvalues[cand]
        busy = np.flatnonzero(old != EMPTY)
        if len(busy) and not self._first_free(keys, busy, cand, old):
            return False  # a key is held
        # of several keys wanting one position, one write survives
        tvalues[cand] = values
        won = tvalues[cand] == values
        if won.all():
            tkeys[cand] = keys
            self._placed(cand, values, old)
            return True
        lost = np.flatnonzero(~won)
        wpos = cand[won]
        tkeys[wpos] = keys[won]
        lost_keys = keys[lost]
        if (tkeys[cand[lost]] == lost_keys).any() or _repeats(lost_keys):
            tvalues[wpos] = old[won]  # a key given twice: undo
            return False
        self._placed(wpos, values[won], old[won])
        for key, value in zip(lost_keys.tolist(), values[lost].tolist()):
            self.insert_one(key, value)  # absent and distinct, so filed one by one
        return True

    def _first_free(
        self, keys: np.ndarray, busy: np.ndarray, cand: np.ndarray, old: np.ndarray
    ) -> bool:
        """For the keys ``busy`` (indices into ``keys``) whose home is taken: False if one is
        held; else set ``cand`` to the first free position of its probe run (``old``: what
        that position holds), scanning window after window until the run's empty position.

        A key's 8 flags of a window are one uint64 word (a bool row read as such), so "any
        in the window" is one comparison, not a reduction along the rows.
        """
        mask = int(self._mask)
        tkeys, tvalues = self.keys, self.values
        todo, start = busy, cand[busy]
        found = None  # a free position was seen (after the first window)
        while True:
            pos = start[:, None] + _OFFSETS
            pos &= mask
            v = tvalues[pos]
            # a key sits only in its own run, so a match anywhere in the window means held
            # (a match at a free position is a stale key: keys stay when deleted)
            same = tkeys[pos] == keys[todo, None]
            if same.any() and (same & (v >= 0)).any():
                return False
            free = v < 0
            at = free.argmax(axis=1)
            new = _any_per_row(free)
            if found is not None:
                new &= ~found[todo]
            first = start + at
            first &= mask
            if new.all():  # usually: every run of the first window has a free position
                cand[todo] = first
                old[todo] = tvalues[first]
            else:
                first = first[new]
                cand[todo[new]] = first
                old[todo[new]] = tvalues[first]
            more = (v == EMPTY).view(_U64)[:, 0] == 0  # the run goes on past this window
            num_more = np.count_nonzero(more)
            if not num_more:
                return True
            if found is None and num_more <= _FEW:
                # a few long runs: scanned on one by one (another pass costs more)
                return self._first_free_rest(keys, todo, start, new, more, cand, old)
            if found is None:
                found = np.zeros(len(keys), dtype=bool)
            found[todo[new]] = True
            todo, start = todo[more], start[more] + WINDOW

    def _first_free_rest(
        self,
        keys: np.ndarray,
        todo: np.ndarray,
        start: np.ndarray,
        new: np.ndarray,
        more: np.ndarray,
        cand: np.ndarray,
        old: np.ndarray,
    ) -> bool:
        """:meth:`_first_free` of the runs ``more`` (of ``todo``, probed from ``start`` on,
        ``new``: a free position was found in the first window) past their first window, in
        Python ints."""
        mask = int(self._mask)
        values, tkeys = self._values_view, self._keys_view
        for i in np.flatnonzero(more).tolist():
            k = int(todo[i])
            key = keys.item(k)
            have_free = bool(new[i])
            pos = (int(start[i]) + WINDOW) & mask
            while True:
                value = values[pos]
                if value == EMPTY:
                    if not have_free:
                        cand[k], old[k] = pos, EMPTY
                    break
                if value >= 0:
                    if tkeys[pos] == key:
                        return False
                elif not have_free:  # a tombstone: the first free position
                    cand[k], old[k] = pos, DELETED
                    have_free = True
                pos = (pos + 1) & mask
        return True

    def _placed(self, pos: np.ndarray, values: np.ndarray, old: np.ndarray) -> None:
        """Bookkeeping of keys just written at ``pos`` (``old``: what each position held)."""
        self.where[values] = pos
        self.num_keys += len(pos)
        if self._num_deleted:
            self._num_deleted -= int(np.count_nonzero(old == DELETED))

    def insert(self, keys: np.ndarray, values: np.ndarray) -> None:
        """File distinct keys that are not held yet."""
        n = len(keys)
        if not n:
            return
        if 2 * (self.num_keys + self._num_deleted + n) > len(self.values):
            self._rebuild(n)
        tkeys, tvalues, mask = self.keys, self.values, int(self._mask)
        start = (keys & self._mask).view(np.int64)
        # most keys find their home position free: of several keys wanting one position, the
        # last write wins, and the keys whose write survived are placed
        home = np.flatnonzero(tvalues[start] < 0)
        hpos = start[home]
        tkeys[hpos] = keys[home]
        won = tkeys[hpos] == keys[home]
        wpos = hpos[won]
        self._num_deleted -= int(np.count_nonzero(tvalues[wpos] == DELETED))
        tvalues[wpos] = values[home[won]]
        self.where[values[home[won]]] = wpos
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
            self.where[values[todo[winners]]] = wpos
            placed = np.zeros(len(todo), dtype=bool)
            placed[winners] = True
            # losers retry from the same start (that position is taken now); full windows
            # move on
            start = np.where(has, start, start + WINDOW)[~placed]
            todo = todo[~placed]
        self.num_keys += n

    def delete(self, keys: np.ndarray) -> None:
        """Remove held keys (every one must be held)."""
        self._delete_at(self._positions(keys))

    def delete_values(self, values: np.ndarray) -> None:
        """Remove the keys holding these values (every one must be held); no probing."""
        self._delete_at(self.where[values])

    def _delete_at(self, pos: np.ndarray) -> None:
        # no probe passes a position followed by an empty one: it can become empty itself
        last = self.values[(pos + 1) & int(self._mask)] == EMPTY
        self.values[pos] = np.where(last, EMPTY, DELETED)
        self.num_keys -= len(pos)
        self._num_deleted += len(pos) - int(np.count_nonzero(last))

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
        self._alloc(capacity)
        self.num_keys = self._num_deleted = 0
        self.insert(keys, values)

    def __getstate__(self) -> dict[str, object]:  # memoryviews do not pickle or copy
        state = dict(self.__dict__)
        del state["_keys_view"], state["_values_view"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._keys_view, self._values_view = self.keys.data, self.values.data

    def _alloc(self, capacity: int) -> None:
        # A position's key and value share a cache line (one array of pairs, two strided
        # views), so a probe or an insert touches one line per position, not two.
        pairs = np.empty((capacity, 2), dtype=np.int64)
        pairs[:, 0] = 0
        pairs[:, 1] = EMPTY
        self.keys = pairs[:, 0].view(_U64)  # key at each position
        self.values = pairs[:, 1]  # value, EMPTY or DELETED
        # the same, read as Python ints by the scalar paths
        self._keys_view, self._values_view = self.keys.data, self.values.data
        self._int_mask = capacity - 1
