"""blocktable beside vLLM's own code, in one process, interleaved, same inputs, same clock.

vLLM is not installed: its released wheel is downloaded at run time (``pip download --no-deps
vllm==VERSION`` into ``~/.cache/blocktable-bench``) and only its pure-Python allocator
(``vllm/v1/core``: ``KVCacheManager``, ``BlockPool``, ``kv_cache_utils``), its ``Request`` and
its worker ``BlockTable`` with the Triton slot-mapping kernel it launches (and that kernel's
launch helpers) are imported from it, with everything they import beyond that stubbed (see
``benchmarks/vllm_shim.py``). No vLLM code lives in this repository. ``--vllm-dir DIR`` imports
an unpacked tree instead (nothing is downloaded); ``--export-vllm-subset DIR`` copies the few
files imported (about 0.5 MiB) into DIR, for a machine without network.

Rows (CPU):

- allocator step: the scenario of ``benchmarks/allocator_workload.py`` (1,024 running, 8
  arrivals x 2,048 tokens, half sharing a 1,024-token prefix, 64 decode blocks, block 16). vLLM
  as its scheduler drives it: ``free``, ``Request.append_output_token_ids`` (hashes new full
  blocks), ``Request(...)`` (hashes the prompt) + ``get_computed_blocks``, ``allocate_slots``
  (allocates and caches) and the scheduler output's ``get_block_ids``; blocktable: ``free``,
  ``append_token_ids``, ``add_request``, ``allocate``, ``take_step_update``, ``mark_computed``,
  per request or batched (``*_many``). Both get Python lists, as vLLM's scheduler holds them.
  Hashes: each side's defaults (vLLM: SHA-256 of pickled blocks; blocktable: a 64-bit key plus
  an exact token comparison), then both reporting SHA-256 digests.
- 1M-token prompt: one request admitted, allocated and cached (every full block hashed).
- block-table rows + commit: each step's ``add_row`` (arrivals) and ``append_row`` (decode
  blocks), then the commit to the table's device copy (here the CPU); blocktable per call, and
  its batched ``apply(StepUpdate)``.
- slot mapping on the CPU (decode 1,024 x 1, prefill 4 x 2,048): vLLM 0.33 computes slot
  mappings only in a Triton kernel, which does not run on a CPU; blocktable's row has no vLLM
  figure.

Rows (CUDA, where torch sees a GPU; ``benchmarks/vs_vllm_cuda.py``): the graph-replayed slot
mapping of a decode and a prefill batch, and the whole block-table step (rows, commit, slot
mapping: vLLM's ``MultiGroupBlockTable`` as its model runner drives it, blocktable's
``CapturedStep``), in host wall time and device time, each row naming its clock.

The CPU rows' times are this process's CPU time by default (``--clock wall`` for wall time), torch on one
thread. vLLM's stubbed imports cost about 16 stub calls per step (a few microseconds).

Every step checks that both sides agree: the same prefix hits, the same block ids in every
touched row, the same number of free blocks, tables equal to the allocators' rows, slots equal
to a numpy formula. Any disagreement exits with status 1.

Usage::

    python benchmarks/vs_vllm.py --quick --json out.json
    python benchmarks/vs_vllm.py --quick --rows allocator  # the allocator-step rows only
    python benchmarks/vs_vllm.py --export-vllm-subset build/vllm-0.33.0   # with network
    python benchmarks/vs_vllm.py --vllm-dir build/vllm-0.33.0 --cuda-only --json cuda.json
    TRITON_INTERPRET=1 python benchmarks/vs_vllm.py --cuda-only --cuda-device cpu \
        --num-reqs 16 --prompt-len 64 --num-blocks 4000 --cuda-steps 4   # dry run, no GPU
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from allocator_workload import AllocatorWorkload, StepEvents
from run_info import run_info
from vllm_shim import export_subset, fetch_wheel, load_vllm

# the checkout's own code, whose commit the results name (not another installed copy)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vs_vllm_cuda import cuda_rows
from vs_vllm_sides import (
    PHASES,
    BlocktableAllocator,
    CheckFailed,
    VllmAllocator,
    check,
    check_sides,
    result_row,
    run_allocator_step,
    slot_reference,
)

import blocktable
from blocktable import GroupSpec, MultiGroupBlockTable
from blocktable._compiled_loader import describe as compiled_part


# ---------------------------------------------------------------------------------- tables
class Tables:
    """vLLM's MultiGroupBlockTable, blocktable's per call, and blocktable's apply(StepUpdate)."""

    def __init__(self, v: types.SimpleNamespace, block_size: int, max_num_reqs: int,
                 max_model_len: int) -> None:
        max_blocks = -(-max_model_len // block_size)
        self.vllm = v.block_table.MultiGroupBlockTable(
            max_num_reqs, 8192, False, torch.device("cpu"), [block_size], [max_blocks])
        self.calls = MultiGroupBlockTable([GroupSpec(block_size)], max_num_reqs, max_model_len,
                                          8192, "cpu")
        self.applied = MultiGroupBlockTable([GroupSpec(block_size)], max_num_reqs,
                                            max_model_len, 8192, "cpu")
        self.max_num_reqs = max_num_reqs

    def run(self, ops: list[tuple[str, list[int], int]], update: Any, num_reqs: int,
            clock: Callable[[], int], order: int) -> dict[str, tuple[float, float]]:
        """Apply one step's row operations on all three; ms per table: (rows, commit)."""
        out = {}

        def vllm_side() -> None:
            t0 = clock()
            for op, ids, row in ops:
                (self.vllm.add_row if op == "add" else self.vllm.append_row)((ids,), row)
            t1 = clock()
            self.vllm.commit_block_table(num_reqs)
            out["vllm"] = ((t1 - t0) / 1e6, (clock() - t1) / 1e6)

        def calls_side() -> None:
            t0 = clock()
            for op, ids, row in ops:
                (self.calls.add_row if op == "add" else self.calls.append_row)((ids,), row)
            t1 = clock()
            self.calls.commit(num_reqs)
            out["calls"] = ((t1 - t0) / 1e6, (clock() - t1) / 1e6)

        def applied_side() -> None:
            t0 = clock()
            self.applied.apply(update)
            t1 = clock()
            self.applied.commit(num_reqs)
            out["applied"] = ((t1 - t0) / 1e6, (clock() - t1) / 1e6)

        runs = [vllm_side, calls_side, applied_side]
        for i in range(3):
            runs[(order + i) % 3]()
        return out

    def check(self, rows: dict[int, list[int]], what: str) -> None:
        devices = {
            "vllm": self.vllm[0].get_device_tensor(self.max_num_reqs).numpy(),
            "blocktable calls": self.calls[0].get_device_tensor(self.max_num_reqs).numpy(),
            "blocktable apply": self.applied[0].get_device_tensor(self.max_num_reqs).numpy(),
        }
        for row, ids in rows.items():
            for name, dev in devices.items():
                check(dev[row, : len(ids)].tolist() == ids,
                      f"{what}: {name} table row {row} != the allocator's blocks")



# ---------------------------------------------------------------------------------- runs
def allocator_run(v: types.SimpleNamespace, args: argparse.Namespace, hash_mode: str,
                  clock: Callable[[], int], with_tables: bool) -> dict[str, Any]:
    bs = args.block_size
    workload = AllocatorWorkload(num_reqs=args.num_reqs, block_size=bs, seed=args.seed,
                                 token_format="list")
    steps = args.warmup + args.steps
    max_model_len = 2048 + bs * (steps + 2)
    ours_hash = "fast" if hash_mode == "defaults" else "sha256"
    sides: list[Any] = [
        VllmAllocator(v, bs, args.num_blocks, max_model_len),
        BlocktableAllocator(False, ours_hash, bs, args.num_blocks, args.num_reqs),
        BlocktableAllocator(True, ours_hash, bs, args.num_blocks, args.num_reqs),
    ]
    per_call = sides[1]
    tables = Tables(v, bs, args.num_reqs, max_model_len) if with_tables else None

    fill = workload.fill()
    fill_ids = [r for r, _ in fill]
    for side in sides:
        # one request at a time, so that later ones find the shared prefix cached
        for req_id, prompt in fill:
            hits = side.admit([req_id], [prompt])
            num_new = [len(prompt) - hits[0]]
            side.allocate([req_id], num_new)
            side.mark_computed([req_id], num_new)
            side.after_step([req_id], num_new)
        side.step_output([])
    check_sides(sides, fill_ids, "after the fill")
    if tables is not None:
        ops = [("add", per_call.block_ids(r), per_call.mgr.row_of(r)) for r in fill_ids]
        tables.run(ops, per_call.update, args.num_reqs, clock, 0)
        tables.check({row: ids for _, ids, row in ops}, "after the fill")

    times: dict[str, dict[str, list[float]]] = {s.name: {p: [] for p in PHASES} for s in sides}
    table_times: dict[str, list[tuple[float, float]]] = {"vllm": [], "calls": [], "applied": []}
    slot_times: dict[str, list[float]] = {"decode": [], "prefill": []}
    for step in range(steps):
        events = workload.next_step()
        sampled = events.sampled.tolist()
        results = {}
        for i in range(len(sides)):  # a different side first every step
            side = sides[(step + i) % len(sides)]
            results[side.name] = run_allocator_step(side, events, events.prompts, sampled, bs,
                                                    clock)
        hits = results["vllm"][1]
        for name, (_, side_hits, _, _) in results.items():
            check(side_hits == hits, f"step {step}: prefix hits vllm {hits} != {name} {side_hits}")
        check_sides(sides, events.new_ids + events.decoding, f"step {step}")
        if step >= args.warmup:
            for name, (phase_ms, _, _, _) in results.items():
                for p, ms in phase_ms.items():
                    times[name][p].append(ms)
        if tables is None:
            continue
        ops = [("add", per_call.block_ids(r), per_call.mgr.row_of(r)) for r in events.new_ids]
        ops += [("append", per_call.block_ids(r)[-1:], per_call.mgr.row_of(r))
                for r in events.decoding]
        table_ms = tables.run(ops, per_call.update, args.num_reqs, clock, step)
        rows = {per_call.mgr.row_of(r): per_call.block_ids(r)
                for r in events.new_ids + events.decoding}
        tables.check(rows, f"step {step}")
        slot_ms = slot_mapping_step(tables.calls, per_call, workload, events, bs, clock, step)
        if step >= args.warmup:
            for name, pair in table_ms.items():
                table_times[name].append(pair)
            for name, value in slot_ms.items():
                slot_times[name].append(value)

    running = list(workload.running)
    check_sides(sides, running, "at the end")
    for side in sides[1:]:
        side.mgr.check_integrity()
    if tables is not None:
        tables.check({per_call.mgr.row_of(r): per_call.block_ids(r) for r in running}, "at the end")
    return {"times": times, "tables": table_times if tables else None,
            "slots": slot_times if tables else None}


def slot_mapping_step(table: MultiGroupBlockTable, side: BlocktableAllocator,
                      workload: AllocatorWorkload, events: StepEvents, bs: int,
                      clock: Callable[[], int], step: int) -> dict[str, float]:
    """Slot mapping of a decode batch (every running request, its next token) and a prefill
    batch (the step's first 4 arrivals, 2,048 tokens each), checked against the formula."""
    host = table[0].get_cpu_tensor().numpy()
    out = {}
    batches = {
        "decode": (list(workload.running), lambda r: [side.mgr.num_tokens(r) - 1]),
        "prefill": (events.new_ids[:4], lambda r: list(range(2048))),
    }
    for name, (req_ids, positions_of) in batches.items():
        rows = np.array([side.mgr.row_of(r) for r in req_ids], dtype=np.int32)
        pos_lists = [positions_of(r) for r in req_ids]
        qsl = np.concatenate(([0], np.cumsum([len(p) for p in pos_lists]))).astype(np.int32)
        positions = np.concatenate(pos_lists).astype(np.int64)
        qsl_t, pos_t, rows_t = torch.from_numpy(qsl), torch.from_numpy(positions), torch.from_numpy(rows)
        t0 = clock()
        slots = table.compute_slot_mapping(qsl_t, pos_t, row_of_batch=rows_t)[0]
        out[name] = (clock() - t0) / 1e6
        assert slots is not None
        expected = slot_reference(host, rows, qsl, positions, bs)
        check(slots[: len(positions)].numpy().tolist() == expected.tolist(),
              f"step {step}: {name} slot mapping != the formula")
    return out


def long_prompt_run(v: types.SimpleNamespace, args: argparse.Namespace, hash_mode: str,
                    clock: Callable[[], int]) -> dict[str, list[float]]:
    bs, n = args.block_size, args.long_prompt_len
    prompt = np.random.default_rng(args.seed).integers(0, 32000, n).tolist()
    num_blocks = n // bs + 2
    ours_hash = "fast" if hash_mode == "defaults" else "sha256"
    out: dict[str, list[float]] = {"vllm": [], "per-request": [], "batched": []}
    for rep in range(args.long_reps):
        sides: list[Any] = [
            VllmAllocator(v, bs, num_blocks, n + bs),
            BlocktableAllocator(False, ours_hash, bs, num_blocks, 4),
            BlocktableAllocator(True, ours_hash, bs, num_blocks, 4),
        ]
        for i in range(3):
            side = sides[(rep + i) % 3]
            t0 = clock()
            hits = side.admit([0], [prompt])
            side.allocate([0], [n - hits[0]])
            side.mark_computed([0], [n - hits[0]])
            out[side.name].append((clock() - t0) / 1e6)
            check(hits == [0], f"1M prompt: {side.name} found a hit in an empty cache")
        check_sides(sides, [0], "1M prompt")
        num_cached = len(sides[0].mgr.block_pool.cached_block_hash_to_block)
        for side in sides[1:]:
            check(side.mgr.num_cached_blocks() == num_cached == n // bs,
                  f"1M prompt: cached blocks vllm {num_cached} != {side.name} "
                  f"{side.mgr.num_cached_blocks()}")
        del sides
    return out


# ---------------------------------------------------------------------------------- output
def _split(times: list[tuple[float, float]]) -> dict[str, float]:
    return {"rows": float(np.median([a for a, _ in times])),
            "commit": float(np.median([b for _, b in times]))}


def _total(times: list[tuple[float, float]]) -> list[float]:
    return [a + b for a, b in times]


def step_totals(phases: dict[str, list[float]]) -> list[float]:
    return [sum(v) for v in zip(*phases.values())]


def markdown(result: dict[str, Any]) -> str:
    title = (f"vLLM {result['vllm']} beside blocktable {result['commit'][:10]}, "
             f"{result['machine']}{', ' + result['gpu'] if 'gpu' in result else ''}, "
             f"{result['date']}, CPU rows' clock: {result['clock']}, torch threads: "
             f"{result['torch_threads']}; medians (p10-p90)")
    lines = [
        title,
        "",
        "| row | unit | vLLM | blocktable | vLLM / blocktable |",
        "|---|---|---|---|---|",
    ]

    def cell(s: dict[str, Any] | None) -> str:
        if s is None:
            return "n/a"
        return f"{s['median']:.3g} ({s['p10']:.3g}-{s['p90']:.3g})"

    for r in result["rows"]:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else r.get("note", "n/a")
        name = r["name"] + (f" [{r['clock']}]" if "clock" in r else "")
        if r.get("late"):  # the GPU caught up with the host: those samples include host gaps
            name += f" [{r['late']} samples late]"
        lines.append(f"| {name} | {r['unit']} | {cell(r['vllm'])} | {cell(r['blocktable'])} "
                     f"| {ratio} |")
    phase_title = ("by phase, medians in ms (vLLM caches blocks inside allocate; step output: "
                   "vLLM get_block_ids, blocktable take_step_update)")
    lines += ["", phase_title, "", "| row | side | phases |", "|---|---|---|"]
    for r in result["rows"]:
        for side, phases in r.get("phases_ms", {}).items():
            lines.append(f"| {r['name']} | {side} | "
                         + ", ".join(f"{p} {ms:.3f}" for p, ms in phases.items()) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-version", default="0.33.0")
    p.add_argument("--vllm-dir", type=Path, default=None,
                   help="an unpacked vLLM tree (holding vllm/) to import instead of the "
                        "downloaded wheel: nothing is downloaded (e.g. the export below)")
    p.add_argument("--export-vllm-subset", type=Path, default=None, metavar="DIR",
                   help="copy only the vLLM files this script imports into DIR (to carry to "
                        "a machine without network, then --vllm-dir DIR), and exit")
    p.add_argument("--quick", action="store_true", help="fewer steps and reps")
    p.add_argument("--cuda-only", action="store_true", help="only the CUDA rows")
    p.add_argument("--no-cuda", action="store_true", help="only the CPU rows")
    p.add_argument("--cuda-device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run of the CUDA rows' inputs and checks, both sides' "
                        "Triton kernels in the interpreter (needs TRITON_INTERPRET=1; use "
                        "small sizes); its times are not a benchmark")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 1000, quick 300)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 50, quick 30)")
    p.add_argument("--cuda-steps", type=int, default=None,
                   help="timed CUDA block-table steps (default 600, quick 200)")
    p.add_argument("--cuda-warmup", type=int, default=20, help="untimed CUDA steps (20)")
    p.add_argument("--cuda-replays", type=int, default=None,
                   help="graph replays per side and batch (default 2000, quick 500)")
    p.add_argument("--prompt-len", type=int, default=2048,
                   help="CUDA rows: prompt length of the arrivals and prefill batch (2048)")
    p.add_argument("--long-reps", type=int, default=None, help="1M-token prompt reps (15, quick 5)")
    p.add_argument("--long-prompt-len", type=int, default=1_000_000)
    p.add_argument("--num-reqs", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=131072)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="CPU rows: cpu (default): this process's CPU time; for this "
                        "single-threaded work it equals wall time on a quiet machine, and on a "
                        "shared one it leaves out the time other processes hold the core (wall "
                        "time then inflates long calls more than short ones). The CUDA rows "
                        "name their own clocks")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared machine, a 2-thread "
                        "copy of a few MiB waits for a busy core and takes milliseconds)")
    p.add_argument("--rows", choices=("all", "allocator"), default="all",
                   help="all (default), or allocator: only the allocator-step rows (no table, "
                        "slot-mapping or 1M-token prompt rows)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    args.steps = args.steps or (300 if args.quick else 1000)
    args.warmup = args.warmup if args.warmup is not None else (30 if args.quick else 50)
    args.long_reps = args.long_reps or (5 if args.quick else 15)
    args.cuda_steps = args.cuda_steps or (200 if args.quick else 600)
    args.cuda_replays = args.cuda_replays or (500 if args.quick else 2000)
    if args.cuda_only and args.no_cuda:
        p.error("--cuda-only and --no-cuda exclude each other")
    if args.cuda_device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--cuda-device cpu runs the Triton kernels in the interpreter: set "
                "TRITON_INTERPRET=1")
    return args


