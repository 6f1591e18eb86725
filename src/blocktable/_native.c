/* blocktable._native: the per-step host loops of the captured step and the allocator,
 * compiled.
 *
 * An engine's step calls each of these once. In Python with numpy the same work is a dozen
 * numpy calls, each paying cold caches between steps; here it is one call. Every function
 * has a pure-numpy twin in the package (the fallback where this module is not built), and the
 * tests compare the two on random inputs.
 *
 * Arrays come through the buffer protocol: 1-D, C-contiguous, int32 ("i32") or int64 ("i64")
 * by item size. A wrong item size raises TypeError; a read-only output or a non-contiguous
 * array raises what the array's buffer export raises (numpy: ValueError or BufferError). Bad
 * values return a negative code, or raise, and write nothing the caller keeps (see each
 * function).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifndef _WIN32
#include <dlfcn.h>
#endif

#define PAD_SLOT_ID (-1)
#define NULL_BLOCK_ID 0

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static int get_buf(PyObject *obj, Buf *b, Py_ssize_t itemsize, int writable, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0)
        return -1;
    b->held = 1;
    if (b->view.itemsize != itemsize || b->view.ndim > 1) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D array of %zd-byte integers", name,
                     itemsize);
        return -1;
    }
    return 0;
}

/* An arena of block ids: int32 [num_rows, width], C-contiguous. */
static int get_arena(PyObject *obj, Buf *b)
{
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    b->held = 1;
    if (b->view.itemsize != 4 || b->view.ndim != 2) {
        PyErr_SetString(PyExc_TypeError, "arena must be a 2-D array of 4-byte integers");
        return -1;
    }
    return 0;
}

static void release(Buf *bufs, int n)
{
    for (int i = 0; i < n; i++)
        if (bufs[i].held)
            PyBuffer_Release(&bufs[i].view);
}

#define LEN(b) ((b).view.len / (b).view.itemsize)
#define I32(b) ((int32_t *)(b).view.buf)
#define I64(b) ((int64_t *)(b).view.buf)

static int wrong_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
    return 1;
}

/* The optional last argument of the stage functions: None, or an int32 buffer as long as
 * host at least (the CPU backend's device table) that gets every write host gets. */
static int get_mirror(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Buf *b,
                      Py_ssize_t host_len)
{
    if (nargs == want || args[want] == Py_None)
        return 0;
    if (get_buf(args[want], b, 4, 1, "mirror") < 0)
        return -1;
    if (LEN(*b) < host_len) {
        PyErr_SetString(PyExc_ValueError, "mirror is shorter than host");
        return -1;
    }
    return 0;
}

static int wrong_nargs_2(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs == want || nargs == want + 1)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd or %zd arguments (%zd given)", name, want,
                 want + 1, nargs);
    return 1;
}

static int get_ints(PyObject *const *args, Py_ssize_t from, Py_ssize_t n, long long *out)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(args[from + i]);
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* stage_appends(host, pairs, rows, ids, width, k, table_offset, counts_offset, num_rows,
 *               id_bound[, mirror]) -> int
 *
 * Rows gaining one manager block each (rows int32 [n], distinct; ids int32 [n]): stage the
 * pairs into pairs (int32 [>= 2 * n * (k + 1)]: the n * (k + 1) flat indices, then their
 * values; for each row its k kernel-block entries, then after all rows the n counts) and write
 * them into host (int32, the flat host buffer: counts at counts_offset + row, the row's
 * entries at table_offset + row * width).
 *
 * With mirror (None, or an int32 buffer as long as host at least), every write to host is
 * made to mirror too.
 *
 * Returns n * (k + 1); or, with nothing written to host (pairs may be): -1 when a row has no
 * room for k more kernel blocks, -2 for an id outside [0, id_bound), -3 for a row outside
 * [0, num_rows), -4 for len(ids) != len(rows) or pairs too short.
 */
static PyObject *stage_appends(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs_2(nargs, 10, "stage_appends"))
        return NULL;
    long long v[6];
    if (get_ints(args, 4, 6, v) < 0)
        return NULL;
    const long long width = v[0], k = v[1], table_offset = v[2], counts_offset = v[3];
    const long long num_rows = v[4], id_bound = v[5];
    Buf b[5];
    memset(b, 0, sizeof b);
    long long result = 0;
    if (get_buf(args[0], &b[0], 4, 1, "host") < 0 || get_buf(args[1], &b[1], 4, 1, "pairs") < 0
        || get_buf(args[2], &b[2], 4, 0, "rows") < 0 || get_buf(args[3], &b[3], 4, 0, "ids") < 0
        || get_mirror(args, nargs, 10, &b[4], LEN(b[0])) < 0)
        goto fail;
    {
        int32_t *host = I32(b[0]), *pairs = I32(b[1]);
        const int32_t *rows = I32(b[2]), *ids = I32(b[3]);
        const Py_ssize_t n = LEN(b[2]), host_len = LEN(b[0]);
        const long long total = n * (k + 1);
        if (LEN(b[3]) != n || LEN(b[1]) < 2 * total || k < 1) {
            result = -4;
            goto done;
        }
        if (counts_offset < 0 || counts_offset + num_rows > host_len || table_offset < 0
            || table_offset + num_rows * width > host_len) {
            PyErr_SetString(PyExc_ValueError, "stage_appends: the layout lies outside host");
            goto fail;
        }
        int32_t *index = pairs, *value = pairs + total;
        for (Py_ssize_t i = 0; i < n; i++) {
            const long long row = rows[i], id = ids[i];
            if (row < 0 || row >= num_rows) {
                result = -3;
                goto done;
            }
            if (id < 0 || id >= id_bound) {
                result = -2;
                goto done;
            }
            const long long filled = host[counts_offset + row];
            if (filled < 0 || filled > width - k) {
                result = -1;
                goto done;
            }
            const long long start = table_offset + row * width + filled;
            for (long long j = 0; j < k; j++) {
                index[i * k + j] = (int32_t)(start + j);
                value[i * k + j] = id == NULL_BLOCK_ID ? NULL_BLOCK_ID : (int32_t)(id * k + j);
            }
            index[n * k + i] = (int32_t)(counts_offset + row);
            value[n * k + i] = (int32_t)(filled + k);
        }
        for (long long p = 0; p < total; p++)  /* every check passed: now the writes */
            host[index[p]] = value[p];
        if (b[4].held)
            for (long long p = 0; p < total; p++)
                I32(b[4])[index[p]] = value[p];
        result = total;
    }
done:
    release(b, 5);
    return PyLong_FromLongLong(result);
fail:
    release(b, 5);
    return NULL;
}

/* One part of stage_group: rows int32 [n], num int32 [n] (manager blocks per row), ids int32
 * [sum(num)]; for added rows the entries start at 0, for appended rows at the row's count. */
typedef struct {
    const int32_t *rows, *num, *ids;
    Py_ssize_t n, num_ids;
    int added;
} Part;

/* The checks and writes of stage_group and stage_packed: host int32 [host_len] (and mirror,
 * when not NULL, at least as long), pairs int32 [pairs_len]. Returns the number of pairs or a negative code as stage_group does; -100 with
 * an exception set for a layout that lies outside host (nothing written). */
