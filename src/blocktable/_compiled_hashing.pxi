# The byte-chained block hashes (included by _compiled.pyx).

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, \
    PyBytes_GET_SIZE
from libc.string cimport memcpy

cdef object _sha256_block_hash = None  # blocktable.block_hashing's, looked up at first use
cdef object _sha256_new = None  # hashlib.sha256: what it calls


cdef bint _is_project_sha256(object hash_fn) except -1:
    global _sha256_block_hash, _sha256_new
    if _sha256_block_hash is None:
        import hashlib
        from blocktable.block_hashing import sha256_block_hash
        _sha256_block_hash, _sha256_new = sha256_block_hash, hashlib.sha256
    return hash_fn is _sha256_block_hash


cdef int64_t _index_arg(object value, str name) except? -1:
    """An integer argument as Python's slicing takes it (``__index__``: no float)."""
    if not PyIndex_Check(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    try:
        return <int64_t>PyNumber_Index(value)
    except OverflowError:
        raise OverflowError(f"{name}={value} is outside the int64 range") from None


def byte_chain(object tokens, object first, object stop, object block_size, object parent,
               object namespace_bytes, object hash_fn):
    """Byte-chained hashes of blocks ``first .. stop-1`` of ``tokens`` after ``parent``; the
    compiled twin of :func:`blocktable.block_hashing.byte_chain_python`, equal to it for every
    input it accepts.

    ``tokens``: int64 ``[n]`` (C-contiguous, native byte order; only read); block ``i`` is
    ``tokens[i * block_size : (i + 1) * block_size]``, hashed as ``hash_fn(parent +
    little-endian token bytes + namespace_bytes)``, its digest the next block's parent.
    ``parent`` and ``namespace_bytes``: bytes; ``hash_fn``: ``callable(bytes) -> bytes``,
    called as is, except that :func:`~blocktable.block_hashing.sha256_block_hash` is done by
    calling ``hashlib.sha256(data).digest()`` here. Returns the ``stop - first`` digests, a
    list of bytes.

    Raises ``TypeError`` for a wrong argument type (a float for an integer included) or a
    digest that is not bytes, ``OverflowError`` for an integer outside the int64 range, and
    ``ValueError`` when ``block_size < 1`` or ``0 <= first <= stop <= n // block_size``
    does not hold (all but the digests checked before the first hash).
    """
    cdef const int64_t[::1] tok = _int64_in(tokens, "tokens")
    cdef int64_t first_i = _index_arg(first, "first"), stop_i = _index_arg(stop, "stop")
    cdef int64_t bs = _index_arg(block_size, "block_size")
    if not PyBytes_Check(parent):
        raise TypeError(f"parent must be bytes, got {type(parent).__name__}")
    if not PyBytes_Check(namespace_bytes):
        raise TypeError(f"namespace_bytes must be bytes, got {type(namespace_bytes).__name__}")
    if not callable(hash_fn):
        raise TypeError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
    if bs < 1:
        raise ValueError(f"block_size must be at least 1, got {bs}")
    cdef int64_t num_full = tok.shape[0] // bs
    if not 0 <= first_i <= stop_i <= num_full:
        raise ValueError(f"blocks {first_i} .. {stop_i} must lie in [0, {num_full}] (tokens "
                         f"holds {num_full} full blocks of {bs})")
    cdef bint sha256 = _is_project_sha256(hash_fn)
    # block_size * 8 <= len(tokens) * 8 fits: a buffer of len(tokens) int64 exists
    cdef Py_ssize_t step = <Py_ssize_t>bs * 8, ns_len = PyBytes_GET_SIZE(namespace_bytes)
    cdef Py_ssize_t parent_len, size, i, k, b
    cdef int64_t value
    cdef unsigned char* data
    cdef list out = []
    for i in range(<Py_ssize_t>(stop_i - first_i)):
        parent_len = PyBytes_GET_SIZE(parent)
        if parent_len > PY_SSIZE_T_MAX - step - ns_len:
            raise OverflowError(f"the input of block {first_i + i} is longer than "
                                f"{PY_SSIZE_T_MAX} bytes")
        size = parent_len + step + ns_len
        block = PyBytes_FromStringAndSize(NULL, size)  # filled below, before anyone sees it
        data = <unsigned char*>PyBytes_AS_STRING(block)
        memcpy(data, PyBytes_AS_STRING(parent), parent_len)
        data += parent_len
        for k in range((first_i + i) * bs, (first_i + i + 1) * bs):
            value = tok[k]
            for b in range(8):  # little-endian on every host
                data[b] = <unsigned char>((<uint64_t>value) >> (8 * b))
            data += 8
        memcpy(data, PyBytes_AS_STRING(namespace_bytes), ns_len)
        if sha256:
            digest = _sha256_new(block).digest()
        else:
            digest = hash_fn(block)
        if not PyBytes_Check(digest):
            raise TypeError(f"hash_fn must return bytes, got {type(digest).__name__}")
        out.append(digest)
        parent = digest
    return out
