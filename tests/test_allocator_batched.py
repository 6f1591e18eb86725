"""Batched calls: the same results as the per-request calls, and bad input changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from test_allocator_snapshot import full_state

from blocktable.allocator import (
    AllocatorGroupSpec,
    KVCacheManager,
    OutOfBlocksError,
    OutOfRowsError,
)

GROUPS = [AllocatorGroupSpec(4, 40), AllocatorGroupSpec(8, 16, sliding_window=12)]


def make(groups: list[AllocatorGroupSpec] = GROUPS, **kwargs: object) -> KVCacheManager:
    return KVCacheManager(groups, 6, max_model_len=80, **kwargs)  # type: ignore[arg-type]


def observable(mgr: KVCacheManager) -> tuple:
    mgr._settle()  # (apply the per-request calls recorded, before private state is read)
    reqs = {r: (mgr.block_ids(r), mgr.num_computed_tokens(r), mgr.row_of(r)) for r in mgr._requests}
    pools = [(p.eviction_order(), p.num_cached_blocks, p.ref_counts.tolist()) for p in mgr.pools]
    return reqs, pools, mgr.prefix_cache_stats


def two_running(num_allocated: int) -> KVCacheManager:
    """:func:`make` with requests "a" (tokens 0..23) and "b" (100..123) admitted, each with
    ``num_allocated`` tokens' worth of blocks."""
    mgr = make()
    for req_id, base in (("a", 0), ("b", 100)):
        mgr.add_request(req_id, list(range(base, base + 24)))
        mgr.allocate(req_id, num_allocated)
    return mgr


def as_lists(update: object) -> tuple:
    out = [update.cleared_rows.tolist()]  # type: ignore[attr-defined]
    for blocks in (*update.added, *update.appended):  # type: ignore[attr-defined]
        out.append((blocks.rows.tolist(), blocks.num_manager_blocks.tolist(), blocks.block_ids.tolist()))
    for entries in update.nulled:  # type: ignore[attr-defined]
        out.append((entries.rows.tolist(), entries.block_indices.tolist()))
    return tuple(out)


@pytest.mark.parametrize("num_groups", [1, 2])  # one group takes the paths without group loops
@pytest.mark.parametrize("seed", range(6))
def test_batched_calls_equal_per_request_calls(seed: int, num_groups: int) -> None:
    rng = np.random.default_rng(seed)
    groups = GROUPS[:num_groups]
    batched, single = make(groups), make(groups)
    base = rng.integers(0, 4, 60).tolist()
    live: dict[int, list[int]] = {}
    next_id = 0
    for _step in range(40):
        arrivals = []
        while len(live) + len(arrivals) < 6 and rng.random() < 0.6:
            cut = int(rng.integers(0, 40))
            arrivals.append(
                (next_id, base[:cut] + rng.integers(0, 4, int(rng.integers(1, 9))).tolist())
            )
            next_id += 1
        if arrivals:
            ids, prompts = [a for a, _ in arrivals], [p for _, p in arrivals]
            got = batched.add_requests(ids, prompts)
            assert got == [single.add_request(r, p) for r, p in arrivals]
            live.update(arrivals)
        sched, nums = [], []
        for r, tokens in live.items():
            done = batched.num_computed_tokens(r)
            n = min(len(tokens) - done, int(rng.integers(1, 10)))
            if n and done + n + 3 <= 80:
                sched.append(r)
                nums.append(n + int(rng.integers(0, 4)))  # with lookahead
        fits = batched.can_allocate_many(sched, nums)
        if fits:
            new = batched.allocate_many(sched, nums)
            per = [single.allocate(r, n) for r, n in zip(sched, nums)]
            for g in range(num_groups):
                assert new[g].block_ids.tolist() == [b for p in per for b in p[g]]
                assert new[g].num_manager_blocks.tolist() == [len(p[g]) for p in per if p[g]]
            computed = [
                min(n, len(live[r]) - batched.num_computed_tokens(r)) for r, n in zip(sched, nums)
            ]
            batched.mark_computed_many(sched, computed)
            for r, n in zip(sched, computed):
                single.mark_computed(r, n)
        else:
            with pytest.raises(OutOfBlocksError):
                batched.allocate_many(sched, nums)
        assert as_lists(batched.take_step_update()) == as_lists(single.take_step_update())
        finished = [
            r for r in live if batched.num_computed_tokens(r) == len(live[r]) and rng.random() < 0.4
        ]
        batched.free_many(finished)
        for r in finished:
            single.free(r)
            del live[r]
        growing = [r for r in live if batched.num_computed_tokens(r) == len(live[r])]
        tokens = rng.integers(0, 4, (len(growing), 2))
        if growing and all(len(live[r]) + 2 <= 80 for r in growing):
            batched.append_token_ids_many(growing, tokens)
            for r, t in zip(growing, tokens.tolist()):
                single.append_token_ids(r, t)
                live[r] += t
        assert observable(batched) == observable(single)
    batched.check_integrity()
    single.check_integrity()


