"""Registering a step's newly full computed blocks in the prefix index, in one pass per group.

Block keys of a prompt's full blocks are computed at admission. Keys of blocks filled later
(generated tokens) are computed here from each request's key chain state, for every request of
the call in one :func:`~blocktable.allocator.hashing.token_chain_keys` pass (hashing and
chaining, compiled where the package's compiled loops are built). Each group then files
all its new blocks with one :meth:`BlockPool.cache` call. Where each request's registration
stands (blocks registered, parent content id, key chain state) lives in
:class:`~blocktable.allocator.request.KeyChains`, arrays indexed by table row, read and written
for all requests of a call with one gather and one scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from blocktable.allocator.hashing import (
    ChainPowers,
    HashFn,
    byte_chain,
    token_chain_keys,
)
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.request import KeyChains, RequestState
from blocktable.allocator.rowstate import RowState

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
        tokens = np.concatenate(
            [req.token_array(first * bs, stop * bs) for req, first, stop in fresh]
        )
        starts = np.array(
            [_state_before(req, first, bs, chains) for req, first, _ in fresh], dtype=_U64
        )
        keys, states = token_chain_keys(tokens.reshape(-1, bs), lengths, starts, powers)
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
    rows: np.ndarray,
    state: RowState,
    pools: Sequence[BlockPool],
    block_sizes: Sequence[int],
    powers: dict[int, ChainPowers],
    byte_hash_fn: HashFn | None,
    chains: KeyChains,
) -> None:
    """File every full computed block of ``reqs`` not filed yet, in every group (``rows``:
    their table rows, intp ``[len(reqs)]``; ``state``:
    the rows' counts and blocks; ``chains``: where each request's key chain stands, moved to
    the last block keyed)."""
    for bs in sorted(set(block_sizes)):
        groups = [g for g, size in enumerate(block_sizes) if size == bs]
        if len(groups) == 1:
            g = groups[0]
            _register_group(reqs, rows, state, pools[g], g, bs, powers[bs], byte_hash_fn, chains)
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
                    pools[g], g, bs, segments, np.concatenate(parts), byte_hash_fn, chains, state
                )


def _register_group(
    reqs: Sequence[RequestState],
    rows: np.ndarray,
    state: RowState,
    pool: BlockPool,
    g: int,
    bs: int,
    powers: ChainPowers,
    byte_hash_fn: HashFn | None,
    chains: KeyChains,
) -> None:
    """:func:`_segment_keys` and :func:`_cache_segments` of a group alone with its block size,
    with the rows' counts, block ids and chains read and written by gathers and scatters.

    Segments whose keys were stored at admission (prompt blocks) come first, their keys
    sliced from each request, then the others (decode blocks, usually one per request),
    keyed here in one :func:`token_chain_keys` pass. Token ids and block ids of all blocks are
    gathered at once from the token and block arenas (else sliced per request, where some
    request's token ids are not in the arena). The blocks are filed with one
    :meth:`BlockPool.cache` call.
    """
    num_hashed, parent_cid = chains.num_hashed[g], chains.parent_cid[g]
    firsts = num_hashed[rows]
    stops = state.num_computed[rows] // bs
    has = stops > firsts
    num_seg = int(np.count_nonzero(has))
    if not num_seg:
        return
    # the requests with a segment (usually every one filled a block: None, no indices built)
    seg = None if num_seg == len(rows) else has.nonzero()[0]
    if byte_hash_fn is not None:  # byte-chained hashes: per segment, as the other groups do
        if seg is None:
            seg = np.arange(len(rows))
        segments = [
            (reqs[i], first, stop)
            for i, first, stop in zip(seg.tolist(), firsts[seg].tolist(), stops[seg].tolist())
        ]
        segments, keys = _segment_keys(segments, bs, powers, chains)
        _cache_segments(pool, g, bs, segments, keys, byte_hash_fn, chains, state)
        return
    if seg is None:
        seg_rows, first, stop = rows, firsts, stops
    else:
        seg_rows, first, stop = rows[seg], firsts[seg], stops[seg]
    stored = stop * bs <= state.num_prompt[seg_rows]  # keys computed at admission
    num_stored = int(np.count_nonzero(stored))
    # stored ones first (the first False after the stored ones: already in order)
    if 0 < num_stored < num_seg and int(stored.argmin()) != num_stored:
        order = np.concatenate((np.flatnonzero(stored), np.flatnonzero(~stored)))
        seg = order if seg is None else seg[order]
        seg_rows, first, stop = seg_rows[order], first[order], stop[order]
    lengths = stop - first
    k = num_stored  # segments 0 .. k - 1: keys stored at admission; k ..: keyed here
    ends = lengths.cumsum()
    seg_starts = ends - lengths  # where each segment's blocks start among all
    total = int(ends[-1])  # blocks in all
    num_stored_blocks = int(ends[k - 1]) if k else 0
    # (Python ints only where a loop needs them)
    seg_l = list(range(k)) if seg is None else seg[:k].tolist()
    first_l, stop_l = first[:k].tolist(), stop[:k].tolist()
    key_parts = [reqs[i].keys[bs][f:s] for i, f, s in zip(seg_l, first_l, stop_l)]
    gathered = _gather_blocks(state, g, seg_rows, first, lengths, seg_starts, total, bs)
    if gathered is not None:  # usually: token ids and block ids of all blocks, one take each
        tokens, block_ids = gathered
        fresh_tokens = tokens[num_stored_blocks:]
    else:
        arena = state.blocks[g]
        token_parts, block_parts = [], []
        for i, row, f, s in zip(seg_l, seg_rows[:k].tolist(), first_l, stop_l):
            token_parts.append(reqs[i].tokens[f * bs : s * bs])
            block_parts.append(arena[row, f:s])
    if k < num_seg:  # decode blocks, usually one each: keyed at once
        fresh_rows, fresh_first, fresh_stop = seg_rows[k:], first[k:], stop[k:]
        num_fresh = num_seg - k
        fresh_reqs = range(k, num_seg) if seg is None else seg[k:].tolist()  # (indices)
        one_each = total - num_stored_blocks == num_fresh
        if gathered is None:
            block_parts.append(state.gather(g, fresh_rows, fresh_first, lengths[k:]))
            fresh_tokens = _fresh_tokens(
                [reqs[i] for i in fresh_reqs], state, fresh_rows, fresh_first, fresh_stop, bs
            )
            token_parts.append(fresh_tokens)
        num_keys, chain_state = chains.num_keys[bs], chains.state[bs]
        starts = chain_state[fresh_rows]
        # usually each chain stands where its segment starts; else the segment starts inside
        # the prompt (its stored states) or the chain is broken (an error)
        off = num_keys[fresh_rows] != fresh_first
        if np.count_nonzero(off):
            for i in np.flatnonzero(off).tolist():
                starts[i] = _state_before(reqs[fresh_reqs[i]], int(first[k + i]), bs, chains)
        keys, states = token_chain_keys(fresh_tokens.reshape(-1, bs), lengths[k:], starts, powers)
        if not one_each:  # (one block each, a decode step: every state is a segment's last)
            states = states[np.cumsum(lengths[k:]) - 1]
        num_keys[fresh_rows] = fresh_stop
        chain_state[fresh_rows] = states
        key_parts.append(keys)
    keys = key_parts[0] if len(key_parts) == 1 else np.concatenate(key_parts)
    if gathered is None:
        if len(token_parts) == 1:
            tokens, block_ids = token_parts[0], block_parts[0]
        else:
            tokens, block_ids = np.concatenate(token_parts), np.concatenate(block_parts)
    parents = np.zeros(total, dtype=np.int64)  # 0: the content of the block before
    parents[seg_starts] = parent_cid[seg_rows]
    cids = pool.cache(block_ids, keys, tokens.reshape(-1, bs), parents)
    parent_cid[seg_rows] = cids if total == num_seg else cids.take(ends - 1)
    num_hashed[seg_rows] = stop


def _gather_blocks(
    state: RowState,
    g: int,
    rows: np.ndarray,
    first: np.ndarray,
    lengths: np.ndarray,
    starts: np.ndarray,
    total: int,
    bs: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Token ids (int64 ``[total, bs]``) and block ids of group ``g`` (int32 ``[total]``) of
    blocks ``first[i] .. first[i] + lengths[i] - 1`` of every row ``rows[i]``, concatenated
    (``starts``: where each segment starts there, int64 ``[len(rows)]``): one gather from each
    arena, the token arena read as whole blocks; None unless every row's token ids are there
    and the arena's rows are whole blocks."""
    arena = state.tokens
    width = arena.shape[1]
    # (count_nonzero: cheaper than all() and any() on bools)
    if width % bs or np.count_nonzero(state.in_arena[rows]) < len(rows):
        return None
    wb = width // bs  # blocks per row of the token arena
    # flat position of every block (block j of segment i: block first[i] + j of row rows[i])
    if total == len(rows):  # one block each (decode steps): no repeats to build
        pos = rows * wb + first
    else:
        pos = np.arange(total) + np.repeat(rows * wb + (first - starts), lengths)
    # (views: both arenas are contiguous; take() beats fancy indexing)
    tokens = arena.reshape(-1, bs).take(pos, axis=0)
    blocks = state.blocks[g]
    nb = blocks.shape[1]
    if nb != wb:  # the block arena's rows are of another width: the same rows' positions there
        shift = rows * (nb - wb)
        pos = pos + (shift if total == len(rows) else np.repeat(shift, lengths))
    return tokens, blocks.reshape(-1).take(pos)


def _fresh_tokens(
    reqs: list[RequestState],
    state: RowState,
    rows: np.ndarray,
    first: np.ndarray,
    stop: np.ndarray,
    bs: int,
) -> np.ndarray:
    """Token ids of blocks ``first[i] .. stop[i] - 1`` of ``reqs[i]`` (holding ``rows[i]``),
    concatenated: one gather from the token arena when every row is there and every segment
    as long, else a slice per segment."""
    length = int(stop[0] - first[0])
    same_length = not np.count_nonzero(stop - first != length)
    if same_length and np.count_nonzero(state.in_arena[rows]) == len(rows):
        arena = state.tokens
        # flat positions (a take on the flat arena beats a broadcast 2-D index)
        at = (rows * arena.shape[1] + first * bs)[:, None] + np.arange(length * bs)
        return arena.reshape(-1).take(at.reshape(-1))
    parts = [req.tokens[f * bs : s * bs] for req, f, s in zip(reqs, first.tolist(), stop.tolist())]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)



def _cache_segments(
    pool: BlockPool,
    g: int,
    bs: int,
    segments: list[Segment],
    keys: np.ndarray,
    byte_hash_fn: HashFn | None,
    chains: KeyChains,
    state: RowState,
) -> None:
    """File the blocks of ``segments`` in group ``g``."""
    arena = state.blocks[g]
    block_ids = np.concatenate([arena[req.row, first:stop] for req, first, stop in segments])
    token_parts = [req.token_array(first * bs, stop * bs) for req, first, stop in segments]
    tokens = token_parts[0] if len(token_parts) == 1 else np.concatenate(token_parts)
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
        for (req, first, stop), seg_tokens in zip(segments, token_parts):
            hashes += byte_chain(
                seg_tokens,
                0,
                stop - first,
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