static long long stage_parts(int32_t *host, int32_t *mirror, Py_ssize_t host_len,
                             int32_t *pairs, Py_ssize_t pairs_len, long long max_pairs,
                             const int32_t *cleared,
                             Py_ssize_t num_cleared, const Part parts[2], long long width,
                             long long k, long long table_offset, long long counts_offset,
                             long long num_rows, long long id_bound, const char *name)
{
    if (k < 1 || width < 0 || max_pairs < 0 || 2 * max_pairs > pairs_len) {
        PyErr_Format(PyExc_ValueError, "%s: k, width or max_pairs out of range", name);
        return -100;
    }
    if (counts_offset < 0 || counts_offset + num_rows > host_len || table_offset < 0
        || table_offset + num_rows * width > host_len) {
        PyErr_Format(PyExc_ValueError, "%s: the layout lies outside host", name);
        return -100;
    }
    /* pass 1: check everything and count the pairs */
    long long total = 0;
    for (Py_ssize_t i = 0; i < num_cleared; i++) {
        const long long row = cleared[i];
        if (row < 0 || row >= num_rows)
            return -3;
        const long long old = host[counts_offset + row];
        if (old < 0 || old > width)
            return -4;
        total += old + 1;
    }
    for (int p = 0; p < 2; p++) {
        const Part *part = &parts[p];
        long long at = 0;
        for (Py_ssize_t i = 0; i < part->n; i++) {
            const long long row = part->rows[i], num = part->num[i];
            if (row < 0 || row >= num_rows)
                return -3;
            if (num < 0 || at + num > part->num_ids)
                return -4;
            for (long long j = at; j < at + num; j++)
                if (part->ids[j] < 0 || part->ids[j] >= id_bound)
                    return -2;
            at += num;
            const long long old = host[counts_offset + row];
            if (old < 0 || old > width)
                return -4;
            const long long start = part->added ? 0 : old, end = start + num * k;
            if (end > width)
                return -1;
            total += num * k + 1 + (part->added && old > end ? old - end : 0);
        }
        if (at != part->num_ids)
            return -4;
    }
    if (total > max_pairs)
        return -5;
    /* pass 2: the pairs; every check passed */
    int32_t *index = pairs, *value = pairs + total;
    long long w = 0;
    for (Py_ssize_t i = 0; i < num_cleared; i++) {
        const long long row = cleared[i], old = host[counts_offset + row];
        for (long long e = 0; e < old; e++) {
            index[w] = (int32_t)(table_offset + row * width + e);
            value[w++] = NULL_BLOCK_ID;
        }
        index[w] = (int32_t)(counts_offset + row);
        value[w++] = 0;
    }
    for (int p = 0; p < 2; p++) {
        const Part *part = &parts[p];
        const int32_t *ids = part->ids;
        for (Py_ssize_t i = 0; i < part->n; i++) {
            const long long row = part->rows[i], num = part->num[i];
            const long long old = host[counts_offset + row];
            const long long start = part->added ? 0 : old, end = start + num * k;
            const long long base = table_offset + row * width;
            for (long long j = 0; j < num; j++, ids++)
                for (long long e = 0; e < k; e++) {
                    index[w] = (int32_t)(base + start + j * k + e);
                    value[w++] = *ids == NULL_BLOCK_ID ? NULL_BLOCK_ID : (int32_t)(*ids * k + e);
                }
            for (long long e = end; part->added && e < old; e++) {
                index[w] = (int32_t)(base + e);
                value[w++] = NULL_BLOCK_ID;
            }
            index[w] = (int32_t)(counts_offset + row);
            value[w++] = (int32_t)end;
        }
    }
    /* pass 3: the host table (and its mirror) */
    for (long long q = 0; q < total; q++)
        host[index[q]] = value[q];
    if (mirror != NULL)
        for (long long q = 0; q < total; q++)
            mirror[index[q]] = value[q];
    return total;
}

/* stage_group(host, pairs, max_pairs, cleared, add_rows, add_num, add_ids, app_rows, app_num,
 *             app_ids, width, k, table_offset, counts_offset, num_rows, id_bound[, mirror])
 *             -> int
 *
 * A step's update of one group whose rows are distinct across its parts (the allocator's
 * journal promises it): cleared rows lose their entries (set to the null block) and their
 * count; added rows get add_num[i] * k entries from 0 (their ids), the entries past them
 * that held ids become null; appended rows gain app_num[i] * k entries after their count.
 * Stages the pairs (indices, then values, as stage_appends) and writes them into host (and
 * mirror, as stage_appends does).
 *
 * Returns the number of pairs; or, with nothing written to host: -1 a row past its width,
 * -2 an id outside [0, id_bound), -3 a row outside [0, num_rows), -4 sizes that disagree
 * (ids against the counts, a negative count, a count outside the row), -5 more than max_pairs.
 */
static PyObject *stage_group(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs_2(nargs, 16, "stage_group"))
        return NULL;
    long long v[7];
    if (get_ints(args, 10, 6, v + 1) < 0 || get_ints(args, 2, 1, v) < 0)
        return NULL;
    static const char *names[] = {"host", "pairs", "cleared_rows", "added rows",
                                  "added counts", "added ids", "appended rows",
                                  "appended counts", "appended ids"};
    Buf b[10];
    memset(b, 0, sizeof b);
    long long result = 0;
    for (int i = 0; i < 9; i++)
        if (get_buf(args[i < 2 ? i : i + 1], &b[i], 4, i < 2, names[i]) < 0)
            goto fail;
    if (get_mirror(args, nargs, 16, &b[9], LEN(b[0])) < 0)
        goto fail;
    if (LEN(b[4]) != LEN(b[3]) || LEN(b[7]) != LEN(b[6])) {
        result = -4;
    } else {
        const Part parts[2] = {
            {I32(b[3]), I32(b[4]), I32(b[5]), LEN(b[3]), LEN(b[5]), 1},
            {I32(b[6]), I32(b[7]), I32(b[8]), LEN(b[6]), LEN(b[8]), 0},
        };
        result = stage_parts(I32(b[0]), b[9].held ? I32(b[9]) : NULL, LEN(b[0]), I32(b[1]),
                             LEN(b[1]), v[0], I32(b[2]), LEN(b[2]), parts, v[1], v[2], v[3],
                             v[4], v[5], v[6], "stage_group");
        if (result == -100)
            goto fail;
    }
    release(b, 10);
    return PyLong_FromLongLong(result);
fail:
    release(b, 10);
    return NULL;
}

/* stage_packed(host, pairs, max_pairs, data, sizes, width, k, table_offset, counts_offset,
 *              num_rows, id_bound[, mirror]) -> int
 *
 * stage_group of an update packed as diff_rows returns it: data (bytes, int32) holds the
 * cleared rows, added rows, added counts, appended rows, appended counts, appended ids, then
 * the added ids; sizes (a tuple of 6 ints) the lengths of the first six parts. The same
 * result codes (and mirror); -4 also for sizes that do not fit data.
 */
static PyObject *stage_packed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs_2(nargs, 11, "stage_packed"))
        return NULL;
    if (!PyBytes_Check(args[3]) || !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) != 6) {
        PyErr_SetString(PyExc_TypeError, "stage_packed: data must be bytes and sizes a tuple "
                                         "of 6 ints");
        return NULL;
    }
    long long v[7], n[6];
    if (get_ints(args, 5, 6, v + 1) < 0 || get_ints(args, 2, 1, v) < 0
        || get_ints(&PyTuple_GET_ITEM(args[4], 0), 0, 6, n) < 0)
        return NULL;
    Buf b[3];
    memset(b, 0, sizeof b);
    long long result = -4;
    if (get_buf(args[0], &b[0], 4, 1, "host") < 0 || get_buf(args[1], &b[1], 4, 1, "pairs") < 0
        || get_mirror(args, nargs, 11, &b[2], LEN(b[0])) < 0)
        goto fail;
    {
        const int32_t *data = (const int32_t *)PyBytes_AS_STRING(args[3]);
        const Py_ssize_t num_words = PyBytes_GET_SIZE(args[3]) / 4;
        long long at = 0;
        for (int i = 0; i < 6; i++) {
            if (n[i] < 0)
                goto done;
            at += n[i];
        }
        if (PyBytes_GET_SIZE(args[3]) % 4 || at > num_words || n[1] != n[2] || n[3] != n[4])
            goto done;
        const int32_t *cleared = data, *a_rows = cleared + n[0], *a_num = a_rows + n[1];
        const int32_t *p_rows = a_num + n[2], *p_num = p_rows + n[3], *p_ids = p_num + n[4];
        const int32_t *a_ids = p_ids + n[5];
        const Part parts[2] = {
            {a_rows, a_num, a_ids, n[1], num_words - at, 1},
            {p_rows, p_num, p_ids, n[3], n[5], 0},
        };
        result = stage_parts(I32(b[0]), b[2].held ? I32(b[2]) : NULL, LEN(b[0]), I32(b[1]),
                             LEN(b[1]), v[0], cleared, n[0], parts, v[1], v[2], v[3], v[4],
                             v[5], v[6], "stage_packed");
        if (result == -100)
            goto fail;
    }
done:
    release(b, 3);
    return PyLong_FromLongLong(result);
fail:
    release(b, 3);
    return NULL;
}

/* diff_rows(rows, gen, start_gen, row_len, start_len, arena) -> (bytes, sizes, one_each, most)
 *
 * The journal's diff of a few touched rows of one group (rows: a list of distinct ints in
 * [0, len(gen))): gen / start_gen int64 [num_rows] (each row's holder now and at its first
 * touch), row_len / start_len int64 [num_rows] (its blocks now and then), arena int32
 * [num_rows, width] (its block ids). A row whose holder left is cleared; a row held by another
 * holder is added (all its blocks); a row of the same holder that grew is appended (the blocks
 * past its old length). Returns the int32 buffer cleared rows, added rows, added counts,
 * appended rows, appended counts, appended ids, added ids (in the rows' order), the sizes of
 * its first six parts, whether every appended row gained one block, and the largest added
 * count (-1 for none).
 */
