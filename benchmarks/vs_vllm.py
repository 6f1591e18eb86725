"""blocktable beside vLLM's own code, in one process, interleaved, same inputs, same clock.

vLLM is not installed: its released wheel is downloaded at run time (``pip download --no-deps
vllm==VERSION`` into ``~/.cache/blocktable-bench``) and only its pure-Python allocator
(``vllm/v1/core``: ``KVCacheManager``, ``BlockPool``, ``kv_cache_utils``), its ``Request`` and
its worker ``BlockTable`` are imported from it, with everything they import beyond that stubbed
(see ``benchmarks/vllm_shim.py``). No vLLM code lives in this repository.

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

Times are this process's CPU time by default (``--clock wall`` for wall time), torch on one
thread. vLLM's stubbed imports cost about 16 stub calls per step (a few microseconds).

Every step checks that both sides agree: the same prefix hits, the same block ids in every
touched row, the same number of free blocks, tables equal to the allocators' rows, slots equal
to a numpy formula. Any disagreement exits with status 1.

Usage::

    python benchmarks/vs_vllm.py --quick --json out.json
    python benchmarks/vs_vllm.py --quick --rows allocator  # the allocator-step rows only
"""

from __future__ import annotations

import argparse
import json
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
from vllm_shim import load_vllm

# the checkout's own code, whose commit the results name (not another installed copy)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import blocktable
from blocktable import GroupSpec, MultiGroupBlockTable
from blocktable.allocator import AllocatorGroupSpec, KVCacheManager

PHASES = ("free", "append", "admit", "allocate", "step_output", "mark_computed")


class CheckFailed(Exception):
    """Both sides disagree: the run is invalid."""


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


# ---------------------------------------------------------------------------------- sides
class VllmAllocator:
    """vLLM's KVCacheManager driven as its scheduler drives it, one call per request."""

    name = "vllm"

    def __init__(self, v: types.SimpleNamespace, block_size: int, num_blocks: int,
                 max_model_len: int) -> None:
        ki = v.kv_cache_interface
        spec = ki.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64,
                                    dtype=torch.float16)
        config = ki.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[ki.KVCacheGroupSpec(["layer.0"], spec)])
        self.mgr = v.kv_cache_manager.KVCacheManager(
            config, max_model_len=max_model_len, scheduler_block_size=block_size,
            hash_block_size=block_size)
        hash_fn = v.hashing.get_hash_fn_by_name("sha256")  # vLLM's default algorithm
        v.kv_cache_utils.init_none_hash(hash_fn)
        self.hasher = v.kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
        self.request_cls = v.request.Request
        # what the engine's sampling parameters carry that the allocator path reads
        self.params = types.SimpleNamespace(max_tokens=1 << 40, extra_args=None,
                                            skip_reading_prefix_cache=None,
                                            structured_outputs=None)
        self.block_size = block_size
        self.requests: dict[int, Any] = {}
        self.pending: dict[int, tuple[Any, int]] = {}  # admitted: (cached blocks, hit tokens)
        self.hits: dict[int, int] = {}  # allocated this step after admission: hit tokens

    def free(self, req_ids: list[int]) -> None:
        for req_id in req_ids:
            self.mgr.free(self.requests.pop(req_id))

    def append(self, req_ids: list[int], tokens: list[list[int]]) -> None:
        for req_id, toks in zip(req_ids, tokens):
            self.requests[req_id].append_output_token_ids(toks)

    def admit(self, req_ids: list[int], prompts: list[list[int]]) -> list[int]:
        hits = []
        for req_id, prompt in zip(req_ids, prompts):
            req = self.request_cls(str(req_id), prompt, self.params, None,
                                   block_hasher=self.hasher)
            blocks, num_hit, _ = self.mgr.get_computed_blocks(req)
            self.requests[req_id] = req
            self.pending[req_id] = (blocks, num_hit)
            hits.append(num_hit)
        return hits

    def allocate(self, req_ids: list[int], num_new: list[int]) -> Any:
        out = []
        for req_id, n in zip(req_ids, num_new):
            req = self.requests[req_id]
            blocks, num_hit = self.pending.pop(req_id, (None, 0))
            if blocks is not None:
                self.hits[req_id] = num_hit
            new = self.mgr.allocate_slots(req, n, num_hit, blocks)
            if new is None:
                raise CheckFailed(f"vLLM: no blocks for request {req_id}")
            out.append((req_id, new))
        return out

    def step_output(self, allocated: Any) -> Any:
        # the scheduler's output: every scheduled request's block ids
        return [blocks.get_block_ids() for _, blocks in allocated]

    def mark_computed(self, req_ids: list[int], num_new: list[int]) -> None:
        pass  # vLLM cached the blocks inside allocate_slots

    def after_step(self, req_ids: list[int], num_new: list[int]) -> None:
        # the scheduler's bookkeeping, not timed: an admitted request starts at its hits
        for req_id, n in zip(req_ids, num_new):
            req = self.requests[req_id]
            req.num_computed_tokens = self.hits.pop(req_id, req.num_computed_tokens) + n

    def block_ids(self, req_id: int) -> list[int]:
        return list(self.mgr.get_block_ids(str(req_id))[0])

    def num_free_blocks(self) -> int:
        return self.mgr.block_pool.get_num_free_blocks()


