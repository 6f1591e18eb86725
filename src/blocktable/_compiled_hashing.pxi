# The byte-chained block hashes (included by _compiled.pyx).

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, \
    PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcpy

cdef extern from *:
    """
    #ifdef BT_HAVE_OPENSSL
    /* the SHA256_* calls: a context on the stack, no allocation or algorithm fetch per block
       (OpenSSL 3's one-shot SHA256() and hashlib's calls both cost more than the hash) */
    #define OPENSSL_SUPPRESS_DEPRECATED 1
    #include <openssl/sha.h>
    #define BT_SHA256_BUILT 1
    static void bt_sha256(const void* a, size_t a_len, const void* b, size_t b_len,
                          const void* c, size_t c_len, void* out) {
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, a, a_len);
        SHA256_Update(&ctx, b, b_len);
        SHA256_Update(&ctx, c, c_len);
        SHA256_Final((unsigned char*)out, &ctx);
    }
    #else
    #define BT_SHA256_BUILT 0
    static void bt_sha256(const void* a, size_t a_len, const void* b, size_t b_len,
                          const void* c, size_t c_len, void* out) {}
    #endif
    static void bt_store_le64(unsigned char* out, const int64_t* values, Py_ssize_t n) {
    #if PY_LITTLE_ENDIAN
        memcpy(out, values, (size_t)n * 8);
    #else
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t v = (uint64_t)values[i];
            for (int b = 0; b < 8; b++) out[8 * i + b] = (unsigned char)(v >> (8 * b));
        }
    #endif
    }
    """
    const bint BT_SHA256_BUILT  # whether OpenSSL's SHA-256 was built in
    # n int64 as little-endian bytes (a copy on little-endian hosts)
    void bt_store_le64(unsigned char* out, const int64_t* values, Py_ssize_t n) noexcept nogil
    # SHA-256 of the bytes of a, then b, then c, into out (32 bytes)
    void bt_sha256(const void* a, size_t a_len, const void* b, size_t b_len, const void* c,
                   size_t c_len, void* out) noexcept nogil

cdef object _sha256_block_hash = None  # blocktable.block_hashing's, looked up at first use

SHA256_BUILT_IN = bool(BT_SHA256_BUILT)  # (for `blocktable --version` and the tests)


cdef bint _is_project_sha256(object hash_fn) except -1:
    global _sha256_block_hash
    if _sha256_block_hash is None:
        from blocktable.block_hashing import sha256_block_hash
        _sha256_block_hash = sha256_block_hash
    return hash_fn is _sha256_block_hash