def cpu_rows(v: types.SimpleNamespace, args: argparse.Namespace, clock: Callable[[], int],
             rows: list[dict[str, Any]]) -> None:
    for hash_mode in ("defaults", "sha256"):
        print(f"allocator steps, {hash_mode} ...", file=sys.stderr)
        with_tables = hash_mode == "defaults" and args.rows == "all"
        run = allocator_run(v, args, hash_mode, clock, with_tables=with_tables)
        label = ("defaults (vLLM SHA-256; blocktable fast key + token check)"
                 if hash_mode == "defaults" else "both SHA-256")
        theirs = step_totals(run["times"]["vllm"])
        phase_medians = {name: {p: float(np.median(v_)) for p, v_ in ph.items()}
                         for name, ph in run["times"].items()}
        for api in ("batched", "per-request"):
            rows.append(result_row(f"allocator step, {api} calls, {label}", "ms",
                                   step_totals(run["times"][api]), theirs,
                                   phases_ms={"vllm": phase_medians["vllm"],
                                              "blocktable": phase_medians[api]}))
        if run["tables"] is not None:
            t = run["tables"]
            rows.append(result_row("table rows + commit, per call (add_row/append_row)", "ms",
                                   _total(t["calls"]), _total(t["vllm"]),
                                   phases_ms={"vllm": _split(t["vllm"]),
                                              "blocktable": _split(t["calls"])}))
            rows.append(result_row("table rows + commit, batched apply(StepUpdate)", "ms",
                                   _total(t["applied"]), _total(t["vllm"]),
                                   phases_ms={"vllm": _split(t["vllm"]),
                                              "blocktable": _split(t["applied"])}))
            note = "vLLM: Triton kernel only, no CPU path"
            rows.append(result_row(f"CPU slot mapping, decode {args.num_reqs} x 1", "ms",
                                   run["slots"]["decode"], None, note=note))
            rows.append(result_row("CPU slot mapping, prefill 4 x 2048", "ms",
                                   run["slots"]["prefill"], None, note=note))
        if args.rows == "allocator":
            continue
        print(f"{args.long_prompt_len}-token prompt, {hash_mode} ...", file=sys.stderr)
        long = long_prompt_run(v, args, hash_mode, clock)
        for api in ("batched", "per-request"):
            rows.append(result_row(f"{args.long_prompt_len:,}-token prompt, {api} calls, "
                                   f"{label}", "ms", long[api], long["vllm"]))


