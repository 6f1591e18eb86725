"""Run workloads on a :class:`~blocktable.engine.distributed.DistributedEngine`, one rank each.

:func:`run_dcp_rank` is the per-rank function handed to
:func:`blocktable.context_parallel.launch.run_ranks`: it builds the model and the engine for
each :class:`DCPRun` in turn (several runs share one process start, which costs seconds), drives
the workload (or the run's own driver) on rank 0 and follows on the others, and returns what
each rank measured::

    from blocktable.context_parallel.launch import run_ranks
    results = run_ranks(run_dcp_rank, 2, args=([DCPRun(EngineConfig(), workload)],))
    driver = results[0][0]  # rank 0, first run: requests, steps, allocator counters
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from blocktable.config import CPConfig
from blocktable.engine.dcp_plan import RankStats
from blocktable.engine.distributed import DistributedEngine, StepHook
from blocktable.engine.engine import EngineConfig, StepResult
from blocktable.engine.generation_request import Request
from blocktable.engine.model import HFLlama, tiny_llama
from blocktable.engine.scheduler import SchedulerOutput
from blocktable.engine.workload import WorkloadRequest, run_workload

MergerFactory = Callable[..., Any]
"""``factory(group, cp, *, pattern, max_num_tokens, num_heads, head_dim, dtype, device)``."""


class ModelBuilder(Protocol):
    """How each rank makes its model: an object that pickles small (a model does not cross
    the process start) and builds the model in the rank, on the rank's device. Every rank
    must build the same weights (the engine's handshake compares a sample of them)."""

    def __call__(self, device: torch.device) -> HFLlama:
        ...


class Driver(Protocol):
    """Rank 0's part of a run in place of the workload: add requests to ``engine`` and step
    it until done (the runner then stops the other ranks); what it returns comes back in
    :attr:`DCPResult.driven`. ``model`` is the rank's model (built by the run's builder)."""

    def __call__(self, engine: DistributedEngine, model: HFLlama) -> Any:
        ...


@dataclass(frozen=True)
class TinyLlama:
    """:class:`ModelBuilder` of :func:`~blocktable.engine.model.tiny_llama` with ``seed``."""

    seed: int = 0

    def __call__(self, device: torch.device) -> HFLlama:
        return tiny_llama(seed=self.seed, device=device)


@dataclass(frozen=True)
class DCPRun:
    """One engine run over a CP group: model, sizes, CP layout and workload.

    ``config.block_size`` and ``config.num_blocks`` are per rank (the table's block and each
    rank's pool); the allocator's block is ``block_size * world`` tokens. The model is
    ``build_model``'s, by default :func:`~blocktable.engine.model.tiny_llama` with
    ``model_seed`` (4 heads, 2 KV heads). Rank 0 runs ``drive`` if given, else adds the
    ``workload``'s requests at their arrival steps.
    """

    config: EngineConfig
    workload: tuple[WorkloadRequest, ...]
    interleave: int = 1
    kernel_block_size: int | None = None
    merge_pattern: str = "all_reduce"
    merge_transport: str = "auto"  # see DistributedEngine
    model_seed: int = 0
    device: str = "cpu"
    check_consistency: bool = True
    take_snapshots: bool = False  # the driver keeps a picture snapshot of every step
    make_merger: MergerFactory | None = None  # default: blocktable.context_parallel's merger
    build_model: ModelBuilder | None = None  # default: TinyLlama(model_seed)
    drive: Driver | None = None  # default: the workload


@dataclass
class DCPResult:
    """What one rank returns for one run (the driver's fields are empty on other ranks)."""

    stats: RankStats
    requests: list[Request] = field(default_factory=list)
    steps: list[StepResult] = field(default_factory=list)
    num_hit_tokens: int = 0  # prefix-cache hits over admitted tokens (driver)
    num_lookup_tokens: int = 0
    num_preemptions: int = 0
    num_free_blocks: int = 0  # at the end (driver)
    num_cached_blocks: int = 0
    allocator_block_size: int = 0
    merge_transport: str = ""  # the transport the engine's merger uses (every rank)
    snapshots: list[Any] = field(default_factory=list)  # picture.TableSnapshot per step (driver)
    driven: Any = None  # what the run's ``drive`` returned (driver)


def run_dcp_rank(rank: int, world_size: int, runs: Sequence[DCPRun]) -> list[DCPResult]:
    """Run every ``runs[i]`` on this rank of the default process group; return its results."""
    import torch.distributed as dist

    group = dist.group.WORLD
    results = []
    for run in runs:
        device = torch.device(run.device)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        build = run.build_model or TinyLlama(run.model_seed)
        model = build(device)
        cp = CPConfig.from_process_group(group, run.interleave)
        merger = None
        if run.make_merger is not None:
            cfg = model.config
            merger = run.make_merger(
                group, cp, pattern=run.merge_pattern, max_num_tokens=run.config.token_budget,
                num_heads=cfg.num_attention_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
                dtype=model.lm_head.weight.dtype, device=device,
            )
        engine = DistributedEngine(
            model, run.config, cp, group, kernel_block_size=run.kernel_block_size, merger=merger,
            merge_pattern=run.merge_pattern, merge_transport=run.merge_transport,
            check_consistency=run.check_consistency,
        )
        if engine.is_driver and run.drive is not None:
            result = _drive_own(engine, run.drive, model)
        elif engine.is_driver:
            result = _drive(engine, run.workload, run.take_snapshots)
        else:
            result = DCPResult(engine.serve())
        result.merge_transport = engine.merge_transport
        results.append(result)
    return results


def drive_workload(
    engine: DistributedEngine,
    workload: Sequence[WorkloadRequest],
    *,
    hook: StepHook | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    max_steps: int = 100_000,
) -> list[StepResult]:
    """Step the driver until every request arrived and finished, then stop the followers."""
    steps = run_workload(engine, workload, hook=hook, on_step=on_step, max_steps=max_steps)
    engine.shutdown()
    return steps


def _drive(
    engine: DistributedEngine, workload: Sequence[WorkloadRequest], take_snapshots: bool
) -> DCPResult:
    snapshots: list[Any] = []

    def snap(eng: DistributedEngine, batch: SchedulerOutput) -> None:
        from blocktable.engine.snapshot import take_snapshot

        # The allocator's view: one block id stands for block_size * world tokens.
        shot = take_snapshot(eng, batch)  # type: ignore[arg-type]
        snapshots.append(replace(shot, block_size=eng.allocator_block_size))

    steps = drive_workload(engine, workload, hook=snap if take_snapshots else None)
    result = _driver_result(engine)
    result.steps, result.snapshots = steps, snapshots
    return result


def _drive_own(engine: DistributedEngine, drive: Driver, model: HFLlama) -> DCPResult:
    # A driver that raises ends its rank without a stop plan: the launcher then ends the
    # others (a stop plan sent after a half-done step would meet them inside a merge).
    driven = drive(engine, model)
    engine.shutdown()
    result = _driver_result(engine)
    result.driven = driven
    return result


def _driver_result(engine: DistributedEngine) -> DCPResult:
    """Rank 0's result after the last step: its requests, allocator counters and stats
    (the tables' integrity checked)."""
    manager, scheduler = engine.manager, engine.scheduler
    assert manager is not None and scheduler is not None
    manager.check_integrity()
    engine.table.check_integrity()
    return DCPResult(
        engine.finish_stats(), list(engine.requests.values()),
        num_hit_tokens=scheduler.num_hit_tokens, num_lookup_tokens=scheduler.num_lookup_tokens,
        num_preemptions=manager.num_preemptions, num_free_blocks=manager.num_free_blocks(),
        num_cached_blocks=manager.num_cached_blocks(),
        allocator_block_size=engine.allocator_block_size,
    )
