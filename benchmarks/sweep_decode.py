"""Sweep the decode kernel's configurations on one GPU: splits, tiles, warps, stages, combine.

bf16, 32 query / 8 KV heads, head dim 128, page 16, one query per request. For each case and
each configuration of the grid it checks the output against a float32 computation on sampled
requests, then times it two ways:

- ``graph``: a CUDA graph of 20 calls replayed; the median replay over 20 (device time, L2
  warm, no host work);
- ``flushed``: device time with a flushed L2: one call between two CUDA events with L2 flushed
  before it (``do_bench``, median), host work of the launch included where the device waits
  for it (not an eager call's wall time). Configurations other than
  the default run through a prebuilt :class:`~blocktable.attention.decode_plan.DecodePlan` (the
  launch path of a repeated public call, without its metadata lookup).

For the default configuration it also times the public ``paged_attention`` call: ``flushed``
as above, ``host`` (the host time of one call with the GPU idle, median) and ``loop`` (100
calls back to back between two events, per call: what a host-bound step sees).

``--quick`` (under a minute): the public call (graph, flushed) at the 6 decode shapes of
``bench_attention.py``, and at B=1 x 8192, 1 x 131072 and 8 x 32768 the configuration the
default rule picks (``decode_schedule``, marked ``rule:``) beside it with one choice
changed at a time: splits 16 / 32 / 64, stages 2 / 3, block ids prefetched / per block,
combine fused / kernel. The rule holds where its row is the fastest of its case (within
noise).

Full grid (without ``--quick``; the first 4 shapes unless ``--cases``):
num_kv_splits {16, 32, 64, 128} x decode_block_n {32, 64, 128} x num_warps {4, 8} x
num_stages {2, 3, 4} x combine {fused, kernel} x block ids {prefetched, per block}. A
configuration that does not compile (shared memory) is
reported as failed and skipped. ``--smoke`` runs tiny shapes under Triton's interpreter (no
timing); ``--host-cpu`` times the public call's host work on the CPU with the launches
replaced by no-ops.

    python benchmarks/sweep_decode.py [--quick] [--json out.json] [--cases 1x8192 8x32768]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from run_info import run_info

if "--smoke" in sys.argv or "--host-cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.testing
from bench_attention import Batch, Shape
from cuda_graphs import capture

from blocktable.attention import KernelConfig, paged_attention
from blocktable.attention.cp_layout import CPLayout
from blocktable.attention.decode_plan import (
    DecodePlan,
    DecodeWorkspace,
    tensor_strides,
)
from blocktable.attention.kernel_config import DecodeSchedule, decode_schedule, default_config
from blocktable.attention.triton_decode import default_num_kv_splits

CASES = {"1x8192": (1, 8192), "1x131072": (1, 131072), "8x32768": (8, 32768),
         "64x4096": (64, 4096), "256x2048": (256, 2048), "1024x1024": (1024, 1024)}
FULL_CASES = ["1x8192", "1x131072", "8x32768", "64x4096"]  # the full grid's default
RULE_CASES = ["1x8192", "1x131072", "8x32768"]  # --quick: the rule's variants here
GRAPH_CALLS = 20
BF16_TOLERANCE = 3e-2  # max abs error against float32 on unit-variance values


@dataclass
class Row:
    case: str
    config: str
    graph_us: float | None
    flushed_us: float | None  # device time with a flushed L2 (do_bench)
    max_err: float | None = None
    host_us: float | None = None
    loop_us: float | None = None
    note: str = ""


def graph_us(fn: Callable[[], object], replays: int = 7) -> float:
    """Median time per call of a CUDA graph of ``GRAPH_CALLS`` calls."""
    graph = capture(fn, GRAPH_CALLS, warmup=1)  # compiled and planned before the capture
    for _ in range(2):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS)
    return statistics.median(times)


def flushed_us(fn: Callable[[], object]) -> float:
    """``do_bench``'s median: L2 flushed before each call, CUDA events around it."""
    return triton.testing.do_bench(fn, warmup=2, rep=10, return_mode="median") * 1e3


