"""A synthetic workload that exercises everything: staggered arrivals, shared prefixes, long
prompts (chunked prefill) and more KV than the pool holds (preemption)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blocktable.engine.engine import LLMEngine, StepHook, StepResult

if TYPE_CHECKING:
    from blocktable.engine.distributed import DistributedEngine
    from blocktable.engine.distributed import StepHook as DistributedStepHook


@dataclass(frozen=True)
class WorkloadRequest:
    """A request and the engine step at which it arrives."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int


def make_workload(
    num_requests: int,
    *,
    seed: int = 0,
    block_size: int = 4,
    vocab_size: int = 256,
    max_new_tokens: int = 12,
    num_prefix_blocks: int = 3,
    max_suffix_len: int | None = None,
) -> list[WorkloadRequest]:
    """``num_requests`` prompts, deterministic in ``seed``.

    Three requests in four start with one of two shared "system prompts" of
    ``num_prefix_blocks`` full blocks (prefix-cache hits once the first one is computed), then
    a private suffix of 1 .. ``max_suffix_len`` tokens (default ``3 * block_size``). Request
    ``i`` arrives at step ``2 * i``, give or take one.
    """
    rng = random.Random(seed)
    prefix_len = num_prefix_blocks * block_size
    max_suffix = max_suffix_len if max_suffix_len is not None else 3 * block_size
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)] for _ in range(2)]
    workload = []
    for i in range(num_requests):
        prefix = [] if i % 4 == 3 else prefixes[i % 2]
        suffix = [rng.randrange(vocab_size) for _ in range(rng.randint(1, max_suffix))]
        arrival = max(0, 2 * i + rng.randint(-1, 1))
        workload.append(WorkloadRequest(f"req{i}", tuple(prefix + suffix), max_new_tokens, arrival))
    return workload


def run_workload(
    engine: LLMEngine | DistributedEngine,
    workload: Sequence[WorkloadRequest],
    *,
    hook: StepHook | DistributedStepHook | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    max_steps: int = 100_000,
) -> list[StepResult]:
    """Step ``engine`` until every request of ``workload`` arrived and finished.

    Requests are added at the start of their arrival step. ``hook`` is passed to the engine's
    ``step``; ``on_step`` sees each step's result. A :class:`DistributedEngine` is driven from
    its driver rank the same way.

    Raises
    ------
    RuntimeError
        After ``max_steps`` steps (a workload that cannot make progress).
    """
    pending = sorted(workload, key=lambda w: w.arrival_step)
    results: list[StepResult] = []
    while pending or engine.has_unfinished():
        if len(results) >= max_steps:
            raise RuntimeError(f"workload not done after max_steps={max_steps} steps")
        while pending and pending[0].arrival_step <= engine.step_index:
            w = pending.pop(0)
            engine.add_request(w.req_id, w.prompt_token_ids, w.max_new_tokens)
        results.append(engine.step(hook))  # type: ignore[arg-type]
        if on_step is not None:
            on_step(results[-1])
    return results
