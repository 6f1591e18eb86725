"""The distributed engine over the peer-to-peer merge transport, on CPU ranks.

``transport="p2p"`` needs GPUs of one node; here each rank's "symmetric" buffer is its slice of
one file mapped by every process (a peer is a fixed number of bytes away) and the kernel runs
under the Triton interpreter, so the engine's real p2p path (``merge_transport="auto"``
choosing it, the symmetric buffer's flags and pushes across processes, one kernel per layer
and step) answers what one process answers, and what ``transformers.generate`` answers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from blocktable.context_parallel.launch import run_ranks
from blocktable.engine import (
    EngineConfig,
    LLMEngine,
    WorkloadRequest,
    run_workload,
    tiny_llama,
    verify_requests,
)
from blocktable.engine.dcp_runner import DCPResult, DCPRun

# A prefill in two chunks, a prefix of one allocator block shared by the second request, and
# decodes of both at once.
WORKLOAD = (
    WorkloadRequest("a", tuple(range(1, 12)), 3, 0),
    WorkloadRequest("b", (*range(1, 5), 40, 41), 3, 1),
)
CONFIG = EngineConfig(block_size=2, num_blocks=12, max_num_reqs=2, token_budget=8,
                      max_model_len=16)


def _use_file_buffers(path: str) -> None:
    """In this process, ``transport="p2p"`` runs on CPU tensors: every symmetric buffer is
    this rank's slice of ``path`` (mapped by every rank; opened in the same order on all)."""
    import torch.distributed as dist

    from blocktable.context_parallel import merge as merge_module
    from blocktable.context_parallel import p2p as p2p_module

    offset = 0

    def open_file_buffer(group: Any, nbytes: int, device: torch.device) -> Any:
        nonlocal offset
        r, w = dist.get_rank(group), dist.get_world_size(group)
        size = -(-nbytes // 16) * 16
        whole = torch.from_file(path, shared=True, size=offset + w * size, dtype=torch.uint8)
        local = whole[offset + r * size: offset + (r + 1) * size]
        offset += w * size
        deltas = tuple((q - r) * size // 16 for q in range(w))
        return p2p_module.SymmetricBuffer(local, deltas, whole)

    def available(device: torch.device) -> None:
        return None

    for module in (merge_module, p2p_module):
        module.p2p_unavailable_reason = available  # type: ignore[assignment]
    merge_module.open_symmetric_buffer = open_file_buffer  # type: ignore[assignment]


def _p2p_job(rank: int, world: int, path: str, runs: list[DCPRun]) -> list[DCPResult]:
    """Run the engine with a file-backed symmetric buffer in place of CUDA symmetric memory."""
    from blocktable.engine.dcp_runner import run_dcp_rank

    _use_file_buffers(path)
    return run_dcp_rank(rank, world, runs)


def test_engine_over_p2p_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "symmetric.bin"
    path.write_bytes(bytes(1 << 20))  # zeroed flags: no call made yet
    runs = [DCPRun(CONFIG, WORKLOAD, interleave=1),  # merge_transport="auto"
            DCPRun(CONFIG, WORKLOAD, interleave=2, merge_transport="collectives")]
    # The children's kernels run on CPU tensors: under the interpreter, even on a GPU machine
    # (chosen through the environment, before the children import triton).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    results = run_ranks(_p2p_job, 2, args=(str(path), runs), timeout_s=200.0)
    model = tiny_llama(seed=0)
    single = LLMEngine(model, EngineConfig(
        block_size=CONFIG.block_size * 2, num_blocks=CONFIG.num_blocks,
        max_num_reqs=CONFIG.max_num_reqs, token_budget=CONFIG.token_budget,
        max_model_len=CONFIG.max_model_len,
    ))
    steps = run_workload(single, WORKLOAD)
    want = {r.req_id: r.output_token_ids for r in single.requests.values()}
    assert sum(r.num_prefill_chunks for r in single.requests.values()) >= 1  # a chunked prefill
    assert single.scheduler.num_hit_tokens >= CONFIG.block_size * 2
    for i, transport in enumerate(("p2p", "collectives")):
        per_rank = [res[i] for res in results]
        assert [r.merge_transport for r in per_rank] == [transport, transport]
        driver = per_rank[0]
        assert [(s.num_reqs, s.num_tokens, s.finished) for s in driver.steps] == [
            (s.num_reqs, s.num_tokens, s.finished) for s in steps]
        assert {r.req_id: r.output_token_ids for r in driver.requests} == want, transport
        checks = verify_requests(model, driver.requests)
        assert all(c.ok for c in checks), [c for c in checks if not c.ok]
        assert per_rank[1].stats.num_empty_queries > 0  # -inf rows crossed the transport


def _bench_job(rank: int, world: int, path: str) -> dict[str, Any]:
    """``benchmarks/bench_dcp_decode.py``'s rank function at smoke sizes, p2p row included."""
    import importlib.util

    _use_file_buffers(path)
    file = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dcp_decode.py"
    if str(file.parent) not in sys.path:  # its own imports (run_info, cuda_graphs)
        sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location("bench_dcp_decode", file)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_dcp_decode"] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    case = bench.Case(num_reqs=2, seq_len=64 * world, num_heads=4, num_kv_heads=2, head_dim=16,
                      dtype="float32", device="cpu", iters=1, graph=False)
    result = bench._bench_rank(rank, world, case)
    return {"result": result, "rows": [list(r) for r in case.rows()]}


def test_bench_dcp_decode_p2p_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "symmetric.bin"
    path.write_bytes(bytes(1 << 20))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    results = run_ranks(_bench_job, 2, args=(str(path),), timeout_s=120.0)
    assert results[0]["rows"][-1] == ["p2p", "all_reduce", "p2p"]
    for r in results:
        rows = r["result"]["dcp"]
        assert set(rows) == {"all_reduce", "all_gather_reduce_scatter", "all_to_all", "p2p"}
        assert rows["p2p"]["transport"] == "p2p" and rows["all_reduce"]["transport"] == \
            "collectives"
        for row in rows.values():
            assert row["max_abs_error_vs_single"] < 1e-5 and row["eager_us"] > 0
