"""The engine's scheduler plans admissions with ``can_admit``: a request that does not fit
leaves the allocator exactly as it was (no LRU reordering, no prefix-cache counters)."""

from __future__ import annotations

from test_allocator_snapshot import full_state

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.engine.generation_request import Request, RequestStatus
from blocktable.engine.scheduler import Scheduler


def test_a_request_that_does_not_fit_waits_and_changes_nothing() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 9)], 4)  # 8 usable blocks
    prefix = list(range(16))
    mgr.add_request("old", prefix)
    mgr.allocate("old", 16)
    mgr.mark_computed("old", 16)
    mgr.free("old")  # 4 cached free blocks
    sched = Scheduler(mgr, token_budget=64)
    running = Request("run", [9] * 15, max_new_tokens=4)
    sched.add(running)
    out = sched.schedule()  # admits "run": 4 uncached blocks
    assert [s.request.req_id for s in out.scheduled] == ["run"]
    mgr.mark_computed("run", 15)
    mgr.take_step_update()
    # "new" hits the 4 cached blocks (leaving the free queue) and needs 2 more: none left
    waiting = Request("new", [*prefix, 1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=4)
    sched.add(waiting)
    running.output_token_ids.append(5)
    mgr.append_token_ids("run", 5)
    before_lookups = (sched.num_lookup_tokens, sched.num_hit_tokens)
    state = full_state(mgr)
    assert not mgr.can_admit(waiting.all_token_ids, 8)
    assert full_state(mgr) == state
    out = sched.schedule()
    assert [s.request.req_id for s in out.scheduled] == ["run"]  # its token fits its last block
    assert list(sched.waiting) == [waiting] and waiting.status is RequestStatus.WAITING
    assert full_state(mgr) == state  # no admit-then-free: LRU order and counters untouched
    assert (sched.num_lookup_tokens, sched.num_hit_tokens) == before_lookups
    # once "run" finishes, "new" is admitted with its hit
    sched.finish(running)
    out = sched.schedule()
    assert [(s.request.req_id, s.start) for s in out.scheduled] == [("new", 16)]
    mgr.check_integrity()


def _drive(at_once: bool, seed: int) -> list[object]:
    """A random workload on a small pool (preemptions happen); per step, what was scheduled,
    who was preempted and every running request's blocks."""
    import numpy as np

    rng = np.random.default_rng(seed)
    mgr = KVCacheManager([AllocatorGroupSpec(4, 12)], 6)
    sched = Scheduler(mgr, token_budget=int(rng.integers(8, 40)))
    if not at_once:
        sched._schedule_running_at_once = lambda budget: None  # type: ignore[method-assign]
    trace: list[object] = []
    shared = rng.integers(0, 50, 8).tolist()
    for step in range(40):
        if rng.random() < 0.4:
            prompt = (shared if rng.random() < 0.5 else []) + rng.integers(
                0, 50, int(rng.integers(1, 20))
            ).tolist()
            sched.add(Request(f"r{step}", prompt, max_new_tokens=int(rng.integers(1, 12))))
        out = sched.schedule()
        for s in out.scheduled:
            mgr.mark_computed(s.request.req_id, s.num_new_tokens)
            if s.completes:
                s.request.output_token_ids.append(int(rng.integers(0, 50)))
                mgr.append_token_ids(s.request.req_id, s.request.output_token_ids[-1])
                if len(s.request.output_token_ids) >= s.request.max_new_tokens:
                    sched.finish(s.request)
        mgr.take_step_update()
        trace.append((
            [(s.request.req_id, s.start, s.num_new_tokens) for s in out.scheduled],
            [r.req_id for r in out.preempted],
            {r.req_id: mgr.block_ids(r.req_id) for r in sched.running},
        ))
    mgr.check_integrity()
    return trace


def test_running_requests_allocated_at_once_as_one_by_one() -> None:
    """One batched allocation for the running requests when they all fit, the request-by-
    request loop (preempting the newest) when they do not: the same steps, blocks and
    preemptions as the loop alone, on random workloads with preemptions."""
    preemptions = 0
    for seed in range(12):
        trace = _drive(True, seed)
        assert trace == _drive(False, seed), seed
        preemptions += sum(len(preempted) for _, preempted, _ in trace)  # type: ignore[misc]
    assert preemptions > 0  # the loop's path was taken too