static PyObject *diff_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "diff_rows takes a list of rows and 5 arrays");
        return NULL;
    }
    static const char *names[] = {"gen", "start_gen", "row_len", "start_len"};
    Buf b[5];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    int32_t *out = NULL;
    for (int i = 0; i < 4; i++)
        if (get_buf(args[i + 1], &b[i], 8, 0, names[i]) < 0)
            goto done;
    if (get_arena(args[5], &b[4]) < 0)
        goto done;
    {
        const int64_t *gen = I64(b[0]), *start_gen = I64(b[1]);
        const int64_t *row_len = I64(b[2]), *start_len = I64(b[3]);
        const int32_t *arena = I32(b[4]);
        const Py_ssize_t num_rows = b[4].view.shape[0], width = b[4].view.shape[1];
        if (LEN(b[0]) < num_rows || LEN(b[1]) < num_rows || LEN(b[2]) < num_rows
            || LEN(b[3]) < num_rows) {
            PyErr_SetString(PyExc_ValueError, "diff_rows: arrays shorter than the arena");
            goto done;
        }
        const Py_ssize_t n = PyList_GET_SIZE(args[0]);
        /* pass 1: sort the rows and size the parts */
        Py_ssize_t num_cleared = 0, num_added = 0, num_appended = 0, add_ids = 0, app_ids = 0;
        long long most = -1;
        int one_each = 1;
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_ssize_t row = PyLong_AsSsize_t(PyList_GET_ITEM(args[0], i));
            if (row == -1 && PyErr_Occurred())
                goto done;
            if (row < 0 || row >= num_rows) {
                PyErr_Format(PyExc_IndexError, "diff_rows: row %zd outside [0, %zd)", row,
                             num_rows);
                goto done;
            }
            const int64_t live = gen[row], len = row_len[row], old = start_len[row];
            if (len < 0 || len > width || (live == start_gen[row] && old < 0)) {
                PyErr_SetString(PyExc_ValueError, "diff_rows: a row length outside the arena");
                goto done;
            }
            if (live == start_gen[row]) {
                if (live && len > old) {
                    num_appended++;
                    app_ids += len - old;
                    one_each &= len - old == 1;
                }
            } else if (live) {
                num_added++;
                add_ids += len;
                if (len > most)
                    most = len;
            } else {
                num_cleared++;
            }
        }
        const Py_ssize_t total = num_cleared + 2 * num_added + 2 * num_appended + app_ids + add_ids;
        out = PyMem_Malloc(total ? total * 4 : 4);
        if (out == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        /* pass 2: fill the parts */
        int32_t *cleared = out, *a_rows = cleared + num_cleared, *a_counts = a_rows + num_added;
        int32_t *p_rows = a_counts + num_added, *p_counts = p_rows + num_appended;
        int32_t *p_ids = p_counts + num_appended, *a_ids = p_ids + app_ids;
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_ssize_t row = PyLong_AsSsize_t(PyList_GET_ITEM(args[0], i));
            const int64_t live = gen[row], len = row_len[row], old = start_len[row];
            const int32_t *blocks = arena + row * width;
            if (live == start_gen[row]) {
                if (live && len > old) {
                    *p_rows++ = (int32_t)row;
                    *p_counts++ = (int32_t)(len - old);
                    for (int64_t j = old; j < len; j++)
                        *p_ids++ = blocks[j];
                }
            } else if (live) {
                *a_rows++ = (int32_t)row;
                *a_counts++ = (int32_t)len;
                for (int64_t j = 0; j < len; j++)
                    *a_ids++ = blocks[j];
            } else {
                *cleared++ = (int32_t)row;
            }
        }
        PyObject *data = PyBytes_FromStringAndSize((const char *)out, total * 4);
        if (data == NULL)
            goto done;
        result = Py_BuildValue("(N(nnnnnn)Ol)", data, num_cleared, num_added, num_added,
                               num_appended, num_appended, app_ids,
                               one_each ? Py_True : Py_False, (long)most);
    }
done:
    PyMem_Free(out);
    release(b, 5);
    return result;
}

/* A free queue as release_rows takes it: None, or a tuple (slots, position, tail) with slots
 * and position int32 (as queue_extend takes them) and tail an int in [0, len(slots)]. */
typedef struct {
    int given;
    int32_t *slots, *position;
    Py_ssize_t num_slots, num_ids;
    long long tail;
} Queue;

static int get_queue(PyObject *obj, Buf *b, Queue *q, const char *name)
{
    memset(q, 0, sizeof *q);
    if (obj == Py_None)
        return 0;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 3) {
        PyErr_Format(PyExc_TypeError, "%s must be None or a tuple (slots, position, tail)", name);
        return -1;
    }
    if (get_buf(PyTuple_GET_ITEM(obj, 0), &b[0], 4, 1, "slots") < 0
        || get_buf(PyTuple_GET_ITEM(obj, 1), &b[1], 4, 1, "position") < 0)
        return -1;
    q->tail = PyLong_AsLongLong(PyTuple_GET_ITEM(obj, 2));
    if (q->tail == -1 && PyErr_Occurred())
        return -1;
    q->given = 1;
    q->slots = I32(b[0]);
    q->position = I32(b[1]);
    q->num_slots = LEN(b[0]);
    q->num_ids = LEN(b[1]);
    if (q->tail < 0 || q->tail > q->num_slots) {
        PyErr_Format(PyExc_ValueError, "release_rows: the %s queue's tail is outside its slots",
                     name);
        return -1;
    }
    return 0;
}

/* release_rows(ref_counts, arena, rows, row_len, num_skipped[, record, cached, uncached])
 *     -> bytes, or with queues (int, int) or None
 *
 * Drop one reference per block of the rows being freed: ref_counts int32 [num_blocks], arena
 * int32 [num_rows, width] (each row's block ids), rows a list of distinct ints, row_len and
 * num_skipped int64 [num_rows] (a row's blocks are arena[row, skipped:len], read tail first).
 * The ids whose count reached 0, each once, in the order of their last reference (the order
 * the free queues take them in), are returned as int32 bytes.
 *
 * With queues (cached and uncached: None or (slots, position, tail), see get_queue) the freed
 * ids are queued instead, each queue taking its ids in that order: the k-th id a queue takes
 * gets slots[tail + k] = id and position[id] = tail + k. With record (int64 [num_blocks]) both
 * queues are given and an id goes to cached when record[id] >= 0, else to uncached; with record
 * None exactly one queue is given and takes every id. Returns (ids cached, ids uncached); or
 * None, with nothing changed, when a given queue's slots past its tail could not hold every
 * block of the rows (compact it, or take the bytes).
 *
 * A row, length or id outside its range, or a count that would fall below 0, raises with every
 * count (and queue) as it was.
 */
