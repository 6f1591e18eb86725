# Python lists of token ids -> int64 arrays (included by _compiled.pyx).
#
# Each item is read after its index was checked against the list's size at that moment. An
# int is converted through the list's own reference (no Python code runs meanwhile, so nothing
# can drop it or change the list); any other item is held by a reference of its own, since its
# ``__index__`` is Python code that may change the list. Every length is checked again after
# such code ran and after the last item, and a change is an error (never a read or write past
# the end).

from cpython.long cimport PyLong_Check
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.number cimport PyIndex_Check, PyNumber_Index
from cpython.ref cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.sequence cimport PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS


cdef enum:
    _INTS_AHEAD = 16  # items whose int object is fetched while earlier ones are converted


cdef object _numpy():
    global _np
    if _np is None:
        import numpy
        _np = numpy
    return _np


cdef str _label(str name, Py_ssize_t which):
    """``name``, or ``name[which]`` for one list of a batch (``which >= 0``)."""
    return name if which < 0 else f"{name}[{which}]"


cdef inline int64_t _token_id(PyObject* item, str name, Py_ssize_t which,
                              Py_ssize_t j) except? -1:
    """Item ``j`` as int64: an int (bool included) or an object with ``__index__``, the set
    ``struct.pack("q", ...)`` accepts. An int outside the int64 range raises Cython's
    ``OverflowError``, which the caller names (one ``try`` per list, not per item).

    ``item`` is borrowed from its list, which the caller read it from after checking the
    index: an int's digits are read with no Python code running (nothing can drop it), and
    any other item is held by a reference of its own before its ``__index__`` runs."""
    if PyLong_Check(<object>item):
        return <int64_t><object>item  # Cython reads the digits
    return _index_token_id(<object>item, name, which, j)


cdef int64_t _index_token_id(object item, str name, Py_ssize_t which, Py_ssize_t j) except? -1:
    """:func:`_token_id` of an item that is not an int."""
    cdef object held = item  # a reference of our own: __index__ may drop the list's
    try:
        if not PyIndex_Check(held):
            raise TypeError("not an integer")
        value = PyNumber_Index(held)  # (a 1-element array's __index__ raises TypeError)
    except TypeError as exc:
        raise TypeError(f"{_label(name, which)} must hold int64 token ids: item {j} is a "
                        f"{type(held).__name__}: {exc}") from None
    return <int64_t>value


cdef int _raise_out_of_range(str name, Py_ssize_t which, Py_ssize_t j) except -1:
    raise OverflowError(f"{_label(name, which)} must hold int64 token ids: item {j} is "
                        "outside the int64 range") from None


cdef int _ints_into(object seq, int64_t[::1] out, Py_ssize_t at, Py_ssize_t n, str name,
                    Py_ssize_t which) except -1:
    """Write the ``n`` items of ``seq`` (an exact list or tuple) to ``out[at : at + n]``.

    Runs of ints are converted with no Python code running, so the sequence cannot change
    during a run: its length and item pointer are read again only after an item's
    ``__index__`` ran (and once at the end), and the output range is checked once."""
    cdef Py_ssize_t j = 0
    cdef PyObject** items
    cdef PyObject* item
    cdef int64_t* dst
    cdef bint is_tuple = type(seq) is tuple
    if at < 0 or n < 0 or n > out.shape[0] - at:
        raise ValueError(f"{_label(name, which)}: {n} ids do not fit at {at} of "
                         f"{out.shape[0]}")
    if is_tuple and PyTuple_GET_SIZE(seq) != n:  # immutable: one check of its length
        raise ValueError(f"{_label(name, which)} holds {len(seq)} ids, not {n}")
    if not n:
        return _same_size(seq, n, name, which)
    dst = &out[at]
    try:
        while j < n:
            if PySequence_Fast_GET_SIZE(seq) != n:  # (after an item's Python code ran)
                break
            items = PySequence_Fast_ITEMS(seq)  # (a list may have moved its items)
            while j < n:  # (j < n, and out[at : at + n] was checked above)
                item = items[j]
                if not PyLong_Check(<object>item):
                    break
                if j + _INTS_AHEAD < n:  # (an address only: a hint, nothing is read)
                    BT_PREFETCH(items[j + _INTS_AHEAD])
                dst[j] = <int64_t><object>item  # (Cython reads the digits; no Python code)
                j += 1
            if j < n:  # not an int: held by a reference of its own while __index__ runs
                dst[j] = _index_token_id(<object>item, name, which, j)
                j += 1
    except OverflowError:
        _raise_out_of_range(name, which, j)
    return _same_size(seq, n, name, which)


