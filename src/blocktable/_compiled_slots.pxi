# The slot mapping and the batch check (included by _compiled.pyx).

cdef class SlotMapper:
    """The slot mapping of every token-slot group of one table into its slot buffers, bound
    once: ``flat_table`` (int32 ``[num_entries]``, the tables then the counts), ``out`` (int64
    ``[num_groups, max_num_tokens]``, writable, overlapping no input) and each group's layout
    ``(table_offset, width, counts_offset, kernel_block_size, manager_block_size,
    cp_world_size, cp_rank, cp_interleave)``, all checked here against the buffers.

    :meth:`map` equals :func:`blocktable.slot_mapping.torch_impl.slot_mapping_numpy` bit for
    bit on every batch it accepts (the tests compare them on random inputs).

    Every map leaves each slot buffer ``PAD_SLOT_ID`` past the batch's tokens, as the numpy
    twin does, but rewrites only the tail the previous map filled: the mapper remembers, per
    group, how far its last map wrote slots. Whoever else writes ``out`` calls
    :meth:`mark_written` after, so that the next map pads to the end again.
    """

    cdef const int32_t[::1] table
    cdef int64_t[:, ::1] out
    cdef int64_t[:, ::1] layout
    cdef int64_t max_num_reqs
    cdef int64_t[::1] filled  # per group: entries of out past this are PAD_SLOT_ID

    def __init__(self, object flat_table, object out, list params, int64_t max_num_reqs):
        self.table = _int32_in(flat_table, "flat_table")
        if out is None:
            raise TypeError("out must be an array, got None")
        try:
            self.out = out
        except (ValueError, TypeError, BufferError) as exc:
            raise TypeError("out must be a writable C-contiguous 2-D native int64 array: "
                            f"{exc}") from None
        cdef Py_ssize_t num_entries = self.table.shape[0], g
        if self.out.shape[0] != len(params):
            raise ValueError(f"out has {self.out.shape[0]} rows for {len(params)} groups")
        if not 0 <= max_num_reqs <= INT32_MAX:
            raise ValueError(f"max_num_reqs={max_num_reqs} is outside [0, {INT32_MAX}]")
        self.max_num_reqs = max_num_reqs
        self.layout = _layout(params)
        for g in range(len(params)):
            _check_layout(self.layout[g], num_entries, max_num_reqs)
        self.filled = cvarray(shape=(max(len(params), 1),), itemsize=8, format="q")
        self.mark_written()
        if self.out.shape[0] and self.out.shape[1] and num_entries and _overlap(
                &self.out[0, 0], self.out.shape[0] * self.out.shape[1] * 8, &self.table[0],
                num_entries * 4):
            raise ValueError("out overlaps flat_table")

    def map(self, object query_start_loc, object positions, object row_of_batch):
        """Every group's slots of a batch, ``PAD_SLOT_ID`` past its tokens; return 0, or -1
        (nothing written) when ``query_start_loc`` (int32 ``[num_reqs + 1]``) is not well
        formed: it must start at 0, never decrease and end at ``len(positions)`` (int64).
        ``row_of_batch``: int32 ``[num_reqs]``, or ``None`` (request ``r`` reads row ``r``)."""
        cdef const int32_t[::1] qsl = _int32_in(query_start_loc, "query_start_loc")
        cdef const int64_t[::1] pos = _int64_in(positions, "positions")
        cdef const int32_t[::1] rows
        cdef bint indexed = row_of_batch is not None
        if indexed:
            rows = _int32_in(row_of_batch, "row_of_batch")
        cdef Py_ssize_t num_tokens = pos.shape[0], num_reqs = qsl.shape[0] - 1, r, g
        if num_reqs < 0:
            raise ValueError("query_start_loc must hold at least one entry")
        if indexed and rows.shape[0] != num_reqs:
            raise ValueError(f"row_of_batch has {rows.shape[0]} entries, query_start_loc "
                             f"describes {num_reqs} requests")
        cdef Py_ssize_t out_tokens = self.out.shape[1]
        if num_tokens > out_tokens:
            raise ValueError(f"positions holds {num_tokens} tokens, more than out's "
                             f"{out_tokens}")
        cdef Py_ssize_t out_bytes = self.out.shape[0] * out_tokens * 8
        if out_bytes and (
                _overlap(&self.out[0, 0], out_bytes, &qsl[0], (num_reqs + 1) * 4)
                or (num_tokens and _overlap(&self.out[0, 0], out_bytes, &pos[0],
                                            num_tokens * 8))
                or (indexed and num_reqs and
                    _overlap(&self.out[0, 0], out_bytes, &rows[0], num_reqs * 4))):
            raise ValueError("out overlaps an input array")
        if not _well_formed(qsl, num_tokens):
            return -1
        if not indexed:
            rows = qsl  # (not read: request r reads row r)
        self._map(qsl, pos, rows, indexed)
        return 0

    cdef int _map(self, const int32_t[::1] qsl, const int64_t[::1] pos,
                  const int32_t[::1] rows, bint indexed) except -1:
        """Every group's slots of a checked batch (``qsl`` well formed for ``pos``; ``rows``
        its requests' rows where ``indexed``, else request ``r`` reads row ``r``; overlapping
        no output). Views only: no Python object per call."""
        cdef Py_ssize_t g
        for g in range(self.out.shape[0]):
            _map_group(self.table, self.layout[g], self.max_num_reqs, qsl, pos, rows,
                       indexed, self.out[g], self.filled[g])
            self.filled[g] = pos.shape[0]  # (once written: were it to raise, the end stays)
        return 0

    def mark_written(self):
        """Say that ``out`` was written by someone else: the next map pads every slot buffer
        to its end."""
        cdef Py_ssize_t g
        for g in range(self.filled.shape[0]):
            self.filled[g] = self.out.shape[1]

    cdef bint _overlaps_out(self, const void* start, Py_ssize_t nbytes) noexcept:
        return self.out.shape[0] > 0 and self.out.shape[1] > 0 and _overlap(
            &self.out[0, 0], self.out.shape[0] * self.out.shape[1] * 8, start, nbytes)


