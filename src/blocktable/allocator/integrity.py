"""``KVCacheManager.check_integrity``: every invariant of the allocator, checked from scratch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from blocktable.allocator.errors import IntegrityError
from blocktable.allocator.request import KeyChains, RequestState
from blocktable.block_hashing import (
    ChainPowers,
    block_content_hashes,
    chain_keys,
    encode_namespace,
    namespace_seed,
)
from blocktable.constants import NULL_BLOCK_ID

# The manager and the pool call these checks: they are typed Any here, so that this module
# imports neither of them (no import cycle).


def has_repeats(ids: np.ndarray) -> bool:
    """Whether some value occurs twice in ``ids``."""
    if len(ids) < 2:
        return False
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


def _check_request(mgr: Any, req: RequestState, ref_counts: list[np.ndarray]) -> None:
    def fail(msg: str) -> NoReturn:
        raise IntegrityError(f"request {req.req_id!r}: {msg}")

    if req.num_computed_tokens > req.num_tokens:
        fail(f"{req.num_computed_tokens} tokens computed but {req.num_tokens} known")
    if req.num_slots != min(n * bs for n, bs in zip(req.row_len, mgr.block_sizes)):
        fail("num_slots does not match the rows")
    tokens = req.token_array().copy()
    for g, (pool, bs) in enumerate(zip(mgr.pools, mgr.block_sizes)):
        if not 0 <= req.row_len[g] <= mgr._row_state.blocks[g].shape[1]:
            fail(f"group {g}: row length {req.row_len[g]} outside its arena")
        blocks = req.blocks(g).astype(np.int64)
        skip = req.num_skipped_blocks[g]
        if len(blocks) * bs < req.num_computed_tokens:
            fail(f"group {g}: {len(blocks)} blocks cannot hold {req.num_computed_tokens} tokens")
        if (blocks[:skip] != NULL_BLOCK_ID).any() or (blocks[skip:] == NULL_BLOCK_ID).any():
            fail(f"group {g}: null entries are not exactly the first {skip}: {blocks.tolist()}")
        owned = blocks[skip:]
        if has_repeats(owned):
            fail(f"group {g}: a block appears twice in {blocks.tolist()}")
        if ((owned <= 0) | (owned >= pool.num_blocks)).any():
            fail(f"group {g}: block id out of range in {blocks.tolist()}")
        np.add.at(ref_counts[g], owned, 1)
        num_hashed = int(mgr.prefix_cache.chains.num_hashed[g][req.row])
        if not mgr.enable_prefix_caching:
            if num_hashed:
                fail(f"group {g}: blocks hashed with prefix caching off")
            continue
        if num_hashed != req.num_computed_tokens // bs:
            fail(f"group {g}: {num_hashed} blocks hashed, want every full computed block")
        _check_keys(req, bs, mgr.prefix_cache.chains, fail)
        # Every owned full computed block holds its content for the index (as the holder or a
        # duplicate, under exactly its tokens and its parent's content id), unless a colliding
        # key displaced it; blocks past it are not in the index.
        index = pool.index
        prev_slot = -1
        for i in range(skip, num_hashed):
            b = int(blocks[i])
            slot = int(pool.record[b]) if pool.record[b] >= 0 else int(pool.dup_of[b])
            if slot < 0:
                prev_slot = -1
                continue
            if not (index.tokens[slot] == tokens[i * bs : (i + 1) * bs]).all():
                fail(f"group {g}: block {b} (index {i}) is indexed as other content")
            want_parent = (
                req.root if i == 0 else (int(index.cid[prev_slot]) if prev_slot >= 0 else None)
            )
            if want_parent is not None and int(index.parent[slot]) != want_parent:
                fail(f"group {g}: block {b} (index {i}) has another parent in the index")
            prev_slot = slot
        parent_cid = int(mgr.prefix_cache.chains.parent_cid[g][req.row])
        if num_hashed > skip and prev_slot >= 0 and parent_cid != index.cid[prev_slot]:
            fail(f"group {g}: the content id chain does not continue from its last block")
        if not num_hashed and parent_cid != req.root:
            fail(f"group {g}: nothing registered, but the parent content id is {parent_cid}")
        rest = blocks[max(num_hashed, skip) :]
        if (pool.record[rest] >= 0).any() or (pool.dup_of[rest] >= 0).any():
            fail(f"group {g}: a block that is not full and computed is in the index")


def _check_keys(req: RequestState, bs: int, chains: KeyChains, fail) -> None:  # type: ignore[no-untyped-def]
    """The stored prompt keys and the chain state equal a fresh computation from the tokens."""
    num_keys = int(chains.num_keys[bs][req.row])
    stored = len(req.keys[bs])
    if stored != req.num_prompt_tokens // bs:
        fail(f"{stored} prompt keys for block size {bs}, {req.num_prompt_tokens} prompt tokens")
    if num_keys < stored or num_keys > req.num_tokens // bs:
        fail(f"key chain at block {num_keys} for block size {bs}, {stored} stored")
    powers = ChainPowers(bs)
    hashes = block_content_hashes(req.token_array(0, num_keys * bs).reshape(-1, bs), powers)
    seed = np.array([namespace_seed(encode_namespace(req.namespace))], dtype=np.uint64)
    keys, states = chain_keys(hashes, np.array([num_keys]), seed, powers)
    if not np.array_equal(keys[:stored], req.keys[bs]):
        fail(f"block keys for block size {bs} do not match the tokens")
    if not np.array_equal(states[:stored], req.prompt_states[bs]):
        fail(f"prompt key chain states for block size {bs} do not match the tokens")
    if num_keys and int(states[-1]) != int(chains.state[bs][req.row]):
        fail(f"key chain state for block size {bs} does not match the tokens")


def check_manager_integrity(
    mgr: Any,
    requests: Mapping[str | int, RequestState],
    holders: Sequence[RequestState | None],
    free_rows: Sequence[int],
) -> None:
    """Raise :class:`IntegrityError` unless every invariant holds.

    * each running request holds exactly one row and each held row one running request; the
      free rows are the others, each listed once;
    * each request's rows: null entries exactly where a sliding window released blocks, no
      block twice, enough blocks for the computed tokens; with prefix caching, every full
      computed block hashed, its key equal to a fresh computation, and blocks in the index
      filed under the request's own tokens and parent;
    * per pool (:func:`check_pool_integrity`): refcount of each block = number of requests
      holding it, the queues, the records and the index agree.
    """
    ref_counts = [np.zeros(pool.num_blocks, dtype=np.int64) for pool in mgr.pools]
    for req_id, req in requests.items():
        if req.req_id != req_id or not 0 <= req.row < len(holders) or holders[req.row] is not req:
            raise IntegrityError(f"request {req_id!r} and row {req.row} do not point to each other")
        _check_request(mgr, req, ref_counts)
    held = {row for row, req in enumerate(holders) if req is not None}
    if len(held) != len(requests):
        raise IntegrityError(f"{len(held)} rows held by {len(requests)} running requests")
    if len(set(free_rows)) != len(free_rows) or set(free_rows) != set(range(len(holders))) - held:
        raise IntegrityError(f"free rows {sorted(free_rows)} do not complement held rows")
    for pool, counts in zip(mgr.pools, ref_counts):
        pool.check_integrity(counts)


def check_pool_integrity(pool: Any, expected_ref_counts: Sequence[int] | np.ndarray) -> None:
    """Raise :class:`IntegrityError` unless the pool's structures agree with each other.

    Refcounts equal ``expected_ref_counts``; the free queues hold exactly the unowned blocks
    (never the null block), the cached ones in the cached queue; every cached block holds a
    live record filed under its key; the index files every used record under its own key;
    content ids are unique; duplicates are owned, uncached, and their record has an owned
    holder.
    """

    def fail(msg: str) -> NoReturn:
        raise IntegrityError(f"BlockPool({pool.num_blocks}): {msg}")

    ref_counts, record, dup_of, index = pool.ref_counts, pool.record, pool.dup_of, pool.index
    expected = np.asarray(expected_ref_counts)
    if not np.array_equal(expected, ref_counts):
        b = int(np.flatnonzero(expected != ref_counts)[0])
        fail(f"block {b} has refcount {ref_counts[b]} but {expected[b]} holders")
    uncached, cached = pool.uncached.ids().tolist(), pool.cached.ids().tolist()
    if len(uncached) != len(pool.uncached) or len(cached) != len(pool.cached):
        fail("a queue's length disagrees with its live slots")
    free = set(uncached) | set(cached)
    if len(free) != len(uncached) + len(cached):
        fail("a block is queued twice")
    want_free = set((np.flatnonzero(ref_counts[1:] == 0) + 1).tolist())
    if free != want_free:
        fail(
            f"free queue and refcounts disagree: queued but owned {sorted(free - want_free)[:8]}"
            f", unowned but not queued {sorted(want_free - free)[:8]}"
        )
    if any(record[b] >= 0 or dup_of[b] >= 0 for b in uncached):
        fail("an uncached free block holds a record")
    if any(record[b] < 0 for b in cached):
        fail("a cached free block holds no record")
    if ref_counts[NULL_BLOCK_ID] or record[NULL_BLOCK_ID] >= 0 or dup_of[NULL_BLOCK_ID] >= 0:
        fail("the null block is cached or owned")
    holders = np.flatnonzero(record >= 0)
    slots = record[holders]
    if has_repeats(slots):
        fail("two blocks hold one record")
    if not np.array_equal(index.holder[slots], holders) or (index.cid[slots] == 0).any():
        fail("a cached block and its record do not point to each other")
    live = index.live_slots()
    if len(live) != len(holders):
        fail(f"{len(live)} live records but {len(holders)} cached blocks")
    if len(holders) != pool.num_cached_blocks:
        fail(f"{len(holders)} blocks cached, the counter says {pool.num_cached_blocks}")
    used = np.flatnonzero(index.cid != 0)
    if len(used) != len(index.slot_of_key) or len(used) != len(index):
        fail(f"{len(used)} records, {len(index.slot_of_key)} keys, counter {len(index)}")
    filed_keys, filed_slots = index.slot_of_key.items()
    keys = np.array(filed_keys, dtype=np.uint64)
    slots = np.array(filed_slots, dtype=np.int64)
    if (index.cid[slots] == 0).any() or not np.array_equal(index.key[slots], keys):
        fail("a key is filed under a record of another key")
    if has_repeats(index.cid[used]):
        fail("two records share a content id")
    if len(used) > index.max_records:
        fail(f"{len(used)} records exceed max_records={index.max_records}")
    if not pool.enable_caching and len(used):
        fail("caching is disabled but blocks are cached")
    listed: set[int] = set()
    for slot, copies in pool.dups.items():
        holder = int(index.holder[slot])
        if not copies or index.cid[slot] == 0 or not holder or not ref_counts[holder]:
            fail(f"duplicates of record {slot} have no owned live holder")
        for b in copies:
            if b in listed or record[b] >= 0 or dup_of[b] != slot or not ref_counts[b]:
                fail(f"duplicate block {b} of record {slot} is inconsistent")
            listed.add(b)
    if listed != set(np.flatnonzero(dup_of >= 0).tolist()):
        fail("the duplicate marks and the duplicate lists disagree")
