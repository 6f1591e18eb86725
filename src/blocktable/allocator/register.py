"""Registering a step's newly full computed blocks in the prefix index, in one pass per group.

Block keys of a prompt are computed at admission; keys of blocks filled later (decode) are
computed here from the request's chain state, for every request of the call in one
:func:`~blocktable.allocator.hashing.chain_keys` pass. Each group then files all its new blocks
with one :meth:`BlockPool.cache` call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from blocktable.allocator.hashing import (
    ChainPowers,
    HashFn,
    block_content_hashes,
    byte_chain,
    chain_keys,
)
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.request import RequestState, grown

_U64 = np.uint64


def _extend_keys(
    todo: list[tuple[RequestState, int, int]], block_size: int, powers: ChainPowers
) -> None:
    """Compute keys ``have .. full - 1`` of each ``(req, have, full)`` in one pass."""
    bs = block_size
    lengths = np.array([full - have for _, have, full in todo], dtype=np.int64)
    tokens = np.concatenate([req.tokens[have * bs : full * bs] for req, have, full in todo])
    hashes = block_content_hashes(tokens.reshape(-1, bs), powers)
    starts = np.array([req.key_states[bs] for req, _, _ in todo], dtype=_U64)
    keys, states = chain_keys(hashes, lengths, starts, powers)
    end = 0
    for req, have, full in todo:
        begin, end = end, end + full - have
        buffer = req.keys[bs] = grown(req.keys[bs], full)
        buffer[have:full] = keys[begin:end]
        req.num_keys[bs] = full
        req.key_states[bs] = states[end - 1]


def register_computed_blocks(
    reqs: Sequence[RequestState],
    pools: Sequence[BlockPool],
    block_sizes: Sequence[int],
    powers: dict[int, ChainPowers],
    byte_hash_fn: HashFn | None,
) -> None:
    """File every full computed block of ``reqs`` not filed yet, in every group."""
    for bs in sorted(set(block_sizes)):
        groups = [g for g, size in enumerate(block_sizes) if size == bs]
        todo = []
        for req in reqs:
            full = req.num_computed_tokens // bs
            if full > req.num_keys[bs] and any(req.num_hashed_blocks[g] < full for g in groups):
                todo.append((req, req.num_keys[bs], full))
        if todo:
            _extend_keys(todo, bs, powers[bs])
        for g in groups:
            segments = [
                (req, req.num_hashed_blocks[g], req.num_computed_tokens // bs)
                for req in reqs
                if req.num_computed_tokens // bs > req.num_hashed_blocks[g]
            ]
            if segments:
                _cache_segments(pools[g], g, bs, segments, byte_hash_fn)


def _cache_segments(
    pool: BlockPool,
    g: int,
    bs: int,
    segments: list[tuple[RequestState, int, int]],
    byte_hash_fn: HashFn | None,
) -> None:
    if len(segments) == 1:
        req, first, stop = segments[0]
        block_ids = req.rows[g][first:stop]
        keys = req.keys[bs][first:stop]
        tokens = req.tokens[first * bs : stop * bs]
    else:
        block_ids = np.concatenate([req.rows[g][first:stop] for req, first, stop in segments])
        keys = np.concatenate([req.keys[bs][first:stop] for req, first, stop in segments])
        tokens = np.concatenate([req.tokens[first * bs : stop * bs] for req, first, stop in segments])
    parents = np.zeros(len(block_ids), dtype=np.int64)
    lengths = [stop - first for _, first, stop in segments]
    ends = np.cumsum(lengths).tolist()
    parents[[end - n for end, n in zip(ends, lengths)]] = [req.parent_cids[g] for req, _, _ in segments]
    hashes = None
    if byte_hash_fn is not None:
        hashes = []
        for req, first, stop in segments:
            hashes += byte_chain(
                req.tokens, first, stop, bs, req.parent_hashes[g], req.namespace_bytes,
                byte_hash_fn,
            )
    cids = pool.cache(block_ids, keys, tokens.reshape(-1, bs), parents, hashes)
    for (req, _, stop), end in zip(segments, ends):
        req.parent_cids[g] = int(cids[end - 1])
        req.num_hashed_blocks[g] = stop
        if hashes is not None:
            req.parent_hashes[g] = hashes[end - 1]