class BlocktableAllocator:
    """blocktable's KVCacheManager, per-request calls or batched calls."""

    def __init__(self, batched: bool, hash_fn: str, block_size: int, num_blocks: int,
                 max_num_reqs: int) -> None:
        self.batched = batched
        self.name = "batched" if batched else "per-request"
        # vLLM counts the null block in num_blocks; blocktable too (block 0 is never handed out)
        self.mgr = KVCacheManager([AllocatorGroupSpec(block_size, num_blocks)], max_num_reqs,
                                  hash_fn=hash_fn)
        self.update: Any = None

    def free(self, req_ids: list[int]) -> None:
        if self.batched:
            self.mgr.free_many(req_ids)
        else:
            for req_id in req_ids:
                self.mgr.free(req_id)

    def append(self, req_ids: list[int], tokens: list[list[int]]) -> None:
        if self.batched:
            self.mgr.append_token_ids_many(req_ids, tokens)
        else:
            for req_id, toks in zip(req_ids, tokens):
                self.mgr.append_token_ids(req_id, toks)

    def admit(self, req_ids: list[int], prompts: list[list[int]]) -> list[int]:
        if self.batched:
            return self.mgr.add_requests(req_ids, prompts)
        return [self.mgr.add_request(r, p) for r, p in zip(req_ids, prompts)]

    def allocate(self, req_ids: list[int], num_new: list[int]) -> Any:
        if self.batched:
            self.mgr.allocate_many(req_ids, num_new)
        else:
            for req_id, n in zip(req_ids, num_new):
                self.mgr.allocate(req_id, n)
        return None

    def step_output(self, allocated: Any) -> Any:
        self.update = self.mgr.take_step_update()
        return self.update

    def mark_computed(self, req_ids: list[int], num_new: list[int]) -> None:
        if self.batched:
            self.mgr.mark_computed_many(req_ids, num_new)
        else:
            for req_id, n in zip(req_ids, num_new):
                self.mgr.mark_computed(req_id, n)
            # per-request marks are recorded and applied by the next call: make that call
            # here, so that their work counts in this phase (and in the 1M-token prompt row)
            self.mgr.num_free_blocks()

    def after_step(self, req_ids: list[int], num_new: list[int]) -> None:
        pass

    def block_ids(self, req_id: int) -> list[int]:
        return list(self.mgr.block_ids(req_id)[0])

    def num_free_blocks(self) -> int:
        return self.mgr.num_free_blocks()


def run_allocator_step(side: Any, events: StepEvents, prompts: list[Any],
                       sampled: list[list[int]], block_size: int, clock: Callable[[], int],
                       ) -> tuple[dict[str, float], list[int], list[int], list[int]]:
    """One scheduling step on one side; phase times in ms, hits, scheduled ids and counts."""
    t = [clock()]
    side.free(events.finished)
    t.append(clock())
    side.append(events.decoding, sampled)
    t.append(clock())
    hits = side.admit(events.new_ids, prompts)
    t.append(clock())
    scheduled = events.new_ids + events.decoding
    num_new = [len(p) - h for p, h in zip(prompts, hits)] + [block_size] * len(events.decoding)
    allocated = side.allocate(scheduled, num_new)
    t.append(clock())
    side.step_output(allocated)
    t.append(clock())
    side.mark_computed(scheduled, num_new)
    t.append(clock())
    side.after_step(scheduled, num_new)
    return {p: (t[i + 1] - t[i]) / 1e6 for i, p in enumerate(PHASES)}, hits, scheduled, num_new


def check_sides(sides: list[Any], req_ids: list[int], what: str) -> None:
    ref = sides[0]
    free = ref.num_free_blocks()
    for side in sides[1:]:
        check(side.num_free_blocks() == free,
              f"{what}: free blocks {ref.name} {free} != {side.name} {side.num_free_blocks()}")
        for req_id in req_ids:
            a, b = ref.block_ids(req_id), side.block_ids(req_id)
            check(a == b, f"{what}: request {req_id}: {ref.name} blocks {a[:8]}... != "
                          f"{side.name} {b[:8]}... (lengths {len(a)}, {len(b)})")


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


def slot_reference(table_rows: np.ndarray, rows: np.ndarray, qsl: np.ndarray,
                   positions: np.ndarray, block_size: int) -> np.ndarray:
    """slot = block id of the position's block * block_size + offset in the block."""
    req_of_token = np.repeat(np.arange(len(rows)), np.diff(qsl))
    row = rows[req_of_token]
    return table_rows[row, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size)


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
def stats(values: list[float]) -> dict[str, Any]:
    a = np.asarray(values)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "n": int(a.size),
            "values": [round(float(x), 5) for x in a]}


def row(name: str, unit: str, ours: list[float], theirs: list[float] | None,
        **extra: Any) -> dict[str, Any]:
    b = stats(ours)
    t = stats(theirs) if theirs else None
    return {"name": name, "unit": unit, "blocktable": b, "vllm": t,
            "ratio": t["median"] / b["median"] if t else None, **extra}


