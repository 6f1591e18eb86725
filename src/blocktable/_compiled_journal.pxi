# The allocator's step journal: the net change of every row since the last take (included by
# _compiled.pyx).

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize

cdef inline const int64_t[:, ::1] _int64_2d_in(object value, str name) except *:
    if value is None:  # (a memoryview would take None as an empty array)
        raise TypeError(f"{name} must be an array, got None")
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(f"{name} must be a C-contiguous 2-D native int64 array: {exc}") from None


cdef inline int64_t[:, ::1] _int64_2d_out(object value, str name) except *:
    if value is None:  # (a memoryview would take None as an empty array)
        raise TypeError(f"{name} must be an array, got None")
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(
            f"{name} must be a writable C-contiguous 2-D native int64 array: {exc}") from None


cdef inline const int32_t[:, ::1] _int32_2d_in(object value, str name) except *:
    if value is None:  # (a memoryview would take None as an empty array)
        raise TypeError(f"{name} must be an array, got None")
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(f"{name} must be a C-contiguous 2-D native int32 array: {exc}") from None


cdef enum:  # what a changed row's change is (ordered: kinds >= _ADDED_ROW are held)
    _UNCHANGED_ROW = 0  # free at the start and now (only its stale lengths moved)
    _CLEARED_ROW = 1  # its holder left
    _ADDED_ROW = 2  # held by another request than at the start: added whole
    _KEPT_ROW = 3  # held by the same request: appends its entries past the old length


cdef inline int _check_len(int64_t length, Py_ssize_t width, str what, Py_ssize_t row,
                           Py_ssize_t group) except -1:
    if length < 0 or length > width:
        raise ValueError(f"{what} of row {row}, group {group} is {length}, outside [0, "
                         f"{width}]: the allocator's row state is corrupt")
    return 0


cdef inline Py_ssize_t _nbytes(const void* start, Py_ssize_t n) noexcept:
    return n * 8 if start != NULL else 0


