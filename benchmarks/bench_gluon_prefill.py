"""The Gluon prefill kernel against the Triton one and PyTorch SDPA on one Hopper GPU.

Usage: ``PYTHONPATH=src python benchmarks/bench_gluon_prefill.py [--json PATH] [--sweep]``

bf16, 32 query / 8 KV heads, head dim 128, page 16 (bench_attention.py's shape), causal
prefills of 1 x 8,192, 4 x 2,048 and 16 x 512 tokens, every request a prefill (the prefill
kernel alone runs). SDPA runs dense, non-paged, KV heads expanded. Each implementation is
timed in ``--rounds`` rounds, alternated, two ways: replayed from a CUDA graph that zeroes a
256 MB buffer (flushing L2) before each call and records CUDA events around the call alone, so
the host's launch cost never enters ("graph", the figure the TFLOP/s come from); and by
``triton.testing.do_bench`` (the same flush, then events around one eager call: when the host
takes longer to launch than the card to run the flush and the call, the host's time shows
there, "events"). Each row gives the median over every sample of every round and the lowest
and highest round median, and the host's wall time per eager call (50 calls queued back to
back, the card's work not waited for: what a launch costs the host). TFLOP/s count the causal
mask's visible pairs exactly, and are set against the card's own dense bf16 rate measured in
the same run (an 8,192-cube ``torch.matmul``, ``do_bench`` median; about 790 TFLOP/s on an
H200). ``--sweep`` adds the Gluon kernel with other tile shapes; ``--decode`` adds batch-1
decode at 8,192 keys, replayed from a CUDA graph. When FlashInfer imports, each of its prefill
backends (``flashinfer_configs``: FA3 and FA2) reads blocktable's CSR export of the same batch
and is timed in the same rounds (its ``plan()`` outside the timing); a backend that fails to
build or run is reported and left out. A result off float32 attention by more than
``MAX_ABS_ERR`` exits with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import (
    MAX_ABS_ERR,
    Batch,
    Shape,
    describe_flashinfer,
    flashinfer,
    flashinfer_configs,
    flashinfer_runner,
    sdpa_runner,
)
from cuda_graphs import capture
from run_info import run_info

from blocktable.attention import (
    PagedAttention,
    paged_attention,
    prefill_launch,
)
from blocktable.attention.kernel_config import default_config

PREFILL_CASES = [(1, 8192), (4, 2048), (16, 512)]
SWEEP = [  # other launch shapes of the Gluon kernel (--sweep)
    prefill_launch.GluonTiles(programs_per_sm=0),
    prefill_launch.GluonTiles(stages=3),
    prefill_launch.GluonTiles(block_n=128, stages=2),
]


def tiles_name(t: prefill_launch.GluonTiles) -> str:
    """``gluon`` and the fields where ``t`` differs from the default launch."""
    default = prefill_launch.GluonTiles()
    changed = [f"{f.name}={getattr(t, f.name)}" for f in dataclasses.fields(t)
               if getattr(t, f.name) != getattr(default, f.name)]
    return " ".join(["gluon", *changed])


def paged_runner(batch: Batch, kernel: str, tiles: prefill_launch.GluonTiles | None = None):
    shape = batch.shape
    config = dataclasses.replace(
        default_config(shape.head_dim, shape.num_heads // shape.num_kv_heads),
        prefill_kernel=kernel,
    )
    attention = PagedAttention(batch.query.device, config)
    n = batch.max_query_len

    def run() -> torch.Tensor:
        if tiles is not None:
            prefill_launch.GLUON_TILES = tiles
        try:
            return attention(
                batch.query, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens,
                batch.query_start_loc, out=batch.out, max_query_len=n, min_query_len=n,
            )
        finally:
            prefill_launch.GLUON_TILES = prefill_launch.GluonTiles()

    return run


def matmul_tflops(n: int = 8192) -> float:
    """The card's dense bf16 rate: an ``n``-cube ``torch.matmul``, ``do_bench`` median."""
    import triton

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: torch.matmul(a, b), rep=200, return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


FLUSH_BYTES = 256 * 1024 * 1024  # what do_bench zeroes: far more than any card's L2


class GraphTimer:
    """Calls of ``fn`` captured in one CUDA graph, each after an L2 flush, timed by events
    recorded inside the graph around the call alone: device time, no host time, no flush."""

    def __init__(self, fn, calls: int = 20):
        self.flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        self.starts = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(calls)]
        self.ends = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(calls)]
        count = itertools.count()

        def timed_call() -> None:
            # (the warm-up calls before capture take some pairs too: modulo ``calls``, the
            # captured calls still record each pair once)
            k = next(count) % calls
            self.flush.zero_()
            self.starts[k].record()
            fn()
            self.ends[k].record()

        self.graph = capture(timed_call, calls)

    def samples_us(self, rep_ms: int) -> list[float]:
        """Replays for about ``rep_ms`` of wall time; every call's time, in microseconds."""
        out: list[float] = []
        deadline = time.perf_counter() + rep_ms * 1e-3
        while not out or time.perf_counter() < deadline:
            self.graph.replay()
            torch.cuda.synchronize()
            out += [s.elapsed_time(e) * 1e3 for s, e in zip(self.starts, self.ends)]
        return out


def summary(runs: list[list[float]]) -> dict[str, object]:
    return {"median_us": statistics.median([t for r in runs for t in r]),
            "round_medians_us": [statistics.median(r) for r in runs]}