static PyObject *release_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if ((nargs != 5 && nargs != 8) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "release_rows takes 2 arrays, a list of rows and 2 "
                        "arrays, then optionally record, cached and uncached");
        return NULL;
    }
    const int queued = nargs == 8;
    Buf b[9];
    memset(b, 0, sizeof b);
    Queue q[2];
    memset(q, 0, sizeof q);
    PyObject *result = NULL;
    int32_t *bytes_out = NULL;
    if (get_buf(args[0], &b[0], 4, 1, "ref_counts") < 0
        || get_buf(args[3], &b[2], 8, 0, "row_len") < 0
        || get_buf(args[4], &b[3], 8, 0, "num_skipped") < 0)
        goto done;
    if (get_arena(args[1], &b[1]) < 0)
        goto done;
    if (queued) {
        if ((args[5] != Py_None && get_buf(args[5], &b[4], 8, 0, "record") < 0)
            || get_queue(args[6], &b[5], &q[0], "cached") < 0
            || get_queue(args[7], &b[7], &q[1], "uncached") < 0)
            goto done;
        const int split = args[5] != Py_None;
        if (split ? !(q[0].given && q[1].given) : q[0].given == q[1].given) {
            PyErr_SetString(PyExc_ValueError, "release_rows: give both queues with a record, "
                            "one without");
            goto done;
        }
    }
    {
        int32_t *ref_counts = I32(b[0]);
        const int32_t *arena = I32(b[1]);
        const int64_t *row_len = I64(b[2]), *num_skipped = I64(b[3]);
        const int64_t *record = b[4].held ? I64(b[4]) : NULL;
        const Py_ssize_t num_blocks = LEN(b[0]), num_rows = b[1].view.shape[0];
        const Py_ssize_t width = b[1].view.shape[1], n = PyList_GET_SIZE(args[2]);
        if (LEN(b[2]) < num_rows || LEN(b[3]) < num_rows) {
            PyErr_SetString(PyExc_ValueError, "release_rows: arrays shorter than the arena");
            goto done;
        }
        if ((record != NULL && LEN(b[4]) < num_blocks)
            || (q[0].given && q[0].num_ids < num_blocks)
            || (q[1].given && q[1].num_ids < num_blocks)) {
            PyErr_SetString(PyExc_ValueError, "release_rows: record or a position shorter "
                            "than ref_counts");
            goto done;
        }
        /* pass 1: check every row, length and id; count the references */
        Py_ssize_t total = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_ssize_t row = PyLong_AsSsize_t(PyList_GET_ITEM(args[2], i));
            if (row == -1 && PyErr_Occurred())
                goto done;
            if (row < 0 || row >= num_rows) {
                PyErr_Format(PyExc_IndexError, "release_rows: row %zd outside [0, %zd)", row,
                             num_rows);
                goto done;
            }
            const int64_t len = row_len[row], skip = num_skipped[row];
            if (skip < 0 || len > width || skip > (len > 0 ? len : 0)) {
                PyErr_SetString(PyExc_ValueError, "release_rows: a row length outside the arena");
                goto done;
            }
            for (int64_t j = skip; j < len; j++)
                if (arena[row * width + j] < 0 || arena[row * width + j] >= num_blocks) {
                    PyErr_SetString(PyExc_ValueError, "release_rows: a block id outside the pool");
                    goto done;
                }
            total += len - skip;
        }
        /* where freed ids go: out[0] (the cached queue's slots past its tail, or the bytes),
         * out[1] (the uncached queue's); slots past a tail are unused until it moves */
        int32_t *out[2] = {NULL, NULL};
        if (queued) {
            for (int k = 0; k < 2; k++)
                if (q[k].given) {
                    if (q[k].tail + total > q[k].num_slots || q[k].tail + total > INT32_MAX) {
                        result = Py_NewRef(Py_None);  /* no room: nothing changed */
                        goto done;
                    }
                    out[k] = q[k].slots + q[k].tail;
                }
            if (record == NULL && out[0] == NULL) {  /* one queue, given as uncached */
                out[0] = out[1];
                out[1] = NULL;
            }
        } else {
            bytes_out = PyMem_Malloc(total ? total * 4 : 4);
            if (bytes_out == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            out[0] = bytes_out;
        }
        /* pass 2: drop the references, tail first; undo them all if a count falls below 0 */
        Py_ssize_t freed[2] = {0, 0}, dropped = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_ssize_t row = PyLong_AsSsize_t(PyList_GET_ITEM(args[2], i));
            const int32_t *blocks = arena + row * width;
            for (int64_t j = row_len[row] - 1; j >= num_skipped[row]; j--) {
                const int32_t id = blocks[j];
                if (ref_counts[id] <= 0) {
                    for (Py_ssize_t r = 0; r <= i && dropped; r++) {  /* undo, in any order */
                        const Py_ssize_t row2 = PyLong_AsSsize_t(PyList_GET_ITEM(args[2], r));
                        const int32_t *blocks2 = arena + row2 * width;
                        for (int64_t j2 = row_len[row2] - 1; j2 >= num_skipped[row2] && dropped;
                             j2--, dropped--)
                            ref_counts[blocks2[j2]]++;
                    }
                    PyErr_Format(PyExc_RuntimeError, "release_rows: block %d has no reference "
                                 "left to drop", (int)id);
                    goto done;
                }
                dropped++;
                if (--ref_counts[id] == 0) {
                    const int k = record != NULL && record[id] < 0;
                    out[k][freed[k]++] = id;
                }
            }
        }
        if (!queued) {
            result = PyBytes_FromStringAndSize((const char *)bytes_out, freed[0] * 4);
            goto done;
        }
        if (record == NULL && !q[0].given) {  /* the one queue was uncached: report it so */
            freed[1] = freed[0];
            freed[0] = 0;
        }
        for (int k = 0; k < 2; k++)
            for (Py_ssize_t m = 0; m < freed[k]; m++)
                q[k].position[q[k].slots[q[k].tail + m]] = (int32_t)(q[k].tail + m);
        result = Py_BuildValue("(nn)", freed[0], freed[1]);
    }
done:
    PyMem_Free(bytes_out);
    release(b, 9);
    return result;
}

/* touch_rows(touched, start_gen, gen, stamp, rows, order) -> bool
 *
 * The step journal's first touch of rows whose requests leave now: touched, start_gen and gen
 * int64 [num_rows], rows a list of ints. For each row with touched[row] < stamp:
 * touched[row] = stamp, start_gen[row] = gen[row], and the row is appended to the list order.
 * Returns whether some row had touched[row] > stamp (a batch's row). A row outside every
 * array raises IndexError with nothing written.
 */
static PyObject *touch_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyList_Check(args[4]) || !PyList_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "touch_rows takes 3 arrays, a stamp, a list of rows "
                        "and the order list");
        return NULL;
    }
    long long stamp;
    if (get_ints(args, 3, 1, &stamp) < 0)
        return NULL;
    Buf b[3];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (get_buf(args[0], &b[0], 8, 1, "touched") < 0
        || get_buf(args[1], &b[1], 8, 1, "start_gen") < 0
        || get_buf(args[2], &b[2], 8, 0, "gen") < 0)
        goto done;
    {
        int64_t *touched = I64(b[0]), *start_gen = I64(b[1]);
        const int64_t *gen = I64(b[2]);
        Py_ssize_t num_rows = LEN(b[0]);
        if (LEN(b[1]) < num_rows)
            num_rows = LEN(b[1]);
        if (LEN(b[2]) < num_rows)
            num_rows = LEN(b[2]);
        PyObject *rows = args[4], *order = args[5];
        const Py_ssize_t n = PyList_GET_SIZE(rows);
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_ssize_t row = PyLong_AsSsize_t(PyList_GET_ITEM(rows, i));
            if (row == -1 && PyErr_Occurred())
                goto done;
            if (row < 0 || row >= num_rows) {
                PyErr_Format(PyExc_IndexError, "touch_rows: row %zd outside [0, %zd)", row,
                             num_rows);
                goto done;
            }
        }
        int stale = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(rows, i);
            const Py_ssize_t row = PyLong_AsSsize_t(item);
            if (touched[row] < stamp) {
                touched[row] = stamp;
                start_gen[row] = gen[row];
                if (PyList_Append(order, item) < 0)
                    goto done;
            } else if (touched[row] != stamp) {
                stale = 1;
            }
        }
        result = PyBool_FromLong(stale);
    }
done:
    release(b, 3);
    return result;
}

/* The key table's arrays (blocktable.allocator.keytable): entries int64 [capacity], a power
 * of two, each EMPTY (-1), DELETED (-2) or (tag << 32) | value with tag = key >> 33; the
 * keys filed per value, uint64 [num_values]. */
#define KEY_EMPTY (-1)
#define KEY_TAG_SHIFT 33

static int get_key_table(PyObject *const *args, Buf *b)
{
    if (get_buf(args[0], &b[0], 8, 1, "entries") < 0
        || get_buf(args[1], &b[1], 8, 1, "key_of_value") < 0)
        return -1;
    const Py_ssize_t capacity = LEN(b[0]);
    if (capacity < 1 || (capacity & (capacity - 1))) {
        PyErr_SetString(PyExc_ValueError, "entries' length must be a power of two");
        return -1;
    }
    return 0;
}

/* keys_insert(entries, key_of_value, where, keys, values) -> int
 *
 * File keys (uint64 [n]) with values (int64 [n], distinct, each below len(key_of_value) and
 * len(where) and 2**32), when no key is held and none repeats: each goes to the first free
 * position (EMPTY or DELETED) of its probe run from key & (capacity - 1), in order;
 * key_of_value[value] = key and where[value] = its position (where int64). Returns the number
 * of DELETED positions reused; or -1, with nothing changed, when a key is held or given twice.
 * A value outside, or a table too full to hold the keys, raises ValueError with nothing
 * changed (the Python table keeps itself at most half full).
 */
