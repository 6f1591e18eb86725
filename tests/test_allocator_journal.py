"""take_step_update: how the operations of one step merge into one StepUpdate."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.allocator.journal import StepJournal
from blocktable.allocator.rowstate import RowState
from blocktable.update import RowBlocks, StepUpdate

# every test runs with the compiled diff of the changed rows and with numpy's
pytestmark = pytest.mark.usefixtures("compiled_mode")


def make(num_groups: int = 1, max_num_reqs: int = 4) -> KVCacheManager:
    return KVCacheManager([AllocatorGroupSpec(4, 32)] * num_groups, max_num_reqs)


def as_lists(blocks: RowBlocks) -> dict[int, list[int]]:
    out, start = {}, 0
    for row, num in zip(blocks.rows.tolist(), blocks.num_manager_blocks.tolist()):
        out[row] = blocks.block_ids[start : start + num].tolist()
        start += num
    return out


def is_empty(update: StepUpdate) -> bool:
    blocks = (*update.added, *update.appended)
    return (
        len(update.cleared_rows) == 0
        and all(len(b) == 0 for b in blocks)
        and all(len(e) == 0 for e in update.nulled)
    )


def test_admitted_and_allocated_in_one_step_is_one_added_row() -> None:
    mgr = make()
    mgr.add_request("a", list(range(9)))
    mgr.allocate("a", 9)
    mgr.mark_computed("a", 9)
    mgr.take_step_update()
    assert mgr.add_request("b", list(range(10))) == 8  # hits blocks 1, 2
    mgr.allocate("b", 2)
    update = mgr.take_step_update()
    assert as_lists(update.added[0]) == {1: [1, 2, 4]}
    assert len(update.appended[0]) == 0 and len(update.cleared_rows) == 0
    for arr in (update.cleared_rows, update.added[0].rows, update.added[0].num_manager_blocks):
        assert arr.dtype == np.int32
    assert update.added[0].block_ids.dtype == np.int32
    assert is_empty(mgr.take_step_update())


def test_appends_of_a_step_are_merged_per_row() -> None:
    mgr = make(num_groups=2)
    mgr.add_request("a", list(range(20)))
    mgr.allocate("a", 4)
    mgr.mark_computed("a", 4)
    mgr.take_step_update()
    mgr.allocate("a", 4)
    mgr.mark_computed("a", 4)
    mgr.allocate("a", 8)
    update = mgr.take_step_update()
    assert [as_lists(a) for a in update.appended] == [{0: [2, 3, 4]}] * 2
    assert len(update.added[0]) == 0


def test_freed_after_append_in_the_same_step_is_only_cleared() -> None:
    mgr = make()
    mgr.add_request("a", [1, 2, 3])
    mgr.allocate("a", 3)
    mgr.take_step_update()
    mgr.allocate("a", 8)
    mgr.free("a")
    update = mgr.take_step_update()
    assert update.cleared_rows.tolist() == [0]
    assert len(update.appended[0]) == 0 and len(update.added[0]) == 0


def test_row_freed_and_taken_by_another_request_in_the_same_step_is_replaced() -> None:
    mgr = make(max_num_reqs=2)
    mgr.add_request("a", [1, 2, 3])
    mgr.allocate("a", 3)
    mgr.add_request("b", [1])
    mgr.take_step_update()
    mgr.allocate("a", 8)  # appended to row 0 ...
    mgr.free("a")  # ... which is freed ...
    mgr.add_request("c", [7, 7])  # ... and given to c
    mgr.allocate("c", 2)
    assert mgr.row_of("c") == 0
    update = mgr.take_step_update()
    assert as_lists(update.added[0]) == {0: [3]}  # replaces the row fully: no stale append
    assert update.cleared_rows.tolist() == [] and len(update.appended[0]) == 0


def test_admitted_and_freed_in_the_same_step_leaves_no_trace() -> None:
    mgr = make()
    mgr.add_request("a", [1, 2])
    mgr.allocate("a", 2)
    mgr.free("a")
    assert is_empty(mgr.take_step_update())


def test_preempted_and_resumed_in_the_same_step_is_replaced() -> None:
    mgr = make()
    mgr.add_request("a", list(range(6)))
    mgr.allocate("a", 6)
    mgr.mark_computed("a", 6)
    mgr.take_step_update()
    mgr.preempt("a")
    mgr.add_request("a", list(range(6)))
    update = mgr.take_step_update()
    assert as_lists(update.added[0]) == {0: [1]}
    assert len(update.cleared_rows) == 0


def test_fork_adds_the_child_row() -> None:
    mgr = make()
    mgr.add_request("p", list(range(6)))
    mgr.allocate("p", 6)
    mgr.mark_computed("p", 6)
    mgr.take_step_update()
    assert mgr.fork("p", "c") == ([(2, 3)],)
    update = mgr.take_step_update()
    assert as_lists(update.added[0]) == {1: [1, 3]}
    assert len(update.appended[0]) == 0


def test_replayed_updates_rebuild_every_row() -> None:
    """Replay a scripted sequence of steps on a numpy table; compare with block_ids."""
    mgr = KVCacheManager(
        [AllocatorGroupSpec(2, 64), AllocatorGroupSpec(4, 32, sliding_window=6)], 3
    )
    table = [np.zeros((3, 32), np.int32) for _ in range(2)]
    counts = [np.zeros(3, np.int32) for _ in range(2)]

    def replay() -> None:
        update = mgr.take_step_update()
        for g in range(2):
            for row in update.cleared_rows.tolist():
                table[g][row], counts[g][row] = 0, 0
            for row, ids in as_lists(update.added[g]).items():
                table[g][row] = 0
                table[g][row, : len(ids)], counts[g][row] = ids, len(ids)
            for row, ids in as_lists(update.appended[g]).items():
                table[g][row, counts[g][row] : counts[g][row] + len(ids)] = ids
                counts[g][row] += len(ids)
            for row, idx in zip(update.nulled[g].rows.tolist(), update.nulled[g].block_indices):
                table[g][row, idx] = 0
        for req_id in list(mgr._requests):
            row = mgr.row_of(req_id)
            for g, ids in enumerate(mgr.block_ids(req_id)):
                assert table[g][row, : counts[g][row]].tolist() == ids

    prompts = {"a": list(range(30)), "b": list(range(17)), "c": [5] * 11}
    for req_id, prompt in prompts.items():
        mgr.add_request(req_id, prompt)
    for chunk in (5, 7, 1, 9, 3):
        for r in list(mgr._requests):
            n = min(chunk, mgr.num_tokens(r) - mgr.num_computed_tokens(r))
            if n == 0:
                mgr.append_token_ids(r, 1)
                n = 1
            mgr.allocate(r, n)
            mgr.mark_computed(r, n)
        replay()
    mgr.free("b")
    mgr.add_request("d", list(range(17)))
    mgr.allocate("d", 1)
    mgr.preempt("a")
    replay()
    mgr.check_integrity()


def computed(req_ids: str, max_num_reqs: int) -> KVCacheManager:
    """A manager whose requests ``req_ids`` (one letter each) hold 8 computed tokens each (no
    prefix hits between them), their update taken."""
    mgr = make(max_num_reqs=max_num_reqs)
    for i, r in enumerate(req_ids):
        mgr.add_request(r, list(range(10 * i, 10 * i + 8)))
        mgr.allocate(r, 8)
        mgr.mark_computed(r, 8)
    mgr.take_step_update()
    return mgr


def test_batched_allocations_merge_with_every_other_change_of_their_rows() -> None:
    """allocate_many's rows are taken as allocated unless another change reaches them in the
    same step: then they are diffed like any row (each case beside the plain one)."""

    def step(changes: list[str]) -> tuple[dict[int, list[int]], dict[int, list[int]], list[int]]:
        mgr = computed("abcd", max_num_reqs=6)
        if "admit first" in changes:  # a row touched before the batch: diffed, the rest batched
            mgr.add_request("e", list(range(100, 103)))
        mgr.allocate_many(
            ["a", "b", "c"] + (["e"] if "admit first" in changes else []),
            [4, 8, 4] + ([3] if "admit first" in changes else []),
        )
        if "allocate again" in changes:
            mgr.allocate("a", 8)
        if "batched again" in changes:
            mgr.allocate_many(["c", "d"], [8, 4])
        if "free" in changes:
            mgr.free("b")
        if "free and reuse" in changes:
            mgr.free("c")
            mgr.add_request("f", list(range(50, 60)))
            mgr.allocate("f", 10)
        update = mgr.take_step_update()
        assert is_empty(mgr.take_step_update())
        return as_lists(update.appended[0]), as_lists(update.added[0]), update.cleared_rows.tolist()

    assert step([]) == ({0: [9], 1: [10, 11], 2: [12]}, {}, [])
    assert step(["allocate again"]) == ({0: [9, 13], 1: [10, 11], 2: [12]}, {}, [])
    assert step(["batched again"]) == ({0: [9], 1: [10, 11], 2: [12, 13], 3: [14]}, {}, [])
    assert step(["free"]) == ({0: [9], 2: [12]}, {}, [1])
    assert step(["free and reuse"]) == ({0: [9], 1: [10, 11]}, {2: [13, 14, 15]}, [])
    assert step(["admit first"]) == ({0: [9], 1: [10, 11], 2: [12]}, {4: [13]}, [])


def test_diffed_rows_and_a_batch_join_into_one_update() -> None:
    """Rows appended, added and cleared by single calls and a batch of allocate_many in one
    update: each row's net change once, int32 read-only arrays, trusted."""
    mgr = computed("abcde", max_num_reqs=8)
    mgr.allocate("d", 8)  # two blocks appended
    mgr.add_request("f", list(range(100, 106)))  # added
    mgr.free("e")  # cleared (after the admission: f does not take its row)
    mgr.allocate_many(["a", "b", "c", "f"], [4, 8, 4, 6])
    update = mgr.take_step_update()
    row = {r: mgr.row_of(r) for r in "abcdf"}
    appended = update.appended[0]
    assert sorted(appended.rows.tolist()) == sorted(row[r] for r in "abcd")
    assert as_lists(appended) == {r: mgr.block_ids(k)[0][2:] for k, r in row.items() if k != "f"}
    assert as_lists(update.added[0]) == {row["f"]: mgr.block_ids("f")[0]}
    assert len(update.cleared_rows) == 1
    assert update.trusted
    for part in (appended.rows, appended.num_manager_blocks, appended.block_ids):
        assert part.dtype == np.int32 and not part.flags.writeable
        with pytest.raises(ValueError):
            part.flags.writeable = True  # views of an immutable buffer


