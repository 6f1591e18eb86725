"""Time the block table's consumers on CUDA: KV write, paged decode attention, FlashInfer export.

Medians of ``triton.testing.do_bench`` (device time with a flushed L2: CUDA events around one
eager launch after an L2 flush; not the call's wall time) and, for the
Triton kernels, of ``do_bench_cudagraph`` (graph replays). Torch paths synchronize (they read
data-dependent sizes), so they have no graph time. Decode attention runs with the default
number of KV splits ("s=") and, where that is more than one, unsplit. "GB/s" counts the bytes
a kernel must move at least (KV read and written, KV read by attention), over the flushed median.

    python benchmarks/bench_consumers.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import triton.testing
from run_info import run_info

from blocktable.attention import paged_decode_attention
from blocktable.attention.triton_decode import default_num_kv_splits
from blocktable.flashinfer import write_flashinfer_page_table
from blocktable.kv_write import write_kv_cache

NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 32, 128, 16
DTYPE = torch.bfloat16


@dataclass
class Row:
    consumer: str
    scenario: str
    backend: str
    flushed_us: float  # device time with a flushed L2 (do_bench)
    graph_us: float | None
    gb_per_s: float | None


def bench(fn: Callable[[], object], graph: bool) -> tuple[float, float | None]:
    flushed_ms = triton.testing.do_bench(fn, return_mode="median")
    graph_ms = triton.testing.do_bench_cudagraph(fn, return_mode="median") if graph else None
    return flushed_ms * 1e3, None if graph_ms is None else graph_ms * 1e3


def bandwidth(num_bytes: int, us: float) -> float:
    return num_bytes / (us * 1e-6) / 1e9


def random_table(num_reqs: int, width: int, num_blocks: int) -> torch.Tensor:
    """Distinct random block ids (never the null block 0), as an allocator would hand out."""
    ids = torch.randperm(num_blocks - 1, device="cuda")[: num_reqs * width] + 1
    return ids.view(num_reqs, width).int()


def bench_kv_write(rows: list[Row], quick: bool) -> None:
    num_blocks = 16384
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = torch.zeros(shape, dtype=DTYPE, device="cuda")
    for label, num_tokens in [("decode 256 tok", 256), ("prefill 8192 tok", 8192)]:
        key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        value = torch.randn_like(key)
        slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
        num_bytes = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
        args = (key, value, kv_cache[0], kv_cache[1], slot_mapping)
        for backend in ("triton", "torch"):
            run = partial(write_kv_cache, *args, check=False, backend=backend)
            flushed, graph = bench(run, graph=backend == "triton")
            rows.append(Row("kv_write", label, backend, flushed, graph, bandwidth(num_bytes, flushed)))


def gather_sdpa(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor
) -> torch.Tensor:
    """Baseline: gather each request's K/V into dense tensors, then torch's SDPA."""
    k = k_cache[block_table.long()].flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
    v = v_cache[block_table.long()].flatten(1, 2).transpose(1, 2)
    q = query[:, :, None]  # [B, H, 1, D]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def bench_decode(rows: list[Row], quick: bool) -> None:
    cases = [(1, 8192), (64, 1024), (64, 8192), (256, 2048)]
    if quick:
        cases = cases[:2]
    for num_reqs, seq_len in cases:
        width = math.ceil(seq_len / BLOCK_SIZE)
        num_blocks = num_reqs * width + 1
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
        v_cache = torch.randn_like(k_cache)
        block_table = random_table(num_reqs, width, num_blocks)
        seq_lens = torch.full((num_reqs,), seq_len, dtype=torch.int32, device="cuda")
        query = torch.randn(num_reqs, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        out = torch.empty_like(query)
        label = f"B={num_reqs} seq={seq_len}"
        num_bytes = 2 * num_reqs * seq_len * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
        args = (query, k_cache, v_cache, block_table)
        default_splits = default_num_kv_splits(num_reqs, NUM_KV_HEADS, width, query.device)
        for splits in sorted({default_splits, 1}, reverse=True):
            run = partial(paged_decode_attention, *args, seq_lens, out=out, num_kv_splits=splits)
            flushed, graph = bench(run, graph=True)
            gbs = bandwidth(num_bytes, flushed)
            rows.append(Row("decode_attn", label, f"triton s={splits}", flushed, graph, gbs))
        flushed, _ = bench(partial(gather_sdpa, *args), graph=False)
        rows.append(Row("decode_attn", label, "gather+sdpa", flushed, None, None))


def bench_flashinfer(rows: list[Row], quick: bool) -> None:
    width = 8192  # 128K tokens at page size 16
    for num_reqs in [256, 1024]:
        block_table = random_table(num_reqs, width, num_reqs * width + 1)
        seq_lens_cpu = torch.randint(1, width * BLOCK_SIZE + 1, (num_reqs,), dtype=torch.int32)
        seq_lens = seq_lens_cpu.cuda()
        kv_indptr = torch.empty(num_reqs + 1, dtype=torch.int32, device="cuda")
        kv_indices = torch.empty(num_reqs * width, dtype=torch.int32, device="cuda")
        kv_last_page_len = torch.empty(num_reqs, dtype=torch.int32, device="cuda")
        num_pages = int(((seq_lens_cpu + BLOCK_SIZE - 1) // BLOCK_SIZE).sum())
        num_bytes = 2 * 4 * num_pages  # ids read and written
        label = f"B={num_reqs} width={width}"
        args = (block_table, seq_lens, BLOCK_SIZE, kv_indptr, kv_indices, kv_last_page_len)
        for backend in ("triton", "torch"):
            run = partial(write_flashinfer_page_table, *args, backend=backend)
            flushed, graph = bench(run, graph=backend == "triton")
            rows.append(
                Row("flashinfer", label, backend, flushed, graph, bandwidth(num_bytes, flushed))
            )


def print_table(rows: list[Row]) -> None:
    def fmt(value: float | None, digits: int) -> str:
        return "" if value is None else f"{value:.{digits}f}"

    header = ("consumer", "scenario", "backend")
    print(f"{header[0]:<12} {header[1]:<22} {header[2]:<12} {'flushed µs':>11} {'graph µs':>9} GB/s")
    print("-" * 75)
    for r in rows:
        times = f"{fmt(r.flushed_us, 1):>11} {fmt(r.graph_us, 1):>9} {fmt(r.gb_per_s, 0):>5}"
        print(f"{r.consumer:<12} {r.scenario:<22} {r.backend:<12} {times}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer attention cases")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_consumers.py needs a CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    rows: list[Row] = []
    for run in (bench_kv_write, bench_decode, bench_flashinfer):
        run(rows, args.quick)
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {DTYPE}, heads {NUM_HEADS}/{NUM_KV_HEADS}, "
          f"head_dim {HEAD_DIM}, block {BLOCK_SIZE}\n")  # fmt: skip
    print_table(rows)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"run": run_info(), "meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