def main() -> int:
    args = parse_args()
    if args.export_vllm_subset is not None:
        root = args.vllm_dir or fetch_wheel(args.vllm_version)
        copies = export_subset(root, args.export_vllm_subset)
        size = sum(c.stat().st_size for c in copies)
        print(f"{len(copies)} files of vLLM {args.vllm_version}, {size / 1024:.0f} KiB, in "
              f"{args.export_vllm_subset}: run with --vllm-dir {args.export_vllm_subset}")
        return 0
    torch.set_num_threads(args.torch_threads)
    clock = time.process_time_ns if args.clock == "cpu" else time.perf_counter_ns

    if Path(blocktable.__file__).resolve().parents[1] != REPO / "src":
        print(f"FAILED: blocktable imported from {blocktable.__file__}, not from {REPO / 'src'}",
              file=sys.stderr)
        return 1
    with_cuda = not args.no_cuda and (torch.cuda.is_available() or args.cuda_device == "cpu")
    if args.cuda_only and not with_cuda:
        print("FAILED: --cuda-only, but torch sees no GPU (--cuda-device cpu: a dry run)",
              file=sys.stderr)
        return 1
    v = load_vllm(args.vllm_version, args.vllm_dir)
    result: dict[str, Any] = {
        **run_info(),
        "vllm": args.vllm_version,
        "clock": args.clock,
        "torch_threads": args.torch_threads,
        "blocktable_compiled": compiled_part(),
        "row_filter": args.rows,
        "scenario": {k: getattr(args, k) for k in (
            "steps", "warmup", "long_reps", "long_prompt_len", "num_reqs", "num_blocks",
            "block_size", "seed", "cuda_steps", "cuda_warmup", "cuda_replays", "prompt_len")},
        "rows": [],
    }
    if with_cuda and args.cuda_device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        result["triton"] = importlib.import_module("triton").__version__
    try:
        if not args.cuda_only:
            cpu_rows(v, args, clock, result["rows"])
        if with_cuda:
            print(f"CUDA rows on {args.cuda_device} ...", file=sys.stderr)
            result["rows"] += cuda_rows(v, args)
    except CheckFailed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