def running_pair() -> KVCacheManager:
    mgr = make()
    mgr.add_requests(["a", "b"], [list(range(20)), list(range(10, 25))])
    mgr.allocate_many(["a", "b"], [12, 15])
    mgr.mark_computed_many(["a", "b"], [12, 15])
    mgr.preempt("b")
    mgr.add_request("c", [3, 3, 3])
    mgr.take_step_update()
    return mgr


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda m: m.add_requests(["x", "x"], [[1], [2]]),
            ValueError,
            "req_ids holds a request twice: 'x'",
        ),
        (
            lambda m: m.add_requests(["x", "a"], [[1], [2]]),
            ValueError,
            "request 'a' is already running",
        ),
        (
            lambda m: m.add_requests(["x", "y"], [[1]]),
            ValueError,
            "prompts has 1 entries but req_ids has 2",
        ),
        (
            lambda m: m.add_requests(["x", "y"], [[1], [2.5]]),
            TypeError,
            "request 'y' must hold int64",
        ),
        (lambda m: m.add_requests(["x", "y"], [[1], []]), ValueError, "request 'y' is empty"),
        (lambda m: m.add_requests(["x", "y"], [[1], [1] * 81]), ValueError, "prompt of 81 tokens"),
        (
            lambda m: m.add_requests(["x"], [[1]], ["ns", "ns"]),
            ValueError,
            "cache_namespaces has 2",
        ),
        (lambda m: m.add_requests(["x"], [[1]], [1.5]), TypeError, "cache_namespace"),
        (
            lambda m: m.add_requests([f"n{i}" for i in range(5)], [[1]] * 5),
            OutOfRowsError,
            "5 requests, 4 free rows",
        ),
        (lambda m: m.add_requests("xy", [[1], [2]]), TypeError, "req_ids must be a list"),
        (lambda m: m.allocate_many(["a", "zz"], [1, 1]), KeyError, "unknown request 'zz'"),
        (lambda m: m.allocate_many(["a", "b"], [1, 1]), KeyError, "request 'b' is preempted"),
        (lambda m: m.allocate_many(["a", "c", "a"], [1, 1, 1]), ValueError, "twice: 'a'"),
        (
            lambda m: m.allocate_many(["a", "c"], [1]),
            ValueError,
            "num_new_tokens has 1 entries but req_ids has 2",
        ),
        (lambda m: m.allocate_many(["a", "c"], [1, -1]), ValueError, "must be >= 0"),
        (
            lambda m: m.allocate_many(["a", "c"], [1, 1.0]),
            TypeError,
            "num_new_tokens entries must be an int",
        ),
        (
            lambda m: m.allocate_many(["a", "c"], np.array([1.0, 2.0])),
            TypeError,
            "1-D integer array",
        ),
        (
            lambda m: m.allocate_many(["c", "a"], [1, 70]),
            ValueError,
            "request 'a': allocation of 82 tokens",
        ),
        (
            lambda m: m.allocate_many(["c", "a"], [60, 60]),
            OutOfBlocksError,
            "2 requests need 15 new blocks in group 1, 13 free",
        ),
        (
            lambda m: m.mark_computed_many(["a", "c"], [0, 4]),
            ValueError,
            "request 'c': cannot mark 4",
        ),
        (lambda m: m.mark_computed_many(["a", "a"], [0, 0]), ValueError, "twice"),
        (lambda m: m.mark_computed_many(["a"], [1, 2]), ValueError, "num_tokens has 2 entries"),
        (lambda m: m.free_many(["a", "zz"]), KeyError, "unknown request 'zz'"),
        (lambda m: m.rows_of(["a", "zz"]), KeyError, "unknown request 'zz'"),
        (lambda m: m.rows_of(["c", "b"]), KeyError, "request 'b' is preempted"),
        (lambda m: m.rows_of(["c", "a", "c"]), ValueError, "twice"),
        (lambda m: m.rows_of("ac"), TypeError, "req_ids must be a list"),
        (lambda m: m.rows_of([["a"]]), TypeError, "req_ids entries"),
        (lambda m: m.free_many(["a", "a"]), ValueError, "twice"),
        (lambda m: m.free_many(["b", "b"]), ValueError, "twice"),
        (
            lambda m: m.append_token_ids_many(["a", "zz"], [[1], [2]]),
            KeyError,
            "unknown request 'zz'",
        ),
        (
            lambda m: m.append_token_ids_many(["a", "c"], [[1]]),
            ValueError,
            "token_ids has 1 entries",
        ),
        (
            lambda m: m.append_token_ids_many(["a", "c"], [[1], [1] * 78]),
            ValueError,
            "sequence of 81",
        ),
        (lambda m: m.append_token_ids_many(["a", "c"], [[1], ["x"]]), TypeError, "request 'c'"),
        (
            lambda m: m.append_token_ids_many(["a", "c"], np.ones((3, 2), np.int64)),
            ValueError,
            "has 3 entries",
        ),
    ],
)
def test_bad_batched_calls_change_nothing(call: object, error: type, match: str) -> None:
    mgr = running_pair()
    before = full_state(mgr)
    with pytest.raises(error, match=match):
        call(mgr)  # type: ignore[operator]
    assert full_state(mgr) == before
    mgr.check_integrity()


