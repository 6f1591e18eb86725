"""Host time of a decode step's allocation and its update: ``allocate_many``, then
``take_step_update``.

256 running requests (block size 16); each round 16 of them (a different 16 each round) cross a
block boundary and gain one block through one ``allocate_many`` call, then the step's update is
taken. Their tokens are appended and marked computed outside the timed region. Each phase is
timed with ``perf_counter``, warm (rounds back to back) and cold (after walking ``--evict-mib``
of host memory, as the model's forward does between two steps); the p50 over rounds is printed.

    PYTHONPATH=src python benchmarks/bench_decode_update.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from run_info import run_info

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager

BLOCK = 16


def run(num_reqs: int, grow: int, rounds: int, evict_mib: int) -> dict[str, float]:
    mgr = KVCacheManager([AllocatorGroupSpec(BLOCK, 1 << 16)], num_reqs)
    ids = [f"r{i}" for i in range(num_reqs)]
    for r in ids:
        mgr.add_request(r, list(range(BLOCK)))
        mgr.allocate(r, BLOCK)
        mgr.mark_computed(r, BLOCK)
    mgr.take_step_update()
    evict = np.zeros(evict_mib << 17, dtype=np.int64) if evict_mib else None
    alloc, take = [], []
    groups = num_reqs // grow
    for i in range(rounds):
        reqs = ids[(i % groups) * grow : (i % groups + 1) * grow]
        if evict is not None:
            evict += 1
        t0 = time.perf_counter()
        mgr.allocate_many(reqs, [BLOCK] * grow)
        t1 = time.perf_counter()
        update = mgr.take_step_update()
        t2 = time.perf_counter()
        if len(update.appended[0].rows) != grow:
            raise AssertionError("every request of the round must gain one block")
        mgr.append_token_ids_many(reqs, [[1] * BLOCK] * grow)
        mgr.mark_computed_many(reqs, [BLOCK] * grow)
        alloc.append(t1 - t0)
        take.append(t2 - t1)
    return {"allocate_many_us": statistics.median(alloc) * 1e6,
            "take_step_update_us": statistics.median(take) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--grow", type=int, default=16, help="requests gaining a block per round")
    ap.add_argument("--rounds", type=int, default=1200)
    ap.add_argument("--evict-mib", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = {"warm": run(args.num_reqs, args.grow, args.rounds, 0),
           "cold": run(args.num_reqs, args.grow, args.rounds, args.evict_mib)}
    print(f"{args.grow} of {args.num_reqs} requests gain a block, p50 of {args.rounds} rounds")
    print(f"{'':<6}{'allocate_many µs':>18}{'take_step_update µs':>21}")
    for name, r in res.items():
        print(f"{name:<6}{r['allocate_many_us']:>18.1f}{r['take_step_update_us']:>21.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_info(), **res}, f, indent=2)


if __name__ == "__main__":
    main()