def check_trusted(update: StepUpdate, num_rows: int, num_blocks: tuple[int, ...]) -> None:
    """What ``trusted=True`` promises: rows in range, listed once per part and disjoint across
    cleared, added and appended; counts >= 0 (>= 1 appended) summing to the ids; ids below the
    pool's size."""
    assert update.trusted
    cleared = update.cleared_rows.tolist()
    assert len(set(cleared)) == len(cleared)
    for g, bound in enumerate(num_blocks):
        added, appended = update.added[g], update.appended[g]
        rows_a, rows_p = added.rows.tolist(), appended.rows.tolist()
        for rows in (cleared, rows_a, rows_p):
            assert all(0 <= r < num_rows for r in rows)
            assert len(set(rows)) == len(rows)
        assert not (set(cleared) & set(rows_a) or set(cleared) & set(rows_p)
                    or set(rows_a) & set(rows_p))
        for part, least in ((added, 0), (appended, 1)):
            counts = part.num_manager_blocks
            assert len(counts) == len(part.rows)
            assert all(c >= least for c in counts.tolist())
            assert int(counts.sum()) == len(part.block_ids)
            assert all(0 <= b < bound for b in part.block_ids.tolist())
            for a in (part.rows, counts, part.block_ids):
                assert a.dtype == np.int32 and not a.flags.writeable


