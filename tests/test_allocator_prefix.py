"""Prefix hits: sliding windows after eviction, hybrid groups, can_admit, reset, the key hash."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from test_allocator_snapshot import full_state

import blocktable.allocator.prefix
import blocktable.allocator.register
from blocktable.allocator import (
    ROOT_BLOCK_HASH,
    AllocatorGroupSpec,
    KVCacheManager,
    fast_block_keys,
    hash_block_tokens,
)
from blocktable.block_hashing import (
    ChainPowers,
    block_content_hashes,
    chain_keys,
    encode_namespace,
    fmix64_int,
    namespace_seed,
)
from blocktable.constants import NULL_BLOCK_ID


def compute_in_chunks(mgr: KVCacheManager, req_id: str, prompt: list[int], chunk: int) -> None:
    cached = mgr.add_request(req_id, prompt)
    for start in range(cached, len(prompt), chunk):
        n = min(chunk, len(prompt) - start)
        mgr.allocate(req_id, n)
        mgr.mark_computed(req_id, n)
    mgr.check_integrity()


# ---------------------------------------------------------------------- sliding windows
def test_sliding_window_hit_survives_eviction_of_blocks_before_the_window() -> None:
    """Window 8, block 4: a request computes 32 tokens in chunks of 4 and finishes; another
    takes 6 blocks, evicting the 2 oldest cached ones (blocks 0 and 1, released first when
    they left the window). The window before token 32 is blocks 6 and 7, still cached."""
    mgr = KVCacheManager([AllocatorGroupSpec(4, 13, sliding_window=8)], 4)  # 12 usable
    first = list(range(100, 132))
    compute_in_chunks(mgr, "a", first, 4)
    a_blocks = mgr.block_ids("a")[0]
    assert a_blocks[:6] == [NULL_BLOCK_ID] * 6  # released as they left the window
    mgr.free("a")
    order = mgr.pools[0].eviction_order()
    mgr.add_request("b", list(range(500, 524)))
    new = mgr.allocate("b", 24)[0]
    assert new == order[:6]  # 4 never-used blocks, then the 2 oldest cached ones
    assert mgr.num_cached_blocks() == 6
    # The same 32-token prompt resumes at 28 (its last token is computed to sample from),
    # needing blocks 5 and 6; one more token resumes at 32, needing blocks 6 and 7.
    assert mgr.lookup_prefix(first) == 28
    assert mgr.lookup_prefix([*first, 7]) == 32
    before = full_state(mgr)
    assert mgr.can_admit([*first, 7], 1)
    assert full_state(mgr) == before
    assert mgr.add_request("c", [*first, 7]) == 32
    held = mgr.block_ids("c")[0]
    assert held[:6] == [NULL_BLOCK_ID] * 6 and len(held) == 8
    assert mgr.pools[0].ref_count(held[6]) == 1 and mgr.pools[0].ref_count(held[7]) == 1
    mgr.allocate("c", 1)
    mgr.mark_computed("c", 1)
    mgr.check_integrity()


def test_blocks_leaving_a_window_together_are_evicted_oldest_first() -> None:
    """Window 4, block 4: one mark_computed of 24 tokens moves the window past blocks 0..4 at
    once. They are queued oldest first (block 5 follows when the request is freed), so taking
    two blocks evicts blocks 0 and 1: resume points that read blocks 2..5 are still served,
    those reading blocks 0 or 1 are not. (Queued newest first, blocks 4 and 3 would go and
    the hits would be the other way round.)"""
    mgr = KVCacheManager([AllocatorGroupSpec(4, 7, sliding_window=4)], 2)  # 6 usable
    prompt = list(range(100, 124))
    mgr.add_request("a", prompt)
    blocks = mgr.allocate("a", 24)[0]
    mgr.mark_computed("a", 24)  # the next token 24 reads [21, 24]: block 5 only
    assert mgr.block_ids("a")[0] == [NULL_BLOCK_ID] * 5 + blocks[5:]
    mgr.free("a")
    assert mgr.pools[0].eviction_order() == blocks  # no uncached block is left
    mgr.add_request("x", list(range(900, 908)))
    assert sorted(mgr.allocate("x", 8)[0]) == sorted(blocks[:2])  # blocks 0 and 1 evicted
    # resume at n reads block n/4 - 1 only (window 4 = one block)
    assert mgr.lookup_prefix([*prompt, 7]) == 24  # block 5
    assert mgr.lookup_prefix(prompt[:21]) == 20  # block 4
    assert mgr.lookup_prefix(prompt[:13]) == 12  # block 2
    assert mgr.lookup_prefix(prompt[:9]) == 0  # 8 reads block 1, 4 reads block 0: evicted
    mgr.check_integrity()


def test_sliding_window_hit_needs_the_window_blocks() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 64, sliding_window=8)], 4)
    prompt = list(range(32))
    compute_in_chunks(mgr, "a", prompt, 4)
    mgr.free("a")
    pool = mgr.pools[0]
    # evict exactly the cached block holding tokens 24..27 (logical block 6)
    slot = pool.index.find([int(mgr_keys(prompt, 4)[6])])[0]
    holder = int(pool.index.holder[slot])
    pool.cached.remove(np.array([holder]))
    pool.uncached.extend(np.array([holder], dtype=np.int32))
    pool._evict(np.array([holder]))
    mgr.check_integrity()
    # 32 needs blocks 6, 7; 28 needs 5, 6; 24 needs 4, 5 (cached): the hit is 24
    assert mgr.lookup_prefix([*prompt, 1]) == 24
    assert mgr.add_request("b", [*prompt, 1]) == 24
    assert mgr.block_ids("b")[0][:4] == [NULL_BLOCK_ID] * 4


def mgr_keys(tokens: list[int], block_size: int) -> list[int]:
    return fast_block_keys(tokens, block_size)


def test_hybrid_groups_serve_the_longest_point_all_groups_can_serve() -> None:
    """A full-attention group (block 4) and a sliding-window group (block 8, window 8): the
    window group's evicted prefix must not cap the full-attention hit."""
    mgr = KVCacheManager([AllocatorGroupSpec(4, 64), AllocatorGroupSpec(8, 7, sliding_window=8)], 4)
    prompt = list(range(48))
    compute_in_chunks(mgr, "a", prompt, 8)
    mgr.free("a")
    # fill group 1's pool so its oldest cached blocks (the prefix) are evicted
    mgr.add_request("b", list(range(900, 932)))
    mgr.allocate("b", 32)
    assert mgr.num_cached_blocks(1) == 2  # blocks 4 and 5 (tokens 32..47) survive
    # resume at 48 needs group 1 blocks 5 (window [41, 48]); group 0 blocks 0..11
    assert mgr.lookup_prefix([*prompt, 5]) == 48
    # resume at 40 needs group 1 blocks 4 (window [33, 40]): 40 is also served, 32 is not
    assert mgr.lookup_prefix(prompt[:41]) == 40
    assert mgr.lookup_prefix(prompt[:35]) == 0  # 32 needs block 3 of group 1: evicted
    assert mgr.add_request("c", [*prompt, 5]) == 48
    assert mgr.block_ids("c")[1][:5] == [NULL_BLOCK_ID] * 5
    mgr.check_integrity()