def host_us(fn: Callable[[], object], n: int = 200) -> float:
    """Median host time of one call issued to an idle GPU."""
    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def loop_us(fn: Callable[[], object], n: int = 100) -> float:
    """Per call of ``n`` calls back to back (no flush): max of host and device time."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


@dataclass(frozen=True)
class Variant:
    """What a row runs: the configuration users tune and the schedule the rule would choose."""

    config: KernelConfig
    schedule: DecodeSchedule


def grid(base: KernelConfig, quick: bool) -> list[Variant]:
    splits = (32, 64) if quick else (16, 32, 64, 128)
    block_n = (64, 128) if quick else (32, 64, 128)
    warps = (4,) if quick else (4, 8)
    stages = (2, 3) if quick else (2, 3, 4)
    rep = dataclasses.replace
    return [
        Variant(rep(base, num_kv_splits=s, decode_block_n=n, decode_num_warps=w,
                    decode_num_stages=st), DecodeSchedule(fused, per_block, st))
        for s, n, w, st, fused, per_block in itertools.product(
            splits, block_n, warps, stages, (True, False), (False, True))
    ]


def rule_variants(base: KernelConfig, splits: int, num_reqs: int, num_kv_heads: int,
                  width: int, block_size: int) -> list[Variant]:
    """The schedule the default rule picks for the shape (first), then the same with one
    choice changed: splits 16 / 32 / 64, stages 2 / 3, block ids prefetched / per block,
    combine fused / kernel."""
    config = dataclasses.replace(base, num_kv_splits=splits)
    rule = Variant(config, decode_schedule(base, splits, num_reqs, num_kv_heads, width,
                                           block_size))
    rep = dataclasses.replace
    variants = [Variant(rep(config, num_kv_splits=s), rule.schedule) for s in (16, 32, 64)]
    variants += [Variant(config, rep(rule.schedule, num_stages=st)) for st in (2, 3)]
    variants += [Variant(config, rep(rule.schedule, per_block_ids=b)) for b in (False, True)]
    variants += [Variant(config, rep(rule.schedule, fused_combine=f)) for f in (True, False)]
    return [rule] + [v for v in dict.fromkeys(variants) if v != rule]


def describe(v: Variant) -> str:
    c, sch = v.config, v.schedule
    combine = ("nocombine" if c.num_kv_splits == 1 else "fused" if sch.fused_combine
               else "kernel")
    splits = "(default)" if c.num_kv_splits is None else c.num_kv_splits
    return (f"splits{splits} n{c.decode_block_n} w{c.decode_num_warps} "
            f"s{sch.num_stages} {'ids-per-block' if sch.per_block_ids else 'ids-prefetched'} "
            f"{combine}")


def plan_runner(batch: Batch, variant: Variant) -> Callable[[], None]:
    """A repeated decode call with ``variant``: the plan's launches only."""
    tensors = (batch.out, None, batch.query, batch.k_cache, batch.v_cache, batch.block_table,
               batch.seq_lens, batch.query_start_loc, None)
    strides = tensor_strides(batch.out, None, batch.query, batch.k_cache, batch.v_cache,
                             batch.block_table)
    plan = DecodePlan.build(
        DecodeWorkspace(batch.query.device), batch.out, None, batch.query, batch.k_cache,
        batch.block_table, batch.seq_lens, batch.query_start_loc, None,
        1.0 / math.sqrt(batch.shape.head_dim), None, CPLayout(), strides, decode_only=True,
        config=variant.config, schedule=variant.schedule,
    )
    assert plan is not None
    ptrs = (batch.query.data_ptr() | batch.k_cache.data_ptr() | batch.v_cache.data_ptr()
            | batch.out.data_ptr())
    aligned = ptrs % 16 == 0
    return lambda: plan.run(*tensors, aligned)


def public_runner(batch: Batch) -> Callable[[], object]:
    return lambda: paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens,
        batch.query_start_loc, out=batch.out, max_query_len=1,
    )


class WrongResult(Exception):
    """An output differs from the float32 reference by more than the tolerance."""


def checked(batch: Batch, fn: Callable[[], object]) -> float:
    batch.out.fill_(float("nan"))
    fn()
    err = batch.check(batch.out)
    if not err <= BF16_TOLERANCE:  # NaN too
        raise WrongResult(f"max abs error {err} against float32")
    return err


def sweep_case(rows: list[Row], name: str, batch: Batch, configs: list[Variant],
               smoke: bool, host_loop: bool = True, rule: Variant | None = None) -> None:
    """Time the public call, then each of ``configs`` (``rule``'s row marked ``rule:``)."""
    public = public_runner(batch)
    err = checked(batch, public)
    row = Row(name, "default (public call)", None, None, err)
    if not smoke:
        row.graph_us, row.flushed_us = graph_us(public), flushed_us(public)
        if host_loop:
            row.host_us, row.loop_us = host_us(public), loop_us(public)
    rows.append(row)
    print(f"{name}: default graph {row.graph_us} flushed {row.flushed_us} host {row.host_us} "
          f"loop {row.loop_us}", flush=True)
    for config in configs:
        label = ("rule: " if config == rule else "") + describe(config)
        try:
            fn = plan_runner(batch, config)
            err = checked(batch, fn)
            g = e = None
            if not smoke:
                g, e = graph_us(fn), flushed_us(fn)
        except WrongResult as exc:
            rows.append(Row(name, label, None, None, note=f"WRONG: {exc}"[:100]))
            continue
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report, go on
            rows.append(Row(name, label, None, None, note=f"failed: {exc}"[:100]))
            continue
        rows.append(Row(name, label, g, e, err))