def host_us_per_call(fn, calls: int = 50) -> float:
    """The host's wall time of one eager call, queued behind the ones before it (the launch's
    Python and driver work; the card's work is not waited for)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def measure(fns: dict[str, object], rounds: int, rep_ms: int) -> dict[str, dict]:
    """``{name: {"graph": summary, "events": summary, "host_us_per_call": [per round]}}``; an
    implementation that cannot be captured has ``"graph": None`` (and the reason under
    ``"graph_error"``)."""
    import triton

    timers: dict[str, GraphTimer | None] = {}
    errors: dict[str, str] = {}
    for name, fn in fns.items():
        try:
            timers[name] = GraphTimer(fn)
        except Exception as exc:  # noqa: BLE001 - reported, and that implementation untimed
            timers[name] = None
            errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"{name}: not captured in a CUDA graph ({errors[name]})")
            torch.cuda.synchronize()
    graph: dict[str, list[list[float]]] = {name: [] for name in fns}
    events: dict[str, list[list[float]]] = {name: [] for name in fns}
    host: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            host[name].append(host_us_per_call(fn))
            if timers[name] is not None:
                graph[name].append(timers[name].samples_us(rep_ms))
            events[name].append(
                [t * 1e3 for t in triton.testing.do_bench(fn, rep=rep_ms, return_mode="all")]
            )
    return {name: {"graph": summary(graph[name]) if graph[name] else None,
                   "graph_error": errors.get(name), "events": summary(events[name]),
                   "host_us_per_call": host[name]}
            for name in fns}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--decode", action="store_true")
    args = parser.parse_args()
    shape = Shape()
    rows = []
    failed = False
    peak_tflops = matmul_tflops()
    print(f"dense bf16 matmul on this card: {peak_tflops:.1f} TFLOP/s")
    for b, n in PREFILL_CASES:
        batch = Batch(shape, [n] * b, [n] * b, "cuda")
        fns = {"gluon": paged_runner(batch, "gluon"), "triton": paged_runner(batch, "triton")}
        if args.sweep:
            for t in SWEEP:
                fns[tiles_name(t)] = paged_runner(batch, "gluon", t)
        errors = {}
        for name, fn in fns.items():
            batch.out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            errors[name] = batch.check(batch.out)
            if not errors[name] <= MAX_ABS_ERR:
                print(f"FAILED: {name} {b} x {n}: max abs error {errors[name]}")
                failed = True
        for config in flashinfer_configs(decode=False) if flashinfer is not None else []:
            name = f"flashinfer {flashinfer.__version__} {describe_flashinfer(config)}"
            try:
                fn = flashinfer_runner(batch, decode=False, graph=False, config=config)
                out = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a backend this build or card lacks
                print(f"{name}: not timed ({type(exc).__name__}: {str(exc)[:200]})")
                continue
            errors[name] = batch.check(out)
            if not errors[name] <= MAX_ABS_ERR:
                print(f"FAILED: {name} {b} x {n}: max abs error {errors[name]}")
                failed = True
            fns[name] = fn
        fns["sdpa"] = sdpa_runner(batch)
        flops = batch.causal_flops()
        for name, r in measure(fns, args.rounds, args.rep_ms).items():
            timed = r["graph"] or r["events"]
            tflops = flops / (timed["median_us"] * 1e-6) / 1e12
            row = {"case": f"prefill causal {b} x {n}", "impl": name, **r,
                   "tflops_from": "graph" if r["graph"] else "events", "tflops": tflops,
                   "of_peak": tflops / peak_tflops, "max_abs_err": errors.get(name)}
            rows.append(row)
            text = []
            for how in ("graph", "events"):
                if r[how] is not None:
                    rm = r[how]["round_medians_us"]
                    text.append(f"{how} {r[how]['median_us']:7.1f} us ({min(rm):.1f}-{max(rm):.1f})")
            text.append(f"host {statistics.median(r['host_us_per_call']):.0f} us/call")
            print(f"{row['case']:<26} {name:<26} {'  '.join(text)}  {tflops:6.1f} TFLOP/s "
                  f"from {row['tflops_from']} ({tflops / peak_tflops:.0%} of the matmul rate)  "
                  f"err {errors.get(name)}")
        del batch
        torch.cuda.empty_cache()
    if args.decode:
        import triton

        batch = Batch(shape, [8192], [1], "cuda")
        fn = lambda: paged_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens,
            batch.query_start_loc, out=batch.out, max_query_len=1,
        )
        fn()
        err = batch.check(batch.out)
        failed |= not err <= MAX_ABS_ERR
        graph = [triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
                 for _ in range(args.rounds)]
        eager = [triton.testing.do_bench(fn, rep=200, return_mode="median") * 1e3
                 for _ in range(args.rounds)]
        row = {"case": "decode 1 x 8192", "impl": "triton", "graph_round_medians_us": graph,
               "eager_round_medians_us": eager, "max_abs_err": err}
        rows.append(row)
        print(f"decode 1 x 8192: graph {statistics.median(graph):.2f} us "
              f"({min(graph):.2f}-{max(graph):.2f}), eager (CUDA events around one call) "
              f"{statistics.median(eager):.2f} us, err {err}")
    info = run_info()
    info["gpu"] = torch.cuda.get_device_name()
    import triton

    info["triton"] = triton.__version__
    info["flashinfer"] = None if flashinfer is None else flashinfer.__version__
    info["dense_bf16_matmul_tflops"] = peak_tflops
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    print(json.dumps(info))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
