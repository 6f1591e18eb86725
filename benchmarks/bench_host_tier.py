"""The host tier's costs: the allocator step with the tier, and the copies' bandwidth.

Allocator: the scenario of ``bench_allocator.py`` (``--num-reqs`` running, 8 arrivals of
2048-token prompts half sharing 1024 tokens, 64 decode blocks, block 16), driven through two
managers in the same process, step by step interleaved: one without a host tier, one with
``--host-blocks``. With ``--pool roomy`` (default) the device pool holds every block the run
ever computes, so nothing is evicted: the tier is enabled but moves nothing (its overhead when
idle). With ``--pool tight`` allocation evicts cached blocks every step: the tier offloads them
(the bookkeeping of host traffic; no tensor is copied here).

Copies: :class:`~blocktable.engine.host_cache.HostKVCache` offloading and restoring a batch of
``--copy-blocks`` blocks of a SmolLM2-135M-shaped cache (30 layers, 3 KV heads, head dim 64,
block 16, bfloat16), beside a plain copy of the same bytes between two contiguous tensors on the
same devices (the bandwidth the batched copy is measured against). On the CPU both are memory
copies; on CUDA the plain copy is a pinned host <-> device copy.

Usage::

    python benchmarks/bench_host_tier.py [--steps 60] [--pool roomy|tight] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from allocator_workload import AllocatorWorkload

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.engine.host_cache import HostKVCache
from blocktable.host_tier import HostTransfers


def bench_allocator(args: argparse.Namespace) -> dict[str, float]:
    bs, per_req = 16, 2048 // 16 + 2
    steps = args.warmup + args.steps
    roomy = (args.num_reqs + 8 * steps) * (per_req + steps) + 64
    tight = args.num_reqs * per_req + 8 * per_req + 512
    num_blocks = roomy if args.pool == "roomy" else tight
    managers, workloads = {}, {}
    for name, host in (("without", 0), ("with host tier", args.host_blocks)):
        managers[name] = KVCacheManager([AllocatorGroupSpec(bs, num_blocks)], args.num_reqs,
                                        host_blocks=host)
        workloads[name] = AllocatorWorkload(num_reqs=args.num_reqs, seed=0)
        mgr = managers[name]
        for req_id, prompt in workloads[name].fill():
            hit = mgr.add_request(req_id, prompt)
            mgr.allocate(req_id, len(prompt) - hit)
            mgr.mark_computed(req_id, len(prompt) - hit)
        mgr.take_step_update()
        mgr.take_transfers()
    times: dict[str, list[float]] = {name: [] for name in managers}
    for step in range(steps):
        for name, mgr in managers.items():  # interleaved: both see the same machine state
            ev = workloads[name].next_step()
            t0 = time.perf_counter()
            mgr.free_many(ev.finished)
            mgr.append_token_ids_many(ev.decoding, ev.sampled)
            cached = mgr.add_requests(ev.new_ids, ev.prompts)
            scheduled = ev.new_ids + ev.decoding
            num_new = [len(p) - c for p, c in zip(ev.prompts, cached)] + [bs] * len(ev.decoding)
            mgr.allocate_many(scheduled, num_new)
            mgr.take_step_update()
            mgr.take_transfers()
            mgr.mark_computed_many(scheduled, num_new)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    out = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    host = managers["with host tier"].host_tier_stats[0]
    print(f"allocator step, {args.pool} pool ({num_blocks} blocks), {args.num_reqs} running, "
          f"median of {args.steps} steps:")
    for name, ms in out.items():
        print(f"  {name:>16}: {ms:7.3f} ms")
    print(f"  ratio: {out['with host tier'] / out['without']:.3f}x; host tier offloaded "
          f"{host.num_offloaded_blocks} blocks, restored {host.num_restored_blocks}")
    return out


def bench_copies(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    n, pool = args.copy_blocks, 2 * args.copy_blocks + 1
    kv = torch.randn(30, 2, pool, 16, 3, 64, device=device).to(torch.bfloat16)
    cache = HostKVCache(kv, pool - 1)
    rng = np.random.default_rng(0)
    dev_ids = rng.permutation(np.arange(1, pool))[:n].astype(np.int32)
    host_ids = rng.permutation(np.arange(1, pool))[:n].astype(np.int32)
    nbytes = n * cache.block_bytes
    plain_src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    plain_dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=device.type == "cuda")

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        ts = []
        for _ in range(args.copy_reps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                cache.synchronize()
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    none = np.zeros((0, 2), dtype=np.int32)
    off = HostTransfers(np.stack((dev_ids, host_ids), axis=1), none)
    res = HostTransfers(none, np.stack((host_ids, dev_ids), axis=1))
    rows = {
        "plain copy device->host": timed(lambda: plain_dst.copy_(plain_src, non_blocking=True)),
        "plain copy host->device": timed(lambda: plain_src.copy_(plain_dst, non_blocking=True)),
        "offload (gather + copy)": timed(lambda: cache.transfer(off)),
        "restore (gather + copy)": timed(lambda: cache.transfer(res)),
    }
    print(f"copies of {n} blocks ({nbytes / 2**20:.1f} MiB, {cache.block_bytes} bytes/block) "
          f"on {device}, median of {args.copy_reps}:")
    for name, s in rows.items():
        print(f"  {name:>24}: {s * 1e3:8.2f} ms  {nbytes / s / 2**30:6.2f} GiB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--num-reqs", type=int, default=256)
    parser.add_argument("--host-blocks", type=int, default=65536)
    parser.add_argument("--pool", choices=("roomy", "tight"), default="roomy")
    parser.add_argument("--copy-blocks", type=int, default=64)
    parser.add_argument("--copy-reps", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-allocator", action="store_true")
    args = parser.parse_args()
    if not args.skip_allocator:
        bench_allocator(args)
    bench_copies(args)


if __name__ == "__main__":
    main()
