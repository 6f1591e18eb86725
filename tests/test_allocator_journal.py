"""take_step_update: how the operations of one step merge into one StepUpdate."""

from __future__ import annotations

import numpy as np
import pytest

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.update import RowBlocks, StepUpdate

# every test here runs with the compiled journal diff and with its Python twin
pytestmark = pytest.mark.usefixtures("native_mode")


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
    """Rows diffed by the few-rows path (appended, added, cleared) and a batch of allocate_many
    in one update: the diffed rows come first in each part, then the batch's, and the facts
    match the arrays."""
    mgr = computed("abcde", max_num_reqs=8)
    mgr.allocate("d", 8)  # diffed: two blocks appended
    mgr.add_request("f", list(range(100, 106)))  # diffed: added
    mgr.free("e")  # diffed: cleared (after the admission: f does not take its row)
    mgr.allocate_many(["a", "b", "c", "f"], [4, 8, 4, 6])  # a, b, c batched
    update = mgr.take_step_update()
    row = {r: mgr.row_of(r) for r in "abcdf"}
    appended = update.appended[0]
    assert appended.rows.tolist() == [row["d"], row["a"], row["b"], row["c"]]
    assert as_lists(appended) == {r: mgr.block_ids(k)[0][2:] for k, r in row.items() if k != "f"}
    assert as_lists(update.added[0]) == {row["f"]: mgr.block_ids("f")[0]}
    assert len(update.cleared_rows) == 1
    assert update.facts.ids_at_most == (mgr.pools[0].num_blocks - 1,)
    assert update.facts.one_block_each == (False,)
    for part in (appended.rows, appended.num_manager_blocks, appended.block_ids):
        assert part.dtype == np.int32 and not part.flags.writeable


def test_updates_state_the_pools_largest_id_as_the_bound_of_their_ids() -> None:
    """The facts bound every id of an update (added and appended) by the pool's largest id,
    without reading the ids: for a batch of many rows (a decode step), for a few diffed rows,
    and for the vectorized path (several groups)."""
    mgr = computed("abcdefghi", max_num_reqs=12)
    mgr.allocate_many(list("abcdefghi"), [4] * 9)  # one block each, nine rows: a batch
    mgr.add_request("k", list(range(200, 203)))
    mgr.allocate("k", 3)
    update = mgr.take_step_update()
    assert update.facts.one_block_each == (True,)
    bound = mgr.pools[0].num_blocks - 1
    assert update.facts.ids_at_most == (bound,)
    assert len(update.appended[0].block_ids) == 9 and len(update.added[0].block_ids) == 1
    assert max(int(update.appended[0].block_ids.max()), int(update.added[0].block_ids.max())) <= bound
    mgr.allocate("a", 8)
    assert mgr.take_step_update().facts.ids_at_most == (bound,)
    two = KVCacheManager([AllocatorGroupSpec(4, 32), AllocatorGroupSpec(8, 16)], 4)
    two.add_request("a", list(range(20)))
    two.allocate("a", 20)
    update = two.take_step_update()
    assert update.facts.ids_at_most == (31, 15)
    assert all(int(p.block_ids.max()) <= b for p, b in zip(update.added, (31, 15), strict=True))


