"""Time blocktable's Triton paged attention beside FlashInfer and torch's SDPA on one GPU.

bf16, 32 query / 8 KV heads, head dim 128, page 16. Cases: decode (one query per request, from
a CUDA graph, and "flushed": device time with a flushed L2, ``triton.testing.do_bench``, i.e.
CUDA events around one call after an L2 flush, host work included only where the GPU waits for
it; not an eager call's wall time), "eager wall" for decode (the wall time of one eager call,
host included, from its launch to a synchronize that returns; median over 200 calls), causal
prefill (TFLOP/s counted exactly from the causal mask), and a mixed step (255 decodes + one
7937-token chunk over a 4096-token cached prefix) against the sum of its two parts run
separately. Every case is checked against a float32 torch computation on a few sampled
requests before it is timed; an error above the tolerance makes the script exit 1. FlashInfer (when
importable) reads blocktable's own CSR export; its ``plan()`` runs outside the timed region, and
each of its configurations worth trying (``flashinfer_configs``: tensor cores or not for decode,
FA2 or FA3) is timed, its fastest being the "flashinfer" row.
``--tune`` also times a small grid of kernel configurations per case and prints the best.
``--smoke`` runs tiny shapes on the CPU under Triton's interpreter (no timing).

    python benchmarks/bench_attention.py [--json out.json] [--tune] [--smoke] [--only decode]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from run_info import run_info

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton.testing

from blocktable.attention import KernelConfig, PagedAttention, paged_attention
from blocktable.attention.kernel_config import default_config
from blocktable.attention.triton_decode import MAX_KV_SPLITS, default_num_kv_splits
from blocktable.flashinfer import write_flashinfer_page_table

try:  # pragma: no cover - GPU machine only
    import flashinfer
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flashinfer = None


@dataclass(frozen=True)
class Shape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16


MAX_ABS_ERR = 3e-2  # against float32 attention, unit-variance bf16 inputs


@dataclass
class Row:
    kind: str  # decode / prefill / mixed
    case: str
    impl: str  # triton / flashinfer / sdpa / triton-parts / tune:<config>
    flushed_us: float | None  # device time with a flushed L2 (do_bench)
    graph_us: float | None
    tflops: float | None = None
    max_err: float | None = None
    note: str = ""
    eager_wall_us: float | None = None  # one eager call's wall time, host included (decode)


class Batch:
    """A paged batch: random distinct block ids, random K/V, queries of the given lengths."""

    def __init__(self, shape: Shape, seq_lens: list[int], query_lens: list[int], device: str,
                 seed: int = 0) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.shape, self.seq_lens_list, self.query_lens_list = shape, seq_lens, query_lens
        page = shape.page_size
        blocks = [math.ceil(s / page) for s in seq_lens]
        self.width = max(blocks + [1])
        num_blocks = sum(blocks) + 1
        ids = torch.randperm(num_blocks - 1, generator=gen).int() + 1
        table = torch.zeros(len(seq_lens), self.width, dtype=torch.int32)
        at = 0
        for r, n in enumerate(blocks):
            table[r, :n] = ids[at : at + n]
            at += n
        cache_shape = (num_blocks, page, shape.num_kv_heads, shape.head_dim)
        self.k_cache = torch.randn(cache_shape, dtype=shape.dtype, device=device)
        self.v_cache = torch.randn(cache_shape, dtype=shape.dtype, device=device)
        self.block_table = table.to(device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=device)
        self.query = torch.randn(qsl[-1], shape.num_heads, shape.head_dim, dtype=shape.dtype,
                                 device=device)
        self.out = torch.empty_like(self.query)
        self.max_query_len = max(query_lens + [1])

    def run(self, config: KernelConfig | None = None) -> Callable[[], object]:
        """The public entry point, or (with ``config``) a planner of its own tuned so."""
        attend = paged_attention if config is None else PagedAttention(self.query.device, config)
        return lambda: attend(
            self.query, self.k_cache, self.v_cache, self.block_table, self.seq_lens,
            self.query_start_loc, out=self.out, max_query_len=self.max_query_len,
        )

    def causal_flops(self) -> float:
        """2 matmuls x 2 flops x heads x head_dim x visible (query, key) pairs."""
        pairs = 0
        for s, q in zip(self.seq_lens_list, self.query_lens_list):
            # query i (0-based) of q sees s - q + i + 1 keys
            pairs += q * (s - q + 1) + q * (q - 1) // 2
        return 4.0 * self.shape.num_heads * self.shape.head_dim * pairs

    def check(self, out: torch.Tensor, samples: int = 3, max_queries: int = 64) -> float:
        """Max abs error against float32 attention on a few requests' last queries; NaN when
        any checked output is NaN."""
        shape, page = self.shape, self.shape.page_size
        group = shape.num_heads // shape.num_kv_heads
        reqs = sorted({0, len(self.seq_lens_list) // 2, len(self.seq_lens_list) - 1})[:samples]
        qsl = self.query_start_loc.tolist()
        worst = 0.0
        for r in reqs:
            s, q = self.seq_lens_list[r], self.query_lens_list[r]
            if q == 0:
                continue
            n = min(q, max_queries)
            rows = self.block_table[r, : math.ceil(s / page)].long()
            k = self.k_cache[rows].flatten(0, 1)[:s].float().repeat_interleave(group, 1)
            v = self.v_cache[rows].flatten(0, 1)[:s].float().repeat_interleave(group, 1)
            tokens = slice(qsl[r + 1] - n, qsl[r + 1])
            qq = self.query[tokens].float()
            pos = torch.arange(s - n, s, device=k.device)
            scores = torch.einsum("qhd,khd->hqk", qq, k) / math.sqrt(shape.head_dim)
            mask = torch.arange(s, device=k.device)[None, :] <= pos[:, None]
            scores = scores.masked_fill(~mask, float("-inf"))
            ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
            err = float((out[tokens].float() - ref).abs().max())
            if math.isnan(err):  # max() would keep the old value and hide the NaN
                return err
            worst = max(worst, err)
        return worst


def timed(fn: Callable[[], object], graph: bool, smoke: bool,
          rep_ms: int = 100) -> tuple[float | None, float | None]:
    if smoke:
        fn()
        return None, None
    flushed = triton.testing.do_bench(fn, rep=rep_ms, return_mode="median") * 1e3
    graph_us = None
    if graph:
        graph_us = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
    return flushed, graph_us


def eager_wall_us(fn: Callable[[], object], reps: int = 200) -> float:
    """Median wall time of one eager call of ``fn`` and a synchronize, host work included,
    each call started with the GPU idle (as a lone request's step sees it)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


# Float workspace for FlashInfer's split-KV partials: its planner asks for ~322 MiB at B=1024
# decode under CUDA graphs (more than the 128 MiB its docs suggest), so every shape here fits.
FLASHINFER_WORKSPACE_BYTES = 1 << 30


def flashinfer_version() -> tuple[int, ...]:
    """FlashInfer's version as numbers, ``()`` when it is not importable."""
    if flashinfer is None:
        return ()
    numbers = []
    for part in str(flashinfer.__version__).split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def flashinfer_configs(decode: bool) -> list[dict[str, object]]:
    """FlashInfer's choices worth timing for this batch; its fastest is its row.

    Decode: its tensor-core path (the prefill kernel on packed GQA rows) and its CUDA-core
    decode kernel (which is faster depends on the group size and batch), and from 0.3 on the
    Hopper (fa3) tensor-core kernel. Prefill: the FA3 (Hopper) and FA2 kernels.
    """
    if decode:
        configs: list[dict[str, object]] = [{"use_tensor_cores": True},
                                            {"use_tensor_cores": False}]
        if flashinfer_version() >= (0, 3):
            configs.append({"use_tensor_cores": True, "backend": "fa3"})
        return configs
    return [{"backend": "fa3"}, {"backend": "fa2"}]


def describe_flashinfer(config: dict[str, object]) -> str:
    names = {"use_tensor_cores": "tc"}
    return ",".join(f"{names.get(k, k)}={v}" for k, v in config.items())


def flashinfer_runner(batch: Batch, decode: bool, graph: bool,
                      config: dict[str, object]) -> Callable[[], object] | None:
    """FlashInfer's wrapper fed blocktable's CSR export; planned here, outside any timing."""
    if flashinfer is None:
        return None
    shape, device = batch.shape, batch.query.device
    num_reqs = batch.seq_lens.shape[0]
    kv_indptr = torch.empty(num_reqs + 1, dtype=torch.int32, device=device)
    kv_indices = torch.empty(num_reqs * batch.width, dtype=torch.int32, device=device)
    kv_last = torch.empty(num_reqs, dtype=torch.int32, device=device)
    write_flashinfer_page_table(batch.block_table, batch.seq_lens, shape.page_size, kv_indptr,
                                kv_indices, kv_last)
    # FlashInfer asks for a zeroed float workspace before its first use.
    ws = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    common = (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size)
    if decode:
        kwargs = dict(config)
        if graph:
            kwargs.update(use_cuda_graph=True, paged_kv_indptr_buffer=kv_indptr,
                          paged_kv_indices_buffer=kv_indices,
                          paged_kv_last_page_len_buffer=kv_last)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **kwargs)
        wrapper.plan(kv_indptr, kv_indices, kv_last, *common, q_data_type=shape.dtype,
                     kv_data_type=shape.dtype)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **config)
        wrapper.plan(batch.query_start_loc, kv_indptr, kv_indices, kv_last, *common,
                     causal=True, q_data_type=shape.dtype, kv_data_type=shape.dtype)
    cache = (batch.k_cache, batch.v_cache)
    return lambda: wrapper.run(batch.query, cache)


