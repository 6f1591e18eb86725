"""The engine's scheduler plans admissions with ``can_admit``: a request that does not fit
leaves the allocator exactly as it was (no LRU reordering, no prefix-cache counters)."""

from __future__ import annotations

from test_allocator_snapshot import full_state

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.engine.request import Request, RequestStatus
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
