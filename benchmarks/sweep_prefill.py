"""Sweep the prefill kernel's variants (KernelConfig options) beside torch's dense SDPA.

bf16, 32 query / 8 KV heads, head dim 128, page 16, causal prefills 1 x 8192, 4 x 2048 and
16 x 512 (and, unless ``--quick``, the mixed step: 255 decodes + one 7937-token chunk over a
4096-token cached prefix). Every variant is first checked on every token against torch's SDPA
run on the same K/V gathered contiguous (a variant that fails the check is reported, not
timed), then timed with ``triton.testing.do_bench`` (median); TFLOP/s are counted exactly from
the causal mask. SDPA (dense, contiguous K/V, ``is_causal=True``) is timed in the same run.
Variants are compiled once and reused by every case. Before the sweep, one child process per
variant compiles and runs it on a small batch of the same shapes (in parallel: Triton's cache
then serves the sweep's compilations), so that a variant whose compilation crashes the
process (or fails) is reported and skipped without ending the sweep. ``--smoke`` runs tiny
float32 shapes on the CPU under Triton's interpreter (checks only, no timing).

    PYTHONPATH=src python benchmarks/sweep_prefill.py [--quick] [--json out.json]
        [--only NAME,NAME] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from run_info import run_info

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.testing
from bench_attention import Batch, Shape

from blocktable.attention.launch import (
    HAS_WS_RANGE,
    CPLayout,
    KernelConfig,
    default_config,
    launch_paged_attention,
)

# Checks against SDPA (itself rounded to bf16): two ulps of bf16 at |x| < 8 (a wrong tile
# makes O(1) errors), and the relative error of the whole output.
MAX_ABS_ERR = {torch.bfloat16: 6.25e-2, torch.float16: 1e-2, torch.float32: 1e-4}
MAX_REL_ERR = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
SMOKE_SHAPE = Shape(num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32)


def variants(base: KernelConfig, quick: bool) -> dict[str, KernelConfig]:
    """Named configurations: the default first, warp-specialized ones last (the riskiest to
    compile). ``quick``: the few most likely to matter.

    What each one asks: ``prescale`` (one multiply per score less; q computed in registers),
    ``pair*`` (equal causal work per program, half the programs: for 16 x 512, where each
    program's start-up latency is exposed), ``m64*``/``*n32*`` (smaller tiles, so that several
    programs share an SM and hide each other's latency and softmax), ``nopack`` (128 tokens of
    one head per tile, K/V of the group shared through L2), ``radix64`` (one level of request
    search up to 63 requests), ``ws*`` (Triton's warp specialization: ``ws`` every loop,
    ``ws-main`` the unmasked loop only)."""
    rep = dataclasses.replace
    pre = {"prefill_prescale_q": True, "prefill_ids_mode": 2}
    ws = {**pre, "prefill_warp_specialize": 1}
    out = {
        "default": base,
        "prescale": rep(base, **pre),
        "pair": rep(base, prefill_pair_tiles=True),
        "pair-prescale-m64": rep(base, prefill_pair_tiles=True, prefill_block_m=64,
                                 prefill_num_warps=4, **pre),
        "pair-m64-w4-s2": rep(base, prefill_pair_tiles=True, prefill_block_m=64,
                              prefill_num_warps=4, prefill_num_stages=2, **pre),
        "m64-n32-w4-s2": rep(base, prefill_block_m=64, prefill_block_n=32, prefill_num_warps=4,
                             prefill_num_stages=2, **pre),
        "nopack-prescale": rep(base, prefill_pack_gqa=False, **pre),
        "prescale-radix64": rep(base, prefill_search_radix=64, **pre),
        "n128-s2-prescale": rep(base, prefill_block_n=128, prefill_num_stages=2, **pre),
        "m64-w4-prescale": rep(base, prefill_block_m=64, prefill_num_warps=4, **pre),
        "n128": rep(base, prefill_block_n=128),
        "n128-nopack": rep(base, prefill_block_n=128, prefill_pack_gqa=False),
        "nopack": rep(base, prefill_pack_gqa=False),
        "ids1": rep(base, prefill_ids_mode=1),
        "n128-ids1": rep(base, prefill_block_n=128, prefill_ids_mode=1),
        "n128-s4": rep(base, prefill_block_n=128, prefill_num_stages=4),
        "s2": rep(base, prefill_num_stages=2),
        "s4": rep(base, prefill_num_stages=4),
        "m64-w4": rep(base, prefill_block_m=64, prefill_num_warps=4),
        "m64-w4-s2": rep(base, prefill_block_m=64, prefill_num_warps=4, prefill_num_stages=2),
        "m64-w4-s4": rep(base, prefill_block_m=64, prefill_num_warps=4, prefill_num_stages=4),
        "m64-w4-n128": rep(base, prefill_block_m=64, prefill_num_warps=4, prefill_block_n=128),
        "ws": rep(base, **ws),
        "ws-main": rep(base, **{**ws, "prefill_warp_specialize": 2}),
        "ws-w4": rep(base, prefill_num_warps=4, **ws),
        "ws-nopack": rep(base, prefill_pack_gqa=False, **ws),
        "ws-n128-s2": rep(base, prefill_block_n=128, prefill_num_stages=2, **ws),
    }
    if quick:
        keep = ("default", "prescale", "pair", "m64-n32-w4-s2", "ws", "ws-main")
        out = {k: v for k, v in out.items() if k in keep}
    if not HAS_WS_RANGE:
        out = {k: v for k, v in out.items() if not v.prefill_warp_specialize}
    return out


def describe(c: KernelConfig) -> str:
    return (f"m{c.prefill_block_m} n{c.prefill_block_n} w{c.prefill_num_warps} "
            f"s{c.prefill_num_stages} ids{c.prefill_ids_mode}"
            + ("" if c.prefill_pack_gqa else " nopack")
            + (" prescale" if c.prefill_prescale_q else "")
            + (f" ws{c.prefill_warp_specialize}" if c.prefill_warp_specialize else "")
            + (" pair" if c.prefill_pair_tiles else "")
            + (f" radix{c.prefill_search_radix}" if c.prefill_search_radix != 16 else ""))


@dataclass
class Row:
    case: str
    variant: str
    config: str
    us: float | None
    tflops: float | None
    max_abs_err: float | None
    note: str = ""


def dense_kv(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of equal-length requests gathered contiguous, KV heads expanded to the query
    heads: ``[num_reqs, num_heads, seq_len, head_dim]`` each."""
    shape, page = batch.shape, batch.shape.page_size
    group = shape.num_heads // shape.num_kv_heads
    n = batch.seq_lens_list[0]
    rows = batch.block_table[:, : math.ceil(n / page)].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        dense = cache[rows].flatten(1, 2)[:, :n]  # [reqs, n, kv_heads, dim]
        return dense.transpose(1, 2).repeat_interleave(group, 1).contiguous()

    return gather(batch.k_cache), gather(batch.v_cache)