def bench_flashinfer(rows: list[Row], kind: str, label: str, batch: Batch) -> None:
    """Every configuration of ``flashinfer_configs``, checked, then its fastest as "flashinfer"
    (from a graph for decode)."""
    decode = kind == "decode"
    flops = batch.causal_flops()
    tried: list[Row] = []
    for config in flashinfer_configs(decode):
        name = f"flashinfer:{describe_flashinfer(config)}"
        try:
            fi = flashinfer_runner(batch, decode, graph=False, config=config)
            if fi is None:
                return
            fi_err = batch.check(fi())
            fe, _ = timed(fi, graph=False, smoke=False)
            fw = eager_wall_us(fi) if decode else None
            del fi
            fg = None
            if decode:
                fig = flashinfer_runner(batch, decode, graph=True, config=config)
                fig()
                fg = triton.testing.do_bench_cudagraph(fig, rep=100, return_mode="median") * 1e3
                del fig
            fi_tf = None if decode else flops / (fe * 1e-6) / 1e12
            row = Row(kind, label, name, fe, fg, fi_tf, fi_err, eager_wall_us=fw)
            tried.append(row)
        except Exception as exc:  # noqa: BLE001 - e.g. a backend this build lacks
            row = Row(kind, label, name, None, None, note=f"failed: {exc}"[:120])
        rows.append(row)
        print(f"  {kind} {label} {name}: flushed {row.flushed_us} us graph {row.graph_us} us "
              f"err {row.max_err} {row.note}", flush=True)
    usable = [r for r in tried if r.max_err is not None and r.max_err <= MAX_ABS_ERR]
    if usable:
        best = min(usable, key=lambda r: r.graph_us if decode else r.flushed_us)
        rows.append(dataclasses.replace(best, impl="flashinfer",
                                        note=f"fastest: {best.impl.split(':', 1)[1]}"))


