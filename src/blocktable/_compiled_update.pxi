# One group's step update, checked then written (included by _compiled.pyx).

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, \
    PyObject_GetBuffer

# ---- one group's step update: checked, then written ------------------------------------
cdef enum:
    OK = 0
    ROW_RANGE = 1
    ROW_TWICE = 2
    NEG_COUNT = 3
    ID_RANGE = 4
    ID_SUM = 5
    WIDTH = 6
    NULL_RANGE = 7
    CLEARED = 0
    ADDED = 1
    APPENDED = 2
    NULLED = 3


cdef struct _Ints:
    # one int32 array of an update, read through its first item (NULL where empty); its
    # buffer is held by the caller for as long as it is read (GroupWriter._hold)
    const int32_t* at
    Py_ssize_t n


cdef enum:  # an update's arrays, in the order of GroupWriter.apply's arguments
    C_ROWS = 0
    A_ROWS = 1
    A_NUM = 2
    A_IDS = 3
    P_ROWS = 4
    P_NUM = 5
    P_IDS = 6
    N_ROWS = 7
    N_BLOCKS = 8
    NUM_ARRAYS = 9


# ---- an int32 array read through numpy's array head (no buffer export) ------------------
cdef extern from *:
    """
    /* The first fields of numpy's array object, as numpy's ndarraytypes.h lays them out
       (PyArrayObject_fields): numpy's ABI, read by the accessors numpy compiles into every
       extension, the same from numpy 1.7 to 2.x. Checked against numpy at run time before
       it is trusted (_array_heads_checked). */
    typedef struct {
        PyObject_HEAD
        char *data;
        int nd;
        Py_ssize_t *dimensions;
        Py_ssize_t *strides;
        PyObject *base;
        PyObject *descr;
        int flags;
    } bt_array_head;
    """
    ctypedef struct bt_array_head:
        char* data
        int nd
        Py_ssize_t* dimensions
        Py_ssize_t* strides
        void* descr
        int flags

cdef enum:
    _C_CONTIGUOUS_ALIGNED = 0x0001 | 0x0100  # numpy's NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED

# numpy's array type and its native int32 dtype (a singleton: every native int32 array made
# the usual ways holds this one), once the heads were checked to read as numpy lays them out;
# None before and where they do not (every array then takes the buffer protocol)
cdef object _NDARRAY = None
cdef object _INT32_DTYPE = None
cdef bint _heads_checked = False


cdef int _array_heads_checked() except -1:
    """Read the heads of a few numpy arrays and trust them only if every field agrees with
    what numpy says of the same arrays (once per process)."""
    global _NDARRAY, _INT32_DTYPE, _heads_checked
    if _heads_checked:
        return 0
    _heads_checked = True
    import numpy
    cdef bt_array_head* head
    int32 = numpy.dtype(numpy.int32)
    probes = (numpy.arange(5, dtype=numpy.int32), numpy.zeros((2, 3), dtype=numpy.int32)[:, 1],
              numpy.frombuffer(bytes(12), dtype=numpy.int32))
    for a in probes:
        head = <bt_array_head*><void*>a
        # (the fields read in place first: the shape's pointers are followed only once those
        # agree)
        if not (head.nd == a.ndim == 1 and <uintptr_t>head.data == a.ctypes.data
                and (head.descr == <void*>a.dtype) == (a.dtype is int32)
                and ((head.flags & _C_CONTIGUOUS_ALIGNED) == _C_CONTIGUOUS_ALIGNED)
                == (a.flags.c_contiguous and a.flags.aligned)
                and head.dimensions[0] == a.shape[0] and head.strides[0] == a.strides[0]):
            return 0  # another layout: the buffer protocol serves
    _NDARRAY, _INT32_DTYPE = numpy.ndarray, int32
    return 0


def array_heads_trusted():
    """Whether update arrays are read through numpy's array heads here (the layout checked
    against this numpy); else every array takes the buffer protocol."""
    _array_heads_checked()
    return _INT32_DTYPE is not None


