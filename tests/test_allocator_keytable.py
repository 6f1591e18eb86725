"""The prefix index's key table and records: probe runs far past one window, token rows
written whole, recycling of dead records (against references)."""

from __future__ import annotations

import numpy as np
import pytest
from test_allocator_pool import cache

from blocktable.allocator import BlockPool
from blocktable.allocator.arrays import last_occurrences
from blocktable.allocator.index import PrefixIndex
from blocktable.allocator.keytable import KeyTable


@pytest.mark.parametrize("seed", range(4))
def test_key_table_long_probe_runs_against_a_dict(seed: int) -> None:
    """Keys crowding a few home positions make probe runs far longer than one window, with
    tombstones inside: filing new keys (up to 40 per call), refusing a batch with a key held
    deep in a run or given twice, deleting and looking up all agree with a dict."""
    rng = np.random.default_rng(seed)
    table, model = KeyTable(48, num_values=4096), {}
    mask = len(table.entries) - 1
    homes = rng.integers(0, mask + 1, 3)
    universe = np.unique(
        (rng.integers(1, 2**40, 400, dtype=np.uint64) * np.uint64(mask + 1))
        + rng.choice(homes, 400).astype(np.uint64)
    )
    free_values = list(range(4096))
    rng.shuffle(free_values)
    for _ in range(150):
        op = rng.integers(0, 3)
        if op == 0 or not model:  # a batch of new keys, sometimes with a held or repeated one
            room = max(0, len(table.entries) // 4 - len(model))
            new = [k for k in rng.permutation(universe).tolist() if k not in model]
            new = new[: int(rng.integers(1, 41))][:room]
            if not new:
                continue
            bad = rng.integers(0, 3)
            keys = list(new)
            if bad == 1 and model:
                keys[int(rng.integers(len(keys)))] = list(model)[int(rng.integers(len(model)))]
            elif bad == 2 and len(keys) > 1:
                keys[-1] = keys[0]
            values = [free_values.pop() for _ in keys]
            ok = table.insert_absent(np.array(keys, dtype=np.uint64), np.array(values))
            fresh = len(set(keys)) == len(keys) and not any(k in model for k in keys)
            assert ok == fresh
            if ok:
                model.update(zip(keys, values))
            else:
                free_values += values
        else:  # delete some keys: tombstones inside the runs
            held = list(model)
            gone = [held[i] for i in rng.permutation(len(held))[: rng.integers(1, 12)]]
            table.delete_values(np.array([model[k] for k in gone], dtype=np.int64))
            for k in gone:
                free_values.append(model.pop(k))
        query = np.array(universe, dtype=np.uint64)
        assert table.get(query).tolist() == [model.get(k, -1) for k in query.tolist()]
        assert [table.get_one(k) for k in query[:40].tolist()] == [
            model.get(k, -1) for k in query[:40].tolist()
        ]
        keys_held, values_held = table.items()
        assert dict(zip(keys_held.tolist(), values_held.tolist())) == model
        assert len(table) == len(model)
        assert table._num_deleted == int(np.count_nonzero(table.entries == -2))


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


@pytest.mark.parametrize("seed", range(3))
def test_key_table_runs_wrapping_past_the_end_against_a_dict(seed: int) -> None:
    """Keys whose homes are the table's last positions: probe windows wrap around to its
    start. Filing (batched and one by one), lookups (batched and
    scalar) and deleting agree with a dict."""
    rng = np.random.default_rng(seed)
    table, model = KeyTable(40, num_values=1024), {}
    size = len(table.entries)
    homes = np.arange(size - 5, size, dtype=np.uint64)  # the last 5 positions
    universe = np.unique(
        rng.integers(1, 2**40, 300, dtype=np.uint64) * np.uint64(size)
        + rng.choice(homes, 300).astype(np.uint64)
    )
    free_values = rng.permutation(1024).tolist()
    for _ in range(120):
        op = int(rng.integers(0, 4))
        if op <= 1 or not model:  # file new keys, vectorized or one by one
            room = max(0, size // 4 - len(model))
            new = [k for k in rng.permutation(universe).tolist() if k not in model]
            new = new[: int(rng.integers(1, 16))][:room]
            if not new:
                continue
            values = [free_values.pop() for _ in new]
            if op == 0:
                assert table.insert_absent(np.array(new, dtype=np.uint64), np.array(values))
            else:
                for key, value in zip(new, values):
                    table.insert_one(key, value)
            model.update(zip(new, values))
        else:  # delete some held keys
            held = list(model)
            gone = [held[i] for i in rng.permutation(len(held))[: int(rng.integers(1, 8))]]
            table.delete_values(np.array([model[k] for k in gone], dtype=np.int64))
            for k in gone:
                free_values.append(model.pop(k))
        query = universe.copy()
        expected = [model.get(k, -1) for k in query.tolist()]
        assert table.get(query).tolist() == expected
        assert [table.get_one(k) for k in query.tolist()] == expected
        values = np.array(expected)
        found = table.where[values[values >= 0]]  # where each held value's entry sits
        assert ((table.entries[found] & 0xFFFFFFFF) == values[values >= 0]).all()
        assert len(table) == len(model)
        assert table._num_deleted == int(np.count_nonzero(table.entries == -2))
    # some run did wrap: a key sits before its home
    keys_held, values_held = table.items()
    if len(keys_held):
        pos = table.where[values_held]
        assert (pos < (keys_held % np.uint64(size)).astype(np.int64)).any() or len(model) < 6
