"""The FlashInfer crash reproduction: its parts that need no GPU.

It must skip cleanly where there is no GPU or FlashInfer, report a child killed by a signal by
the signal's name (the next variant still runs), and size FlashInfer's split-KV workspace as
its planner does for the shapes of the attention benchmark.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from flashinfer_segfault import _run, fa2_decode_plan_estimate, outcome

H200_SMS = 132
MIB = 2**20


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_without_a_gpu_the_script_says_why_and_exits_0() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "flashinfer_segfault.py")],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("skipped: no CUDA device")


def test_a_child_killed_by_a_signal_is_named_and_its_last_stage_kept() -> None:
    code = ("import os, signal; print('  stage: plan', flush=True); "
            "os.kill(os.getpid(), signal.SIGSEGV)")
    res = _run([sys.executable, "-c", code], timeout_s=60)
    assert res["outcome"] == "SIGSEGV"
    assert res["last_stage"] == "plan"
    assert outcome(0) == "ok" and outcome(None) == "timeout" and outcome(3) == "exit 3"


def test_a_child_past_its_time_is_killed_and_reported() -> None:
    code = "import time; print('  stage: run', flush=True); time.sleep(60)"
    res = _run([sys.executable, "-c", code], timeout_s=1)
    assert res["outcome"] == "timeout" and res["last_stage"] == "run"
    assert res["seconds"] < 30


def test_decode_plan_estimate_matches_the_planner_arithmetic_by_hand() -> None:
    # 32/8 heads: 4 packed rows per request, one 16-row query tile; grid 2 * 132 / 8 = 33.
    # Under CUDA graphs the padded batch is ceil(B * 4 / 16) + B - 1, and KV is always split:
    # partials of 32 heads x 16 rows x (128 + 1) float32 per padded item.
    big = fa2_decode_plan_estimate(1024, 64, H200_SMS, cuda_graph=True)
    assert (big.cta_tile_q, big.padded_batch_size, big.split_kv) == (16, 1279, True)
    assert big.float_workspace_bytes == 32 * 1279 * 16 * 129 * 4
    assert big.float_workspace_bytes > 256 * MIB  # the benchmark's old workspace
    ok = fa2_decode_plan_estimate(256, 128, H200_SMS, cuda_graph=True)
    assert ok.padded_batch_size == 64 + 255 and ok.float_workspace_bytes < 256 * MIB
    # Eager, 1024 requests already fill the grid: no split, no float workspace.
    eager = fa2_decode_plan_estimate(1024, 64, H200_SMS, cuda_graph=False)
    assert (eager.padded_batch_size, eager.split_kv, eager.float_workspace_bytes) == (1024, False, 0)
    # One request of 512 pages: the smallest chunk keeping ceil(512 / chunk) <= 33 is 16 pages.
    single = fa2_decode_plan_estimate(1, 512, H200_SMS, cuda_graph=False)
    assert (single.split_kv, single.padded_batch_size) == (True, 32)


class _StandInDecodeWrapper:
    """Attention from the CSR arrays handed to ``plan()``, the way FlashInfer reads them: copied
    into the caller's buffers in CUDA-graph mode, else kept as given."""

    def __init__(self, workspace, layout, use_tensor_cores=False, use_cuda_graph=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None) -> None:
        self.graph = use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                        paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last, heads, kv_heads, head_dim, page, **dtypes) -> None:
        if self.graph:
            self.buffers[0].copy_(indptr)
            self.buffers[1][: indices.shape[0]].copy_(indices)
            self.buffers[2].copy_(last)
        else:
            self.buffers = (indptr, indices, last)
        self.page, self.group = page, heads // kv_heads

    def run(self, query, cache, out) -> None:
        indptr, indices, last = (t.long() for t in self.buffers)
        for r in range(query.shape[0]):
            pages = indices[indptr[r] : indptr[r + 1]]
            s = (pages.shape[0] - 1) * self.page + int(last[r])
            k, v = (c[pages].flatten(0, 1)[:s].float().repeat_interleave(self.group, 1)
                    for c in cache)
            p = (torch.einsum("hd,khd->hk", query[r].float(), k) / query.shape[-1] ** 0.5)
            out[r] = torch.einsum("hk,khd->hd", p.softmax(-1), v).to(out.dtype)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("handbuilt", [False, True])
def test_a_child_step_checks_the_export_and_the_output_on_the_cpu(monkeypatch, graph,
                                                                   handbuilt) -> None:
    import types

    import flashinfer_segfault as script

    monkeypatch.setattr(script, "DEVICE", "cpu")
    stand_in = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_StandInDecodeWrapper)
    err = script._decode_once(stand_in, 5, 77, graph=graph, capture=False, tensor_cores=True,
                              workspace_mib=1, handbuilt=handbuilt, page_pool=None, replays=2)
    assert err < 1e-2
    # Ids drawn with repeats from a small pool are still read right.
    err = script._decode_once(stand_in, 5, 77, graph=graph, capture=False, tensor_cores=True,
                              workspace_mib=1, handbuilt=handbuilt, page_pool=3, replays=1)
    assert err < 1e-2
