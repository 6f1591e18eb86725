"""BlockPool: null block, free-queue order, reference counts, eviction, records and the index."""

from __future__ import annotations

import numpy as np
import pytest

from blocktable.allocator import AllocatorGroupSpec, BlockPool, OutOfBlocksError
from blocktable.allocator.index import PrefixIndex
from blocktable.block_queue import BlockQueue, last_occurrences

ROOT = -1  # parent content id of a first block (namespace 1)

pytestmark = pytest.mark.usefixtures("compiled_mode")  # compiled (where built), then numpy


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def cache(pool: BlockPool, blocks: list[int], tokens: list[int], parent: int = ROOT) -> list[int]:
    """File ``blocks`` as one chain (block size 1: one token each) with keys = token ids."""
    keys = np.array([t * 1000 + 7 for t in tokens], dtype=np.uint64)
    toks = np.array(tokens, dtype=np.int64).reshape(-1, 1)
    starts, parents = np.zeros(1, np.int64), np.array([parent])  # one chain
    return pool.cache(ids(*blocks), keys, toks, starts, parents).tolist()


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    assert pool.take(4).tolist() == [1, 2, 3, 4]
    with pytest.raises(OutOfBlocksError, match="need 1 blocks, 0 free of 4"):
        pool.take(1)
    pool.release(ids(4, 3, 2, 1))
    assert sorted(pool.take(4).tolist()) == [1, 2, 3, 4]
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
    assert pool.take(5).tolist() == [1, 2, 3, 4, 5]
    pool.release(ids(2))
    pool.release(ids(5, 4))
    assert pool.eviction_order() == [2, 5, 4]
    assert pool.take(2).tolist() == [2, 5]
    assert pool.take(1).tolist() == [4]


def test_cached_blocks_go_after_uncached_ones_in_lru_order() -> None:
    pool = BlockPool(8)
    blocks = pool.take(7).tolist()
    cache(pool, blocks[:4], [0, 1, 2, 3])  # blocks 1..4 cached (one chain)
    # A request frees its tail first: 4, 3 become evictable before 2, 1.
    pool.release(ids(4, 3))
    pool.release(ids(7))  # uncached
    pool.release(ids(2, 1))
    pool.release(ids(6, 5))  # uncached
    assert pool.eviction_order() == [7, 6, 5, 4, 3, 2, 1]
    assert pool.num_cached_blocks == 4
    # Reusing a cached block (a hit) refreshes its recency.
    pool.share_many(ids(3))
    pool.release(ids(3))
    assert pool.eviction_order() == [7, 6, 5, 4, 2, 1, 3]
    assert pool.take(4).tolist() == [7, 6, 5, 4]  # the last one evicted block 4
    assert pool.num_cached_blocks == 3
    assert pool.block_hash(4) is None and pool.content_id(4) is None
    assert pool.take(1).tolist() == [2]  # evicts too
    pool.check_integrity([0, 0, 1, 0, 1, 1, 1, 1])


def test_share_takes_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    [b] = pool.take(1).tolist()
    cache(pool, [b], [7])
    pool.release(ids(b))
    assert pool.num_free_blocks == 3
    pool.share_many(ids(b, b))
    assert pool.ref_count(b) == 2 and pool.num_free_blocks == 2
    assert b not in pool.eviction_order()
    pool.release(ids(b))
    assert b not in pool.eviction_order()
    pool.release(ids(b))
    assert pool.eviction_order()[-1] == b
    pool.check_integrity([0, 0, 0, 0])


def test_release_with_repeats_queues_each_block_where_its_last_reference_went() -> None:
    pool = BlockPool(6)
    pool.take(5)
    pool.share_many(ids(2, 3))
    pool.release(ids(3, 2, 1, 5, 3, 4, 2), may_repeat=True)
    assert pool.eviction_order() == [1, 5, 3, 4, 2]
    pool.check_integrity([0] * 6)


def test_eviction_kills_the_record_and_recomputing_revives_it() -> None:
    pool = BlockPool(3)
    a, b = pool.take(2).tolist()
    [cid] = cache(pool, [a], [42])
    slot = int(pool.record[a])
    pool.release(ids(a))
    assert pool.index.holder[slot] == a  # freed blocks stay findable
    assert pool.take(1).tolist() == [a]  # evicts it (no uncached block left)
    assert pool.index.holder[slot] == 0 and pool.index.cid[slot] == cid  # dead, kept
    assert pool.num_cached_blocks == 0
    # Computing the same content again revives the record with its content id, so children
    # filed under that id stay reachable.
    assert cache(pool, [b], [42]) == [cid]
    assert pool.index.holder[slot] == b
    pool.check_integrity([0, 1, 1])