def test_bad_entry_of_mark_computed_many_undoes_the_entries_before_it() -> None:
    # mark_computed_many counts while it checks: an entry after a good one must undo it
    mgr = running_pair()
    mgr.allocate_many(["a"], [8])
    mgr.take_step_update()
    before = full_state(mgr)
    with pytest.raises(ValueError, match="request 'c': cannot mark 4 tokens computed, only 3"):
        mgr.mark_computed_many(["a", "c"], [8, 4])
    assert full_state(mgr) == before
    mgr.mark_computed_many(["a", "c"], [8, 0])
    assert (mgr.num_computed_tokens("a"), mgr.num_computed_tokens("c")) == (20, 0)
    mgr.check_integrity()


def test_batched_free_of_requests_sharing_blocks_queues_tails_first() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 16)], 4)
    mgr.add_request("a", list(range(12)))
    mgr.allocate("a", 12)
    mgr.mark_computed("a", 12)
    assert mgr.add_requests(["b", "c"], [[*range(8), 50, 51], [*range(8), 60]]) == [8, 8]
    mgr.allocate_many(["b", "c"], [2, 1])
    mgr.mark_computed_many(["b", "c"], [2, 1])
    single = KVCacheManager([AllocatorGroupSpec(4, 16)], 4)
    single.add_request("a", list(range(12)))
    single.allocate("a", 12)
    single.mark_computed("a", 12)
    for r, p in (("b", [*range(8), 50, 51]), ("c", [*range(8), 60])):
        single.add_request(r, p)
    single.allocate("b", 2)
    single.allocate("c", 1)
    mgr.free_many(["c", "a", "b"])
    for r in ("c", "a", "b"):
        single.free(r)
    assert mgr.pools[0].eviction_order() == single.pools[0].eviction_order()
    mgr.check_integrity()


