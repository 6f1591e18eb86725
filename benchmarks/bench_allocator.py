"""Host time of the block allocator: one scheduling step, a 1M-token prompt, freeing.

Step scenario: manager block size 16, 1024 running requests; every step 8 requests finish and 8
arrive with 2048-token prompts, half of them sharing a 1024-token prefix (64 cached blocks), and
64 running requests cross a block boundary while decoding (16 sampled tokens appended, one new
block each). The pool is small enough that allocation evicts cached blocks in the steady state.

Timed per step (host microseconds), with the batched calls (``--api batched``, default) or the
per-request ones (``--api per-request``): ``free`` of the finished requests,
``append_token_ids`` of the sampled tokens, admission of the arrivals (token conversion, key
hashing, prefix lookup), ``allocate`` of their prompts and of the 64 decode blocks (one call
for all in batched mode), ``take_step_update``, ``mark_computed`` (hashing and indexing newly
full blocks). "allocator step" sums them (the target); the table's batched ``apply`` of the
update is reported beside it.

Long prompt: one 1,000,000-token prompt admitted, allocated and marked computed (every full
block hashed and indexed) in one call each, and the same prompt as 2048-token chunks (one
``allocate`` + ``mark_computed`` per chunk); median of ``--long-reps`` fresh managers.

Usage::

    python benchmarks/bench_allocator.py [--steps 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import time
from typing import Any

import numpy as np
from allocator_workload import AllocatorWorkload
from floors import format_floors, measure_floors
from run_info import run_info

from blocktable import GroupSpec, MultiGroupBlockTable
from blocktable.allocator import AllocatorGroupSpec, KVCacheManager

clock = time.perf_counter_ns  # --clock cpu: time.process_time_ns (for a loaded machine)

STEP_PHASES = (
    "free",
    "append_token_ids",
    "add_requests",
    "allocate",
    "take_step_update",
    "mark_computed",
)


class PhaseProfile:
    """``--profile``: one cProfile per phase of the timed steps, summarised per step.

    Counts what each phase costs in calls: every Python function call, the numpy functions and
    array methods among them (operators such as ``a + b`` and indexing are not calls and are
    not counted), and blocktable's own Python functions. Times under the profiler are inflated
    by its overhead; the counts are exact.
    """

    def __init__(self) -> None:
        self.profiles: dict[str, cProfile.Profile] = {}
        self.active: cProfile.Profile | None = None

    def switch(self, phase: str | None) -> None:
        if self.active is not None:
            self.active.disable()
            self.active = None
        if phase is not None:
            self.active = self.profiles.setdefault(phase, cProfile.Profile())
            self.active.enable()

    def report(self, num_steps: int, top: int = 6) -> None:
        print(f"\nper phase and step, under cProfile ({num_steps} steps)")
        print(f"{'phase':18s} {'us (prof.)':>10s} {'calls':>8s} {'numpy':>8s} {'blocktable':>10s}")
        tops = []
        for phase, prof in self.profiles.items():
            stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
            calls = numpy_calls = own_calls = 0
            rows = []
            for (filename, _, name), (_, ncalls, tottime, _, _) in stats.items():
                calls += ncalls
                if "numpy" in filename or "numpy" in name:
                    numpy_calls += ncalls
                if "blocktable" in filename:
                    own_calls += ncalls
                    rows.append((tottime, name, ncalls))
            total = sum(v[2] for v in stats.values())
            print(
                f"{phase:18s} {total / num_steps * 1e6:10.0f} {calls / num_steps:8.1f} "
                f"{numpy_calls / num_steps:8.1f} {own_calls / num_steps:10.1f}"
            )
            rows.sort(reverse=True)
            tops.append(
                f"  {phase}: "
                + ", ".join(
                    f"{n} {t / num_steps * 1e6:.0f} us x{c / num_steps:g}" for t, n, c in rows[:top]
                )
            )
        print("blocktable functions by own time (us per step under the profiler, calls per step):")
        print("\n".join(tops))


def run_steps(args: argparse.Namespace) -> dict[str, Any]:
    bs = args.block_size
    workload = AllocatorWorkload(
        num_reqs=args.num_reqs,
        block_size=bs,
        prompt_len=args.prompt_len,
        shared_prefix_len=args.shared_prefix_len,
        arrivals=args.arrivals,
        decode_blocks=args.decode_blocks,
        seed=args.seed,
        token_format=args.token_format,
    )
    mgr = KVCacheManager(
        [AllocatorGroupSpec(block_size=bs, num_blocks=args.num_blocks)],
        max_num_reqs=args.num_reqs,
        hash_fn=args.hash,
    )
    max_model_len = args.prompt_len + bs * (args.warmup + args.steps + 2)
    table = MultiGroupBlockTable(
        [GroupSpec(bs, num_blocks=args.num_blocks)], args.num_reqs, max_model_len, 8192, "cpu"
    )
    batched = args.api == "batched"
    profile = PhaseProfile() if args.profile else None

    times: dict[str, list[float]] = {name: [] for name in (*STEP_PHASES, "table_apply")}
    for req_id, prompt in workload.fill():
        hit = mgr.add_request(req_id, prompt)
        mgr.allocate(req_id, len(prompt) - hit)
        mgr.mark_computed(req_id, len(prompt) - hit)
    table.apply(mgr.take_step_update())

    for step in range(args.warmup + args.steps):
        t: dict[str, int] = {}
        events = workload.next_step()
        finished, new_ids, prompts = events.finished, events.new_ids, events.prompts
        decoding, sampled = events.decoding, events.sampled

        t0 = clock()
        if profile is not None and step >= args.warmup:
            profile.switch("free")
        if batched:
            mgr.free_many(finished)
        else:
            for req_id in finished:
                mgr.free(req_id)
        t1 = clock()
        if profile is not None and step >= args.warmup:
            profile.switch("append_token_ids")
        if batched:
            mgr.append_token_ids_many(decoding, sampled)
        else:
            for req_id, tokens in zip(decoding, sampled):
                mgr.append_token_ids(req_id, tokens)
        t2 = clock()
        if profile is not None and step >= args.warmup:
            profile.switch("add_requests")
        if batched:
            cached = mgr.add_requests(new_ids, prompts)
        else:
            cached = [mgr.add_request(r, p) for r, p in zip(new_ids, prompts)]
        t3 = clock()
        if profile is not None and step >= args.warmup:
            profile.switch("allocate")
        scheduled = new_ids + decoding
        num_new = [len(p) - c for p, c in zip(prompts, cached)] + [bs] * len(decoding)
        if batched:
            mgr.allocate_many(scheduled, num_new)
        else:
            for r, n in zip(scheduled, num_new):
                mgr.allocate(r, n)
        t4 = clock()
        if profile is not None and step >= args.warmup:
            profile.switch("take_step_update")
        update = mgr.take_step_update()
        t5 = clock()
        if profile is not None and step >= args.warmup:
            profile.switch("table_apply")
        table.apply(update)
        t6 = clock()
        if profile is not None and step >= args.warmup:
            profile.switch("mark_computed")
        if batched:
            mgr.mark_computed_many(scheduled, num_new)
        else:
            for r, n in zip(scheduled, num_new):
                mgr.mark_computed(r, n)
            mgr.num_free_blocks()  # applies the recorded marks (their work counts here)
        t7 = clock()
        if profile is not None:
            profile.switch(None)
        t.update(free=t1 - t0, append_token_ids=t2 - t1, add_requests=t3 - t2, allocate=t4 - t3)
        t.update(take_step_update=t5 - t4, table_apply=t6 - t5, mark_computed=t7 - t6)
        if step >= args.warmup:
            for name, ns in t.items():
                times[name].append(ns / 1e3)

    if profile is not None:
        profile.report(args.steps)
    mgr.check_integrity()
    for req_id in workload.running:  # the table holds exactly the allocator's blocks
        row = table[0].row(mgr.row_of(req_id))
        if row.tolist() != mgr.block_ids(req_id)[0]:
            raise SystemExit(f"FAILED: request {req_id}: the table's row != the allocator's blocks")
    times["allocator step"] = [sum(v) for v in zip(*(times[n] for n in STEP_PHASES))]
    times["allocator step + table apply"] = [
        a + b for a, b in zip(times["allocator step"], times["table_apply"])
    ]
    return {
        "hit_rate": mgr.prefix_cache_stats.hit_rate,
        "free_blocks_at_end": mgr.num_free_blocks(),
        "cached_blocks_at_end": mgr.num_cached_blocks(),
        "us_per_step": {name: _stats(v) for name, v in times.items()},
    }


def run_long_prompt(args: argparse.Namespace) -> dict[str, Any]:
    bs = args.block_size
    num_tokens = args.long_prompt_len
    prompt = np.random.default_rng(args.seed).integers(0, 32000, num_tokens)
    prompt_list = prompt.tolist()
    results: dict[str, list[float]] = {
        "one call, numpy prompt": [],
        "one call, list prompt": [],
        "2048-token chunks, numpy prompt": [],
    }

    def fresh() -> KVCacheManager:
        return KVCacheManager([AllocatorGroupSpec(bs, num_tokens // bs + 2)], 4, hash_fn=args.hash)

    for _ in range(args.long_reps):
        for name, tokens in (
            ("one call, numpy prompt", prompt),
            ("one call, list prompt", prompt_list),
        ):
            mgr = fresh()
            t0 = clock()
            mgr.add_request("long", tokens)
            mgr.allocate("long", num_tokens)
            mgr.mark_computed("long", num_tokens)
            mgr.num_free_blocks()  # applies the recorded mark (its work counts here)
            results[name].append((clock() - t0) / 1e6)
        mgr.check_integrity() if args.long_reps == 1 else None
        _check_cached(mgr, num_tokens // bs)
        mgr = fresh()
        t0 = clock()
        mgr.add_request("long", prompt)
        for start in range(0, num_tokens, args.chunk):
            n = min(args.chunk, num_tokens - start)
            mgr.allocate("long", n)
            mgr.mark_computed("long", n)
        mgr.num_free_blocks()  # applies the last recorded mark
        results["2048-token chunks, numpy prompt"].append((clock() - t0) / 1e6)
        _check_cached(mgr, num_tokens // bs)
    return {"ms": {name: _stats(v) for name, v in results.items()}}


def run_free(args: argparse.Namespace) -> dict[str, Any]:
    """free_many of 8 finished 2048-token requests (fully computed, half sharing a prefix)."""
    rng = np.random.default_rng(args.seed)
    bs, n = args.block_size, args.arrivals
    shared = rng.integers(0, 32000, args.shared_prefix_len)
    times = []
    mgr = KVCacheManager([AllocatorGroupSpec(bs, 64 * 1024)], 64, hash_fn=args.hash)
    for rep in range(args.free_reps):
        ids = [f"{rep}-{i}" for i in range(n)]
        prompts = [
            np.concatenate((shared, rng.integers(0, 32000, args.prompt_len - len(shared))))
            if i % 2
            else rng.integers(0, 32000, args.prompt_len)
            for i in range(n)
        ]
        cached = mgr.add_requests(ids, prompts)
        num_new = [len(p) - c for p, c in zip(prompts, cached)]
        mgr.allocate_many(ids, num_new)
        mgr.mark_computed_many(ids, num_new)
        mgr.take_step_update()
        t0 = clock()
        mgr.free_many(ids)
        times.append((clock() - t0) / 1e3)
    mgr.check_integrity()
    return {"us": _stats(times[len(times) // 5 :])}


def _check_cached(mgr: KVCacheManager, num_blocks: int) -> None:
    if mgr.num_cached_blocks() != num_blocks:
        raise SystemExit(f"FAILED: {mgr.num_cached_blocks()} cached blocks, expected {num_blocks}")


def _stats(v: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(v),
        "mean": statistics.fmean(v),
        "p90": float(np.percentile(v, 90)),
        "n": len(v),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-reqs", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--shared-prefix-len", type=int, default=1024)
    p.add_argument("--arrivals", type=int, default=8, help="admissions (and finishes) per step")
    p.add_argument("--decode-blocks", type=int, default=64, help="decode blocks per step")
    p.add_argument("--num-blocks", type=int, default=131072)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api", choices=("batched", "per-request"), default="batched")
    p.add_argument("--hash", choices=("fast", "sha256"), default="fast")
    p.add_argument(
        "--token-format",
        choices=("list", "numpy"),
        default="numpy",
        help="how prompts reach the allocator (a list costs ~7 ns per token more)",
    )
    p.add_argument("--long-prompt-len", type=int, default=1_000_000)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--long-reps", type=int, default=7)
    p.add_argument("--free-reps", type=int, default=200)
    p.add_argument("--skip", nargs="*", default=[], choices=("step", "long", "free"))
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time, less disturbed by other loads on a shared host",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="step: per phase, calls per step (all, numpy, blocktable) under cProfile",
    )
    p.add_argument("--json", type=str, default=None, help="write the results here")
    args = p.parse_args()
    global clock
    clock = time.process_time_ns if args.clock == "cpu" else time.perf_counter_ns

    result: dict[str, object] = {
        **run_info(),
        "scenario": vars(args) | {"json": None},
        "host": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "floors": measure_floors("cpu"),  # the host's state: compare ratios, not absolutes
    }
    print(format_floors(result["floors"]))
    if "step" not in args.skip:
        result["step"] = step = run_steps(args)
        print(
            f"\nallocator step ({args.api} calls, {args.hash} hash, {args.token_format} prompts): "
            f"{args.num_reqs} running, {args.arrivals} arrivals x {args.prompt_len} tokens "
            f"({args.shared_prefix_len}-token shared prefix on half), {args.decode_blocks} "
            f"decode blocks, block size {args.block_size}, {args.steps} steps; "
            f"hit rate {step['hit_rate']:.3f}"
        )
        print(f"{'phase (us/step)':34s} {'median':>9s} {'mean':>9s} {'p90':>9s}")
        for name, s in step["us_per_step"].items():
            print(f"{name:34s} {s['median']:9.1f} {s['mean']:9.1f} {s['p90']:9.1f}")
    if "long" not in args.skip:
        result["long_prompt"] = long = run_long_prompt(args)
        print(
            f"\n{args.long_prompt_len}-token prompt, admitted + allocated + hashed "
            f"({args.long_reps} reps)"
        )
        print(f"{'case (ms)':34s} {'median':>9s} {'mean':>9s} {'p90':>9s}")
        for name, s in long["ms"].items():
            print(f"{name:34s} {s['median']:9.2f} {s['mean']:9.2f} {s['p90']:9.2f}")
    if "free" not in args.skip:
        result["free"] = free = run_free(args)
        s = free["us"]
        print(
            f"\nfree_many of {args.arrivals} finished {args.prompt_len}-token requests: "
            f"median {s['median']:.1f} us, mean {s['mean']:.1f}, p90 {s['p90']:.1f}"
        )
    result["floors_after"] = measure_floors("cpu")
    print(format_floors(result["floors_after"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