def print_table(rows: list[Row]) -> None:
    def f(v: float | None, d: int = 1) -> str:
        return "" if v is None else f"{v:.{d}f}"

    print(f"\n{'case':<9} {'config':<46} {'graph us':>9} {'flushed us':>11} {'host us':>8} "
          f"{'loop us':>8} {'max err':>8} note")
    print("-" * 112)
    for r in rows:
        print(f"{r.case:<9} {r.config:<46} {f(r.graph_us):>9} {f(r.flushed_us):>11} "
              f"{f(r.host_us):>8} {f(r.loop_us):>8} {f(r.max_err, 4):>8} {r.note}")
    print("\nbest per case (graph / flushed):")
    for case in dict.fromkeys(r.case for r in rows):
        timed = [r for r in rows if r.case == case and r.graph_us is not None]
        if not timed:
            continue
        bg = min(timed, key=lambda r: r.graph_us)  # type: ignore[arg-type, return-value]
        be = min(timed, key=lambda r: r.flushed_us)  # type: ignore[arg-type, return-value]
        print(f"  {case:<9} graph {bg.graph_us:.1f} us ({bg.config}); "
              f"flushed {be.flushed_us:.1f} us ({be.config})")


class _NoLaunch:
    """Stands for a :class:`~blocktable._triton.Launcher` whose kernel launch costs nothing."""

    def __call__(self, grid: tuple[int, ...], *args: object, num_warps: int = 4) -> None:
        pass

    def bind(self, args: tuple[object, ...], num_warps: int = 4) -> Callable[..., None]:
        return lambda grid, *call_args: None


def host_cpu(n: int = 5000) -> None:
    """Host work of the public decode call at B=1 x 8192 (bf16, 32/8 heads, dim 128, 32
    splits) on CPU tensors, the kernel launches replaced by no-ops: checks, metadata lookup,
    argument assembly (not the launcher's own C code and driver call)."""
    from blocktable.attention import decode_plan

    for name in ("_decode_launch", "_decode_launch_unaligned", "_combine_launch"):
        setattr(decode_plan, name, _NoLaunch())
    batch = Batch(Shape(), [8192], [1], "cpu")
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_table, batch.seq_lens,
            batch.query_start_loc)
    empty = torch.zeros(0)
    calls = {
        "public call, 32 splits": lambda: paged_attention(
            *args, out=batch.out, max_query_len=1, num_kv_splits=32, backend="triton"),
        "empty torch op (floor)": lambda: empty.add_(0),
    }
    for label, fn in calls.items():
        for _ in range(200):
            fn()
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        print(f"{label}: {statistics.median(samples) * 1e6:.2f} us (median of {n})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true",
                        help="the public call at 6 shapes, the default rule's variants at 3")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--cases", nargs="+", choices=list(CASES),
                        help="default: all 6 with --quick, else the first 4")
    parser.add_argument("--host-cpu", action="store_true",
                        help="only the public call's host work on the CPU, launches no-ops")
    args = parser.parse_args()
    if args.host_cpu:
        host_cpu()
        return 0
    if args.smoke:
        device = "cpu"
        shape = Shape(num_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                      dtype=torch.float32)
        cases = {"2x40": (2, 40), "1x9": (1, 9)}
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --smoke)", file=sys.stderr)
            return 2
        device, shape = "cuda", Shape()
        names = args.cases or (list(CASES) if args.quick else FULL_CASES)
        cases = {name: CASES[name] for name in names}
    base = default_config(shape.head_dim, shape.num_heads // shape.num_kv_heads,
                          torch.tensor([], dtype=shape.dtype).element_size())
    configs = [] if args.quick else grid(base, args.smoke)
    if args.smoke:
        configs = [Variant(dataclasses.replace(v.config, decode_block_n=16, decode_num_stages=1),
                           dataclasses.replace(v.schedule, num_stages=1))
                   for v in configs[::6]]
    rows: list[Row] = []
    t0 = time.monotonic()
    for name, (num_reqs, seq_len) in cases.items():
        batch = Batch(shape, [seq_len] * num_reqs, [1] * num_reqs, device)
        splits = default_num_kv_splits(num_reqs, shape.num_kv_heads, batch.width,
                                       batch.query.device, shape.page_size)
        print(f"{name}: default num_kv_splits {splits}", flush=True)
        case_configs, rule = configs, None
        if (args.quick and name in RULE_CASES) or args.smoke:
            variants = rule_variants(base, splits, num_reqs, shape.num_kv_heads, batch.width,
                                     shape.page_size)
            if args.smoke:
                variants = [Variant(dataclasses.replace(v.config, decode_block_n=16), v.schedule)
                            for v in variants]
            rule = variants[0]
            case_configs = variants + configs
        sweep_case(rows, name, batch, case_configs, args.smoke, host_loop=not args.quick,
                   rule=rule)
        del batch
        if args.json:
            write_json(args.json, rows, device)
    print_table(rows)
    print(f"\n{len(rows)} rows in {time.monotonic() - t0:.0f} s")
    if args.json:
        write_json(args.json, rows, device)
    wrong = [r for r in rows if r.note.startswith("WRONG")]
    if wrong:
        print(f"FAILED: {len(wrong)} configs with a wrong result", file=sys.stderr)
        return 1
    return 0


def write_json(path: str, rows: list[Row], device: str) -> None:
    with open(path, "w") as f:
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "torch": torch.__version__, "triton": triton.__version__}
        json.dump({"run": run_info(), "meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