# ---------------------------------------------------------------------- can_admit, reset
def test_can_admit_counts_hit_blocks_taken_from_the_free_queue() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 9)], 4)  # 8 usable blocks
    prompt = list(range(16))
    compute_in_chunks(mgr, "a", prompt, 16)
    mgr.free("a")  # 4 cached free blocks, 4 uncached
    mgr.add_request("x", [7] * 12)
    mgr.allocate("x", 12)  # 3 uncached blocks taken: 5 free, 4 of them cached hits
    assert mgr.num_free_blocks() == 5
    longer = [*prompt, 1, 2, 3, 4, 5]
    assert mgr.lookup_prefix(longer) == 16
    before = full_state(mgr)
    # 16 cached tokens + 5 new = 6 blocks: 4 hits (leaving the free queue) + 2 new: only 1
    # free block remains once the hits are taken, so it does not fit...
    assert not mgr.can_admit(longer, 5)
    # ...while 4 new tokens need one new block, which fits
    assert mgr.can_admit(longer, 4)
    assert mgr.can_admit(longer[:9], 1)  # 8 cached, one block: fits
    assert full_state(mgr) == before  # no LRU change, no counters
    mgr.add_request("b", longer)
    assert mgr.can_allocate("b", 4) and not mgr.can_allocate("b", 5)


