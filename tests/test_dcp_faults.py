"""A distributed engine under faults: disagreeing ranks, an idle driver, a killed or stalled rank.

One spawned gloo job (two ranks, process-group timeout 2 s) runs the engine cases in turn and
ends with rank 1 killed by SIGKILL in the middle of a workload; the parent must blame it, by
signal, with the last step it finished. A second, model-free job stalls a rank. Every job ends
on its timeout.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from blocktable.context_parallel.launch import RankFailedError, report_step, run_ranks

PG_TIMEOUT_S = 2.0
IDLE_S = 3.0  # the driver's pause before its first step: longer than the group's timeout
KILLED_AT_STEP = 2


def _engine(model: Any, interleave: int) -> Any:  # a DistributedEngine, built in a child
    import torch.distributed as dist

    from blocktable.config import CPConfig
    from blocktable.engine import EngineConfig
    from blocktable.engine.distributed import DistributedEngine

    group = dist.group.WORLD
    config = EngineConfig(block_size=4, num_blocks=8, max_num_reqs=2, token_budget=8,
                          max_model_len=32)
    return DistributedEngine(model, config, CPConfig.from_process_group(group, interleave),
                             group, check_consistency=True)


def engine_faults_job(rank: int, world: int, report_path: str) -> None:
    from blocktable.context_parallel import ConfigMismatchError
    from blocktable.engine import WorkloadRequest, tiny_llama
    from blocktable.engine.dcp_runner import drive_workload

    model = tiny_llama(seed=0)
    workload = [WorkloadRequest("a", tuple(range(1, 11)), 4, 0),
                WorkloadRequest("b", (5, 6, 7), 4, 1)]
    # A terminal's Ctrl-C passes the ranks by (the parent ends them).
    report: dict[str, object] = {
        "sigint_blocked": signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())}
    # Ranks that disagree on the interleave would write and attend different tokens.
    try:
        _engine(model, interleave=(1, 2)[rank])
        report["interleave"] = "constructed"
    except ConfigMismatchError as err:
        report["interleave"] = str(err)
    try:  # different weights: every rank would sample from another model
        _engine(tiny_llama(seed=rank), interleave=2)
        report["weights"] = "constructed"
    except ConfigMismatchError as err:
        report["weights"] = str(err)
    # A driver idle for longer than the group's timeout: the followers keep waiting.
    engine = _engine(model, interleave=2)
    if engine.is_driver:
        time.sleep(IDLE_S)
        steps = drive_workload(engine, workload)
        report["finished"] = sorted(f for s in steps for f in s.finished)
        report["tokens"] = {r.req_id: len(r.output_token_ids) for r in engine.requests.values()}
    else:
        report["follower_steps"] = engine.serve().num_steps
    Path(report_path + f".{rank}").write_text(json.dumps(report))
    # Rank 1 is killed by SIGKILL when the plan of step 2 arrives.
    engine = _engine(model, interleave=2)
    if engine.is_driver:
        drive_workload(engine, workload)
        return
    execute = engine._execute

    def execute_or_die(plan: Any, hook: Any) -> Any:
        if plan.step == KILLED_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        return execute(plan, hook)

    engine._execute = execute_or_die  # type: ignore[method-assign]
    engine.serve()


def test_engine_disagreement_idle_driver_and_killed_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "report")
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as caught:
        run_ranks(engine_faults_job, 2, args=(path,), timeout_s=90.0, pg_timeout_s=PG_TIMEOUT_S,
                  num_threads=1)
    elapsed = time.monotonic() - t0
    reports = [json.loads(Path(f"{path}.{r}").read_text()) for r in range(2)]
    for report in reports:  # refused on every rank, naming the field and both values
        assert report["sigint_blocked"] is True
        assert report["interleave"] == ("DistributedEngine: the ranks disagree on interleave "
                                        "(rank 0: 1, rank 1: 2)")
        assert report["weights"].startswith(
            "DistributedEngine: the ranks disagree on weights sample (rank 0: '"), report
    assert reports[0]["finished"] == ["a", "b"] and reports[0]["tokens"] == {"a": 4, "b": 4}
    assert reports[1]["follower_steps"] > 0
    err = caught.value
    assert (err.rank, err.cause, err.signal_name) == (1, "died", "SIGKILL")
    assert err.last_steps == [KILLED_AT_STEP - 1, KILLED_AT_STEP - 1]
    assert str(err).startswith(
        f"rank 1 of 2 died: killed by SIGKILL (exit code -9); the last step it finished: "
        f"{KILLED_AT_STEP - 1} (others: rank 0: {KILLED_AT_STEP - 1})"), str(err)
    assert list(err.tracebacks) == [1, 0]  # the dead rank first, the rank that waited next
    assert elapsed < 60  # seconds after the kill, not a collective timeout per step


def stall_job(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    x = torch.ones(1)
    for step in range(3):
        dist.all_reduce(x)
        report_step(step)
    if rank == 1:
        time.sleep(3600)  # stalled: alive, silent
    dist.all_reduce(x)  # rank 0 waits for rank 1 into the group's timeout


def test_a_stalled_rank_is_blamed_not_the_rank_that_timed_out() -> None:
    with pytest.raises(RankFailedError) as caught:
        run_ranks(stall_job, 2, timeout_s=60.0, pg_timeout_s=PG_TIMEOUT_S, num_threads=1)
    err = caught.value
    assert (err.rank, err.cause, err.signal_name, err.last_steps) == (1, "stalled", None, [2, 2])
    assert str(err).startswith("rank 1 of 2 stalled: no result and no error 1 s after another "
                               "rank failed; the last step it finished: 2 (others: rank 0: 2)")
    assert list(err.tracebacks) == [1, 0]