static PyObject *keys_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 5, "keys_insert"))
        return NULL;
    Buf b[5];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    int64_t *undo = NULL;
    if (get_key_table(args, b) < 0 || get_buf(args[2], &b[2], 8, 1, "where") < 0
        || get_buf(args[3], &b[3], 8, 0, "keys") < 0 || get_buf(args[4], &b[4], 8, 0, "values") < 0)
        goto done;
    {
        int64_t *entries = I64(b[0]), *where = I64(b[2]);
        uint64_t *key_of_value = (uint64_t *)b[1].view.buf;
        const uint64_t *keys = (const uint64_t *)b[3].view.buf;
        const int64_t *values = I64(b[4]);
        const Py_ssize_t n = LEN(b[3]), capacity = LEN(b[0]);
        const uint64_t mask = (uint64_t)capacity - 1;
        Py_ssize_t num_values = LEN(b[1]) < LEN(b[2]) ? LEN(b[1]) : LEN(b[2]);
        if (num_values > ((Py_ssize_t)1 << 32))
            num_values = (Py_ssize_t)1 << 32;
        if (LEN(b[4]) != n) {
            PyErr_SetString(PyExc_ValueError, "keys_insert: keys and values differ in length");
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (values[i] < 0 || values[i] >= num_values) {
                PyErr_Format(PyExc_ValueError, "keys_insert: value %lld outside [0, %zd)",
                             (long long)values[i], num_values);
                goto done;
            }
        /* pass 1: a key held before the call refuses it */
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint64_t key = keys[i];
            const int64_t tag = (int64_t)(key >> KEY_TAG_SHIFT);
            Py_ssize_t probed = 0;
            for (uint64_t pos = key & mask;; pos = (pos + 1) & mask) {
                const int64_t entry = entries[pos];
                if (entry == KEY_EMPTY)
                    break;
                if (entry >= 0 && (entry >> 32) == tag
                    && key_of_value[entry & 0xffffffff] == key) {
                    result = PyLong_FromLong(-1);
                    goto done;
                }
                if (++probed == capacity) {
                    PyErr_SetString(PyExc_ValueError, "keys_insert: the table has no empty "
                                    "position");
                    goto done;
                }
            }
        }
        undo = PyMem_Malloc((n ? n : 1) * 3 * sizeof(int64_t));  /* (pos, old entry, old key) */
        if (undo == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        /* pass 2: file in order; a key met again before its free position repeats */
        Py_ssize_t reused = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint64_t key = keys[i];
            const int64_t tag = (int64_t)(key >> KEY_TAG_SHIFT);
            uint64_t pos = key & mask;
            Py_ssize_t probed = 0;
            for (;; pos = (pos + 1) & mask) {
                const int64_t entry = entries[pos];
                if (entry < 0)
                    break;
                const int repeat = (entry >> 32) == tag && key_of_value[entry & 0xffffffff] == key;
                if (repeat || ++probed == capacity) {
                    for (Py_ssize_t r = i - 1; r >= 0; r--) {  /* undo, newest first */
                        entries[undo[3 * r]] = undo[3 * r + 1];
                        key_of_value[values[r]] = (uint64_t)undo[3 * r + 2];
                    }
                    if (repeat)
                        result = PyLong_FromLong(-1);
                    else
                        PyErr_SetString(PyExc_ValueError, "keys_insert: no room left for the "
                                        "keys");
                    goto done;
                }
            }
            undo[3 * i] = (int64_t)pos;
            undo[3 * i + 1] = entries[pos];
            undo[3 * i + 2] = (int64_t)key_of_value[values[i]];
            reused += entries[pos] != KEY_EMPTY;
            entries[pos] = (tag << 32) | values[i];
            key_of_value[values[i]] = key;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            where[values[i]] = undo[3 * i];
        result = PyLong_FromSsize_t(reused);
    }
done:
    PyMem_Free(undo);
    release(b, 5);
    return result;
}

/* keys_get(entries, key_of_value, keys, out) -> None
 *
 * out[i] = the value filed with keys[i] (uint64 [n]), or -1 where it is not held (out int64
 * [n]): the probe run from key & (capacity - 1), up to its first EMPTY position.
 */
static PyObject *keys_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 4, "keys_get"))
        return NULL;
    Buf b[4];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (get_buf(args[0], &b[0], 8, 0, "entries") < 0
        || get_buf(args[1], &b[1], 8, 0, "key_of_value") < 0
        || get_buf(args[2], &b[2], 8, 0, "keys") < 0 || get_buf(args[3], &b[3], 8, 1, "out") < 0)
        goto done;
    {
        const int64_t *entries = I64(b[0]);
        const uint64_t *key_of_value = (const uint64_t *)b[1].view.buf;
        const uint64_t *keys = (const uint64_t *)b[2].view.buf;
        int64_t *out = I64(b[3]);
        const Py_ssize_t n = LEN(b[2]), capacity = LEN(b[0]), num_values = LEN(b[1]);
        const uint64_t mask = (uint64_t)capacity - 1;
        if (capacity < 1 || (capacity & (capacity - 1))) {
            PyErr_SetString(PyExc_ValueError, "entries' length must be a power of two");
            goto done;
        }
        if (LEN(b[3]) != n) {
            PyErr_SetString(PyExc_ValueError, "keys_get: keys and out differ in length");
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint64_t key = keys[i];
            const int64_t tag = (int64_t)(key >> KEY_TAG_SHIFT);
            int64_t found = -1;
            Py_ssize_t probed = 0;
            for (uint64_t pos = key & mask; probed < capacity; pos = (pos + 1) & mask, probed++) {
                const int64_t entry = entries[pos];
                if (entry == KEY_EMPTY)
                    break;
                if (entry >= 0 && (entry >> 32) == tag && (entry & 0xffffffff) < num_values
                    && key_of_value[entry & 0xffffffff] == key) {
                    found = entry & 0xffffffff;
                    break;
                }
            }
            out[i] = found;
        }
        result = Py_NewRef(Py_None);
    }
done:
    release(b, 4);
    return result;
}

/* chain_prompts(prompts, block_size, token_powers, block_base, seeds, keys, states) -> None
 *
 * The fast block keys of every full block of several prompts (blocktable.allocator.hashing):
 * prompts a list of int64 arrays (token ids), token_powers uint64 [block_size] (B**(bs-1-j)),
 * block_base B**bs, seeds uint64 [len(prompts)] (each prompt's K_{-1}); keys and states uint64
 * [total full blocks] get, prompt after prompt, fmix64(K_i) and K_i, with
 * h_i = sum_j x[i*bs+j] * token_powers[j] and K_i = K_{i-1} * B**bs + h_i, all mod 2**64.
 * A length that disagrees raises ValueError before any write.
 */
static inline uint64_t fmix64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xFF51AFD7ED558CCDULL;
    k ^= k >> 33;
    k *= 0xC4CEB9FE1A85EC53ULL;
    return k ^ (k >> 33);
}

/* One chain of num_blocks blocks of tokens x (block after block) from state: keys and states. */
static void chain_run(const uint64_t *x, Py_ssize_t num_blocks, Py_ssize_t bs,
                      const uint64_t *powers, uint64_t block_base, uint64_t state,
                      uint64_t *keys, uint64_t *states)
{
    for (Py_ssize_t i = 0; i < num_blocks; i++, x += bs) {
        uint64_t h = 0;
        for (Py_ssize_t j = 0; j < bs; j++)  /* independent products: vectorizable */
            h += x[j] * powers[j];
        state = state * block_base + h;
        states[i] = state;
        keys[i] = fmix64(state);
    }
}

static PyObject *chain_prompts(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 7, "chain_prompts"))
        return NULL;
    if (!PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "prompts must be a list of int64 arrays");
        return NULL;
    }
    const Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    const unsigned long long block_base = PyLong_AsUnsignedLongLong(args[3]);
    if (block_base == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    PyObject *prompts = args[0];
    const Py_ssize_t num_prompts = PyList_GET_SIZE(prompts);
    Buf b[4];
    memset(b, 0, sizeof b);
    Buf *tok = NULL;
    PyObject *result = NULL;
    if (get_buf(args[2], &b[0], 8, 0, "token_powers") < 0
        || get_buf(args[4], &b[1], 8, 0, "seeds") < 0 || get_buf(args[5], &b[2], 8, 1, "keys") < 0
        || get_buf(args[6], &b[3], 8, 1, "states") < 0)
        goto done;
    if (bs < 1 || LEN(b[0]) != bs || LEN(b[1]) != num_prompts) {
        PyErr_SetString(PyExc_ValueError, "chain_prompts: token_powers must hold block_size "
                        "powers and seeds one per prompt");
        goto done;
    }
    tok = PyMem_Calloc(num_prompts ? num_prompts : 1, sizeof(Buf));
    if (tok == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t r = 0; r < num_prompts; r++) {
        if (get_buf(PyList_GET_ITEM(prompts, r), &tok[r], 8, 0, "prompts' entries") < 0)
            goto done;
        total += LEN(tok[r]) / bs;
    }
    if (LEN(b[2]) != total || LEN(b[3]) != total) {
        PyErr_Format(PyExc_ValueError, "chain_prompts: keys and states must hold the %zd full "
                     "blocks", total);
        goto done;
    }
    {
        const uint64_t *powers = (const uint64_t *)b[0].view.buf;
        const uint64_t *seeds = (const uint64_t *)b[1].view.buf;
        uint64_t *keys = (uint64_t *)b[2].view.buf, *states = (uint64_t *)b[3].view.buf;
        Py_ssize_t out = 0;
        for (Py_ssize_t r = 0; r < num_prompts; r++) {
            const Py_ssize_t num_blocks = LEN(tok[r]) / bs;
            chain_run((const uint64_t *)tok[r].view.buf, num_blocks, bs, powers, block_base,
                      seeds[r], keys + out, states + out);
            out += num_blocks;
        }
        result = Py_NewRef(Py_None);
    }
done:
    if (tok != NULL) {
        release(tok, (int)num_prompts);
        PyMem_Free(tok);
    }
    release(b, 4);
    return result;
}