def test_batched_calls_naming_the_last_calls_requests_see_who_left_and_came_back() -> None:
    """Consecutive batched calls naming the same requests reuse the lookup of their states and
    rows; a request freed (or preempted) and added again in between is a new request."""
    batched = KVCacheManager([AllocatorGroupSpec(4, 64)], 4)
    plain = KVCacheManager([AllocatorGroupSpec(4, 64)], 4)
    for mgr in (batched, plain):
        mgr.add_requests(["a", "b"], [list(range(10)), list(range(20, 29))])
    batched.allocate_many(["a", "b"], [10, 9])
    batched.mark_computed_many(["a", "b"], [10, 9])
    for r, n in (("a", 10), ("b", 9)):
        plain.allocate(r, n)
        plain.mark_computed(r, n)
    ids = ["a", "b"]
    for k, leave in enumerate((KVCacheManager.free, KVCacheManager.preempt)):
        prompt = list(range(100 * k + 40, 100 * k + 45))
        batched.append_token_ids_many(ids, np.array([[7], [8]]))
        leave(batched, "a")  # "a" comes back in another row with another prompt
        batched.add_request("c", list(range(50, 54)))
        batched.add_request("a", prompt)
        batched.allocate_many(ids, [5, 1])
        batched.mark_computed_many(ids, [5, 1])
        for r, tokens in (("a", [7]), ("b", [8])):
            plain.append_token_ids(r, tokens)
        leave(plain, "a")
        plain.add_request("c", list(range(50, 54)))
        plain.add_request("a", prompt)
        for r, n in (("a", 5), ("b", 1)):
            plain.allocate(r, n)
            plain.mark_computed(r, n)
        for r in ("a", "b", "c"):
            assert batched.row_of(r) == plain.row_of(r)
            assert batched.block_ids(r) == plain.block_ids(r)
            assert batched.num_computed_tokens(r) == plain.num_computed_tokens(r)
        batched.free("c")
        plain.free("c")
        batched.check_integrity()
    batched.mark_computed_many(ids, [0, 0])
    batched.free("a")
    with pytest.raises(KeyError, match="unknown request 'a'"):
        batched.mark_computed_many(ids, [0, 0])


def test_one_admission_call_takes_shared_free_cached_blocks_out_of_the_queue_once() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 16)], 4)
    mgr.add_request("a", list(range(12)))
    mgr.allocate("a", 12)
    mgr.mark_computed("a", 12)
    mgr.free("a")  # its three blocks stay cached, in the free queue
    num_free = mgr.num_free_blocks()
    assert mgr.add_requests(["b", "c"], [list(range(12)), list(range(9))]) == [8, 8]
    shared = mgr.block_ids("b")[0]
    assert shared == mgr.block_ids("c")[0] and len(shared) == 2
    assert [mgr.pools[0].ref_count(b) for b in shared] == [2, 2]
    assert mgr.num_free_blocks() == num_free - 2  # each left the queue once
    assert not set(shared) & set(mgr.pools[0].eviction_order())
    mgr.check_integrity()
    mgr.free_many(["b", "c"])
    assert mgr.num_free_blocks() == num_free
    mgr.check_integrity()


@pytest.mark.parametrize("num_groups", [1, 2])
def test_batched_calls_with_no_requests_change_nothing(num_groups: int) -> None:
    """A step without arrivals, decodes or finished requests passes empty lists to every
    batched call: each returns its empty result and nothing changes."""
    mgr = make(GROUPS[:num_groups])
    mgr.add_request("a", list(range(9)))
    mgr.allocate("a", 9)
    mgr.take_step_update()
    before = observable(mgr)
    assert mgr.add_requests([], []) == []
    assert mgr.add_requests([], [], []) == []
    assert all(len(blocks.rows) == 0 for blocks in mgr.allocate_many([], []))
    assert mgr.can_allocate_many([], [])
    mgr.mark_computed_many([], [])
    mgr.append_token_ids_many([], [])
    mgr.append_token_ids_many([], np.zeros((0, 3), dtype=np.int64))
    mgr.free_many([])
    assert observable(mgr) == before
    update = mgr.take_step_update()
    assert all(len(part) == 0 for part in as_lists(update)[0:1])
    assert as_lists(update)[1:] == tuple(([], [], []) for _ in range(2 * num_groups)) + tuple(
        ([], []) for _ in range(num_groups)
    )
    mgr.check_integrity()


