"""Chained block hashes: the fast vectorized one (the index key) and SHA-256 (identity).

Every full block ``i`` of a prompt gets a **block key**, a 64-bit chained hash of the whole
prefix up to the end of the block, namespace included::

    h_i = sum_j x[i*bs + j] * B**(bs-1-j)          (mod 2**64; x = token id as uint64)
    K_i = K_{i-1} * B**bs + h_i                    (K_{-1} = namespace seed)
    key_i = fmix64(K_i)                            (murmur3's 64-bit finalizer)

``K_i`` is the polynomial hash of the whole prefix, so the keys of ``n`` blocks cost a few
numpy passes over the tokens (no Python loop per block), and a chunk of a long prompt continues
from the last key instead of re-reading the prefix. The keys of several requests are computed
in one pass: the recurrence is a segmented scan (see :func:`chain_keys`).

The key is only a *name* for the prefix index; it is not trusted. A lookup shares a block only
when the block's stored token ids equal the prompt's and its stored parent content id equals
the content id found for the previous block (see :mod:`blocktable.allocator.index`), so a
colliding key costs a cache miss, never wrong KV. The key is deterministic (fixed constants, no
per-process seed) but not collision resistant: prompts built to collide only lose hits.

The **block hash** a pool reports for a cached block (``BlockPool.block_hash``) is selected by
``KVCacheManager(hash_fn=...)``:

* ``"fast"`` (default): the block key itself (a Python int < 2**64), the same in every process;
* ``"sha256"``: ``sha256(parent_hash + token_bytes + namespace_bytes)`` chained from
  :data:`ROOT_BLOCK_HASH`, token bytes little-endian int64 (32 bytes, collision resistant; about
  computed only in this mode, on top of the key);
* any ``callable(bytes) -> bytes``: the same chain with that function.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from blocktable import _compiled_loader as _loader
from blocktable._fastnp import count_nonzero

HashFn = Callable[[bytes], bytes]
"""``hash_fn(data) -> digest``; ``data`` is ``parent_hash + token_bytes + namespace_bytes``."""

BlockHash = int | bytes
"""A block hash as reported: an int for the fast hash, bytes for SHA-256 or a callable."""

ROOT_BLOCK_HASH: bytes = bytes(32)
"""The parent hash of the first block of every prompt (byte-chained hashes)."""

MASK64 = _MASK = (1 << 64) - 1
CHAIN_BASE = _BASE = 0x9E3779B97F4A7C15  # B, odd: invertible mod 2**64
_NAMESPACE_TYPES = (str, int, bytes)
_U64 = np.uint64
# 0-d arrays, not numpy scalars: a ufunc takes a 0-d array operand without the scalar
# conversion and promotion it does for a scalar)
_SHIFT33, _FMIX_C1, _FMIX_C2 = (
    np.array(c, dtype=_U64) for c in (33, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)
)


def sha256_block_hash(data: bytes) -> bytes:
    """SHA-256 of ``data`` (32 bytes, stable across processes)."""
    return hashlib.sha256(data).digest()


def check_namespace(namespace: object, name: str = "cache_namespace") -> None:
    """Check that ``namespace`` has a stable encoding: None, str, int, bytes or tuples of them.

    Bools and int subclasses (numpy ints) are rejected: ``True == 1`` would make two namespaces
    share blocks.
    """
    if namespace is None or type(namespace) in _NAMESPACE_TYPES:
        return
    if type(namespace) is tuple:
        for item in namespace:
            check_namespace(item, name)
        return
    raise TypeError(
        f"{name} must be None, str, int, bytes or a tuple of them, got {type(namespace).__name__}"
    )


def encode_namespace(namespace: object) -> bytes:
    """The bytes a namespace contributes to every block hash (``b""`` for None)."""
    check_namespace(namespace)
    return b"" if namespace is None else repr(namespace).encode("utf-8")


def namespace_seed(namespace_bytes: bytes) -> int:
    """``K_{-1}`` of the fast chain for a namespace (its encoding's first 8 blake2b bytes)."""
    digest = hashlib.blake2b(b"blocktable" + namespace_bytes, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def fmix64_int(k: int) -> int:
    """murmur3's 64-bit finalizer on a Python int (the reference of :func:`fmix64`)."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK
    return k ^ (k >> 33)


def fmix64(k: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer, elementwise on a uint64 array (a new array)."""
    out = k >> _SHIFT33
    out ^= k
    out *= _FMIX_C1
    shifted = out >> _SHIFT33
    out ^= shifted
    out *= _FMIX_C2
    np.right_shift(out, _SHIFT33, out=shifted)
    out ^= shifted
    return out


class ChainPowers:
    """Powers of ``B`` for one block size, grown on demand (uint64, on cpu).

    ``token_powers[j] = B**(bs-1-j)``; ``block_powers[k] = (B**bs)**k``,
    ``inverse_powers[k] = (B**bs)**-k`` and ``shifted_inverse_powers[k] = (B**bs)**(1-k)``
    mod 2**64 for ``k`` up to the longest scan so far.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.token_powers = np.array(
            [pow(_BASE, block_size - 1 - j, 1 << 64) for j in range(block_size)], dtype=_U64
        )
        self.block_base = pow(_BASE, block_size, 1 << 64)
        self.block_base_array = np.array(self.block_base, dtype=_U64)  # 0-d (see _SHIFT33)
        self.block_powers = np.ones(1, dtype=_U64)
        self.inverse_powers = np.ones(1, dtype=_U64)
        self.shifted_inverse_powers = np.full(1, self.block_base, dtype=_U64)  # Bb * Q**k

    def ensure(self, num_blocks: int) -> None:
        """Make the power tables hold at least ``num_blocks + 1`` entries."""
        if len(self.block_powers) > num_blocks:
            return
        size = max(num_blocks + 1, 2 * len(self.block_powers), 1024)
        self.block_powers = _power_table(self.block_base, size)
        self.inverse_powers = _power_table(pow(self.block_base, -1, 1 << 64), size)
        self.shifted_inverse_powers = self.inverse_powers * _U64(self.block_base)


def _power_table(base: int, size: int) -> np.ndarray:
    """``[base**0, ..., base**(size-1)]`` mod 2**64 (uint64; cumprod wraps like C)."""
    factors = np.full(size, base, dtype=_U64)
    factors[0] = 1
    return np.cumprod(factors, dtype=_U64)


def block_content_hashes(tokens: np.ndarray, powers: ChainPowers) -> np.ndarray:
    """``h_i`` of every row of ``tokens`` (int64 ``[n, block_size]``), uint64 ``[n]``."""
    # an integer matmul wraps mod 2**64 like the elementwise form, at half its cost; powers
    # times the transposed tokens (a row vector times a matrix) costs less than the product
    # the other way round (numpy's integer matmul loops over the output with less overhead)
    return np.matmul(powers.token_powers, tokens.view(_U64).T)


def chain_keys(
    content_hashes: np.ndarray,
    segment_lengths: np.ndarray,
    start_states: np.ndarray,
    powers: ChainPowers,
    segment_starts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Chain ``content_hashes`` per segment; return ``(keys, states)``, both uint64 ``[n]``.

    ``content_hashes`` (uint64 ``[n]``) are several requests' consecutive blocks, segment ``r``
    ``segment_lengths[r]`` long (int64, sum ``n``) and continuing from state ``start_states[r]``
    (uint64: ``K`` of the block before it, or the namespace seed). ``states[i]`` is ``K_i``;
    ``keys[i] = fmix64(K_i)``. One pass: with ``Q = (B**bs)**-1``,
    ``K_g = S_r * Bb**(g-s+1) + Bb**g * sum_{s<=g'<=g} h_g' * Q**g'`` for block ``g`` of a segment
    starting at ``s``. ``segment_starts`` (int64, optional): where each segment starts, if
    the caller has them.
    """
    n = len(content_hashes)
    # a decode step: as many segments as blocks, none empty (count_nonzero: cheaper than
    # comparing with 1; the lengths sum to n, so n nonzero lengths are all 1)
    if n and n == len(segment_lengths) and count_nonzero(segment_lengths) == n:
        states = start_states * powers.block_base_array
        states += content_hashes
        return fmix64(states), states
    powers.ensure(n)
    if n == 0:
        return content_hashes.copy(), content_hashes.copy()
    # running sums with a 0 in front: the sum before each segment is one gather
    running = np.empty(n + 1, dtype=_U64)
    running[0] = 0
    sums = running[1:]
    np.multiply(content_hashes, powers.inverse_powers[:n], out=sums)
    np.add.accumulate(sums, out=sums)  # (cumsum: the same sums at twice the cost)
    seg_starts = (
        np.cumsum(segment_lengths) - segment_lengths if segment_starts is None else segment_starts
    )
    # K_g = Bb**g * (sums_g + adjust_r), adjust_r = S_r * Bb * Q**s - (sum before s): one
    # per-segment term, repeated, instead of per-block gathers of segment values
    adjust = start_states * powers.shifted_inverse_powers[seg_starts]
    adjust -= running[seg_starts]
    states = np.repeat(adjust, segment_lengths)
    states += sums
    states *= powers.block_powers[:n]
    return fmix64(states), states


def token_chain_keys(
    tokens: np.ndarray,
    segment_lengths: np.ndarray,
    start_states: np.ndarray,
    powers: ChainPowers,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`block_content_hashes` of ``tokens`` (int64 ``[n, block_size]``: the blocks of
    the segments, back to back) then :func:`chain_keys`: ``(keys, states)``, uint64 ``[n]``.

    ``segment_lengths``: int64 ``[m]``; ``start_states``: uint64 ``[m]``. Compiled where the
    install built it (one pass over the tokens, no temporary per step of the recurrence), else
    those two numpy functions; the results are equal.
    """
    compiled = _loader.COMPILED
    if compiled is None:
        return chain_keys(
            block_content_hashes(tokens, powers), segment_lengths, start_states, powers
        )
    n = len(tokens)
    keys, states = np.empty(n, dtype=_U64), np.empty(n, dtype=_U64)
    compiled.token_chain_keys(
        np.ascontiguousarray(tokens).reshape(-1),
        segment_lengths,
        start_states,
        powers.token_powers,
        powers.block_base,
        keys,
        states,
    )
    return keys, states


def fast_block_keys(
    token_ids: Sequence[int] | np.ndarray, block_size: int, *, namespace: object = None
) -> list[int]:
    """The fast block keys of every full block of ``token_ids``, in plain Python (reference).

    Equal to the keys the manager computes with numpy, and to the block hashes it reports with
    ``hash_fn="fast"``.

    Examples
    --------
    >>> keys = fast_block_keys(list(range(40)), 16)
    >>> len(keys), all(0 <= k < 2**64 for k in keys)
    (2, True)
    """
    state = namespace_seed(encode_namespace(namespace))
    keys: list[int] = []
    base_bs = pow(_BASE, block_size, 1 << 64)
    for i in range(len(token_ids) // block_size):
        h = 0
        for t in token_ids[i * block_size : (i + 1) * block_size]:
            h = (h * _BASE + (int(t) & _MASK)) & _MASK
        state = (state * base_bs + h) & _MASK
        keys.append(fmix64_int(state))
    return keys


def hash_block_tokens(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    namespace: object = None,
    hash_fn: HashFn = sha256_block_hash,
) -> list[bytes]:
    """The byte-chained hashes of every full block of ``token_ids`` (a reference).

    Returns the block hashes the manager reports with ``hash_fn="sha256"`` (the default here)
    or with the given callable.

    Examples
    --------
    >>> hashes = hash_block_tokens(list(range(40)), 16)
    >>> len(hashes), len(hashes[0])
    (2, 32)
    """
    tokens = np.asarray(token_ids, dtype="<i8")
    ns_bytes = encode_namespace(namespace)
    hashes: list[bytes] = []
    parent = ROOT_BLOCK_HASH
    for i in range(len(tokens) // block_size):
        parent = hash_fn(
            parent + tokens[i * block_size : (i + 1) * block_size].tobytes() + ns_bytes
        )
        hashes.append(parent)
    return hashes


def byte_chain(
    tokens: np.ndarray,
    segment_lengths: np.ndarray,
    parents: list[bytes],
    namespaces: list[bytes],
    block_size: int,
    hash_fn: HashFn,
) -> list[bytes]:
    """Byte-chained hashes of several segments of blocks, each after its own parent.

    ``tokens``: integer ``[n * block_size]`` (on cpu), the ``n`` blocks of every segment back
    to back; segment ``r`` is ``segment_lengths[r]`` blocks (int64 ``[m]``, >= 0, summing to
    ``n``), its first block's parent ``parents[r]`` and its namespace ``namespaces[r]``
    (bytes). Each block's digest ``hash_fn(parent + little-endian int64 token bytes +
    namespace)`` is the next block's parent. Returns the ``n`` digests in order. Compiled where
    the install built it (``hash_fn`` :func:`sha256_block_hash` then costs no Python call per
    block), else :func:`byte_chain_python`; the results are equal.

    Raises ``ValueError`` when the lengths do not cut ``tokens`` into whole blocks or disagree
    with the parents, ``TypeError`` when a parent, a namespace or a digest is not bytes.
    """
    compiled = _loader.COMPILED
    if compiled is not None:
        return compiled.byte_chain(  # type: ignore[no-any-return]
            np.ascontiguousarray(tokens, dtype=np.int64),
            np.ascontiguousarray(segment_lengths, dtype=np.int64),
            parents,
            namespaces,
            block_size,
            hash_fn,
        )
    return byte_chain_python(tokens, segment_lengths, parents, namespaces, block_size, hash_fn)


def byte_chain_python(
    tokens: np.ndarray,
    segment_lengths: np.ndarray,
    parents: list[bytes],
    namespaces: list[bytes],
    block_size: int,
    hash_fn: HashFn,
) -> list[bytes]:
    """:func:`byte_chain` in Python (the reference of the compiled one)."""
    lengths = [int(n) for n in segment_lengths]
    if len(parents) != len(lengths) or len(namespaces) != len(lengths):
        raise ValueError(
            f"{len(lengths)} segments, {len(parents)} parents and {len(namespaces)} namespaces"
        )
    num_blocks = len(tokens) // max(block_size, 1)
    if block_size < 1 or len(tokens) % block_size or min(lengths, default=0) < 0 or sum(
        lengths
    ) != num_blocks:
        raise ValueError(
            f"segment_lengths {lengths} must be >= 0 and cut the tokens into their "
            f"{num_blocks} blocks of {block_size} (block_size >= 1)"
        )
    for name, values in (("parents", parents), ("namespaces", namespaces)):
        for value in values:
            if not isinstance(value, bytes):
                raise TypeError(f"{name} must hold bytes, got {type(value).__name__}")
    data = np.asarray(tokens).astype("<i8", copy=False).tobytes()
    step = block_size * 8
    out: list[bytes] = []
    at = 0
    for length, parent, namespace in zip(lengths, parents, namespaces):
        for _ in range(length):
            parent = hash_fn(parent + data[at : at + step] + namespace)
            if not isinstance(parent, bytes):
                raise TypeError(f"hash_fn must return bytes, got {type(parent).__name__}")
            out.append(parent)
            at += step
    return out


def byte_hash_fn(hash_fn: object) -> HashFn | None:
    """The byte-chained hash function a ``hash_fn`` argument selects (None: the fast key)."""
    if hash_fn is None or hash_fn == "fast":
        return None
    if hash_fn == "sha256":
        return sha256_block_hash
    if isinstance(hash_fn, str):
        raise ValueError(  # noqa: TRY004 (a str of the right type, naming no hash)
            f"hash_fn must be 'fast', 'sha256' or a callable, got {hash_fn!r}"
        )
    if not callable(hash_fn):
        raise TypeError(
            f"hash_fn must be 'fast', 'sha256' or a callable, got {type(hash_fn).__name__}"
        )
    return hash_fn  # type: ignore[return-value]