/* file_records(slots, first_cid, parent_ids, block_ids, tokens, cid, parent, holder,
 *              index_tokens, record) -> None
 *
 * The prefix index's records of n new contents (blocktable.allocator.index): for each i,
 * with s = slots[i] (int64 [n], in [0, len(cid))) and b = block_ids[i] (int32 [n], in
 * [0, len(record))): cid[s] = first_cid + i, parent[s] = parent_ids[i] (int64 [n]),
 * holder[s] = b, the token row index_tokens[s] = tokens[i] (int64 [n * block_size] and
 * [len(cid) * block_size]) and record[b] = s. Every index and length is checked before the
 * first write (ValueError, nothing written).
 */
static PyObject *file_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 10, "file_records"))
        return NULL;
    long long first_cid;
    if (get_ints(args, 1, 1, &first_cid) < 0)
        return NULL;
    Buf b[9];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (get_buf(args[0], &b[0], 8, 0, "slots") < 0
        || get_buf(args[2], &b[1], 8, 0, "parent_ids") < 0
        || get_buf(args[3], &b[2], 4, 0, "block_ids") < 0
        || get_buf(args[4], &b[3], 8, 0, "tokens") < 0 || get_buf(args[5], &b[4], 8, 1, "cid") < 0
        || get_buf(args[6], &b[5], 8, 1, "parent") < 0
        || get_buf(args[7], &b[6], 4, 1, "holder") < 0)
        goto done;
    /* index_tokens: the 2-D token rows of the records, C-contiguous */
    if (PyObject_GetBuffer(args[8], &b[7].view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    b[7].held = 1;
    if (b[7].view.itemsize != 8) {
        PyErr_SetString(PyExc_TypeError, "index_tokens must hold 8-byte integers");
        goto done;
    }
    if (get_buf(args[9], &b[8], 8, 1, "record") < 0)
        goto done;
    {
        const int64_t *slots = I64(b[0]), *parent_ids = I64(b[1]), *tokens = I64(b[3]);
        const int32_t *block_ids = I32(b[2]);
        int64_t *cid = I64(b[4]), *parent = I64(b[5]), *index_tokens = I64(b[7]);
        int64_t *record = I64(b[8]);
        int32_t *holder = I32(b[6]);
        const Py_ssize_t n = LEN(b[0]), capacity = LEN(b[4]), num_blocks = LEN(b[8]);
        const Py_ssize_t bs = n ? LEN(b[3]) / n : 0;
        if (LEN(b[1]) != n || LEN(b[2]) != n || (n && LEN(b[3]) != n * bs)
            || LEN(b[5]) < capacity || LEN(b[6]) < capacity
            || (n && LEN(b[7]) != capacity * bs)) {
            PyErr_SetString(PyExc_ValueError, "file_records: lengths that disagree");
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (slots[i] < 0 || slots[i] >= capacity || block_ids[i] < 0
                || block_ids[i] >= num_blocks) {
                PyErr_SetString(PyExc_ValueError, "file_records: a slot or block id outside");
                goto done;
            }
        for (Py_ssize_t i = 0; i < n; i++) {
            const int64_t slot = slots[i];
            cid[slot] = first_cid + i;
            parent[slot] = parent_ids[i];
            holder[slot] = block_ids[i];
            memcpy(index_tokens + slot * bs, tokens + i * bs, (size_t)bs * 8);
            record[block_ids[i]] = slot;
        }
        result = Py_NewRef(Py_None);
    }
done:
    release(b, 9);
    return result;
}

/* chain_segments(tokens, block_size, token_powers, block_base, starts, lengths, keys,
 *                states) -> None
 *
 * chain_prompts for segments of blocks lying back to back in one int64 array: segment r is
 * lengths[r] (int64, >= 0) blocks continuing from state starts[r] (uint64). tokens holds
 * sum(lengths) * block_size ids; keys and states (uint64) get one entry per block. Lengths
 * that disagree raise ValueError before any write.
 */
static PyObject *chain_segments(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 8, "chain_segments"))
        return NULL;
    const Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred())
        return NULL;
    const unsigned long long block_base = PyLong_AsUnsignedLongLong(args[3]);
    if (block_base == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Buf b[6];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (get_buf(args[0], &b[0], 8, 0, "tokens") < 0
        || get_buf(args[2], &b[1], 8, 0, "token_powers") < 0
        || get_buf(args[4], &b[2], 8, 0, "starts") < 0
        || get_buf(args[5], &b[3], 8, 0, "lengths") < 0 || get_buf(args[6], &b[4], 8, 1, "keys") < 0
        || get_buf(args[7], &b[5], 8, 1, "states") < 0)
        goto done;
    {
        const int64_t *lengths = I64(b[3]);
        const Py_ssize_t num_segments = LEN(b[3]);
        Py_ssize_t total = 0;
        int bad = bs < 1 || LEN(b[1]) != bs || LEN(b[2]) != num_segments;
        for (Py_ssize_t r = 0; r < num_segments && !bad; r++) {
            bad = lengths[r] < 0;
            total += lengths[r];
        }
        if (bad || LEN(b[4]) != total || LEN(b[5]) != total || LEN(b[0]) != total * bs) {
            PyErr_SetString(PyExc_ValueError, "chain_segments: lengths that disagree");
            goto done;
        }
        const uint64_t *x = (const uint64_t *)b[0].view.buf, *powers = (uint64_t *)b[1].view.buf;
        const uint64_t *starts = (const uint64_t *)b[2].view.buf;
        uint64_t *keys = (uint64_t *)b[4].view.buf, *states = (uint64_t *)b[5].view.buf;
        Py_ssize_t out = 0;
        for (Py_ssize_t r = 0; r < num_segments; r++) {
            chain_run(x + out * bs, lengths[r], bs, powers, block_base, starts[r], keys + out,
                      states + out);
            out += lengths[r];
        }
        result = Py_NewRef(Py_None);
    }
done:
    release(b, 6);
    return result;
}

/* queue_extend(slots, position, ids, tail) -> int
 *
 * The free queue's extend by distinct ids (int32 or int64 [n], each in [0, len(position))):
 * slots[tail + j] = ids[j] and position[ids[j]] = tail + j (slots, position int32). Returns
 * the new tail; raises, with nothing written, for an id outside or no room past tail.
 */
static PyObject *queue_extend(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 4, "queue_extend"))
        return NULL;
    long long tail;
    if (get_ints(args, 3, 1, &tail) < 0)
        return NULL;
    Buf b[3];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (get_buf(args[0], &b[0], 4, 1, "slots") < 0 || get_buf(args[1], &b[1], 4, 1, "position") < 0)
        goto done;
    if (PyObject_GetBuffer(args[2], &b[2].view, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    b[2].held = 1;
    {
        const Py_ssize_t size = b[2].view.itemsize;
        if ((size != 4 && size != 8) || b[2].view.ndim > 1) {
            PyErr_SetString(PyExc_TypeError, "ids must be a 1-D array of 4- or 8-byte integers");
            goto done;
        }
        int32_t *slots = I32(b[0]), *position = I32(b[1]);
        const Py_ssize_t n = b[2].view.len / size, num_ids = LEN(b[1]);
        if (tail < 0 || tail + n > LEN(b[0]) || tail + n > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "queue_extend: no room for the ids past tail");
            goto done;
        }
        for (Py_ssize_t j = 0; j < n; j++) {
            const long long id = size == 4 ? (long long)((int32_t *)b[2].view.buf)[j]
                                           : (long long)((int64_t *)b[2].view.buf)[j];
            if (id < 0 || id >= num_ids) {
                PyErr_Format(PyExc_ValueError, "queue_extend: id %lld outside [0, %zd)", id,
                             num_ids);
                goto done;
            }
        }
        for (Py_ssize_t j = 0; j < n; j++) {
            const int32_t id = size == 4 ? ((int32_t *)b[2].view.buf)[j]
                                         : (int32_t)((int64_t *)b[2].view.buf)[j];
            slots[tail + j] = id;
            position[id] = (int32_t)(tail + j);
        }
        result = PyLong_FromLongLong(tail + n);
    }
done:
    release(b, 3);
    return result;
}