cdef inline bint _read_int32_head(object value, _Ints* part) noexcept:
    """Read ``value`` into ``part`` if it is a C-contiguous, aligned 1-D numpy array of the
    native int32 dtype (by its head: no buffer export); False for anything else. The caller
    holds a reference to ``value`` and runs no Python code while it reads ``part``: nothing
    can move or free the memory meanwhile (numpy resizes only through a Python call)."""
    if _INT32_DTYPE is None or type(value) is not _NDARRAY:
        return False
    cdef bt_array_head* head = <bt_array_head*><void*>value
    if head.nd != 1 or head.descr != <void*>_INT32_DTYPE or \
            (head.flags & _C_CONTIGUOUS_ALIGNED) != _C_CONTIGUOUS_ALIGNED:
        return False
    part.n = head.dimensions[0]
    part.at = <const int32_t*>head.data if part.n else NULL
    return True


cdef tuple _NAMES = ("cleared", "add_rows", "add_num", "add_ids", "app_rows", "app_num",
                     "app_ids", "null_rows", "null_blocks")
cdef bint _LITTLE_ENDIAN = sys.byteorder == "little"
cdef tuple _PASSED = (OK, 0, 0, 0, 0)  # GroupWriter._apply's verdict for an update that passed


cdef bint _native_int32_format(const char* fmt) noexcept:
    """Whether a buffer format describes one signed 32-bit integer in this machine's byte
    order: ``i`` or ``l`` (the item size, checked apart, tells them from wider ones), bare or
    after a native or matching byte-order prefix. No unsigned, float, object or swapped
    item."""
    if fmt == NULL:  # (the buffer protocol's "unsigned bytes")
        return False
    cdef char c = fmt[0]
    if c == b'@' or c == b'=' or (c == b'<' and _LITTLE_ENDIAN) or \
            ((c == b'>' or c == b'!') and not _LITTLE_ENDIAN):
        fmt += 1
    return (fmt[0] == b'i' or fmt[0] == b'l') and fmt[1] == 0


cdef inline void _release_parts(Py_buffer* bufs, bint* held) noexcept:
    cdef int i
    for i in range(NUM_ARRAYS):
        if held[i]:
            held[i] = False
            PyBuffer_Release(&bufs[i])


cdef tuple _rows_in_range(_Ints rows, Py_ssize_t num_rows, int part):
    cdef Py_ssize_t i
    for i in range(rows.n):
        if rows.at[i] < 0 or rows.at[i] >= num_rows:
            return (ROW_RANGE, part, i, rows.at[i], num_rows)
    return None


cdef tuple _blocks_ok(_Ints rows, _Ints num, _Ints ids, int64_t max_id, int part,
                      Py_ssize_t num_rows, unsigned char* seen):
    """Rows in range and listed once, counts >= 0 summing to the ids, ids in ``[0, max_id)``.
    ``seen`` (``[num_rows]``, all 0) is left all 0. ``num`` has ``rows``' length."""
    cdef tuple res = _rows_in_range(rows, num_rows, part)
    if res is not None:
        return res
    cdef Py_ssize_t i, j, n = rows.n, negative = -1
    cdef int64_t total = 0
    for i in range(n):  # (every row is in [0, num_rows), checked just above)
        if seen[rows.at[i]]:
            for j in range(i):
                seen[rows.at[j]] = 0
            return (ROW_TWICE, part, i, rows.at[i], 0)
        seen[rows.at[i]] = 1
        if num.at[i] < 0 and negative < 0:  # (named once no row is listed twice)
            negative = i
        total += num.at[i]
    for i in range(n):
        seen[rows.at[i]] = 0
    if negative >= 0:
        return (NEG_COUNT, part, negative, num.at[negative], 0)
    if total != ids.n:
        return (ID_SUM, part, ids.n, total, 0)
    for i in range(ids.n):
        if ids.at[i] < 0 or ids.at[i] >= max_id:
            return (ID_RANGE, part, i, ids.at[i], max_id)
    return None


cdef inline void _log(int64_t* journal, Py_ssize_t capacity, int64_t* journal_len,
                      int64_t start, int64_t length) noexcept:
    """Journal the run ``[start, start + length)`` (``journal``: ``[capacity, 2]``); past
    capacity, mark the overflow."""
    cdef int64_t runs = journal_len[0]
    if runs < 0 or length <= 0:
        return
    if runs + 1 > capacity or journal_len[1] + length > capacity:
        journal_len[0] = -1
        return
    journal[2 * runs] = start
    journal[2 * runs + 1] = length
    journal_len[0] = runs + 1
    journal_len[1] += length


