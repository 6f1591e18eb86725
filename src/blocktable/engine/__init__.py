"""A minimal continuous-batching engine on blocktable: how the pieces fit in a real loop.

- :mod:`~blocktable.engine.generation_request`: a request's tokens and state;
- :mod:`~blocktable.engine.scheduler`: token budget, chunked prefill, preemption;
- :mod:`~blocktable.engine.engine`: the step loop (allocator -> table -> commit -> slot
  mapping -> KV write + paged attention -> sampling);
- :mod:`~blocktable.engine.model`: a Llama forward over the paged KV cache;
- :mod:`~blocktable.engine.sampling`: greedy or seeded temperature / top-k / top-p choice;
- :mod:`~blocktable.engine.chat`: chat prompts through the tokenizer's template, stop tokens;
- :mod:`~blocktable.engine.workload`: a synthetic workload and the loop that feeds it;
- :mod:`~blocktable.engine.verify`: the check against transformers' own ``generate`` (same
  stop tokens and lengths);
- :mod:`~blocktable.engine.distributed`: the same engine with each request's KV sharded over
  the processes of a context-parallel group (:mod:`~blocktable.engine.dcp_runner` runs it).
"""

from __future__ import annotations

from blocktable.engine.dcp_plan import RankStats, StepPlan
from blocktable.engine.distributed import DistributedEngine
from blocktable.engine.engine import EngineConfig, LLMEngine, StepResult
from blocktable.engine.generation_request import Request, RequestStatus
from blocktable.engine.model import AttentionInputs, PagedLlama, tiny_llama
from blocktable.engine.sampling import SamplingParams
from blocktable.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from blocktable.engine.verify import Verification, reference_generate, verify_requests
from blocktable.engine.workload import WorkloadRequest, make_workload, run_workload

__all__ = [
    "AttentionInputs",
    "DistributedEngine",
    "EngineConfig",
    "LLMEngine",
    "PagedLlama",
    "RankStats",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "StepPlan",
    "StepResult",
    "Verification",
    "WorkloadRequest",
    "make_workload",
    "reference_generate",
    "run_workload",
    "tiny_llama",
    "verify_requests",
]
