"""Host time of the allocator journal's ``take``: the compare of every row with its start.

A :class:`blocktable.allocator.journal.StepJournal` over a row state of ``--rows`` rows (one
group, every row held), where each step grows ``--changed`` rows by one block and the next
shrinks them back; per step one ``take`` is timed in this thread's CPU time, with the compiled
pass and with its numpy twin, alternated step by step in one process, warm and with the caches
evicted before each take (a 32 MiB write, as a model forward between engine steps does). Reports
the median over steps with the 10th and 90th percentiles, in µs. Each step's two updates are
compared array by array: a difference exits non-zero.

    PYTHONPATH=src python benchmarks/bench_journal_take.py [--rows 8 256 1024] [--steps 2000]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np
from run_info import run_info

import blocktable._compiled_loader as loader
from blocktable.allocator.journal import StepJournal
from blocktable.allocator.rowstate import RowState


def journals(num_rows: int) -> tuple[RowState, StepJournal, StepJournal]:
    """A row state with every row held (3 blocks each), and a compiled and a numpy journal."""
    state = RowState(num_rows, 1)
    state.holder_gen[:] = np.arange(1, num_rows + 1)
    state.row_len[:] = 3
    compiled = loader.COMPILED
    if compiled is None:
        sys.exit("blocktable._compiled is not built: build it to compare the two")
    fast = StepJournal(1, state)
    loader.COMPILED = None
    try:
        plain = StepJournal(1, state)
    finally:
        loader.COMPILED = compiled
    fast.take()
    plain.take()
    return state, fast, plain


def same(a: object, b: object) -> bool:
    """Whether two updates hold equal arrays (both int32), part by part."""
    pairs = [(a.cleared_rows, b.cleared_rows)]  # type: ignore[attr-defined]
    for x, y in zip((*a.added, *a.appended), (*b.added, *b.appended)):  # type: ignore[attr-defined]
        pairs += [(getattr(x, f.name), getattr(y, f.name)) for f in dataclasses.fields(x)]
    return all(p.dtype == q.dtype == np.int32 and np.array_equal(p, q) for p, q in pairs)


def run(num_rows: int, num_changed: int, steps: int, cold: bool) -> dict[str, list[float]]:
    state, fast, plain = journals(num_rows)
    rows = np.linspace(0, num_rows - 1, min(num_changed, num_rows)).astype(np.intp)
    evict = np.zeros(32 << 20, dtype=np.uint8)
    times: dict[str, list[float]] = {"compiled": [], "numpy": []}
    for step in range(steps):
        state.row_len[0, rows] += 1 if step % 2 == 0 else -1
        updates = []
        for name, journal in (("compiled", fast), ("numpy", plain))[:: 1 if step % 4 < 2 else -1]:
            if cold:
                evict += 1
            t = time.thread_time()
            updates.append(journal.take())
            times[name].append(time.thread_time() - t)
        if not same(*updates):
            sys.exit(f"{num_rows} rows, step {step}: the compiled and numpy updates differ")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 256, 1024])
    ap.add_argument("--changed", type=int, default=16, help="rows grown (then shrunk) a step")
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    print(run_info())
    print(f"journal.take, µs of thread time per take: median (p10-p90) over {args.steps} steps")
    print(f"{'rows':>6} {'caches':>6} {'compiled':>20} {'numpy':>20}")
    for num_rows in args.rows:
        for cold in (False, True):
            t = run(num_rows, args.changed, args.steps if not cold else args.steps // 4, cold)
            cells = [
                f"{np.median(v) * 1e6:.1f} ({np.percentile(v, 10) * 1e6:.1f}-"
                f"{np.percentile(v, 90) * 1e6:.1f})" for v in (t["compiled"], t["numpy"])
            ]
            print(f"{num_rows:>6} {'cold' if cold else 'warm':>6} {cells[0]:>20} {cells[1]:>20}")


if __name__ == "__main__":
    main()
