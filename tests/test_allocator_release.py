"""Batched release: the pool's release of many requests' blocks at once, the free queue's
extend with repeats and the row allocator's batched calls, each against a plain reference."""

from __future__ import annotations

import numpy as np
import pytest

from blocktable.allocator import BlockPool, OutOfRowsError
from blocktable.allocator.rows import RowAllocator
from blocktable.block_queue import BlockQueue

ROOT = -1  # parent content id of a first block (namespace 1)

pytestmark = pytest.mark.usefixtures("compiled_mode")  # compiled (where built), then numpy


def _cache(pool: BlockPool, blocks: list[int], tokens: list[int]) -> None:
    """File ``blocks`` as one chain (block size 1) keyed by their tokens."""
    keys = np.array([t * 1000 + 7 for t in tokens], dtype=np.uint64)
    toks = np.array(tokens, dtype=np.int64).reshape(-1, 1)
    pool.cache(np.array(blocks, dtype=np.int32), keys, toks, np.zeros(1, np.int64),
               np.array([ROOT]))


def _build(seed: int) -> tuple[BlockPool, list[list[int]]]:
    """A pool after random admissions (fresh blocks, cached as a prefix of one of three
    chains, so that contents repeat: duplicates of owned holders, moves from free ones), prefix
    hits (shares of owned and of free cached blocks) and frees; and the rows of the requests
    still running."""
    rng = np.random.default_rng(seed)
    pool = BlockPool(700)
    reqs: list[list[int]] = []
    for _ in range(40):
        op = int(rng.integers(4))
        if op == 3 and reqs:
            row = reqs.pop(int(rng.integers(len(reqs))))
            pool.release(np.array(row[::-1], dtype=np.intp))
            continue
        hit: list[int] = []
        if op >= 1:  # a prefix hit: cached blocks, owned by others or free
            owned = [b for r in reqs for b in r if pool.record[b] >= 0]
            choices = sorted(set(owned) | set(pool.cached.ids().tolist()))
            if choices:
                k = int(rng.integers(0, min(len(choices), 25) + 1))
                hit = rng.permutation(choices)[:k].tolist()
                if hit:
                    pool.share_many(np.array(hit, dtype=np.intp))
        if pool.num_free_blocks < 30:
            continue
        n = int(rng.integers(1, 30))
        fresh = pool.take(n).tolist()
        num_cached = int(rng.integers(0, n + 1))
        if num_cached:
            chain = int(rng.integers(3)) * 100
            _cache(pool, fresh[:num_cached], list(range(chain, chain + num_cached)))
        reqs.append(hit + fresh)
    return pool, reqs


def _state(pool: BlockPool) -> tuple[object, ...]:
    return (
        pool.eviction_order(),
        len(pool.uncached),
        pool.ref_counts.tolist(),
        pool.record.tolist(),
        pool.dup_of.tolist(),
        {slot: list(copies) for slot, copies in pool.dups.items()},
        pool.index.holder.tolist(),
        pool.num_cached_blocks,
    )


