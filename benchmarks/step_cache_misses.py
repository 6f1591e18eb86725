"""Cache lines the engine's block-table step misses per decode step, counted by a simulated
cache: the cold-cache cost that wall time shows only through its noise.

Between two engine steps the model's forward pass evicts the caches, so most of a step's host
time is spent fetching its code and data again. This runs ``bench_engine_loop.py``'s
decode-256 workload on the CPU with the forward pass replaced by a pass over 32 MiB (the same
eviction, without the model's work), under valgrind's ``callgrind`` with its cache simulation
(a last-level cache of ``--ll-mib``), collecting only inside the block-table step's two calls
(the allocator's ``take_step_update`` and the captured step's ``run_staged``) on decode steps.
It prints, per step, the instructions run and the lines missed in the last-level cache:
instruction fetches (ILmr), data reads (DLmr) and data writes (DLmw). The counts are
deterministic for a given build: compare two checkouts by running this in each.

    PYTHONPATH=src python benchmarks/step_cache_misses.py            # needs valgrind
    PYTHONPATH=src python benchmarks/step_cache_misses.py --steps 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import shutil
import subprocess
import sys
import tempfile

NUM_REQS = 256
EVENTS = ("Ir", "ILmr", "DLmr", "DLmw")


def child(steps: int) -> None:
    """The workload, each decode step's two table calls made through ``operator.call`` (a C
    function callgrind can start and stop collecting at)."""
    import numpy as np
    import torch
    from bench_engine_loop import decode_engine

    engine = decode_engine("cpu", NUM_REQS, steps, captured=True)
    evict = np.zeros(32 << 20, dtype=np.uint8)

    def forward(input_ids, positions, attn, logits_indices):
        evict.__iadd__(1)  # the caches emptied, as by a forward pass
        return torch.zeros(len(logits_indices), 8)  # every request samples token 0

    engine.model = forward
    step, manager = engine.captured_step, engine.manager
    assert step is not None, "the captured step is off"
    take, run_staged = manager.take_step_update, step.run_staged
    decode = [False]
    manager.take_step_update = lambda *a: (operator.call(take, *a) if decode[0] else take(*a))
    step.run_staged = lambda *a, **k: (operator.call(run_staged, *a, **k) if decode[0]
                                       else run_staged(*a, **k))
    counted = 0
    while engine.has_unfinished():
        # a decode step: every request running, one token each (known from the last step)
        result = engine.step()
        decode[0] = result.num_reqs == NUM_REQS and result.num_tokens == NUM_REQS
        counted += decode[0]
    print(json.dumps({"decode_steps_collected": counted - 1}))  # (the last one ran no step)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="decode steps (default 100)")
    ap.add_argument("--ll-mib", type=int, default=8, help="simulated last-level cache, MiB")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.steps)
        return 0
    if shutil.which("valgrind") is None:
        print("step_cache_misses: valgrind is not installed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes",
               f"--LL={args.ll_mib << 20},16,64", "--collect-atstart=no",
               "--toggle-collect=_operator_call", f"--callgrind-out-file={out}",
               sys.executable, os.path.abspath(__file__), "--child", "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        counted = json.loads(proc.stdout.strip().splitlines()[-1])["decode_steps_collected"]
        events, totals = _totals(out)
    if counted <= 0:
        print("step_cache_misses: no decode step was collected", file=sys.stderr)
        return 1
    per_step = {e: totals[events.index(e)] / counted for e in EVENTS}
    res = {"decode_steps": counted, "ll_mib": args.ll_mib, "per_step": per_step,
           "python": sys.version.split()[0]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    print(f"block-table step (take_step_update + run_staged), decode-256, per step over "
          f"{counted} steps, simulated {args.ll_mib} MiB last-level cache:")
    print("  " + "  ".join(f"{e} {per_step[e]:,.0f}" for e in EVENTS))
    if per_step["Ir"] == 0:
        print("step_cache_misses: nothing collected (is _operator_call a symbol of this "
              "Python?)", file=sys.stderr)
        return 1
    return 0


def _totals(path: str) -> tuple[list[str], list[int]]:
    """The event names and the whole run's totals of a callgrind output file."""
    events: list[str] = []
    totals: list[int] = []
    with open(path) as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith(("totals:", "summary:")):
                totals = [int(v) for v in line.split()[1:]]
    if not events or not totals:
        raise RuntimeError(f"no events or totals in {path}")
    return events, totals + [0] * (len(events) - len(totals))


if __name__ == "__main__":
    sys.exit(main())
