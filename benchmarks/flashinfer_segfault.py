"""Reproduce the crash of FlashInfer's decode reading blocktable's CSR export, one suspect at a time.

``bench_attention.py`` ended in a segmentation fault in the decode case after B=256 x 2048 (that
is, at B=1024 x 1024) whenever FlashInfer ran beside it. This script runs that shape (bf16, 32
query / 8 KV heads x 128, page 16) in a child process per variant, so a crash is reported as
the signal that ended the child and the next variant still runs:

- ``original``: the benchmark's own sequence when it crashed, B=256 x 2048 then B=1024 x 1024
  in one process: blocktable's decode timed eagerly and from a graph, FlashInfer's tensor-core
  wrapper (256 MiB uninitialized workspace) timed eagerly, then a CUDA-graph wrapper on the
  export's own buffers timed from a graph;
- ``bench``: the same FlashInfer steps without blocktable's kernels or the timing loops (a
  zeroed workspace, 20 runs or graph replays);
- ``eager``: the eager tensor-core wrapper alone at B=1024 x 1024;
- ``graph``: the CUDA-graph wrapper alone (256 MiB float workspace, as the benchmark);
- ``graph-ws512``: the same with a 512 MiB workspace (suspect: workspace too small for the plan);
- ``graph-handbuilt``: ``graph-ws512`` with CSR arrays built by torch ops, host copies to
  ``plan()`` and separate device buffers (suspect: blocktable's export);
- ``graph-cudacores``: ``graph-ws512`` with the CUDA-core decode kernel instead of the
  tensor-core one;
- ``small-cache``: B=1024 x 1024 with page ids drawn from 4,096 pages (suspect: page offsets
  past 2**31 bytes of cache, which the full case reaches: 65,537 pages of 32 KiB);
- ``b512x2048``: the same page count (65,536) at half the batch (suspect: cache size rather
  than batch size).

Each child checks the export against a torch-built CSR, prints its stage before each step (so a
crash names the step; ``faulthandler`` adds the Python stack), prints FlashInfer's plan
(padded batch size, split-KV) beside this script's estimate of the float workspace the
0.2.x FA2 planner asks for, and checks the output against float32 attention on sampled
requests. ``--sanitizer`` also runs, under ``compute-sanitizer --tool memcheck``, the eager
wrapper and the CUDA-graph wrapper's plan (512 MiB workspace) run without a capture.

    PYTHONPATH=/tmp/fi:src python benchmarks/flashinfer_segfault.py [--sanitizer] [--json out.json]

Without CUDA or FlashInfer it prints why and exits 0. Exit 1 when any variant crashed, failed
or gave a wrong output.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DEVICE = "cuda"  # the tests run the child steps on the CPU with a stand-in FlashInfer
MAX_ABS_ERR = 3e-2  # against float32 attention, unit-variance bf16 inputs (as the benchmark)
VARIANTS = ("original", "bench", "eager", "graph", "graph-ws512", "graph-handbuilt", "graph-cudacores",
            "small-cache", "b512x2048")
SANITIZED = ("sanitize-eager", "sanitize-graphmode")


@dataclass(frozen=True)
class PlanEstimate:
    """What FlashInfer 0.2.x's FA2 planner sizes for a decode batch through tensor cores."""

    cta_tile_q: int
    padded_batch_size: int
    split_kv: bool
    float_workspace_bytes: int


