"""Host cost of the batched update and the commit staging: numpy loops, and numba's for contrast.

Two workloads on a 1024-row table 8192 blocks wide (manager block 16, CPU device):

- ``decode-64``: one decode step's update, 64 of 1024 rows gain one block (``apply``), then
  ``commit`` (on the CPU backend: staging + an indexed write);
- ``add-1024x512``: one batched ``apply`` that replaces 1024 rows with 512 ids each, against
  1024 ``add_row`` calls.

``--numba`` also times the compiled loops this library used before (loaded from the git history
at ``NUMBA_COMMIT``; needs ``numba`` and ``git``), swapped in for the numpy ones in the same
process, interleaved, so both columns see the same machine state (``--numba-file PATH``: a copy
of that module, where the git history is not at hand). Their compile time is reported
apart (the first call compiles; numba's on-disk cache is off here).

    PYTHONPATH=src python benchmarks/bench_host_loops.py [--numba] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import ModuleType

import numpy as np
import torch
from run_info import run_info

from blocktable import GroupSpec, MultiGroupBlockTable, RowBlocks, StepUpdate, batch, commit
from blocktable import _host_loops as numpy_loops

NUMBA_COMMIT = "29d6d58"  # the last commit with the numba loops
MAX_REQS = 1024
MAX_MODEL_LEN = 131072


def load_numba_loops(path: str | None = None) -> ModuleType:
    """The old numba module: from ``path`` (a copy of it), else from the git history."""
    if path is not None:
        with open(path) as f:
            src = f.read()
    else:
        src = subprocess.run(
            ["git", "show", f"{NUMBA_COMMIT}:src/blocktable/_host_loops.py"],
            check=True, capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout
    src = src.replace("cache=True", "cache=False")
    path = os.path.join(tempfile.mkdtemp(), "_numba_host_loops.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("_numba_host_loops", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def use(loops: ModuleType) -> None:
    batch.loops = loops
    commit.fill_staging = loops.fill_staging


def table() -> MultiGroupBlockTable:
    return MultiGroupBlockTable([GroupSpec(16)], MAX_REQS, MAX_MODEL_LEN, 8192, "cpu")


def decode_updates(rng: np.random.Generator, n: int) -> list[StepUpdate]:
    out = []
    for _ in range(n):
        rows = rng.choice(MAX_REQS, 64, replace=False).astype(np.int32)
        ids = rng.integers(1, 2**20, 64, dtype=np.int32)
        out.append(StepUpdate.make(1, appended=[RowBlocks(rows, np.ones(64, np.int32), ids)]))
    return out


def bench_decode(bt: MultiGroupBlockTable, ups: list[StepUpdate]) -> tuple[list[float], list[float]]:
    apply_s, commit_s = [], []
    for u in ups:
        if bt[0].num_kernel_blocks.max() > bt[0].width - 2:
            bt.clear()
            bt.commit()
        t0 = time.perf_counter()
        bt.apply(u)
        t1 = time.perf_counter()
        bt.commit()
        t2 = time.perf_counter()
        apply_s.append(t1 - t0)
        commit_s.append(t2 - t1)
    return apply_s, commit_s


def bench_add(bt: MultiGroupBlockTable, upd: StepUpdate) -> float:
    t0 = time.perf_counter()
    bt.apply(upd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--numba", action="store_true", help="also time the old numba loops")
    ap.add_argument("--numba-file", default=None,
                    help=f"a copy of the old module (git show {NUMBA_COMMIT}:src/blocktable/"
                    "_host_loops.py)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    versions: dict[str, ModuleType] = {"numpy": numpy_loops}
    compile_s = None
    if args.numba:
        nb = load_numba_loops(args.numba_file)
        use(nb)
        t0 = time.perf_counter()
        warm = table()
        warm.apply(decode_updates(rng, 1)[0])
        warm.commit()
        warm.apply(StepUpdate.make(1, added=[RowBlocks.from_lists([0, 1], [[1], [2]])],
                                   cleared_rows=[3]))
        compile_s = time.perf_counter() - t0
        versions["numba"] = nb
    ups = decode_updates(rng, 200)
    rows = np.arange(MAX_REQS, dtype=np.int32)
    ids = rng.integers(1, 2**20, MAX_REQS * 512, dtype=np.int32)
    add = StepUpdate.make(1, added=[RowBlocks(rows, np.full(MAX_REQS, 512, np.int32), ids)])
    samples: dict[str, dict[str, list[float]]] = {
        v: {"apply": [], "commit": [], "add": []} for v in versions
    }
    per_row: list[float] = []
    tables = {v: table() for v in versions}
    for _ in range(args.rounds):
        for name, loops in versions.items():  # interleaved: same machine state for both
            use(loops)
            a, c = bench_decode(tables[name], ups)
            samples[name]["apply"] += a
            samples[name]["commit"] += c
            samples[name]["add"].append(bench_add(tables[name], add))
            tables[name].commit()
        bt = tables["numpy"]
        t0 = time.perf_counter()
        for r in range(MAX_REQS):
            bt.add_row((ids[r * 512 : (r + 1) * 512],), r)
        per_row.append(time.perf_counter() - t0)
        bt.commit()
    use(numpy_loops)
    res: dict = {
        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "python": sys.version.split()[0], "numpy": np.__version__,
        "numba_compile_s": compile_s, "per_row_add_ms": statistics.median(per_row) * 1e3,
    }
    for name in versions:
        s = samples[name]
        res[name] = {
            "decode64_apply_us": statistics.median(s["apply"]) * 1e6,
            "decode64_commit_us": statistics.median(s["commit"]) * 1e6,
            "add_1024x512_ms": statistics.median(s["add"]) * 1e3,
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_info(), **res}, f, indent=2)
    print(f"\nhost loops on {os.cpu_count()} cpus (numpy {np.__version__}); medians")
    print(f"{'version':<8}{'decode-64 apply µs':>20}{'commit µs':>11}{'add 1024x512 ms':>17}"
          f"{'vs per-row':>12}")
    for name in versions:
        r = res[name]
        print(f"{name:<8}{r['decode64_apply_us']:>20.1f}{r['decode64_commit_us']:>11.1f}"
              f"{r['add_1024x512_ms']:>17.2f}{res['per_row_add_ms'] / r['add_1024x512_ms']:>11.1f}x")
    print(f"per-row add_row x1024: {res['per_row_add_ms']:.2f} ms"
          + (f"; numba first-call compile {compile_s:.1f} s" if compile_s is not None else ""))


if __name__ == "__main__":
    main()
