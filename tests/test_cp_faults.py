"""Ranks that disagree or fall out of step: a clear error on every rank, never a wrong answer.

One spawned gloo job (two ranks) runs every merger case in turn; after each refused case the
group must still work, so the job ends with a merge compared against the float64 reference.
The same job runs over NCCL where two GPUs are visible. Every child ends on the job's timeout.
"""

from __future__ import annotations

import time

import pytest
import torch
from spawn import run_ranks

from blocktable.context_parallel import (
    PATTERNS,
    AttentionMerger,
    CallMismatchError,
    ConfigMismatchError,
    merge_attention_reference,
)

NUM_HEADS, HEAD_DIM, MAX_TOKENS = 4, 8, 8


def _merger(device: str, **kw: object) -> AttentionMerger:
    # check_calls is on by default for CPU tensors only: these cases need it everywhere.
    args: dict[str, object] = {"max_num_tokens": MAX_TOKENS, "num_heads": NUM_HEADS,
                               "head_dim": HEAD_DIM, "dtype": torch.float32, "device": device,
                               "check_calls": True}
    return AttentionMerger(None, **{**args, **kw})  # type: ignore[arg-type]


def _states(num_tokens: int, world: int, seed: int, device: torch.device | str,
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(world, num_tokens, NUM_HEADS, HEAD_DIM, generator=g)
    lses = 2 * torch.randn(world, num_tokens, NUM_HEADS, generator=g)
    return list(outs.to(device)), list(lses.to(device))


def _error(fn: object) -> str:
    """``type: message`` of what ``fn()`` raised, or ``"returned"``."""
    try:
        fn()  # type: ignore[operator]
    except Exception as err:  # noqa: BLE001 - reported to the parent
        return f"{type(err).__name__}: {err}"
    return "returned"


def _zeros(num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(num_tokens, NUM_HEADS, HEAD_DIM, device=device),
            torch.zeros(num_tokens, NUM_HEADS, device=device))


def _merge_error(merger: AttentionMerger, num_tokens: int, **kw: object) -> str:
    out, lse = _zeros(num_tokens, merger.device)
    return _error(lambda: merger.merge(out, lse, **kw))


def _max_error(merger: AttentionMerger, num_tokens: int, seed: int) -> float:
    """One merge of every head on this rank against the float64 reference."""
    outs, lses = _states(num_tokens, merger.world_size, seed, merger.device)
    want, _ = merge_attention_reference(outs, lses)
    got = merger.merge(outs[merger.rank], lses[merger.rank], gather_heads=True)
    return float((got.double() - want).abs().max())


def merger_faults_job(rank: int, world: int, device_type: str = "cpu") -> dict[str, object]:
    started = time.monotonic()
    device = "cpu" if device_type == "cpu" else f"cuda:{torch.cuda.current_device()}"
    res: dict[str, object] = {}
    # Settings that differ: refused at construction, on every rank, before any payload.
    res["pattern"] = _error(lambda: _merger(device, pattern=PATTERNS[rank]))
    res["dtype"] = _error(lambda: _merger(device, dtype=(torch.bfloat16, torch.float16)[rank]))
    res["heads"] = _error(lambda: _merger(device, num_heads=(4, 8)[rank], pattern="all_reduce"))
    # One rank's batch is empty, its peer's is not: both are told, and nothing moved.
    merger = _merger(device)
    res["empty_vs_3"] = _merge_error(merger, (0, 3)[rank])
    # A rank that skipped a step's merges arrives with the next step's number.
    res["skipped_step"] = _merge_error(merger, 2, step=(6, 5)[rank])
    res["after_errors"] = _max_error(merger, 5, seed=1)  # the group still pairs correctly
    # Empty batches on every rank take part in every collective, checked or not, and the
    # calls after them still pair with the right peer call.
    errors = []
    for pattern in PATTERNS:
        for check in (True, False):
            m = _merger(device, pattern=pattern, check_calls=check)
            for gather in (False, True):
                got = m.merge(*_zeros(0, m.device), gather_heads=gather)
                heads = NUM_HEADS if gather or pattern == "all_reduce" else NUM_HEADS // world
                if got.shape != (0, heads, HEAD_DIM):
                    errors.append(f"{pattern} check={check} gather={gather}: {list(got.shape)}")
            errors.append(_max_error(m, 3, seed=2))
    res["empty_all"] = errors
    res["seconds"] = time.monotonic() - started
    return res


def test_merger_refuses_disagreeing_ranks_and_out_of_step_calls(tmp_path) -> None:
    _check(run_ranks(merger_faults_job, 2, tmp_path, timeout_s=60.0, pg_timeout_s=10.0))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_merger_faults_over_nccl() -> None:
    from blocktable.context_parallel.launch import run_ranks as run_gpu_ranks

    _check(run_gpu_ranks(merger_faults_job, 2, args=("cuda",), device="cuda", timeout_s=120.0,
                         pg_timeout_s=30.0))


def _check(results: list[dict[str, object]]) -> None:
    for rank, res in enumerate(results):
        cme, mismatch = ConfigMismatchError.__name__, CallMismatchError.__name__
        assert res["pattern"] == (
            f"{cme}: AttentionMerger: the ranks disagree on pattern (rank 0: "
            f"'{PATTERNS[0]}', rank 1: '{PATTERNS[1]}')"), res
        assert res["dtype"].startswith(f"{cme}: AttentionMerger: the ranks disagree on dtype "
                                       "(rank 0: 'torch.bfloat16', rank 1: 'torch.float16')")
        assert "num_heads (rank 0: 4, rank 1: 8)" in res["heads"]
        assert res["empty_vs_3"].startswith(
            f"{mismatch}: AttentionMerger.merge on rank {rank}: the ranks are out of step "
            "(rank 0: step 1, 0 tokens, rank 1: step 1, 3 tokens)"), res["empty_vs_3"]
        assert "(rank 0: step 6, 2 tokens, rank 1: step 5, 2 tokens)" in res["skipped_step"]
        assert res["after_errors"] < 1e-5
        assert all(isinstance(e, float) and e < 1e-5 for e in res["empty_all"]), res["empty_all"]