/* scatter(flat, pairs, n): flat[pairs[i]] = pairs[n + i] for i < n (int32 both). Every index
 * is checked against len(flat) before the first write: -1 (nothing written) for one outside,
 * else n. */
static PyObject *scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 3, "scatter"))
        return NULL;
    long long n;
    if (get_ints(args, 2, 1, &n) < 0)
        return NULL;
    Buf b[2];
    memset(b, 0, sizeof b);
    long long result = n;
    if (get_buf(args[0], &b[0], 4, 1, "flat") < 0 || get_buf(args[1], &b[1], 4, 0, "pairs") < 0)
        goto fail;
    {
        int32_t *flat = I32(b[0]);
        const int32_t *pairs = I32(b[1]);
        const Py_ssize_t len = LEN(b[0]);
        if (n < 0 || 2 * n > LEN(b[1])) {
            PyErr_SetString(PyExc_ValueError, "scatter: n must lie in [0, len(pairs) / 2]");
            goto fail;
        }
        for (long long i = 0; i < n; i++)
            if (pairs[i] < 0 || pairs[i] >= len) {
                result = -1;
                goto done;
            }
        for (long long i = 0; i < n; i++)
            flat[pairs[i]] = pairs[n + i];
    }
done:
    release(b, 2);
    return PyLong_FromLongLong(result);
fail:
    release(b, 2);
    return NULL;
}

/* The batch check of check_batch and prepare_batch: qsl[:num_reqs + 1] and, with rows not
 * NULL, rows[:num_rows_given]. 1 for a decode batch, 0 for another well-formed one, -1 for a
 * malformed qsl, -2 for a row outside [0, num_rows). */
static int batch_code(const int32_t *qsl, Py_ssize_t num_reqs, long long num_tokens,
                      const int32_t *rows, Py_ssize_t num_rows_given, long long num_rows)
{
    if (num_reqs < 0 || qsl[0] != 0 || qsl[num_reqs] != num_tokens)
        return -1;
    int decode = num_tokens == num_reqs;
    for (Py_ssize_t r = 0; r < num_reqs; r++) {
        if (qsl[r + 1] < qsl[r])
            return -1;
        decode &= qsl[r + 1] == r + 1;
    }
    for (Py_ssize_t r = 0; rows != NULL && r < num_rows_given; r++)
        if (rows[r] < 0 || rows[r] >= num_rows)
            return -2;
    return decode;
}

/* check_batch(qsl, rows, num_tokens, num_rows) -> int
 *
 * qsl int32 [num_reqs + 1], rows int32 [num_reqs] or None. Returns 1 when qsl is 0, 1, ...,
 * num_reqs and num_tokens == num_reqs (a decode batch), 0 for another well-formed batch (qsl
 * starts at 0, never decreases, ends at num_tokens), -1 for a malformed qsl, -2 for a row
 * outside [0, num_rows).
 */
static PyObject *check_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 4, "check_batch"))
        return NULL;
    long long v[2];
    if (get_ints(args, 2, 2, v) < 0)
        return NULL;
    Buf b[2];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    const int with_rows = args[1] != Py_None;
    if (get_buf(args[0], &b[0], 4, 0, "query_start_loc") < 0
        || (with_rows && get_buf(args[1], &b[1], 4, 0, "row_of_batch") < 0))
        goto done;
    {
        const Py_ssize_t num_reqs = LEN(b[0]) - 1;
        const Py_ssize_t given = !with_rows ? 0 : LEN(b[1]) < num_reqs ? LEN(b[1]) : num_reqs;
        result = PyLong_FromLong(batch_code(I32(b[0]), num_reqs, v[0],
                                            with_rows ? I32(b[1]) : NULL, given, v[1]));
    }
done:
    release(b, 2);
    return result;
}

/* prepare_batch(qsl, rows, num_reqs, num_tokens, num_rows, header, batch_words, seq) -> int
 *
 * check_batch of a batch staged at full capacity, then its padding and header, in one call:
 * qsl int32 [>= num_reqs + 1] and rows int32 [>= num_reqs] are the staging buffer's views;
 * the batch is qsl[:num_reqs + 1] and rows[:num_reqs]. Returns check_batch's code. When it is
 * >= 0 (well formed, rows inside): qsl[num_reqs + 1:] = num_tokens (padding requests own no
 * token), header[3] = batch_words and header[1] = seq (header int32 [4]: the step's batch
 * words and sequence number; the pair count, header[0], is the staging's to write). A refusal
 * (-1, -2) writes nothing.
 */
static PyObject *prepare_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 8, "prepare_batch"))
        return NULL;
    long long v[5];
    if (get_ints(args, 2, 3, v) < 0 || get_ints(args, 6, 2, v + 3) < 0)
        return NULL;
    const long long num_reqs = v[0], num_tokens = v[1], num_rows = v[2];
    Buf b[3];
    memset(b, 0, sizeof b);
    PyObject *result = NULL;
    if (get_buf(args[0], &b[0], 4, 1, "query_start_loc") < 0
        || get_buf(args[1], &b[1], 4, 0, "row_of_batch") < 0
        || get_buf(args[5], &b[2], 4, 1, "header") < 0)
        goto done;
    if (num_reqs < 0 || num_reqs + 1 > LEN(b[0]) || num_reqs > LEN(b[1]) || LEN(b[2]) < 4) {
        PyErr_SetString(PyExc_ValueError, "prepare_batch: num_reqs outside the staging views, "
                        "or a header shorter than 4");
        goto done;
    }
    {
        int32_t *qsl = I32(b[0]), *header = I32(b[2]);
        const int code = batch_code(qsl, num_reqs, num_tokens, I32(b[1]), num_reqs, num_rows);
        if (code >= 0) {
            const Py_ssize_t capacity = LEN(b[0]);
            for (Py_ssize_t r = num_reqs + 1; r < capacity; r++)
                qsl[r] = (int32_t)num_tokens;
            header[3] = (int32_t)v[3];
            header[1] = (int32_t)v[4];
        }
        result = PyLong_FromLongLong(code);
    }
done:
    release(b, 3);
    return result;
}

/* map_slots(table, positions, qsl, rows, out, width, block_size, num_rows) -> int
 *
 * One group's slot mapping of a checked batch: table int32 [num_rows * width] (the group's
 * table: the null block past each row's count), positions int64 [num_tokens], qsl int32
 * [num_reqs + 1] (well formed) or None for a decode batch (token t is request t), rows int32
 * [num_reqs] in [0, num_rows), out int64 [>= num_tokens]. The slot of a token at position p
 * of row r is id * block_size + p % block_size for id = table[r * width + p / block_size],
 * PAD_SLOT_ID where id is the null block.
 *
 * Returns 0; or -1 for a position outside [0, width * block_size) or a row outside the table
 * (the caller's general function handles both; out is partly written).
 */
