"""How fast can a Triton causal prefill be on this GPU? A ceiling for the paged prefill kernel.

bf16, 32 query / 8 KV heads, head dim 128, causal prefills 1 x 8192, 4 x 2048 and 16 x 512.
Beside torch's dense SDPA and blocktable's prefill kernel, it times a *minimal* causal
attention kernel written here (no sliding window, no context parallelism, no pad rows, equal
lengths), in the variants that bound what the library's kernel can reach with the Triton
installed:

- ``dense ptr``: contiguous K/V, pointer loads, 128 tokens of one query head per program,
  128-key tiles, 3 stages (the best dense configuration found);
- ``dense tma``: the same with TMA tensor descriptors (host-side ``TensorDescriptor``);
- ``paged``: K/V through a page-16 block table (random block order), with the library's loop
  (GQA group packed in 128 rows, block ids prefetched a tile ahead, loads masked by id
  validity, scale in one FMA, 64-key tiles);
- ``paged+varlen``: ``paged`` plus what a varlen kernel adds around the loop (the request of
  a program found by a radix search over ``query_start_loc``, masks by row bounds, masked q
  load and output store).

``blocktable`` is the library's kernel as an engine calls it for a step of prompts only
(``paged_attention(..., min_query_len=n)``: the prefill kernel alone).

Each variant is checked against SDPA on two heads of the first request, then timed with
``triton.testing.do_bench`` (median). TFLOP/s count the causal mask exactly.

    PYTHONPATH=src python benchmarks/prefill_ceiling.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl
import triton.testing
from run_info import run_info

from blocktable.attention import KernelConfig, PagedAttention

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: no TMA variant
    TensorDescriptor = None

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
LOG2_E = 1.4426950408889634
CASES = [(1, 8192), (4, 2048), (16, 512)]


@triton.jit
def _loop(acc, l_i, m_i, q, k_src, v_src, table, k_row_stride, page_stride, kv_head, num_blocks,
          q_pos, row_hi, lo, hi, qk_scale, BLOCK_N: tl.constexpr, D: tl.constexpr,
          MASKED: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr):
    """Online softmax over keys [lo, hi). MODE 0 dense pointers, 1 dense TMA, 2 paged."""
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    next_ids = n
    if MODE == 2:
        next_ids = tl.load(table + (lo + n) // 16, mask=lo + n < hi, other=-1)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        keys = start + n
        if MODE == 2:
            ids = next_ids
            next_ids = tl.load(table + (keys + BLOCK_N) // 16, mask=keys + BLOCK_N < hi, other=-1)
            ok = (ids >= 0) & (ids < num_blocks)
            offs = (tl.where(ok, ids, 0).to(tl.int64)[:, None] * page_stride
                    + (keys % 16)[:, None] * k_row_stride + kv_head * D + d[None, :])
            k = tl.load(k_src + offs, mask=ok[:, None], other=0.0)
        elif MODE == 1:
            k = k_src.load([start, kv_head * D])
        else:
            offs = keys.to(tl.int64)[:, None] * k_row_stride + kv_head * D + d[None, :]
            k = tl.load(k_src + offs)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            qk = tl.where(keys[None, :] < row_hi[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MODE == 2:
            v = tl.load(v_src + offs, mask=ok[:, None], other=0.0)
        elif MODE == 1:
            v = v_src.load([start, kv_head * D])
        else:
            v = tl.load(v_src + offs)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _minimal_kernel(out, query, k_src, v_src, table, qsl, table_width, k_row_stride,
                    page_stride, num_blocks, num_reqs, seq_len, qk_scale,
                    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                    MODE: tl.constexpr, PACK: tl.constexpr, VARLEN: tl.constexpr):
    """Causal attention of ``num_reqs`` requests of ``seq_len`` tokens each."""
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    TOKENS: tl.constexpr = BLOCK_M // GROUP if PACK else BLOCK_M
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    if VARLEN:  # one flat tile axis over requests: find this program's request
        lanes = tl.arange(0, 16)
        req = tile * 0
        stride = 16
        while stride > 0:
            cand = req + lanes * stride
            ok = cand <= num_reqs
            first = tl.load(qsl + cand, mask=ok, other=0) // TOKENS + cand
            req = req + (tl.sum((ok & (first <= tile)).to(tl.int32), 0) - 1) * stride
            stride = stride // 16
        if req == num_reqs:
            return
        j = tile - tl.load(qsl + req) // TOKENS - req
        if j * TOKENS >= seq_len:
            return
    else:
        req = tl.program_id(2)
        j = tile
    if PACK:
        kv_head = tl.program_id(1)
        q_pos = j * TOKENS + rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
    else:
        kv_head = tl.program_id(1) // GROUP
        q_pos = j * TOKENS + rows
        heads = tl.program_id(1) + rows * 0
    row_ok = q_pos < seq_len
    tokens = (req * seq_len + q_pos).to(tl.int64)
    offs = tokens[:, None] * (H * D) + heads[:, None] * D + d[None, :]
    if VARLEN:
        q = tl.load(query + offs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(query + offs)
    row_hi = tl.where(row_ok, q_pos + 1, 0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if MODE == 2:
        k_base, v_base, row_table = k_src, v_src, table + req * table_width
        first_key = 0
    else:
        k_base, v_base, row_table = k_src, v_src, table
        first_key = req * seq_len  # dense: requests are consecutive rows
    lo_diag = (j * TOKENS // BLOCK_N) * BLOCK_N
    hi = j * TOKENS + TOKENS
    if MODE == 1:  # descriptors index absolute rows
        acc, l_i, m_i = _loop(acc, l_i, m_i, q, k_base, v_base, row_table, k_row_stride,
                              page_stride, kv_head, num_blocks, q_pos + first_key,
                              row_hi + first_key, first_key, first_key + lo_diag, qk_scale,
                              BLOCK_N, D, False, STAGES, MODE)
        acc, l_i, m_i = _loop(acc, l_i, m_i, q, k_base, v_base, row_table, k_row_stride,
                              page_stride, kv_head, num_blocks, q_pos + first_key,
                              row_hi + first_key, first_key + lo_diag, first_key + hi, qk_scale,
                              BLOCK_N, D, True, STAGES, MODE)
    else:
        if MODE == 0:
            k_base = k_src + first_key.to(tl.int64) * k_row_stride
            v_base = v_src + first_key.to(tl.int64) * k_row_stride
        acc, l_i, m_i = _loop(acc, l_i, m_i, q, k_base, v_base, row_table, k_row_stride,
                              page_stride, kv_head, num_blocks, q_pos, row_hi, 0, lo_diag,
                              qk_scale, BLOCK_N, D, False, STAGES, MODE)
        acc, l_i, m_i = _loop(acc, l_i, m_i, q, k_base, v_base, row_table, k_row_stride,
                              page_stride, kv_head, num_blocks, q_pos, row_hi, lo_diag, hi,
                              qk_scale, BLOCK_N, D, True, STAGES, MODE)
    o = (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out.dtype.element_ty)
    if VARLEN:
        tl.store(out + offs, o, mask=row_ok[:, None])
    else:
        tl.store(out + offs, o)


# name -> (MODE, PACK, VARLEN, BLOCK_M, BLOCK_N, stages)
VARIANTS = {
    "dense ptr": (0, False, False, 128, 128, 3),
    "dense tma": (1, False, False, 128, 128, 3),
    "paged": (2, True, False, 128, 64, 3),
    "paged+varlen": (2, True, True, 128, 64, 3),
}


def make_inputs(b: int, n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(b * 100003 + n)
    kw = {"device": "cuda", "dtype": torch.bfloat16, "generator": gen}
    q = torch.randn(b * n, HEADS, HEAD_DIM, **kw)
    k = torch.randn(b * n, KV_HEADS, HEAD_DIM, **kw)
    v = torch.randn(b * n, KV_HEADS, HEAD_DIM, **kw)
    pages = b * n // PAGE
    ids = torch.randperm(pages + 7, device="cuda", generator=gen)[:pages].to(torch.int32)
    k_cache = torch.zeros(pages + 7, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=q.dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache[ids.long()] = k.view(pages, PAGE, KV_HEADS, HEAD_DIM)
    v_cache[ids.long()] = v.view(pages, PAGE, KV_HEADS, HEAD_DIM)
    return {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache,
            "table": ids.view(b, n // PAGE).contiguous(),
            "qsl": torch.arange(b + 1, device="cuda", dtype=torch.int32) * n,
            "seq_lens": torch.full((b,), n, device="cuda", dtype=torch.int32)}


def minimal_runner(name: str, x: dict[str, torch.Tensor], out: torch.Tensor, b: int,
                   n: int) -> Callable[[], object]:
    mode, pack, varlen, block_m, block_n, stages = VARIANTS[name]
    group = HEADS // KV_HEADS
    if mode == 1:
        if TensorDescriptor is None:
            raise RuntimeError("this Triton has no TensorDescriptor")
        k_src = TensorDescriptor.from_tensor(x["k"].view(b * n, -1), [block_n, HEAD_DIM])
        v_src = TensorDescriptor.from_tensor(x["v"].view(b * n, -1), [block_n, HEAD_DIM])
    elif mode == 2:
        k_src, v_src = x["k_cache"], x["v_cache"]
    else:
        k_src, v_src = x["k"], x["v"]
    tokens = block_m // group if pack else block_m
    heads = KV_HEADS if pack else HEADS
    grid = (b * triton.cdiv(n, tokens) + b, heads, 1) if varlen else (triton.cdiv(n, tokens),
                                                                       heads, b)
    scale = HEAD_DIM ** -0.5 * LOG2_E
    cache = x["k_cache"]
    return lambda: _minimal_kernel[grid](
        out, x["q"], k_src, v_src, x["table"], x["qsl"], x["table"].shape[1],
        KV_HEADS * HEAD_DIM, cache.stride(0), cache.shape[0], b, n, scale,
        HEADS, group, HEAD_DIM, block_m, block_n, stages, mode, pack, varlen,
        num_warps=8, num_stages=stages,
    )


def blocktable_runner(x: dict[str, torch.Tensor], out: torch.Tensor) -> Callable[[], object]:
    """The prefill kernel alone, as an engine gets it for a step of prompts only."""
    attention = PagedAttention(x["q"].device, KernelConfig())
    min_query_len = int((x["qsl"][1:] - x["qsl"][:-1]).min())
    return lambda: attention(
        x["q"], x["k_cache"], x["v_cache"], x["table"], x["seq_lens"], x["qsl"],
        scale=HEAD_DIM ** -0.5, out=out, min_query_len=min_query_len,
    )


def sdpa_inputs(x: dict[str, torch.Tensor], b: int, n: int) -> tuple[torch.Tensor, ...]:
    """``[b, heads, n, dim]`` q, and K/V with the KV heads expanded, contiguous."""
    def heads_first(t: torch.Tensor) -> torch.Tensor:
        t = t.view(b, n, t.shape[1], HEAD_DIM).transpose(1, 2)
        return t.repeat_interleave(HEADS // t.shape[1], 1).contiguous()
    return heads_first(x["q"]), heads_first(x["k"]), heads_first(x["v"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    rows = []
    wrong: list[str] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for b, n in CASES:
        x = make_inputs(b, n)
        flops = 4.0 * HEADS * HEAD_DIM * b * n * (n + 1) / 2
        q, k, v = sdpa_inputs(x, b, n)
        ref = sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(b * n, HEADS, HEAD_DIM)
        runners: dict[str, Callable[[], object]] = {
            "sdpa (dense)": lambda q=q, k=k, v=v: sdpa(q, k, v, is_causal=True)}
        outs: dict[str, torch.Tensor] = {}
        for name in VARIANTS:
            outs[name] = torch.zeros_like(x["q"])
            runners[name] = minimal_runner(name, x, outs[name], b, n)
        outs["blocktable"] = torch.zeros_like(x["q"])
        runners["blocktable"] = blocktable_runner(x, outs["blocktable"])
        for name, fn in runners.items():
            row = {"case": f"{b} x {n}", "impl": name, "us": None, "tflops": None, "err": None}
            try:
                fn()
                torch.cuda.synchronize()
                if name in outs:
                    row["err"] = (outs[name].float() - ref.float()).abs().max().item()
                    if not row["err"] < 0.0625:
                        raise WrongResult(f"wrong result: max abs err {row['err']:.3g}")
                us = triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms) * 1e3
                row.update(us=us, tflops=flops / us / 1e6)
            except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
                row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                if isinstance(exc, WrongResult):
                    wrong.append(f"{row['case']} {name}")
            rows.append(row)
            print(f"{row['case']:10s} {name:14s} "
                  + (f"{row['us']:8.1f} us {row['tflops']:6.1f} TFLOP/s" if row["us"]
                     else row.get("note", "")), flush=True)
    print("\ncase       " + " ".join(f"{name:>14s}" for name in runners))
    for b, n in CASES:
        case = [r for r in rows if r["case"] == f"{b} x {n}"]
        base = next(r["tflops"] for r in case if r["impl"] == "sdpa (dense)")
        print(f"{b} x {n:<6d} " + " ".join(
            f"{r['tflops']:6.0f} ({r['tflops'] / base:.2f})" if r["tflops"] else f"{'-':>14s}"
            for r in case))
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__}
        with open(args.json, "w") as f:
            json.dump({"run": run_info(), "meta": meta, "rows": rows}, f, indent=1)
    if wrong:
        print(f"FAILED: wrong results: {wrong}", file=sys.stderr)
        return 1
    return 0


class WrongResult(RuntimeError):
    """An output differs from dense SDPA by more than the tolerance."""


if __name__ == "__main__":
    sys.exit(main())
