"""The allocator's host tier, case by case: arguments, offload order, split hits, full tier."""

from __future__ import annotations

import numpy as np
import pytest

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager


def make(num_blocks: int = 5, host_blocks: int = 8, block_size: int = 4) -> KVCacheManager:
    spec = AllocatorGroupSpec(block_size=block_size, num_blocks=num_blocks)
    return KVCacheManager([spec], max_num_reqs=4, host_blocks=host_blocks)


def run(mgr: KVCacheManager, req: str, prompt: list[int], *, free: bool = True) -> int:
    hit = mgr.add_request(req, prompt)
    mgr.allocate(req, len(prompt) - hit)
    mgr.mark_computed(req, len(prompt) - hit)
    if free:
        mgr.free(req)
    mgr.check_integrity()
    return hit


A = list(range(100, 116))  # four blocks of 4
B = list(range(200, 216))


@pytest.mark.parametrize("bad", [-1, 2**40])
def test_bad_host_blocks_is_a_clear_error(bad: int) -> None:
    with pytest.raises((ValueError, IndexError), match="host_blocks"):
        make(host_blocks=bad)


def test_host_blocks_needs_prefix_caching_and_full_attention() -> None:
    spec = AllocatorGroupSpec(block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVCacheManager([spec], 2, enable_prefix_caching=False, host_blocks=4)
    window = AllocatorGroupSpec(block_size=4, num_blocks=8, sliding_window=8)
    with pytest.raises(ValueError, match="full-attention"):
        KVCacheManager([spec, window], 2, host_blocks=4)


def test_without_host_tier_transfers_are_empty() -> None:
    mgr = make(num_blocks=6, host_blocks=0)
    run(mgr, "a", A)
    run(mgr, "b", B)  # evicts a's blocks (but one): forgotten
    [t] = mgr.take_transfers()
    assert not t and t.offload.shape == (0, 2) and t.restore.shape == (0, 2)
    assert run(mgr, "c", [*A, 1]) == 4  # the head block left on the device only


def test_evicted_blocks_are_offloaded_in_eviction_order_and_restored() -> None:
    mgr = make()
    run(mgr, "a", A)  # blocks 1..4, freed tail first: evicted 4, 3, 2, 1
    assert not mgr.take_transfers()[0]
    run(mgr, "b", B)
    [t] = mgr.take_transfers()
    assert t.offload.tolist() == [[4, 1], [3, 2], [2, 3], [1, 4]]
    assert mgr.lookup_prefix([*A, 1]) == 16  # found on the host
    hit = run(mgr, "c", [*A[:8], 1], free=False)  # two blocks restored, one computed
    assert hit == 8
    [t] = mgr.take_transfers()
    # b's blocks (released tail first: 1, 2, 3) are offloaded before a's restored into them
    assert t.offload.tolist() == [[1, 5], [2, 6], [3, 7]]
    assert t.restore.tolist() == [[4, 1], [3, 2]]  # a's block 0 left device 1 last: host 4
    assert mgr.block_ids("c")[0] == [1, 2, 3]
    stats = mgr.prefix_cache_stats
    assert stats.num_host_hit_tokens == 8 and stats.num_device_hit_tokens == 0
    host = mgr.host_tier_stats[0]
    assert (host.num_offloaded_blocks, host.num_restored_blocks) == (7, 2)


def test_split_hit_device_head_host_tail() -> None:
    mgr = make(num_blocks=6)  # five usable blocks
    run(mgr, "a", A)  # 1..4; then x takes block 5 and evicts a's tail block (4)
    run(mgr, "x", [7, 7, 7, 7, 7])  # two blocks: 5 and the LRU cached block 4 (a's tail)
    [t] = mgr.take_transfers()
    assert t.offload.tolist() == [[4, 1]]
    before = mgr.prefix_cache_stats
    assert run(mgr, "c", [*A, 1], free=False) == 16
    [t] = mgr.take_transfers()
    assert len(t.restore) == 1 and t.restore[0, 0] == 1  # only the tail comes from the host
    after = mgr.prefix_cache_stats
    assert after.num_host_hit_tokens - before.num_host_hit_tokens == 4
    assert after.num_hit_tokens - before.num_hit_tokens == 16


def test_host_lru_evicts_least_recently_offloaded_first() -> None:
    mgr = make(num_blocks=5, host_blocks=4)
    run(mgr, "a", A)
    run(mgr, "b", B)  # a -> host 1..4
    mgr.take_transfers()
    run(mgr, "c", list(range(300, 316)))  # b -> host; host full: a's copies go, LRU first
    [t] = mgr.take_transfers()
    # b's tail (device 1, freed first) takes the host block of a's tail (host 1, offloaded
    # first), and so on
    assert t.offload.tolist() == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert mgr.host_tier_stats[0].num_host_evictions == 4
    assert mgr.lookup_prefix([*A, 1]) == 0
    assert mgr.lookup_prefix([*B, 1]) == 16


def test_full_pinned_host_tier_never_blocks_the_device() -> None:
    mgr = make(num_blocks=5, host_blocks=2)
    run(mgr, "a", A)
    run(mgr, "b", B)  # 4 evictions, 2 host blocks, both pinned until take_transfers
    [t] = mgr.take_transfers()
    assert len(t.offload) == 2
    assert mgr.host_tier_stats[0].num_dropped_blocks == 2
    # a's tail (evicted first) is on the host, its head was dropped: a miss, never a wrong hit
    assert mgr.lookup_prefix([*A, 1]) == 0


def test_restore_never_evicts_hits_of_the_same_admission() -> None:
    mgr = make(num_blocks=9, host_blocks=8)  # eight usable blocks
    run(mgr, "a", A)
    run(mgr, "b", B)
    run(mgr, "x", list(range(300, 316)))  # a -> host; b free cached on device
    mgr.take_transfers()
    hits = mgr.add_requests(["c", "d"], [[*B, 1], [*A, 1]])  # d's restore takes free blocks
    assert hits == [16, 16]
    mgr.check_integrity()
    [t] = mgr.take_transfers()
    assert set(mgr.block_ids("c")[0]).isdisjoint(t.restore[:, 1].tolist())
    assert set(t.restore[:, 1].tolist()) == set(mgr.block_ids("d")[0])


def test_hit_is_capped_when_restores_do_not_fit() -> None:
    mgr = make(num_blocks=5, host_blocks=8)
    run(mgr, "a", A)
    run(mgr, "b", B, free=False)  # a on the host, every device block held by b
    mgr.take_transfers()
    assert mgr.lookup_prefix([*A, 1]) == 0  # no free device block to restore into
    assert not mgr.can_admit([*A, 1])
    assert np.array_equal(mgr.take_transfers()[0].restore, np.zeros((0, 2), np.int32))