def test_can_admit_without_rows_and_bad_input() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 9)], 1, max_model_len=10)
    assert mgr.can_admit([1, 2, 3])
    mgr.add_request("a", [1])
    assert not mgr.can_admit([1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        mgr.can_admit([])
    with pytest.raises(ValueError, match="allocation of 11 tokens exceeds max_model_len=10"):
        mgr.can_admit([1, 2, 3], 11)
    with pytest.raises(TypeError, match="cache_namespace"):
        mgr.can_admit([1, 2, 3], cache_namespace=1.5)


def test_reset_prefix_cache_refuses_while_blocks_are_held() -> None:
    mgr = KVCacheManager(
        [AllocatorGroupSpec(4, 16), AllocatorGroupSpec(4, 16, sliding_window=4)], 2
    )
    compute_in_chunks(mgr, "a", list(range(12)), 12)
    before = full_state(mgr)
    assert mgr.reset_prefix_cache() is False
    assert full_state(mgr) == before
    mgr.free("a")
    mgr.add_request("b", [5])  # running, but holding no block
    assert mgr.lookup_prefix(list(range(12))) == 8
    stats = mgr.prefix_cache_stats
    assert mgr.reset_prefix_cache() is True
    assert mgr.lookup_prefix(list(range(12))) == 0
    assert mgr.num_cached_blocks(0) == mgr.num_cached_blocks(1) == 0
    assert mgr.prefix_cache_stats == stats  # counters are cumulative
    mgr.check_integrity()
    compute_in_chunks(mgr, "c", list(range(12)), 5)  # caching works again
    assert mgr.lookup_prefix(list(range(12))) == 8


# ---------------------------------------------------------------------- the key hash
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_vectorized_keys_equal_the_plain_python_reference(block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    powers = ChainPowers(block_size)
    for _ in range(20):
        prompts = [rng.integers(-(2**40), 2**40, int(rng.integers(0, 80))) for _ in range(4)]
        namespaces = [None, "lora", (1, "x"), b"salt"]
        full = [p[: len(p) // block_size * block_size].reshape(-1, block_size) for p in prompts]
        # several requests in one pass, each split at a random block into two passes
        cuts = [int(rng.integers(0, len(f) + 1)) for f in full]
        seeds = np.array(
            [namespace_seed(encode_namespace(ns)) for ns in namespaces], dtype=np.uint64
        )
        head = block_content_hashes(np.concatenate([f[:c] for f, c in zip(full, cuts)]), powers)
        keys1, states1 = chain_keys(head, np.array(cuts), seeds, powers)
        ends = np.cumsum(cuts)
        mid = np.array(
            [states1[e - 1] if c else s for e, c, s in zip(ends, cuts, seeds)], dtype=np.uint64
        )
        tail = block_content_hashes(np.concatenate([f[c:] for f, c in zip(full, cuts)]), powers)
        keys2, _ = chain_keys(tail, np.array([len(f) - c for f, c in zip(full, cuts)]), mid, powers)
        got1, got2 = keys1.tolist(), keys2.tolist()
        for p, ns, f, c in zip(prompts, namespaces, full, cuts):
            want = fast_block_keys(p.tolist(), block_size, namespace=ns)
            assert got1[:c] + got2[: len(f) - c] == want
            got1, got2 = got1[c:], got2[len(f) - c :]


def test_fast_block_hashes_are_the_keys_and_stable() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 16)], 2)
    prompt = list(range(100, 111))
    mgr.add_request("a", prompt, cache_namespace="salt")
    mgr.allocate("a", 11)
    mgr.mark_computed("a", 11)
    got = [mgr.pools[0].block_hash(b) for b in mgr.block_ids("a")[0][:2]]
    assert got == fast_block_keys(prompt, 4, namespace="salt")
    assert got != fast_block_keys(prompt, 4)  # the namespace is part of the key


def test_sha256_and_callable_block_hashes_chain_with_the_namespace() -> None:
    prompt = list(range(7, 20))
    for hash_fn, fn in (
        ("sha256", hashlib.sha256),
        (lambda d: hashlib.md5(d).digest(), hashlib.md5),
    ):
        mgr = KVCacheManager([AllocatorGroupSpec(4, 16)], 2, hash_fn=hash_fn)
        mgr.add_request("a", prompt, cache_namespace=("tenant", 3))
        for _ in range(3):  # in chunks: the chain continues across calls
            mgr.allocate("a", 4)
            mgr.mark_computed("a", 4)
        parent, want = ROOT_BLOCK_HASH, []
        for i in range(3):
            data = (
                parent + np.asarray(prompt[4 * i : 4 * i + 4], "<i8").tobytes() + b"('tenant', 3)"
            )
            parent = fn(data).digest()
            want.append(parent)
        got = [mgr.pools[0].block_hash(b) for b in mgr.block_ids("a")[0]]
        assert got == want
        if hash_fn == "sha256":
            assert got == hash_block_tokens(prompt, 4, namespace=("tenant", 3))
        # a hit continues the chain from the shared blocks
        assert (
            mgr.add_request("b", [*prompt[:8], 1, 1, 1, 1, 1], cache_namespace=("tenant", 3)) == 8
        )
        mgr.allocate("b", 5)
        mgr.mark_computed("b", 5)
        third = mgr.pools[0].block_hash(mgr.block_ids("b")[0][2])
        data = want[1] + np.ones(4, "<i8").tobytes() + b"('tenant', 3)"
        assert third == fn(data).digest()
        mgr.check_integrity()


def test_chunked_prefill_hashes_each_token_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys of a prompt are computed at admission, in one pass; chunks re-read nothing."""
    hashed_rows: list[int] = []
    real_keys = blocktable.allocator.register.token_chain_keys

    def counting_keys(tokens, lengths, starts, powers):  # type: ignore[no-untyped-def]
        hashed_rows.append(len(tokens))
        return real_keys(tokens, lengths, starts, powers)

    monkeypatch.setattr(blocktable.allocator.prefix, "token_chain_keys", counting_keys)
    monkeypatch.setattr(blocktable.allocator.register, "token_chain_keys", counting_keys)
    mgr = KVCacheManager([AllocatorGroupSpec(16, 2048)], 2)
    prompt = np.arange(20_000) % 5000
    mgr.add_request("a", prompt)
    assert hashed_rows == [1250]
    for start in range(0, 20_000, 2048):
        n = min(2048, 20_000 - start)
        mgr.allocate("a", n)
        mgr.mark_computed("a", n)
    assert hashed_rows == [1250]  # no block hashed again
    mgr.append_token_ids("a", list(range(16)))  # 20016 tokens: block 1250 becomes full
    mgr.allocate("a", 16)
    mgr.mark_computed("a", 16)
    assert mgr.num_cached_blocks() == 1251  # (the next call applies the recorded mark)
    assert hashed_rows == [1250, 1]  # one new block, keyed from the chain state
    tokens = [*prompt.tolist(), *range(16)]
    last = mgr.block_ids("a")[0][1250]
    assert mgr.pools[0].block_hash(last) == fast_block_keys(tokens, 16)[1250]
    # two requests in one call: one vectorized pass for their new blocks
    mgr.append_token_ids("a", list(range(32)))
    mgr.add_request("b", list(range(7000, 7040)))
    mgr.allocate_many(["a", "b"], [32, 40])
    mgr.mark_computed_many(["a", "b"], [32, 40])
    assert hashed_rows == [1250, 1, 2, 2]  # b's prompt at admission, then a's two new blocks
    mgr.check_integrity()


def test_reset_while_a_request_holds_only_null_entries_keeps_hits_exact() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 16, sliding_window=1)], 2)
    mgr.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    mgr.allocate("a", 8)
    mgr.mark_computed("a", 8)  # the token at 8 attends to itself only: both blocks released
    assert mgr.block_ids("a") == ([NULL_BLOCK_ID, NULL_BLOCK_ID],)
    assert mgr.reset_prefix_cache() is True
    mgr.allocate("a", 5)
    mgr.append_token_ids("a", [10, 11, 12])
    mgr.mark_computed("a", 4)  # block 2 (tokens 9..12) is registered after the reset
    mgr.check_integrity()
    # its parent's record is gone: no prompt may hit it, even one starting with its tokens
    assert mgr.lookup_prefix([9, 10, 11, 12, 0]) == 0
    assert mgr.lookup_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0]) == 0


@pytest.mark.parametrize(
    "lengths", [[1] * 7, [1], [0, 1], [1, 0, 2], [3, 1, 1], [0], [2, 2]], ids=str
)
def test_chain_keys_match_the_recurrence_in_python_ints(lengths: list[int]) -> None:
    """Segmented chaining (one block per segment included: the decode shortcut) equals
    ``K = S * B**bs + h`` block after block, mod 2**64, with ``key = fmix64(K)``."""
    rng = np.random.default_rng(len(lengths))
    powers = ChainPowers(16)
    seg = np.array(lengths, dtype=np.int64)
    hashes = rng.integers(0, 2**63, int(seg.sum())).astype(np.uint64) * np.uint64(3)
    starts = rng.integers(0, 2**63, len(seg)).astype(np.uint64) * np.uint64(3)
    keys, states = chain_keys(hashes, seg, starts, powers)
    want, i = [], 0
    for length, state in zip(lengths, starts.tolist()):
        for _ in range(length):
            state = (state * powers.block_base + int(hashes[i])) % 2**64
            want.append(state)
            i += 1
    assert states.dtype == np.uint64 and states.tolist() == want
    assert keys.tolist() == [fmix64_int(s) for s in want]