@pytest.mark.parametrize("num_groups", [1, 2])
def test_every_update_keeps_the_trusted_promise(num_groups: int) -> None:
    """Random steps of admissions, finishes, preemptions and (batched or single) allocations:
    every update keeps what ``trusted=True`` promises, and replaying them rebuilds the rows."""
    rng = np.random.default_rng(num_groups)
    specs = [AllocatorGroupSpec(4, 1024), AllocatorGroupSpec(8, 512, sliding_window=16)]
    mgr = KVCacheManager(specs[:num_groups], 16)
    running: list[int] = []
    table: list[dict[int, list[int]]] = [{} for _ in range(num_groups)]
    for step in range(120):
        roll = rng.random()
        prompt = list(range(100 * step, 100 * step + int(rng.integers(1, 9))))
        if roll < 0.25 and len(running) < 14 and mgr.can_admit(prompt):
            mgr.add_request(step, prompt)
            mgr.allocate(step, len(prompt))
            mgr.mark_computed(step, len(prompt))
            running.append(step)
        elif roll < 0.45 and running:
            victim = running.pop(int(rng.integers(len(running))))
            (mgr.free if rng.random() < 0.7 else mgr.preempt)(victim)
        if running and rng.random() < 0.8:
            reqs = [r for r in running if rng.random() < 0.7]
            new = [int(rng.choice([1, 4, 5])) for _ in reqs]
            if reqs and mgr.can_allocate_many(reqs, new):
                if rng.random() < 0.5:
                    mgr.allocate_many(reqs, new)
                else:
                    for r, n in zip(reqs, new):
                        mgr.allocate(r, n)
                mgr.append_token_ids_many(reqs, [[1] * n for n in new])
                mgr.mark_computed_many(reqs, new)
        update = mgr.take_step_update()
        check_trusted(update, 16, tuple(s.num_blocks for s in specs[:num_groups]))
        for g in range(num_groups):
            for r in update.cleared_rows.tolist():
                table[g].pop(r, None)
            table[g].update(as_lists(update.added[g]))
            for r, ids in as_lists(update.appended[g]).items():
                table[g].setdefault(r, []).extend(ids)
            for r, i in zip(update.nulled[g].rows.tolist(),
                            update.nulled[g].block_indices.tolist()):
                table[g][r][i] = 0
        for r in running:
            for g in range(num_groups):
                assert table[g][mgr.row_of(r)] == mgr.block_ids(r)[g], (step, r, g)


