"""The blocks of one KV cache group: reference counts, the free queue and the prefix index."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from blocktable.allocator.errors import OutOfBlocksError
from blocktable.allocator.hashing import CacheKey
from blocktable.allocator.integrity import check_pool_integrity
from blocktable.allocator.lru import LruQueue

INDEX_LIMIT_FACTOR = 2  # the index may keep this many keys per block before dropping dead ones
_DROP_PER_INSERT = 2  # keys re-examined per newly cached block while over the limit

Hit = tuple[int, int]  # (content_id, block_id)


class BlockPool:
    """``num_blocks`` blocks of one KV cache group; block 0 is the null block, never handed out.

    A block is *owned* (reference count > 0: held by that many requests) or *free*. Free blocks
    wait in two queues, and :meth:`take` empties them in this order:

    1. free blocks holding no cached content, least recently freed first;
    2. free cached blocks, least recently used first. Taking one *evicts* it: its content id is
       reset before it is handed out, so the prefix index never returns it for its old content.

    Cached content therefore survives as long as possible, least recently used first.
    :meth:`release` queues blocks in the order given; the manager passes a request's blocks
    tail first, so its tail is evicted before the prefix other requests may share.

    The prefix index maps a cache key (see :mod:`blocktable.allocator.hashing`) to its content
    id and the one block, the *holder*, that lookups return. A block computed with content
    that is already cached becomes the holder if the old holder is free (the old one becomes
    an uncached free block), else a *duplicate*: owned, not indexed, and promoted to holder
    when the holder is freed, so content stays findable while any request owns a copy.

    Eviction only resets the block's content id (O(1), no index memory touched). The key stays,
    dead, until its content is computed again (it keeps its content id, so cached children
    stay reachable) or the index holds more than ``INDEX_LIMIT_FACTOR * num_blocks`` keys;
    then each newly cached block also drops up to two dead keys, oldest first.

    Parameters
    ----------
    num_blocks : int
        Pool size including the null block; at least 2.
    enable_caching : bool
        When False, nothing is ever cached and every free block is uncached.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Per block id, on cpu:
        self._ref_counts = [0] * num_blocks
        self._content = [0] * num_blocks  # content id the block holds for the index, 0 = none
        self._dup_of = [0] * num_blocks  # content id an owned duplicate holds, 0 = none
        self._block_hashes: list[bytes | None] = [None] * num_blocks  # valid where cached/dup
        self._free_uncached: deque[int] = deque(range(1, num_blocks))  # FIFO
        self._free_cached = LruQueue(num_blocks)  # least recently used first
        self._index: dict[CacheKey, Hit] = {}  # key -> (content id, holder); holder maybe evicted
        self._index_order: deque[CacheKey] = deque()  # the index's keys, oldest first
        self._dups: dict[int, tuple[CacheKey, list[int]]] = {}  # content id -> key, duplicates
        self._num_cached_blocks = 0
        self._next_content_id = 1

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that :meth:`take` can hand out now (uncached or evictable)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is findable by prefix lookup (owned or free)."""
        return self._num_cached_blocks

    def ref_count(self, block_id: int) -> int:
        """How many requests hold ``block_id``."""
        return self._ref_counts[block_id]

    def content_id(self, block_id: int) -> int | None:
        """The content id of a cached block, else None."""
        return self._content[block_id] or None

    def block_hash(self, block_id: int) -> bytes | None:
        """The chained hash of the content of a cached or duplicate block, else None."""
        if self._content[block_id] or self._dup_of[block_id]:
            return self._block_hashes[block_id]
        return None

    def duplicate_key(self, block_id: int) -> tuple[CacheKey, int] | None:
        """``(key, content_id)`` of the content a duplicate block holds, else None."""
        content_id = self._dup_of[block_id]
        return (self._dups[content_id][0], content_id) if content_id else None

    def eviction_order(self) -> list[int]:
        """Free block ids in the order :meth:`take` hands them out (for tests and debugging)."""
        return [*self._free_uncached, *self._free_cached]

    def live_keys(self) -> dict[int, tuple[CacheKey, int]]:
        """``{block_id: (key, content_id)}`` for every cached block (O(index); for checks)."""
        content = self._content
        return {
            block_id: (key, content_id)
            for key, (content_id, block_id) in self._index.items()
            if content[block_id] == content_id
        }

    # ----------------------------------------------------------------- blocks
    def take(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` free blocks with reference count 1 (evicting cached ones).

        Raises
        ------
        OutOfBlocksError
            When fewer blocks are free; nothing is taken.
        """
        uncached = self._free_uncached
        if num_blocks == 1 and (uncached or self._free_cached):  # the decode fast path
            if uncached:
                block_id = uncached.popleft()
            else:
                block_id = self._free_cached.pop_one()
                self._content[block_id] = 0
                self._num_cached_blocks -= 1
            self._ref_counts[block_id] = 1
            return [block_id]
        num_evict = num_blocks - len(uncached)
        if num_evict <= 0:
            popleft = uncached.popleft
            block_ids = [popleft() for _ in range(num_blocks)]
        elif num_evict > len(self._free_cached):
            raise OutOfBlocksError(
                f"need {num_blocks} blocks, {self.num_free_blocks} free of {self.num_blocks - 1}"
            )
        else:
            block_ids = list(uncached)
            uncached.clear()
            evicted = self._free_cached.pop_front(num_evict)
            content = self._content
            for block_id in evicted:
                content[block_id] = 0
            block_ids += evicted
            self._num_cached_blocks -= num_evict
        ref_counts = self._ref_counts
        for block_id in block_ids:
            ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block; a free cached block leaves the free queue."""
        ref_counts = self._ref_counts
        free_cached = self._free_cached
        for block_id in block_ids:
            if ref_counts[block_id] == 0:
                free_cached.remove(block_id)
            ref_counts[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in order."""
        ref_counts = self._ref_counts
        content = self._content
        newly_free_cached: list[int] = []  # queued at the end: the other queue is independent
        for block_id in block_ids:
            count = ref_counts[block_id] - 1
            ref_counts[block_id] = count
            if count:
                continue
            if not content[block_id]:
                if self._dups and self._dup_of[block_id]:
                    self._forget_duplicate(block_id)
                self._free_uncached.append(block_id)
            elif self._dups and content[block_id] in self._dups:
                self._promote_duplicate(block_id)
                self._free_uncached.append(block_id)
            else:
                newly_free_cached.append(block_id)
        if newly_free_cached:
            self._free_cached.extend(newly_free_cached)

    def _forget_duplicate(self, block_id: int) -> None:
        content_id = self._dup_of[block_id]
        duplicates = self._dups[content_id][1]
        duplicates.remove(block_id)
        if not duplicates:
            del self._dups[content_id]
        self._dup_of[block_id] = 0

    def _promote_duplicate(self, holder: int) -> None:
        """The holder of a content is freed while a duplicate is owned: index the duplicate."""
        content_id = self._content[holder]
        key, duplicates = self._dups[content_id]
        block_id = duplicates.pop()
        if not duplicates:
            del self._dups[content_id]
        self._dup_of[block_id] = 0
        self._index[key] = (content_id, block_id)
        self._content[block_id] = content_id
        self._content[holder] = 0

    # ----------------------------------------------------------------- prefix index
    def lookup(self, key: CacheKey) -> Hit | None:
        """``(content_id, block_id)`` of the block holding exactly the content of ``key``."""
        hit = self._index.get(key)
        if hit is None or self._content[hit[1]] != hit[0]:
            return None  # never cached, or evicted (the key keeps its id for a recomputation)
        return hit

    def find_chain(
        self, parent: bytes, tokens: memoryview, block_bytes: int, stop: int
    ) -> list[Hit]:
        """The cached blocks ``0, 1, ...`` (up to ``stop``) of a prompt, as long as they chain.

        ``parent`` is the root prefix of the prompt's first key (see
        :func:`~blocktable.allocator.hashing.root_prefix`); block ``i`` is
        ``tokens[i * block_bytes : (i + 1) * block_bytes]``.
        """
        get, content = self._index.get, self._content
        hits: list[Hit] = []
        for i in range(stop):
            hit = get(parent + tokens[i * block_bytes : (i + 1) * block_bytes])
            if hit is None or content[hit[1]] != hit[0]:
                break
            hits.append(hit)
            parent = b"C" + hit[0].to_bytes(8, "little")  # hashing.content_prefix, inlined
        return hits

    def cache_block(self, block_id: int, key: CacheKey, block_hash: bytes) -> int:
        """Make an owned, full, computed block findable under ``key``; return its content id.

        If an owned block already holds this content, ``block_id`` becomes its duplicate.
        """
        index, content = self._index, self._content
        hit = index.get(key)
        if hit is None:
            content_id = self._next_content_id
            self._next_content_id += 1
            self._index_order.append(key)
            if len(index) >= INDEX_LIMIT_FACTOR * self.num_blocks:
                self._drop_dead_keys(_DROP_PER_INSERT)
        else:
            content_id, holder = hit
            if content[holder] == content_id:
                self._block_hashes[block_id] = block_hash
                if self._ref_counts[holder]:
                    self._dup_of[block_id] = content_id
                    self._dups.setdefault(content_id, (key, []))[1].append(block_id)
                    return content_id
                # The holder is free: keep the owned copy; the free one is just a free block.
                self._free_cached.remove(holder)
                content[holder] = 0
                self._free_uncached.append(holder)
                self._num_cached_blocks -= 1
        index[key] = (content_id, block_id)
        content[block_id] = content_id
        self._block_hashes[block_id] = block_hash
        self._num_cached_blocks += 1
        return content_id

    def _drop_dead_keys(self, num_keys: int) -> None:
        order, index, content = self._index_order, self._index, self._content
        for _ in range(num_keys):
            key = order.popleft()
            content_id, block_id = index[key]
            if content[block_id] == content_id:
                order.append(key)
            else:
                del index[key]

    def check_integrity(self, expected_ref_counts: Sequence[int]) -> None:
        """Check refcounts against ``expected_ref_counts`` and the queues against the index.

        See :func:`blocktable.allocator.integrity.check_pool_integrity`.
        """
        check_pool_integrity(self, expected_ref_counts)