def test_a_step_that_is_one_large_batch_hands_out_its_arrays() -> None:
    """A step whose only change is one allocate_many of many rows (an engine's decode step) is
    that call's rows, counts and ids, in its order, read-only, with facts that say whether each
    row gained one block."""
    mgr = KVCacheManager([AllocatorGroupSpec(4, 64)], 12)
    reqs = list("abcdefghi")  # more rows than the journal diffs one by one
    for i, r in enumerate(reqs):
        mgr.add_request(r, list(range(10 * i, 10 * i + 8)))
        mgr.allocate(r, 8)
        mgr.mark_computed(r, 8)
    mgr.take_step_update()
    for new_tokens, one_each in (([4, 8] * 4 + [4], False), ([4] * 9, True)):
        held = {r: len(mgr.block_ids(r)[0]) for r in reqs}
        mgr.allocate_many(reqs, new_tokens)
        update = mgr.take_step_update()
        part = update.appended[0]
        assert part.rows.tolist() == [mgr.row_of(r) for r in reqs]
        assert as_lists(part) == {mgr.row_of(r): mgr.block_ids(r)[0][held[r]:] for r in reqs}
        assert not len(update.cleared_rows) and not len(update.added[0]) and not len(update.nulled[0])
        assert update.facts.one_block_each == (one_each,)
        assert update.facts.ids_at_most == (63,)
        assert update.facts.appends_only == one_each
        for a in (part.rows, part.num_manager_blocks, part.block_ids):
            assert a.dtype == np.int32 and not a.flags.writeable
            with pytest.raises(ValueError):
                a.flags.writeable = True  # views of an immutable buffer: the facts hold
        mgr.append_token_ids_many(reqs, [[1] * n for n in new_tokens])
        mgr.mark_computed_many(reqs, new_tokens)


@pytest.mark.parametrize("num_groups", [1, 2])
def test_a_step_that_changed_nothing_is_one_immutable_empty_update(num_groups: int) -> None:
    """Steps without a row change hand out the same empty update, with the facts the diff
    would state (one block each, nothing added; appends only with one group), and the step
    after one still sees its changes."""
    specs = [AllocatorGroupSpec(4, 32), AllocatorGroupSpec(8, 16)][:num_groups]
    mgr = KVCacheManager(specs, 4)
    mgr.add_request("a", list(range(6)))
    mgr.allocate("a", 6)
    mgr.take_step_update()
    first, second = mgr.take_step_update(), mgr.take_step_update()
    assert first is second and is_empty(first)
    assert first.allocator_block_sizes == mgr.block_sizes
    assert first.facts.one_block_each == (True,) * num_groups
    assert first.facts.largest_added_count == (-1,) * num_groups
    assert first.facts.appends_only == (num_groups == 1)
    assert first.facts.ids_at_most == tuple(s.num_blocks - 1 for s in specs)
    assert not first.cleared_rows.flags.writeable
    mgr.mark_computed("a", 6)
    held = [len(ids) for ids in mgr.block_ids("a")]
    mgr.allocate("a", 4)  # 10 tokens: one more block in every group
    update = mgr.take_step_update()
    assert [as_lists(p) for p in update.appended] == [
        {mgr.row_of("a"): ids[n:]} for ids, n in zip(mgr.block_ids("a"), held, strict=True)]
    assert all(len(ids) == n + 1 for ids, n in zip(mgr.block_ids("a"), held, strict=True))


def test_a_lone_batch_of_a_few_rows_is_handed_out_as_allocated() -> None:
    """A step whose only change is one allocate_many, however few its rows, is that call's own
    blocks: the update holds the very object the call returned, nothing diffed or copied."""
    mgr = KVCacheManager([AllocatorGroupSpec(4, 64)], 4)
    for i, r in enumerate("abc"):
        mgr.add_request(r, list(range(10 * i, 10 * i + 4)))
        mgr.allocate(r, 4)
        mgr.mark_computed(r, 4)
    mgr.take_step_update()
    [blocks] = mgr.allocate_many(["a", "c"], [4, 4])
    update = mgr.take_step_update()
    assert update.appended[0] is blocks
    assert as_lists(blocks) == {mgr.row_of(r): mgr.block_ids(r)[0][1:] for r in "ac"}
    assert update.facts.appends_only and not len(update.cleared_rows)
    assert is_empty(mgr.take_step_update())