def random_steps(mgr: KVCacheManager, seed: int, num_steps: int) -> list[StepUpdate]:
    """``num_steps`` random steps (admissions, frees, preemptions, batched and single
    allocations, sliding windows) on ``mgr``; the update of each."""
    rng = np.random.default_rng(seed)
    running: list[int] = []
    updates = []
    for step in range(num_steps):
        for _ in range(int(rng.integers(0, 3))):
            prompt = list(range(7 * step, 7 * step + int(rng.integers(1, 13))))
            if len(running) < 14 and mgr.can_admit(prompt):
                mgr.add_request(step, prompt)
                mgr.allocate(step, len(prompt))
                mgr.mark_computed(step, len(prompt))
                running.append(step)
                break
        if running and rng.random() < 0.4:
            victim = running.pop(int(rng.integers(len(running))))
            (mgr.free if rng.random() < 0.7 else mgr.preempt)(victim)
        reqs = [r for r in running if rng.random() < 0.7]
        new = [int(rng.choice([1, 3, 9])) for _ in reqs]
        if reqs and mgr.can_allocate_many(reqs, new):
            mgr.allocate_many(reqs, new)
            mgr.append_token_ids_many(reqs, [[1] * n for n in new])
            mgr.mark_computed_many(reqs, new)
        updates.append(mgr.take_step_update())
    return updates


