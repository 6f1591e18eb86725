"""KV transfer between a prefill and a decode process, beside one contiguous tensor's send.

Two figures:

1. **Bandwidth.** Two spawned ranks (gloo on the CPU, NCCL with ``--device cuda``). Rank 0 holds
   a KV cache of ``--num-layers`` layers, rank 1 another; per repeat, rank 0 gathers a prompt's
   blocks (shuffled ids, as an allocator hands them out) of every layer into one buffer
   (:func:`blocktable.transfer.buffers.gather_chunks`) and sends it
   (:class:`blocktable.transfer.TorchDistributedTransport`); rank 1 receives and scatters into
   its own shuffled blocks. Timed on rank 1 from a barrier to the end of its scatter. Interleaved
   with it, the same number of bytes as one contiguous tensor, plain send/recv. Medians.
2. **Host bookkeeping per round for 64 requests** (in this process): the decode side's plans
   (allocator admission and allocation, the token-position mapping of both sides) and the
   messages' pickling, over ``--num-requests`` offers of ``--prompt-tokens`` tokens; the mapping
   and the messages alone are shown too (the allocator's share is the allocator's cost).

    PYTHONPATH=src python benchmarks/bench_transfer.py                  # CPU, gloo
    PYTHONPATH=src python benchmarks/bench_transfer.py --device cuda --num-tokens 8192

Llama-8B-sized layers by default: 32 layers, 8 KV heads, head dim 128, bfloat16 (128 KiB per
token); the CPU default moves 1,024 tokens (128 MiB) to stay short on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from blocktable.context_parallel.launch import run_ranks
from blocktable.transfer.buffers import gather_chunks, scatter_chunks
from blocktable.transfer.transport import TorchDistributedTransport


def _cache(args: argparse.Namespace, device: torch.device, num_blocks: int) -> torch.Tensor:
    dtype = getattr(torch, args.dtype)
    return torch.randn(args.num_layers, 2, num_blocks, args.block_size, args.kv_heads,
                       args.head_dim, device=device).to(dtype)


def bandwidth_job(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    num_prompt_blocks = -(-args.num_tokens // args.block_size)
    num_blocks = num_prompt_blocks + 1
    kv = _cache(args, device, num_blocks)
    rng = np.random.default_rng(rank)
    rows = rng.permutation(np.arange(1, num_blocks))[:num_prompt_blocks]  # whole blocks
    transport = TorchDistributedTransport(1 - rank, "decode" if rank == 0 else "prefill",
                                          device, timeout_s=120.0)
    view_shape = (kv.shape[0] * 2, num_prompt_blocks, kv[0, 0, 0].numel())
    flat = torch.empty(view_shape, dtype=kv.dtype, device=device)  # the plain tensor
    landing = torch.empty_like(flat)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    paged_s, plain_s = [], []
    for i in range(args.warmup + args.repeats):
        for kind in ("paged", "plain"):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            if rank == 0 and kind == "paged":
                transport.send_tensor(gather_chunks(kv, rows, args.block_size))
            elif rank == 0:
                transport.send_tensor(flat)
            elif kind == "paged":
                transport.recv_tensor(landing)
                scatter_chunks(kv, rows, args.block_size, landing)
            else:
                transport.recv_tensor(landing)
            sync()
            if i >= args.warmup:
                (paged_s if kind == "paged" else plain_s).append(time.perf_counter() - t0)
    nbytes = flat.numel() * flat.element_size()
    return {"bytes": nbytes, "paged_s": statistics.median(paged_s),
            "plain_s": statistics.median(plain_s)}


def bookkeeping(args: argparse.Namespace) -> dict[str, float]:
    """Median host seconds per round for ``args.num_requests`` offers."""
    from blocktable.engine import EngineConfig, LLMEngine, tiny_llama
    from blocktable.transfer import DecodeWorker, local_pair
    from blocktable.transfer.messages import Offer, OfferBatch, Round
    from blocktable.transfer.plan import chunk_rows_many

    n, tokens, bs = args.num_requests, args.prompt_tokens, args.block_size
    per_req = -(-(tokens + 2) // bs)
    engine = LLMEngine(tiny_llama(), EngineConfig(
        block_size=bs, num_blocks=n * per_req + 1, max_num_reqs=n,
        max_model_len=tokens + 2, enable_prefix_caching=False))
    worker = DecodeWorker(engine, local_pair()[1])
    worker.remote = worker.layout
    rng = np.random.default_rng(0)
    offers = [Offer(f"r{i}", rng.integers(0, 256, tokens), 1, 2,
                    rng.permutation(np.arange(1, n * per_req + 1, dtype=np.int32))[:per_req])
              for i in range(n)]
    full, mapping = [], []
    for _ in range(args.bookkeeping_repeats):
        t0 = time.perf_counter()
        batch = OfferBatch.of(offers)  # the prefill side's message
        received = pickle.loads(pickle.dumps(Round(batch, False)))
        plans = worker._plan_batch(received.offers)
        pickle.loads(pickle.dumps(plans))
        full.append(time.perf_counter() - t0)
        # the same without the allocator's admissions: messages and both sides' mapping
        t1 = time.perf_counter()
        batch = OfferBatch.of(offers)
        received = pickle.loads(pickle.dumps(Round(batch, False)))
        b = received.offers
        counts = np.diff(b.block_starts)
        firsts, nums = np.zeros(n, np.int64), np.diff(b.prompt_starts)
        chunk_rows_many(b.block_ids, b.block_starts[:-1], counts, bs, bs, firsts, nums)
        chunk_rows_many(b.block_ids, b.block_starts[:-1], counts, bs, bs, firsts, nums)
        pickle.loads(pickle.dumps(plans))
        mapping.append(time.perf_counter() - t1)
        worker._planned.clear()
        engine.manager.free_many([o.req_id for o in offers])
    engine.manager.check_integrity()
    return {"round_s": statistics.median(full), "mapping_and_messages_s":
            statistics.median(mapping)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--num-tokens", type=int, default=None,
                   help="prompt tokens moved (default 8192 on cuda, 1024 on cpu)")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--bookkeeping-repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.num_tokens is None:
        args.num_tokens = 8192 if args.device == "cuda" else 1024
    torch.set_num_threads(1)
    book = bookkeeping(args)
    results = run_ranks(bandwidth_job, 2, args=(args,), device=args.device, timeout_s=600.0,
                        pg_timeout_s=120.0, num_threads=1)
    bw = results[1]
    gib = bw["bytes"] / 2**30
    backend = "nccl" if args.device == "cuda" else "gloo"
    rows = [
        (f"transfer: gather + send + recv + scatter ({backend})",
         f"{bw['paged_s'] * 1e3:.1f} ms", f"{gib / bw['paged_s']:.2f} GiB/s"),
        (f"one contiguous tensor, send + recv ({backend})",
         f"{bw['plain_s'] * 1e3:.1f} ms", f"{gib / bw['plain_s']:.2f} GiB/s"),
        ("transfer / contiguous bandwidth", "", f"{bw['plain_s'] / bw['paged_s']:.0%}"),
        (f"host bookkeeping, round of {args.num_requests} requests (allocator included)",
         f"{book['round_s'] * 1e6:.0f} µs", ""),
        (f"host bookkeeping, mapping + messages only ({args.num_requests} requests)",
         f"{book['mapping_and_messages_s'] * 1e6:.0f} µs", ""),
    ]
    print(f"{args.num_tokens} tokens x {args.num_layers} layers x {args.kv_heads} KV heads x "
          f"{args.head_dim} ({args.dtype}, block {args.block_size}) = {bw['bytes'] / 2**20:.0f} "
          f"MiB; {args.device}; medians of {args.repeats}")
    width = max(len(r[0]) for r in rows)
    print(f"| {'what':<{width}} | time | rate |\n|{'-' * (width + 2)}|---|---|")
    for name, t, rate in rows:
        print(f"| {name:<{width}} | {t} | {rate} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k != "json"}, **bw, **book}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
