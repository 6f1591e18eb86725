"""One admission call for many prompts that share prefixes: prompts whose looked-up blocks
repeat an earlier prompt's follow its lookup, with the same hits as a block-by-block walk."""

from __future__ import annotations

import numpy as np
import pytest
from test_allocator_lookup import walk_hit

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager, fast_block_keys
from blocktable.allocator.prefix import find_hits, prompt_keys


@pytest.mark.parametrize(("seed", "block_sizes"), [(s, (4,)) for s in range(5)] + [(9, (4, 8))])
def test_repeated_prefixes_in_one_call_match_a_walk(
    seed: int, block_sizes: tuple[int, ...]
) -> None:
    """Calls of up to 10 prompts drawn from a few bases (whole, cut, extended), some repeated
    exactly, in two namespaces, in pools small enough to evict: every hit equals the walk,
    and admission leaves the manager consistent."""
    rng = np.random.default_rng(seed)
    groups = [AllocatorGroupSpec(bs, 160) for bs in block_sizes]
    mgr = KVCacheManager(groups, max_num_reqs=64)
    bases = [rng.integers(0, 30, int(rng.integers(8, 90))) for _ in range(3)]
    next_id = 0
    running: list[int] = []
    for _ in range(14):
        prompts, namespaces = [], []
        for _ in range(int(rng.integers(2, 11))):
            base = bases[int(rng.integers(len(bases)))]
            cut = int(rng.integers(1, len(base) + 1))
            tail = rng.integers(0, 30, int(rng.integers(0, 20)))
            prompt = np.concatenate((base[:cut], tail)) if rng.random() < 0.6 else base.copy()
            prompts.append(prompt)
            namespaces.append(None if rng.random() < 0.8 else "other")
        expected = [walk_hit(mgr, p, ns) for p, ns in zip(prompts, namespaces)]
        while mgr.num_free_rows < len(prompts):
            mgr.free(running.pop(0))
        req_ids = list(range(next_id, next_id + len(prompts)))
        next_id += len(prompts)
        assert mgr.add_requests(req_ids, prompts, namespaces) == expected
        mgr.check_integrity()
        for r, p, hit in zip(req_ids, prompts, expected):
            running.append(r)
            if mgr.can_allocate(r, len(p) - hit):
                mgr.allocate(r, len(p) - hit)
                mgr.mark_computed(r, len(p) - hit)
        mgr.check_integrity()
        for r in list(running[: len(running) // 2]):
            if rng.random() < 0.5:
                mgr.free(r)
                running.remove(r)
        mgr.check_integrity()


@pytest.mark.parametrize("colliding_first", [False, True])
def test_equal_keys_with_other_tokens_are_verified_apart(colliding_first: bool) -> None:
    """Two prompts whose (forced) block keys are equal but whose tokens differ are looked up
    and verified each on its own: the one holding the cached tokens hits them, the other only
    up to where its tokens differ."""
    bs = 4
    mgr = KVCacheManager([AllocatorGroupSpec(bs, 64)], max_num_reqs=4)
    cached = np.arange(13, dtype=np.int64)
    mgr.add_request("a", cached)
    mgr.allocate("a", 13)
    mgr.mark_computed("a", 13)
    other = cached.copy()
    other[6] = 100  # block 1 differs
    prompts = [other, cached] if colliding_first else [cached, other]
    cache = mgr.prefix_cache
    plans = [cache.plan(p, None, {}) for p in prompts]
    prompt_keys(plans, cache.powers)
    cached_keys = plans[1 if colliding_first else 0].keys[bs]
    assert cached_keys.tolist() == fast_block_keys(cached.tolist(), bs)
    plans[0].keys[bs] = plans[1].keys[bs] = cached_keys  # both carry the cached prompt's keys
    find_hits(plans, mgr.pools, mgr.block_sizes, mgr.windows, cache.align_tokens)
    hits = [plan.num_cached_tokens for plan in plans]
    assert hits == ([4, 12] if colliding_first else [12, 4])