cdef bint _well_formed(const int32_t[::1] qsl, Py_ssize_t num_tokens) noexcept:
    """Whether ``qsl`` (``[num_reqs + 1]``, at least one entry) starts at 0, never decreases
    and ends at ``num_tokens``."""
    cdef Py_ssize_t r, num_reqs = qsl.shape[0] - 1
    if qsl[0] != 0 or qsl[num_reqs] != num_tokens:
        return False
    for r in range(num_reqs):
        if qsl[r + 1] < qsl[r]:
            return False
    return True


# ---- the CPU backend's device work of a captured step ------------------------------------
cdef class HostLaunch:
    """The CPU backend's device work of one staging buffer of a captured step, bound once:
    what a CUDA graph replay does on an accelerator, reading the same buffer the same way.

    The bound arrays, read only: ``header_pairs`` (int32 ``[1 + 2 * max_pairs]``: the number
    of staged pairs ``n``, then their flat indices, then their values, packed: the values
    start at ``1 + n``), ``query_start_loc`` (int32 ``[max_num_reqs + 1]``, padded past the
    batch with ``num_tokens``), ``row_of_batch`` (int32 ``[max_num_reqs]``) and ``positions``
    (int64 ``[max_num_tokens]``). Written: ``device_table`` (int32 ``[num_entries]``, the CPU
    backend's device table) and the slot buffers of ``mapper`` (a :class:`SlotMapper` that
    reads ``device_table``; ``None``: no slot mapping). No read array may overlap a written
    one, nor the two written ones each other.
    """

    cdef const int32_t[::1] pairs
    cdef const int32_t[::1] qsl
    cdef const int32_t[::1] rows
    cdef const int64_t[::1] pos
    cdef int32_t[::1] table
    cdef SlotMapper mapper

    def __init__(self, object header_pairs, object query_start_loc, object row_of_batch,
                 object positions, object device_table, SlotMapper mapper):
        self.pairs = _int32_in(header_pairs, "header_pairs")
        self.qsl = _int32_in(query_start_loc, "query_start_loc")
        self.rows = _int32_in(row_of_batch, "row_of_batch")
        self.pos = _int64_in(positions, "positions")
        if device_table is None:
            raise TypeError("device_table must be an array, got None")
        try:
            self.table = device_table
        except (ValueError, TypeError, BufferError) as exc:
            raise TypeError("device_table must be a writable C-contiguous 1-D native int32 "
                            f"array: {exc}") from None
        self.mapper = mapper
        if self.pairs.shape[0] < 1 or self.pairs.shape[0] % 2 != 1:
            raise ValueError(f"header_pairs must hold 1 + 2 * max_pairs entries, got "
                             f"{self.pairs.shape[0]}")
        if self.qsl.shape[0] != self.rows.shape[0] + 1:
            raise ValueError(f"query_start_loc has {self.qsl.shape[0]} entries, not "
                             f"row_of_batch's {self.rows.shape[0]} + 1")
        cdef Py_ssize_t table_bytes = self.table.shape[0] * 4
        cdef const void* table_start = &self.table[0] if table_bytes else NULL
        cdef const void* starts[4]
        cdef Py_ssize_t sizes[4]
        starts[0], sizes[0] = &self.pairs[0], self.pairs.shape[0] * 4
        starts[1], sizes[1] = &self.qsl[0], self.qsl.shape[0] * 4
        starts[2], sizes[2] = (&self.rows[0] if self.rows.shape[0] else NULL,
                               self.rows.shape[0] * 4)
        starts[3], sizes[3] = (&self.pos[0] if self.pos.shape[0] else NULL,
                               self.pos.shape[0] * 8)
        cdef int i
        for i in range(4):
            if _overlap(starts[i], sizes[i], table_start, table_bytes) or (
                    mapper is not None and mapper._overlaps_out(starts[i], sizes[i])):
                raise ValueError("a read array overlaps device_table or the slot buffers")
        if mapper is not None and mapper._overlaps_out(table_start, table_bytes):
            raise ValueError("device_table overlaps the slot buffers")
        if mapper is not None and mapper.out.shape[1] < self.pos.shape[0]:
            raise ValueError(f"positions has {self.pos.shape[0]} entries, more than the slot "
                             f"buffers' {mapper.out.shape[1]}")

    def launch(self):
        """Scatter the staged pairs into ``device_table``, then map the slots of the batch
        (``num_tokens = query_start_loc[-1]``). Raises, with nothing written, unless the pair
        count lies in ``[0, max_pairs]``, every index in ``device_table`` and
        ``query_start_loc`` is well formed for at most ``max_num_tokens`` tokens."""
        cdef const int32_t[::1] pairs = self.pairs
        cdef int32_t[::1] table = self.table
        cdef int64_t n = pairs[0], num_entries = table.shape[0], idx
        cdef Py_ssize_t i
        if n < 0 or 2 * n + 1 > pairs.shape[0]:
            raise ValueError(f"the staged pair count {n} is outside [0, "
                             f"{(pairs.shape[0] - 1) // 2}]")
        for i in range(1, n + 1):
            idx = pairs[i]
            if idx < 0 or idx >= num_entries:
                raise ValueError(f"staged pair {i - 1} has index {idx}, outside [0, "
                                 f"{num_entries})")
        cdef int64_t num_tokens = self.qsl[self.qsl.shape[0] - 1]
        if self.mapper is not None and not (0 <= num_tokens <= self.pos.shape[0]
                                            and _well_formed(self.qsl, num_tokens)):
            raise ValueError("query_start_loc must start at 0, never decrease and end at "
                             f"num_tokens <= {self.pos.shape[0]}")
        for i in range(1, n + 1):
            table[pairs[i]] = pairs[n + i]
        if self.mapper is not None:
            self.mapper._map(self.qsl, self.pos[:num_tokens], self.rows, True)


