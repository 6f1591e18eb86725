"""Registering a step's newly full computed blocks in the prefix index, in one pass per group.

Block keys of a prompt's full blocks are computed at admission. Keys of blocks filled later
(generated tokens) are computed here from each request's key chain state, for every request of
the call in one :func:`~blocktable.allocator.hashing.chain_keys` pass. Each group then files
all its new blocks with one :meth:`BlockPool.cache` call.
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
from blocktable.allocator.request import RequestState

_U64 = np.uint64
Segment = tuple[RequestState, int, int]  # (request, first block, stop block)


def _segment_keys(segments: list[Segment], bs: int, powers: ChainPowers) -> np.ndarray:
    """Keys of blocks ``first .. stop-1`` of each segment, concatenated (uint64).

    Stored prompt keys are sliced; keys past them are chained from the request's state (every
    request's new blocks in one pass), which then moves to the segment's end.
    """
    parts: list[np.ndarray] = []
    todo: list[Segment] = []
    for req, first, stop in segments:
        stored = len(req.keys[bs])
        if stop <= stored:
            parts.append(req.keys[bs][first:stop])
        else:
            if first < stored:
                parts.append(req.keys[bs][first:stored])
            parts.append(None)  # type: ignore[arg-type]  # filled below
            todo.append((req, max(first, stored), stop))
    if todo:
        # the chain state is at num_keys; blocks between it and `first` were keyed already
        lengths = np.array([stop - req.num_keys[bs] for req, _, stop in todo], dtype=np.int64)
        tokens = np.concatenate([req.tokens[req.num_keys[bs] * bs : stop * bs] for req, _, stop in todo])
        hashes = block_content_hashes(tokens.reshape(-1, bs), powers)
        starts = np.array([req.key_states[bs] for req, _, _ in todo], dtype=_U64)
        keys, states = chain_keys(hashes, lengths, starts, powers)
        ends = np.cumsum(lengths)
        last_states = states[ends - 1].tolist()
        new_parts = iter(
            keys[end - (stop - first) : end]
            for (_, first, stop), end in zip(todo, ends.tolist())
        )
        parts = [next(new_parts) if part is None else part for part in parts]
        for (req, _, stop), state in zip(todo, last_states):
            req.num_keys[bs] = stop
            req.key_states[bs] = _U64(state)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


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
        union = []
        g0 = groups[0]
        for req in reqs:
            hashed = req.num_hashed_blocks
            first = hashed[g0] if len(groups) == 1 else min(hashed[g] for g in groups)
            stop = req.num_computed_tokens // bs
            if stop > first:
                union.append((req, first, stop))
        if not union:
            continue
        keys = _segment_keys(union, bs, powers[bs])
        offsets = np.cumsum([0] + [stop - first for _, first, stop in union]).tolist()
        for g in groups:
            segments, parts = [], []
            for (req, first, stop), offset in zip(union, offsets):
                first_g = req.num_hashed_blocks[g]
                if stop > first_g:
                    segments.append((req, first_g, stop))
                    parts.append((offset + first_g - first, offset + stop - first))
            if not segments:
                continue
            if len(segments) == len(union) and all(
                seg[1] == whole[1] for seg, whole in zip(segments, union)
            ):
                keys_g = keys  # the common case: every group of this size is equally far
            else:
                keys_g = np.concatenate([keys[a:b] for a, b in parts])
            _cache_segments(pools[g], g, bs, segments, keys_g, byte_hash_fn)


def _cache_segments(
    pool: BlockPool,
    g: int,
    bs: int,
    segments: list[Segment],
    keys: np.ndarray,
    byte_hash_fn: HashFn | None,
) -> None:
    block_ids: list[int] = []
    for req, first, stop in segments:
        block_ids += req.blocks[g][first:stop]
    if len(segments) == 1:
        req, first, stop = segments[0]
        tokens = req.tokens[first * bs : stop * bs]
    else:
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
    cids = pool.cache(
        np.array(block_ids, dtype=np.int32), keys, tokens.reshape(-1, bs), parents, hashes
    )
    last_cids = cids[np.array(ends) - 1].tolist()
    for (req, _, stop), end, cid in zip(segments, ends, last_cids):
        req.parent_cids[g] = cid
        req.num_hashed_blocks[g] = stop
        if hashes is not None:
            req.parent_hashes[g] = hashes[end - 1]
