"""Host time of ``BlockPool.release`` and of the row allocator in the free of a step.

The scenario of ``bench_allocator.py --skip step long``: 8 finished 2048-token requests (block
size 16, fully computed, half sharing a 1024-token prefix, so 64 shared blocks appear 4 times)
are freed with ``free_many``; the pool's ``release`` inside it is timed on its own (the one
array of the freed rows' blocks, tail first), beside the whole ``free_many``. The row allocator
is timed apart: 8 rows released and 8 taken again, as a step does.

Usage::

    python benchmarks/bench_pool_release.py [--reps 300] [--clock cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
from run_info import run_info

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.allocator.rows import RowAllocator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    clock = time.process_time_ns if args.clock == "cpu" else time.perf_counter_ns
    rng = np.random.default_rng(0)
    bs, n, prompt_len, shared_len = 16, 8, 2048, 1024
    shared = rng.integers(0, 32000, shared_len)
    mgr = KVCacheManager([AllocatorGroupSpec(bs, 64 * 1024)], 64)
    pool = mgr.pools[0]
    release_us: list[float] = []
    free_us: list[float] = []
    sizes: list[int] = []
    real_release = pool.release

    def timed_release(block_ids: np.ndarray, **kw: Any) -> None:
        t0 = clock()
        real_release(block_ids, **kw)
        release_us.append((clock() - t0) / 1e3)
        sizes.append(len(block_ids))

    pool.release = timed_release  # type: ignore[method-assign]
    for rep in range(args.reps):
        ids = [f"{rep}-{i}" for i in range(n)]
        prompts = [
            np.concatenate((shared, rng.integers(0, 32000, prompt_len - shared_len)))
            if i % 2
            else rng.integers(0, 32000, prompt_len)
            for i in range(n)
        ]
        cached = mgr.add_requests(ids, prompts)
        num_new = [len(q) - c for q, c in zip(prompts, cached)]
        mgr.allocate_many(ids, num_new)
        mgr.mark_computed_many(ids, num_new)
        mgr.take_step_update()
        t0 = clock()
        mgr.free_many(ids)
        free_us.append((clock() - t0) / 1e3)
    mgr.check_integrity()

    rows: RowAllocator[int] = RowAllocator(1024)
    for i in range(1024):
        rows.take(i)
    row_us: list[float] = []
    many = hasattr(rows, "release_many")
    holders = list(range(n))
    for _ in range(args.reps):
        freed = sorted(rng.choice(1024, n, replace=False).tolist())
        t0 = clock()
        if many:
            rows.release_many(freed)
            rows.take_many(holders)
        else:
            for r in freed:
                rows.release(r)
            for holder in holders:
                rows.take(holder)
        row_us.append((clock() - t0) / 1e3)

    skip = args.reps // 5
    result = {
        name: statistics.median(v[skip:])
        for name, v in (("free_many", free_us), ("pool.release", release_us), ("rows 8+8", row_us))
    }
    print(f"release array: {sizes[-1]} ids; clock {args.clock}; medians after {skip} warm-up reps")
    print(f"{'what':14s} {'median us':>10s}")
    for name, us in result.items():
        print(f"{name:14s} {us:10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_info(), "us": result, "reps": args.reps, "clock": args.clock}, f, indent=1)


if __name__ == "__main__":
    main()