cdef int64_t[:, ::1] _layout(list params) except *:
    """``params`` (one sequence of 8 integers per group) copied into an int64 array."""
    cdef cvarray copy = cvarray(shape=(max(len(params), 1), 8), itemsize=8, format="q")
    cdef int64_t[:, ::1] layout = copy
    cdef Py_ssize_t g, f
    for g in range(len(params)):
        if len(params[g]) != 8:
            raise ValueError(f"params[{g}] must hold 8 integers")
        for f in range(8):
            layout[g, f] = params[g][f]
    return layout


cdef int _check_layout(const int64_t[::1] p, Py_ssize_t num_entries,
                       int64_t max_num_reqs) except -1:
    cdef int64_t table_offset = p[0], width = p[1], counts_offset = p[2]
    cdef int64_t kernel_block_size = p[3], manager_block_size = p[4]
    cdef int64_t cp_world_size = p[5], cp_rank = p[6], cp_interleave = p[7]
    if not 1 <= width <= INT32_MAX:
        raise ValueError(f"width={width} is outside [1, {INT32_MAX}]")
    # max_num_reqs * width < 2**62: no overflow in the bounds below
    if table_offset < 0 or table_offset > num_entries or \
            max_num_reqs * width > num_entries - table_offset:
        raise ValueError(f"a group's table [{table_offset}, +{max_num_reqs} x {width}) lies "
                         f"outside flat_table's {num_entries} entries")
    if counts_offset < 0 or counts_offset > num_entries or \
            max_num_reqs > num_entries - counts_offset:
        raise ValueError(f"a group's counts [{counts_offset}, +{max_num_reqs}) lie outside "
                         f"flat_table's {num_entries} entries")
    if not 1 <= kernel_block_size <= INT32_MAX:
        raise ValueError(f"kernel_block_size={kernel_block_size} is outside [1, {INT32_MAX}]")
    if not kernel_block_size <= manager_block_size <= INT32_MAX or \
            manager_block_size % kernel_block_size:
        raise ValueError(f"manager_block_size={manager_block_size} must be a multiple of "
                         f"kernel_block_size={kernel_block_size}, at most {INT32_MAX}")
    if not 1 <= cp_world_size <= 65536 or not 0 <= cp_rank < cp_world_size:
        raise ValueError(f"cp_rank={cp_rank} and cp_world_size={cp_world_size} must satisfy "
                         "0 <= cp_rank < cp_world_size <= 65536")
    if not 1 <= cp_interleave <= manager_block_size:
        raise ValueError(f"cp_interleave={cp_interleave} is outside [1, "
                         f"manager_block_size={manager_block_size}]")
    return 0