cdef class GroupWriter:
    """One group's host table, bound once: checks a step update's part for the group, then
    (if it passed) writes it and journals every written run.

    The compiled twin of :func:`blocktable._host_loops.check_and_write_group_update`. The
    bound arrays: ``table``, the group's flat host table (int32 ``[num_rows * width]``);
    ``counts``, its filled entries per row (int32 ``[num_rows]``); ``scratch`` (int64
    ``[num_rows]``) and ``seen`` (uint8 ``[num_rows]``, all 0), work space; ``dirty`` (uint8
    ``[num_rows]``), the rows to commit; ``journal`` (int64 ``[capacity, 2]``) and
    ``journal_len`` (int64 ``[2]``), the written runs of flat indices (``offset`` added). All
    writable, C-contiguous, native, and overlapping no other.
    """

    cdef int32_t[::1] tab
    cdef int32_t[::1] cnt
    cdef int64_t[::1] after
    cdef unsigned char[::1] mark
    cdef unsigned char[::1] dirt
    cdef int64_t[:, ::1] jour
    cdef int64_t[::1] jlen
    cdef int64_t width, k, max_id, offset
    cdef uintptr_t out_start[7]  # the bound arrays' memory: (first byte, size in bytes)
    cdef Py_ssize_t out_bytes[7]
    cdef PairStager stager  # the table's pair stager, for apply_and_stage (None: unbound)
    cdef object staged_a  # the last two staging arrays taken (None at first), their views
    cdef object staged_b  # (which hold their buffers) and the views' first items and lengths
    cdef int32_t[::1] staged_view_a
    cdef int32_t[::1] staged_view_b
    cdef int32_t* staged_at_a
    cdef int32_t* staged_at_b
    cdef Py_ssize_t staged_len_a
    cdef Py_ssize_t staged_len_b
    cdef bint bound  # __init__ completed (once)

    def __init__(self, object table, object counts, int64_t width, int64_t k, int64_t max_id,
                 int64_t offset, object scratch, object seen, object dirty, object journal,
                 object journal_len):
        _bound_once(self.bound, "GroupWriter")
        _array_heads_checked()
        if table is None or counts is None or seen is None or dirty is None or journal is None:
            raise TypeError("table, counts, seen, dirty and journal must be arrays, got None")
        try:
            self.tab = table
            self.cnt = counts
            self.mark = seen
            self.dirt = dirty
            self.jour = journal
        except (ValueError, TypeError, BufferError) as exc:
            raise TypeError(f"table and counts must be writable C-contiguous 1-D native int32 "
                            f"arrays, seen and dirty uint8, journal int64 [capacity, 2]: {exc}") \
                from None
        self.after = _int64_out(scratch, "scratch")
        self.jlen = _int64_out(journal_len, "journal_len")
        cdef Py_ssize_t num_rows = self.cnt.shape[0]
        if not 1 <= k <= width <= INT32_MAX or width % k:
            raise ValueError(f"k={k} and width={width} must satisfy 1 <= k <= width <= "
                             f"{INT32_MAX}, width a multiple of k")
        if not 0 <= max_id <= INT32_MAX // k + 1:
            raise ValueError(f"max_id={max_id} is outside [0, {INT32_MAX // k + 1}]")
        if self.tab.shape[0] != num_rows * width:
            raise ValueError(f"table has {self.tab.shape[0]} entries, not counts' {num_rows} "
                             f"rows x width {width}")
        if self.after.shape[0] != num_rows or self.mark.shape[0] != num_rows or \
                self.dirt.shape[0] != num_rows:
            raise ValueError(f"scratch, seen and dirty must have counts' {num_rows} entries")
        if self.jour.shape[1] != 2 or self.jlen.shape[0] != 2:
            raise ValueError("journal must be [capacity, 2] and journal_len [2]")
        if offset < 0 or offset > INT32_MAX:
            raise ValueError(f"offset={offset} is outside [0, {INT32_MAX}]")
        self.width, self.k, self.max_id, self.offset = width, k, max_id, offset
        spans = [
            (<uintptr_t>(&self.tab[0]) if self.tab.shape[0] else 0, self.tab.shape[0] * 4),
            (<uintptr_t>(&self.cnt[0]) if num_rows else 0, num_rows * 4),
            (<uintptr_t>(&self.after[0]) if num_rows else 0, num_rows * 8),
            (<uintptr_t>(&self.mark[0]) if num_rows else 0, num_rows),
            (<uintptr_t>(&self.dirt[0]) if num_rows else 0, num_rows),
            (<uintptr_t>(&self.jour[0, 0]) if self.jour.shape[0] else 0,
             self.jour.shape[0] * 16),
            (<uintptr_t>(&self.jlen[0]), 16)]
        for i in range(7):
            self.out_start[i], self.out_bytes[i] = spans[i]
        for i in range(7):
            if _overlaps_any(self.out_start[i], self.out_bytes[i], self.out_start, self.out_bytes,
                             7, i):
                raise ValueError("the bound arrays overlap")
        for i in range(num_rows):
            if self.mark[i]:
                raise ValueError("seen must be all 0")
        self.bound = True

    def apply(self, object cleared, object add_rows, object add_num, object add_ids,
              object app_rows, object app_num, object app_ids, object null_rows,
              object null_blocks, bint write=True):
        """Check the update's part for this group (int32 arrays: ``cleared`` rows, then rows,
        counts and manager ids of ``added`` and ``appended``, rows and block indices of
        ``nulled``); write it if it passed and ``write``. Returns ``(code, part, index,
        value, bound)`` as the numpy twin does, ``code`` 0 when it passed; nothing is written
        unless it passed."""
        _check_bound(self.bound, "GroupWriter")
        cdef Py_buffer bufs[NUM_ARRAYS]
        cdef bint held[NUM_ARRAYS]
        cdef _Ints parts[NUM_ARRAYS]
        cdef int i
        for i in range(NUM_ARRAYS):
            held[i] = False
        try:
            self._hold((cleared, add_rows, add_num, add_ids, app_rows, app_num, app_ids,
                        null_rows, null_blocks), bufs, held, parts)
            if not self._parts_sound(parts, NULL, 0):
                raise ValueError("each part's rows and counts (or block indices) must have "
                                 "one entry per row")
            return self._apply(parts, write)
        finally:
            _release_parts(bufs, held)

    def bind_stager(self, PairStager stager not None):
        """Bind the table's pair stager (it must drain this writer's journal), for
        :meth:`apply_and_stage`."""
        _check_bound(self.bound, "GroupWriter")
        _check_bound(stager.bound, "PairStager")
        if stager.jour.shape[0] != self.jour.shape[0] or (
                self.jour.shape[0] and &stager.jour[0, 0] != &self.jour[0, 0]) or \
                &stager.jlen[0] != &self.jlen[0]:
            raise ValueError("the stager must drain this writer's journal")
        self.stager = stager

    def apply_and_stage(self, object update, object staging, int64_t capacity):
        """:meth:`apply` of a one-group step update then, if it passed, the bound stager's
        :meth:`PairStager.fill` into ``staging`` (int32 ``[>= 1 + 2 * capacity]``: the number
        of pairs, the flat indices, the values), every argument checked before the first
        write.

        ``update`` is read as a :class:`blocktable.update.StepUpdate`: its ``cleared_rows``
        and the one entry of each of the tuples ``added``, ``appended`` and ``nulled`` (int32
        arrays).
        Returns the number of pairs; -1 when they exceed ``capacity`` (the update is written,
        nothing staged: the changes wait for the table's commit); -2, nothing written, when
        the update is refused or is not one group's int32 arrays (:meth:`apply` of converted
        arrays names why). A bad ``staging`` or ``capacity`` raises."""
        _check_bound(self.bound, "GroupWriter")
        if self.stager is None:
            raise ValueError("apply_and_stage needs bind_stager() first")
        cdef Py_ssize_t out_len
        cdef int32_t* out = self._staging(staging, capacity, &out_len)
        cdef Py_buffer bufs[NUM_ARRAYS]
        cdef bint held[NUM_ARRAYS]
        cdef _Ints parts[NUM_ARRAYS]
        cdef int i
        for i in range(NUM_ARRAYS):
            held[i] = False
        try:
            try:
                added, appended, nulled = update.added, update.appended, update.nulled
                if not (type(added) is tuple and type(appended) is tuple and
                        type(nulled) is tuple and len(<tuple>added) == 1 and
                        len(<tuple>appended) == 1 and len(<tuple>nulled) == 1):
                    return -2  # (apply takes any sequence of one group's parts)
                a, p, z = (<tuple>added)[0], (<tuple>appended)[0], (<tuple>nulled)[0]
                values = (update.cleared_rows, a.rows, a.num_manager_blocks, a.block_ids,
                          p.rows, p.num_manager_blocks, p.block_ids, z.rows, z.block_indices)
                self._hold(values, bufs, held, parts)
            except (TypeError, ValueError, AttributeError, IndexError):
                return -2
            if not self._parts_sound(parts, out, out_len * 4):
                return -2
            if self._apply(parts, True) is not _PASSED:
                return -2
            return self.stager._fill(out, out_len, capacity)
        finally:
            _release_parts(bufs, held)

    cdef bint _parts_sound(self, const _Ints* parts, const void* staging,
                           Py_ssize_t staging_bytes) except -1:
        """Whether each part's rows and counts (or block indices) have one entry per row;
        raises where an array overlaps the table's own arrays or ``staging``."""
        if parts[A_ROWS].n != parts[A_NUM].n or parts[P_ROWS].n != parts[P_NUM].n or \
                parts[N_ROWS].n != parts[N_BLOCKS].n:
            return False
        cdef int i
        for i in range(NUM_ARRAYS):
            if _overlaps_any(<uintptr_t>parts[i].at, parts[i].n * 4, self.out_start,
                             self.out_bytes, 7, -1) or \
                    _overlap(parts[i].at, parts[i].n * 4, staging, staging_bytes):
                raise ValueError("an update array overlaps the table's own arrays or staging")
        return True

    cdef int32_t* _staging(self, object staging, int64_t capacity,
                           Py_ssize_t* staging_len) except NULL:
        """``staging``'s first item and (into ``staging_len``) its length, checked
        (:meth:`PairStager._staging`, and against this writer's arrays); remembered for the
        last two arrays taken (a captured step's two staging buffers). As with the bound
        arrays, a remembered array's view is held: its memory cannot be freed while the
        writer holds it, and it was writable and apart from every bound array when it was
        taken."""
        cdef int32_t[::1] out
        if staging is self.staged_a and staging is not None:
            staging_len[0] = self.staged_len_a
            _check_capacity(self.staged_len_a, capacity)
            return self.staged_at_a
        if staging is self.staged_b and staging is not None:
            staging_len[0] = self.staged_len_b
            _check_capacity(self.staged_len_b, capacity)
            return self.staged_at_b
        out = self.stager._staging(staging, capacity)  # (at least one entry)
        if _overlaps_any(<uintptr_t>(&out[0]), out.shape[0] * 4, self.out_start,
                         self.out_bytes, 7, -1):
            raise ValueError("staging overlaps the table's own arrays")
        if self.staged_a is not None:
            self.staged_b, self.staged_view_b = self.staged_a, self.staged_view_a
            self.staged_at_b, self.staged_len_b = self.staged_at_a, self.staged_len_a
        self.staged_a, self.staged_view_a = staging, out
        self.staged_at_a, self.staged_len_a = &out[0], out.shape[0]
        staging_len[0] = out.shape[0]
        return &out[0]

    cdef int _hold(self, tuple values, Py_buffer* bufs, bint* held, _Ints* parts) except -1:
        """Read each of the ``NUM_ARRAYS`` ``values`` as ``parts[i]``, or raise TypeError
        naming the first that is not a C-contiguous 1-D native int32 array.

        Where every value is a numpy array of the native int32 dtype, each is read through
        its head: nothing else runs while
        the caller reads them, and it holds them (the tuple). Otherwise each buffer is held
        in ``bufs`` (``held[i]`` set for each one held: the caller releases them, on every
        path), with a typed memoryview's checks: dimensions, item size, kind and byte order
        by the format, contiguity by the request. (An export may run Python code, which could
        change an array read before it: so it is all heads or all buffers.)"""
        cdef int i
        cdef object value
        for i in range(NUM_ARRAYS):
            value = values[i]
            if not _read_int32_head(value, &parts[i]):
                break
        else:
            return 0
        for i in range(NUM_ARRAYS):
            value = values[i]
            parts[i].at, parts[i].n = NULL, 0
            if value is None:  # (None exports no buffer: named here)
                raise TypeError(f"{_NAMES[i]} must be an array, got None")
            try:
                PyObject_GetBuffer(value, &bufs[i], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
            except (ValueError, TypeError, BufferError) as exc:
                raise TypeError(f"{_NAMES[i]} must be a C-contiguous 1-D native int32 array: "
                                f"{exc}") from None
            held[i] = True
            if bufs[i].ndim != 1 or bufs[i].itemsize != 4 or \
                    not _native_int32_format(bufs[i].format):
                raise TypeError(f"{_NAMES[i]} must be a C-contiguous 1-D native int32 array, "
                                f"got {bufs[i].ndim}-D items of format "
                                f"{(bufs[i].format or b'B').decode('ascii', 'replace')!r}")
            if <uintptr_t>bufs[i].buf % sizeof(int32_t):  # (read as int32: aligned)
                raise TypeError(f"{_NAMES[i]} must be an aligned int32 array")
            parts[i].n = bufs[i].shape[0]
            if parts[i].n:
                parts[i].at = <const int32_t*>bufs[i].buf
        return 0

    cdef tuple _apply(self, const _Ints* parts, bint write):
        """Check the update's ``parts`` (each row part with one count or block index per row:
        :meth:`_parts_sound`), then write them if they passed and ``write``; ``(code, part,
        index, value, bound)``, ``code`` OK when they passed.

        The writes index the bound arrays through their first items without bounds checks:
        every index is proven in range by the checks before them (rows in ``[0, num_rows)``,
        each part's counts summing to its ids, every count of a written row and every row's
        length after the update in ``[0, width]``, nulled blocks below it)."""
        cdef _Ints c_rows = parts[C_ROWS], a_rows = parts[A_ROWS], a_num = parts[A_NUM]
        cdef _Ints a_ids = parts[A_IDS], p_rows = parts[P_ROWS], p_num = parts[P_NUM]
        cdef _Ints p_ids = parts[P_IDS], n_rows = parts[N_ROWS], n_blocks = parts[N_BLOCKS]
        cdef int64_t width = self.width, k = self.k
        cdef Py_ssize_t num_rows = self.cnt.shape[0]
        # the bound arrays' first items (NULL without rows: then every nonempty row part is
        # refused and nothing is read or written through them); each was checked at binding
        # to hold num_rows entries, the table num_rows * width, the journal its capacity
        cdef int32_t* tab = &self.tab[0] if num_rows else NULL
        cdef int32_t* cnt = &self.cnt[0] if num_rows else NULL
        cdef int64_t* after = &self.after[0] if num_rows else NULL
        cdef unsigned char* mark = &self.mark[0] if num_rows else NULL
        cdef unsigned char* dirt = &self.dirt[0] if num_rows else NULL
        cdef Py_ssize_t capacity = self.jour.shape[0]
        cdef int64_t* jour = &self.jour[0, 0] if capacity else NULL
        cdef int64_t* jlen = &self.jlen[0]
        cdef int64_t offset = self.offset
        # ---- checks (nothing written but the work space, which is restored) -----------------
        # (each part's code runs only where the part has rows: a step changes few parts, and
        # code skipped is code not fetched into a cold cache)
        cdef tuple res = None
        if c_rows.n:
            res = _rows_in_range(c_rows, num_rows, CLEARED)
        if res is None and a_rows.n | a_ids.n:
            res = _blocks_ok(a_rows, a_num, a_ids, self.max_id, ADDED, num_rows, mark)
        if res is None and p_rows.n | p_ids.n:
            res = _blocks_ok(p_rows, p_num, p_ids, self.max_id, APPENDED, num_rows, mark)
        if res is None and n_rows.n:
            res = _rows_in_range(n_rows, num_rows, NULLED)
        if res is not None:
            return res
        cdef Py_ssize_t i, j, q
        cdef int64_t row, old, new, start, stop, b
        # every row's count read once, a count outside [0, width] (a corrupt table) remembered
        cdef int64_t corrupt = -1
        if c_rows.n:
            for i in range(c_rows.n):
                if <uint64_t>cnt[c_rows.at[i]] > <uint64_t>width:
                    corrupt = c_rows.at[i]
        if a_rows.n:
            for i in range(a_rows.n):
                after[a_rows.at[i]] = cnt[a_rows.at[i]]
                if <uint64_t>cnt[a_rows.at[i]] > <uint64_t>width:
                    corrupt = a_rows.at[i]
        for i in range(p_rows.n):
            after[p_rows.at[i]] = cnt[p_rows.at[i]]
            if <uint64_t>cnt[p_rows.at[i]] > <uint64_t>width:
                corrupt = p_rows.at[i]
        if n_rows.n:
            for i in range(n_rows.n):
                after[n_rows.at[i]] = cnt[n_rows.at[i]]
                if <uint64_t>cnt[n_rows.at[i]] > <uint64_t>width:
                    corrupt = n_rows.at[i]
        if c_rows.n | a_rows.n:
            for i in range(c_rows.n):
                after[c_rows.at[i]] = 0
            for i in range(a_rows.n):
                after[a_rows.at[i]] = a_num.at[i] * k
        for i in range(p_rows.n):
            after[p_rows.at[i]] += p_num.at[i] * k
        if a_rows.n:
            for i in range(a_rows.n):
                if after[a_rows.at[i]] > width:
                    return (WIDTH, 0, a_rows.at[i], after[a_rows.at[i]], width)
        for i in range(p_rows.n):
            if after[p_rows.at[i]] > width:
                return (WIDTH, 0, p_rows.at[i], after[p_rows.at[i]], width)
        if n_rows.n:
            for i in range(n_rows.n):
                if n_blocks.at[i] < 0 or n_blocks.at[i] * k >= after[n_rows.at[i]]:
                    return (NULL_RANGE, i, n_blocks.at[i], n_rows.at[i],
                            after[n_rows.at[i]] // k)
        # every count in [0, width] in a sound table; refuse to write through one that is not
        if corrupt >= 0:
            raise ValueError(f"row {corrupt} holds count {cnt[corrupt]}, outside [0, "
                             f"{width}]: the table is corrupt")
        if not write:
            return _PASSED

        # ---- writes, in the update's order: cleared, added, appended, nulled ----------------
        if c_rows.n:
            for i in range(c_rows.n):
                row = c_rows.at[i]
                if mark[row]:
                    continue  # (a row listed twice is cleared and journaled once)
                mark[row] = 1
                old = cnt[row]
                for q in range(row * width, row * width + old):
                    tab[q] = NULL_BLOCK_ID
                _log(jour, capacity, jlen, offset + row * width, old)
                cnt[row] = 0
                dirt[row] = 1
            for i in range(c_rows.n):
                mark[c_rows.at[i]] = 0
        if a_rows.n:
            j = 0
            for i in range(a_rows.n):
                row = a_rows.at[i]
                old = cnt[row]
                new = a_num.at[i] * k
                start = row * width
                for q in range(a_num.at[i]):
                    b = a_ids.at[j + q]
                    for stop in range(k):
                        tab[start + q * k + stop] = 0 if b == NULL_BLOCK_ID else b * k + stop
                for q in range(start + new, start + old):
                    tab[q] = NULL_BLOCK_ID
                j += a_num.at[i]
                _log(jour, capacity, jlen, offset + start, new if new > old else old)
                cnt[row] = new
                dirt[row] = 1
        j = 0
        for i in range(p_rows.n):
            row = p_rows.at[i]
            start = row * width + cnt[row]
            for q in range(p_num.at[i]):
                b = p_ids.at[j + q]
                for stop in range(k):
                    tab[start + q * k + stop] = 0 if b == NULL_BLOCK_ID else b * k + stop
            j += p_num.at[i]
            _log(jour, capacity, jlen, offset + start, p_num.at[i] * k)
            cnt[row] += p_num.at[i] * k
            dirt[row] = 1
        if n_rows.n:
            for i in range(n_rows.n):
                start = n_rows.at[i] * width + n_blocks.at[i] * k
                for q in range(start, start + k):
                    tab[q] = NULL_BLOCK_ID
                _log(jour, capacity, jlen, offset + start, k)
                dirt[n_rows.at[i]] = 1
        return _PASSED


cdef bint _overlaps_any(uintptr_t start, Py_ssize_t nbytes, const uintptr_t* starts,
                       const Py_ssize_t* sizes, int n, int skip) noexcept:
    """Whether ``[start, start + nbytes)`` overlaps one of the ``n`` spans but ``skip``."""
    cdef int j
    for j in range(n):
        if j != skip and _overlap(<void*>start, nbytes, <void*>starts[j], sizes[j]):
            return True
    return False