static PyObject *map_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 8, "map_slots"))
        return NULL;
    long long v[3];
    if (get_ints(args, 5, 3, v) < 0)
        return NULL;
    const long long width = v[0], block_size = v[1], num_rows = v[2];
    Buf b[5];
    memset(b, 0, sizeof b);
    long long result = 0;
    const int decode = args[2] == Py_None;
    if (get_buf(args[0], &b[0], 4, 0, "table") < 0 || get_buf(args[1], &b[1], 8, 0, "positions") < 0
        || (!decode && get_buf(args[2], &b[2], 4, 0, "query_start_loc") < 0)
        || get_buf(args[3], &b[3], 4, 0, "rows") < 0 || get_buf(args[4], &b[4], 8, 1, "out") < 0)
        goto fail;
    {
        const int32_t *table = I32(b[0]), *rows = I32(b[3]);
        const int64_t *positions = I64(b[1]);
        int64_t *out = I64(b[4]);
        const Py_ssize_t num_tokens = LEN(b[1]), num_reqs = LEN(b[3]);
        const long long bound = width * block_size;
        if (block_size < 1 || num_rows * width > LEN(b[0]) || LEN(b[4]) < num_tokens
            || (decode ? num_reqs < num_tokens : LEN(b[2]) != num_reqs + 1)) {
            PyErr_SetString(PyExc_ValueError, "map_slots: arrays of inconsistent sizes");
            goto fail;
        }
        const int32_t *qsl = decode ? NULL : I32(b[2]);
        const int pow2 = (block_size & (block_size - 1)) == 0;
        int shift = 0;
        while (pow2 && (1LL << shift) < block_size)
            shift++;
        for (Py_ssize_t r = 0; r < (decode ? num_tokens : num_reqs); r++) {
            const long long row = rows[r];
            if (row < 0 || row >= num_rows) {
                result = -1;
                goto done;
            }
            const int32_t *entries = table + row * width;
            Py_ssize_t t = decode ? r : qsl[r], end = decode ? r + 1 : qsl[r + 1];
            if (t < 0 || end > num_tokens) {
                result = -1;
                goto done;
            }
            for (; t < end; t++) {
                const int64_t pos = positions[t];
                if (pos < 0 || pos >= bound) {
                    result = -1;
                    goto done;
                }
                const int64_t block = pow2 ? pos >> shift : pos / block_size;
                const int64_t offset = pow2 ? pos & (block_size - 1) : pos % block_size;
                const int64_t id = entries[block];
                out[t] = id == NULL_BLOCK_ID ? PAD_SLOT_ID : id * block_size + offset;
            }
        }
    }
done:
    release(b, 5);
    return PyLong_FromLongLong(result);
fail:
    release(b, 5);
    return NULL;
}

/* ---------------------------------------------------------------- CUDA graph launch
 *
 * torch's CUDAGraph.replay() reaches the driver through pybind, a GIL release, a device guard,
 * a driver-version query and the runtime API: with the CPU caches cold (as they are after a
 * model's forward) that costs several microseconds more than the driver's own launch. These
 * two functions call the driver directly, through the libcuda the process has loaded already
 * (torch loads it with CUDA's first use; this module never loads it itself, so importing it
 * on a machine without CUDA does nothing).
 */
typedef int (*cu_ctx_get_current_t)(void **);
typedef int (*cu_graph_launch_t)(void *, void *);
typedef int (*cu_get_error_name_t)(int, const char **);
static cu_ctx_get_current_t cu_ctx_get_current;
static cu_graph_launch_t cu_graph_launch;
static cu_get_error_name_t cu_get_error_name;

/* 1 once the driver's functions are resolved, 0 where the process has not loaded libcuda. */
static int load_driver(void)
{
    if (cu_graph_launch != NULL)
        return 1;
#ifdef _WIN32
    return 0;
#else
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        return 0;
    cu_ctx_get_current = (cu_ctx_get_current_t)dlsym(lib, "cuCtxGetCurrent");
    cu_get_error_name = (cu_get_error_name_t)dlsym(lib, "cuGetErrorName");
    cu_graph_launch_t launch = (cu_graph_launch_t)dlsym(lib, "cuGraphLaunch");
    if (cu_ctx_get_current == NULL || launch == NULL)
        return 0;
    cu_graph_launch = launch;
    return 1;
#endif
}

/* cuda_context() -> int
 *
 * The calling thread's current CUDA context (a CUcontext as an int; 0 when none is current),
 * or -1 where the process has not loaded the CUDA driver or the driver refused the query.
 */
static PyObject *cuda_context(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 0, "cuda_context"))
        return NULL;
    void *context = NULL;
    if (!load_driver() || cu_ctx_get_current(&context) != 0)
        return PyLong_FromLong(-1);
    return PyLong_FromVoidPtr(context);
}

/* graph_launch(graph_exec, stream, context) -> int
 *
 * Launch an instantiated CUDA graph (graph_exec: a CUgraphExec as an int, as torch's
 * CUDAGraph.raw_cuda_graph_exec() gives it) on stream (a CUstream as an int, 0 for the
 * default stream), when context (from cuda_context()) is the calling thread's current one.
 * Returns 0 once launched; -1, launching nothing, when the driver is not loaded or another
 * context (or none) is current: the caller replays through torch, which makes the graph's
 * device current. A driver error raises RuntimeError with its name.
 */
static PyObject *graph_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 3, "graph_launch"))
        return NULL;
    void *handles[3];
    for (int i = 0; i < 3; i++) {
        handles[i] = PyLong_AsVoidPtr(args[i]);
        if (handles[i] == NULL && PyErr_Occurred())
            return NULL;
    }
    void *current = NULL;
    if (!load_driver() || handles[2] == NULL || cu_ctx_get_current(&current) != 0
        || current != handles[2])
        return PyLong_FromLong(-1);
    const int err = cu_graph_launch(handles[0], handles[1]);
    if (err != 0) {
        const char *name = NULL;
        if (cu_get_error_name == NULL || cu_get_error_name(err, &name) != 0)
            name = NULL;
        PyErr_Format(PyExc_RuntimeError, "cuGraphLaunch failed: %s (CUresult %d)",
                     name ? name : "unknown error", err);
        return NULL;
    }
    return PyLong_FromLong(0);
}

static PyMethodDef methods[] = {
    {"stage_appends", (PyCFunction)(void (*)(void))stage_appends, METH_FASTCALL,
     "Stage and write rows gaining one block each (see the module source)."},
    {"stage_group", (PyCFunction)(void (*)(void))stage_group, METH_FASTCALL,
     "Stage and write a one-group update of distinct rows (see the module source)."},
    {"stage_packed", (PyCFunction)(void (*)(void))stage_packed, METH_FASTCALL,
     "stage_group of an update packed as diff_rows returns it (see the module source)."},
    {"diff_rows", (PyCFunction)(void (*)(void))diff_rows, METH_FASTCALL,
     "The journal's diff of a few touched rows of one group (see the module source)."},
    {"release_rows", (PyCFunction)(void (*)(void))release_rows, METH_FASTCALL,
     "Drop the references of the freed rows' blocks; the ids that reached 0, or queue them (see "
     "the source)."},
    {"touch_rows", (PyCFunction)(void (*)(void))touch_rows, METH_FASTCALL,
     "The journal's first touch of leaving rows; whether a batch's row was among them."},
    {"keys_insert", (PyCFunction)(void (*)(void))keys_insert, METH_FASTCALL,
     "File absent, distinct keys in the key table; -1 (nothing changed) if one is held."},
    {"keys_get", (PyCFunction)(void (*)(void))keys_get, METH_FASTCALL,
     "The key table's value of each key, -1 where absent."},
    {"chain_prompts", (PyCFunction)(void (*)(void))chain_prompts, METH_FASTCALL,
     "The fast block keys and chain states of several prompts' full blocks."},
    {"file_records", (PyCFunction)(void (*)(void))file_records, METH_FASTCALL,
     "Write the prefix index's records of new contents and the blocks' record slots."},
    {"chain_segments", (PyCFunction)(void (*)(void))chain_segments, METH_FASTCALL,
     "The fast block keys and chain states of segments of blocks lying back to back."},
    {"queue_extend", (PyCFunction)(void (*)(void))queue_extend, METH_FASTCALL,
     "The free queue's extend by distinct ids: slots and positions in one pass."},
    {"scatter", (PyCFunction)(void (*)(void))scatter, METH_FASTCALL,
     "flat[pairs[:n]] = pairs[n:2n], every index checked first."},
    {"check_batch", (PyCFunction)(void (*)(void))check_batch, METH_FASTCALL,
     "1 for a decode batch, 0 for another well-formed one, -1 bad qsl, -2 bad row."},
    {"prepare_batch", (PyCFunction)(void (*)(void))prepare_batch, METH_FASTCALL,
     "Check a staged batch, pad its query start locations and write the step header's words."},
    {"map_slots", (PyCFunction)(void (*)(void))map_slots, METH_FASTCALL,
     "One group's slot mapping of a checked batch; -1: the general function must map it."},
    {"cuda_context", (PyCFunction)(void (*)(void))cuda_context, METH_FASTCALL,
     "The calling thread's current CUDA context as an int (0: none), -1 without the driver."},
    {"graph_launch", (PyCFunction)(void (*)(void))graph_launch, METH_FASTCALL,
     "Launch a CUDA graph exec on a stream through the driver; -1: not launched (see source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "blocktable._native",
    "The captured step's per-step host loops, compiled (optional: numpy twins stand in).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
