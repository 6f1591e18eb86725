# cython: language_level=3, boundscheck=True, wraparound=False, initializedcheck=True
# cython: cdivision=True, embedsignature=True
"""The compiled slot mapping of one KV cache group on the host (the CPU backend).

Typed memoryviews check each array's kind, item size, byte order, dimensions and contiguity
(``int32_t[::1]`` accepts exactly a C-contiguous 1-D native int32 buffer: no float, unsigned,
byte-swapped, object or strided array), and ``const`` marks the inputs, so a read-only input is
accepted and a read-only output refused. Every size and offset is checked against its buffer
before the first write, with 64-bit arithmetic that cannot overflow for the checked ranges, and
the output may not overlap an input. Bounds checking stays on (the default) everywhere.

Results equal :func:`blocktable.slot_mapping.torch_impl.slot_mapping_numpy` bit for bit for
every batch this function accepts (the tests compare them on random inputs); a batch whose
``query_start_loc`` is not well formed is left to that function.
"""

from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef enum:
    PAD_SLOT_ID = -1
    NULL_BLOCK_ID = 0
    INT32_MAX = 2147483647


cdef inline const int32_t[::1] _int32_in(object value, str name) except *:
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(f"{name} must be a C-contiguous 1-D native int32 array: {exc}") from None


cdef inline const int64_t[::1] _int64_in(object value, str name) except *:
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(f"{name} must be a C-contiguous 1-D native int64 array: {exc}") from None


cdef inline int64_t[::1] _int64_out(object value, str name) except *:
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(
            f"{name} must be a writable C-contiguous 1-D native int64 array: {exc}") from None


cdef inline bint _overlap(const void* a, Py_ssize_t a_bytes, const void* b,
                          Py_ssize_t b_bytes) noexcept:
    cdef uintptr_t a0 = <uintptr_t>a, b0 = <uintptr_t>b
    return a_bytes > 0 and b_bytes > 0 and a0 < b0 + <uintptr_t>b_bytes and \
        b0 < a0 + <uintptr_t>a_bytes


