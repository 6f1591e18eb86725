# A commit's pairs: the table's changes drained into a staging buffer (included by _compiled.pyx).

cdef class PairStager:
    """A table's changes, bound once: gathers a commit's ``(flat index, value)`` pairs into a
    staging buffer and resets the changes; the compiled twin of
    :func:`blocktable._host_loops.fill_staging`.

    The bound arrays: ``journal`` (int64 ``[capacity, 2]``, the written runs: start, length)
    and ``host`` (int32 ``[num_entries]``, the flat host table), read only; ``journal_len``
    (int64 ``[2]``: runs, indices; -1 runs after an overflow) and ``dirty`` (uint8, the flat
    ``[groups, rows]`` dirty rows), written. The counts start at ``counts_offset`` of ``host``.
    All C-contiguous, native, and overlapping no other.
    """

    cdef const int64_t[:, ::1] jour
    cdef int64_t[::1] jlen
    cdef unsigned char[::1] dirt
    cdef const int32_t[::1] src
    cdef int64_t counts_offset
    cdef uintptr_t bound_start[4]  # the bound arrays' memory: (first byte, size in bytes)
    cdef Py_ssize_t bound_bytes[4]
    cdef bint bound  # __init__ completed (once)

    def __init__(self, object journal, object journal_len, object dirty, int64_t counts_offset,
                 object host):
        _bound_once(self.bound, "PairStager")
        if journal is None or dirty is None:
            raise TypeError("journal and dirty must be arrays, got None")
        try:
            self.jour = journal
            self.dirt = dirty
        except (ValueError, TypeError, BufferError) as exc:
            raise TypeError("journal must be a C-contiguous int64 [capacity, 2] array and dirty "
                            f"a writable uint8 array: {exc}") from None
        self.jlen = _int64_out(journal_len, "journal_len")
        self.src = _int32_in(host, "host")
        if self.jour.shape[1] != 2 or self.jlen.shape[0] != 2:
            raise ValueError("journal must be [capacity, 2] and journal_len [2]")
        cdef Py_ssize_t num_entries = self.src.shape[0], num_dirty = self.dirt.shape[0]
        if counts_offset < 0 or counts_offset > num_entries or \
                num_dirty > num_entries - counts_offset:
            raise ValueError(f"the counts [{counts_offset}, +{num_dirty}) lie outside host's "
                             f"{num_entries} entries")
        self.counts_offset = counts_offset
        spans = [
            (<uintptr_t>(&self.jour[0, 0]) if self.jour.shape[0] else 0, self.jour.shape[0] * 16),
            (<uintptr_t>(&self.jlen[0]), 16),
            (<uintptr_t>(&self.dirt[0]) if num_dirty else 0, num_dirty),
            (<uintptr_t>(&self.src[0]) if num_entries else 0, num_entries * 4)]
        cdef int i
        for i in range(4):
            self.bound_start[i], self.bound_bytes[i] = spans[i]
        for i in range(4):
            if _overlaps_any(self.bound_start[i], self.bound_bytes[i], self.bound_start,
                             self.bound_bytes, 4, i):
                raise ValueError("the bound arrays overlap")
        self.bound = True

    def fill(self, object staging, int64_t capacity):
        """Gather the pairs into ``staging`` (int32, writable, at least ``1 + 2 * capacity``
        entries: word 0 the number of pairs, then their flat indices, then their values) and
        reset the changes. Returns the number of pairs, or -1 (nothing written or reset) when
        they exceed ``capacity`` or the journal overflowed."""
        _check_bound(self.bound, "PairStager")
        cdef int32_t[::1] out = self._staging(staging, capacity)  # (held while filled)
        return self._fill(&out[0], out.shape[0], capacity)

    cdef int32_t[::1] _staging(self, object staging, int64_t capacity) except *:
        """``staging`` as a writable view, checked: room for ``capacity`` pairs and a header,
        overlapping no bound array."""
        cdef int32_t[::1] out
        if staging is None:  # (a memoryview would take None as an empty array)
            raise TypeError("staging must be an array, got None")
        try:
            out = staging
        except (ValueError, TypeError, BufferError) as exc:
            raise TypeError(
                f"staging must be a writable C-contiguous 1-D native int32 array: {exc}") \
                from None
        _check_capacity(out.shape[0], capacity)
        if _overlaps_any(<uintptr_t>(&out[0]), out.shape[0] * 4,
                         self.bound_start, self.bound_bytes, 4, -1):
            raise ValueError("staging overlaps the bound arrays")
        return out

    cdef int64_t _fill(self, int32_t* out, Py_ssize_t out_len, int64_t capacity) except -2:
        """:meth:`fill` into the ``out_len`` entries at ``out``, a checked staging buffer
        (:meth:`_staging`) whose view the caller holds; ``capacity`` checked again.

        Indexes through first items without bounds checks, each index proven in range by a
        check above it: the pairs' count ``total <= capacity <= (out_len - 1) // 2``, every
        journal run inside ``host`` and below the journal's capacity, every dirty count's
        index below ``counts_offset + len(dirty) <= len(host)`` (checked at binding)."""
        _check_capacity(out_len, capacity)
        cdef Py_ssize_t num_runs = self.jour.shape[0], num_dirty = self.dirt.shape[0]
        cdef Py_ssize_t num_entries = self.src.shape[0]
        cdef const int64_t* jour = &self.jour[0, 0] if num_runs else NULL
        cdef int64_t* jlen = &self.jlen[0]
        cdef unsigned char* dirt = &self.dirt[0] if num_dirty else NULL
        cdef const int32_t* src = &self.src[0] if num_entries else NULL
        cdef int64_t runs = jlen[0], num_indices = jlen[1], total, r, q, start, length
        cdef Py_ssize_t i, at = 0
        if runs < 0:
            return -1
        if runs > num_runs or num_indices < 0:
            raise ValueError(f"journal_len={runs, num_indices} does not describe journal")
        total = num_indices
        for i in range(num_dirty):
            total += dirt[i] != 0
        if total > capacity:
            return -1
        for r in range(runs):  # every run inside host, and the lengths adding up, before writing
            start, length = jour[2 * r], jour[2 * r + 1]
            if start < 0 or length < 0 or start > num_entries or length > num_entries - start:
                raise ValueError(f"journal run {r} [{start}, +{length}) lies outside host")
            at += length
        if at != num_indices:
            raise ValueError(f"journal runs hold {at} indices, journal_len says {num_indices}")
        at = 1  # (word 0: the number of pairs, written last)
        for r in range(runs):  # each index and its value (the index read from the journal
            start, length = jour[2 * r], jour[2 * r + 1]  # once, as checked above)
            for q in range(start, start + length):
                out[at] = <int32_t>q
                out[total + at] = src[q]
                at += 1
        for i in range(num_dirty):
            if dirt[i]:
                q = self.counts_offset + i
                out[at] = <int32_t>q
                out[total + at] = src[q]
                at += 1
                dirt[i] = 0
        out[0] = <int32_t>total
        jlen[0] = 0
        jlen[1] = 0
        return total


cdef int _check_capacity(Py_ssize_t staging_len, int64_t capacity) except -1:
    """Raise unless a staging buffer of ``staging_len`` entries holds a header word and
    ``capacity`` pairs (no overflow: the bound is computed from the length)."""
    if capacity < 0 or staging_len < 1 or capacity > (staging_len - 1) // 2:
        raise ValueError(f"capacity={capacity} needs staging of 1 + 2 * {capacity} entries, "
                         f"got {staging_len}")
    return 0