def test_same_content_in_two_owned_blocks_keeps_one_findable_until_both_are_freed() -> None:
    pool = BlockPool(4)
    a, b, c = pool.take(3).tolist()
    [cid] = cache(pool, [a], [1])
    assert cache(pool, [b], [1]) == [cid]  # b duplicates a
    assert pool.num_cached_blocks == 1 and pool.dup_of[b] == pool.record[a]
    assert pool.block_hash(b) == pool.block_hash(a)
    slot = int(pool.record[a])
    pool.release(ids(a))  # the holder is freed while b is owned: b becomes the holder
    assert pool.index.holder[slot] == b
    assert pool.eviction_order() == [a]  # a is now a plain free block, reused first
    pool.check_integrity([0, 0, 1, 1])
    # A copy computed while the holder is free replaces it (the free one is then uncached).
    pool.release(ids(b))
    assert cache(pool, [c], [1]) == [cid]
    assert pool.index.holder[slot] == c
    assert pool.eviction_order() == [a, b]
    assert pool.num_cached_blocks == 1
    pool.check_integrity([0, 0, 0, 1])


def test_a_key_filed_under_other_content_goes_to_the_new_content() -> None:
    pool = BlockPool(4)
    a, b = pool.take(2).tolist()
    keys = np.array([5], dtype=np.uint64)
    one_chain = np.zeros(1, np.int64), np.array([ROOT])
    pool.cache(ids(a), keys, np.array([[1]]), *one_chain)
    # same key, other tokens (a collision): the new content takes the key, a loses its record
    [cid] = pool.cache(ids(b), keys, np.array([[2]]), *one_chain).tolist()
    assert pool.record[a] == -1 and pool.content_id(b) == cid
    assert pool.index.find([5]).tolist() == [int(pool.record[b])]
    pool.release(ids(a, b))
    assert pool.eviction_order() == [3, a, b]  # a is uncached, b cached
    pool.check_integrity([0, 0, 0, 0])


def test_dead_records_are_bounded_and_recycled_oldest_first() -> None:
    pool = BlockPool(5, max_records=8)
    for i in range(200):  # every block computed with new content, then evicted
        [b] = pool.take(1).tolist()
        cache(pool, [b], [i])
        pool.release(ids(b))
        pool.check_integrity([0] * 5)
    assert len(pool.index) <= 8 and len(pool.index.slot_of_key) <= 8
    for i in range(196, 200):  # the live ones are findable
        assert pool.index.find([i * 1000 + 7])[0] >= 0
    assert pool.index.find([190 * 1000 + 7])[0] == -1  # recycled


def test_dead_list_keeps_its_order_moved_in_place_or_grown() -> None:
    """kill appends to the dead list; once entries were examined (as recycling does), a full
    list moves the rest to the front in place when they fit in half of it, else grows: either
    way the waiting entries are the same, in order, and the killed records are dead."""
    rng = np.random.default_rng(3)
    index = PrefixIndex(64, 1)
    model: list[int] = []
    moved = grown = 0
    for i in range(3000):
        slots = rng.integers(0, 64, int(rng.integers(1, 50))).astype(np.int64)
        index.holder[slots] = 5
        before, full = index._dead, index._dead_tail + len(slots) > len(index._dead)
        index.kill(slots)
        model += slots.tolist()
        if full:
            moved += index._dead is before
            grown += index._dead is not before
        if i > 300 and rng.random() < 0.3:  # examined by a recycling (after some growth)
            k = int(rng.integers(0, len(model) + 1))
            index._dead_head += k
            model = model[k:]
        assert index._dead[index._dead_head : index._dead_tail].tolist() == model
        assert not index.holder[slots].any()
    assert moved and grown


def test_no_caching_pool_never_caches() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.take(2)
    pool.release(blocks)
    assert pool.num_cached_blocks == 0
    pool.check_integrity([0, 0, 0])


def test_reset_cache_makes_every_free_block_uncached() -> None:
    pool = BlockPool(5)
    blocks = pool.take(4).tolist()
    cache(pool, blocks[:3], [1, 2, 3])
    pool.release(ids(*reversed(blocks)))
    pool.reset_cache()
    assert pool.num_cached_blocks == 0 and len(pool.index) == 0
    assert pool.eviction_order() == [4, 3, 2, 1]
    pool.check_integrity([0] * 5)