def test_token_ids_past_the_arena_move_to_a_buffer_and_batched_appends_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sequences longer than the token arena's rows hold move to buffers of their own; the
    batched append (one scatter for arena rows, per request otherwise) and the per-request
    one keep every request's token ids equal to a plain list, and registration reads them."""
    from blocktable.allocator import rowstate

    monkeypatch.setattr(rowstate, "_MIN_TOKEN_WIDTH", 4)
    monkeypatch.setattr(rowstate, "TOKEN_ROW_CAP", 40)
    rng = np.random.default_rng(0)
    mgr = KVCacheManager([AllocatorGroupSpec(4, 200)], 6)
    model: dict[str, list[int]] = {}
    for i, n in enumerate([3, 9, 30]):  # the last one starts outside the arena
        prompt = rng.integers(0, 100, n).tolist()
        mgr.add_request(f"r{i}", prompt)
        model[f"r{i}"] = prompt
    for step in range(14):  # 3 + 14 * 3 > 40: every sequence leaves the arena at some step
        ids = list(model)
        block = rng.integers(0, 100, (len(ids), 3))
        if step % 3 == 2:
            for r, new in zip(ids, block.tolist()):
                mgr.append_token_ids(r, new)
        else:
            mgr.append_token_ids_many(ids, block)
        for r, new in zip(ids, block.tolist()):
            model[r] += new
        mgr._settle()  # (apply the per-request calls recorded, before private state is read)
        for r in ids:
            assert mgr._requests[r].token_ids() == model[r]
            n = len(model[r])
            mgr.allocate(r, n - mgr.num_computed_tokens(r))
        mgr.mark_computed_many(ids, [len(model[r]) - mgr.num_computed_tokens(r) for r in ids])
        mgr.check_integrity()  # the index holds each full block under the request's tokens
    assert not mgr._row_state.in_arena[[mgr.row_of(r) for r in model]].any()  # all moved


def test_a_pickled_manager_goes_on_exactly_as_the_original() -> None:
    """Memoryviews of the row arrays do not pickle: they are rebuilt on load, and the copy
    (rows, token arena, journal, key chains) then behaves exactly as the original."""
    import pickle

    rng = np.random.default_rng(3)
    mgr = make(GROUPS[:1])
    for i in range(3):
        mgr.add_request(f"r{i}", rng.integers(0, 5, 9).tolist())
        mgr.allocate(f"r{i}", 9)
    mgr.mark_computed_many(["r0", "r1"], [9, 9])
    copy = pickle.loads(pickle.dumps(mgr))
    prompt = rng.integers(0, 5, 12).tolist()
    for m in (mgr, copy):
        m.append_token_ids_many(["r0", "r1"], np.array([[1, 2, 3], [4, 5, 6]]))
        m.allocate_many(["r0", "r1", "r2"], [3, 3, 9])
        m.mark_computed_many(["r0", "r1", "r2"], [3, 3, 9])
        m.free_many(["r1"])
        m.add_request("r3", prompt)
    assert observable(mgr) == observable(copy)
    assert as_lists(mgr.take_step_update()) == as_lists(copy.take_step_update())
    assert mgr._requests["r0"].token_ids() == copy._requests["r0"].token_ids()
    copy.check_integrity()


@pytest.mark.parametrize(
    "probe",
    [
        lambda m: m.lookup_prefix(list(range(12))),
        lambda m: m.num_cached_blocks(),
        lambda m: m.num_free_blocks(1),
        lambda m: m.num_computed_tokens("a"),
        lambda m: m.block_ids("a"),
        lambda m: m.pools[1].eviction_order(),
        lambda m: m.prefix_cache.num_query_tokens,
        lambda m: as_lists(m.take_step_update()),
        lambda m: m.fork("b", "c"),
        lambda m: (m.free("a"), observable(m)),
        lambda m: (m.append_token_ids("a", [1, 2]), m.num_tokens("a")),
        lambda m: m.can_allocate("a", 4),
    ],
)
def test_per_request_marks_are_applied_before_the_next_call(probe: object) -> None:
    """mark_computed is recorded and applied by the next call of any other method: whatever
    that call reads or changes sees the marks applied, in call order, exactly as the batched
    call leaves them (a request marked twice applies its first mark first)."""
    pair = []
    for per_request in (True, False):
        mgr = two_running(24)
        if per_request:
            mgr.mark_computed("a", 8)
            mgr.mark_computed("b", 24)
            mgr.mark_computed("a", 16)
        else:
            mgr.mark_computed_many(["a", "b"], [8, 24])
            mgr.mark_computed_many(["a"], [16])
        pair.append((probe(mgr), observable(mgr)))  # type: ignore[operator]
    assert pair[0][0] == pair[1][0]
    assert pair[0][1] == pair[1][1]