def map_slots(object flat_table, int64_t table_offset, int64_t width, int64_t counts_offset,
              int64_t max_num_reqs, int64_t kernel_block_size, int64_t manager_block_size,
              int64_t cp_world_size, int64_t cp_rank, int64_t cp_interleave,
              object query_start_loc, object positions, object row_of_batch, object out):
    """Write one group's slots of a batch into ``out``; return 0, or -1 (nothing written) for a
    ``query_start_loc`` that is not well formed.

    Parameters
    ----------
    flat_table : np.ndarray
        int32 ``[num_entries]``, on cpu: every group's table, then the counts.
    table_offset, width, counts_offset : int
        Where this group's ``[max_num_reqs, width]`` table and ``[max_num_reqs]`` counts lie in
        ``flat_table``.
    max_num_reqs : int
        Rows of the group's table.
    kernel_block_size, manager_block_size, cp_world_size, cp_rank, cp_interleave : int
        The group's slot layout (``manager_block_size`` a multiple of ``kernel_block_size``).
    query_start_loc : np.ndarray
        int32 ``[num_reqs + 1]``: well formed means it starts at 0, never decreases and ends at
        ``len(positions)``.
    positions : np.ndarray
        int64 ``[num_tokens]``.
    row_of_batch : np.ndarray or None
        int32 ``[num_reqs]``; ``None``: request ``r`` reads row ``r``.
    out : np.ndarray
        int64 ``[n >= num_tokens]``, writable, overlapping no input: the slots, then
        ``PAD_SLOT_ID`` to its end.

    Raises
    ------
    TypeError
        An array of the wrong kind, item size, byte order, shape or contiguity, or a read-only
        ``out``.
    ValueError
        A size, offset or layout outside its buffer or its bounds, or ``out`` overlapping an
        input. Nothing is written.
    """
    cdef const int32_t[::1] table = _int32_in(flat_table, "flat_table")
    cdef const int32_t[::1] qsl = _int32_in(query_start_loc, "query_start_loc")
    cdef const int64_t[::1] pos = _int64_in(positions, "positions")
    cdef const int32_t[::1] rows
    cdef bint indexed = row_of_batch is not None
    if indexed:
        rows = _int32_in(row_of_batch, "row_of_batch")
    cdef int64_t[::1] slots = _int64_out(out, "out")
    cdef Py_ssize_t num_entries = table.shape[0]
    cdef Py_ssize_t num_tokens = pos.shape[0]
    cdef Py_ssize_t num_reqs = qsl.shape[0] - 1

    # ---- every argument checked before the first write --------------------------------
    if num_reqs < 0:
        raise ValueError("query_start_loc must hold at least one entry")
    if indexed and rows.shape[0] != num_reqs:
        raise ValueError(f"row_of_batch has {rows.shape[0]} entries, query_start_loc "
                         f"describes {num_reqs} requests")
    if slots.shape[0] < num_tokens:
        raise ValueError(f"out has {slots.shape[0]} entries, fewer than the {num_tokens} "
                         "positions")
    if not 0 <= max_num_reqs <= INT32_MAX:
        raise ValueError(f"max_num_reqs={max_num_reqs} is outside [0, {INT32_MAX}]")
    if not 1 <= width <= INT32_MAX:
        raise ValueError(f"width={width} is outside [1, {INT32_MAX}]")
    # max_num_reqs * width < 2**62: no overflow in the bounds below
    if table_offset < 0 or table_offset > num_entries or \
            max_num_reqs * width > num_entries - table_offset:
        raise ValueError(f"the group's table [{table_offset}, +{max_num_reqs} x {width}) lies "
                         f"outside flat_table's {num_entries} entries")
    if counts_offset < 0 or counts_offset > num_entries or \
            max_num_reqs > num_entries - counts_offset:
        raise ValueError(f"the group's counts [{counts_offset}, +{max_num_reqs}) lie outside "
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
    cdef Py_ssize_t out_bytes = slots.shape[0] * 8
    if out_bytes and (
            _overlap(&slots[0], out_bytes, &table[0] if num_entries else NULL, num_entries * 4)
            or _overlap(&slots[0], out_bytes, &qsl[0], (num_reqs + 1) * 4)
            or _overlap(&slots[0], out_bytes, &pos[0] if num_tokens else NULL, num_tokens * 8)
            or (indexed and num_reqs and
                _overlap(&slots[0], out_bytes, &rows[0], num_reqs * 4))):
        raise ValueError("out overlaps an input array")
    # well formed: starts at 0, never decreases, ends at num_tokens
    cdef Py_ssize_t r
    if qsl[0] != 0 or qsl[num_reqs] != num_tokens:
        return -1
    for r in range(num_reqs):
        if qsl[r + 1] < qsl[r]:
            return -1

    # ---- the slots ---------------------------------------------------------------------
    cdef Py_ssize_t t, start, stop
    cdef int64_t row, p, block_index, offset, count, entry, block_id, v, local
    cdef int64_t virtual_block_size = manager_block_size * cp_world_size
    cdef int64_t blocks_per_manager_block = manager_block_size // kernel_block_size
    cdef int64_t table_end = table_offset + max_num_reqs * width  # entries read are clipped
    cdef bint sharded = cp_world_size > 1
    for t in range(num_tokens, slots.shape[0]):
        slots[t] = PAD_SLOT_ID
    for r in range(num_reqs):
        start, stop = qsl[r], qsl[r + 1]
        row = rows[r] if indexed else r
        for t in range(start, stop):
            slots[t] = PAD_SLOT_ID
            p = pos[t]
            if row < 0 or row >= max_num_reqs or p < 0:
                continue
            if sharded:
                v = p % virtual_block_size
                if (v // cp_interleave) % cp_world_size != cp_rank:
                    continue
                local = (v // (cp_world_size * cp_interleave)) * cp_interleave \
                    + v % cp_interleave
                block_index = (p // virtual_block_size) * blocks_per_manager_block \
                    + local // kernel_block_size
                offset = local % kernel_block_size
            else:
                block_index = p // kernel_block_size
                offset = p % kernel_block_size
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
