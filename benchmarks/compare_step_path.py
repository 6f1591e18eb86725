"""The engine loop's block-table host time, this checkout against others, alternated.

Runs ``bench_engine_loop``'s two workloads (``demo`` and ``decode-256``) in fresh processes.
On the CPU every ``time.perf_counter`` read in the engine is replaced by ``time.thread_time``,
so the step's clock counts this thread's CPU time only (other processes on the machine do not
count); on CUDA (``--device cuda``) the clock stays the host's wall time, since the step's
driver calls are part of what it costs. Each round runs, in this order: the other checkouts with
their compiled part, this checkout with its compiled part, then (on the CPU) all with the
compiled part turned off (``BLOCKTABLE_NATIVE=0`` and ``BLOCKTABLE_COMPILED=0``: older checkouts
used the first name). Reports, per code and workload, the median over rounds of each run's p50
over steps, with the lowest and highest.

    PYTHONPATH=src python benchmarks/compare_step_path.py --base ../old-checkout --json out.json
    PYTHONPATH=src python benchmarks/compare_step_path.py --base ../old ../older --device cuda

Each ``--base`` must be a source tree whose compiled part is built in place
(``python setup.py build_ext --inplace``). A run that fails exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from run_info import run_info

_LOOP = """
import importlib.util, json, sys, time
device = sys.argv[1]
if device == "cpu":
    time.perf_counter = time.thread_time  # the engine's step clock: this thread's CPU time
sys.path.insert(0, "benchmarks")
import bench_engine_loop as b
demo = b.demo_workload(device, 4, 3, True)
decode = b.decode_workload(device, 256, 64, True)
built = [m for m in ("_compiled", "_native") if importlib.util.find_spec("blocktable." + m)]
print(json.dumps({"demo": demo["table_p50_us"], "decode-256": decode["table_p50_us"],
                  "compiled": bool(built)}))
"""


def one_run(tree: Path, compiled: bool, device: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    if not compiled:
        env.update(BLOCKTABLE_NATIVE="0", BLOCKTABLE_COMPILED="0")
    out = subprocess.run([sys.executable, "-c", _LOOP, device], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    if out.returncode:
        raise RuntimeError(f"the run in {tree} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # a tree whose compiled part is not built for this Python would silently run its numpy
    # fallback under the "compiled" label
    if compiled and not result.pop("compiled"):
        raise RuntimeError(f"{tree} has no compiled part built for this Python: build it in "
                           "place first (python setup.py build_ext --inplace)")
    result.pop("compiled", None)
    return result


def summary(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {w: {"median": statistics.median(r[w] for r in runs),
                "low": min(r[w] for r in runs), "high": max(r[w] for r in runs)}
            for w in ("demo", "decode-256")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, nargs="+", required=True,
                   help="the other source trees")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    head = Path(__file__).resolve().parents[1]
    # (each run's cwd is its tree: a relative path would break)
    bases: dict[str, Path] = {}
    for b in args.base:
        name = _commit(b.resolve()) or str(b)
        bases[name if name not in bases else f"{name} ({b})"] = b.resolve()  # (same commit)
    codes = {f"{c}, compiled": (b, True) for c, b in bases.items()}
    codes["this, compiled"] = (head, True)
    if args.device == "cpu":
        codes.update({f"{c}, numpy": (b, False) for c, b in bases.items()})
        codes["this, numpy"] = (head, False)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in codes}
    for _ in range(args.rounds):
        for name, (tree, compiled) in codes.items():
            runs[name].append(one_run(tree, compiled, args.device))
    result = {
        **run_info(),
        "base_commits": list(bases),
        "device": args.device,
        "clock": "thread CPU time" if args.device == "cpu" else "host wall time",
        "unit": "us, p50 over steps per run",
        "runs": runs, "summary": {name: summary(r) for name, r in runs.items()},
    }
    print(f"{'code':24s} {'demo µs':>26s} {'decode-256 µs':>26s}")
    for name, s in result["summary"].items():
        cells = [f"{s[w]['median']:.1f} ({s[w]['low']:.1f}-{s[w]['high']:.1f})"
                 for w in ("demo", "decode-256")]
        print(f"{name:24s} {cells[0]:>26s} {cells[1]:>26s}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def _commit(tree: Path) -> str:
    """The short commit of a git checkout ("" where there is none)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree,
                          capture_output=True, text=True, check=False).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
