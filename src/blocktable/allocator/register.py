"""Registering a step's newly full computed blocks in the prefix index, in one pass per group.

Block keys of a prompt's full blocks are computed at admission. Keys of blocks filled later
(generated tokens) are computed here from each request's key chain state, for every request of
the call in one :func:`~blocktable.allocator.hashing.chain_keys` pass. Each group then files
all its new blocks with one :meth:`BlockPool.cache` call. Where each request's registration
stands (blocks registered, parent content id, key chain state) lives in
:class:`~blocktable.allocator.request.KeyChains`, arrays indexed by table row, read and written
for all requests of a call with one gather and one scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from blocktable.allocator.hashing import (
    CHAIN_BASE,
    MASK64,
    ChainPowers,
    HashFn,
    block_content_hashes,
    byte_chain,
    chain_keys,
    fmix64_int,
)
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.request import KeyChains, RequestState

_U64 = np.uint64
Segment = tuple[RequestState, int, int]  # (request, first block, stop block)


def _segment_keys(
    segments: list[Segment], bs: int, powers: ChainPowers, chains: KeyChains
) -> tuple[list[Segment], np.ndarray]:
    """The segments reordered (prompt blocks first) and their keys, concatenated (uint64).

    Keys of prompt blocks were stored at admission; the others are chained, for every request
    at once, from the chain state before the segment (the prompt's state there, or the state
    where the last computation stopped), which then moves to the segment's end.
    """
    stored: list[Segment] = []
    fresh: list[Segment] = []
    for seg in segments:
        (stored if seg[2] <= seg[0].num_prompt_tokens // bs else fresh).append(seg)
    parts = [req.keys[bs][first:stop] for req, first, stop in stored]
    if fresh:
        lengths = np.array([stop - first for _, first, stop in fresh], dtype=np.int64)
        tokens = np.concatenate([req.tokens[first * bs : stop * bs] for req, first, stop in fresh])
        hashes = block_content_hashes(tokens.reshape(-1, bs), powers)
        starts = np.array(
            [_state_before(req, first, bs, chains) for req, first, _ in fresh], dtype=_U64
        )
        keys, states = chain_keys(hashes, lengths, starts, powers)
        rows = np.array([req.row for req, _, _ in fresh], dtype=np.int64)
        chains.num_keys[bs][rows] = [stop for _, _, stop in fresh]
        chains.state[bs][rows] = states[np.cumsum(lengths) - 1]
        parts.append(keys)
    return stored + fresh, parts[0] if len(parts) == 1 else np.concatenate(parts)


def _state_before(req: RequestState, first: int, bs: int, chains: KeyChains) -> int:
    """The key chain state after block ``first - 1`` (the namespace seed for ``first == 0``)."""
    if first == 0:
        return req.seed
    if first <= len(req.prompt_states[bs]):
        return int(req.prompt_states[bs][first - 1])
    num_keys = int(chains.num_keys[bs][req.row])
    if first != num_keys:
        raise AssertionError(f"key chain of request {req.req_id!r} is at {num_keys}")
    return int(chains.state[bs][req.row])


def register_computed_blocks(
    reqs: Sequence[RequestState],
    pools: Sequence[BlockPool],
    block_sizes: Sequence[int],
    powers: dict[int, ChainPowers],
    byte_hash_fn: HashFn | None,
    chains: KeyChains,
) -> None:
    """File every full computed block of ``reqs`` not filed yet, in every group (``chains``:
    where each request's key chain stands, moved to the last block keyed)."""
    if len(reqs) == 1 and byte_hash_fn is None:
        req = reqs[0]
        counts = [
            req.num_computed_tokens // bs - int(chains.num_hashed[g][req.row])
            for g, bs in enumerate(block_sizes)
        ]
        if max(counts) <= 1:  # a decode step filled at most one block per group
            _register_one_block(req, counts, pools, block_sizes, powers, chains)
            return
    for bs in sorted(set(block_sizes)):
        groups = [g for g, size in enumerate(block_sizes) if size == bs]
        if len(groups) == 1:
            _register_group(reqs, pools[groups[0]], groups[0], bs, powers[bs], byte_hash_fn, chains)
            continue
        union = []
        for req in reqs:
            first = min(int(chains.num_hashed[g][req.row]) for g in groups)
            stop = req.num_computed_tokens // bs
            if stop > first:
                union.append((req, first, stop))
        if not union:
            continue
        union, keys = _segment_keys(union, bs, powers[bs], chains)
        offsets = np.cumsum([0] + [stop - first for _, first, stop in union]).tolist()
        for g in groups:
            segments, parts = [], []
            for (req, first, stop), offset in zip(union, offsets):
                first_g = int(chains.num_hashed[g][req.row])
                if stop > first_g:
                    segments.append((req, first_g, stop))
                    parts.append(keys[offset + first_g - first : offset + stop - first])
            if segments:
                _cache_segments(
                    pools[g], g, bs, segments, np.concatenate(parts), byte_hash_fn, chains
                )


def _register_group(
    reqs: Sequence[RequestState],
    pool: BlockPool,
    g: int,
    bs: int,
    powers: ChainPowers,
    byte_hash_fn: HashFn | None,
    chains: KeyChains,
) -> None:
    """:func:`_segment_keys` and :func:`_cache_segments` of a group alone with its block size,
    in one pass over the requests: each request's tokens and block ids are sliced once.

    Segments whose keys were stored at admission (prompt blocks) come first, then the others,
    keyed here in one :func:`chain_keys` pass. Registration counts, parents and key chains are
    read and written for all segments at once (``chains``, indexed by row).
    """
    num_hashed, parent_cid = chains.num_hashed[g], chains.parent_cid[g]
    if len(reqs) == 1:
        firsts = [int(num_hashed[reqs[0].row])]
    else:
        firsts = num_hashed[[req.row for req in reqs]].tolist()
    # Per segment: request, stop block, length, row, token ids, block ids, and its keys
    # (stored segments) or its first block (fresh ones). One tuple per segment, unzipped after
    # the loop: cheaper than a list append per field.
    stored: list[tuple] = []
    fresh: list[tuple] = []
    for req, first in zip(reqs, firsts):
        stop = req.num_computed_tokens // bs
        if stop <= first:
            continue
        tokens = req.tokens[first * bs : stop * bs]
        if stop <= req.num_prompt_tokens // bs:
            ids = req.block_buf[g][first:stop]
            stored.append((req, stop, stop - first, req.row, tokens, ids, req.keys[bs][first:stop]))
        else:
            fresh.append(
                (req, stop, stop - first, req.row, tokens, req.block_buf[g][first:stop], first)
            )
    if byte_hash_fn is not None:  # byte-chained hashes: per segment, as the other groups do
        segments = [(seg[0], seg[1] - seg[2], seg[1]) for seg in stored + fresh]
        if segments:
            segments, keys = _segment_keys(segments, bs, powers, chains)
            _cache_segments(pool, g, bs, segments, keys, byte_hash_fn, chains)
        return
    if len(stored) + len(fresh) <= 1:
        if stored or fresh:
            req, stop, length, row, tokens, block_ids, last = (stored or fresh)[0]
            stored_keys = last if stored else None
            first = stop - length
            _register_segment(
                req, stop, row, tokens, block_ids, stored_keys, first, pool, g, bs, powers, chains
            )
        return
    # the segments' ints, stored segments first: one conversion, then views
    s_stops: tuple = ()
    s_lengths: tuple = ()
    s_rows: tuple = ()
    token_parts: list[np.ndarray] = []
    id_parts: list[np.ndarray] = []
    key_parts: list[np.ndarray] = []
    if stored:
        _, s_stops, s_lengths, s_rows, s_tokens, s_ids, s_keys = zip(*stored)
        token_parts += s_tokens
        id_parts += s_ids
        key_parts += s_keys
    f_reqs: tuple = ()
    f_stops: tuple = ()
    f_lengths: tuple = ()
    f_rows: tuple = ()
    f_firsts: tuple = ()
    if fresh:
        f_reqs, f_stops, f_lengths, f_rows, f_tokens, f_ids, f_firsts = zip(*fresh)
        token_parts.append(f_tokens[0] if len(f_tokens) == 1 else np.concatenate(f_tokens))
        id_parts += f_ids
    ints = np.array(
        (s_stops + f_stops, s_lengths + f_lengths, s_rows + f_rows, s_lengths + f_firsts),
        dtype=np.int64,
    )
    stops, lengths, seg_rows, firsts_fresh = ints  # firsts_fresh[:len(stored)]: unused
    if fresh:
        k = len(stored)
        fresh_len, fresh_rows = lengths[k:], seg_rows[k:]
        tokens = token_parts[-1]
        hashes = block_content_hashes(tokens.reshape(-1, bs), powers)
        num_keys, chain_state = chains.num_keys[bs], chains.state[bs]
        starts = chain_state[fresh_rows]
        # usually each chain stands where its segment starts; else the segment starts inside
        # the prompt (its stored states) or the chain is broken (an error)
        for i in np.flatnonzero(num_keys[fresh_rows] != firsts_fresh[k:]).tolist():
            starts[i] = _state_before(f_reqs[i], f_firsts[i], bs, chains)
        keys, states = chain_keys(hashes, fresh_len, starts, powers)
        num_keys[fresh_rows] = stops[k:]
        chain_state[fresh_rows] = (
            states if len(states) == len(fresh) else states[np.cumsum(fresh_len) - 1]
        )
        key_parts.append(keys)
    num_segments = len(seg_rows)
    ends = lengths.cumsum()
    parent_ids = np.zeros(int(ends[-1]), dtype=np.int64)  # 0: the previous entry's content
    parent_ids[ends - lengths] = parent_cid[seg_rows]
    cids = pool.cache(
        id_parts[0] if len(id_parts) == 1 else np.concatenate(id_parts),
        key_parts[0] if len(key_parts) == 1 else np.concatenate(key_parts),
        (token_parts[0] if len(token_parts) == 1 else np.concatenate(token_parts)).reshape(-1, bs),
        parent_ids,
    )
    parent_cid[seg_rows] = cids if len(cids) == num_segments else cids[ends - 1]
    num_hashed[seg_rows] = stops


def _register_segment(
    req: RequestState,
    stop: int,
    row: int,
    tokens: np.ndarray,
    block_ids: np.ndarray,
    keys: np.ndarray | None,
    first: int,
    pool: BlockPool,
    g: int,
    bs: int,
    powers: ChainPowers,
    chains: KeyChains,
) -> None:
    """:func:`_register_group` of one segment, blocks ``first .. stop - 1`` of ``req`` (a
    prompt chunk), with scalar bookkeeping; ``keys``: the stored ones, or None to chain them."""
    if keys is None:
        num_keys, chain_state = chains.num_keys[bs], chains.state[bs]
        if int(num_keys[row]) == first:
            start = int(chain_state[row])
        else:
            start = _state_before(req, first, bs, chains)
        hashes = block_content_hashes(tokens.reshape(-1, bs), powers)
        lengths = np.array([stop - first], dtype=np.int64)
        keys, states = chain_keys(hashes, lengths, np.array([start], dtype=_U64), powers)
        num_keys[row] = stop
        chain_state[row] = states[-1]
    parent_ids = np.zeros(stop - first, dtype=np.int64)  # 0: the previous entry's content
    parent_cid = chains.parent_cid[g]
    parent_ids[0] = parent_cid[row]
    cids = pool.cache(block_ids, keys, tokens.reshape(-1, bs), parent_ids)
    parent_cid[row] = cids[-1]
    chains.num_hashed[g][row] = stop


def _cache_segments(
    pool: BlockPool,
    g: int,
    bs: int,
    segments: list[Segment],
    keys: np.ndarray,
    byte_hash_fn: HashFn | None,
    chains: KeyChains,
    block_ids: np.ndarray | None = None,
    tokens: np.ndarray | None = None,
) -> None:
    """File the blocks of ``segments`` in group ``g`` (``block_ids`` and ``tokens``, the
    segments' block ids and token ids concatenated, are sliced here when not given)."""
    if block_ids is None:
        block_ids = np.concatenate([req.block_buf[g][first:stop] for req, first, stop in segments])
    if tokens is not None:
        pass
    elif len(segments) == 1:
        req, first, stop = segments[0]
        tokens = req.tokens[first * bs : stop * bs]
    else:
        tokens = np.concatenate(
            [req.tokens[first * bs : stop * bs] for req, first, stop in segments]
        )
    parents = np.zeros(len(block_ids), dtype=np.int64)
    seg_starts, ends, end = [], [], 0
    for _, first, stop in segments:
        seg_starts.append(end)
        end += stop - first
        ends.append(end)
    parent_cid, num_hashed = chains.parent_cid[g], chains.num_hashed[g]
    rows = np.array([req.row for req, _, _ in segments], dtype=np.int64)
    parents[seg_starts] = parent_cid[rows]
    hashes = None
    if byte_hash_fn is not None:
        hashes = []
        for req, first, stop in segments:
            hashes += byte_chain(
                req.tokens,
                first,
                stop,
                bs,
                req.parent_hashes[g],
                req.namespace_bytes,
                byte_hash_fn,
            )
    cids = pool.cache(block_ids, keys, tokens.reshape(-1, bs), parents, hashes)
    parent_cid[rows] = cids if len(cids) == len(segments) else cids[np.array(ends) - 1]
    num_hashed[rows] = [stop for _, _, stop in segments]
    if hashes is not None:
        for (req, _, _), end in zip(segments, ends):
            req.parent_hashes[g] = hashes[end - 1]


def _register_one_block(
    req: RequestState,
    counts: list[int],
    pools: Sequence[BlockPool],
    block_sizes: Sequence[int],
    powers: dict[int, ChainPowers],
    chains: KeyChains,
) -> None:
    """:func:`register_computed_blocks` of one request's one new block per group, in plain
    Python (a few numpy calls cost more than hashing one block's tokens one by one)."""
    keys: dict[int, int] = {}  # block size -> key of the new block
    for g, (pool, bs) in enumerate(zip(pools, block_sizes)):
        if not counts[g]:
            continue
        i = int(chains.num_hashed[g][req.row])
        key = keys.get(bs)
        if key is None:
            if i < req.num_prompt_tokens // bs:
                key = int(req.keys[bs][i])
            else:
                state = _state_before(req, i, bs, chains)
                h = 0
                for t in req.tokens[i * bs : (i + 1) * bs].tolist():
                    h = (h * CHAIN_BASE + (t & MASK64)) & MASK64
                state = (state * powers[bs].block_base + h) & MASK64
                chains.set(req.row, bs, i + 1, state)
                key = fmix64_int(state)
            keys[bs] = key
        cid = pool.cache_one(
            int(req.block_buf[g][i]),
            key,
            req.tokens[i * bs : (i + 1) * bs],
            int(chains.parent_cid[g][req.row]),
        )
        chains.parent_cid[g][req.row] = cid
        chains.num_hashed[g][req.row] = i + 1
