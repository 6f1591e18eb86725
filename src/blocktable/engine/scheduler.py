"""Continuous batching: which requests run this step, and with how many tokens.

Every step has a token budget. Running requests go first, oldest first: a decoding request
takes one token, a request still in its (chunked) prefill takes what is left of its prompt, cut
to the budget. When the allocator cannot give a running request its blocks, the *newest*
running request is preempted (its blocks go back to the pool, its full blocks stay in the
prefix cache) and waits at the head of the queue; it resumes by recomputing its tokens, most of
them usually found in the prefix cache. Waiting requests are admitted, in arrival order, while
budget, rows and blocks last, and never in a step that preempted (that would only thrash).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from blocktable.allocator import KVCacheManager, OutOfBlocksError
from blocktable.engine.generation_request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_new_tokens)`` of it."""

    request: Request
    start: int  # tokens already in the KV cache (computed or prefix-cache hits)
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """Whether this step reaches the end of the known tokens (so a token is sampled)."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs, in batch order, and who lost their blocks to make room."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Waiting and running queues over one :class:`~blocktable.allocator.KVCacheManager`.

    The scheduler is the only caller of the allocator's admission and allocation methods; the
    engine reads the resulting table changes with ``manager.take_step_update()``.

    Parameters
    ----------
    manager : KVCacheManager
        The block allocator (it also assigns each running request its table row).
    token_budget : int
        Most tokens computed in one step (prefill chunks and decodes together).
    """

    def __init__(self, manager: KVCacheManager, token_budget: int) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.manager = manager
        self.token_budget = token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first; preemption takes from the end
        # Prefix-cache counters over admissions (equal to the allocator's own, which only
        # count admissions too).
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0

    def add(self, request: Request) -> None:
        """Queue a new request behind the others."""
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """Drop a finished request and free its row and blocks (cached blocks stay findable)."""
        self.running.remove(request)
        self.manager.free(request.req_id)
        request.status = RequestStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of admitted requests' tokens served by the prefix cache (0.0 if none)."""
        return self.num_hit_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch, allocating its blocks (preempting if they run out)."""
        budget = self.token_budget
        scheduled = self._schedule_running_at_once(budget)
        preempted: list[Request] = []
        if scheduled is None:  # short of blocks: request by request, preempting
            scheduled, budget = self._schedule_running(budget, preempted)
        else:
            budget -= sum(s.num_new_tokens for s in scheduled)
        self._admit_waiting(budget, scheduled, bool(preempted))
        return SchedulerOutput(scheduled, preempted)

    def _schedule_running_at_once(self, budget: int) -> list[ScheduledRequest] | None:
        """The running requests' share of the step, their blocks allocated by one batched
        call; None (nothing allocated) when the pool cannot serve them all, where
        :meth:`_schedule_running` preempts. When it can, the request-by-request loop would
        preempt nobody and allocate the same, so the result is the same."""
        num_computed = self.manager.num_computed_tokens
        scheduled: list[ScheduledRequest] = []
        req_ids: list[str] = []
        counts: list[int] = []
        for req in self.running:
            if budget <= 0:
                break
            start = num_computed(req.req_id)
            num_new = min(req.num_tokens - start, budget)
            scheduled.append(ScheduledRequest(req, start, num_new))
            req_ids.append(req.req_id)
            counts.append(num_new)
            budget -= num_new
        try:
            self.manager.allocate_many(req_ids, counts)
        except OutOfBlocksError:
            return None
        return scheduled

    def _schedule_running(
        self, budget: int, preempted: list[Request]
    ) -> tuple[list[ScheduledRequest], int]:
        """The running requests' share of the step, oldest first, preempting the newest
        (appended to ``preempted``) while a request's blocks do not fit; returns the budget
        left."""
        scheduled: list[ScheduledRequest] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start = self.manager.num_computed_tokens(req.req_id)
            num_new = min(req.num_tokens - start, budget)
            while not self.manager.can_allocate(req.req_id, num_new):
                victim = self.running.pop()  # the newest, possibly `req` itself
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # `req` was the newest left: nobody after it to schedule
            self.manager.allocate(req.req_id, num_new)
            scheduled.append(ScheduledRequest(req, start, num_new))
            budget -= num_new
            i += 1
        return scheduled, budget

    def _admit_waiting(
        self, budget: int, scheduled: list[ScheduledRequest], preempted: bool
    ) -> None:
        """Admit waiting requests in arrival order (appended to ``scheduled``) while budget,
        rows and blocks last, in a step that preempted nobody."""
        while self.waiting and budget > 0 and not preempted and self.manager.num_free_rows:
            req = self.waiting[0]
            tokens = req.all_token_ids
            # Plan without side effects (no LRU reordering, no counters); when the pool is
            # short the request stays at the head of the queue and retries next step.
            num_cached = self.manager.lookup_prefix(tokens)
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.manager.can_admit(tokens, num_new):
                break
            num_cached = self.manager.add_request(req.req_id, tokens)
            self.manager.allocate(req.req_id, num_new)
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_cached_tokens += num_cached
            self.num_lookup_tokens += req.num_tokens
            self.num_hit_tokens += num_cached
            scheduled.append(ScheduledRequest(req, num_cached, num_new))
            budget -= num_new

    def _preempt(self, req: Request) -> None:
        self.manager.preempt(req.req_id)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        # Preempted requests resume before new ones; when several are preempted in one step
        # (newest first), the older ends up in front.
        self.waiting.appendleft(req)
