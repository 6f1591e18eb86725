"""Prefix hits under eviction: in which order blocks that leave a sliding window are queued.

When one ``mark_computed`` moves a request's window past several blocks (a prefill chunk),
those blocks join the free queue together, and the order among them decides which of them the
next evictions take first. Two orders are compared on the same workload:

* ``oldest first``: the block of the lowest position is queued first, so it is evicted first;
* ``newest first``: the block nearest the window is queued first and evicted first (vLLM 0.33
  frees skipped blocks this way).

The allocator ships one of them; the other is run by a small subclass of ``KVCacheManager``
defined here (the shipped allocator has no switch). Which is which is found by a probe.

Workload (per seed): a hybrid model, one full-attention group and one sliding-window group
(block 16 tokens each, window ``--window`` tokens, ``--num-blocks`` blocks per group), a
scheduler with ``--max-reqs`` rows and a ``--budget``-token step (chunked prefill, decode
first, the most recently admitted request preempted when blocks run out). ``--requests``
requests arrive; ``--shared`` of them start with one of ``--prompts`` system prompts
(``--system-len``, default 384..1024 tokens, popularity Zipf-like), the others are unrelated
traffic; every request adds a private user part (``--user-len``, default 32..512 tokens) and
generates 16..96 tokens. The prefix-hit rate is the
allocator's ``prefix_cache_stats``: tokens served from the cache / prompt tokens looked up
(every admission, resumed ones included). ``check_integrity`` runs every 256 steps and at the
end; the script exits non-zero if it fails in any run.

Usage::

    PYTHONPATH=src python benchmarks/bench_window_order.py [--seeds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from typing import Any

import numpy as np
from run_info import run_info

from blocktable.allocator import (
    AllocatorGroupSpec,
    IntegrityError,
    KVCacheManager,
    OutOfBlocksError,
)

BLOCK_SIZE = 16  # tokens per block, both groups
VOCAB = 32000


class ReversedWindowRelease(KVCacheManager):
    """The shipped allocator with the opposite queueing order for blocks leaving a window.

    Each request's blocks are released on their own with the ids reversed; releasing the
    requests one by one queues a block shared by two of them where its last reference drops,
    as one call for all of them does.
    """

    def _release_outside_window(self, reqs: list[Any], g: int, window: int) -> None:
        pool = self.pools[g]
        shipped = pool.release

        def reversed_release(block_ids: np.ndarray, *, may_repeat: bool = False) -> None:
            shipped(block_ids[::-1], may_repeat=may_repeat)

        pool.release = reversed_release  # type: ignore[method-assign]
        try:
            for req in reqs:
                super()._release_outside_window([req], g, window)
        finally:
            del pool.release  # the instance attribute: back to the class's method


def release_order(cls: type[KVCacheManager]) -> str:
    """Probe: which block of three leaving a window at once is queued first."""
    mgr = cls([AllocatorGroupSpec(4, 16, sliding_window=4)], 1)
    mgr.add_request("probe", list(range(17)))
    blocks = mgr.allocate("probe", 17)[0]
    mgr.mark_computed("probe", 17)  # the next token 17 reads [14, 17]: blocks 0..2 leave
    queued = [b for b in mgr.pools[0].eviction_order() if b in blocks[:3]]
    if queued == blocks[:3]:
        return "oldest first"
    if queued == blocks[2::-1]:
        return "newest first"
    raise SystemExit(f"FAILED: probe queued {queued} for blocks {blocks[:3]}")


def make_requests(seed: int, args: argparse.Namespace) -> list[tuple[np.ndarray, int]]:
    """``(prompt, num_output_tokens)`` per request, in arrival order."""
    rng = np.random.default_rng(seed)
    lo, hi = args.system_len
    systems = [rng.integers(0, VOCAB, int(rng.integers(lo, hi + 1))) for _ in range(args.prompts)]
    weights = 1.0 / np.arange(1, args.prompts + 1)
    weights /= weights.sum()
    out = []
    for _ in range(args.requests):
        user = rng.integers(0, VOCAB, int(rng.integers(args.user_len[0], args.user_len[1] + 1)))
        if rng.random() < args.shared:
            prompt = np.concatenate((systems[rng.choice(args.prompts, p=weights)], user))
        else:
            prompt = np.concatenate((rng.integers(0, VOCAB, int(rng.integers(128, 1025))), user))
        out.append((prompt, int(rng.integers(16, 97))))
    return out


def run(cls: type[KVCacheManager], seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Serve one seed's requests to the end; the hit counters and whether integrity held."""
    groups = [
        AllocatorGroupSpec(BLOCK_SIZE, args.full_blocks),
        AllocatorGroupSpec(BLOCK_SIZE, args.window_blocks, sliding_window=args.window),
    ]
    mgr = cls(groups, args.max_reqs)
    requests = make_requests(seed, args)
    rng = np.random.default_rng(seed + 1_000_003)  # sampled tokens
    waiting: deque[int] = deque(range(len(requests)))
    running: list[int] = []  # admission order
    sequences = {r: [prompt] for r, (prompt, _) in enumerate(requests)}  # prompt, sampled
    generated = dict.fromkeys(range(len(requests)), 0)
    steps = 0
    integrity = "ok"
    while waiting or running:
        budget = args.budget
        scheduled: dict[int, int] = {}
        i = 0
        while i < len(running) and budget:
            r = running[i]
            n = min(mgr.num_tokens(r) - mgr.num_computed_tokens(r), budget)
            while True:
                try:
                    mgr.allocate(r, n)
                    break
                except OutOfBlocksError:
                    victim = running.pop()  # the most recently admitted
                    mgr.preempt(victim)  # it resumes with its tokens so far
                    scheduled.pop(victim, None)
                    waiting.appendleft(victim)
                    if victim == r:
                        break
            if r not in running:
                break
            scheduled[r] = n
            budget -= n
            i += 1
        while waiting and budget and len(running) < args.max_reqs:
            r = waiting[0]
            parts = sequences[r]
            prompt = parts[0] if len(parts) == 1 else np.concatenate(parts)
            num_cached = mgr.lookup_prefix(prompt)
            n = min(len(prompt) - num_cached, budget)
            if not mgr.can_admit(prompt, n):
                break
            waiting.popleft()
            mgr.add_request(r, prompt)
            mgr.allocate(r, n)
            running.append(r)
            scheduled[r] = n
            budget -= n
        if not scheduled:
            raise SystemExit(f"FAILED: seed {seed}: no request could be scheduled")
        ids = list(scheduled)
        mgr.mark_computed_many(ids, [scheduled[r] for r in ids])
        mgr.take_step_update()  # (no table here: the step's row changes are dropped)
        sampled, finished = [], []
        for r in ids:
            if mgr.num_computed_tokens(r) == mgr.num_tokens(r):  # the forward sampled a token
                generated[r] += 1
                if generated[r] >= requests[r][1]:
                    finished.append(r)
                else:
                    sampled.append(r)
        if sampled:
            new = rng.integers(0, VOCAB, (len(sampled), 1))
            mgr.append_token_ids_many(sampled, new)
            for r, token in zip(sampled, new):
                sequences[r].append(token)
        if finished:
            mgr.free_many(finished)
            done = set(finished)
            running = [r for r in running if r not in done]
        steps += 1
        if steps % 256 == 0 or not (waiting or running):
            try:
                mgr.check_integrity()
            except IntegrityError as e:
                integrity = f"step {steps}: {e}"
                break
    stats = mgr.prefix_cache_stats
    return {
        "seed": seed,
        "hit_tokens": stats.num_hit_tokens,
        "lookup_tokens": stats.num_query_tokens,
        "hit_rate": stats.hit_rate,
        "preemptions": mgr.num_preemptions,
        "steps": steps,
        "integrity": integrity,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--prompts", type=int, default=8, help="distinct system prompts")
    p.add_argument("--shared", type=float, default=0.7, help="share of requests with one")
    p.add_argument("--system-len", type=int, nargs=2, default=[384, 1024],
                   help="system prompt tokens, min max")
    p.add_argument("--user-len", type=int, nargs=2, default=[32, 512],
                   help="user part tokens, min max")
    p.add_argument("--window", type=int, default=256, help="sliding window, tokens")
    p.add_argument("--full-blocks", type=int, nargs="+", default=[2048],
                   help="blocks of the full-attention group (one run per size)")
    p.add_argument("--window-blocks", type=int, nargs="+", default=[200, 320, 512],
                   help="blocks of the sliding-window group (one run per size)")
    p.add_argument("--max-reqs", type=int, default=8)
    p.add_argument("--budget", type=int, default=512, help="tokens per step")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    orders = {release_order(cls): cls for cls in (KVCacheManager, ReversedWindowRelease)}
    shipped = release_order(KVCacheManager)
    results: dict[str, Any] = {"run": run_info(), "args": vars(args), "shipped": shipped,
                               "runs": []}
    failed = False
    rows = []
    paired = []
    for full_blocks in args.full_blocks:
        for window_blocks in args.window_blocks:
            sizes = argparse.Namespace(
                **{**vars(args), "full_blocks": full_blocks, "window_blocks": window_blocks}
            )
            by_order = {}
            for name, cls in orders.items():
                runs = []
                t0 = time.perf_counter()
                for seed in range(args.seeds):
                    one = run(cls, seed, sizes)
                    one.update(order=name, full_blocks=full_blocks, window_blocks=window_blocks)
                    runs.append(one)
                    if one["integrity"] != "ok":
                        failed = True
                        print(f"FAILED integrity: {name}, {full_blocks}/{window_blocks} blocks, "
                              f"seed {seed}: {one['integrity']}", file=sys.stderr)
                results["runs"].extend(runs)
                by_order[name] = [r["hit_rate"] for r in runs]
                rates = by_order[name]
                rows.append((full_blocks, window_blocks, name, statistics.median(rates),
                             min(rates), max(rates),
                             statistics.median(r["preemptions"] for r in runs),
                             time.perf_counter() - t0))
            # the same seed is the same workload: compare the orders seed by seed
            diffs = [n - o for n, o in zip(by_order["newest first"], by_order["oldest first"])]
            paired.append((full_blocks, window_blocks, statistics.median(diffs),
                           sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)))
    print(f"shipped order: {shipped}; {args.seeds} seeds, {args.requests} requests each, "
          f"window {args.window}, block {BLOCK_SIZE}, {args.max_reqs} rows, "
          f"{args.budget}-token steps, system prompts {args.system_len[0]}..{args.system_len[1]}, "
          f"user parts {args.user_len[0]}..{args.user_len[1]} tokens")
    print("| blocks: full / window group | order | hit rate, median (min-max) "
          "| preemptions, median | s |")
    print("|---|---|---|---|---|")
    for full_blocks, window_blocks, name, med, lo, hi, pre, secs in rows:
        mark = " (shipped)" if name == shipped else ""
        print(f"| {full_blocks} / {window_blocks} | {name}{mark} | {med:.3f} ({lo:.3f}-{hi:.3f})"
              f" | {pre:g} | {secs:.1f} |")
    print()
    print("| blocks: full / window group | newest - oldest, median per seed | seeds newest wins "
          "| seeds oldest wins |")
    print("|---|---|---|---|")
    for full_blocks, window_blocks, diff, newest, oldest in paired:
        print(f"| {full_blocks} / {window_blocks} | {diff:+.4f} | {newest} | {oldest} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
