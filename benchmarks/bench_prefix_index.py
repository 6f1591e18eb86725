"""The prefix index at the allocator step: its compiled key table against the ``dict`` twin.

``blocktable.key_table`` has two implementations of the map from block keys to record slots:
the compiled open-addressing ``KeyTable`` and ``DictKeyTable``, a Python ``dict``. This script
alternates them in one process (``PrefixIndex`` is made to build one or the other), each run
being ``bench_allocator.py``'s step scenario and its 1,000,000-token prompt, with numpy prompts
and with Python lists, on the thread's CPU time. The decision rule: the compiled table stays
only if it wins the allocator step by 1.5x or more.

The steady state is measured: the index keeps at most ``max_records`` records (twice the
pool's blocks), and this scenario's fill plus about 200 steps fill it; from then on every step
recycles (unfiles) about as many dead records as it files new ones. The default 800 timed
steps (after 50 untimed) are mostly such steps.

    PYTHONPATH=src python benchmarks/bench_prefix_index.py --runs 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import bench_allocator
from run_info import run_info

import blocktable.allocator.index as index_module
from blocktable import _compiled_loader
from blocktable.key_table import DictKeyTable


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=6, help="runs of each index, alternated")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if _compiled_loader.COMPILED is None:
        raise SystemExit("blocktable._compiled is not built: nothing to compare the dict with")
    bench_allocator.clock = time.thread_time_ns
    variants = {
        "dict": lambda capacity: DictKeyTable(capacity),
        "compiled table": _compiled_loader.COMPILED.KeyTable,
    }
    results: dict[str, Any] = {}
    for token_format in ("numpy", "list"):
        scenario = argparse.Namespace(
            num_reqs=1024, block_size=16, prompt_len=2048, shared_prefix_len=1024, arrivals=8,
            decode_blocks=64, num_blocks=131072, steps=args.steps, warmup=50, seed=0,
            api="batched", hash="fast", token_format=token_format, profile=False,
            long_prompt_len=1_000_000, chunk=2048, long_reps=3,
        )
        runs: dict[str, dict[str, list[float]]] = {v: {"step_us": [], "long_ms": []} for v in variants}
        for r in range(args.runs):
            for name in list(variants)[:: 1 if r % 2 else -1]:
                index_module.new_key_table = variants[name]
                step = bench_allocator.run_steps(scenario)["us_per_step"]["allocator step"]
                long = bench_allocator.run_long_prompt(scenario)["ms"]["one call, numpy prompt"]
                runs[name]["step_us"].append(step["median"])
                runs[name]["long_ms"].append(long["median"])
        for name, figures in runs.items():
            step, long = figures["step_us"], figures["long_ms"]
            print(f"{token_format} prompts, {name}: step {statistics.median(step):.0f} us "
                  f"({min(step):.0f}-{max(step):.0f}), 1M prompt {statistics.median(long):.1f} ms "
                  f"({min(long):.1f}-{max(long):.1f})")
        results[f"{token_format} prompts"] = runs
    index_module.new_key_table = variants["compiled table"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info(), "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