def fa2_decode_plan_estimate(batch_size: int, pages_per_request: int, num_sms: int,
                             cuda_graph: bool, num_heads: int = NUM_HEADS,
                             num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM,
                             page_size: int = PAGE) -> PlanEstimate:
    """Our reading of the 0.2.x prefill planner for one query per request of equal length.

    A decode query packs ``group = num_heads / num_kv_heads`` rows; a query tile holds 16 of
    them (up to 16 rows, on Ampere or newer). The grid it aims for is ``2 * num_sms /
    num_kv_heads`` work items; it picks the smallest KV chunk (in pages, at least
    ``128 / page_size``) that keeps the work items under that, and splits KV when the chunk is
    shorter than the request, or always under CUDA graphs, where the padded batch is the
    larger of that grid and a bound on the query tiles, ``ceil(B * group / tile) + B - 1``.
    Split KV keeps a float32 partial output and LSE per padded item, tile row and head.
    """
    group = num_heads // num_kv_heads
    tile = 128 if group > 64 else (64 if group > 16 else 16)
    tiles_per_request = math.ceil(group / tile)
    grid = 2 * num_sms // num_kv_heads
    chunk = max(128 // page_size, 1)
    while chunk < pages_per_request and (
        batch_size * tiles_per_request * math.ceil(pages_per_request / chunk) > grid
    ):
        chunk += 1
    chunk = min(chunk, max(pages_per_request, 1))
    split = cuda_graph or chunk < pages_per_request
    items = batch_size * tiles_per_request * math.ceil(max(pages_per_request, 1) / chunk)
    padded = max(grid, math.ceil(batch_size * group / tile) + batch_size - 1) if cuda_graph \
        else items
    floats = num_heads * padded * tile * (head_dim + 1) * 4 if split else 0
    return PlanEstimate(tile, padded, split, floats)


def outcome(returncode: int | None) -> str:
    """A child's end in words: ``ok``, ``timeout``, ``SIGSEGV``, ``exit 1``..."""
    if returncode is None:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


# ---------------------------------------------------------------------------------------------
# child side: one variant


def _stage(name: str) -> None:
    print(f"  stage: {name}", flush=True)


def _make_case(batch: int, context: int, seed: int, page_pool: int | None):
    """Inputs laid out as bench_attention.Batch does (distinct shuffled ids), or with ids drawn
    with repeats from ``page_pool`` pages."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pages = math.ceil(context / PAGE)
    if page_pool is None:
        num_blocks = batch * pages + 1
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()
    else:
        num_blocks = page_pool + 1
        ids = torch.randint(1, num_blocks, (batch * pages,), generator=gen, dtype=torch.int32)
    table = ids.view(batch, pages).to(DEVICE)
    cache_shape = (num_blocks, PAGE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=DEVICE)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    return table, seq_lens, k_cache, v_cache, query


def _export(table, seq_lens):
    """blocktable's export into fresh device buffers, as the benchmark sizes them."""
    import torch

    from blocktable.flashinfer import write_flashinfer_page_table

    num_reqs, width = table.shape
    kv_indptr = torch.empty(num_reqs + 1, dtype=torch.int32, device=DEVICE)
    kv_indices = torch.empty(num_reqs * width, dtype=torch.int32, device=DEVICE)
    kv_last = torch.empty(num_reqs, dtype=torch.int32, device=DEVICE)
    write_flashinfer_page_table(table, seq_lens, PAGE, kv_indptr, kv_indices, kv_last)
    return kv_indptr, kv_indices, kv_last


def _handbuilt(table, seq_lens):
    """The same CSR by torch ops on the host (what ``plan()`` reads): the independent check."""
    import torch

    seq, rows = seq_lens.cpu().long(), table.cpu()
    pages = (seq + PAGE - 1) // PAGE
    indptr = torch.zeros(seq.shape[0] + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0).int()
    indices = torch.cat([rows[r, : int(pages[r])] for r in range(seq.shape[0])]).int()
    last = (seq - (pages - 1) * PAGE).int()
    return indptr, indices, last


def _check(out, query, table, seq_lens, k_cache, v_cache) -> float:
    import torch

    group = NUM_HEADS // NUM_KV_HEADS
    n = table.shape[0]
    worst = 0.0
    for r in sorted({0, n // 2, n - 1}):
        s = int(seq_lens[r])
        rows = table[r, : math.ceil(s / PAGE)].long()
        k = k_cache[rows].flatten(0, 1)[:s].float().repeat_interleave(group, 1)
        v = v_cache[rows].flatten(0, 1)[:s].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", query[r].float(), k) / math.sqrt(HEAD_DIM)
        ref = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
        err = float((out[r].float() - ref).abs().max())
        if math.isnan(err):
            return err
        worst = max(worst, err)
    return worst


def _plan_summary(wrapper) -> str:
    info = getattr(wrapper, "_plan_info", None)
    try:
        values = info.tolist() if hasattr(info, "tolist") else list(info)
    except TypeError:
        return f"plan info: {info!r}"[:300]
    if len(values) == 15:  # 0.2.x PrefillPlanInfo: padded batch, ..., cta_tile_q, ..., split
        return (f"plan: padded_batch_size={values[0]} cta_tile_q={values[3]} "
                f"split_kv={bool(values[14])} (raw {values})")
    return f"plan info: {values}"


def _decode_once(flashinfer, batch: int, context: int, *, graph: bool, capture: bool,
                 tensor_cores: bool,
                 workspace_mib: int, handbuilt: bool, page_pool: int | None, replays: int,
                 seed: int = 0) -> float:
    import torch

    _stage(f"inputs B={batch} x {context} graph={graph} tensor_cores={tensor_cores} "
           f"workspace={workspace_mib} MiB handbuilt={handbuilt} page_pool={page_pool}")
    table, seq_lens, k_cache, v_cache, query = _make_case(batch, context, seed, page_pool)
    host = _handbuilt(table, seq_lens)
    exported = _export(table, seq_lens)
    for name, a, b in zip(("kv_indptr", "kv_indices", "kv_last_page_len"), exported, host):
        if a.shape != b.shape or not torch.equal(a.cpu(), b):
            raise AssertionError(f"blocktable's {name} differs from the torch-built CSR")
    print(f"  export == torch-built CSR; indptr[-1]={int(host[0][-1])} "
          f"indices={exported[1].numel()} cache pages={k_cache.shape[0]} "
          f"cache bytes={k_cache.numel() * 2}", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 132
    est = fa2_decode_plan_estimate(batch, math.ceil(context / PAGE), sms, graph)
    print(f"  estimate (0.2.x FA2 planner): {est}; workspace {workspace_mib * 2**20} bytes",
          flush=True)
    if handbuilt:
        plan_args = host
        buffers = tuple(t.to(DEVICE) for t in host)
    else:
        plan_args = buffers = exported
    ws = torch.zeros(workspace_mib * 2**20, dtype=torch.uint8, device=DEVICE)
    kwargs = {}
    if graph:
        kwargs = {"use_cuda_graph": True, "paged_kv_indptr_buffer": buffers[0],
                  "paged_kv_indices_buffer": buffers[1],
                  "paged_kv_last_page_len_buffer": buffers[2]}
    _stage("wrapper")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_tensor_cores=tensor_cores, **kwargs)
    _stage("plan")
    wrapper.plan(*plan_args, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    print("  " + _plan_summary(wrapper), flush=True)
    out = torch.empty_like(query)
    cache = (k_cache, v_cache)
    _stage("run")
    wrapper.run(query, cache, out=out)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    sync()
    if graph and capture:
        _stage("capture")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            wrapper.run(query, cache, out=out)
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            wrapper.run(query, cache, out=out)
        _stage(f"replay x{replays}")
        out.zero_()
        for _ in range(replays):
            cuda_graph.replay()
    else:
        _stage(f"rerun x{replays}")
        for _ in range(replays):
            wrapper.run(query, cache, out=out)
    sync()
    err = _check(out, query, table, seq_lens, k_cache, v_cache)
    print(f"  max abs error {err:.5f}", flush=True)
    return err


def _original_sequence(flashinfer) -> float:
    """What bench_attention did when it crashed, case by case: blocktable's decode timed
    eagerly and from a graph, then FlashInfer's tensor-core wrapper on a 256 MiB uninitialized
    workspace, eagerly (``do_bench``), then a CUDA-graph wrapper on the export's own buffers
    (``do_bench_cudagraph``)."""
    worst = 0.0
    for batch, context in ((256, 2048), (1024, 1024)):
        worst = max(worst, _original_case(flashinfer, batch, context))
        print(f"  B={batch} x {context} done, worst error so far {worst:.5f}", flush=True)
    return worst


def _original_case(flashinfer, batch: int, context: int) -> float:
    import torch
    import triton.testing

    from blocktable.attention import paged_attention

    name = f"original B={batch} x {context}"
    _stage(f"{name}: inputs")
    table, seq_lens, k_cache, v_cache, query = _make_case(batch, context, 0, None)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(query)

    def ours() -> None:
        paged_attention(query, k_cache, v_cache, table, seq_lens, qsl, out=out, max_query_len=1)

    _stage(f"{name}: blocktable")
    ours()
    worst = _check(out, query, table, seq_lens, k_cache, v_cache)
    triton.testing.do_bench(ours, rep=100, return_mode="median")
    triton.testing.do_bench_cudagraph(ours, rep=100, return_mode="median")
    cache = (k_cache, v_cache)
    for graph in (False, True):
        exported = _export(table, seq_lens)
        ws = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)
        kwargs = {}
        if graph:
            kwargs = {"use_cuda_graph": True, "paged_kv_indptr_buffer": exported[0],
                      "paged_kv_indices_buffer": exported[1],
                      "paged_kv_last_page_len_buffer": exported[2]}
        _stage(f"{name}: flashinfer graph={graph} plan")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=True, **kwargs)
        try:
            wrapper.plan(*exported, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE,
                         q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        except Exception as exc:  # noqa: BLE001 - the benchmark caught it and went on
            print(f"  plan raised (the benchmark went on): {exc}"[:400], flush=True)
            continue
        print("  " + _plan_summary(wrapper), flush=True)
        _stage(f"{name}: flashinfer graph={graph} run")
        fi_out = wrapper.run(query, cache)
        torch.cuda.synchronize()
        worst = max(worst, _check(fi_out, query, table, seq_lens, k_cache, v_cache))
        _stage(f"{name}: flashinfer graph={graph} timing")
        bench = triton.testing.do_bench_cudagraph if graph else triton.testing.do_bench
        run = functools.partial(wrapper.run, query, cache)
        bench(run, rep=100, return_mode="median")
        torch.cuda.synchronize()
    return worst


def run_child(variant: str, replays: int) -> int:
    faulthandler.enable()
    import flashinfer

    print(f"child {variant}: flashinfer {flashinfer.__version__}", flush=True)
    d = {"graph": True, "capture": True, "tensor_cores": True, "workspace_mib": 256, "handbuilt": False,
         "page_pool": None, "replays": replays}
    cases = {
        "eager": [(1024, 1024, {**d, "graph": False})],
        "graph": [(1024, 1024, d)],
        "graph-ws512": [(1024, 1024, {**d, "workspace_mib": 512})],
        "graph-handbuilt": [(1024, 1024, {**d, "workspace_mib": 512, "handbuilt": True})],
        "graph-cudacores": [(1024, 1024, {**d, "workspace_mib": 512, "tensor_cores": False})],
        "small-cache": [(1024, 1024, {**d, "graph": False, "page_pool": 4096}),
                        (1024, 1024, {**d, "workspace_mib": 512, "page_pool": 4096})],
        "b512x2048": [(512, 2048, {**d, "graph": False}),
                      (512, 2048, {**d, "workspace_mib": 512})],
        "bench": [(b, n, {**d, "graph": g}) for b, n in ((256, 2048), (1024, 1024))
                  for g in (False, True)],
        # Nothing captured under the sanitizer; the second runs the graph-mode plan eagerly.
        "sanitize-eager": [(1024, 1024, {**d, "graph": False, "replays": 1})],
        "sanitize-graphmode": [(1024, 1024, {**d, "capture": False, "workspace_mib": 512,
                                             "replays": 1})],
    }
    if variant == "original":
        return 0 if _original_sequence(flashinfer) <= MAX_ABS_ERR else 3
    worst = 0.0
    for batch, context, kw in cases[variant]:
        err = _decode_once(flashinfer, batch, context, **kw)
        worst = err if math.isnan(err) else max(worst, err)
    return 0 if worst <= MAX_ABS_ERR else 3


# ---------------------------------------------------------------------------------------------
# parent side


def _run(cmd: list[str], timeout_s: float) -> dict:
    """Run one child in its own process group; on timeout the whole group is killed (the
    sanitizer's target included)."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    code: int | None
    try:
        text, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        code = None
    stages = [line.split("stage: ", 1)[1] for line in text.splitlines() if "stage: " in line]
    return {"outcome": outcome(code), "returncode": code, "seconds": time.perf_counter() - start,
            "last_stage": stages[-1] if stages else None, "tail": text.splitlines()[-40:]}


def why_skipped() -> str | None:
    """Why this machine cannot run the reproduction, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return f"flashinfer is not importable ({type(exc).__name__}: {exc})"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=VARIANTS + SANITIZED,
                        help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per child")
    parser.add_argument("--sanitizer", action="store_true", help="also run compute-sanitizer")
    parser.add_argument("--sanitizer-timeout", type=float, default=300.0,
                        help="seconds per child under compute-sanitizer")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.child:
        return run_child(args.child, args.replays)

    skipped = why_skipped()
    if skipped is not None:
        print(f"skipped: {skipped}; the reproduction needs a CUDA GPU and FlashInfer")
        return 0
    import flashinfer
    import torch

    print(f"flashinfer {flashinfer.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    results: dict[str, dict] = {}
    meta = {"flashinfer": flashinfer.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name()}

    def record(name: str, res: dict, tail_lines: int) -> None:
        """Keep a child's result, print it, and rewrite the JSON (a killed run keeps the rest)."""
        results[name] = res
        print(f"{name:<16} {res['outcome']:<9} {res['seconds']:6.1f} s  last stage: "
              f"{res['last_stage']}", flush=True)
        if res["outcome"] != "ok" or name.startswith("sanitize"):
            print("\n".join("    | " + line for line in res["tail"][-tail_lines:]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**meta, "results": results}, f, indent=1)

    me = [sys.executable, os.path.abspath(__file__)]
    for variant in [v for v in args.variants.split(",") if v]:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}")
        cmd = me + ["--child", variant, "--replays", str(args.replays)]
        record(variant, _run(cmd, args.timeout), 25)
    sanitizer = shutil.which("compute-sanitizer")
    if args.sanitizer and sanitizer is None:
        print("compute-sanitizer not on PATH: sanitizer variants skipped")
    elif args.sanitizer:
        for name in SANITIZED:
            cmd = [sanitizer, "--tool", "memcheck", "--error-exitcode", "9",
                   "--print-limit", "20", *me, "--child", name, "--replays", "1"]
            record(name, _run(cmd, args.sanitizer_timeout), 20)
    return 0 if all(r["outcome"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
