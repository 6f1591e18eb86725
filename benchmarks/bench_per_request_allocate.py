"""Per-request ``allocate``: its own one-request path against a thin wrapper of ``allocate_many``.

``KVCacheManager.allocate`` works on its one request in Python ints and defers to
``allocate_many`` only on an error; the alternative is the thin wrapper
``allocate_many([req_id], [n])``. The decision rule: the one-request path stays only if it
wins the per-request allocator step (``vs_vllm.py``'s scenario, every call per request: 8
frees, 64 appends, 8 admissions, 72 allocations, 72 marks a step) by 1.3x or more.

Two managers run the same events, alternated step by step (the first one changes every step),
one with each ``allocate``; thread CPU time per step; the allocators' block ids and free counts
are compared every step (a mismatch exits 1).

    PYTHONPATH=src python benchmarks/bench_per_request_allocate.py --steps 300 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
from allocator_workload import AllocatorWorkload
from run_info import run_info

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager

ONE_REQUEST = KVCacheManager.allocate


def thin_wrapper(mgr: KVCacheManager, req_id: Any, num_new_tokens: int) -> tuple[list[int], ...]:
    return tuple(part.block_ids.tolist() for part in mgr.allocate_many([req_id], [num_new_tokens]))


def step(mgr: KVCacheManager, events: Any, sampled: list[list[int]], block_size: int) -> int:
    """One scheduling step with per-request calls; its thread CPU time in ns."""
    t0 = time.thread_time_ns()
    for req_id in events.finished:
        mgr.free(req_id)
    for req_id, tokens in zip(events.decoding, sampled):
        mgr.append_token_ids(req_id, tokens)
    hits = [mgr.add_request(r, p) for r, p in zip(events.new_ids, events.prompts)]
    scheduled = events.new_ids + events.decoding
    num_new = [len(p) - h for p, h in zip(events.prompts, hits)]
    num_new += [block_size] * len(events.decoding)
    for req_id, n in zip(scheduled, num_new):
        mgr.allocate(req_id, n)
    mgr.take_step_update()
    for req_id, n in zip(scheduled, num_new):
        mgr.mark_computed(req_id, n)
    mgr.num_free_blocks()  # applies the recorded marks inside the timed step
    return time.thread_time_ns() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--num-reqs", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=131072)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    bs = args.block_size
    names = ("one-request path", "thin wrapper")
    sides = {}
    for name in names:
        workload = AllocatorWorkload(num_reqs=args.num_reqs, block_size=bs, token_format="list")
        mgr = KVCacheManager([AllocatorGroupSpec(bs, args.num_blocks)], args.num_reqs)
        for req_id, prompt in workload.fill():
            hit = mgr.add_request(req_id, prompt)
            mgr.allocate(req_id, len(prompt) - hit)
            mgr.mark_computed(req_id, len(prompt) - hit)
        mgr.take_step_update()
        sides[name] = (workload, mgr)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.warmup + args.steps):
        for name in names if i % 2 else names[::-1]:
            workload, mgr = sides[name]
            KVCacheManager.allocate = ONE_REQUEST if name == names[0] else thin_wrapper
            events = workload.next_step()
            ns = step(mgr, events, events.sampled.tolist(), bs)
            if i >= args.warmup:
                times[name].append(ns / 1e6)
        KVCacheManager.allocate = ONE_REQUEST
        (wa, a), (_, b) = sides[names[0]], sides[names[1]]
        if a.num_free_blocks() != b.num_free_blocks() or any(
            a.block_ids(r) != b.block_ids(r) for r in wa.running
        ):
            print(f"FAILED: the two allocators differ after step {i}", file=sys.stderr)
            return 1
    stats = {
        name: {"median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
               "p90": float(np.percentile(v, 90)), "n": len(v)}
        for name, v in times.items()
    }
    ratio = stats[names[1]]["median"] / stats[names[0]]["median"]
    for name, s in stats.items():
        print(f"{name:18s} {s['median']:.3f} ms ({s['p10']:.3f}-{s['p90']:.3f}) per step")
    print(f"thin wrapper / one-request path: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info(), "unit": "ms per step, thread CPU time", "rows": stats,
                       "ratio": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
