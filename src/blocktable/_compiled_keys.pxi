# The prefix index's map from block keys to record slots: open addressing, linear probing.
#
# Included by _compiled.pyx. The readable twin is blocktable.key_table.DictKeyTable (a dict);
# the tests run both through the same random operations and compare them after every one.

from libc.stdint cimport uint64_t
from libc.string cimport memset

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define BT_PREFETCH(address) __builtin_prefetch(address)
    #else
    #define BT_PREFETCH(address) ((void)0)
    #endif
    """
    void BT_PREFETCH(const void* address) noexcept nogil

cdef enum:
    _PREFETCH_AHEAD = 12  # keys whose first positions are fetched while earlier ones are probed
    _POSITIONS_PER_LINE = 4  # 16-byte positions in a 64-byte cache line
    _EMPTY = -1  # a free position's value; values filed are >= 0
    _MIN_POSITIONS = 64


cdef inline const uint64_t[::1] _uint64_in(object value, str name) except *:
    if value is None:  # (a memoryview would take None as an empty array)
        raise TypeError(f"{name} must be an array, got None")
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(f"{name} must be a C-contiguous 1-D native uint64 array: {exc}") from None


cdef class KeyTable:
    """A map from uint64 keys to int64 values >= 0 (the prefix index's record slots).

    Open addressing with linear probing over arrays of a power-of-two size, at most half full
    (it doubles before a call would fill more); a key's first position is the top bits of the
    key times an odd multiplier drawn at random per table, so keys chosen to share positions
    cannot be made without that number. Removal shifts the entries after a removed one back
    (no tombstones), so a lookup never reads past the first free position.

    Every call checks all its arguments before it changes anything, and a call that raises or
    returns False leaves the map as it was.
    """

    # position i: _entries[2 * i] holds the key (its bits), _entries[2 * i + 1] the value
    # (_EMPTY where free); side by side, so a probe reads one cache line, not two
    cdef int64_t[::1] _entries
    cdef Py_ssize_t _positions
    cdef Py_ssize_t _count
    cdef uint64_t _mask
    cdef int _shift  # 64 - log2(positions)
    cdef readonly uint64_t multiplier

    def __init__(self, Py_ssize_t capacity=0, uint64_t multiplier=0):
        """An empty map with room for ``capacity`` keys before it grows; ``multiplier`` (odd;
        0: drawn at random) fixes the probe order, for reproducing a run."""
        if capacity < 0 or capacity > (<Py_ssize_t>1 << 40):
            raise ValueError(f"capacity must be in [0, 2**40], got {capacity}")
        if multiplier == 0:
            import os
            multiplier = int.from_bytes(os.urandom(8), "little")
        self.multiplier = multiplier | 1
        self._allocate(_positions_for(capacity))

    cdef void _allocate(self, Py_ssize_t positions) except *:
        cdef cvarray entries = cvarray(shape=(2 * positions,), itemsize=8, format="q")
        self._entries = entries
        memset(&self._entries[0], 0xFF, 2 * positions * 8)  # every value _EMPTY (-1)
        self._positions = positions
        self._count = 0
        self._mask = <uint64_t>(positions - 1)
        self._shift = 64 - _log2(positions)

    cdef inline Py_ssize_t _home(self, uint64_t key) noexcept:
        return <Py_ssize_t>((key * self.multiplier) >> self._shift)

    cdef inline void _prefetch(self, const uint64_t[::1] keys, Py_ssize_t i) noexcept:
        """Start reading the first position of ``keys[i]`` and the cache line after it (hints;
        nothing if past the end): a probe reads on to the first free position, often past
        the first line, and stalls there when that line was not fetched ahead."""
        cdef Py_ssize_t home
        if i < keys.shape[0]:
            home = self._home(keys[i])
            BT_PREFETCH(&self._entries[2 * home])
            BT_PREFETCH(&self._entries[2 * ((home + _POSITIONS_PER_LINE) & <Py_ssize_t>self._mask)])

    cdef inline Py_ssize_t _position(self, uint64_t key) noexcept:
        """Where ``key`` is, or -1."""
        cdef Py_ssize_t i = self._home(key)
        cdef uint64_t mask = self._mask
        while self._entries[2 * i + 1] != _EMPTY:
            if <uint64_t>self._entries[2 * i] == key:
                return i
            i = <Py_ssize_t>((<uint64_t>i + 1) & mask)
        return -1

    cdef inline bint _put_absent(self, uint64_t key, int64_t value) noexcept:
        """File ``key`` (room checked by the caller); False if it is filed already."""
        cdef Py_ssize_t i = self._home(key)
        cdef uint64_t mask = self._mask
        while self._entries[2 * i + 1] != _EMPTY:
            if <uint64_t>self._entries[2 * i] == key:
                return False
            i = <Py_ssize_t>((<uint64_t>i + 1) & mask)
        self._entries[2 * i] = <int64_t>key
        self._entries[2 * i + 1] = value
        self._count += 1
        return True

    cdef void _remove_at(self, Py_ssize_t i) noexcept:
        """Free position ``i`` (occupied), moving back the entries of its run that may move."""
        cdef uint64_t mask = self._mask
        cdef Py_ssize_t j = i
        cdef uint64_t home
        while True:
            j = <Py_ssize_t>((<uint64_t>j + 1) & mask)
            if self._entries[2 * j + 1] == _EMPTY:
                break
            home = <uint64_t>self._home(<uint64_t>self._entries[2 * j])
            # the entry at j may move back to i when i lies on its probe path (home .. j)
            if ((<uint64_t>j - home) & mask) >= ((<uint64_t>j - <uint64_t>i) & mask):
                self._entries[2 * i] = self._entries[2 * j]
                self._entries[2 * i + 1] = self._entries[2 * j + 1]
                i = j
        self._entries[2 * i + 1] = _EMPTY
        self._count -= 1

    cdef void _reserve(self, Py_ssize_t more) except *:
        """Grow (rehashing every entry) so that ``more`` further keys keep it half full."""
        if more > (<Py_ssize_t>1 << 40):
            raise ValueError(f"cannot file {more} keys at once")
        cdef Py_ssize_t want = _positions_for(self._count + more)
        if want <= self._positions:
            return
        cdef int64_t[::1] old = self._entries
        cdef Py_ssize_t i
        self._allocate(want)
        for i in range(old.shape[0] // 2):
            if old[2 * i + 1] != _EMPTY:
                self._put_absent(<uint64_t>old[2 * i], old[2 * i + 1])

    def __len__(self):
        return self._count

    def get(self, uint64_t key, int64_t default=-1):
        """The value of ``key``, else ``default``."""
        cdef Py_ssize_t i = self._position(key)
        return default if i < 0 else self._entries[2 * i + 1]

    def find(self, object keys, object out):
        """``out[i]`` = the value of ``keys[i]`` (uint64 ``[n]``), -1 where absent (``out``:
        int64 ``[n]``, writable, not overlapping ``keys``)."""
        cdef const uint64_t[::1] k = _uint64_in(keys, "keys")
        cdef int64_t[::1] o = _int64_out(out, "out")
        cdef Py_ssize_t n = k.shape[0], i, at
        if o.shape[0] != n:
            raise ValueError(f"out has {o.shape[0]} entries, keys {n}")
        if n == 0:
            return
        if _overlap(&k[0], n * 8, &o[0], n * 8):
            raise ValueError("out must not overlap keys")
        for i in range(min(n, _PREFETCH_AHEAD)):
            self._prefetch(k, i)
        for i in range(n):
            self._prefetch(k, i + _PREFETCH_AHEAD)
            at = self._position(k[i])
            o[i] = -1 if at < 0 else self._entries[2 * at + 1]

    def insert_absent(self, object keys, object values):
        """File ``keys[i]`` (uint64 ``[n]``) with ``values[i]`` (int64 ``[n]``, >= 0) and
        return True when no key is filed yet and none repeats; else change nothing and
        return False."""
        cdef const uint64_t[::1] k = _uint64_in(keys, "keys")
        cdef const int64_t[::1] v = _int64_in(values, "values")
        cdef Py_ssize_t n = k.shape[0], i, j
        if v.shape[0] != n:
            raise ValueError(f"values has {v.shape[0]} entries, keys {n}")
        for i in range(n):
            if v[i] < 0:
                raise ValueError(f"values[{i}] is {v[i]}, values must be >= 0")
        self._reserve(n)
        for i in range(min(n, _PREFETCH_AHEAD)):
            self._prefetch(k, i)
        for i in range(n):
            self._prefetch(k, i + _PREFETCH_AHEAD)
            if not self._put_absent(k[i], v[i]):
                for j in range(i):  # undo: the keys filed by this call
                    self._remove_at(self._position(k[j]))
                return False
        return True

    def insert(self, uint64_t key, int64_t value):
        """File ``key`` (not filed yet) with ``value`` (>= 0)."""
        if value < 0:
            raise ValueError(f"value must be >= 0, got {value}")
        if self._position(key) >= 0:
            raise KeyError(f"key {key} is filed already")
        self._reserve(1)
        self._put_absent(key, value)

    def remove(self, object keys):
        """Remove ``keys`` (uint64 ``[n]``, each filed, distinct); ``KeyError`` naming the first
        that is not (nothing removed then)."""
        cdef const uint64_t[::1] k = _uint64_in(keys, "keys")
        cdef Py_ssize_t n = k.shape[0], i, j, at
        if n == 0:
            return
        # One pass: each key's entry is removed where it is found, its value kept; a key not
        # found (never filed, or a repeat of one removed above) first files the removed ones
        # again with their values, so the map is as it was.
        cdef int64_t[::1] removed = cvarray(shape=(n,), itemsize=8, format="q")
        for i in range(min(n, _PREFETCH_AHEAD)):
            self._prefetch(k, i)
        for i in range(n):
            self._prefetch(k, i + _PREFETCH_AHEAD)
            at = self._position(k[i])
            if at < 0:
                what = "not filed"
                for j in range(i):  # (room: as many keys were removed just above)
                    if k[j] == k[i]:
                        what = "repeated"
                    self._put_absent(k[j], removed[j])
                raise KeyError(f"keys[{i}] ({k[i]}) is {what}")
            removed[i] = self._entries[2 * at + 1]
            self._remove_at(at)

    def clear(self):
        """Remove every key."""
        self._allocate(_MIN_POSITIONS)

    def items(self):
        """Every key and its value, as two lists in the same (unspecified) order."""
        keys, values = [], []
        cdef Py_ssize_t i
        for i in range(self._positions):
            if self._entries[2 * i + 1] != _EMPTY:
                keys.append(<uint64_t>self._entries[2 * i])
                values.append(self._entries[2 * i + 1])
        return keys, values

    def __reduce__(self):
        keys, values = self.items()
        return _key_table_from_items, (keys, values, self.multiplier)


def _key_table_from_items(list keys, list values, uint64_t multiplier):
    """A :class:`KeyTable` holding ``keys`` -> ``values`` (for pickling and copying)."""
    table = KeyTable(len(keys), multiplier)
    cdef Py_ssize_t i
    for i in range(len(keys)):
        table.insert(keys[i], values[i])
    return table


cdef inline int _log2(Py_ssize_t n) noexcept:
    cdef int bits = 0
    while (<Py_ssize_t>1 << bits) < n:
        bits += 1
    return bits


cdef inline Py_ssize_t _positions_for(Py_ssize_t count) noexcept:
    """The power of two that holds ``count`` keys at most half full (at least 64)."""
    cdef Py_ssize_t positions = _MIN_POSITIONS
    while positions < 2 * count:
        positions *= 2
    return positions