# per-request calls and the batched calls they stand for, in order
CALL_SEQUENCES = [
    [("append", "a", [1, 2]), ("append", "b", [3]), ("append", "a", [4, 5])],
    [("append", "a", [1] * 8), ("append", "b", [2] * 8), ("mark", "a", 20), ("free", "b", None)],
    [("free", "b", None), ("free", "a", None)],
    [("mark", "a", 16), ("free", "b", None), ("append", "a", 7), ("mark", "a", 8)],
]


@pytest.mark.parametrize("calls", CALL_SEQUENCES)
@pytest.mark.parametrize(
    "probe",
    [
        observable,
        lambda m: as_lists(m.take_step_update()),
        lambda m: m.add_request("c", list(range(24))),
        lambda m: "a" in m and m.num_tokens("a"),
        lambda m: m.free_many([r for r in ("a", "b") if r in m]),
    ],
)
def test_per_request_calls_are_applied_as_the_batched_calls(calls: list, probe: object) -> None:
    """append_token_ids, free and mark_computed are recorded and applied by the next call of
    another method or kind (or of the same kind on the same request): every call after sees
    what the batched calls, made one by one, leave."""
    pair = []
    for per_request in (True, False):
        mgr = two_running(32)
        for kind, req_id, arg in calls:
            if kind == "append":
                (mgr.append_token_ids if per_request else mgr.append_token_ids_many)(
                    *((req_id, arg) if per_request else ([req_id], [arg])))
            elif kind == "free":
                mgr.free(req_id) if per_request else mgr.free_many([req_id])
            else:
                (mgr.mark_computed if per_request else mgr.mark_computed_many)(
                    *((req_id, arg) if per_request else ([req_id], [arg])))
        pair.append((probe(mgr), observable(mgr)))  # type: ignore[operator]
        mgr.check_integrity()
    assert pair[0] == pair[1]


def test_a_recorded_append_keeps_a_copy_of_its_array() -> None:
    """A recorded append holds a copy of an array: the caller may reuse the array before the
    append is applied."""
    mgr = make()
    mgr.add_request("a", list(range(20)))
    mgr.add_request("b", [7] * 20)
    sampled = np.array([9], dtype=np.int64)
    mgr.append_token_ids("a", sampled)  # recorded, with a copy of the array
    sampled[0] = 10
    mgr.append_token_ids("b", sampled)
    assert mgr.num_tokens("a") == 21  # (applied)
    assert mgr._requests["a"].token_ids()[-1] == 9 and mgr._requests["b"].token_ids()[-1] == 10
    mgr.check_integrity()


def test_a_bad_per_request_append_or_free_raises_at_once_and_records_nothing() -> None:
    mgr = make()
    mgr.add_request("a", list(range(24)))
    mgr.append_token_ids("a", [1, 2])
    with pytest.raises(TypeError, match="token_ids of request 'a' must hold int64"):
        mgr.append_token_ids("a", [1.5])
    with pytest.raises(ValueError, match="max_model_len"):
        mgr.append_token_ids("a", list(range(60)))  # 26 + 60 > 80
    with pytest.raises(KeyError, match="unknown request 'z'"):
        mgr.append_token_ids("z", [1])
    assert mgr.num_tokens("a") == 26  # the first append only
    mgr.free("a")
    with pytest.raises(KeyError, match="unknown request 'a'"):
        mgr.free("a")  # twice
    with pytest.raises(KeyError, match="unknown request 'a'"):
        mgr.append_token_ids("a", [1])
    assert "a" not in mgr and mgr.num_free_rows == 6
    mgr.check_integrity()


def test_a_bad_per_request_mark_raises_at_once_and_records_nothing() -> None:
    mgr = make()
    mgr.add_request("a", list(range(24)))
    mgr.allocate("a", 16)
    mgr.mark_computed("a", 4)
    with pytest.raises(ValueError, match="has blocks for 16"):
        mgr.mark_computed("a", 13)  # 17 tokens computed, blocks for 16
    with pytest.raises(ValueError, match="only 24 token ids are known"):
        mgr.mark_computed("a", 25)
    with pytest.raises(KeyError, match="unknown request 'z'"):
        mgr.mark_computed("z", 1)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        mgr.mark_computed("a", -1)
    assert mgr.num_computed_tokens("a") == 4  # the first mark only
    mgr.mark_computed("a", 12)
    assert mgr.num_computed_tokens("a") == 16