@pytest.mark.parametrize("seed", range(4))
def test_compiled_and_numpy_diffs_give_the_same_updates(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same random steps on a manager whose journal diffs with the compiled loop and on
    one that diffs with numpy: equal updates, array by array, every step."""
    import blocktable._compiled_loader as loader

    module = pytest.importorskip("blocktable._compiled", reason="the compiled part is not built")
    specs = [AllocatorGroupSpec(4, 256), AllocatorGroupSpec(8, 128, sliding_window=16)]
    monkeypatch.setattr(loader, "COMPILED", module)
    compiled = random_steps(KVCacheManager(specs, 16), seed, 80)
    monkeypatch.setattr(loader, "COMPILED", None)
    plain = random_steps(KVCacheManager(specs, 16), seed, 80)
    for step, (a, b) in enumerate(zip(compiled, plain)):
        assert a.trusted and b.trusted
        np.testing.assert_array_equal(a.cleared_rows, b.cleared_rows, err_msg=str(step))
        for g in range(2):
            for part_a, part_b in ((a.added[g], b.added[g]), (a.appended[g], b.appended[g]),
                                   (a.nulled[g], b.nulled[g])):
                for field in dataclasses.fields(part_a):
                    x, y = getattr(part_a, field.name), getattr(part_b, field.name)
                    assert x.dtype == y.dtype == np.int32 and not x.flags.writeable
                    np.testing.assert_array_equal(x, y, err_msg=str(step))


def _random_row_change(state: RowState, rng: np.random.Generator) -> None:
    """Random holders, lengths and ids on some rows of ``state`` (lengths within the arena;
    rows left as they were, freed, re-held, grown or shrunk)."""
    n = state.num_rows
    rows = rng.choice(n, size=int(rng.integers(0, n + 1)), replace=False)
    for row in rows.tolist():
        kind = rng.integers(4)
        if kind == 0:
            state.holder_gen[row] = 0
        elif kind == 1:
            state.holder_gen[row] = int(rng.integers(1, 2**40))
        for g, arena in enumerate(state.blocks):
            if rng.random() < 0.6:
                state.row_len[g, row] = int(rng.integers(0, arena.shape[1] + 1))
            arena[row] = rng.integers(0, 2**31, size=arena.shape[1], dtype=np.int32)


@pytest.mark.parametrize("seed", range(6))
def test_compiled_and_numpy_takes_agree_on_random_row_states(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Journals over random row states (any holders, lengths and ids, not only those the
    allocator makes), one taking with the compiled pass and one with numpy: equal updates and
    equal next starts, array by array, over several takes."""
    import blocktable._compiled_loader as loader

    module = pytest.importorskip("blocktable._compiled", reason="the compiled part is not built")
    rng = np.random.default_rng(seed)
    num_rows, num_groups = int(rng.integers(1, 70)), int(rng.integers(1, 4))
    state = RowState(num_rows, num_groups)
    for g in range(num_groups):
        state.ensure_width(g, int(rng.integers(1, 40)))
    _random_row_change(state, rng)
    monkeypatch.setattr(loader, "COMPILED", module)
    fast = StepJournal(num_groups, state)
    monkeypatch.setattr(loader, "COMPILED", None)
    plain = StepJournal(num_groups, state)
    assert fast._compiled_diff is not None and plain._compiled_diff is None
    start_gen = rng.integers(0, 3, size=num_rows) * state.holder_gen  # some rows unchanged
    start_len = np.minimum(state.row_len, rng.integers(0, 40, size=(num_groups, num_rows)))
    for journal in (fast, plain):  # the same random start
        journal.start_gen[:] = start_gen
        journal.start_len[:] = start_len
    num_ids = 0
    for step in range(5):
        a, b = fast.take((4,) * num_groups), plain.take((4,) * num_groups)
        np.testing.assert_array_equal(a.cleared_rows, b.cleared_rows, err_msg=str(step))
        for g in range(num_groups):
            for part_a, part_b in ((a.added[g], b.added[g]), (a.appended[g], b.appended[g])):
                for field in dataclasses.fields(part_a):
                    x, y = getattr(part_a, field.name), getattr(part_b, field.name)
                    assert x.dtype == y.dtype == np.int32 and not x.flags.writeable
                    np.testing.assert_array_equal(x, y, err_msg=f"{step} {field.name}")
            num_ids += len(a.added[g].block_ids) + len(a.appended[g].block_ids)
        np.testing.assert_array_equal(fast.start_gen, state.holder_gen)
        np.testing.assert_array_equal(plain.start_gen, state.holder_gen)
        np.testing.assert_array_equal(fast.start_len, state.row_len)
        np.testing.assert_array_equal(plain.start_len, state.row_len)
        _random_row_change(state, rng)
    assert num_ids > 0  # (the states made changes to diff)