cdef int _map_group(const int32_t[::1] table, const int64_t[::1] p, int64_t max_num_reqs,
                    const int32_t[::1] qsl, const int64_t[::1] pos, const int32_t[::1] rows,
                    bint indexed, int64_t[::1] slots, int64_t filled) except -1:
    """One group's slots (its layout ``p`` checked, ``qsl`` well formed; ``rows`` read only
    where ``indexed``); ``slots`` is ``PAD_SLOT_ID`` past ``filled`` already."""
    cdef int64_t table_offset = p[0], width = p[1], counts_offset = p[2]
    cdef int64_t kernel_block_size = p[3], manager_block_size = p[4]
    cdef int64_t cp_world_size = p[5], cp_rank = p[6], cp_interleave = p[7]
    cdef Py_ssize_t t, r, start, stop, num_tokens = pos.shape[0]
    cdef int64_t row, q, block_index, offset, count, entry, block_id, v, local
    cdef int64_t virtual_block_size = manager_block_size * cp_world_size
    cdef int64_t blocks_per_manager_block = manager_block_size // kernel_block_size
    cdef int64_t table_end = table_offset + max_num_reqs * width  # entries read are clipped
    cdef bint sharded = cp_world_size > 1
    for t in range(num_tokens, min(filled, slots.shape[0])):
        slots[t] = PAD_SLOT_ID
    for r in range(qsl.shape[0] - 1):
        start, stop = qsl[r], qsl[r + 1]
        row = rows[r] if indexed else r
        for t in range(start, stop):
            slots[t] = PAD_SLOT_ID
            q = pos[t]
            if row < 0 or row >= max_num_reqs or q < 0:
                continue
            if sharded:
                v = q % virtual_block_size
                if (v // cp_interleave) % cp_world_size != cp_rank:
                    continue
                local = (v // (cp_world_size * cp_interleave)) * cp_interleave \
                    + v % cp_interleave
                block_index = (q // virtual_block_size) * blocks_per_manager_block \
                    + local // kernel_block_size
                offset = local % kernel_block_size
            else:
                block_index = q // kernel_block_size
                offset = q % kernel_block_size
            count = table[counts_offset + row]
            if block_index >= count:
                continue
            # count <= width in a sound table; clipped like the numpy path's take otherwise
            entry = table_offset + row * width + block_index
            if entry >= table_end:
                entry = table_end - 1
            block_id = table[entry]
            if block_id == NULL_BLOCK_ID:
                continue
            slots[t] = block_id * kernel_block_size + offset
    return 0


# ---- the batch check of a step ----------------------------------------------------------
cdef class BatchChecker:
    """A staging buffer's batch, bound once: ``query_start_loc`` (int32 ``[capacity + 1]``) and
    ``row_of_batch`` (int32 ``[capacity]``), read only, at full capacity; rows must lie in
    ``[0, num_rows)``. Each step checks the batch's first entries through the arrays' first
    items, remembered at binding (the views held here keep their buffers)."""

    cdef const int32_t[::1] qsl
    cdef const int32_t[::1] rows
    cdef const int32_t* qsl_at  # NULL until bound
    cdef const int32_t* rows_at
    cdef int64_t capacity
    cdef int64_t num_rows

    def __init__(self, object query_start_loc, object row_of_batch, int64_t num_rows):
        _bound_once(self.qsl_at != NULL, "BatchChecker")
        self.qsl = _int32_in(query_start_loc, "query_start_loc")
        self.rows = _int32_in(row_of_batch, "row_of_batch")
        if self.qsl.shape[0] != self.rows.shape[0] + 1:
            raise ValueError(f"query_start_loc has {self.qsl.shape[0]} entries, not "
                             f"row_of_batch's {self.rows.shape[0]} + 1")
        if num_rows < 0:
            raise ValueError(f"num_rows={num_rows} is negative")
        self.num_rows = num_rows
        self.capacity = self.rows.shape[0]
        self.rows_at = &self.rows[0] if self.capacity else NULL
        self.qsl_at = &self.qsl[0]  # (capacity + 1 >= 1 entries; set last: bound)

    def check(self, int64_t num_reqs, int64_t num_tokens):
        """1 when ``query_start_loc[:num_reqs + 1]`` is ``0, 1, ..., num_reqs`` (one token per
        request), 0 when it is otherwise well formed (starts at 0, never decreases, ends at
        ``num_tokens``) and every row of ``row_of_batch[:num_reqs]`` lies in
        ``[0, num_rows)``; -1 for anything else, ``num_reqs`` outside ``[0, capacity]``
        included (the caller names the error). Reads only."""
        _check_bound(self.qsl_at != NULL, "BatchChecker")
        cdef const int32_t* qsl = self.qsl_at
        cdef const int32_t* rows = self.rows_at
        cdef int64_t num_rows = self.num_rows
        cdef Py_ssize_t r
        if num_reqs < 0 or num_reqs > self.capacity:
            return -1
        if qsl[0] != 0 or qsl[num_reqs] != num_tokens:  # (num_reqs <= capacity, checked)
            return -1
        # one pass without branches (the compiler vectorizes it), the verdict at the end
        cdef bint bad = False, not_decode = num_tokens != num_reqs
        for r in range(num_reqs):  # (r < num_reqs <= capacity: rows non-NULL where read)
            bad |= (qsl[r + 1] < qsl[r]) | (rows[r] < 0) | (rows[r] >= num_rows)
            not_decode |= qsl[r + 1] != r + 1
        if bad:
            return -1
        return 0 if not_decode else 1
