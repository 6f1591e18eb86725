"""The prefix index at the allocator step: the ``dict`` against the numpy key table it replaced.

The key table is read from the repository's history (``git show``; it is no longer in the
package) and patched into :class:`~blocktable.allocator.index.PrefixIndex` in place of the
``dict``; the two are alternated in one process, each run being ``bench_allocator.py``'s step
scenario and its 1,000,000-token prompt, on the thread's CPU time. The decision rule: the
``dict`` stays unless the key table wins the allocator step by 1.5x or more.

    PYTHONPATH=src python benchmarks/bench_prefix_index.py --runs 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from typing import Any

import bench_allocator
import numpy as np
from run_info import run_info

import blocktable.allocator.index as index_module
from blocktable.allocator import KVCacheManager

KEY_TABLE_COMMIT = "88271b8"  # the last commit with allocator/keytable.py
_HAS_REPEATS = '''
def _repeats(ids):
    s = np.sort(ids)
    return bool(len(ids) > 1 and (s[1:] == s[:-1]).any())
'''


def key_table_class() -> type:
    """``KeyTable`` as it was at :data:`KEY_TABLE_COMMIT` (its one helper import inlined)."""
    source = subprocess.run(
        ["git", "show", f"{KEY_TABLE_COMMIT}:src/blocktable/allocator/keytable.py"],
        capture_output=True, text=True, check=True,
    ).stdout
    source = source.replace(
        "from blocktable.allocator.arrays import has_repeats as _repeats\n", _HAS_REPEATS
    )
    namespace: dict[str, Any] = {"__name__": "keytable_at_" + KEY_TABLE_COMMIT}
    exec(compile(source, "keytable.py", "exec"), namespace)  # noqa: S102 (our own history)
    return namespace["KeyTable"]  # type: ignore[no-any-return]


SWAPPED = ("__init__", "find", "find_one", "file_absent", "file_one", "unfile", "clear")


def key_table_methods(key_table: type) -> dict[str, Any]:
    """``PrefixIndex``'s key-filing methods, filing in ``key_table`` instead of the ``dict``."""
    index = index_module.PrefixIndex
    dict_init, dict_clear = index.__init__, index.clear

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        dict_init(self, *args, **kwargs)
        self.table = key_table(self.max_records)
        self.key = self.table.key_of_value

    def clear(self: Any) -> None:
        self.table.clear()
        dict_clear(self)

    return {
        "__init__": __init__,
        "find": lambda self, keys: self.table.get(np.asarray(keys, dtype=np.uint64)),
        "find_one": lambda self, key: self.table.get_one(key),
        "file_absent": lambda self, keys, slots: self.table.insert_absent(keys, slots),
        "file_one": lambda self, key, slot: self.table.insert_one(key, slot),
        "unfile": lambda self, slots: self.table.delete_values(slots),
        "clear": clear,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=6, help="runs of each index, alternated")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    bench_allocator.clock = time.thread_time_ns
    KVCacheManager.check_integrity = lambda self: None  # (the checker reads the dict)
    index = index_module.PrefixIndex
    variants = {
        "dict": {name: getattr(index, name) for name in SWAPPED},
        "key table": key_table_methods(key_table_class()),
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
                for method, fn in variants[name].items():
                    setattr(index, method, fn)
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
    for method, fn in variants["dict"].items():
        setattr(index, method, fn)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**run_info(), "key_table_commit": KEY_TABLE_COMMIT, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