def sdpa_runner(batch: Batch) -> Callable[[], object]:
    """Dense causal SDPA on contiguous K/V (KV heads expanded), equal-length requests."""
    shape = batch.shape
    b, n = len(batch.seq_lens_list), batch.seq_lens_list[0]
    dev, dt = batch.query.device, shape.dtype
    q = torch.randn(b, shape.num_heads, n, shape.head_dim, device=dev, dtype=dt)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(q, k, v, is_causal=True)


def tune_configs(kind: str, base: KernelConfig, splits: int) -> list[KernelConfig]:
    """One knob at a time around ``base`` (few compilations), without repeats."""
    configs = _tune_grid(kind, base, splits)
    return [c for i, c in enumerate(configs) if c not in configs[:i]]


def _tune_grid(kind: str, base: KernelConfig, splits: int) -> list[KernelConfig]:
    """The defaults, then one variant at a time (see ``KernelConfig``): at most 6 prefill and 6
    decode compilations per case."""
    rep = dataclasses.replace
    if kind == "decode":
        b = rep(base, num_kv_splits=splits)
        return [
            b,
            rep(b, num_kv_splits=min(splits * 2, MAX_KV_SPLITS)),
            rep(b, num_kv_splits=max(1, splits // 2)),
            rep(b, decode_block_n=32),
            rep(b, decode_num_stages=3),
            rep(b, decode_num_warps=8),
        ]
    return [
        base,
        rep(base, prefill_block_n=128, prefill_num_stages=2),
        rep(base, prefill_block_n=128, prefill_num_stages=3),
        rep(base, prefill_block_m=64, prefill_num_warps=4, prefill_num_stages=2),
        rep(base, prefill_block_m=64, prefill_num_warps=4, prefill_num_stages=3),
        rep(base, prefill_num_stages=2),
    ]


def describe(c: KernelConfig, kind: str) -> str:
    if kind == "decode":
        return (f"n{c.decode_block_n} w{c.decode_num_warps} s{c.decode_num_stages} "
                f"splits{c.num_kv_splits}")
    return (f"m{c.prefill_block_m} n{c.prefill_block_n} w{c.prefill_num_warps} "
            f"s{c.prefill_num_stages}")


def bench_case(rows: list[Row], kind: str, label: str, batch: Batch, args: argparse.Namespace,
               sdpa: bool = False) -> None:
    decode = kind == "decode"
    run = batch.run()
    run()
    err = batch.check(batch.out)
    flushed, graph = timed(run, graph=decode or kind == "mixed", smoke=args.smoke)
    flops = batch.causal_flops()
    tflops = None if flushed is None else flops / (flushed * 1e-6) / 1e12
    wall = eager_wall_us(run) if decode and not args.smoke else None
    rows.append(Row(kind, label, "triton", flushed, graph, None if decode else tflops, err,
                    eager_wall_us=wall))
    if not args.smoke and kind != "mixed":
        bench_flashinfer(rows, kind, label, batch)
    if sdpa:
        fn = sdpa_runner(batch)
        se, _ = timed(fn, graph=False, smoke=args.smoke)
        rows.append(Row(kind, label, "sdpa", se, None,
                        None if se is None else flops / (se * 1e-6) / 1e12))
    if args.tune:
        shape = batch.shape
        base = default_config(shape.head_dim, shape.num_heads // shape.num_kv_heads)
        splits = default_num_kv_splits(len(batch.seq_lens_list), shape.num_kv_heads,
                                       batch.width, batch.query.device, shape.page_size)
        tune_kind = "decode" if decode else "prefill"
        best: tuple[float, str] | None = None
        for config in tune_configs(tune_kind, base, splits):
            fn = batch.run(config)
            name = describe(config, tune_kind)
            try:
                fn()
                cerr = batch.check(batch.out)
                ce, cg = timed(fn, graph=decode, smoke=args.smoke, rep_ms=30)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip it
                rows.append(Row(kind, label, f"tune:{name}", None, None,
                                note=f"failed: {exc}"[:120]))
                continue
            t = cg if cg is not None else ce
            rows.append(Row(kind, label, f"tune:{name}", ce, cg, None, cerr))
            if t is not None:
                print(f"  tune {kind} {label}: {name} flushed {ce:.1f} us"
                      + ("" if cg is None else f" graph {cg:.1f} us")
                      + f" err {cerr:.4f}", flush=True)
            if t is not None and (best is None or t < best[0]):
                best = (t, name)
        if best is not None:
            print(f"best {kind} {label}: {best[1]} {best[0]:.1f} us", flush=True)
    del run


def bench_mixed(rows: list[Row], shape: Shape, device: str, args: argparse.Namespace,
                num_decodes: int, context: int, chunk: int, prefix: int) -> None:
    label = f"{num_decodes}x{context} dec + {chunk} over {prefix}"
    seq = [context] * num_decodes + [prefix + chunk]
    qlens = [1] * num_decodes + [chunk]
    mixed = Batch(shape, seq, qlens, device, seed=3)
    bench_case(rows, "mixed", label, mixed, args)
    # The same two parts, separately: the decodes (decode kernel alone), then the chunk.
    decodes = Batch(shape, seq[:-1], qlens[:-1], device, seed=4)
    alone = Batch(shape, seq[-1:], qlens[-1:], device, seed=5)
    times = [timed(b.run(), graph=True, smoke=args.smoke) for b in (decodes, alone)]
    if times[0][0] is not None:
        flushed = times[0][0] + times[1][0]
        graph = times[0][1] + times[1][1]
        rows.append(Row("mixed", label, "triton-parts", flushed, graph))


def print_table(rows: list[Row]) -> None:
    def f(v: float | None, d: int = 1) -> str:
        return "" if v is None else f"{v:.{d}f}"

    print(f"{'kind':<8} {'case':<34} {'impl':<34} {'flushed us':>10} {'graph us':>9} "
          f"{'eager wall us':>13} {'TFLOP/s':>8} {'max err':>8} note")
    print("-" * 144)
    for r in rows:
        print(f"{r.kind:<8} {r.case:<34} {r.impl:<34} {f(r.flushed_us):>10} {f(r.graph_us):>9} "
              f"{f(r.eager_wall_us):>13} {f(r.tflops):>8} {f(r.max_err, 4):>8} {r.note}")


def print_ratios(rows: list[Row]) -> None:
    """The targets' ratios: Triton over FlashInfer (time), over SDPA (TFLOP/s), over parts."""
    by = {(r.kind, r.case, r.impl): r for r in rows}
    print("\nratios (time: lower is better; TFLOP/s: higher is better)")
    for (kind, case, impl), r in by.items():
        if impl != "triton":
            continue
        parts = []
        for other in ("flashinfer", "triton-parts"):
            o = by.get((kind, case, other))
            if o is None:
                continue
            for name, a, b in (("flushed", r.flushed_us, o.flushed_us), ("graph", r.graph_us,
                                                                    o.graph_us),
                               ("eager wall", r.eager_wall_us, o.eager_wall_us)):
                if a and b:
                    parts.append(f"{name} time / {other} {a / b:.2f}")
        for other in ("flashinfer", "sdpa"):
            o = by.get((kind, case, other))
            if o is not None and r.tflops and o.tflops:
                parts.append(f"TFLOP/s / {other} {r.tflops / o.tflops:.2f}")
        if parts:
            print(f"  {kind:<8} {case:<34} " + ", ".join(parts))


def write_json(path: str | None, rows: list[Row], device: str) -> None:
    """The rows so far (rewritten after every case, so a crash keeps what was measured)."""
    if not path:
        return
    with open(path, "w") as f:
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "torch": torch.__version__, "triton": triton.__version__,
                "flashinfer": getattr(flashinfer, "__version__", None)}
        json.dump({"run": run_info(), "meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--tune", action="store_true", help="time a grid of kernel configs")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--only", choices=["decode", "prefill", "mixed"], help="one kind")
    args = parser.parse_args()
    rows: list[Row] = []
    if args.smoke:
        device = "cpu"
        shape = Shape(num_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                      dtype=torch.float32)
        decode_cases = [(2, 40), (1, 9)]
        prefill_cases = [(1, 24), (2, 10)]
        mixed = (5, 12, 9, 7)
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --smoke)", file=sys.stderr)
            return 2
        device, shape = "cuda", Shape()
        decode_cases = [(1, 8192), (1, 131072), (8, 32768), (64, 4096), (256, 2048),
                        (1024, 1024)]
        prefill_cases = [(1, 8192), (4, 2048), (16, 512)]
        mixed = (255, 4096, 7937, 4096)
    if args.only in (None, "decode"):
        for b, n in decode_cases:
            batch = Batch(shape, [n] * b, [1] * b, device)
            bench_case(rows, "decode", f"B={b} x {n}", batch, args)
            del batch
            write_json(args.json, rows, device)
    if args.only in (None, "prefill"):
        for b, n in prefill_cases:
            batch = Batch(shape, [n] * b, [n] * b, device, seed=1)
            bench_case(rows, "prefill", f"{b} x {n} causal", batch, args, sdpa=True)
            del batch
            write_json(args.json, rows, device)
    if args.only in (None, "mixed"):
        bench_mixed(rows, shape, device, args, *mixed)
    print_table(rows)
    print_ratios(rows)
    write_json(args.json, rows, device)
    wrong = [r for r in rows if r.max_err is not None and not r.max_err <= MAX_ABS_ERR]
    for r in wrong:
        print(f"FAILED: {r.kind} {r.case} {r.impl}: max abs error {r.max_err}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