def sdpa_out(batch: Batch, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Causal SDPA on the batch's own queries as ``[num_reqs, heads, n, dim]``; returns the
    output in the kernel's ``[num_tokens, heads, dim]`` layout when called."""
    b, n = len(batch.seq_lens_list), batch.seq_lens_list[0]
    q = batch.query.view(b, n, *batch.query.shape[1:]).transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(batch.query.shape)


def launcher(batch: Batch, config: KernelConfig) -> Callable[[], None]:
    scale = 1.0 / math.sqrt(batch.shape.head_dim)
    decode_only = batch.max_query_len <= 4
    return lambda: launch_paged_attention(
        batch.out, None, batch.query, batch.k_cache, batch.v_cache, batch.block_table,
        batch.seq_lens, batch.query_start_loc, None, scale, None, CPLayout(),
        decode_only=decode_only, config=config,
    )


def bench(fn: Callable[[], object], smoke: bool, rep_ms: int) -> float | None:
    if smoke:
        fn()
        return None
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e3


def run_case(rows: list[Row], label: str, batch: Batch, configs: dict[str, KernelConfig],
             broken: set[str], args: argparse.Namespace, equal_lengths: bool) -> None:
    flops = batch.causal_flops()

    def tf(us: float | None) -> float | None:
        return None if us is None else flops / (us * 1e-6) / 1e12

    ref = None
    if equal_lengths:
        k, v = dense_kv(batch)
        sdpa = sdpa_out(batch, k, v)
        ref = sdpa().float()
        us = bench(sdpa, args.smoke, args.rep_ms)
        rows.append(Row(label, "sdpa", "torch dense, is_causal", us, tf(us), None))
        print_row(rows[-1])
        del k, v
    tol = MAX_ABS_ERR[batch.shape.dtype]
    for name, config in configs.items():
        if name in broken:
            continue
        fn = launcher(batch, config)
        try:
            batch.out.fill_(float("nan"))
            t0 = time.perf_counter()
            fn()
            if batch.out.is_cuda:
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            if ref is not None:
                diff = batch.out.float() - ref
                err = float(diff.abs().max())
                rel = float(diff.norm() / ref.norm())
            else:  # float32 attention on sampled requests
                err, rel = batch.check(batch.out), 0.0
        except Exception as exc:  # noqa: BLE001 - e.g. a variant this Triton cannot compile
            broken.add(name)
            rows.append(Row(label, name, describe(config), None, None, None,
                            f"failed: {type(exc).__name__}: {exc}"[:160]))
            print_row(rows[-1])
            continue
        rel_tol = MAX_REL_ERR[batch.shape.dtype]
        if not (math.isfinite(err) and math.isfinite(rel)) or err > tol or rel > rel_tol:
            rows.append(Row(label, name, describe(config), None, None, err,
                            f"WRONG (max abs err > {tol} or rel err {rel:.2e} > {rel_tol})"))
            print_row(rows[-1])
            continue
        us = bench(fn, args.smoke, args.rep_ms)
        rows.append(Row(label, name, describe(config), us, tf(us), err,
                        f"first call {first_s:.1f} s" if first_s > 1 else ""))
        print_row(rows[-1])


def print_row(r: Row) -> None:
    def f(v: float | None, d: int = 1) -> str:
        return "" if v is None else f"{v:.{d}f}"

    print(f"{r.case:<26} {r.variant:<20} {r.config:<40} {f(r.us):>9} {f(r.tflops):>8} "
          f"{f(r.max_abs_err, 4):>8} {r.note}", flush=True)


def print_summary(rows: list[Row]) -> None:
    print(f"\n{'case':<26} {'variant':<20} {'config':<40} {'us':>9} {'TFLOP/s':>8} "
          f"{'max err':>8} note")
    print("-" * 124)
    for r in rows:
        print_row(r)
    print("\nbest per case (TFLOP/s; / SDPA; / default)")
    for case in dict.fromkeys(r.case for r in rows):
        mine = [r for r in rows if r.case == case and r.variant != "sdpa" and r.us]
        if not mine:
            continue
        best = min(mine, key=lambda r: r.us)  # type: ignore[arg-type, return-value]
        sdpa = next((r for r in rows if r.case == case and r.variant == "sdpa" and r.us), None)
        default = next((r for r in mine if r.variant == "default"), None)
        parts = [f"{case:<26} {best.variant:<20} {best.us:.1f} us"]
        if best.tflops:
            parts.append(f"{best.tflops:.0f} TFLOP/s")
        if sdpa is not None and sdpa.us:
            parts.append(f"/ SDPA {sdpa.us / best.us:.2f}")  # type: ignore[operator]
        if default is not None and default.us:
            parts.append(f"/ default {default.us / best.us:.2f}")  # type: ignore[operator]
        print("  " + " ".join(parts))


def probe(name: str, smoke: bool) -> int:
    """Child process: compile and run variant ``name`` on one 256-token prefill (the table's
    width a multiple of 16, as in the sweep's equal-length cases) and on a small mixed step
    (a width that is not), so that the sweep finds both specializations in Triton's cache."""
    shape, device = (SMOKE_SHAPE, "cpu") if smoke else (Shape(), "cuda")
    base = default_config(shape.head_dim, shape.num_heads // shape.num_kv_heads,
                          shape.dtype.itemsize)
    config = variants(base, False)[name]
    batch = Batch(shape, [256], [256], device, seed=2)
    k, v = dense_kv(batch)
    ref = sdpa_out(batch, k, v)().float()
    launcher(batch, config)()
    err = float((batch.out.float() - ref).abs().max())
    # The mixed step's specialization too (a table width that is not a multiple of 16).
    mixed = Batch(shape, [40] * 3 + [263], [1] * 3 + [63], device, seed=3)
    launcher(mixed, config)()
    err = max(err, mixed.check(mixed.out))
    print(f"probe {name}: max abs err {err:.4f}")
    return 0 if err <= MAX_ABS_ERR[shape.dtype] else 3


def warm(names: list[str], timeout_s: float, smoke: bool) -> dict[str, str]:
    """Probe every variant in its own process, all at once; the failures: name -> note."""
    extra = ["--smoke"] if smoke else []
    procs = {
        n: subprocess.Popen([sys.executable, __file__, "--probe", n, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for n in names
    }
    failed: dict[str, str] = {}
    deadline = time.perf_counter() + timeout_s
    for n, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failed[n] = f"probe timed out after {timeout_s:.0f} s"
            continue
        if proc.returncode != 0:
            tail = " | ".join(out.strip().splitlines()[-2:])
            wrong = "WRONG: " if proc.returncode == 3 else ""  # probe(): a wrong result
            failed[n] = f"{wrong}probe rc {proc.returncode}: {tail}"[:200]
    return failed


def write_json(path: str | None, rows: list[Row], meta: dict[str, object]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"run": run_info(), "meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="6 variants, no mixed step")
    parser.add_argument("--only", help="comma-separated variant names (default: all)")
    parser.add_argument("--rep-ms", type=int, default=60, help="do_bench rep per timing")
    parser.add_argument("--budget-s", type=float, default=230.0,
                        help="start no new case after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--no-warm", action="store_true",
                        help="no child processes: compile in this process only")
    parser.add_argument("--warm", action="store_true", help="probe in child processes even "
                        "with --smoke (on CUDA they always run, unless --no-warm)")
    parser.add_argument("--probe", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        return probe(args.probe, args.smoke)
    t_start = time.perf_counter()
    if args.smoke:
        device, shape = "cpu", SMOKE_SHAPE
        cases = [(1, 40), (3, 19)]
        mixed = (5, 12, 9, 7)
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --smoke)", file=sys.stderr)
            return 2
        device, shape = "cuda", Shape()
        cases = [(1, 8192), (4, 2048), (16, 512)]
        mixed = (255, 4096, 7937, 4096)
    base = default_config(shape.head_dim, shape.num_heads // shape.num_kv_heads,
                          shape.dtype.itemsize)
    configs = variants(base, args.quick)
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in variants(base, False)]
        if unknown:
            print(f"unknown variants {unknown}; known: {list(variants(base, False))}",
                  file=sys.stderr)
            return 2
        configs = {k: v for k, v in variants(base, False).items() if k in wanted}
    cap = torch.cuda.get_device_capability() if device == "cuda" else None
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "capability": cap, "torch": torch.__version__, "triton": triton.__version__,
        "warp_specialize_arg": HAS_WS_RANGE,
        "tensor_descriptors": hasattr(triton.language, "make_tensor_descriptor"),
        "variants": {k: describe(v) for k, v in configs.items()},
    }
    print(f"triton {triton.__version__}, capability {cap}, tl.range(warp_specialize): "
          f"{HAS_WS_RANGE}, tl.make_tensor_descriptor: {meta['tensor_descriptors']}")
    rows: list[Row] = []
    broken: set[str] = set()
    if (device == "cuda" or args.warm) and not args.no_warm:
        failed = warm(list(configs), min(180.0, args.budget_s), args.smoke)
        for name, note in failed.items():
            broken.add(name)
            rows.append(Row("probe", name, describe(configs[name]), None, None, None, note))
            print_row(rows[-1])
        print(f"probes done after {time.perf_counter() - t_start:.0f} s", flush=True)
    for b, n in cases:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget spent: {b} x {n} skipped", flush=True)
            continue
        batch = Batch(shape, [n] * b, [n] * b, device, seed=1)
        run_case(rows, f"{b} x {n} causal", batch, configs, broken, args, equal_lengths=True)
        del batch
        write_json(args.json, rows, meta)
    if not args.quick and time.perf_counter() - t_start <= args.budget_s:
        num_decodes, context, chunk, prefix = mixed
        seq = [context] * num_decodes + [prefix + chunk]
        qlens = [1] * num_decodes + [chunk]
        batch = Batch(shape, seq, qlens, device, seed=3)
        run_case(rows, f"mixed {num_decodes}+{chunk}/{prefix}", batch, configs, broken, args,
                 equal_lengths=False)
    write_json(args.json, rows, meta)
    print_summary(rows)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    wrong = [r for r in rows if r.note.startswith("WRONG")]
    if wrong:
        print(f"FAILED: {len(wrong)} rows with a wrong result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
