# cython: language_level=3, boundscheck=True, wraparound=False, initializedcheck=True
# cython: cdivision=True, embedsignature=True
"""The compiled host loops of a step: the batch check, one group's update, the commit's pairs,
the CPU backend's slot mapping and captured-step launch, the allocator journal's diff of the
changed rows, the conversion of Python lists of token ids, the byte-chained block hashes
(SHA-256 by OpenSSL where the build found it), the fast chained block keys, the prefix
index's key table, and the captured step's CUDA graph launch through the driver.

Typed memoryviews check each array's kind, item size, byte order, dimensions and contiguity
(``int32_t[::1]`` accepts exactly a C-contiguous 1-D native int32 buffer: no float, unsigned,
byte-swapped, object or strided array), and ``const`` marks the inputs, so a read-only input is
accepted and a read-only output refused. A step update's nine arrays, new every step, are held
as plain buffers with the same checks made by hand (one function: the request asks for a
C-contiguous buffer, then its dimensions, item size and format, one native signed 32-bit
integer, are checked), which costs a cold step far less code than nine memoryviews. Every
size and offset is checked against its buffer before the first write, with 64-bit arithmetic
that cannot overflow for the checked ranges, and the output may not overlap an input. Bounds
checking stays on (the default) everywhere but in loops whose every index is below a bound
checked above them: the update's checks and writes, the commit's pairs and the journal's diff
(which read and write through their arrays' first items: each row below the row count or
width every bound array was checked to have when bound, each count checked against its array
just above, each length against the arena it indexes), the batch check's loop (its indices
below a request count checked against its arrays just above) and the block keys' loop (its
segment lengths checked to sum to the block count every array holds). Python
lists of token ids are read item by item below their length (checked before the first read and
again after any item's Python code ran) into an output range checked once before the loop.

Each piece has a numpy twin that gives the same results bit for bit for every input the piece
accepts (the tests compare them on random inputs): :mod:`blocktable._host_loops`,
:func:`blocktable.slot_mapping.torch_impl.slot_mapping_numpy` (after ``numpy.put`` of the
pairs, for the captured step's launch), the numpy diff in
:class:`blocktable.allocator.journal.StepJournal`, ``struct.pack`` in
:func:`blocktable.token_ids.int64_from_ints_python`,
:func:`blocktable.block_hashing.byte_chain_python`,
:func:`~blocktable.block_hashing.chain_keys` after
:func:`~blocktable.block_hashing.block_content_hashes`, the ``dict`` of
:class:`blocktable.key_table.DictKeyTable`, and torch's ``CUDAGraph.replay`` of the same graph.
"""

cimport cython
import sys
from cython.view cimport array as cvarray
from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t

cdef extern from "Python.h":
    const Py_ssize_t PY_SSIZE_T_MAX

cdef object _np = None  # numpy, imported at the first journal diff (not by `--help`)

cdef enum:
    PAD_SLOT_ID = -1
    NULL_BLOCK_ID = 0
    INT32_MAX = 2147483647


cdef inline const int32_t[::1] _int32_in(object value, str name) except *:
    if value is None:  # (a memoryview would take None as an empty array)
        raise TypeError(f"{name} must be an array, got None")
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(f"{name} must be a C-contiguous 1-D native int32 array: {exc}") from None


cdef inline const int64_t[::1] _int64_in(object value, str name) except *:
    if value is None:  # (a memoryview would take None as an empty array)
        raise TypeError(f"{name} must be an array, got None")
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(f"{name} must be a C-contiguous 1-D native int64 array: {exc}") from None


cdef inline int64_t[::1] _int64_out(object value, str name) except *:
    if value is None:  # (a memoryview would take None as an empty array)
        raise TypeError(f"{name} must be an array, got None")
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


cdef inline int _bound_once(bint bound, str name) except -1:
    """Refuse a second ``__init__``: a rebinding that failed part way would leave the object
    holding views of two bindings, of sizes checked against neither."""
    if bound:
        raise TypeError(f"a {name} is bound once, at construction; make a new one")
    return 0


cdef inline int _check_bound(bint bound, str name) except -1:
    """Refuse a call on an object whose ``__init__`` never completed."""
    if not bound:
        raise ValueError(f"this {name} was never bound: its __init__ did not complete")
    return 0


include "_compiled_slots.pxi"
include "_compiled_pairs.pxi"
include "_compiled_update.pxi"
include "_compiled_graph.pxi"
include "_compiled_journal.pxi"
include "_compiled_keys.pxi"
include "_compiled_tokens.pxi"
include "_compiled_hashing.pxi"
