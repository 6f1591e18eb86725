"""BlockPool: null block, free-queue order, reference counts, eviction and the prefix index."""

from __future__ import annotations

import pytest

from blocktable.allocator import AllocatorGroupSpec, BlockPool, OutOfBlocksError
from blocktable.allocator.hashing import content_prefix, root_prefix
from blocktable.allocator.pool import INDEX_LIMIT_FACTOR


def _key(parent: bytes, token: int) -> bytes:
    return parent + token.to_bytes(8, "little")


def _refs(pool: BlockPool) -> list[int]:
    return [pool.ref_count(b) for b in range(pool.num_blocks)]


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    assert pool.take(4) == [1, 2, 3, 4]
    with pytest.raises(OutOfBlocksError, match="need 1 blocks, 0 free of 4"):
        pool.take(1)
    pool.release([4, 3, 2, 1])
    assert sorted(pool.take(4)) == [1, 2, 3, 4]
    pool.check_integrity([0, 1, 1, 1, 1])


@pytest.mark.parametrize("num_blocks", [0, 1, -3])
def test_num_blocks_below_two_is_rejected(num_blocks: int) -> None:
    with pytest.raises(ValueError, match=f"num_blocks must be >= 2.*got {num_blocks}"):
        BlockPool(num_blocks)
    with pytest.raises(ValueError, match=f"num_blocks must be >= 2.*got {num_blocks}"):
        AllocatorGroupSpec(block_size=16, num_blocks=num_blocks)


def test_spec_argument_types() -> None:
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        BlockPool(2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        AllocatorGroupSpec(block_size=16, num_blocks=True)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        AllocatorGroupSpec(block_size=0, num_blocks=8)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        AllocatorGroupSpec(block_size=4, num_blocks=8, sliding_window=0)


def test_take_failure_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.take(2)
    with pytest.raises(OutOfBlocksError):
        pool.take(2)
    assert pool.num_free_blocks == 1
    assert pool.eviction_order() == [3]


def test_uncached_free_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(6)
    a = pool.take(5)
    assert a == [1, 2, 3, 4, 5]
    pool.release([2])
    pool.release([5, 4])
    assert pool.eviction_order() == [2, 5, 4]
    assert pool.take(2) == [2, 5]


def test_cached_blocks_go_after_uncached_ones_in_lru_order() -> None:
    pool = BlockPool(8)
    blocks = pool.take(7)
    parent = root_prefix(None)
    for i, b in enumerate(blocks[:4]):  # blocks 1..4 cached (one chain)
        content_id = pool.cache_block(b, _key(parent, i), b"h%d" % i)
        parent = content_prefix(content_id)
    # A request frees its tail first: 4, 3 become evictable before 2, 1.
    pool.release([4, 3])
    pool.release([7])  # uncached
    pool.release([2, 1])
    pool.release([6, 5])  # uncached
    assert pool.eviction_order() == [7, 6, 5, 4, 3, 2, 1]
    assert pool.num_cached_blocks == 4
    # Reusing a cached block (a hit) refreshes its recency.
    pool.share([3])
    pool.release([3])
    assert pool.eviction_order() == [7, 6, 5, 4, 2, 1, 3]
    assert pool.take(4) == [7, 6, 5, 4]  # the last one evicted block 4
    assert pool.num_cached_blocks == 3
    assert pool.block_hash(4) is None and pool.content_id(4) is None
    pool.check_integrity([0, 0, 0, 0, 1, 1, 1, 1])


def test_share_takes_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    [b] = pool.take(1)
    pool.cache_block(b, _key(root_prefix(None), 7), b"h")
    pool.release([b])
    assert pool.num_free_blocks == 3
    pool.share([b])
    pool.share([b])
    assert pool.ref_count(b) == 2 and pool.num_free_blocks == 2
    assert b not in pool.eviction_order()
    pool.release([b])
    assert b not in pool.eviction_order()
    pool.release([b])
    assert pool.eviction_order()[-1] == b
    pool.check_integrity([0, 0, 0, 0])


def test_eviction_drops_the_block_from_the_index_before_reuse() -> None:
    pool = BlockPool(3)
    key = _key(root_prefix(None), 42)
    a, b = pool.take(2)
    content_id = pool.cache_block(a, key, b"h")
    assert pool.lookup(key) == (content_id, a)
    pool.release([a])
    assert pool.lookup(key) == (content_id, a)  # freed blocks stay findable
    assert pool.take(1) == [a]  # evicts it (no uncached block left)
    assert pool.lookup(key) is None
    assert pool.num_cached_blocks == 0
    # Computing the same content again revives the key with its content id, so children
    # cached under that id stay reachable.
    assert pool.cache_block(b, key, b"h") == content_id
    assert pool.lookup(key) == (content_id, b)
    pool.check_integrity([0, 1, 1])


def test_same_content_in_two_owned_blocks_keeps_one_findable_until_both_are_freed() -> None:
    pool = BlockPool(4)
    key = _key(root_prefix(None), 1)
    a, b, c = pool.take(3)
    content_id = pool.cache_block(a, key, b"h")
    assert pool.cache_block(b, key, b"h") == content_id  # b duplicates a
    assert pool.num_cached_blocks == 1 and pool.duplicate_key(b) == (key, content_id)
    assert pool.block_hash(b) == b"h"
    pool.release([a])  # the holder is freed while b is owned: b becomes the holder
    assert pool.lookup(key) == (content_id, b)
    assert pool.eviction_order() == [a]  # a is now a plain free block, reused first
    pool.check_integrity([0, 0, 1, 1])
    # A copy computed while the holder is free replaces it (the free one is then uncached).
    pool.release([b])
    assert pool.cache_block(c, key, b"h") == content_id
    assert pool.lookup(key) == (content_id, c)
    assert pool.eviction_order() == [a, b]
    assert pool.num_cached_blocks == 1
    pool.check_integrity([0, 0, 0, 1])


def test_dead_keys_are_bounded() -> None:
    pool = BlockPool(5)
    for i in range(200):  # every block computed with new content, then evicted
        [b] = pool.take(1)
        pool.cache_block(b, _key(root_prefix(None), i), b"h")
        pool.release([b])
        pool.check_integrity([0] * 5)
    assert len(pool._index) <= INDEX_LIMIT_FACTOR * pool.num_blocks
    assert pool.num_cached_blocks == 4
    for i in range(196, 200):
        assert pool.lookup(_key(root_prefix(None), i)) is not None


def test_no_caching_pool_never_caches() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.take(2)
    pool.release(blocks)
    assert pool.num_cached_blocks == 0
    pool.check_integrity([0, 0, 0])
    assert _refs(pool) == [0, 0, 0]