cdef class JournalDiff:
    """The journal's arrays, bound once: the net change of every row since the start (the last
    take), in row order, and the live state copied as the next start; the compiled twin of
    :meth:`blocktable.allocator.journal.StepJournal.take`'s numpy diff.

    The bound arrays: ``start_gen`` and ``holder_gen`` (int64 ``[num_rows]``: each row's holder
    at the start and now), ``start_len`` and ``row_len`` (int64 ``[num_groups, num_rows]``:
    the row lengths at the start and now), and ``empty``, an empty int32 array handed out for
    every empty array; ``row_blocks`` makes a group's rows and blocks
    (:class:`blocktable.update.RowBlocks`) and ``no_blocks`` is its empty instance;
    ``step_update`` makes the update (:class:`blocktable.update.StepUpdate`). A row
    changed where its holder or any of its lengths differs from the start. A changed row whose
    holder left (``holder_gen`` 0, ``start_gen`` not) is cleared; one held by another request
    than at the start is added whole; one held by the same request appends its entries past
    ``start_len``. ``holder_gen`` and ``row_len`` are only read; ``start_gen`` and
    ``start_len`` are written (they must be writable and overlap no other bound array).

    The arenas (per group the int32 block rows ``[num_rows, width_g]``) come with each call,
    as a list: an arena grows by being replaced. The one last taken of each group is
    remembered, and the same object passed again reuses its view (its shape checked when it
    was taken; an array's memory does not move while a view of it is held).
    """

    cdef int64_t[::1] sgen
    cdef const int64_t[::1] hgen
    cdef int64_t[:, ::1] slen
    cdef const int64_t[:, ::1] rlen
    cdef Py_ssize_t[::1] rows  # work space: the changed rows of a call, in order
    cdef unsigned char[::1] kinds  # and the kind of each
    cdef object empty
    cdef object row_blocks  # the class of a group's rows and blocks, and its empty instance
    cdef object no_blocks
    cdef tuple no_parts  # (no_blocks,) per group: the added or appended part of no row
    cdef object step_update  # the class of the update
    cdef list arena_objs  # per group, the arena last taken (None at first)
    cdef list arena_views  # and its view (which holds its buffer)
    cdef Py_ssize_t[::1] arena_at  # and the view's first item (as an address) and its width
    cdef Py_ssize_t[::1] arena_width
    cdef int32_t[::1] work  # work space: a call's parts, gathered before the one copy out
    cdef Py_ssize_t[::1] lens  # work space: the length of each part (2 + 5 per group)
    cdef object int32  # numpy's int32 dtype, for the parts' arrays
    cdef object frombuffer  # numpy.frombuffer, which makes each part's array
    cdef bint bound  # __init__ completed (once)

    def __init__(self, object start_gen, object holder_gen, object start_len, object row_len,
                 object empty, object row_blocks, object no_blocks, object step_update):
        _bound_once(self.bound, "JournalDiff")
        global _np
        if _np is None:
            import numpy
            _np = numpy
        self.sgen = _int64_out(start_gen, "start_gen")
        self.hgen = _int64_in(holder_gen, "holder_gen")
        self.slen = _int64_2d_out(start_len, "start_len")
        self.rlen = _int64_2d_in(row_len, "row_len")
        if _int32_in(empty, "empty").shape[0] != 0:
            raise ValueError("empty must be an empty int32 array")
        cdef Py_ssize_t num_rows = self.sgen.shape[0], num_groups = self.slen.shape[0]
        if num_rows > INT32_MAX:
            raise ValueError(f"start_gen has {num_rows} rows, more than {INT32_MAX}")
        if self.hgen.shape[0] != num_rows:
            raise ValueError(f"holder_gen must have start_gen's {num_rows} entries")
        if self.rlen.shape[0] != num_groups or self.slen.shape[1] != num_rows or \
                self.rlen.shape[1] != num_rows:
            raise ValueError(f"start_len and row_len must both be [num_groups, {num_rows}]")
        # the written arrays overlap nothing bound: a write never changes what is compared
        cdef Py_ssize_t n_len = num_groups * num_rows
        cdef const void* sg = &self.sgen[0] if num_rows else NULL
        cdef const void* hg = &self.hgen[0] if num_rows else NULL
        cdef const void* sl = &self.slen[0, 0] if n_len else NULL
        cdef const void* rl = &self.rlen[0, 0] if n_len else NULL
        if _overlap(sg, _nbytes(sg, num_rows), hg, _nbytes(hg, num_rows)) or \
                _overlap(sg, _nbytes(sg, num_rows), sl, _nbytes(sl, n_len)) or \
                _overlap(sg, _nbytes(sg, num_rows), rl, _nbytes(rl, n_len)) or \
                _overlap(sl, _nbytes(sl, n_len), hg, _nbytes(hg, num_rows)) or \
                _overlap(sl, _nbytes(sl, n_len), rl, _nbytes(rl, n_len)):
            raise ValueError("start_gen and start_len must overlap no other bound array")
        self.rows = _np.empty(num_rows, dtype=_np.intp)
        self.kinds = _np.empty(num_rows, dtype=_np.uint8)
        self.empty = empty
        self.row_blocks, self.no_blocks = row_blocks, no_blocks
        self.no_parts = (no_blocks,) * num_groups
        self.step_update = step_update
        self.arena_objs = [None] * num_groups
        self.arena_views = [None] * num_groups
        self.arena_at = _np.zeros(num_groups, dtype=_np.intp)
        self.arena_width = _np.zeros(num_groups, dtype=_np.intp)
        self.work = _np.empty(max(64, 4 * num_rows), dtype=_np.int32)
        self.lens = _np.empty(2 + 5 * num_groups, dtype=_np.intp)
        self.int32 = _np.dtype(_np.int32)
        self.frombuffer = _np.frombuffer
        self.bound = True

    cdef int _take_arena(self, object obj, Py_ssize_t g) except -1:
        """Take ``obj`` as group ``g``'s arena (int32 ``[num_rows, width]``, checked), its view
        (which holds its buffer) kept with its first item (as an address) and its width."""
        cdef const int32_t[:, ::1] arena = _int32_2d_in(obj, f"arenas[{g}]")
        if arena.shape[0] != self.sgen.shape[0] or arena.shape[1] > INT32_MAX:
            raise ValueError(f"arenas[{g}] must have {self.sgen.shape[0]} rows and at most "
                             f"{INT32_MAX} columns")
        self.arena_objs[g], self.arena_views[g] = obj, arena
        self.arena_at[g] = <Py_ssize_t>(&arena[0, 0]) if arena.shape[0] * arena.shape[1] \
            else 0
        self.arena_width[g] = arena.shape[1]
        return 0

    def diff(self, list arenas, object nulled, object allocator_block_sizes):
        """The net change of every row since the start, in row order, as one update; then the
        live holders and lengths of the changed rows are copied into ``start_gen`` and
        ``start_len``.

        Returns ``step_update(cleared_rows, added, appended, nulled, allocator_block_sizes,
        True)`` (trusted: its rows are distinct table rows per part, its counts sum to its
        ids, which are read from the arenas): the cleared rows (int32), and per group
        ``row_blocks(rows, counts, ids)`` of the added rows (their whole rows) and of the rows
        that grew (their growth and new ids), or ``no_blocks`` where a group has none;
        ``nulled`` and ``allocator_block_sizes`` are passed through. The arrays are read-only
        int32 views of one new bytes object; empty ones are ``empty``. Every length is checked
        against its arena before anything is gathered; on an error nothing is written.
        """
        _check_bound(self.bound, "JournalDiff")
        cdef Py_ssize_t num_rows = self.sgen.shape[0], num_groups = self.slen.shape[0]
        if len(arenas) != num_groups:
            raise ValueError(f"arenas must hold {num_groups} arrays, got {len(arenas)}")
        # every group's arena taken first: taking a new one may run Python code (a name is
        # formatted), and from the first read of a row to the last id gathered none runs
        cdef Py_ssize_t g, width
        cdef object obj
        for g in range(num_groups):  # (the one taken last for a group is remembered)
            obj = arenas[g]
            if obj is not self.arena_objs[g] or obj is None:
                self._take_arena(obj, g)
        # the bound arrays and work spaces through their first items, without bounds checks:
        # every row r < num_rows, group g < num_groups and count n <= num_rows (each array was
        # checked to have these shapes when bound; memoryviews are never rebound), and every
        # arena index below a length checked against the arena's width (NULL where empty)
        cdef bint any_len = num_rows * num_groups > 0
        cdef int64_t* sgen = &self.sgen[0] if num_rows else NULL
        cdef const int64_t* hgen = &self.hgen[0] if num_rows else NULL
        cdef int64_t* slen = &self.slen[0, 0] if any_len else NULL  # [g * num_rows + r]
        cdef const int64_t* rlen = &self.rlen[0, 0] if any_len else NULL
        cdef Py_ssize_t* rows = &self.rows[0] if num_rows else NULL
        cdef unsigned char* kinds = &self.kinds[0] if num_rows else NULL
        # the changed rows, in order, each with its kind, and the parts' sizes (``lens``: the
        # cleared and added rows, then per group the added rows' counts and ids and the grown
        # rows, their growth and new ids), every length checked against its arena as it is
        # counted: every later pass visits only these rows
        cdef Py_ssize_t* lens = &self.lens[0]  # (2 + 5 * num_groups entries, at binding)
        cdef const Py_ssize_t* widths = &self.arena_width[0] if num_groups else NULL
        cdef const int64_t* rlen_g
        cdef const int64_t* slen_g
        cdef Py_ssize_t n = 0, i, r, q, at, n_cleared = 0, n_added = 0
        cdef int64_t live, old, new
        cdef bint changed
        cdef unsigned char kind
        for i in range(2 + 5 * num_groups):
            lens[i] = 0
        for r in range(num_rows):
            live = hgen[r]
            changed = live != sgen[r]
            for g in range(num_groups):
                changed = changed | (rlen[g * num_rows + r] != slen[g * num_rows + r])
            if not changed:
                continue
            rows[n] = r
            if live == 0:
                kinds[n] = _CLEARED_ROW if sgen[r] != 0 else _UNCHANGED_ROW
                n_cleared += sgen[r] != 0
                n += 1
                continue
            kind = _ADDED_ROW if live != sgen[r] else _KEPT_ROW
            kinds[n] = kind
            n += 1
            n_added += kind == _ADDED_ROW
            for g in range(num_groups):
                new = rlen[g * num_rows + r]
                _check_len(new, widths[g], "row_len", r, g)
                if kind == _ADDED_ROW:
                    lens[3 + 5 * g] += new
                    continue
                old = slen[g * num_rows + r]
                if new > old:
                    _check_len(old, widths[g], "start_len", r, g)
                    lens[4 + 5 * g] += 1
                    lens[6 + 5 * g] += new - old
        lens[0], lens[1] = n_cleared, n_added
        cdef Py_ssize_t total = n_cleared + n_added, grown
        for g in range(num_groups):
            lens[2 + 5 * g], lens[5 + 5 * g] = n_added, lens[4 + 5 * g]
            total += n_added + lens[3 + 5 * g] + 2 * lens[4 + 5 * g] + lens[6 + 5 * g]
        # ---- the parts, in the order of ``lens`` ----------------------------------------
        make, none = self.row_blocks, self.no_blocks
        if total == 0:  # nothing to gather: every part is empty
            update = self.step_update(self.empty, self.no_parts, self.no_parts, nulled,
                                      allocator_block_sizes, True)
            self._restart(n)  # (once the update is made: were it refused, nothing is written)
            return update
        if total > PY_SSIZE_T_MAX // 4:
            raise ValueError(f"the update would hold {total} ids")
        # gathered into the work space (grown to fit), then copied into a new bytes object:
        # the parts' arrays over it are read-only from birth, and so is every view of them
        if total > self.work.shape[0]:
            # grown, then everything read again: growing runs Python code (numpy's), which
            # could change what the sizes were computed from
            self.work = _np.empty(max(total, 2 * self.work.shape[0]), dtype=_np.int32)
            return self.diff(arenas, nulled, allocator_block_sizes)
        # one pass per group writes each part at its own cursor (the parts' starts and ends
        # from ``lens``, every cursor checked at its part's end: at most total entries)
        cdef int32_t* out = &self.work[0]
        cdef const int32_t* arena
        cdef Py_ssize_t c_at = 0, a_at = n_cleared, num_at, ids_at, g_at, gn_at, gi_at
        for i in range(n):
            if kinds[i] == _CLEARED_ROW:
                out[c_at] = <int32_t>rows[i]
                c_at += 1
            elif kinds[i] == _ADDED_ROW:
                out[a_at] = <int32_t>rows[i]
                a_at += 1
        at = a_at
        for g in range(num_groups):  # (the arenas taken above, their lengths checked)
            arena = <const int32_t*>self.arena_at[g]
            width = widths[g]
            rlen_g, slen_g = rlen + g * num_rows, slen + g * num_rows
            num_at = at  # the added rows' counts, their ids, the grown rows, growth, new ids
            ids_at = num_at + n_added
            g_at = ids_at + lens[3 + 5 * g]
            gn_at = g_at + lens[4 + 5 * g]
            gi_at = gn_at + lens[4 + 5 * g]
            for i in range(n):
                kind = kinds[i]
                if kind < _ADDED_ROW:
                    continue
                r = rows[i]
                new = rlen_g[r]
                if kind == _ADDED_ROW:
                    out[num_at] = <int32_t>new
                    num_at += 1
                    for q in range(new):
                        out[ids_at + q] = arena[r * width + q]
                    ids_at += new
                    continue
                old = slen_g[r]
                if new > old:
                    out[g_at] = <int32_t>r
                    out[gn_at] = <int32_t>(new - old)
                    g_at += 1
                    gn_at += 1
                    for q in range(old, new):
                        out[gi_at] = arena[r * width + q]
                        gi_at += 1
            at = gi_at
            if c_at != n_cleared or a_at != n_cleared + n_added or num_at != ids_at - \
                    lens[3 + 5 * g] or ids_at != g_at - lens[4 + 5 * g] or g_at != gn_at - \
                    lens[4 + 5 * g] or gn_at != gi_at - lens[6 + 5 * g] or at > total:
                raise AssertionError("the journal diff gathered other sizes than it counted")
        if at != total:  # (the sizes above count exactly what was gathered)
            raise AssertionError(f"the journal diff gathered {at} ids, not {total}")
        cdef bytes buf = PyBytes_FromStringAndSize(<char*> out, total * 4)
        # each part is its own array over the bytes (cutting one flat array would take a
        # numpy call more per step)
        cleared = self._part(buf, 0, n_cleared)
        added_rows = self._part(buf, n_cleared, n_added)
        at = n_cleared + n_added
        # the added rows serve every group; a group's empty part is the one empty instance,
        # and a part empty in every group the one tuple of them
        # (each Python call made with a tuple of its arguments: one plain call, where a call
        # with separate arguments inlines Cython's every way of calling at each site)
        cdef list added = [], appended = []
        cdef bint any_grown = False
        cdef tuple args
        for g in range(num_groups):
            if n_added:
                args = (added_rows, self._part(buf, at, n_added),
                        self._part(buf, at + n_added, lens[3 + 5 * g]))
                added.append(make(*args))
            at += n_added + lens[3 + 5 * g]
            grown = lens[4 + 5 * g]
            if grown:
                args = (self._part(buf, at, grown), self._part(buf, at + grown, grown),
                        self._part(buf, at + 2 * grown, lens[6 + 5 * g]))
                appended.append(make(*args))
                any_grown = True
            else:
                appended.append(none)
            at += 2 * grown + lens[6 + 5 * g]
        args = (cleared, tuple(added) if n_added else self.no_parts,
                tuple(appended) if any_grown else self.no_parts, nulled, allocator_block_sizes,
                True)
        update = self.step_update(*args)
        self._restart(n)
        return update

    cdef object _part(self, bytes buf, Py_ssize_t start, Py_ssize_t length):
        """The ``length`` int32 values at ``start`` of ``buf``, as a read-only array
        (the one empty array where ``length`` is 0)."""
        if not length:
            return self.empty
        return self.frombuffer(buf, self.int32, length, start * 4)

    cdef int _restart(self, Py_ssize_t n) except -1:
        """The live holders and lengths of the first ``n`` changed rows become their start
        (the other rows' start equals their live state already)."""
        if n == 0:
            return 0
        cdef Py_ssize_t num_rows = self.sgen.shape[0], num_groups = self.slen.shape[0]
        cdef int64_t* sgen = &self.sgen[0]  # (n > 0: there are rows)
        cdef const int64_t* hgen = &self.hgen[0]
        cdef int64_t* slen = &self.slen[0, 0] if num_groups else NULL  # (num_rows > 0)
        cdef const int64_t* rlen = &self.rlen[0, 0] if num_groups else NULL
        cdef const Py_ssize_t* rows = &self.rows[0]
        cdef Py_ssize_t i, r, g
        for i in range(n):  # (n <= num_rows and every row r < num_rows: the diff's first
            r = rows[i]  # pass wrote them, into a work space of num_rows)
            sgen[r] = hgen[r]
            for g in range(num_groups):
                slen[g * num_rows + r] = rlen[g * num_rows + r]
        return 0