@pytest.mark.parametrize(
    "req_id, num_new_tokens",
    [
        ("zz", 4),  # unknown
        ("b", 4),  # preempted
        (["a"], 4),  # not an id
        (True, 4),
        ("a", -1),
        ("a", True),
        ("a", 2.0),
        ("a", 69),  # past max_model_len
        ("a", 2**64),  # past any int64 count
        ("c", 76),  # with most blocks taken (below): more than are free
    ],
)
def test_a_bad_per_request_allocate_raises_as_the_batched_call_and_changes_nothing(
    req_id: object, num_new_tokens: object
) -> None:
    """``allocate`` works on its one request by itself; its errors are ``allocate_many``'s."""
    errors = []
    for call in ("allocate", "allocate_many"):
        mgr = running_pair()
        mgr.add_request("d", list(range(100, 180)))
        mgr.allocate("d", 80)
        before = full_state(mgr)
        args = (req_id, num_new_tokens) if call == "allocate" else ([req_id], [num_new_tokens])
        with pytest.raises((KeyError, TypeError, ValueError, OutOfBlocksError)) as info:
            getattr(mgr, call)(*args)
        errors.append((info.type, str(info.value)))
        assert full_state(mgr) == before
        mgr.check_integrity()
    assert errors[0] == errors[1]


@pytest.mark.parametrize("num_groups", [1, 2])
def test_per_request_allocate_of_any_integer_count_equals_the_batched_call(
    num_groups: int,
) -> None:
    rng = np.random.default_rng(num_groups)
    one, many = make(GROUPS[:num_groups]), make(GROUPS[:num_groups])
    for mgr in (one, many):
        mgr.add_requests(["a", "b"], [list(range(30)), list(range(5, 17))])
    for _ in range(12):
        req_id = ["a", "b"][int(rng.integers(0, 2))]
        count = int(rng.integers(0, 9))
        kind = [int, np.int64, np.int32][int(rng.integers(0, 3))]
        got = one.allocate(req_id, kind(count))
        want = many.allocate_many([req_id], [count])
        assert got == tuple(part.block_ids.tolist() for part in want)
        for mgr in (one, many):
            mgr.mark_computed(req_id, min(count, mgr.num_tokens(req_id)
                                          - mgr.num_computed_tokens(req_id)))
        assert observable(one) == observable(many)
        assert as_lists(one.take_step_update()) == as_lists(many.take_step_update())


@pytest.mark.parametrize("seed", range(4))
def test_rows_of_equals_row_of_with_per_request_calls_recorded(seed: int) -> None:
    """The batched look-up settles the per-request calls recorded before it (a recorded
    free makes the request unknown), then answers what row_of answers, in the order asked."""
    rng = np.random.default_rng(seed)
    mgr = KVCacheManager([AllocatorGroupSpec(4, 64)], 8)
    live: list[int] = []
    for step in range(30):
        arrivals = [100 * step + i for i in range(int(rng.integers(0, 8 - len(live) + 1)))]
        mgr.add_requests(arrivals, [rng.integers(0, 9, int(rng.integers(1, 12))) for _ in arrivals])
        live += arrivals
        for r in [r for r in live if rng.random() < 0.3]:
            mgr.free(r)  # recorded, applied by the next call
            live.remove(r)
            with pytest.raises(KeyError, match=f"unknown request {r}"):
                mgr.rows_of([*live, r])
        asked = rng.permutation(np.array(live, dtype=np.int64))[: int(rng.integers(0, len(live) + 1))]
        got = mgr.rows_of(asked)  # (an int array of ids, as the requests' own ids)
        assert got.dtype == np.int32
        assert got.tolist() == [mgr.row_of(int(r)) for r in asked]
    assert sorted(mgr.rows_of(live).tolist()) == sorted(mgr.row_of(r) for r in live)
    mgr.check_integrity()
