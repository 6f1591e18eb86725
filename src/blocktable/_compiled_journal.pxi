# The allocator's step journal: the net change of every touched row (included by _compiled.pyx).

cdef inline const int64_t[:, ::1] _int64_2d_in(object value, str name) except *:
    if value is None:  # (a memoryview would take None as an empty array)
        raise TypeError(f"{name} must be an array, got None")
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(f"{name} must be a C-contiguous 2-D native int64 array: {exc}") from None


cdef inline const int32_t[:, ::1] _int32_2d_in(object value, str name) except *:
    if value is None:  # (a memoryview would take None as an empty array)
        raise TypeError(f"{name} must be an array, got None")
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(f"{name} must be a C-contiguous 2-D native int32 array: {exc}") from None


cdef enum:  # what a touched row's change is (ordered: kinds >= _ADDED_ROW are held)
    _UNCHANGED_ROW = 0  # free at its first touch and now
    _CLEARED_ROW = 1  # its holder left
    _ADDED_ROW = 2  # held by another request than at its first touch: added whole
    _KEPT_ROW = 3  # held by the same request: appends its entries past the old length


cdef inline int _check_len(int64_t length, Py_ssize_t width, str what, Py_ssize_t row,
                           Py_ssize_t group) except -1:
    if length < 0 or length > width:
        raise ValueError(f"{what} of row {row}, group {group} is {length}, outside [0, "
                         f"{width}]: the allocator's row state is corrupt")
    return 0


def journal_diff(object touched, int64_t stamp, object start_gen, object holder_gen,
                 object start_len, object row_len, list arenas):
    """The net change of every row ``r`` with ``touched[r] == stamp``, in row order; the
    compiled twin of the classification and gathers of
    :meth:`blocktable.allocator.journal.StepJournal.take`.

    ``touched``, ``start_gen``, ``holder_gen``: int64 ``[num_rows]``; ``start_len`` and
    ``row_len``: int64 ``[num_groups, num_rows]``; ``arenas``: per group the int32 block rows
    ``[num_rows, width_g]``. A row whose holder left (``holder_gen`` 0, ``start_gen`` not) is
    cleared; a row held by another request than at its first touch is added whole; a row held
    by the same request appends its entries past ``start_len``.

    Returns ``(flat, lengths)``: ``flat`` a new int32 array holding, one after the other, the
    cleared rows, the added rows, then per group the added counts, the added ids, the rows
    that grew, their growth and their new ids; ``lengths`` the length of each of those
    ``2 + 5 * num_groups`` parts. Inputs are only read; every length is checked against its
    arena before anything is gathered.
    """
    global _np
    if _np is None:
        import numpy
        _np = numpy
    cdef const int64_t[::1] tch = _int64_in(touched, "touched")
    cdef const int64_t[::1] sgen = _int64_in(start_gen, "start_gen")
    cdef const int64_t[::1] hgen = _int64_in(holder_gen, "holder_gen")
    cdef const int64_t[:, ::1] slen = _int64_2d_in(start_len, "start_len")
    cdef const int64_t[:, ::1] rlen = _int64_2d_in(row_len, "row_len")
    cdef Py_ssize_t num_rows = tch.shape[0], num_groups = len(arenas)
    if num_rows > INT32_MAX:
        raise ValueError(f"touched has {num_rows} rows, more than {INT32_MAX}")
    if sgen.shape[0] != num_rows or hgen.shape[0] != num_rows:
        raise ValueError(f"start_gen and holder_gen must have touched's {num_rows} entries")
    if slen.shape[0] != num_groups or rlen.shape[0] != num_groups or \
            slen.shape[1] != num_rows or rlen.shape[1] != num_rows:
        raise ValueError(f"start_len and row_len must be [{num_groups}, {num_rows}] (one row "
                         "per arena)")
    # the touched rows, in order, each with its kind: every later pass visits only them
    rows_obj = _np.empty(num_rows, dtype=_np.intp)
    kinds_obj = _np.empty(num_rows, dtype=_np.uint8)
    cdef Py_ssize_t[::1] rows = rows_obj
    cdef unsigned char[::1] kinds = kinds_obj
    cdef Py_ssize_t n = 0, i
    cdef Py_ssize_t r, g, q, at, n_cleared = 0, n_added = 0
    cdef int64_t live, old, new
    for r in range(num_rows):
        if tch[r] == stamp:
            live = hgen[r]
            if live == 0:
                kinds[n] = _CLEARED_ROW if sgen[r] != 0 else _UNCHANGED_ROW
                n_cleared += sgen[r] != 0
            elif live != sgen[r]:
                kinds[n] = _ADDED_ROW
                n_added += 1
            else:
                kinds[n] = _KEPT_ROW
            rows[n] = r
            n += 1
    # ---- sizes, with every length checked against its arena ----------------------------
    cdef const int32_t[:, ::1] arena
    cdef list lengths = [n_cleared, n_added]
    cdef Py_ssize_t total = n_cleared + n_added, add_ids, grown, new_ids
    for g in range(num_groups):
        arena = _int32_2d_in(arenas[g], f"arenas[{g}]")
        if arena.shape[0] != num_rows or arena.shape[1] > INT32_MAX:
            raise ValueError(f"arenas[{g}] must have {num_rows} rows and at most {INT32_MAX} "
                             "columns")
        add_ids = grown = new_ids = 0
        for i in range(n):
            if kinds[i] < _ADDED_ROW:
                continue
            r = rows[i]
            new = rlen[g, r]
            _check_len(new, arena.shape[1], "row_len", r, g)
            if kinds[i] == _ADDED_ROW:
                add_ids += new
            else:
                old = slen[g, r]
                if new > old:
                    _check_len(old, arena.shape[1], "start_len", r, g)
                    grown += 1
                    new_ids += new - old
        lengths += [n_added, add_ids, grown, grown, new_ids]
        total += n_added + add_ids + 2 * grown + new_ids
    # ---- the parts, in the order of ``lengths`` -----------------------------------------
    flat = _np.empty(total, dtype=_np.int32)
    cdef int32_t[::1] out = flat
    at = 0
    for i in range(n):
        if kinds[i] == _CLEARED_ROW:
            out[at] = <int32_t>rows[i]
            at += 1
    for i in range(n):
        if kinds[i] == _ADDED_ROW:
            out[at] = <int32_t>rows[i]
            at += 1
    for g in range(num_groups):
        arena = arenas[g]
        for i in range(n):  # added: each row's count, then all their ids
            if kinds[i] == _ADDED_ROW:
                out[at] = <int32_t>rlen[g, rows[i]]
                at += 1
        for i in range(n):
            if kinds[i] == _ADDED_ROW:
                r = rows[i]
                for q in range(rlen[g, r]):
                    out[at] = arena[r, q]
                    at += 1
        for i in range(n):  # grown: the rows, their growth, then their new ids
            r = rows[i]
            if kinds[i] == _KEPT_ROW and rlen[g, r] > slen[g, r]:
                out[at] = <int32_t>r
                at += 1
        for i in range(n):
            r = rows[i]
            if kinds[i] == _KEPT_ROW and rlen[g, r] > slen[g, r]:
                out[at] = <int32_t>(rlen[g, r] - slen[g, r])
                at += 1
        for i in range(n):
            r = rows[i]
            if kinds[i] == _KEPT_ROW and rlen[g, r] > slen[g, r]:
                for q in range(slen[g, r], rlen[g, r]):
                    out[at] = arena[r, q]
                    at += 1
    return flat, lengths
