"""The prefix index: filing keys against a dict, token rows written whole, recycling of dead
records (against references); its key table compiled and as a dict."""

from __future__ import annotations

import numpy as np
import pytest
from test_allocator_pool import cache

from blocktable.allocator import BlockPool
from blocktable.allocator.index import PrefixIndex
from blocktable.block_queue import last_occurrences


@pytest.mark.usefixtures("compiled_mode")
@pytest.mark.parametrize("seed", range(4))
def test_key_filing_against_a_dict(seed: int) -> None:
    """Filing batches of new keys (refused whole, changing nothing, when one is filed already
    or given twice), filing one by one, dropping records and looking keys up agree with a
    dict, and ``key`` names each filed record's key."""
    rng = np.random.default_rng(seed)
    index, model = PrefixIndex(4096, 4), {}
    universe = np.unique(rng.integers(0, 2**64, 400, dtype=np.uint64))
    for _ in range(150):
        op = int(rng.integers(0, 4))
        if op <= 1 or not model:
            new = [k for k in rng.permutation(universe).tolist() if k not in model]
            new = new[: int(rng.integers(1, 41))]
            if not new:
                continue
            bad = int(rng.integers(0, 3)) if op == 0 else 0
            keys = list(new)
            if bad == 1 and model:
                keys[int(rng.integers(len(keys)))] = list(model)[int(rng.integers(len(model)))]
            elif bad == 2 and len(keys) > 1:
                keys[-1] = keys[0]
            slots = index.take_slots(len(keys))
            fresh = len(set(keys)) == len(keys) and not any(k in model for k in keys)
            if op == 0:
                ok = index.file_absent(np.array(keys, dtype=np.uint64), slots)
                assert ok == fresh
            elif fresh:
                for key, slot in zip(keys, slots.tolist()):
                    index.file_one(key, slot)
            if fresh:
                model.update(zip(keys, slots.tolist()))
                index.cid[slots] = 1  # (used records, for drop)
            else:
                index.untake_slots(slots)
        else:  # drop some records: their keys leave the index
            held = list(model)
            gone = [held[i] for i in rng.permutation(len(held))[: rng.integers(1, 12)]]
            index.drop(np.array([model[k] for k in gone], dtype=np.int64))
            for k in gone:
                del model[k]
        query = np.array(universe, dtype=np.uint64)
        assert index.find(query).tolist() == [model.get(k, -1) for k in query.tolist()]
        assert [index.find_one(k) for k in query[:40].tolist()] == [
            model.get(k, -1) for k in query[:40].tolist()
        ]
        assert dict(zip(*index.slot_of_key.items())) == model
        assert index.key[list(model.values())].tolist() == list(model)
        assert len(index) == len(model)


def test_index_token_rows_written_and_read_whole() -> None:
    """``PrefixIndex.write_tokens`` (one put of whole rows) equals row-wise assignment."""
    from blocktable.allocator.prefix import _rows_differ

    rng = np.random.default_rng(5)
    for bs in (1, 3, 8, 16):
        index = PrefixIndex(64, bs)
        expected = index.tokens.copy()
        slots = rng.permutation(len(index.tokens))[:20]
        tokens = rng.integers(-(2**62), 2**62, (20, bs))
        index.write_tokens(slots, tokens)
        expected[slots] = tokens
        assert (index.tokens == expected).all()
        other = tokens.copy()
        other[::3, -1] += 1
        assert _rows_differ(tokens, other).tolist() == (tokens != other).any(axis=1).tolist()


def _recycle_reference(index: PrefixIndex, want: int) -> bool:
    """The recycling of dead records as first written: repeats dropped with a stamp array
    (each slot kept where it occurs last), then the still-dead ones dropped."""
    found = 0
    while found < want and index._dead_head < index._dead_tail:
        head = index._dead_head
        batch = index._dead[head : min(index._dead_tail, head + max(2 * want, 1024))].copy()
        index._dead_head = head + len(batch)
        batch = last_occurrences(batch)
        batch = batch[(index.cid[batch] != 0) & (index.holder[batch] == 0)]
        if len(batch):
            index.drop(batch)
            found += len(batch)
    return found > 0


@pytest.mark.parametrize("seed", range(3))
def test_recycling_drops_the_same_records_as_the_reference(seed: int) -> None:
    """Records that died, were revived and died again (repeated entries in the death list)
    are recycled once each, and exactly the records the reference recycles go."""
    rng = np.random.default_rng(seed)
    pools = [BlockPool(6, max_records=8), BlockPool(6, max_records=8)]
    pools[1].index._recycle = lambda want: _recycle_reference(pools[1].index, want)
    for _ in range(150):
        n = int(rng.integers(1, 4))
        contents = rng.integers(0, 15, n).tolist()  # repeats: some are revived, then die
        for pool in pools:
            blocks = pool.take(n).tolist()
            cache(pool, blocks, contents)
            pool.release(np.array(blocks[::-1], dtype=np.int32))
            pool.check_integrity([0] * 6)
        a, b = (p.index for p in pools)
        assert sorted(a.cid[a.cid != 0].tolist()) == sorted(b.cid[b.cid != 0].tolist())
        keys = [t * 1000 + 7 for t in range(15)]
        assert (a.find(keys) >= 0).tolist() == (b.find(keys) >= 0).tolist()
