"""Prefix caching: finding a prompt's cached blocks and registering newly computed ones.

See :mod:`blocktable.allocator.hashing` for the two identities of a cached block (the stable
chained hash and the exact cache key).
"""

from __future__ import annotations

from collections.abc import Sequence

from blocktable.allocator.hashing import HashFn, content_prefix, root_prefix
from blocktable.allocator.pool import BlockPool, Hit
from blocktable.allocator.request import TOKEN_BYTES, RequestState
from blocktable.constants import NULL_BLOCK_ID


def find_cached_prefix(
    pools: Sequence[BlockPool],
    block_sizes: Sequence[int],
    tokens: bytearray,
    namespace: object,
    align_tokens: int,
) -> tuple[int, list[list[Hit]]]:
    """The longest cached prefix of ``tokens`` found in every group; no side effects.

    ``tokens`` are little-endian int64 token ids. The prefix is made of full blocks, is a
    multiple of ``align_tokens`` (the lcm of the block sizes, so every group covers it exactly)
    and leaves at least one token to compute.

    Returns
    -------
    num_tokens : int
        Length of the prefix in tokens.
    hits : list of list of (content_id, block_id)
        Per group, the blocks holding its ``num_tokens // block_size`` blocks.
    """
    max_tokens = len(tokens) // TOKEN_BYTES - 1
    found: list[list[Hit]] = []
    root = root_prefix(namespace)
    with memoryview(tokens) as view:
        for pool, block_size in zip(pools, block_sizes):
            hits = pool.find_chain(root, view, block_size * TOKEN_BYTES, max_tokens // block_size)
            found.append(hits)
            max_tokens = min(max_tokens, len(hits) * block_size)
    num_tokens = max_tokens // align_tokens * align_tokens
    return num_tokens, [hits[: num_tokens // bs] for hits, bs in zip(found, block_sizes)]


def share_cached_prefix(
    req: RequestState,
    pools: Sequence[BlockPool],
    hits: Sequence[Sequence[Hit]],
    num_cached_tokens: int,
    num_skipped_blocks: Sequence[int],
) -> None:
    """Give a new request the blocks found by :func:`find_cached_prefix`.

    Per group, the first ``num_skipped_blocks[g]`` hits are outside a sliding window: their
    entries are the null block and no reference is taken. The request continues the hash
    chain from the last hit.
    """
    req.num_computed_tokens = num_cached_tokens
    for g, (pool, group_hits, skip) in enumerate(zip(pools, hits, num_skipped_blocks)):
        block_ids = [block_id for _, block_id in group_hits[skip:]]
        pool.share(block_ids)
        req.blocks[g] = [NULL_BLOCK_ID] * skip + block_ids
        req.num_skipped_blocks[g] = skip
        req.num_hashed_blocks[g] = len(group_hits)
        last_content, last_block = group_hits[-1]
        last_hash = pool.block_hash(last_block)
        assert last_hash is not None  # a hit is a cached block
        req.parent_prefixes[g] = content_prefix(last_content)
        req.parent_hashes[g] = last_hash


def cache_full_blocks(
    pool: BlockPool,
    req: RequestState,
    group: int,
    block_size: int,
    num_full_blocks: int,
    hash_fn: HashFn,
    hash_memo: dict[tuple[int, int], bytes] | None = None,
) -> None:
    """Hash and index ``req``'s blocks ``num_hashed_blocks[group] .. num_full_blocks - 1``.

    ``hash_memo`` shares hashes between groups of equal block size within one call (their
    chains are identical: same tokens, same namespace).
    """
    first = req.num_hashed_blocks[group]
    if num_full_blocks <= first:
        return
    blocks = req.blocks[group]
    parent = req.parent_prefixes[group]
    parent_hash = req.parent_hashes[group]
    namespace_bytes = req.namespace_bytes
    step = block_size * TOKEN_BYTES
    with memoryview(req.tokens) as view:
        for i in range(first, num_full_blocks):
            block_bytes = view[i * step : (i + 1) * step].tobytes()
            block_hash = None if hash_memo is None else hash_memo.get((block_size, i))
            if block_hash is None:
                block_hash = hash_fn(parent_hash + block_bytes + namespace_bytes)
                if hash_memo is not None:
                    hash_memo[(block_size, i)] = block_hash
            content_id = pool.cache_block(blocks[i], parent + block_bytes, block_hash)
            parent = content_prefix(content_id)
            parent_hash = block_hash
    req.num_hashed_blocks[group] = num_full_blocks
    req.parent_prefixes[group] = parent
    req.parent_hashes[group] = parent_hash
