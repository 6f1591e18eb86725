"""Registering a step's newly full computed blocks in the prefix index, one pass per block size.

Block keys of a prompt's full blocks are computed at admission. Keys of blocks filled later
(generated tokens) are computed here from each request's key chain state, for every request of
the call in one :func:`~blocktable.block_hashing.token_chain_keys` pass. Groups of one
block size register the same blocks (their registration always stands at the same block), so
keys and token ids are found once per block size, and each group then files its new blocks
with one :meth:`BlockPool.cache` call. Where each request's registration stands (blocks
registered, parent content id, key chain state) lives in
:class:`~blocktable.allocator.request.KeyChains`, arrays indexed by table row, read and written
for all requests of a call with one gather and one scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from blocktable._fastnp import count_nonzero
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.request import KeyChains, RequestState
from blocktable.allocator.rowstate import RowState
from blocktable.block_hashing import ChainPowers, HashFn, byte_chain, token_chain_keys


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
    """File every full computed block of ``reqs`` not filed yet, in every group.

    ``rows``: their table rows (intp ``[len(reqs)]``); ``state``: the rows' counts, tokens and
    blocks; ``chains``: where each request's registration and key chain stand (moved on).
    """
    for bs in sorted(set(block_sizes)):
        groups = [g for g, size in enumerate(block_sizes) if size == bs]
        _register_size(reqs, rows, state, pools, groups, bs, powers[bs], byte_hash_fn, chains)


def _register_size(
    reqs: Sequence[RequestState],
    rows: np.ndarray,
    state: RowState,
    pools: Sequence[BlockPool],
    groups: list[int],
    bs: int,
    powers: ChainPowers,
    byte_hash_fn: HashFn | None,
    chains: KeyChains,
) -> None:
    """Register the new full blocks of the groups of block size ``bs``.

    Each request with new full blocks has a *segment*: its blocks from where its registration
    stands to its last full computed block. Segments whose keys were stored at admission
    (prompt blocks) come first, their keys sliced from each request, then the others (decode
    blocks, usually one per request), keyed here in one pass from their chain states.
    """
    firsts = chains.num_hashed[groups[0]][rows]
    stops = state.num_computed[rows] // bs
    has = stops > firsts
    num_seg = int(count_nonzero(has))
    if not num_seg:
        return
    if num_seg == len(rows):  # (usually every request filled a block: no indices built)
        seg, seg_rows, first, stop = None, rows, firsts, stops
    else:
        seg = has.nonzero()[0]
        seg_rows, first, stop = rows[seg], firsts[seg], stops[seg]
    stored = stop * bs <= state.num_prompt[seg_rows]  # keys computed at admission
    k = int(count_nonzero(stored))  # segments 0 .. k - 1: stored keys; k ..: keyed here
    if 0 < k < num_seg and int(stored.argmin()) != k:  # stored ones first
        order = np.concatenate((np.flatnonzero(stored), np.flatnonzero(~stored)))
        seg = order if seg is None else seg[order]
        seg_rows, first, stop = seg_rows[order], first[order], stop[order]
    lengths = stop - first
    ends = lengths.cumsum()
    seg_starts = ends - lengths  # where each segment's blocks start among all
    total = int(ends[-1])
    seg_reqs = list(reqs) if seg is None else [reqs[i] for i in seg.tolist()]
    pos = _block_positions(state, seg_rows, first, lengths, seg_starts, total, bs)
    if pos is not None:  # usually: the token ids of all blocks in one gather
        tokens = state.tokens.reshape(-1, bs).take(pos, axis=0).reshape(-1)
    else:
        parts = [req.tokens[f * bs : s * bs]
                 for req, f, s in zip(seg_reqs, first.tolist(), stop.tolist())]
        tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
    key_parts = [
        req.keys[bs][f:s] for req, f, s in zip(seg_reqs[:k], first[:k].tolist(), stop[:k].tolist())
    ]
    if k < num_seg:  # decode blocks, usually one each: keyed at once
        fresh_rows, fresh_first = seg_rows[k:], first[k:]
        num_keys, chain_state = chains.num_keys[bs], chains.state[bs]
        starts = chain_state[fresh_rows]
        # usually each chain stands where its segment starts; else the segment starts inside
        # the prompt (its stored states)
        elsewhere = num_keys[fresh_rows] != fresh_first
        if count_nonzero(elsewhere):
            for i in elsewhere.nonzero()[0].tolist():
                starts[i] = _state_before(seg_reqs[k + i], int(fresh_first[i]), bs, chains)
        fresh_tokens = tokens[int(seg_starts[k]) * bs :]
        keys, states = token_chain_keys(fresh_tokens.reshape(-1, bs), lengths[k:], starts, powers)
        num_keys[fresh_rows] = stop[k:]
        chain_state[fresh_rows] = states[ends[k:] - ends[k - 1] - 1 if k else ends - 1]
        key_parts.append(keys)
    keys = key_parts[0] if len(key_parts) == 1 else np.concatenate(key_parts)
    for g in groups:
        parent_cid = chains.parent_cid[g]
        hashes = None
        if byte_hash_fn is not None:  # every segment's blocks in one call
            hashes = byte_chain(tokens, lengths, [req.parent_hashes[g] for req in seg_reqs],
                                [req.namespace_bytes for req in seg_reqs], bs, byte_hash_fn)
            for req, end in zip(seg_reqs, ends.tolist()):
                req.parent_hashes[g] = hashes[end - 1]
        arena = state.blocks[g]
        if pos is None:
            block_ids = state.gather(g, seg_rows, first, lengths)
        else:  # the same blocks' positions in this arena (its rows may be of another width)
            shift = seg_rows * (arena.shape[1] - state.tokens.shape[1] // bs)
            block_ids = arena.reshape(-1).take(
                pos + (shift if total == num_seg else shift.repeat(lengths)))
        cids = pools[g].cache(block_ids, keys, tokens.reshape(-1, bs), seg_starts,
                              parent_cid[seg_rows], hashes)
        parent_cid[seg_rows] = cids[ends - 1]
        chains.num_hashed[g][seg_rows] = stop


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


def _block_positions(
    state: RowState,
    rows: np.ndarray,
    first: np.ndarray,
    lengths: np.ndarray,
    starts: np.ndarray,
    total: int,
    bs: int,
) -> np.ndarray | None:
    """Where blocks ``first[i] .. first[i] + lengths[i] - 1`` of every row ``rows[i]`` lie in
    the token arena read as whole blocks (``[num_rows * width // bs, bs]``), concatenated
    (``starts``: where each segment starts there); None unless every row's token ids are in
    the arena and its rows are whole blocks."""
    width = state.tokens.shape[1]
    if width % bs or count_nonzero(state.in_arena[rows]) < len(rows):
        return None
    wb = width // bs  # blocks per row of the token arena
    if total == len(rows):  # one block each (decode steps): no repeats to build
        return rows * wb + first
    return np.arange(total) + (rows * wb + (first - starts)).repeat(lengths)