@pytest.mark.parametrize("seed", range(12))
def test_release_of_many_rows_equals_one_block_at_a_time(seed: int) -> None:
    """One release of several rows (tail first, concatenated, shared blocks repeated) leaves
    the pool exactly as releasing each entry alone, in order: same queues in the same order,
    reference counts, records, duplicates and their handovers."""
    batched, reqs = _build(seed)
    reference, _ = _build(seed)
    assert _state(batched) == _state(reference)
    rng = np.random.default_rng(100 + seed)
    if len(reqs) < 2:
        pytest.skip("too few running requests")
    chosen = rng.permutation(len(reqs))[: max(2, len(reqs) * 2 // 3)].tolist()
    block_ids = np.concatenate([np.array(reqs[i][::-1], dtype=np.intp) for i in chosen])
    batched.release(block_ids, may_repeat=True)
    for block_id in block_ids.tolist():
        reference.release(np.array([block_id], dtype=np.intp))
    assert _state(batched) == _state(reference)
    expected = np.zeros(batched.num_blocks, dtype=np.int64)
    for i, row in enumerate(reqs):
        if i not in chosen:
            np.add.at(expected, row, 1)
    batched.check_integrity(expected)


def test_the_scenarios_reach_duplicates_repeats_and_both_queues() -> None:
    """The random pools above exercise what they are meant to (else the test proves little)."""
    with_dups = with_repeats = with_uncached = 0
    for seed in range(12):
        pool, reqs = _build(seed)
        with_dups += len(pool.dups) > 0
        blocks = [b for r in reqs for b in r]
        with_repeats += len(blocks) > len(set(blocks))
        with_uncached += any(pool.record[b] < 0 for b in blocks)
    assert with_dups >= 3 and with_repeats >= 6 and with_uncached >= 6


def test_release_without_repeats_and_all_blocks_freed() -> None:
    pool = BlockPool(10)
    blocks = pool.take(6).tolist()
    _cache(pool, blocks[:4], [1, 2, 3, 4])
    pool.share_many(np.array([blocks[0]], dtype=np.intp))
    pool.release(np.array(blocks[::-1], dtype=np.int32))  # int32 ids, as from a row
    assert pool.eviction_order() == [7, 8, 9, 6, 5, 4, 3, 2]  # block 1 is still held
    pool.release(np.array([blocks[0]], dtype=np.intp))
    assert pool.eviction_order() == [7, 8, 9, 6, 5, 4, 3, 2, 1]
    pool.check_integrity([0] * 10)


def test_block_queue_extend_with_repeats_against_a_list() -> None:
    """Each id is queued once, where it occurs last; also when the repeats outnumber the free
    slots of the queue's array (it compacts, then drops the repeats first)."""
    rng = np.random.default_rng(5)
    q, model = BlockQueue(30), []
    for _ in range(1500):
        op = int(rng.integers(0, 3))
        outside = [b for b in range(1, 30) if b not in model]
        if op == 0 and outside:
            new = rng.permutation(outside)[: rng.integers(1, 8)]
            size = int(rng.choice([1, 5, 40, 200]))  # 200: more than the array holds
            ids = rng.choice(new, size).astype(np.int32 if rng.integers(2) else np.intp)
            q.extend(ids, may_repeat=True)
            last = {b: i for i, b in enumerate(ids.tolist())}
            model += sorted(last, key=last.__getitem__)
        elif op == 1 and model:
            gone = rng.permutation(model)[: rng.integers(1, 4)].astype(np.int32)
            q.remove(gone)
            model = [b for b in model if b not in set(gone.tolist())]
        elif op == 2 and model:
            n = int(rng.integers(1, len(model) + 1))
            assert q.pop(n).tolist() == model[:n]
            model = model[n:]
        assert q.ids().tolist() == model and len(q) == len(model)


def test_row_allocator_hands_out_the_lowest_free_rows() -> None:
    rng = np.random.default_rng(6)
    rows_of: RowAllocator[int] = RowAllocator(40)
    model: dict[int, int] = {}  # row -> holder
    for step in range(300):
        if rng.integers(2) and model:
            rows = rng.permutation(list(model))[: rng.integers(1, 9)].tolist()
            rows_of.release_many(rows)
            for row in rows:
                del model[row]
        else:
            holders = list(range(step * 100, step * 100 + int(rng.integers(0, 9))))
            if len(holders) > rows_of.num_free:
                with pytest.raises(OutOfRowsError, match=f"no {len(holders)} free rows"):
                    rows_of.take_many(holders)
                continue
            rows = rows_of.take_many(holders)
            assert rows == sorted(set(range(40)) - set(model))[: len(holders)]  # lowest first
            model.update(zip(rows, holders))
        assert rows_of.holders == [model.get(row) for row in range(40)]
        assert sorted(rows_of.free_rows()) == sorted(set(range(40)) - set(model))


def test_row_allocator_take_many_failure_changes_nothing() -> None:
    rows: RowAllocator[str] = RowAllocator(3)
    rows.take_many(["a", "b"])
    with pytest.raises(OutOfRowsError, match="no 2 free rows for the requests: 1 free of 3"):
        rows.take_many(["c", "d"])
    assert rows.holders == ["a", "b", None] and rows.free_rows() == [2]
    assert rows.take_many(["c"]) == [2]
    with pytest.raises(OutOfRowsError, match="no free row for x: all 3 held"):
        rows.check_free("x")
