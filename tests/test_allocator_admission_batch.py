"""One admission call for many prompts that share prefixes: prompts whose looked-up blocks
repeat an earlier prompt's follow its lookup, with the same hits as a block-by-block walk."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_allocator_lookup import walk_hit

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager, fast_block_keys
from blocktable.allocator.prefix import find_hits, prompt_keys
from blocktable.allocator.request import KeyChains
from blocktable.allocator.rowstate import RowState


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
    plans = [mgr._new_plan(p, None, {}) for p in prompts]
    prompt_keys(plans, mgr.block_sizes, mgr._powers)
    cached_keys = plans[1 if colliding_first else 0].keys[bs]
    assert cached_keys.tolist() == fast_block_keys(cached.tolist(), bs)
    plans[0].keys[bs] = plans[1].keys[bs] = cached_keys  # both carry the cached prompt's keys
    find_hits(plans, mgr.pools, mgr.block_sizes, mgr.windows, mgr._align_tokens)
    hits = [plan.num_cached_tokens for plan in plans]
    assert hits == ([4, 12] if colliding_first else [12, 4])


@pytest.mark.parametrize("seed", range(4))
def test_row_starts_of_a_call_equal_one_start_per_row(seed: int) -> None:
    """RowState.start_many and KeyChains.admit_many leave every array as RowState.start and
    KeyChains.admit row by row do, prompts longer than the token arena's rows included."""
    rng = np.random.default_rng(seed)
    num_rows, block_sizes = 12, (4, 8)
    one, many = RowState(num_rows, 2), RowState(num_rows, 2)
    chains_one, chains_many = KeyChains(num_rows, block_sizes), KeyChains(num_rows, block_sizes)
    for state in (one, many):  # stale entries of earlier holders
        state.num_computed[:] = 7
        state.num_slots[:] = 5
        state.num_tokens[:] = 3
        state.row_len[:] = 3
        state.num_skipped[:] = 1
    rows = rng.permutation(num_rows)[: int(rng.integers(1, num_rows))].tolist()
    prompts = [rng.integers(0, 100, int(rng.choice([1, 9, 300, 5000]))) for _ in rows]
    roots = [-int(rng.integers(1, 4)) for _ in rows]
    seeds = [int(rng.integers(0, 2**63)) for _ in rows]
    keys = [
        {bs: rng.integers(0, 2**63, len(p) // bs).astype(np.uint64) for bs in (4, 8)}
        for p in prompts
    ]
    states = [
        {bs: rng.integers(0, 2**63, len(p) // bs).astype(np.uint64) for bs in (4, 8)}
        for p in prompts
    ]
    buffers_one = [one.start(row, p) for row, p in zip(rows, prompts)]
    for args in zip(rows, roots, seeds, keys, states):
        chains_one.admit(*args)
    buffers_many = many.start_many(rows, prompts)
    plans = [
        SimpleNamespace(root=root, seed=seed, keys=k, states=st)
        for root, seed, k, st in zip(roots, seeds, keys, states)
    ]
    chains_many.admit_many(rows, plans)
    for name in (
        "num_computed",
        "num_tokens",
        "num_prompt",
        "num_slots",
        "row_len",
        "num_skipped",
        "in_arena",
        "holder_gen",
        "tokens",
    ):
        assert np.array_equal(getattr(one, name), getattr(many, name)), name
    for a, b, p in zip(buffers_one, buffers_many, prompts):  # (own buffers: room past p)
        assert (a is None) == (b is None)
        assert a is None or (len(a) == len(b) and np.array_equal(a[: len(p)], b[: len(p)]))
    for name in ("num_hashed", "parent_cid"):
        for a, b in zip(getattr(chains_one, name), getattr(chains_many, name)):
            assert np.array_equal(a, b), name
    for bs in (4, 8):
        assert np.array_equal(chains_one.num_keys[bs], chains_many.num_keys[bs])
        assert np.array_equal(chains_one.state[bs], chains_many.state[bs])
