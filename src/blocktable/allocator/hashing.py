"""Chained block hashes and the exact keys of the prefix cache.

Two identities are kept for every cached (full, computed) block:

* The **block hash**, a stable digest chained over the prefix:
  ``hash_i = hash_fn(hash_{i-1} + token_bytes_i + namespace_bytes)`` with
  ``hash_{-1} = ROOT_BLOCK_HASH`` and ``token_bytes_i`` the block's token ids as little-endian
  int64. It is the same in every process and on every machine, so it can name a block outside
  this process (KV-cache events, offloading, a cache shared by several engines).
* The **cache key**, ``parent_prefix + token_bytes`` (bytes), used by the in-process index:
  ``parent_prefix`` names the exact content of the previous block of the prefix by its
  *content id* (``b"C" + id as 8 bytes``), or the namespace for the first block
  (``b"R" + namespace_bytes``). Looking a block up by its key compares the block's token ids
  and, through the parent's content id, its whole prefix *exactly*, so a hash collision can
  never share wrong KV: two blocks with the same tokens but different prefixes (whose hashes
  may collide) have different keys. A content id names one exact content for as long as its
  key stays in the index, and is never reused.

A block's hash is computed once, when the block first becomes full and computed; a prefix hit
inherits the hashes of the blocks it reuses instead of recomputing them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

HashFn = Callable[[bytes], bytes]
"""``hash_fn(data) -> digest``; ``data`` is ``parent_hash + token_bytes + namespace_bytes``."""

CacheKey = bytes
"""``parent_prefix + token_bytes``; see :func:`root_prefix` and :func:`content_prefix`."""

ROOT_BLOCK_HASH: bytes = bytes(32)
"""The parent hash of the first block of every prompt."""

_NAMESPACE_TYPES = (str, int, bytes)


def sha256_block_hash(data: bytes) -> bytes:
    """The default ``hash_fn``: SHA-256 of ``data`` (32 bytes, stable across processes)."""
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


def root_prefix(namespace: object) -> bytes:
    """The parent part of the cache key of a prompt's first block."""
    return b"R" + encode_namespace(namespace)


def content_prefix(content_id: int) -> bytes:
    """The parent part of the cache key of a block whose parent holds ``content_id``."""
    return b"C" + content_id.to_bytes(8, "little")


def hash_block_tokens(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    namespace: object = None,
    hash_fn: HashFn = sha256_block_hash,
) -> list[bytes]:
    """The chained hashes of every full block of ``token_ids`` (a reference, not the hot path).

    Returns the same hashes the manager assigns to these blocks once they are computed.

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
