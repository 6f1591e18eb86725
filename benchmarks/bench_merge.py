"""Per-call cost of the context-parallel attention merge, beside the bare collectives it uses.

One process per rank (spawned here, no torchrun), ``file://`` rendezvous in a temp dir. Each
pattern and batch size is first checked against the float64 reference, then timed: per-call
medians over many calls replayed from one CUDA graph, and "eager": CUDA events around many
eager calls issued back to back, per call (stream time: host launch work counts where the GPU
waits for it), and the same for the pattern's collectives alone on the merger's own buffers. vLLM's figures for its
own merge are constants quoted from one earlier measurement (2 H200s, 2026-11-30, graph, same
shapes), not measured by this run; the column says so.

Two transports: ``collectives`` (the pattern's NCCL collectives) and ``p2p`` (symmetric memory,
one Triton kernel per call; CUDA only). For ``p2p`` the "bare" column is that kernel with no
token: only its flag exchange with the peers (the transport's floor).

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python benchmarks/bench_merge.py --json merge.json
    PYTHONPATH=src python benchmarks/bench_merge.py --device cpu --world 2   # gloo smoke test

NVLink multicast stays off in every process (set here for the children too). On the CPU there
is no graph column and the eager times are host wall-clock medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from run_info import run_info

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cuda_graphs import capture

# Quoted, not measured here: vLLM 0.33's own merge, 2 H200s, 2026-11-30, NCCL, 32 heads x 128,
# bf16, fp32 LSE; µs per call replayed from a CUDA graph, by batch size.
VLLM_GRAPH_US = {
    "all_to_all": {1: 13.0, 64: 17.2, 256: 26.6, 1024: 58.6},
    "all_gather_reduce_scatter": {1: 17.1, 64: 21.5, 256: 34.0, 1024: 77.5},
    "all_reduce": {1: 18.1, 64: 23.1, 256: 44.0, 1024: 77.7},
}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def bare_collectives(merger, out: torch.Tensor, lse: torch.Tensor, gather: bool) -> Callable[[], None]:
    """The collectives ``merger.merge`` issues for these inputs, on its own buffers, no math
    (for the p2p transport: its kernel's flag exchange alone)."""
    if merger._p2p is not None:
        return lambda: merger._p2p.handshake(out, lse)
    comm, v = merger._comm, merger._views(out.shape[0])
    if merger.pattern == "all_to_all":
        steps = [lambda: comm.all_to_all(v["recv"], v["send"])]
    else:
        steps = [lambda: comm.all_gather(v["lse_all"], lse)]
        if merger.pattern == "all_reduce":
            steps.append(lambda: comm.all_reduce(v["send"]))
        else:
            steps.append(lambda: comm.reduce_scatter(v["mine"], v["send"]))
    if gather and merger.head_sliced:
        steps.append(lambda: comm.all_gather(v["slices"], v["mine"]))

    def run() -> None:
        for step in steps:
            step()
    return run


def time_cuda(
    fn: Callable[[], object], calls: int, repeats: int,
    verify: Callable[[], float] | None = None, reset: Callable[[], None] | None = None,
) -> tuple[float, float, float | None]:
    """(graph, eager back to back) per-call medians in µs (``calls`` calls per graph replay / per
    timed run of eager calls between two events)
    and ``verify()`` after ``reset()`` and one more replay (the graph's own result)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for start, end in events:
        start.record()
        for _ in range(calls):
            fn()
        end.record()
    torch.cuda.synchronize()
    eager = statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / calls
    graph = capture(fn, calls, warmup=2)
    graph.replay()
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    graph_us = statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / calls
    graph_err = None
    if verify is not None and reset is not None:
        reset()
        graph.replay()
        torch.cuda.synchronize()
        graph_err = verify()
    del graph
    return graph_us, eager, graph_err


def time_cpu(
    fn: Callable[[], object], calls: int, repeats: int,
    verify: Callable[[], float] | None = None, reset: Callable[[], None] | None = None,
) -> tuple[None, float, float | None]:
    fn()
    runs = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return None, statistics.median(runs) * 1e6, None


def worker(rank: int, args: argparse.Namespace, tmp: str) -> None:
    os.environ.update(NO_MULTICAST)
    from blocktable.context_parallel import AttentionMerger

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:  # ranks share the host's cores: intra-op threads would spin against the peer
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/rendezvous",
                            rank=rank, world_size=args.world, timeout=timedelta(seconds=120))
    dtype = getattr(torch, args.dtype)
    rows = []
    for transport in args.transports:
        if transport == "p2p" and not cuda:
            continue  # symmetric memory needs GPUs
        for pattern in args.patterns:
            for gather in ([False, True] if args.gather_heads else [False]):
                if gather and pattern == "all_reduce":
                    continue
                merger = AttentionMerger(None, max_num_tokens=max(args.tokens),
                                         num_heads=args.heads, head_dim=args.head_dim,
                                         dtype=dtype, device=device, pattern=pattern,
                                         transport=transport)
                rows += [measure(merger, n, gather, args) for n in args.tokens]
                del merger
    if rank == 0:
        report(rows, args)
    dist.barrier()
    dist.destroy_process_group()
    if not all(row["ok"] for row in rows):
        raise SystemExit(f"rank {rank}: merge differs from the float64 reference")


def measure(merger, num_tokens: int, gather: bool, args: argparse.Namespace) -> dict:
    """Check one (pattern, batch) against the float64 reference, then time it and its bare
    collectives."""
    from blocktable.context_parallel import merge_attention_reference

    dtype, rank, cuda = merger.dtype, merger.rank, merger.device.type == "cuda"
    g = torch.Generator().manual_seed(num_tokens)
    shape = (args.world, num_tokens, args.heads)
    outs = torch.randn(*shape, args.head_dim, generator=g).to(dtype)
    lses = 4 * torch.randn(*shape, generator=g)
    lses[-1, : num_tokens // 2] = float("-inf")  # an empty shard for half the tokens
    want, want_lse = merge_attention_reference(list(outs), list(lses))
    out, lse = outs[rank].to(merger.device), lses[rank].to(merger.device)
    heads = slice(None) if gather else merger.head_slice
    _, got_lse = merger.merge(out, lse, gather_heads=gather, return_lse=True)
    lse_err = lse_error(got_lse, want_lse[:, heads])
    got = merger.merge(out, lse, gather_heads=gather)

    def verify() -> float:
        err = (got.double().cpu() - want[:, heads]).abs().max() / want.abs().max().clamp_min(1)
        return err.item()

    def reset() -> None:  # so that a graph replay that writes nothing cannot pass
        bufs = (merger._p2p.result,) if merger._p2p is not None else (merger._send,
                                                                      merger._slices)
        for buf in bufs:
            buf.fill_(float("nan"))

    err = verify()
    timer = time_cuda if cuda else time_cpu
    calls, repeats = (args.calls, args.repeats) if cuda else (5, 5)
    graph_us, eager_us, graph_err = timer(
        lambda: merger.merge(out, lse, gather_heads=gather), calls, repeats, verify, reset)
    err = max(err, graph_err if graph_err is not None else 0.0)
    bare_graph, bare_eager, _ = timer(bare_collectives(merger, out, lse, gather), calls, repeats)
    return {
        "transport": merger.transport,
        "pattern": merger.pattern + ("+gather" if gather else ""), "tokens": num_tokens,
        "graph_us": graph_us, "eager_us": eager_us, "bare_graph_us": bare_graph,
        "bare_eager_us": bare_eager,
        "vllm_graph_us": None if gather else VLLM_GRAPH_US[merger.pattern].get(num_tokens),
        "max_rel_err": err, "lse_max_err": lse_err, "graph_checked": graph_err is not None,
        "ok": err <= TOLERANCE[dtype] and lse_err <= 1e-5,
    }


def lse_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |error| of the finite merged LSEs, relative to max(1, |lse|); inf on a -inf mismatch."""
    got = got.double().cpu()
    if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
        return float("inf")
    finite = torch.isfinite(want)
    if not finite.any():
        return 0.0
    return ((got[finite] - want[finite]).abs() / want[finite].abs().clamp_min(1.0)).max().item()


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def report(rows: list[dict], args: argparse.Namespace) -> None:
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (gloo)"
    print(f"\nattention merge, world {args.world}, {args.heads} heads x {args.head_dim}, "
          f"{args.dtype} out, fp32 LSE, {dev}; µs per call (medians)")
    head = ("transport", "pattern", "B", "graph", "eager", "bare graph", "bare eager",
            "vLLM graph (quoted 2026-11-30)", "rel err")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['transport']} | {r['pattern']} | {r['tokens']} | {fmt(r['graph_us'])} | "
              f"{fmt(r['eager_us'])} | "
              f"{fmt(r['bare_graph_us'])} | {fmt(r['bare_eager_us'])} | "
              f"{fmt(r['vllm_graph_us'])} | {r['max_rel_err']:.1e}{'' if r['ok'] else ' FAIL'} |")
    if args.json:
        meta = {"device": dev, "world": args.world, "heads": args.heads,
                "head_dim": args.head_dim, "dtype": args.dtype, "torch": torch.__version__,
                "calls_per_timing": args.calls, "repeats": args.repeats}
        Path(args.json).write_text(json.dumps({"run": run_info(), "meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.json}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 64, 256, 1024])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--patterns", type=lambda s: s.split(","),
                        default=["all_to_all", "all_gather_reduce_scatter", "all_reduce"])
    parser.add_argument("--transports", type=lambda s: s.split(","),
                        default=["collectives", "p2p"],
                        help="collectives (NCCL/gloo) and/or p2p (symmetric memory, CUDA)")
    parser.add_argument("--gather-heads", action="store_true",
                        help="also time the head-sliced patterns with gather_heads=True")
    parser.add_argument("--calls", type=int, default=50, help="merges per graph / timed run")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds before killing")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="bench_merge_")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_run, args=(r, args, tmp)) for r in range(args.world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    code = 0
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            print(f"rank {r}: killed after {args.timeout} s", file=sys.stderr)
            code = 1
        elif p.exitcode:
            code = 1
    return code


def _run(rank: int, args: argparse.Namespace, tmp: str) -> None:
    try:
        worker(rank, args, tmp)
    except SystemExit:
        raise
    except Exception:  # noqa: BLE001 - printed here, the exit code tells the parent
        traceback.print_exc()
        raise SystemExit(1) from None


if __name__ == "__main__":
    sys.exit(main())
