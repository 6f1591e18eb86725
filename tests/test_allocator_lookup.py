"""Batched prefix lookup (the probe bound), prompt token buffers, and
registration state kept per table row."""

from __future__ import annotations

import numpy as np
import pytest

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager, fast_block_keys


@pytest.mark.parametrize(
    "num_cached_blocks", [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 40, 63, 64, 65, 79]
)
def test_hits_of_every_length_in_one_batched_call(num_cached_blocks: int) -> None:
    """Hits ending just before, at and after the keys the lookup probes one by one (0, 16,
    64) are found whole, for several prompts in one call: the bound never cuts a hit."""
    bs = 4
    rng = np.random.default_rng(num_cached_blocks)
    mgr = KVCacheManager([AllocatorGroupSpec(bs, 512)], max_num_reqs=16)
    base = rng.integers(0, 1000, 80 * bs)
    mgr.add_request("base", base)
    mgr.allocate("base", len(base))
    mgr.mark_computed("base", len(base))
    # prompts sharing num_cached_blocks (or fewer) blocks with base, then diverging
    prompts, expected = [], []
    for shared in (num_cached_blocks, num_cached_blocks // 2, 0):
        tail = rng.integers(1000, 2000, 5 * bs + 3)
        prompts.append(np.concatenate((base[: shared * bs], tail)))
        expected.append(shared * bs)
    prompts.append(base[: num_cached_blocks * bs + 1])  # the whole prefix but its last token
    expected.append(num_cached_blocks * bs)
    assert [mgr.lookup_prefix(p) for p in prompts] == expected
    got = mgr.add_requests([f"r{i}" for i in range(len(prompts))], prompts)
    assert got == expected
    mgr.check_integrity()


def test_admitted_prompt_owns_its_tokens() -> None:
    """Admission copies a prompt (into the token arena's row, or a buffer of the request's
    own): the caller's array is neither aliased nor written by later appends."""
    mgr = KVCacheManager([AllocatorGroupSpec(4, 64)], max_num_reqs=2)
    prompt = np.arange(10, dtype=np.int64)
    kept = prompt.copy()
    mgr.add_requests(["a"], [prompt])
    prompt[:] = -1  # the caller reuses its array
    mgr.allocate("a", 10)
    mgr.mark_computed("a", 10)
    mgr.append_token_ids_many(["a"], np.array([[100, 101, 102]]))
    mgr.allocate("a", 3)
    mgr.mark_computed("a", 3)
    mgr.check_integrity()
    assert (prompt == -1).all()
    assert mgr.num_tokens("a") == 13
    assert mgr.lookup_prefix([*kept.tolist(), 100, 101, 102, 7]) == 12


def test_a_reused_row_starts_a_fresh_chain() -> None:
    """Registration state is kept per table row: a request taking a freed row (here with
    another namespace) starts from its own root and seed, and its generated blocks get the
    block keys of its own tokens."""
    bs = 4
    mgr = KVCacheManager([AllocatorGroupSpec(bs, 64)], max_num_reqs=1)
    for req_id, namespace, first in (("a", None, 0), ("b", "lora-7", 100)):
        prompt = list(range(first, first + 10))
        mgr.add_requests([req_id], [prompt], [namespace])
        assert mgr.row_of(req_id) == 0
        mgr.allocate_many([req_id], [10])
        mgr.mark_computed_many([req_id], [10])
        generated = [first + 50 + i for i in range(6)]
        mgr.append_token_ids_many([req_id], [generated])
        mgr.allocate_many([req_id], [6])
        mgr.mark_computed_many([req_id], [6])
        mgr.check_integrity()
        tokens = prompt + generated
        blocks = mgr.block_ids(req_id)[0]
        want = fast_block_keys(tokens, bs, namespace=namespace)
        assert [mgr.pools[0].block_hash(b) for b in blocks[: len(want)]] == want
        mgr.free(req_id)


def walk_hit(mgr: KVCacheManager, prompt: np.ndarray, namespace: object = None) -> int:
    """A prompt's hit by a scalar walk over every group's index (no windows): block i is
    served while its key is filed under a live record holding its tokens whose parent is the
    content id served for block i - 1; the hit is the shortest over the groups, aligned."""
    align = int(np.lcm.reduce(mgr.block_sizes))
    hit = len(prompt) - 1
    for pool, bs in zip(mgr.pools, mgr.block_sizes):
        index = pool.index
        root = mgr.prefix_cache.plan([0], namespace, {}).root
        parent, served = root, 0
        keys = fast_block_keys(prompt.tolist(), bs, namespace=namespace)
        for i in range((len(prompt) - 1) // bs):
            slot = index.find_one(keys[i])
            if slot < 0 or index.holder[slot] == 0 or index.parent[slot] != parent:
                break
            if (index.tokens[slot] != prompt[i * bs : (i + 1) * bs]).any():
                break
            parent = int(index.cid[slot])
            served = i + 1
        hit = min(hit, served * bs)
    return hit // align * align


@pytest.mark.parametrize(
    ("seed", "groups"),
    [(seed, [(4, 96)]) for seed in range(6)]
    + [(100 + seed, [(4, 160), (8, 72)]) for seed in range(4)],
)
def test_batched_hits_match_a_scalar_walk(seed: int, groups: list[tuple[int, int]]) -> None:
    """Several prompts per call, sharing prefixes with each other and with cached prompts (of
    any length, or none; a prompt twice in one call), in pools small enough that cached blocks
    are evicted, tails first: every hit of the one batched lookup equals a walk over the index
    block by block. With two full-attention groups of block sizes 4 and 8 each hit is the
    shorter of the groups' walks, cut to a multiple of 8 (the lookup bounds a group by what the
    groups before allow)."""
    rng = np.random.default_rng(seed)
    mgr = KVCacheManager([AllocatorGroupSpec(bs, n) for bs, n in groups], max_num_reqs=64)
    done: list[np.ndarray] = []
    next_id = num_hits = 0
    for _ in range(12):
        prompts = []
        for _ in range(int(rng.integers(1, 7))):
            if done and rng.random() < 0.75:
                base = done[int(rng.integers(len(done)))]
                keep = int(rng.integers(0, len(base) + 1))
                tail = rng.integers(0, 40, int(rng.integers(1, 40)))
                prompts.append(np.concatenate((base[:keep], tail)))
            else:
                prompts.append(rng.integers(0, 40, int(rng.integers(2, 90))))
        if len(prompts) > 1 and rng.random() < 0.5:
            prompts.append(prompts[0].copy())  # a prompt twice in one call
        expected = [walk_hit(mgr, p) for p in prompts]
        num_hits += sum(map(bool, expected))
        req_ids = list(range(next_id, next_id + len(prompts)))
        next_id += len(prompts)
        assert [mgr.lookup_prefix(p) for p in prompts] == expected
        assert mgr.add_requests(req_ids, prompts) == expected
        for r, p, hit in zip(req_ids, prompts, expected):
            if mgr.can_allocate(r, len(p) - hit):
                mgr.allocate(r, len(p) - hit)
                mgr.mark_computed(r, len(p) - hit)
                done.append(p)
            mgr.free(r)
        mgr.check_integrity()
    assert num_hits > 0  # (the walks are not all trivially empty)


def test_a_reused_row_with_a_prompt_shorter_than_a_block_chains_from_the_seed() -> None:
    """A prompt without a full block takes a row whose last holder had keyed blocks: its
    chain starts at its namespace's seed (no key kept from the row's last holder), so its
    generated blocks get the keys of its own tokens."""
    bs = 4
    mgr = KVCacheManager([AllocatorGroupSpec(bs, 64)], max_num_reqs=1)
    mgr.add_requests(["a"], [list(range(20))])
    mgr.allocate_many(["a"], [20])
    mgr.mark_computed_many(["a"], [20])
    mgr.free("a")
    mgr.add_requests(["b"], [[7, 8, 9]], ["tenant"])
    assert mgr.row_of("b") == 0
    mgr.check_integrity()
    mgr.allocate_many(["b"], [3])
    mgr.mark_computed_many(["b"], [3])
    mgr.append_token_ids_many(["b"], [[10, 11, 12, 13, 14, 15]])
    mgr.allocate_many(["b"], [6])
    mgr.mark_computed_many(["b"], [6])
    mgr.check_integrity()
    want = fast_block_keys([7, 8, 9, 10, 11, 12, 13, 14, 15], bs, namespace="tenant")
    blocks = mgr.block_ids("b")[0]
    assert [mgr.pools[0].block_hash(b) for b in blocks[: len(want)]] == want


@pytest.mark.parametrize("seed", range(6))
def test_batched_hits_match_a_scalar_walk_when_records_do_not_verify(seed: int) -> None:
    """Records whose key is found but which do not verify (other token ids: a colliding key;
    another parent; a dead block) end the hit where a walk over the index ends it, for prompts
    looked up alone and in one batched call (some twice, some sharing a prefix)."""
    rng = np.random.default_rng(seed)
    bs = 4
    mgr = KVCacheManager([AllocatorGroupSpec(bs, 256)], max_num_reqs=32)
    done = []
    for r in range(6):
        prompt = rng.integers(0, 50, int(rng.integers(8, 60)))
        if done and rng.random() < 0.5:  # sharing a prefix with an earlier prompt
            prompt = np.concatenate((done[-1][: int(rng.integers(0, len(done[-1])))], prompt))
        mgr.add_request(r, prompt)
        hit = mgr.num_computed_tokens(r)
        mgr.allocate(r, len(prompt) - hit)
        mgr.mark_computed(r, len(prompt) - hit)
        mgr.free(r)
        done.append(prompt)
    index = mgr.pools[0].index
    filed = np.flatnonzero(index.cid != 0)
    for slot in rng.choice(filed, size=min(len(filed), 4), replace=False).tolist():
        how = int(rng.integers(3))
        if how == 0:
            index.tokens[slot, int(rng.integers(bs))] += 1000  # a key naming other tokens
        elif how == 1:
            index.parent[slot] += 12345  # another parent
        else:
            index.holder[slot] = 0  # dead (a record of an evicted block)
    prompts = [np.concatenate((p, [7, 8, 9])) for p in done]
    prompts += [prompts[0].copy(), prompts[-1].copy()]  # twice in one call
    expected = [walk_hit(mgr, p) for p in prompts]
    assert [mgr.lookup_prefix(p) for p in prompts] == expected
    assert mgr.add_requests(list(range(100, 100 + len(prompts))), prompts) == expected