cdef int64_t _index_arg(object value, str name) except? -1:
    """An integer argument as Python's slicing takes it (``__index__``: no float)."""
    if not PyIndex_Check(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    try:
        return <int64_t>PyNumber_Index(value)
    except OverflowError:
        raise OverflowError(f"{name}={value} is outside the int64 range") from None


cdef list _bytes_list(object values, str name, Py_ssize_t count):
    """A new list of ``values`` (a list or tuple of ``count`` bytes), checked."""
    if type(values) is not list and type(values) is not tuple:
        raise TypeError(f"{name} must be a list of bytes, got {type(values).__name__}")
    cdef list out = list(values)  # (ours: a hash_fn that changes the caller's list is harmless)
    if len(out) != count:
        raise ValueError(f"{name} has {len(out)} entries, segment_lengths {count}")
    for value in out:
        if not PyBytes_Check(value):
            raise TypeError(f"{name} must hold bytes, got {type(value).__name__}")
    return out


def byte_chain(object tokens, object segment_lengths, object parents, object namespaces,
               object block_size, object hash_fn):
    """Byte-chained hashes of several segments of blocks, each after its own parent; the
    compiled twin of :func:`blocktable.block_hashing.byte_chain_python`, equal to it for
    every input it accepts.

    ``tokens``: int64 ``[n * block_size]`` (C-contiguous, native byte order; only read), the
    ``n`` blocks of every segment back to back; segment ``r`` is ``segment_lengths[r]`` blocks
    (int64 ``[m]``, >= 0, summing to ``n``) after ``parents[r]`` with ``namespaces[r]`` (lists
    or tuples of ``m`` bytes). Block ``i`` is hashed as ``hash_fn(parent + little-endian token
    bytes + namespace)``, its digest the next block's parent. ``hash_fn``:
    ``callable(bytes) -> bytes``, called as is, except that
    :func:`~blocktable.block_hashing.sha256_block_hash` is done by OpenSSL's SHA-256 here
    where the build found OpenSSL (``SHA256_BUILT_IN``). Returns the ``n`` digests, a list of
    bytes.

    Raises ``TypeError`` for a wrong argument type (a float for an integer included) or a
    digest that is not bytes, ``OverflowError`` for an integer outside the int64 range, and
    ``ValueError`` when ``block_size < 1``, the tokens are not whole blocks, the lengths are
    negative or do not sum to the blocks, or the lists' lengths disagree (all but the digests
    checked before the first hash).
    """
    cdef const int64_t[::1] tok = _int64_in(tokens, "tokens")
    cdef const int64_t[::1] lengths = _int64_in(segment_lengths, "segment_lengths")
    cdef Py_ssize_t m = lengths.shape[0]
    cdef list parent_list = _bytes_list(parents, "parents", m)
    cdef list namespace_list = _bytes_list(namespaces, "namespaces", m)
    cdef int64_t bs = _index_arg(block_size, "block_size")
    if not callable(hash_fn):
        raise TypeError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
    if bs < 1:
        raise ValueError(f"block_size must be at least 1, got {bs}")
    if tok.shape[0] % bs:
        raise ValueError(f"tokens has {tok.shape[0]} entries, not whole blocks of {bs}")
    cdef Py_ssize_t n = <Py_ssize_t>(tok.shape[0] // bs), r, total = 0
    for r in range(m):
        if lengths[r] < 0 or lengths[r] > n - total:
            raise ValueError(f"segment_lengths must be >= 0 and sum to the {n} blocks: "
                             f"segment_lengths[{r}] is {lengths[r]} after {total}")
        total += <Py_ssize_t>lengths[r]
    if total != n:
        raise ValueError(f"segment_lengths sum to {total}, not the {n} blocks of tokens")
    cdef bint sha256 = BT_SHA256_BUILT and _is_project_sha256(hash_fn)
    # n >= 1 blocks of bs int64 exist when a block is hashed: bs * 8 fits then
    cdef Py_ssize_t step = <Py_ssize_t>bs * 8 if n else 0
    cdef Py_ssize_t parent_len, ns_len, size, i, at = 0
    cdef unsigned char* data
    cdef unsigned char* token_bytes = NULL  # SHA-256 built in: one block's token bytes
    cdef list out = []
    if sha256 and n:
        token_bytes = <unsigned char*>PyMem_Malloc(step)
        if token_bytes == NULL:
            raise MemoryError()
    try:
        for r in range(m):
            parent, namespace = parent_list[r], namespace_list[r]
            ns_len = PyBytes_GET_SIZE(namespace)
            for i in range(<Py_ssize_t>lengths[r]):
                parent_len = PyBytes_GET_SIZE(parent)
                if parent_len > PY_SSIZE_T_MAX - step - ns_len:
                    raise OverflowError(f"the input of block {at} is longer than "
                                        f"{PY_SSIZE_T_MAX} bytes")
                if sha256:
                    data = token_bytes
                else:
                    size = parent_len + step + ns_len
                    block = PyBytes_FromStringAndSize(NULL, size)  # filled before it is seen
                    data = <unsigned char*>PyBytes_AS_STRING(block)
                    memcpy(data, PyBytes_AS_STRING(parent), parent_len)
                    data += parent_len
                bt_store_le64(data, &tok[at * bs], bs)  # (at < n: a whole block of tok)
                data += step
                if sha256:
                    digest = PyBytes_FromStringAndSize(NULL, 32)  # filled before it is seen
                    bt_sha256(PyBytes_AS_STRING(parent), parent_len, token_bytes, step,
                              PyBytes_AS_STRING(namespace), ns_len, PyBytes_AS_STRING(digest))
                else:
                    memcpy(data, PyBytes_AS_STRING(namespace), ns_len)
                    digest = hash_fn(block)
                    if not PyBytes_Check(digest):
                        raise TypeError(
                            f"hash_fn must return bytes, got {type(digest).__name__}")
                out.append(digest)
                parent = digest
                at += 1
    finally:
        PyMem_Free(token_bytes)
    return out


# ---------------------------------------------------------------- the fast chained block keys
cdef inline uint64_t[::1] _uint64_out(object value, str name) except *:
    if value is None:  # (a memoryview would take None as an empty array)
        raise TypeError(f"{name} must be an array, got None")
    try:
        return value
    except (ValueError, TypeError, BufferError) as exc:
        raise TypeError(
            f"{name} must be a writable C-contiguous 1-D native uint64 array: {exc}") from None


cdef inline uint64_t _fmix64(uint64_t k) noexcept:
    k ^= k >> 33
    k *= <uint64_t>0xFF51AFD7ED558CCD
    k ^= k >> 33
    k *= <uint64_t>0xC4CEB9FE1A85EC53
    return k ^ (k >> 33)


def token_chain_keys(object tokens, object segment_lengths, object start_states,
                     object token_powers, object block_base, object keys, object states):
    """The chained block keys of several segments of blocks into ``keys`` and ``states``; the
    compiled twin of :func:`blocktable.block_hashing.chain_keys` after
    :func:`~blocktable.block_hashing.block_content_hashes`, equal to them for every input it
    accepts.

    ``tokens``: int64 ``[n * bs]``, the ``n`` blocks of ``bs = len(token_powers)`` tokens of
    every segment back to back (read as uint64); segment ``r`` is ``segment_lengths[r]``
    (int64, >= 0, summing to ``n``) blocks long and continues from ``start_states[r]`` (uint64).
    Block ``i``: ``h = sum_j tokens[i * bs + j] * token_powers[j]``, ``K = K * block_base + h``
    (mod 2**64, ``K`` the state of the block before, or the segment's start state), then
    ``states[i] = K`` and ``keys[i] = fmix64(K)``. Inputs are only read (read-only accepted);
    ``keys`` and ``states`` (uint64 ``[n]``, writable, overlapping no input nor each other) are
    written, only once every argument was checked.

    Raises ``TypeError`` for an array of the wrong kind (dtype, byte order, dimensions,
    contiguity, writability) or a ``block_base`` that is not an integer, ``ValueError`` for
    sizes that disagree, a negative length, a ``block_base`` outside ``[0, 2**64)``, no token
    powers, or outputs that overlap.
    """
    cdef const int64_t[::1] tok = _int64_in(tokens, "tokens")
    cdef const int64_t[::1] lengths = _int64_in(segment_lengths, "segment_lengths")
    cdef const uint64_t[::1] starts = _uint64_in(start_states, "start_states")
    cdef const uint64_t[::1] powers = _uint64_in(token_powers, "token_powers")
    cdef uint64_t[::1] out_keys = _uint64_out(keys, "keys")
    cdef uint64_t[::1] out_states = _uint64_out(states, "states")
    if not PyIndex_Check(block_base):
        raise TypeError(f"block_base must be an integer, got {type(block_base).__name__}")
    base_value = PyNumber_Index(block_base)
    if not 0 <= base_value < 2**64:
        raise ValueError(f"block_base must lie in [0, 2**64), got {base_value}")
    cdef uint64_t base = <uint64_t>base_value
    cdef Py_ssize_t bs = powers.shape[0], n = out_keys.shape[0], m = lengths.shape[0]
    if bs < 1:
        raise ValueError("token_powers must hold at least one power (the block size)")
    if out_states.shape[0] != n:
        raise ValueError(f"states has {out_states.shape[0]} entries, keys {n}")
    # (no product of two sizes: tokens must hold exactly n blocks)
    if tok.shape[0] % bs or tok.shape[0] // bs != n:
        raise ValueError(f"tokens has {tok.shape[0]} entries, not the {n} blocks of {bs} that "
                         f"keys has room for")
    if starts.shape[0] != m:
        raise ValueError(f"start_states has {starts.shape[0]} entries, segment_lengths {m}")
    cdef Py_ssize_t r, j, total = 0
    for r in range(m):
        if lengths[r] < 0 or lengths[r] > n - total:
            raise ValueError(f"segment_lengths must be >= 0 and sum to {n}: "
                             f"segment_lengths[{r}] is {lengths[r]} after {total}")
        total += <Py_ssize_t>lengths[r]
    if total != n:
        raise ValueError(f"segment_lengths sum to {total}, not {n}")
    # the outputs may overlap no input and not each other (an input read after an output was
    # written would change the keys)
    cdef Py_ssize_t out_bytes = n * 8  # (n uint64 exist)
    cdef const void* outs[2]
    cdef const void* ins[4]
    cdef Py_ssize_t in_bytes[4]
    outs[0] = &out_keys[0] if n else NULL
    outs[1] = &out_states[0] if n else NULL
    ins[0], in_bytes[0] = (&tok[0] if n else NULL), tok.shape[0] * 8
    ins[1], in_bytes[1] = (&lengths[0] if m else NULL), m * 8
    ins[2], in_bytes[2] = (&starts[0] if m else NULL), m * 8
    ins[3], in_bytes[3] = &powers[0], bs * 8
    if _overlap(outs[0], out_bytes, outs[1], out_bytes):
        raise ValueError("keys and states overlap")
    for r in range(2):
        for j in range(4):
            if _overlap(outs[r], out_bytes, ins[j], in_bytes[j]):
                raise ValueError(f"{('keys', 'states')[r]} overlaps an input")
    cdef Py_ssize_t i = 0, at = 0, end
    cdef uint64_t k, h
    # (the lengths were checked to sum to n, so i < n, at + j < n * bs = tok.shape[0] and
    # j < bs = powers.shape[0]: every index below is in range)
    with cython.boundscheck(False):
        for r in range(m):
            k = starts[r]
            end = i + <Py_ssize_t>lengths[r]
            while i < end:
                h = 0
                for j in range(bs):
                    h += <uint64_t>tok[at + j] * powers[j]
                at += bs
                k = k * base + h
                out_states[i] = k
                out_keys[i] = _fmix64(k)
                i += 1
