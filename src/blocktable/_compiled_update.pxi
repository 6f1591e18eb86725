# One group's step update, checked then written (included by _compiled.pyx).

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


cdef enum:  # the nine arrays of one group's update, in the order apply() takes them
    C_ROWS = 0
    A_ROWS = 1
    A_NUM = 2
    A_IDS = 3
    P_ROWS = 4
    P_NUM = 5
    P_IDS = 6
    N_ROWS = 7
    N_BLOCKS = 8
    NUM_PARTS = 9


# The update's arrays are read through pointers, each below its length (the view the caller
# holds fixes both); every row or id read from them that indexes a bound array does so through
# that array's bounds-checked view, so no value, even one changed since it was checked, can
# reach outside it.

cdef tuple _rows_in_range(const int32_t* rows, Py_ssize_t n, Py_ssize_t num_rows, int part):
    cdef Py_ssize_t i
    for i in range(n):  # i < n, the length of rows
        if rows[i] < 0 or rows[i] >= num_rows:
            return (ROW_RANGE, part, i, rows[i], num_rows)
    return None


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

    An update's empty parts are usually one shared empty array (the allocator's): the last
    empty int32 array taken is remembered, and that same object passed again reuses its
    (empty) view instead of being taken again. It holds nothing to read or write, so nothing
    done to it in between can matter.
    """

    cdef int32_t[::1] tab
    cdef int32_t[::1] cnt
    cdef int64_t[::1] after
    cdef unsigned char[::1] mark
    cdef unsigned char[::1] dirt
    cdef int64_t[:, ::1] jour
    cdef int64_t[::1] jlen
    cdef int64_t width, k, max_id, offset
    cdef Py_ssize_t num_rows, jour_cap
    cdef bint bound  # __init__ completed: the pointers below are set (and never reset)
    # the journal's first entries (NULL where empty), for _log: the views above hold the
    # buffers for the writer's life and are never rebound
    cdef int64_t* jour_p
    cdef int64_t* jlen_p
    cdef uintptr_t out_start[7]  # the bound arrays' memory: (first byte, size in bytes)
    cdef Py_ssize_t out_bytes[7]
    cdef object empty  # the last empty array taken (None at first), and its view
    cdef const int32_t[::1] empty_view
    cdef PairStager stager  # the table's pair stager, for apply_and_stage (None: unbound)
    cdef object staged_a  # the last two staging arrays taken (None at first), and their views
    cdef object staged_b
    cdef int32_t[::1] staged_view_a
    cdef int32_t[::1] staged_view_b
    cdef int32_t* staged_ptr_a  # and their first entries and lengths
    cdef int32_t* staged_ptr_b
    cdef Py_ssize_t staged_len_a, staged_len_b

    def __init__(self, object table, object counts, int64_t width, int64_t k, int64_t max_id,
                 int64_t offset, object scratch, object seen, object dirty, object journal,
                 object journal_len):
        _bound_once(self.bound, "GroupWriter")
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
        self.num_rows, self.jour_cap = num_rows, self.jour.shape[0]
        self.jour_p = &self.jour[0, 0] if self.jour_cap else NULL
        self.jlen_p = &self.jlen[0]
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
        cdef const int32_t* ptr[NUM_PARTS]  # each array's first entry and length; the views
        cdef Py_ssize_t num[NUM_PARTS]  # below hold the buffers for the call
        cdef const int32_t[::1] c_rows = self._take(cleared, "cleared", ptr, num, C_ROWS)
        cdef const int32_t[::1] a_rows = self._take(add_rows, "add_rows", ptr, num, A_ROWS)
        cdef const int32_t[::1] a_num = self._take(add_num, "add_num", ptr, num, A_NUM)
        cdef const int32_t[::1] a_ids = self._take(add_ids, "add_ids", ptr, num, A_IDS)
        cdef const int32_t[::1] p_rows = self._take(app_rows, "app_rows", ptr, num, P_ROWS)
        cdef const int32_t[::1] p_num = self._take(app_num, "app_num", ptr, num, P_NUM)
        cdef const int32_t[::1] p_ids = self._take(app_ids, "app_ids", ptr, num, P_IDS)
        cdef const int32_t[::1] n_rows = self._take(null_rows, "null_rows", ptr, num, N_ROWS)
        cdef const int32_t[::1] n_blocks = self._take(null_blocks, "null_blocks", ptr, num,
                                                      N_BLOCKS)
        if not _parts_paired(num):
            raise ValueError("each part's rows and counts (or block indices) must have one "
                             "entry per row")
        if self._overlapping(ptr, num, NULL, 0):
            raise ValueError("an update array overlaps the table's own arrays")
        return self._apply(ptr, num, write)

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
        and the one entry of each of ``added``, ``appended`` and ``nulled`` (int32 arrays).
        Returns the number of pairs; -1 when they exceed ``capacity`` (the update is written,
        nothing staged: the changes wait for the table's commit); -2, nothing written, when
        the update is refused or is not one group's int32 arrays (:meth:`apply` of converted
        arrays names why). A bad ``staging`` or ``capacity`` raises."""
        if self.stager is None:  # (set only by bind_stager, on a bound writer)
            raise ValueError("apply_and_stage needs bind_stager() first")
        cdef Py_ssize_t out_len
        cdef int32_t* out
        cdef const int32_t* ptr[NUM_PARTS]  # as in apply()
        cdef Py_ssize_t num[NUM_PARTS]
        cdef const int32_t[::1] c_rows, a_rows, a_num, a_ids, p_rows, p_num, p_ids
        cdef const int32_t[::1] n_rows, n_blocks
        try:
            added, appended, nulled = update.added, update.appended, update.nulled
            if len(added) != 1 or len(appended) != 1 or len(nulled) != 1:
                return -2
            a, p, z = added[0], appended[0], nulled[0]
            c_rows = self._take(update.cleared_rows, "cleared", ptr, num, C_ROWS)
            a_rows = self._take(a.rows, "add_rows", ptr, num, A_ROWS)
            a_num = self._take(a.num_manager_blocks, "add_num", ptr, num, A_NUM)
            a_ids = self._take(a.block_ids, "add_ids", ptr, num, A_IDS)
            p_rows = self._take(p.rows, "app_rows", ptr, num, P_ROWS)
            p_num = self._take(p.num_manager_blocks, "app_num", ptr, num, P_NUM)
            p_ids = self._take(p.block_ids, "app_ids", ptr, num, P_IDS)
            n_rows = self._take(z.rows, "null_rows", ptr, num, N_ROWS)
            n_blocks = self._take(z.block_indices, "null_blocks", ptr, num, N_BLOCKS)
        except (TypeError, ValueError, AttributeError, IndexError):
            return -2
        if not _parts_paired(num):
            return -2
        # the staging buffer last: no Python code runs from here to the fill, so no other
        # call can replace the remembered view that holds it
        out = self._staging(staging, capacity, &out_len)
        if self._overlapping(ptr, num, out, out_len * 4):
            raise ValueError("an update array overlaps the table's own arrays or staging")
        if self._apply(ptr, num, True)[0] != OK:
            return -2
        return self.stager._fill(out, out_len, capacity)

    cdef int32_t* _staging(self, object staging, int64_t capacity,
                           Py_ssize_t* length) except NULL:
        """``staging``'s first entry and (in ``length``) its entries, checked
        (:meth:`PairStager._staging`, and against this writer's arrays): room for a header
        and ``capacity`` pairs, so never empty. One of the last two arrays taken (a captured
        step's two staging buffers) is remembered with its view: as with the bound arrays,
        the view holds its buffer, and the array was writable and apart from every bound
        array when it was taken."""
        cdef int32_t[::1] out
        if staging is self.staged_a and staging is not None:
            length[0] = self.staged_len_a
            _check_capacity(length[0], capacity)
            return self.staged_ptr_a
        if staging is self.staged_b and staging is not None:
            length[0] = self.staged_len_b
            _check_capacity(length[0], capacity)
            return self.staged_ptr_b
        out = self.stager._staging(staging, capacity)  # (checks the capacity)
        if _overlaps_any(<uintptr_t>(&out[0]), out.shape[0] * 4, self.out_start,
                         self.out_bytes, 7, -1):
            raise ValueError("staging overlaps the table's own arrays")
        if self.staged_a is not None:
            self.staged_b, self.staged_view_b = self.staged_a, self.staged_view_a
            self.staged_ptr_b, self.staged_len_b = self.staged_ptr_a, self.staged_len_a
        self.staged_a, self.staged_view_a = staging, out
        self.staged_ptr_a, self.staged_len_a = &out[0], out.shape[0]
        length[0] = out.shape[0]
        return &out[0]

    cdef const int32_t[::1] _take(self, object value, str name, const int32_t** ptr,
                                  Py_ssize_t* num, int part) except *:
        """``value`` as an int32 view (:func:`_int32_in`; the remembered empty view for the
        remembered empty array), its first entry (NULL where empty) and length recorded in
        ``ptr[part]`` and ``num[part]``. The caller holds the view while it reads them."""
        cdef const int32_t[::1] view
        if value is self.empty and value is not None:
            view = self.empty_view
        else:
            view = _int32_in(value, name)
            if view.shape[0] == 0:
                self.empty, self.empty_view = value, view
        ptr[part] = &view[0] if view.shape[0] else NULL
        num[part] = view.shape[0]
        return view

    cdef bint _overlapping(self, const int32_t** ptr, const Py_ssize_t* num,
                           const void* staging, Py_ssize_t staging_bytes) noexcept:
        """Whether an update array overlaps a bound array or ``staging``."""
        cdef int i
        for i in range(NUM_PARTS):
            if _overlaps_any(<uintptr_t>ptr[i], num[i] * 4, self.out_start, self.out_bytes, 7,
                             -1) or _overlap(ptr[i], num[i] * 4, staging, staging_bytes):
                return True
        return False

    cdef tuple _blocks_ok(self, const int32_t* rows, const int32_t* num, Py_ssize_t n,
                          const int32_t* ids, Py_ssize_t num_ids, int part):
        """Rows (``n``) in range and listed once, counts (``n``) >= 0 summing to the ids'
        ``num_ids``, ids in ``[0, max_id)``. ``seen`` is left all 0."""
        cdef tuple res = _rows_in_range(rows, n, self.num_rows, part)
        if res is not None:
            return res
        cdef Py_ssize_t i, j
        cdef int64_t total = 0
        for i in range(n):
            if self.mark[rows[i]]:
                for j in range(i):
                    self.mark[rows[j]] = 0
                return (ROW_TWICE, part, i, rows[i], 0)
            self.mark[rows[i]] = 1
        for i in range(n):
            self.mark[rows[i]] = 0
        for i in range(n):
            if num[i] < 0:
                return (NEG_COUNT, part, i, num[i], 0)
            total += num[i]
        if total != num_ids:
            return (ID_SUM, part, num_ids, total, 0)
        for i in range(num_ids):
            if ids[i] < 0 or ids[i] >= self.max_id:
                return (ID_RANGE, part, i, ids[i], self.max_id)
        return None

    cdef int _counts_sound(self, const int32_t* rows, Py_ssize_t n) except -1:
        cdef Py_ssize_t i
        cdef int64_t count
        for i in range(n):
            count = self.cnt[rows[i]]
            if count < 0 or count > self.width:
                raise ValueError(f"row {rows[i]} holds count {count}, outside [0, "
                                 f"{self.width}]: the table is corrupt")
        return 0

    cdef void _log(self, int64_t start, int64_t length) noexcept:
        """Journal the run ``[start, start + length)`` (``offset`` added); past the journal's
        capacity, mark the overflow (``journal_len[0] = -1``)."""
        cdef int64_t* journal_len = self.jlen_p
        cdef int64_t runs = journal_len[0]
        if runs < 0 or length <= 0:
            return
        if runs + 1 > self.jour_cap or journal_len[1] + length > self.jour_cap:
            journal_len[0] = -1
            return
        self.jour_p[2 * runs] = self.offset + start  # runs < capacity: checked just above
        self.jour_p[2 * runs + 1] = length
        journal_len[0] = runs + 1
        journal_len[1] += length

    cdef int _write_blocks(self, int64_t start, const int32_t* ids, Py_ssize_t first,
                           Py_ssize_t count, Py_ssize_t num_ids) except -1:
        """The slots of blocks ``ids[first : first + count]`` into the table from ``start``
        (``k`` per block; the null block's slots 0). An index past ``num_ids`` reads as the
        null block: the counts summed to ``num_ids`` when checked, so only a change since can
        reach it, and it must not read outside the ids."""
        cdef Py_ssize_t q
        cdef int64_t b, stop, k = self.k
        for q in range(count):
            b = ids[first + q] if first + q < num_ids else NULL_BLOCK_ID
            for stop in range(k):
                self.tab[start + q * k + stop] = 0 if b == NULL_BLOCK_ID else b * k + stop
        return 0

    cdef tuple _apply(self, const int32_t** ptr, const Py_ssize_t* num, bint write):
        """Check, then (if it passed and ``write``) write, the update's nine arrays: ``ptr[i]``
        holds ``num[i]`` entries (the parts' rows and counts paired: :func:`_parts_paired`)."""
        cdef const int32_t* c_rows = ptr[C_ROWS]
        cdef const int32_t* a_rows = ptr[A_ROWS]
        cdef const int32_t* a_num = ptr[A_NUM]
        cdef const int32_t* a_ids = ptr[A_IDS]
        cdef const int32_t* p_rows = ptr[P_ROWS]
        cdef const int32_t* p_num = ptr[P_NUM]
        cdef const int32_t* p_ids = ptr[P_IDS]
        cdef const int32_t* n_rows = ptr[N_ROWS]
        cdef const int32_t* n_blocks = ptr[N_BLOCKS]
        cdef Py_ssize_t n_c = num[C_ROWS], n_a = num[A_ROWS], n_p = num[P_ROWS]
        cdef Py_ssize_t n_n = num[N_ROWS]
        cdef int64_t width = self.width, k = self.k
        # ---- checks (nothing written but the work space, which is restored) -----------------
        cdef tuple res = _rows_in_range(c_rows, n_c, self.num_rows, CLEARED)
        if res is None:
            res = self._blocks_ok(a_rows, a_num, n_a, a_ids, num[A_IDS], ADDED)
        if res is None:
            res = self._blocks_ok(p_rows, p_num, n_p, p_ids, num[P_IDS], APPENDED)
        if res is None:
            res = _rows_in_range(n_rows, n_n, self.num_rows, NULLED)
        if res is not None:
            return res
        cdef Py_ssize_t i, j, q
        cdef int64_t row, old, new, start
        for i in range(n_a):
            self.after[a_rows[i]] = self.cnt[a_rows[i]]
        for i in range(n_p):
            self.after[p_rows[i]] = self.cnt[p_rows[i]]
        for i in range(n_n):
            self.after[n_rows[i]] = self.cnt[n_rows[i]]
        for i in range(n_c):
            self.after[c_rows[i]] = 0
        for i in range(n_a):
            self.after[a_rows[i]] = a_num[i] * k
        for i in range(n_p):
            self.after[p_rows[i]] += p_num[i] * k
        for i in range(n_a):
            if self.after[a_rows[i]] > width:
                return (WIDTH, 0, a_rows[i], self.after[a_rows[i]], width)
        for i in range(n_p):
            if self.after[p_rows[i]] > width:
                return (WIDTH, 0, p_rows[i], self.after[p_rows[i]], width)
        for i in range(n_n):
            if n_blocks[i] < 0 or n_blocks[i] * k >= self.after[n_rows[i]]:
                return (NULL_RANGE, i, n_blocks[i], n_rows[i], self.after[n_rows[i]] // k)
        # every count in [0, width] in a sound table; refuse to write through one that is not
        self._counts_sound(c_rows, n_c)
        self._counts_sound(a_rows, n_a)
        self._counts_sound(p_rows, n_p)
        self._counts_sound(n_rows, n_n)
        if not write:
            return (OK, 0, 0, 0, 0)

        # ---- writes, in the update's order: cleared, added, appended, nulled ----------------
        for i in range(n_c):
            row = c_rows[i]
            if self.mark[row]:
                continue  # (a row listed twice is cleared and journaled once)
            self.mark[row] = 1
            old = self.cnt[row]
            for q in range(row * width, row * width + old):
                self.tab[q] = NULL_BLOCK_ID
            self._log(row * width, old)
            self.cnt[row] = 0
            self.dirt[row] = 1
        for i in range(n_c):
            self.mark[c_rows[i]] = 0
        j = 0
        for i in range(n_a):
            row = a_rows[i]
            old = self.cnt[row]
            new = a_num[i] * k
            start = row * width
            self._write_blocks(start, a_ids, j, a_num[i], num[A_IDS])
            for q in range(start + new, start + old):
                self.tab[q] = NULL_BLOCK_ID
            j += a_num[i]
            self._log(start, new if new > old else old)
            self.cnt[row] = new
            self.dirt[row] = 1
        j = 0
        for i in range(n_p):
            row = p_rows[i]
            start = row * width + self.cnt[row]
            self._write_blocks(start, p_ids, j, p_num[i], num[P_IDS])
            j += p_num[i]
            self._log(start, p_num[i] * k)
            self.cnt[row] += p_num[i] * k
            self.dirt[row] = 1
        for i in range(n_n):
            start = n_rows[i] * width + n_blocks[i] * k
            for q in range(start, start + k):
                self.tab[q] = NULL_BLOCK_ID
            self._log(start, k)
            self.dirt[n_rows[i]] = 1
        return (OK, 0, 0, 0, 0)


cdef inline bint _parts_paired(const Py_ssize_t* num) noexcept:
    """Whether each part's rows and counts (or block indices) have one entry per row."""
    return num[A_ROWS] == num[A_NUM] and num[P_ROWS] == num[P_NUM] and \
        num[N_ROWS] == num[N_BLOCKS]


cdef bint _overlaps_any(uintptr_t start, Py_ssize_t nbytes, const uintptr_t* starts,
                       const Py_ssize_t* sizes, int n, int skip) noexcept:
    """Whether ``[start, start + nbytes)`` overlaps one of the ``n`` spans but ``skip``."""
    cdef int j
    for j in range(n):
        if j != skip and _overlap(<void*>start, nbytes, <void*>starts[j], sizes[j]):
            return True
    return False
