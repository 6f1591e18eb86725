"""KVCacheManager: exact outputs for prefix caching, forks, sliding windows and bad input."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from test_allocator_snapshot import full_state

from blocktable.allocator import (
    ROOT_BLOCK_HASH,
    AllocatorGroupSpec,
    KVCacheManager,
    OutOfBlocksError,
    OutOfRowsError,
    hash_block_tokens,
)
from blocktable.constants import NULL_BLOCK_ID


def make(
    num_blocks: int = 16, block_size: int = 4, max_num_reqs: int = 4, **kwargs: object
) -> KVCacheManager:
    return KVCacheManager(
        [AllocatorGroupSpec(block_size, num_blocks)],
        max_num_reqs,
        **kwargs,  # type: ignore[arg-type]
    )


def run(mgr: KVCacheManager, req_id: object, tokens: list[int], **kwargs: object) -> int:
    """Admit and compute a whole prompt; return the number of cached tokens."""
    cached = mgr.add_request(req_id, tokens, **kwargs)  # type: ignore[arg-type]
    mgr.allocate(req_id, len(tokens) - cached)  # type: ignore[arg-type]
    mgr.mark_computed(req_id, len(tokens) - cached)  # type: ignore[arg-type]
    mgr.check_integrity()
    return cached


def decode(mgr: KVCacheManager, req_id: object, token: int) -> None:
    mgr.append_token_ids(req_id, token)  # type: ignore[arg-type]
    mgr.allocate(req_id, 1)  # type: ignore[arg-type]
    mgr.mark_computed(req_id, 1)  # type: ignore[arg-type]


def state(mgr: KVCacheManager) -> object:
    """Everything the manager holds (for 'unchanged' checks)."""
    return full_state(mgr)


# ---------------------------------------------------------------------- prefix caching
def test_full_prefix_hit_leaves_one_token_to_compute() -> None:
    mgr = make()
    prompt = list(range(12))  # exactly 3 blocks
    assert run(mgr, "a", prompt) == 0
    assert mgr.block_ids("a") == ([1, 2, 3],)
    # The same prompt: the last block is not taken, its last token must be computed.
    assert mgr.add_request("b", prompt) == 8
    assert mgr.block_ids("b") == ([1, 2],)
    assert mgr.allocate("b", 4) == ([4],)
    mgr.mark_computed("b", 4)
    mgr.check_integrity()
    # One more token than the blocks: everything cached.
    assert mgr.add_request("c", [*prompt, 99]) == 12
    assert mgr.block_ids("c") == ([1, 2, 3],)
    assert mgr.pools[0].ref_count(1) == 3
    assert mgr.prefix_cache_stats.num_hit_tokens == 20
    assert mgr.prefix_cache_stats.hit_rate == pytest.approx(20 / 37)


def test_single_token_prompt_never_hits() -> None:
    mgr = make()
    run(mgr, "a", [5, 5, 5, 5])
    assert mgr.add_request("b", [5]) == 0


def test_hit_after_preemption_and_resume() -> None:
    mgr = make()
    run(mgr, "a", list(range(10)))
    for t in (10, 11, 12):
        decode(mgr, "a", t)
    assert mgr.num_computed_tokens("a") == 13
    blocks = mgr.block_ids("a")[0]
    assert blocks == [1, 2, 3, 4]
    mgr.preempt("a")
    assert mgr.is_preempted("a") and "a" not in mgr and mgr.num_preemptions == 1
    assert mgr.num_free_blocks() == 15
    with pytest.raises(KeyError, match="'a' is preempted"):
        mgr.allocate("a", 1)
    # Re-admitted with everything it had: prompt and generated tokens.
    assert mgr.add_request("a", list(range(13))) == 12
    assert mgr.block_ids("a") == ([1, 2, 3],)
    assert not mgr.is_preempted("a")
    # The partial block 4 was not cached; free blocks are reused least recently freed first.
    assert mgr.allocate("a", 1) == ([5],)
    mgr.check_integrity()


def test_stale_entry_after_the_block_was_reused_never_hits() -> None:
    mgr = make(num_blocks=4)  # 3 usable blocks
    run(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    mgr.free("a")
    assert mgr.num_cached_blocks() == 2
    # Another request takes every block, evicting a's cached ones, but computes nothing yet.
    mgr.add_request("b", [7] * 12)
    assert mgr.allocate("b", 12) == ([3, 2, 1],)
    assert mgr.num_cached_blocks() == 0
    assert mgr.add_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    mgr.free("c")
    mgr.mark_computed("b", 12)  # now blocks 3, 2, 1 hold b's tokens
    mgr.free("b")
    assert mgr.add_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert mgr.add_request("e", [7] * 9) == 8
    mgr.check_integrity()


def test_hit_on_blocks_another_running_request_owns() -> None:
    mgr = make()
    run(mgr, "a", list(range(9)))
    assert mgr.add_request("b", [*range(8), 100, 101]) == 8
    assert mgr.block_ids("b") == ([1, 2],)
    assert [mgr.pools[0].ref_count(b) for b in (1, 2, 3)] == [2, 2, 1]
    free_before = mgr.num_free_blocks()
    mgr.free("a")
    assert mgr.num_free_blocks() == free_before + 1  # only a's private tail block
    assert mgr.pools[0].eviction_order()[-1] == 3
    mgr.free("b")
    assert mgr.pools[0].eviction_order()[-2:] == [2, 1]  # tail first
    mgr.check_integrity()


def test_same_prefix_computed_twice_stays_findable_while_either_runs() -> None:
    mgr = make()
    for r in ("a", "b"):  # admitted in the same step: neither hits
        assert mgr.add_request(r, list(range(9))) == 0
        mgr.allocate(r, 9)
    for r in ("a", "b"):
        mgr.mark_computed(r, 9)
    mgr.free("a")
    mgr.add_request("filler", [50] * 24)
    mgr.allocate("filler", 24)  # evicts a's cached blocks
    assert mgr.add_request("c", list(range(9))) == 8
    assert mgr.block_ids("c")[0] == mgr.block_ids("b")[0][:2]
    mgr.check_integrity()


def test_free_releases_tail_blocks_first() -> None:
    mgr = make()
    run(mgr, "a", list(range(10)))
    mgr.free("a")
    # uncached blocks first (the partial tail), then the cached ones tail first
    order = mgr.pools[0].eviction_order()
    assert order[-3:] == [3, 2, 1]
    assert order[-4] == 15


def test_colliding_hashes_never_share_wrong_kv() -> None:
    mgr = make(hash_fn=lambda data: b"collide")
    run(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    # Same tokens in the second block but another first block: the second block's KV differs.
    assert mgr.add_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    assert mgr.add_request("c", [1, 2, 3, 4, 9, 9, 9, 9, 0]) == 4
    assert mgr.add_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    assert mgr.pools[0].block_hash(1) == b"collide"
    mgr.check_integrity()


def test_namespaces_do_not_share() -> None:
    mgr = make()
    prompt = list(range(9))
    run(mgr, "a", prompt, cache_namespace="lora-1")
    assert mgr.add_request("b", prompt) == 0
    assert mgr.add_request("c", prompt, cache_namespace="lora-2") == 0
    assert mgr.add_request("d", prompt, cache_namespace="lora-1") == 8
    with pytest.raises(TypeError, match="cache_namespace must be None, str, int, bytes"):
        mgr.add_request("e", prompt, cache_namespace=True)
    with pytest.raises(TypeError, match="cache_namespace"):
        mgr.add_request("e", prompt, cache_namespace=[1])


def test_block_hashes_are_a_stable_sha256_chain() -> None:
    mgr = make(hash_fn="sha256")
    prompt = list(range(100, 111))
    run(mgr, "a", prompt, cache_namespace="salt")
    want = []
    parent = ROOT_BLOCK_HASH
    for i in range(2):
        data = parent + np.asarray(prompt[4 * i : 4 * i + 4], dtype="<i8").tobytes() + b"'salt'"
        parent = hashlib.sha256(data).digest()
        want.append(parent)
    got = [mgr.pools[0].block_hash(b) for b in mgr.block_ids("a")[0][:2]]
    assert got == want == hash_block_tokens(prompt, 4, namespace="salt")
    assert mgr.pools[0].block_hash(mgr.block_ids("a")[0][2]) is None  # partial block
    assert hash_block_tokens(prompt, 4) != want  # the namespace is part of the hash
    # A hit continues the chain from the shared blocks.
    assert mgr.add_request("b", [*prompt[:8], 7, 7, 7, 7, 7], cache_namespace="salt") == 8
    mgr.allocate("b", 5)
    mgr.mark_computed("b", 5)
    third = mgr.pools[0].block_hash(mgr.block_ids("b")[0][2])
    assert third == hash_block_tokens([*prompt[:8], 7, 7, 7, 7], 4, namespace="salt")[2]


def test_groups_of_different_block_sizes_hit_a_common_prefix() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(2, 16), AllocatorGroupSpec(4, 16)], 4)
    run(mgr, "a", list(range(11)))
    assert mgr.add_request("b", list(range(11))) == 8  # lcm(2, 4) = 4, at most 10 tokens
    assert mgr.block_ids("b") == ([1, 2, 3, 4], [1, 2])
    # Group 0 finds 3 blocks (6 tokens) but group 1 only one: the common prefix is 4 tokens.
    assert mgr.add_request("c", [*range(6), 50, 0, 0]) == 4
    assert mgr.block_ids("c") == ([1, 2], [1])


def test_prefix_caching_disabled() -> None:
    mgr = make(enable_prefix_caching=False)
    run(mgr, "a", list(range(9)))
    assert mgr.add_request("b", list(range(9))) == 0
    assert mgr.num_cached_blocks() == 0
    assert mgr.prefix_cache_stats.hit_rate == 0.0


# ---------------------------------------------------------------------- fork
def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 16), AllocatorGroupSpec(8, 16)], 4)
    run(mgr, "p", list(range(10)))
    assert mgr.block_ids("p") == ([1, 2, 3], [1, 2])
    copies = mgr.fork("p", "c")
    assert copies == ([(3, 4)], [(2, 3)])
    assert mgr.block_ids("c") == ([1, 2, 4], [1, 3])
    assert mgr.num_computed_tokens("c") == 10 and mgr.num_tokens("c") == 10
    assert mgr.row_of("c") == 1
    assert [mgr.pools[0].ref_count(b) for b in (1, 2, 3, 4)] == [2, 2, 1, 1]
    mgr.check_integrity()
    # Parent and child diverge; each continues in its own partial block.
    decode(mgr, "p", 1)
    decode(mgr, "c", 2)
    assert mgr.block_ids("p")[0] == [1, 2, 3] and mgr.block_ids("c")[0] == [1, 2, 4]
    mgr.check_integrity()
    mgr.free("p")
    assert mgr.pools[0].ref_count(1) == 1
    mgr.check_integrity()


def test_fork_with_a_sliding_window_shares_only_blocks_inside_it() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 16, sliding_window=4)], 4)
    mgr.add_request("p", list(range(14)))
    mgr.allocate("p", 14)
    mgr.mark_computed("p", 14)  # next token 14 attends to [11, 14]
    assert mgr.block_ids("p") == ([0, 0, 3, 4],)
    assert mgr.fork("p", "c") == ([(4, 5)],)
    assert mgr.block_ids("c") == ([0, 0, 3, 5],)
    assert [mgr.pools[0].ref_count(b) for b in (1, 2, 3, 4, 5)] == [0, 0, 2, 1, 1]
    mgr.check_integrity()


def test_fork_at_a_block_boundary_copies_nothing_and_skips_lookahead_blocks() -> None:
    mgr = make()
    mgr.add_request("p", list(range(8)))
    mgr.allocate("p", 12)  # 4 lookahead tokens: a third block
    mgr.mark_computed("p", 8)
    assert mgr.fork("p", "c") == ([],)
    assert mgr.block_ids("c") == ([1, 2],) and mgr.block_ids("p") == ([1, 2, 3],)
    assert mgr.allocate("c", 1) == ([4],)
    mgr.check_integrity()


def test_fork_failures_change_nothing() -> None:
    mgr = make(num_blocks=4, max_num_reqs=3)
    run(mgr, "p", list(range(10)))  # all 3 blocks used, the last one partial
    before = state(mgr)
    with pytest.raises(OutOfBlocksError, match="fork of 'p'"):
        mgr.fork("p", "c")
    with pytest.raises(ValueError, match="child_id 'p' is already a known request"):
        mgr.fork("p", "p")
    with pytest.raises(KeyError, match="unknown request 'x'"):
        mgr.fork("x", "c")
    assert state(mgr) == before
    mgr2 = make(max_num_reqs=1)
    run(mgr2, "p", list(range(10)))
    with pytest.raises(OutOfRowsError):
        mgr2.fork("p", "c")


# ---------------------------------------------------------------------- sliding windows
def test_sliding_window_releases_blocks_and_nulls_their_entries() -> None:
    mgr = KVCacheManager(
        [AllocatorGroupSpec(4, 16), AllocatorGroupSpec(4, 16, sliding_window=6)], 4
    )
    mgr.add_request("a", list(range(24)))
    mgr.allocate("a", 8)
    mgr.mark_computed("a", 8)
    # next token 8 attends to [3, 8]: block 0 (tokens 0..3) still needed
    assert mgr.block_ids("a") == ([1, 2], [1, 2])
    mgr.take_step_update()
    mgr.allocate("a", 4)
    mgr.mark_computed("a", 4)
    # next token 12 attends to [7, 12]: block 0 left the window
    assert mgr.block_ids("a") == ([1, 2, 3], [NULL_BLOCK_ID, 2, 3])
    assert mgr.pools[1].ref_count(1) == 0 and mgr.pools[1].eviction_order()[-1] == 1
    assert mgr.pools[1].num_cached_blocks == 3  # block 1 stays findable until evicted
    update = mgr.take_step_update()
    assert update.appended[1].block_ids.tolist() == [3]
    assert update.nulled[1].rows.tolist() == [0] and update.nulled[1].block_indices.tolist() == [0]
    assert len(update.nulled[0]) == 0
    mgr.check_integrity()
    # A long chunk: entries appended and released in the same step arrive as null ids.
    assert mgr.allocate("a", 12)[1] == [4, 5, 6]
    mgr.mark_computed("a", 12)  # next token 24 attends to [19, 24]
    assert mgr.block_ids("a")[1] == [0, 0, 0, 0, 5, 6]
    update = mgr.take_step_update()
    assert update.appended[1].block_ids.tolist() == [0, 5, 6]
    assert update.nulled[1].block_indices.tolist() == [1, 2]
    mgr.check_integrity()


def test_sliding_window_hit_takes_only_blocks_inside_the_window() -> None:
    mgr = KVCacheManager(
        [AllocatorGroupSpec(4, 16), AllocatorGroupSpec(4, 16, sliding_window=5)], 4
    )
    mgr.add_request("a", list(range(17)))
    mgr.allocate("a", 4)
    mgr.mark_computed("a", 4)
    mgr.allocate("a", 13)
    mgr.mark_computed("a", 13)
    assert mgr.block_ids("a")[1] == [0, 0, 0, 4, 5]
    mgr.free("a")
    assert mgr.add_request("b", list(range(17))) == 16
    # next token 16 attends to [12, 16]: only block 3 of the cached chain is needed
    assert mgr.block_ids("b") == ([1, 2, 3, 4], [0, 0, 0, 4])
    assert [mgr.pools[1].ref_count(b) for b in (1, 2, 3, 4)] == [0, 0, 0, 1]
    mgr.check_integrity()


# ---------------------------------------------------------------------- allocation
def test_allocate_is_all_or_nothing_over_groups() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 32), AllocatorGroupSpec(8, 3)], 4)
    mgr.add_request("a", list(range(30)))
    assert not mgr.can_allocate("a", 17)  # group 1 has 2 blocks: 16 tokens
    before = state(mgr)
    with pytest.raises(OutOfBlocksError, match="'a' needs 3 new blocks in group 1, 2 free"):
        mgr.allocate("a", 17)
    assert state(mgr) == before
    assert mgr.can_allocate("a", 16)
    assert mgr.allocate("a", 16) == ([1, 2, 3, 4], [1, 2])
    assert mgr.allocate("a", 3) == ([], [])  # lookahead already covers it
    assert mgr.allocate("a", 0) == ([], [])


def test_rows_are_assigned_lowest_first_and_reused() -> None:
    mgr = make(max_num_reqs=3)
    for r in "abc":
        mgr.add_request(r, [1])
    assert [mgr.row_of(r) for r in "abc"] == [0, 1, 2]
    before = state(mgr)
    with pytest.raises(OutOfRowsError, match="no free row for request 'd'"):
        mgr.add_request("d", [1])
    assert state(mgr) == before
    mgr.free("b")
    mgr.add_request("d", [1])
    assert mgr.row_of("d") == 1 and mgr.num_free_rows == 0


def test_max_model_len() -> None:
    mgr = make(max_model_len=10)
    with pytest.raises(ValueError, match="prompt of 11 tokens exceeds max_model_len=10"):
        mgr.add_request("a", list(range(11)))
    mgr.add_request("a", list(range(9)))
    before = state(mgr)
    with pytest.raises(ValueError, match="request 'b': prompt of 11 tokens exceeds"):
        mgr.add_request("b", list(range(11)))  # (a namespace seen before: the inline plan)
    with pytest.raises(ValueError, match="prompt_token_ids of request 'b' is empty"):
        mgr.add_request("b", [])
    assert state(mgr) == before
    with pytest.raises(ValueError, match="allocation of 11 tokens exceeds"):
        mgr.allocate("a", 11)
    with pytest.raises(ValueError, match="allocation of 11 tokens exceeds"):
        mgr.can_allocate("a", 11)
    mgr.allocate("a", 10)
    mgr.append_token_ids("a", 9)
    with pytest.raises(ValueError, match="sequence of 11 tokens exceeds"):
        mgr.append_token_ids("a", [1])


def test_token_id_inputs() -> None:
    mgr = make()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    run(mgr, "list", prompt)
    assert mgr.add_request("tuple", tuple(prompt)) == 8
    assert mgr.add_request("numpy", np.array(prompt, dtype=np.int32)) == 8
    assert mgr.add_request("tensor", torch.tensor(prompt)) == 8
    mgr.append_token_ids("numpy", np.array([7, 7], dtype=np.uint8))
    mgr.append_token_ids("tensor", 7)
    mgr.append_token_ids("tensor", np.int64(8))  # a sampled token straight from numpy
    mgr.append_token_ids("tensor", torch.tensor(9))
    assert mgr.num_tokens("numpy") == 11 and mgr.num_tokens("tensor") == 12
    assert mgr._requests["tensor"].token_ids() == [*prompt, 7, 8, 9]


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "tokens, match",
    [
        ([1, 2.5], "prompt_token_ids of request 'x' must hold int64 token ids"),
        ("abc", "prompt_token_ids of request 'x' must be an int, list"),
        (np.array([1.0, 2.0]), "prompt_token_ids of request 'x' must hold integers"),
        (np.array([True]), "must hold integers"),
        (torch.tensor([1.0]), "must hold integers"),
        ([1, None], "must hold int64 token ids"),
        ([2**63], "must hold int64 token ids"),
    ],
)
def test_bad_token_ids_are_rejected_and_change_nothing(tokens: object, match: str) -> None:
    mgr = make()
    run(mgr, "a", list(range(6)))
    before = state(mgr)
    with pytest.raises(TypeError, match=match):
        mgr.add_request("x", tokens)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=match.replace("prompt_token_ids of request 'x'", "")):
        mgr.append_token_ids("a", tokens)  # type: ignore[arg-type]
    assert state(mgr) == before


def test_bad_calls_name_the_request_and_change_nothing() -> None:
    mgr = make()
    run(mgr, "a", list(range(6)))
    before = state(mgr)
    with pytest.raises(KeyError, match="unknown request 'zz'"):
        mgr.free("zz")
    with pytest.raises(KeyError, match="unknown request 'zz'"):
        mgr.allocate("zz", 1)
    with pytest.raises(KeyError, match="unknown request 7"):
        mgr.can_allocate(7, 1)
    with pytest.raises(KeyError, match="unknown request 'zz'"):
        mgr.mark_computed("zz", 1)
    with pytest.raises(KeyError, match="unknown request 'zz'"):
        mgr.preempt("zz")
    with pytest.raises(ValueError, match="request 'a' is already running"):
        mgr.add_request("a", [1, 2])
    with pytest.raises(ValueError, match="prompt_token_ids of request 'b' is empty"):
        mgr.add_request("b", [])
    with pytest.raises(TypeError, match="req_id must be a str or int, got float"):
        mgr.add_request(1.0, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="req_id must be a str or int, got bool"):
        mgr.add_request(True, [1])
    with pytest.raises(ValueError, match="num_new_tokens( entries)? must be >= 0, got -1"):
        mgr.allocate("a", -1)
    with pytest.raises(TypeError, match="num_new_tokens( entries)? must be an int, got float"):
        mgr.allocate("a", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot mark 7 tokens computed, only 6 token ids"):
        mgr.mark_computed("a", 1)
    assert state(mgr) == before
    mgr.append_token_ids("a", [1, 2, 3])
    before = state(mgr)
    with pytest.raises(ValueError, match="cannot mark 9 tokens computed, group 0 has blocks for 8"):
        mgr.mark_computed("a", 3)
    assert state(mgr) == before
    mgr.free("a")
    with pytest.raises(KeyError, match="unknown request 'a' \\(never added, or already freed\\)"):
        mgr.free("a")


def test_free_of_a_preempted_request_forgets_it() -> None:
    mgr = make()
    run(mgr, "a", list(range(6)))
    mgr.preempt("a")
    mgr.free("a")  # aborted while waiting
    assert not mgr.is_preempted("a")
    with pytest.raises(KeyError, match="unknown request 'a'"):
        mgr.free("a")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"groups": []}, ValueError, "groups must hold at least one"),
        ({"groups": [(4, 16)]}, TypeError, r"groups\[0\] must be an AllocatorGroupSpec"),
        ({"max_num_reqs": 0}, ValueError, "max_num_reqs must be >= 1"),
        ({"hash_fn": 3}, TypeError, "hash_fn must be 'fast', 'sha256' or a callable, got int"),
        ({"hash_fn": "md5"}, ValueError, "hash_fn must be 'fast', 'sha256' or a callable"),
        ({"max_model_len": 0}, ValueError, "max_model_len must be >= 1"),
    ],
)
def test_bad_construction(kwargs: dict, error: type, match: str) -> None:
    args = {"groups": [AllocatorGroupSpec(4, 16)], "max_num_reqs": 2} | kwargs
    with pytest.raises(error, match=match):
        KVCacheManager(**args)  # type: ignore[arg-type]


def test_lookup_prefix_matches_add_request_and_changes_nothing():
    mgr = KVCacheManager([AllocatorGroupSpec(block_size=4, num_blocks=16)], max_num_reqs=3)
    prompt = list(range(10))
    assert mgr.lookup_prefix(prompt) == 0
    mgr.add_request("a", prompt)
    mgr.allocate("a", len(prompt))
    mgr.mark_computed("a", len(prompt))
    mgr.free("a")  # its full blocks stay cached (and free)
    stats = mgr.prefix_cache_stats
    free, cached = mgr.num_free_blocks(), mgr.num_cached_blocks()
    order = list(mgr.pools[0].eviction_order())
    assert mgr.lookup_prefix(prompt[:9] + [99]) == 8
    assert mgr.lookup_prefix(prompt, cache_namespace="lora-1") == 0  # other namespace: no hit
    assert mgr.lookup_prefix(prompt[:8]) == 4  # at least one token is always computed
    assert (mgr.prefix_cache_stats, mgr.num_free_blocks(), mgr.num_cached_blocks()) == (
        stats, free, cached)
    assert list(mgr.pools[0].eviction_order()) == order
    mgr.check_integrity()
    assert mgr.add_request("b", prompt[:9] + [99]) == 8
    with pytest.raises(TypeError):
        mgr.lookup_prefix([1.5, 2.0])
    with pytest.raises(ValueError, match="empty"):
        mgr.lookup_prefix([])