@pytest.mark.parametrize("repeats", [False, True])
def test_block_queue_against_a_list(repeats: bool) -> None:
    """With ``repeats``, extends repeat ids: each is queued at its last occurrence, the slots of
    the earlier ones stay stale and every later operation (pop, remove, compaction) skips
    them."""
    rng = np.random.default_rng(int(repeats))
    q, model = BlockQueue(40), []
    for _ in range(3000 if repeats else 2000):
        op = rng.integers(0, 4)
        outside = [b for b in range(1, 40) if b not in model]
        if op == 0 and outside and repeats:
            new = rng.permutation(outside)[: rng.integers(1, 8)]
            batch = rng.choice(new, size=int(rng.integers(1, 12))).astype(np.intp)
            q.extend(batch, may_repeat=True)
            model += [b for i, b in enumerate(batch.tolist()) if b not in batch[i + 1 :].tolist()]
        elif op == 0 and outside:
            new = rng.permutation(outside)[: rng.integers(1, 6)].astype(np.int32)
            q.extend(new)
            model += new.tolist()
        elif op == 1 and model:
            gone = rng.permutation(model)[: rng.integers(1, 4)].astype(np.int32)
            q.remove(gone)
            model = [b for b in model if b not in set(gone.tolist())]
        elif op == 2 and model:
            n = int(rng.integers(1, len(model) + 1))
            assert q.pop(n).tolist() == model[:n]
            model = model[n:]
        elif op == 3 and model:
            assert q.pop(1).tolist() == [model.pop(0)]
        assert q.ids().tolist() == model and len(q) == len(model)
        assert q.contains(np.array(model, dtype=np.int64)).all()
        others = np.array([b for b in range(1, 40) if b not in model], dtype=np.int64)
        assert not q.contains(others).any()  # popped and removed ones included


def test_array_helpers_against_plain_python() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        values = rng.integers(1, 12, int(rng.integers(1, 30)))
        if rng.integers(2):
            values = values.astype(np.int32)  # the pools' block ids
        last = {v: i for i, v in enumerate(values.tolist())}
        assert last_occurrences(values).tolist() == sorted(last, key=last.get)


@pytest.mark.parametrize("cached_share", [0.0, 0.5, 1.0])
def test_release_finds_cached_blocks_as_the_records_say(cached_share: float) -> None:
    """The counters' shortcut (every owned block cached, or none) and the records' gather
    queue the same blocks in the same queues and order as a plain reference."""
    rng = np.random.default_rng(int(cached_share * 10))
    num_blocks = 64
    pool = BlockPool(num_blocks)
    held: list[int] = []
    next_token = 0
    for _ in range(300):
        free = pool.num_free_blocks
        if free and (not held or rng.random() < 0.5):
            new = pool.take(int(rng.integers(1, min(free, 6) + 1))).tolist()
            cached = [b for b in new if rng.random() < cached_share]
            if cached:
                tokens = list(range(next_token, next_token + len(cached)))
                next_token += len(cached)
                cache(pool, cached, tokens)
            held += new
            if held and rng.random() < 0.3:  # a second reference on some held blocks
                distinct = sorted(set(held))
                extra = rng.choice(distinct, size=min(len(distinct), 3), replace=False)
                pool.share_many(extra.astype(np.int32))
                held += extra.tolist()
            continue
        num = int(rng.integers(1, min(len(held), 8) + 1))
        batch = [held.pop(int(rng.integers(0, len(held)))) for _ in range(num)]
        refs = pool.ref_counts.copy()
        np.subtract.at(refs, np.array(batch), 1)
        freed = [b for i, b in enumerate(batch) if refs[b] == 0 and b not in batch[i + 1 :]]
        was_cached = {b: pool.record[b] >= 0 for b in freed}
        uncached_before = pool.uncached.ids().tolist()
        cached_before = pool.cached.ids().tolist()
        pool.release(np.array(batch, dtype=np.intp), may_repeat=True)
        assert pool.uncached.ids().tolist() == uncached_before + [
            b for b in freed if not was_cached[b]
        ]
        assert pool.cached.ids().tolist() == cached_before + [b for b in freed if was_cached[b]]
        expected = np.zeros(num_blocks, dtype=np.int64)
        np.add.at(expected, np.array(held, dtype=np.int64), 1)
        pool.check_integrity(expected)
