"""Decode attention at long context: one GPU holding all the KV vs DCP over N GPUs, merge included.

Every rank (one process per GPU, started by ``blocktable.context_parallel.launch.run_ranks``,
NCCL, NVLink multicast off) builds the same global K/V (seeded), computes the single-GPU
attention over all of it (``paged_attention``, no CP) and its own DCP shard: each rank holds
the keys it owns (interleave runs of a 16-token block's virtual block of ``16 * world``
tokens), attends with its log-sum-exp, and the ranks merge with ``AttentionMerger``: one row
per collective pattern, plus a ``p2p`` row (``transport="p2p"``: one kernel writing into the
peers' symmetric memory, no collective; every pattern is the same kernel there). Both are
timed eagerly (CUDA events, median) and replayed from a CUDA graph; the merged output is
checked against the single-GPU output (bf16: max error <= 2e-2; above it, or when the ranks
saw different inputs, the script exits 1). "eager" is the time between CUDA events recorded
around one call on an idle device (host launch work included when it outlasts the kernels).
A ratio is DCP over single for the same rank, the worst rank shown. "KV tokens per GPU" is what
each GPU stores for the batch: DCP N divides it by N, so the same pool bytes hold N times the
context.

    python benchmarks/bench_dcp_decode.py --json dcp.json             # 2 GPUs, 8 x 131072
    python benchmarks/bench_dcp_decode.py --transports p2p            # the p2p row alone
    python benchmarks/bench_dcp_decode.py --smoke --device cpu --world 2  # tiny, CPU, gloo
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from cuda_graphs import capture
from run_info import run_info

from blocktable.context_parallel.launch import run_ranks

PATTERNS = ("all_reduce", "all_gather_reduce_scatter", "all_to_all")
TRANSPORTS = ("collectives", "p2p")
MAX_ABS_ERROR = 2e-2  # against the single-GPU output (bf16)
P2P_ROW = "p2p"  # the row (and JSON key) of transport="p2p", pattern all_reduce


@dataclass(frozen=True)
class Case:
    num_reqs: int = 8
    seq_len: int = 131072
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    interleave: int = 1
    dtype: str = "bfloat16"
    device: str = "cuda"
    backend: str = "auto"
    iters: int = 50
    graph: bool = True
    patterns: tuple[str, ...] = PATTERNS
    transports: tuple[str, ...] = TRANSPORTS

    def rows(self) -> list[tuple[str, str, str]]:
        """``(row, pattern, transport)`` of every merge measured."""
        rows = [(p, p, "collectives") for p in self.patterns if "collectives" in self.transports]
        if "p2p" in self.transports:
            rows.append((P2P_ROW, "all_reduce", "p2p"))
        return rows


def _time_eager(fn: Any, iters: int, device: torch.device) -> float:
    """Median µs of ``fn()`` (CUDA events per call on CUDA; wall clock on the CPU)."""
    import torch.distributed as dist

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _time_graph(fn: Any, iters: int) -> tuple[float | None, str]:
    """µs per replay of a CUDA graph of ``fn`` (``None`` and the reason if capture fails)."""
    import torch.distributed as dist

    try:
        graph = capture(fn)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - reported in the table, not fatal
        torch.cuda.synchronize()
        return None, f"{type(err).__name__}: {err}"[:200]
    times = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times), ""


def _bench_rank(rank: int, world: int, case: Case) -> dict[str, Any]:
    import torch.distributed as dist

    from blocktable.attention import paged_attention
    from blocktable.attention.cp_layout import global_positions
    from blocktable.config import CPConfig
    from blocktable.context_parallel import AttentionMerger
    from blocktable.context_parallel.p2p import p2p_unavailable_reason

    device = torch.device("cuda", torch.cuda.current_device()) if case.device == "cuda" \
        else torch.device("cpu")
    dtype = getattr(torch, case.dtype)
    bs, n, s = case.block_size, case.num_reqs, case.seq_len
    gen = torch.Generator(device=device).manual_seed(0)
    # Global KV: request i's positions in consecutive blocks 1 + i*width ...
    width = math.ceil(s / bs)
    shape = (1 + n * width, bs, case.num_kv_heads, case.head_dim)
    k_global = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_global = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    query = torch.randn(n, case.num_heads, case.head_dim, generator=gen, device=device,
                        dtype=dtype)
    table = (1 + torch.arange(n * width, device=device, dtype=torch.int32)).view(n, width)
    seq_lens = torch.full((n,), s, dtype=torch.int32, device=device)
    qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
    checksum = torch.stack([k_global.float().sum(), query.float().sum()])
    sums = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(sums, checksum)
    same_data = all(torch.equal(x, sums[0]) for x in sums)

    def single() -> torch.Tensor:
        return paged_attention(query, k_global, v_global, table, seq_lens, qsl,
                               backend=case.backend)  # type: ignore[return-value]

    result: dict[str, Any] = {"rank": rank, "same_data_on_every_rank": same_data}
    expected = single().float()
    result["single_eager_us"] = _time_eager(single, case.iters, device)
    if case.graph and device.type == "cuda":
        result["single_graph_us"], result["single_graph_error"] = _time_graph(single, case.iters)
    single_bytes = (k_global.numel() + v_global.numel()) * k_global.element_size()

    # This rank's shard: local position l of request i holds global position g(l).
    cp = CPConfig(world, rank, case.interleave)
    local_len = s // world  # s is a multiple of block_size * world here
    local_width = math.ceil(local_len / bs)
    local = torch.arange(local_len, device=device)
    glob = torch.from_numpy(global_positions(
        np.arange(local_len), world_size=world, rank=rank, interleave=case.interleave,
        manager_block_size=bs)).to(device)
    k_local = torch.zeros((1 + n * local_width, *shape[1:]), device=device, dtype=dtype)
    v_local = torch.zeros_like(k_local)
    local_table = (1 + torch.arange(n * local_width, device=device, dtype=torch.int32)).view(
        n, local_width)
    for i in range(n):
        src_blocks = table[i, glob // bs].long()
        dst_blocks = local_table[i, local // bs].long()
        k_local[dst_blocks, local % bs] = k_global[src_blocks, glob % bs]
        v_local[dst_blocks, local % bs] = v_global[src_blocks, glob % bs]
    out = torch.empty_like(query)
    lse = torch.empty(n, case.num_heads, dtype=torch.float32, device=device)

    def attend() -> None:
        paged_attention(query, k_local, v_local, local_table, seq_lens, qsl, cp=cp,
                        cp_block_size=bs, out=out, lse_out=lse, backend=case.backend)

    result["kv_tokens_per_gpu_single"] = n * s
    result["kv_tokens_per_gpu_dcp"] = n * local_len
    result["pool_bytes_single"] = single_bytes
    result["pool_bytes_dcp"] = (k_local.numel() + v_local.numel()) * k_local.element_size()
    result["shard_attention_eager_us"] = _time_eager(attend, case.iters, device)
    if case.graph and device.type == "cuda":
        result["shard_attention_graph_us"], _ = _time_graph(attend, case.iters)
    patterns: dict[str, Any] = {}
    for name, pattern, transport in case.rows():
        if transport == "p2p" and p2p_unavailable_reason(device) is not None:
            patterns[name] = {"skipped": p2p_unavailable_reason(device)}  # alike on every rank
            continue
        merger = AttentionMerger(None, max_num_tokens=n, num_heads=case.num_heads,
                                 head_dim=case.head_dim, dtype=dtype, device=device,
                                 pattern=pattern, cp=cp, transport=transport)

        def dcp(merger: AttentionMerger = merger) -> torch.Tensor:
            attend()
            return merger.merge(out, lse, gather_heads=True)  # type: ignore[return-value]

        merged = dcp().float()
        row: dict[str, Any] = {
            "pattern": pattern, "transport": merger.transport,
            "max_abs_error_vs_single": float((merged - expected).abs().max()),
            "eager_us": _time_eager(dcp, case.iters, device),
        }
        if case.graph and device.type == "cuda":
            row["graph_us"], row["graph_error"] = _time_graph(dcp, case.iters)
        patterns[name] = row
    result["dcp"] = patterns
    return result


def _table(case: Case, world: int, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def own_ratio(key: str, base: str, rows: list[dict[str, Any]],
                  ranks: list[dict[str, Any]]) -> float | None:
        """The worst rank's DCP time over that same rank's single-GPU time."""
        pairs = [(r.get(key), rank.get(base)) for r, rank in zip(rows, ranks)]
        if any(a is None or not b for a, b in pairs):
            return None
        return max(a / b for a, b in pairs)  # type: ignore[operator]

    def worst(key: str, rows: list[dict[str, Any]]) -> float | None:
        vals = [r.get(key) for r in rows]
        return None if any(v is None for v in vals) else max(vals)  # type: ignore[type-var]

    single_eager = worst("single_eager_us", results)
    single_graph = worst("single_graph_us", results)
    lines = []
    for name, pattern, transport in case.rows():
        rows = [r["dcp"][name] for r in results]
        if "skipped" in rows[0]:
            lines.append({"pattern": name, "transport": transport, "skipped": rows[0]["skipped"]})
            continue
        eager, graph = worst("eager_us", rows), worst("graph_us", rows)
        lines.append({
            "pattern": name, "merge_pattern": pattern, "transport": transport,
            "single_eager_us": single_eager, "dcp_eager_us": eager,
            "eager_ratio": own_ratio("eager_us", "single_eager_us", rows, results),
            "single_graph_us": single_graph, "dcp_graph_us": graph,
            "graph_ratio": own_ratio("graph_us", "single_graph_us", rows, results),
            "max_abs_error": max(r["max_abs_error_vs_single"] for r in rows),
            "graph_errors": sorted({r.get("graph_error", "") for r in rows} - {""}),
        })
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="GPUs (ranks), default 2")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU-capable)")
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--backend", default="auto", help="paged_attention backend")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--transports", type=lambda v: tuple(v.split(",")), default=None,
                        help="merge transports to measure, comma-separated: collectives (one "
                             "row per pattern), p2p (CUDA only; one row); default both on "
                             "CUDA, collectives on the CPU")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    transports = args.transports or (TRANSPORTS if args.device == "cuda" else ("collectives",))
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad or not transports:
        parser.error(f"--transports: {bad} not in {TRANSPORTS}")
    if "p2p" in transports and args.device != "cuda":
        parser.error("--transports p2p needs --device cuda (GPUs of one node)")
    if args.smoke:
        case = Case(num_reqs=2, seq_len=256 * args.world, num_heads=8, num_kv_heads=2,
                    head_dim=32, dtype="float32" if args.device == "cpu" else "bfloat16",
                    interleave=args.interleave, device=args.device, backend=args.backend,
                    iters=args.iters or 3, transports=transports)
    else:
        case = Case(interleave=args.interleave, device=args.device, backend=args.backend,
                    iters=args.iters or 50, transports=transports)
    if case.seq_len % (case.block_size * args.world):
        parser.error("seq_len must be a multiple of block_size * world")
    results = run_ranks(_bench_rank, args.world, args=(case,), device=args.device,
                        timeout_s=1800.0, pg_timeout_s=600.0)
    lines = _table(case, args.world, results)
    r0 = results[0]
    print(f"decode attention, {case.num_reqs} x {case.seq_len} tokens, {case.num_heads} q / "
          f"{case.num_kv_heads} kv heads x {case.head_dim}, {case.dtype}, block "
          f"{case.block_size}, DCP {args.world} (interleave {case.interleave}) on {case.device}")
    print(f"KV tokens per GPU: single {r0['kv_tokens_per_gpu_single']}, DCP "
          f"{r0['kv_tokens_per_gpu_dcp']} ({r0['pool_bytes_single'] / 2**30:.2f} GiB vs "
          f"{r0['pool_bytes_dcp'] / 2**30:.2f} GiB per GPU); same data on every rank: "
          f"{all(r['same_data_on_every_rank'] for r in results)}")

    def fmt(x: float | None, unit: str = "") -> str:
        return "-" if x is None else f"{x:.1f}{unit}" if unit else f"{x:.3f}"

    header = f"{'pattern':<26} {'single eager':>13} {'DCP eager':>11} {'ratio':>6} " \
             f"{'single graph':>13} {'DCP graph':>11} {'ratio':>6} {'max err':>9}"
    print(header)
    for ln in lines:
        if "skipped" in ln:
            print(f"{ln['pattern']:<26} skipped: {ln['skipped']}")
            continue
        print(f"{ln['pattern']:<26} {fmt(ln['single_eager_us'], ' us'):>13} "
              f"{fmt(ln['dcp_eager_us'], ' us'):>11} {fmt(ln['eager_ratio']):>6} "
              f"{fmt(ln['single_graph_us'], ' us'):>13} {fmt(ln['dcp_graph_us'], ' us'):>11} "
              f"{fmt(ln['graph_ratio']):>6} {ln['max_abs_error']:>9.2e}")
        for err in ln["graph_errors"]:
            print(f"    graph capture failed: {err}")
    print(f"shard attention alone (rank 0): eager {fmt(r0['shard_attention_eager_us'], ' us')}, "
          f"graph {fmt(r0.get('shard_attention_graph_us'), ' us')}; target: DCP / single <= 0.6")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_info(), "case": asdict(case), "world": args.world, "summary": lines,
                       "ranks": results}, f, indent=2)
    failed = [ln["pattern"] for ln in lines
              if "skipped" not in ln and not ln["max_abs_error"] <= MAX_ABS_ERROR]
    if failed or not all(r["same_data_on_every_rank"] for r in results):
        print(f"FAILED: max error above {MAX_ABS_ERROR} in {failed}, or ranks saw different "
              "inputs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
