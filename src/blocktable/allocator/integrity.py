"""``KVCacheManager.check_integrity``: every invariant of the allocator, checked from scratch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn

from blocktable.allocator.errors import IntegrityError
from blocktable.allocator.hashing import CacheKey, content_prefix, root_prefix
from blocktable.allocator.request import RequestState, block_token_bytes
from blocktable.constants import NULL_BLOCK_ID

if TYPE_CHECKING:
    from blocktable.allocator.manager import KVCacheManager
    from blocktable.allocator.pool import BlockPool


def _check_request(
    mgr: KVCacheManager,
    req: RequestState,
    ref_counts: list[list[int]],
    live_keys: list[dict[int, tuple[CacheKey, int]]],
) -> None:
    def fail(msg: str) -> NoReturn:
        raise IntegrityError(f"request {req.req_id!r}: {msg}")

    if req.num_computed_tokens > req.num_tokens:
        fail(f"{req.num_computed_tokens} tokens computed but {req.num_tokens} known")
    for g, (pool, blocks) in enumerate(zip(mgr.pools, req.blocks)):
        block_size = mgr.block_sizes[g]
        skip = req.num_skipped_blocks[g]
        if len(blocks) * block_size < req.num_computed_tokens:
            fail(f"group {g}: {len(blocks)} blocks cannot hold {req.num_computed_tokens} tokens")
        if any(b != NULL_BLOCK_ID for b in blocks[:skip]) or NULL_BLOCK_ID in blocks[skip:]:
            fail(f"group {g}: null entries are not exactly the first {skip}: {blocks}")
        owned = blocks[skip:]
        if len(set(owned)) != len(owned):
            fail(f"group {g}: a block appears twice in {blocks}")
        if any(not 0 < b < pool.num_blocks for b in owned):
            fail(f"group {g}: block id out of range in {blocks}")
        counts = ref_counts[g]
        for b in owned:
            counts[b] += 1
        num_hashed = req.num_hashed_blocks[g]
        if not mgr.enable_prefix_caching:
            if num_hashed:
                fail(f"group {g}: blocks hashed with prefix caching off")
            continue
        if num_hashed != req.num_computed_tokens // block_size:
            fail(f"group {g}: {num_hashed} blocks hashed, want every full computed block")
        # Every owned full computed block holds its content for the index: as the holder
        # (live key) or as a duplicate, under exactly its tokens and its prefix's content id.
        token_bytes = block_token_bytes(req.tokens, block_size, 0, num_hashed)
        parent: bytes | None = root_prefix(req.namespace)
        for i in range(skip, num_hashed):
            if i and i == skip:
                parent = None  # the content id of a block left behind the window is not kept
            b = blocks[i]
            found = live_keys[g].get(b) or pool.duplicate_key(b)
            if found is None:
                fail(f"group {g}: full computed block {b} (index {i}) is not in the index")
            key, content_id = found
            if not key.endswith(token_bytes[i]) or (
                parent is not None and key != parent + token_bytes[i]
            ):
                fail(f"group {g}: block {b} (index {i}) is indexed as other content")
            parent = content_prefix(content_id)
        for b in blocks[max(num_hashed, skip) :]:
            if b in live_keys[g] or pool.duplicate_key(b) is not None:
                fail(f"group {g}: block {b} is not full and computed but is in the index")
        if num_hashed > skip:
            if req.parent_prefixes[g] != parent:
                fail(f"group {g}: the cache key chain does not continue from its last block")
            if req.parent_hashes[g] != pool.block_hash(blocks[num_hashed - 1]):
                fail(f"group {g}: the hash chain does not continue from its last block")


def check_manager_integrity(
    mgr: KVCacheManager,
    requests: Mapping[str | int, RequestState],
    holders: Sequence[RequestState | None],
    free_rows: Sequence[int],
) -> None:
    """Raise :class:`IntegrityError` unless every invariant holds.

    * each running request holds exactly one row and each held row one running request; the
      free rows are the others, each listed once;
    * each request's rows: null entries exactly where a sliding window released blocks, no
      block twice, enough blocks for the computed tokens; with prefix caching, every full
      computed block hashed, and those in the index filed under the request's own tokens and
      prefix;
    * per pool: refcount of each block = number of requests holding it; the free queues hold
      exactly the unowned blocks, cached ones in the cached queue; each cached block has a
      live index key; the null block is never free, owned or cached.
    """
    ref_counts = [[0] * pool.num_blocks for pool in mgr.pools]
    live_keys = [pool.live_keys() for pool in mgr.pools]
    for req_id, req in requests.items():
        if req.req_id != req_id or not 0 <= req.row < len(holders) or holders[req.row] is not req:
            raise IntegrityError(f"request {req_id!r} and row {req.row} do not point to each other")
        _check_request(mgr, req, ref_counts, live_keys)
    held = {row for row, req in enumerate(holders) if req is not None}
    if len(held) != len(requests):
        raise IntegrityError(f"{len(held)} rows held by {len(requests)} running requests")
    if len(set(free_rows)) != len(free_rows) or set(free_rows) != set(range(len(holders))) - held:
        raise IntegrityError(f"free rows {sorted(free_rows)} do not complement held rows")
    for pool, counts in zip(mgr.pools, ref_counts):
        pool.check_integrity(counts)


def check_pool_integrity(pool: BlockPool, expected_ref_counts: Sequence[int]) -> None:
    """Raise :class:`IntegrityError` unless the pool's structures agree with each other.

    Refcounts equal ``expected_ref_counts``; the free queues hold exactly the unowned blocks
    (never the null block), the cached ones in the cached queue; every cached block is the
    live holder of exactly one index key; content ids are unique; duplicates are owned,
    uncached, and their content has an owned holder.
    """

    def fail(msg: str) -> NoReturn:
        raise IntegrityError(f"BlockPool({pool.num_blocks}): {msg}")

    ref_counts, content, dup_of = pool._ref_counts, pool._content, pool._dup_of
    if list(expected_ref_counts) != ref_counts:
        b = next(b for b in range(pool.num_blocks) if expected_ref_counts[b] != ref_counts[b])
        fail(f"block {b} has refcount {ref_counts[b]} but {expected_ref_counts[b]} holders")
    uncached, cached = list(pool._free_uncached), list(pool._free_cached)
    free = set(uncached) | set(cached)
    if len(free) != len(uncached) + len(cached):
        fail("a block is queued twice")
    want_free = {b for b in range(1, pool.num_blocks) if ref_counts[b] == 0}
    if free != want_free:
        fail(
            f"free queue and refcounts disagree: queued but owned {sorted(free - want_free)[:8]}"
            f", unowned but not queued {sorted(want_free - free)[:8]}"
        )
    if any(content[b] or dup_of[b] for b in uncached) or not all(content[b] for b in cached):
        fail("a free block is in the wrong queue for its cached state")
    if content[NULL_BLOCK_ID] or dup_of[NULL_BLOCK_ID] or ref_counts[NULL_BLOCK_ID]:
        fail("the null block is cached or owned")
    content_ids = [content_id for content_id, _ in pool._index.values()]
    if len(set(content_ids)) != len(content_ids):
        fail("two index keys share a content id")
    order = pool._index_order
    if len(order) != len(pool._index) or set(order) != set(pool._index):
        fail("the index and its key order disagree")
    live = pool.live_keys()
    cached_blocks = {b for b, c in enumerate(content) if c}
    if set(live) != cached_blocks:
        fail(f"cached blocks without a live index key: {sorted(cached_blocks - set(live))[:8]}")
    if len(cached_blocks) != pool.num_cached_blocks:
        fail(f"{len(cached_blocks)} blocks cached, the counter says {pool.num_cached_blocks}")
    if not pool.enable_caching and (cached_blocks or pool._index):
        fail("caching is disabled but blocks are cached")
    listed: set[int] = set()
    for content_id, (key, duplicates) in pool._dups.items():
        holder = pool._index[key][1] if key in pool._index else -1
        if live.get(holder, (b"", -1))[1] != content_id or not ref_counts[holder]:
            fail(f"duplicates of content {content_id} have no owned live holder")
        for b in duplicates:
            if b in listed or content[b] or dup_of[b] != content_id or not ref_counts[b]:
                fail(f"duplicate block {b} of content {content_id} is inconsistent")
            listed.add(b)
    if listed != {b for b, c in enumerate(dup_of) if c}:
        fail("the duplicate marks and the duplicate lists disagree")
