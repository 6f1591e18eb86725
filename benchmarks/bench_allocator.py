"""Host time of one scheduling step of the block allocator (SPEC §3.8, issue 4).

Scenario: manager block size 16, 1024 running requests; every step 8 requests finish and 8
arrive with 2048-token prompts, half of them sharing a 1024-token prefix (64 cached blocks),
and 64 running requests cross a block boundary while decoding (one new block each). The pool
is small enough that allocation evicts cached blocks in the steady state.

Timed per step (host microseconds): ``free`` of the finished requests, ``add_request`` of the
arrivals (token conversion and prefix lookup), ``allocate`` of their prompts, ``allocate`` of
the 64 decode blocks, ``take_step_update``, and the table's batched ``apply`` of that update
(host table, CPU backend). The target (200 us, issue 4) is for admission,
allocation and the StepUpdate; ``free`` and ``mark_computed`` (hashing newly full blocks,
after the forward) are reported too. ``append_token_ids`` is not timed.

Usage::

    python benchmarks/bench_allocator.py [--steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import deque

import numpy as np

from blocktable import GroupSpec, MultiGroupBlockTable
from blocktable.allocator import AllocatorGroupSpec, KVCacheManager

PHASES = (
    "free", "add_request", "allocate_prefill", "allocate_decode", "take_step_update", "table_apply"
)
TARGET_PHASES = (
    "add_request", "allocate_prefill", "allocate_decode", "take_step_update", "table_apply"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-reqs", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--shared-prefix-len", type=int, default=1024)
    p.add_argument("--arrivals", type=int, default=8, help="admissions (and finishes) per step")
    p.add_argument("--decode-blocks", type=int, default=64, help="decode blocks per step")
    p.add_argument("--num-blocks", type=int, default=131072)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--token-format",
        choices=("list", "numpy"),
        default="list",
        help="how prompts reach add_request (a list costs ~7 ns per token to convert)",
    )
    p.add_argument("--json", type=str, default=None, help="write the results here")
    args = p.parse_args()

    rng = np.random.default_rng(args.seed)
    bs = args.block_size
    shared = rng.integers(0, 32000, args.shared_prefix_len).tolist()
    mgr = KVCacheManager(
        [AllocatorGroupSpec(block_size=bs, num_blocks=args.num_blocks)], max_num_reqs=args.num_reqs
    )
    # the table the step's update lands in: rows wide enough for every request's growth
    max_model_len = args.prompt_len + bs * (args.warmup + args.steps + 2)
    table = MultiGroupBlockTable([GroupSpec(bs, num_blocks=args.num_blocks)], args.num_reqs,
                                 max_model_len, 8192, "cpu")
    next_id = 0
    arrivals_made = 0

    def new_prompt() -> list[int] | np.ndarray:
        nonlocal arrivals_made
        arrivals_made += 1
        if arrivals_made % 2:
            tail = rng.integers(0, 32000, args.prompt_len - len(shared)).tolist()
            prompt = shared + tail
        else:
            prompt = rng.integers(0, 32000, args.prompt_len).tolist()
        return np.array(prompt, dtype=np.int64) if args.token_format == "numpy" else prompt

    running: deque[int] = deque()  # oldest first
    decode_cursor: deque[int] = deque()
    times: dict[str, list[float]] = {name: [] for name in (*PHASES, "mark_computed")}

    def admit(req_id: int, prompt: list[int] | np.ndarray) -> None:
        cached = mgr.add_request(req_id, prompt)
        mgr.allocate(req_id, len(prompt) - cached)

    # Fill the batch.
    for _ in range(args.num_reqs):
        admit(next_id, prompt := new_prompt())
        mgr.mark_computed(next_id, len(prompt) - mgr.num_computed_tokens(next_id))
        running.append(next_id)
        decode_cursor.append(next_id)
        next_id += 1
    table.apply(mgr.take_step_update())

    for step in range(args.warmup + args.steps):
        t: dict[str, int] = {}
        finished = [running.popleft() for _ in range(args.arrivals)]
        t0 = time.perf_counter_ns()
        for req_id in finished:
            mgr.free(req_id)
        t1 = time.perf_counter_ns()
        t["free"] = t1 - t0
        finished_set = set(finished)
        decode_cursor = deque(r for r in decode_cursor if r not in finished_set)

        prompts = [new_prompt() for _ in range(args.arrivals)]
        new_ids = list(range(next_id, next_id + args.arrivals))
        next_id += args.arrivals
        decoding = []
        for _ in range(args.decode_blocks):
            req_id = decode_cursor.popleft()
            decode_cursor.append(req_id)
            mgr.append_token_ids(req_id, rng.integers(0, 32000, bs).tolist())
            decoding.append(req_id)

        t0 = time.perf_counter_ns()
        cached = [mgr.add_request(r, prompt) for r, prompt in zip(new_ids, prompts)]
        t1 = time.perf_counter_ns()
        for r, prompt, num_cached in zip(new_ids, prompts, cached):
            mgr.allocate(r, len(prompt) - num_cached)
        t2 = time.perf_counter_ns()
        for r in decoding:
            mgr.allocate(r, 1)
        t3 = time.perf_counter_ns()
        update = mgr.take_step_update()
        t4 = time.perf_counter_ns()
        table.apply(update)
        t5 = time.perf_counter_ns()
        t.update(add_request=t1 - t0, allocate_prefill=t2 - t1, allocate_decode=t3 - t2)
        t["take_step_update"] = t4 - t3
        t["table_apply"] = t5 - t4

        t0 = time.perf_counter_ns()
        for r, prompt, num_cached in zip(new_ids, prompts, cached):
            mgr.mark_computed(r, len(prompt) - num_cached)
        for r in decoding:
            mgr.mark_computed(r, bs)
        t["mark_computed"] = time.perf_counter_ns() - t0
        running.extend(new_ids)
        decode_cursor.extend(new_ids)
        if step >= args.warmup:
            for name, ns in t.items():
                times[name].append(ns / 1e3)

    mgr.check_integrity()
    for req_id in running:  # the table holds exactly the allocator's blocks
        row = table[0].row(mgr.row_of(req_id))
        assert row.tolist() == mgr.block_ids(req_id)[0], f"request {req_id}: table != allocator"

    def summed(names: tuple[str, ...]) -> list[float]:
        return [sum(v) for v in zip(*(times[n] for n in names))]

    rows = [(name, times[name]) for name in (*PHASES, "mark_computed")]
    rows.append(("allocate + update (no admission)", summed(TARGET_PHASES[1:])))
    rows.append(("target: admit + allocate + update", summed(TARGET_PHASES)))
    rows.append(("all allocator host work", summed((*PHASES, "mark_computed"))))
    us_per_step = {
        name: {
            "median": statistics.median(v),
            "mean": statistics.fmean(v),
            "p90": float(np.percentile(v, 90)),
        }
        for name, v in rows
    }
    result = {
        "scenario": vars(args) | {"json": None},
        "host": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "hit_rate": mgr.prefix_cache_stats.hit_rate,
        "free_blocks_at_end": mgr.num_free_blocks(),
        "cached_blocks_at_end": mgr.num_cached_blocks(),
        "us_per_step": us_per_step,
    }
    print(
        f"\nallocator step: {args.num_reqs} running, {args.arrivals} arrivals x {args.prompt_len} "
        f"tokens ({args.shared_prefix_len}-token shared prefix on half), {args.decode_blocks} "
        f"decode blocks, block size {bs}, {args.steps} steps, {args.token_format} prompts; "
        f"hit rate {result['hit_rate']:.3f}"
    )
    print(f"{'phase (us/step)':34s} {'median':>9s} {'mean':>9s} {'p90':>9s}")
    for name, stats in us_per_step.items():
        print(f"{name:34s} {stats['median']:9.1f} {stats['mean']:9.1f} {stats['p90']:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