@pytest.mark.parametrize("few_rows", [128, 0])  # the per-row diff, and the vectorized one
def test_appends_only_says_exactly_whether_one_block_per_row_is_the_whole_update(
        few_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The captured step stages an update whose facts say ``appends_only`` by its decode lane
    alone (no look at cleared, added or nulled rows): every path of the journal must set it
    exactly when the only change is appended rows gaining one block each."""
    from blocktable.allocator import journal

    monkeypatch.setattr(journal, "_FEW_ROWS", few_rows)
    rng = np.random.default_rng(few_rows)
    mgr = KVCacheManager([AllocatorGroupSpec(4, 1024)], 16)
    running: list[int] = []
    seen = set()
    for step in range(120):
        roll = rng.random()
        prompt = list(range(100 * step, 100 * step + int(rng.integers(1, 9))))
        if roll < 0.25 and len(running) < 14 and mgr.can_admit(prompt):  # admit one
            mgr.add_request(step, prompt)
            mgr.allocate(step, len(prompt))
            running.append(step)
        elif roll < 0.45 and running:  # finish one
            mgr.free(running.pop(int(rng.integers(len(running)))))
        if running and rng.random() < 0.8:  # decode: some rows cross a block boundary
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
        part = update.appended[0]
        want = bool(len(part.rows)) and not (
            len(update.cleared_rows) or len(update.added[0]) or len(update.nulled[0])
        ) and all(n == 1 for n in part.num_manager_blocks.tolist())
        if not len(part.rows) and not len(update.cleared_rows) and not len(update.added[0]):
            want = update.facts.appends_only  # an empty update: either way stages nothing
        assert update.facts.appends_only == want, step
        seen.add(want)
    assert seen == {True, False}  # both kinds of step happened


def test_admissions_and_finishes_keep_one_packed_buffer_until_read(
        native_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the compiled diff, a step that admits and finishes requests hands out its update
    as one packed buffer; reading a field cuts every array from it, and they equal what the
    Python diff builds for the same step: int32, read-only, the same facts. Copies, pickles and
    replace() of it are ordinary updates holding those arrays."""
    import copy
    import dataclasses
    import pickle

    import blocktable._native_loader as loader
    from blocktable.update import PackedStepUpdate

    def step() -> StepUpdate:
        mgr = make(max_num_reqs=6)
        for i, r in enumerate("abcd"):
            mgr.add_request(r, list(range(10 * i, 10 * i + 6)))
            mgr.allocate(r, 6)
        mgr.take_step_update()
        mgr.free("b")
        mgr.free("c")  # cleared (e takes the other freed row: added)
        mgr.add_request("e", list(range(50, 59)))
        mgr.allocate("e", 9)
        mgr.mark_computed("a", 6)
        mgr.allocate("a", 4)  # appended: two blocks
        return mgr.take_step_update()

    update = step()
    monkeypatch.setattr(loader, "NATIVE", None)
    twin = step()
    assert type(twin) is StepUpdate
    fields = ("cleared_rows", "added", "appended", "nulled")
    if native_mode == "native":
        assert type(update) is PackedStepUpdate
        assert not set(fields) & update.__dict__.keys()  # nothing cut yet
    assert update.facts == twin.facts and update.allocator_block_sizes == (4,)

    def arrays(u: StepUpdate) -> list[np.ndarray]:
        return [u.cleared_rows, *(a for part in (u.added[0], u.appended[0])
                                  for a in (part.rows, part.num_manager_blocks, part.block_ids)),
                u.nulled[0].rows, u.nulled[0].block_indices]

    got, want = arrays(update), arrays(twin)
    assert [len(a) for a in got] == [len(a) for a in want]
    assert all(len(a) for a in got[:7])  # every part of the update is there
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.int32 and not a.flags.writeable
    for other in (copy.copy(update), pickle.loads(pickle.dumps(update)),
                  dataclasses.replace(update)):
        assert other.facts is None  # checked in full by whoever applies it
        for a, b in zip(arrays(other), got, strict=True):
            np.testing.assert_array_equal(a, b)
    assert update == copy.copy(update) and copy.copy(update) == update
