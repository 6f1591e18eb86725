"""Registration of a step's newly full blocks in one batched call, against one call per
request and the plain-Python key reference: decode blocks (one per request, gathered from the
token arena), longer fresh segments, requests whose token ids left the arena, block sizes that
do not divide the arena's rows, fresh segments before stored ones."""

from __future__ import annotations

import numpy as np
import pytest

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.allocator.rowstate import TOKEN_ROW_CAP
from blocktable.block_hashing import fast_block_keys


def _registered(mgr: KVCacheManager, req_id: int, bs: int) -> list[tuple]:
    """Per full computed block of ``req_id``: its key (block hash), content id and the
    content id of its parent (from the record it holds or duplicates)."""
    pool = mgr.pools[0]
    out = []
    for block in mgr.block_ids(req_id)[0][: mgr.num_computed_tokens(req_id) // bs]:
        slot = int(pool.record[block])
        if slot < 0:  # a duplicate of an owned block's content
            slot = int(pool.dup_of[block])
        index = pool.index
        out.append((pool.block_hash(block), int(index.cid[slot]), int(index.parent[slot])))
    return out


@pytest.mark.parametrize("bs", [3, 16])  # 3 does not divide the token arena's rows
@pytest.mark.parametrize("seed", range(3))
# without the long request, the arenas' rows hold as many blocks of token ids as block ids
# (one position per block serves both gathers)
@pytest.mark.parametrize("with_long", [True, False])
def test_batched_registration_equals_per_request_and_the_key_reference(
    bs: int, seed: int, with_long: bool
) -> None:
    rng = np.random.default_rng(seed)
    long_len = TOKEN_ROW_CAP + 5  # its token ids live in a buffer of their own
    make = lambda: KVCacheManager(
        [AllocatorGroupSpec(bs, 4000)], 8, max_model_len=long_len + 40 * bs
    )
    batched, single = make(), make()
    prompts: dict[int, list[int]] = {}
    for r in range(6):
        n = long_len if r == 0 and with_long else int(rng.integers(bs, 12 * bs))
        prompts[r] = rng.integers(0, 50, n).tolist()
    ids = list(prompts)
    for mgr in (batched, single):
        mgr.add_requests(ids, [prompts[r] for r in ids])
        mgr.allocate_many(ids, [len(prompts[r]) for r in ids])
    # prompts partly computed, in an order where fresh segments may come before stored ones
    first = [int(rng.integers(1, len(prompts[r]) + 1)) for r in ids]
    batched.mark_computed_many(ids, first)
    for r, n in zip(ids, first):
        single.mark_computed(r, n)
    for _ in range(12):
        sched, nums = [], []
        for r in rng.permutation(ids).tolist():
            if rng.random() < 0.3:  # (the long request too sits some steps out)
                continue
            left = len(prompts[r]) - batched.num_computed_tokens(r)
            # decode: 1 block (usually) or a few; sometimes appended before the prompt is
            # computed, so that one segment runs from stored keys into fresh ones
            if left == 0 or rng.random() < 0.15:
                new = rng.integers(0, 50, bs * int(rng.choice([1, 1, 1, 3]))).tolist()
                for mgr in (batched, single):
                    mgr.append_token_ids(r, new)
                prompts[r] += new
                left += len(new)
            n = int(rng.integers(1, left + 1)) if rng.random() < 0.3 else left
            for mgr in (batched, single):
                mgr.allocate(r, n)
            sched.append(r)
            nums.append(n)
        batched.mark_computed_many(sched, nums)
        for r, n in zip(sched, nums):
            single.mark_computed(r, n)
        for r in ids:
            keys = fast_block_keys(prompts[r], bs)
            for mgr in (batched, single):  # (content ids are numbered in call order)
                got = _registered(mgr, r, bs)
                assert len(got) == batched.num_computed_tokens(r) // bs
                assert [key for key, _, _ in got] == keys[: len(got)]
                # each block's parent is the content of the block before it
                assert [p for _, _, p in got[1:]] == [c for _, c, _ in got[:-1]]
    batched.check_integrity()
    single.check_integrity()