cdef int _same_size(object seq, Py_ssize_t n, str name, Py_ssize_t which) except -1:
    if len(seq) != n:
        raise RuntimeError(f"{_label(name, which)} changed size while it was converted (an "
                           "item's __index__ changed it)")
    return 0


def int64_from_ints(object values, str name not None):
    """A list or tuple of token ids as a new int64 array ``[len(values)]`` (C-contiguous, on
    cpu, writable).

    The compiled twin of ``numpy.frombuffer(struct.pack(f"={n}q", *values), numpy.int64)``:
    it accepts the same items (ints, bools as 0 and 1, objects with ``__index__`` such as
    numpy integers) and gives the same array. ``values`` must be exactly a list or a tuple
    (a subclass may iterate differently: its caller converts it the plain way).

    Raises ``TypeError`` for another container or an item that is not an integer, and
    ``OverflowError`` for an item outside the int64 range, each naming ``name`` and the item's
    index; ``values`` is only read.
    """
    if type(values) is not list and type(values) is not tuple:
        raise TypeError(f"{name} must be a list or tuple of ints, got {type(values).__name__}")
    cdef Py_ssize_t n = len(values)
    array = _numpy().empty(n, dtype=_np.int64)
    _ints_into(values, array, 0, n, name, -1)
    return array


def int64_from_int_lists(object lists, str name not None):
    """Many lists of token ids as one flat int64 array and its offsets, or ``None``.

    ``lists``: a list or tuple whose items are lists or tuples of token ids (each converted as
    by :func:`int64_from_ints`) or single ints (one token each). Returns ``(flat, offsets)``:
    ``flat`` int64 ``[offsets[-1]]`` holds item ``i``'s ids at ``flat[offsets[i] :
    offsets[i + 1]]``; ``offsets`` int64 ``[len(lists) + 1]``, starting at 0; both new,
    C-contiguous, on cpu. Returns ``None`` (nothing converted) when an item is of another type
    (an array, a tensor, a bool, a subclass): the caller converts such batches item by item.

    Raises ``TypeError`` when ``lists`` is not a list or tuple or a token id is not an
    integer, and ``OverflowError`` when one is outside the int64 range, naming
    ``name[i]`` and the item's index; ``lists`` is only read.
    """
    if type(lists) is not list and type(lists) is not tuple:
        raise TypeError(f"{name} must be a list or tuple, got {type(lists).__name__}")
    np = _numpy()
    cdef Py_ssize_t num_lists = len(lists), i, m, total = 0
    offsets = np.empty(num_lists + 1, dtype=np.int64)
    cdef int64_t[::1] offs = offsets
    for i in range(num_lists):
        item = lists[i]
        if type(item) is list or type(item) is tuple:
            m = len(item)
        elif type(item) is int:
            m = 1
        else:
            return None
        if m > PY_SSIZE_T_MAX - total:
            raise OverflowError(f"{name} holds more than {PY_SSIZE_T_MAX} token ids")
        offs[i] = total
        total += m
    offs[num_lists] = total
    flat = np.empty(total, dtype=np.int64)
    cdef int64_t[::1] out = flat
    for i in range(num_lists):
        if len(lists) != num_lists:
            break
        item = lists[i]
        m = <Py_ssize_t>(offs[i + 1] - offs[i])
        if type(item) is int:
            if m != 1:
                break
            try:
                out[offs[i]] = _token_id(<PyObject*>item, name, i, 0)  # (held by `item`)
            except OverflowError:
                _raise_out_of_range(name, i, 0)
        elif (type(item) is list or type(item) is tuple) and len(item) == m:
            _ints_into(item, out, <Py_ssize_t>offs[i], m, name, i)
        else:
            break
    else:
        if len(lists) == num_lists:
            return flat, offsets
    raise RuntimeError(f"{name} changed while it was converted (an item's __index__ changed "
                       "it)")
