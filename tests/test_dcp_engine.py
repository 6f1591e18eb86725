"""Decode context parallelism across real processes (spawned, gloo): the engine answers exactly
what one process answers, and what ``transformers.generate`` answers.

Process start (torch + transformers) costs seconds, so each world size is ONE spawned job that
runs several engine configurations in turn, plus the group and table probes. Every run goes
through chunked prefill, a prefix-cache hit, a preemption and a request shorter than
``interleave * world`` (some rank holds none of its KV); each is asserted to have happened.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TRITON_DEVICE

from blocktable import GroupSpec, MultiGroupBlockTable
from blocktable.attention.cp_layout import local_seq_len
from blocktable.config import CPConfig
from blocktable.context_parallel.launch import run_ranks
from blocktable.engine import (
    EngineConfig,
    LLMEngine,
    WorkloadRequest,
    make_workload,
    run_workload,
    tiny_llama,
    verify_requests,
)
from blocktable.engine.dcp_runner import DCPResult, DCPRun, run_dcp_rank

TIMEOUT_S = 240.0  # the whole job; a hang ends here (children are killed), never in CI's limit


def _workload(allocator_block_size: int, seed: int) -> tuple[WorkloadRequest, ...]:
    """Shared one-block prefixes (hits), prompts past the budget (chunks), one tiny request."""
    work = make_workload(5, seed=seed, block_size=allocator_block_size, max_new_tokens=5,
                         num_prefix_blocks=1, max_suffix_len=allocator_block_size + 4)
    # One KV token: fewer than interleave * world, so the last rank holds none of it.
    return (*work, WorkloadRequest("tiny", (7,), 1, 1))


def _run(world: int, block_size: int, num_blocks: int, interleave: int,
         kernel_block_size: int | None = None, pattern: str = "all_reduce",
         seed: int = 0, transport: str = "auto") -> DCPRun:
    work = _workload(block_size * world, seed)
    config = EngineConfig(
        block_size=block_size, num_blocks=num_blocks, max_num_reqs=6, token_budget=12,
        max_model_len=max(len(w.prompt_token_ids) for w in work) + 5,
    )
    return DCPRun(config, work, interleave=interleave, kernel_block_size=kernel_block_size,
                  merge_pattern=pattern, merge_transport=transport)


# The GPU code path (Triton slot mapping, commit and KV write; under the interpreter on the
# CPU) on a small workload: a prefill, a chunk and decodes.
TRITON_RUN = DCPRun(
    EngineConfig(block_size=4, num_blocks=8, max_num_reqs=2, token_budget=8, max_model_len=32,
                 backend="triton"),
    (WorkloadRequest("t0", tuple(range(1, 11)), 3, 0), WorkloadRequest("t1", (5, 6, 7), 3, 1)),
    interleave=2,
)

RUNS = {
    2: [
        _run(2, block_size=4, num_blocks=7, interleave=1),
        _run(2, block_size=4, num_blocks=5, interleave=4, pattern="all_gather_reduce_scatter",
             seed=1, transport="collectives"),
        # interleave 8 > kernel block 4: ownership is decided per manager block of 8.
        _run(2, block_size=8, num_blocks=5, interleave=8, kernel_block_size=4,
             pattern="all_to_all", seed=2),
    ],
    4: [
        _run(4, block_size=2, num_blocks=7, interleave=1),
        _run(4, block_size=4, num_blocks=5, interleave=2, kernel_block_size=2,
             pattern="all_to_all", seed=1),
    ],
}


def _probes(rank: int, world: int) -> dict[str, Any]:
    """Table and group checks run inside the spawned job (the group is initialized)."""
    import torch.distributed as dist

    from blocktable.engine.dcp_plan import StepPlan, check_cp_group
    from blocktable.engine.distributed import DistributedEngine
    from blocktable.update import StepUpdate

    out: dict[str, Any] = {}
    qsl, pos = torch.tensor([0, 4], dtype=torch.int32), torch.arange(4)
    # Tensor parallelism: a table built without cp= maps every token on every rank.
    tp = MultiGroupBlockTable([GroupSpec(block_size=16)], 2, 256, 8)
    tp.add_row(([7],), 0)
    tp.commit()
    out["tp_cp"] = tp.cp
    out["tp_slots"] = tp.compute_slot_mapping(qsl, pos)[0][:4].tolist()
    # CP only from the group handed over explicitly.
    cp = CPConfig.from_process_group(dist.group.WORLD, 1)
    out["cp"] = cp
    shard = MultiGroupBlockTable([GroupSpec(block_size=16)], 2, 256, 8, cp=cp)
    shard.add_row(([7],), 0)
    shard.commit()
    out["cp_slots"] = shard.compute_slot_mapping(qsl, pos)[0][:4].tolist()
    # A CP config that disagrees with the group: refused before any collective.
    errors = []
    for bad in (CPConfig(world, (rank + 1) % world), CPConfig(world + 1, rank)):
        with pytest.raises(ValueError, match="disagrees with the process group") as err:
            check_cp_group(bad, dist.group.WORLD)
        errors.append(str(err.value))
        with pytest.raises(ValueError, match="disagrees"):
            DistributedEngine(tiny_llama(), EngineConfig(), bad, dist.group.WORLD)
    out["errors"] = errors
    # A rank handed the plan of another step stops instead of computing garbage.
    engine = DistributedEngine(tiny_llama(), EngineConfig(), cp, dist.group.WORLD)
    if rank == 0:
        engine._broadcast(StepPlan(5, StepUpdate.empty(1)))
    else:
        with pytest.raises(RuntimeError, match="expected the plan of step 0, got step 5"):
            engine._receive()
    return out


def _job(rank: int, world: int, runs: list[DCPRun]) -> tuple[dict[str, Any], list[DCPResult]]:
    probes = _probes(rank, world)
    probes["device"] = runs[0].device
    return probes, run_dcp_rank(rank, world, runs)


def _expected_transport(run: DCPRun, device: str) -> str:
    """``"auto"`` picks p2p on GPUs (symmetric memory in this torch), collectives on the CPU."""
    if run.merge_transport != "auto":
        return run.merge_transport
    if device != "cuda":
        return "collectives"
    from blocktable.context_parallel.p2p import p2p_unavailable_reason

    return "p2p" if p2p_unavailable_reason(torch.device("cuda", 0)) is None else "collectives"


# CPU with gloo always; on a machine with 2+ GPUs also NCCL, one GPU per rank.
JOBS = [(w, "cpu") for w in sorted(RUNS)] + [
    (w, "cuda") for w in sorted(RUNS) if torch.cuda.device_count() >= w
]


def _runs_for(world: int, device: str) -> list[DCPRun]:
    runs = [replace(r, device=device) for r in RUNS[world]]
    if world == 2 and device == TRITON_DEVICE:  # CUDA if present, else the interpreter
        runs.append(replace(TRITON_RUN, device=device))
    return runs


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=0)


@pytest.fixture(scope="module", params=JOBS, ids=[f"{d}-world{w}" for w, d in JOBS])
def job(request: pytest.FixtureRequest) -> tuple[int, list[tuple[dict[str, Any], list[DCPResult]]]]:
    world, device = request.param
    results = run_ranks(_job, world, args=(_runs_for(world, device),), device=device,
                        timeout_s=TIMEOUT_S)
    return world, results


def test_tensor_parallel_table_maps_every_token(job: Any) -> None:
    world, results = job
    for rank, (probe, _) in enumerate(results):
        assert probe["tp_cp"] == CPConfig(1, 0, 1)
        assert probe["tp_slots"] == [112, 113, 114, 115]
        assert probe["cp"] == CPConfig(world, rank, 1)
        owned = iter(range(112, 116))
        want = [next(owned) if p % world == rank else -1 for p in range(4)]
        assert probe["cp_slots"] == want
        assert f"world_size={world}, rank={rank}" in probe["errors"][0]
        assert f"CPConfig(world_size={world + 1}, rank={rank})" in probe["errors"][1]


def test_engine_equals_one_process_and_generate(job: Any, model: torch.nn.Module) -> None:
    world, results = job
    for i, run in enumerate(RUNS[world]):
        per_rank = [res[i] for _, res in results]
        driver = per_rank[0]
        # The single-process engine with the allocator's block (block_size * world): the same
        # scheduling decisions, step by step, and the same tokens.
        single = LLMEngine(model, EngineConfig(
            block_size=driver.allocator_block_size, num_blocks=run.config.num_blocks,
            max_num_reqs=run.config.max_num_reqs, token_budget=run.config.token_budget,
            max_model_len=run.config.max_model_len,
        ))
        steps = run_workload(single, run.workload)
        assert driver.allocator_block_size == run.config.block_size * world
        assert [(s.num_reqs, s.num_tokens, s.preempted, s.finished) for s in driver.steps] == [
            (s.num_reqs, s.num_tokens, s.preempted, s.finished) for s in steps
        ]
        want = {r.req_id: r.output_token_ids for r in single.requests.values()}
        got = {r.req_id: r.output_token_ids for r in driver.requests}
        assert got == want, f"run {i}"
        transport = _expected_transport(run, results[0][0]["device"])
        assert [r.merge_transport for r in per_rank] == [transport] * world, f"run {i}"
        checks = verify_requests(model, driver.requests)
        assert all(c.ok for c in checks), [c for c in checks if not c.ok]
        _assert_every_path_ran(run, world, per_rank)


# The Triton-path run is in one job only (see _runs_for); the others are not asked for.
TRITON_JOBS = [j for j in JOBS if j == (2, TRITON_DEVICE)]


@pytest.mark.parametrize("job", TRITON_JOBS, indirect=True,
                         ids=[f"{d}-world{w}" for w, d in TRITON_JOBS])
def test_gpu_code_path(job: Any, model: torch.nn.Module) -> None:
    world, results = job
    assert len(results[0][1]) == len(RUNS[world]) + 1
    per_rank = [res[len(RUNS[world])] for _, res in results]
    driver = per_rank[0]
    checks = verify_requests(model, driver.requests)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert sum(r.num_prefill_chunks for r in driver.requests) >= 1
    written = [r.stats.kv_tokens_written for r in per_rank]
    assert sum(written) == sum(s.num_tokens for s in driver.steps) and min(written) > 0


def _assert_every_path_ran(run: DCPRun, world: int, per_rank: list[DCPResult]) -> None:
    driver = per_rank[0]
    reqs = {r.req_id: r for r in driver.requests}
    assert driver.num_preemptions >= 1 and any(r.num_preemptions for r in reqs.values())
    assert driver.num_hit_tokens >= driver.allocator_block_size  # a whole block was a hit
    assert sum(r.num_prefill_chunks for r in reqs.values()) >= 1
    tiny = reqs["tiny"]
    tiny_kv = len(tiny.prompt_token_ids) + tiny.max_new_tokens - 1
    assert tiny_kv < run.interleave * world
    assert local_seq_len(tiny_kv, world_size=world, rank=world - 1, interleave=run.interleave,
                         manager_block_size=run.config.block_size) == 0
    # Every token's K/V was written by exactly one rank; every rank wrote some.
    written = [r.stats.kv_tokens_written for r in per_rank]
    assert sum(written) == sum(s.num_tokens for s in driver.steps)
    assert min(written) > 0
    # Ranks past 0 saw queries with no key of theirs (-inf LSE merged away).
    assert all(r.stats.num_empty_queries > 0 for r in per_rank[1:])
    assert [r.stats.rank for r in per_rank] == list(range(world))
    assert len({r.stats.num_steps for r in per_rank}) == 1
    assert len({r.stats.kv_cache_bytes for r in per_rank}) == 1
    assert np.all(np.array([r.stats.peak_kv_tokens for r in per_rank]) > 0)
