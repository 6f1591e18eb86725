"""``run_ranks``: a failing, dying or stuck rank ends the whole job fast.

The children here import only torch (no model), so each job costs a few seconds of start-up.
The process-group timeout is set far above the job's limits: ending the job must not wait
for a collective to time out.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from blocktable.context_parallel.launch import RankFailedError, run_ranks

PG_TIMEOUT_S = 300.0  # never reached: the parent ends the job first


def _sum_then_fail(rank: int, world: int, fail_rank: int, how: str) -> float:
    import torch.distributed as dist

    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)  # every rank reaches this, so the group works before the failure
    if rank == fail_rank:
        if how == "raise":
            raise ValueError(f"boom on rank {rank}")
        if how == "exit":
            os._exit(3)
        time.sleep(3600)  # stuck
    if fail_rank >= 0:
        dist.all_reduce(x)  # blocks: the failing rank never joins
    return float(x)


def test_a_failing_rank_ends_all() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as err:
        run_ranks(_sum_then_fail, 2, args=(1, "raise"), timeout_s=120, pg_timeout_s=PG_TIMEOUT_S)
    assert err.value.rank == 1
    assert "rank 1 of 2 failed" in str(err.value) and "ValueError: boom on rank 1" in str(err.value)
    assert time.monotonic() - t0 < 100  # start-up plus seconds: never the 300 s group timeout


def test_a_dying_rank_is_named() -> None:
    with pytest.raises(RankFailedError, match="rank 0 of 2 failed:\nthe process exited with code 3"):
        run_ranks(_sum_then_fail, 2, args=(0, "exit"), timeout_s=120, pg_timeout_s=PG_TIMEOUT_S)


def test_a_stuck_rank_times_out() -> None:
    # the whole wait is the test's cost: room for the two torch-only ranks to start on a busy
    # machine (a job that fails ends in under 3 s there), not more
    timeout_s = 8.0
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[.*1.*\] of 2 did not finish within"):
        run_ranks(_sum_then_fail, 2, args=(1, "sleep"), timeout_s=timeout_s,
                  pg_timeout_s=PG_TIMEOUT_S)
    assert time.monotonic() - t0 < timeout_s + 15  # the timeout plus the time to end the children


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"world_size": 0}, "world_size"), ({"world_size": 2, "device": "tpu"}, "device"),
     ({"world_size": 2, "timeout_s": 0}, "timeout_s"),
     ({"world_size": torch.cuda.device_count() + 1, "device": "cuda"}, "GPUs")],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_ranks(_sum_then_fail, **kwargs)