def _split(times: list[tuple[float, float]]) -> dict[str, float]:
    return {"rows": float(np.median([a for a, _ in times])),
            "commit": float(np.median([b for _, b in times]))}


def _total(times: list[tuple[float, float]]) -> list[float]:
    return [a + b for a, b in times]


def step_totals(phases: dict[str, list[float]]) -> list[float]:
    return [sum(v) for v in zip(*phases.values())]


def markdown(result: dict[str, Any]) -> str:
    title = (f"vLLM {result['vllm']} beside blocktable {result['commit'][:10]}, "
             f"{result['machine']}, {result['date']}, clock: {result['clock']}, torch threads: "
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
        lines.append(f"| {r['name']} | {r['unit']} | {cell(r['vllm'])} | {cell(r['blocktable'])} "
                     f"| {ratio} |")
    phase_title = ("by phase, medians in ms (vLLM caches blocks inside allocate; step output: "
                   "vLLM get_block_ids, blocktable take_step_update)")
    lines += ["", phase_title, "", "| row | side | phases |", "|---|---|---|"]
    for r in result["rows"]:
        for side, phases in r.get("phases_ms", {}).items():
            lines.append(f"| {r['name']} | {side} | "
                         + ", ".join(f"{p} {ms:.3f}" for p, ms in phases.items()) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-version", default="0.33.0")
    p.add_argument("--quick", action="store_true", help="fewer steps and reps (CPU rows only)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 1000, quick 300)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 50, quick 30)")
    p.add_argument("--long-reps", type=int, default=None, help="1M-token prompt reps (15, quick 5)")
    p.add_argument("--long-prompt-len", type=int, default=1_000_000)
    p.add_argument("--num-reqs", type=int, default=1024)
    p.add_argument("--num-blocks", type=int, default=131072)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu (default): this process's CPU time; for this single-threaded work "
                        "it equals wall time on a quiet machine, and on a shared one it leaves "
                        "out the time other processes hold the core (wall time then inflates "
                        "long calls more than short ones)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared machine, a 2-thread "
                        "copy of a few MiB waits for a busy core and takes milliseconds)")
    p.add_argument("--rows", choices=("all", "allocator"), default="all",
                   help="all (default), or allocator: only the allocator-step rows (no table, "
                        "slot-mapping or 1M-token prompt rows)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.torch_threads)
    args.steps = args.steps or (300 if args.quick else 1000)
    args.warmup = args.warmup if args.warmup is not None else (30 if args.quick else 50)
    args.long_reps = args.long_reps or (5 if args.quick else 15)
    clock = time.process_time_ns if args.clock == "cpu" else time.perf_counter_ns

    if Path(blocktable.__file__).resolve().parents[1] != REPO / "src":
        print(f"FAILED: blocktable imported from {blocktable.__file__}, not from {REPO / 'src'}",
              file=sys.stderr)
        return 1
    v = load_vllm(args.vllm_version)
    result: dict[str, Any] = {
        **run_info(),
        "vllm": args.vllm_version,
        "clock": args.clock,
        "torch_threads": args.torch_threads,
        "row_filter": args.rows,
        "scenario": {k: getattr(args, k) for k in ("steps", "warmup", "long_reps",
                                                   "long_prompt_len", "num_reqs", "num_blocks",
                                                   "block_size", "seed")},
        "rows": [],
    }
    rows = result["rows"]
    try:
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
                rows.append(row(f"allocator step, {api} calls, {label}", "ms",
                                step_totals(run["times"][api]), theirs,
                                phases_ms={"vllm": phase_medians["vllm"],
                                           "blocktable": phase_medians[api]}))
            if run["tables"] is not None:
                t = run["tables"]
                rows.append(row("table rows + commit, per call (add_row/append_row)", "ms",
                                _total(t["calls"]), _total(t["vllm"]),
                                phases_ms={"vllm": _split(t["vllm"]),
                                           "blocktable": _split(t["calls"])}))
                rows.append(row("table rows + commit, batched apply(StepUpdate)", "ms",
                                _total(t["applied"]), _total(t["vllm"]),
                                phases_ms={"vllm": _split(t["vllm"]),
                                           "blocktable": _split(t["applied"])}))
                note = "vLLM: Triton kernel only, no CPU path"
                rows.append(row(f"CPU slot mapping, decode {args.num_reqs} x 1", "ms",
                                run["slots"]["decode"], None, note=note))
                rows.append(row("CPU slot mapping, prefill 4 x 2048", "ms",
                                run["slots"]["prefill"], None, note=note))
            if args.rows == "allocator":
                continue
            print(f"{args.long_prompt_len}-token prompt, {hash_mode} ...", file=sys.stderr)
            long = long_prompt_run(v, args, hash_mode, clock)
            for api in ("batched", "per-request"):
                rows.append(row(f"{args.long_prompt_len:,}-token prompt, {api} calls, {label}",
                                "ms", long[api], long["vllm"]))
    except CheckFailed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    if torch.cuda.is_available():
        print("CUDA is present, but this version has no CUDA rows yet", file=sys.stderr)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
