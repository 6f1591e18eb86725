"""The CUDA rows of ``benchmarks/vs_vllm.py``: vLLM's worker block table beside blocktable's.

vLLM's side is its own ``MultiGroupBlockTable`` (``vllm/v1/worker/block_table.py``) and the
Triton kernel it launches for the slot mapping (``ComputeSlotMappingKernel``, through its JIT
launch helpers), imported from the unpacked wheel; blocktable's is its ``MultiGroupBlockTable``
and its ``CapturedStep``. Two kinds of rows:

- **slot mapping, graph replay**: a decode batch (every row, its next token) and a prefill batch
  (4 prompts) over the same table, each side's slot-mapping call captured in a CUDA graph and
  replayed. Device time per replay by CUDA events with the GPU kept busy ahead (the events
  bracket the replay, not the host's launch), the two sides interleaved; and the same with a
  flushed L2 (``triton.testing.do_bench``, all its samples).
- **block-table step**: the allocator scenario of ``benchmarks/allocator_workload.py`` (its ids
  from blocktable's allocator, outside the timing), each step a mixed batch: every running
  request in row order, the arrivals' uncached prompt tokens and one token for every other.
  vLLM as its model runner drives its table: ``add_row``/``append_row``, ``commit_block_table``,
  the batch written into its pinned buffers (``CpuGpuBuffer``) and copied,
  ``compute_slot_mapping`` (vLLM's runner derives positions on the GPU from copied per-request
  counts; here both sides move the same positions from the host); blocktable:
  ``CapturedStep.run(update, query_start_loc, positions)`` (one graph replay). Host wall time to
  issue a step (every step), host wall time until the step's device work is done (odd steps),
  and device time (even steps: CUDA events with the GPU kept busy ahead; ours is one graph
  replay, vLLM's its eager copies and kernel).

vLLM's kernel reads row ``r`` for request ``r`` (its persistent batch keeps them so), so every
batch here is in row order, and blocktable is called the same way (``row_of_batch`` None).
After every replay and step both sides are compared: the rows of both device tables against the
allocator's block ids, and both whole slot-mapping buffers (padding included) against each
other and against the formula. Any difference raises ``CheckFailed``.

With ``device="cpu"`` (under ``TRITON_INTERPRET=1``) both sides' Triton kernels run in Triton's
interpreter on small sizes: a dry run of the inputs and the checks; its times are not a
benchmark.
"""

from __future__ import annotations

import argparse
import importlib
import time
import types
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import numpy as np
import torch
from allocator_workload import AllocatorWorkload
from cuda_graphs import capture
from vs_vllm_sides import BlocktableAllocator, CheckFailed, check, result_row, slot_reference

from blocktable import GroupSpec, MultiGroupBlockTable, RowBlocks, StepUpdate
from blocktable.step import CapturedStep


class Sides:
    """vLLM's and blocktable's tables, their slot buffers, and the comparison of both."""

    def __init__(self, v: types.SimpleNamespace, device: torch.device, block_size: int,
                 max_num_reqs: int, max_model_len: int, max_num_tokens: int) -> None:
        cuda = device.type == "cuda"
        self.vllm = v.block_table.MultiGroupBlockTable(
            max_num_reqs, max_num_tokens, cuda, device, [block_size],
            [-(-max_model_len // block_size)])
        self.ours = MultiGroupBlockTable([GroupSpec(block_size)], max_num_reqs, max_model_len,
                                         max_num_tokens, device, backend="triton")
        self.block_size, self.max_num_reqs = block_size, max_num_reqs
        self.device = device

    def check(self, rows: dict[int, list[int]], qsl: np.ndarray, positions: np.ndarray,
              what: str) -> None:
        """Both device tables hold ``rows`` (row -> block ids); both slot buffers are equal,
        padding included, and their first tokens are the formula's (batch in row order)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        R = self.max_num_reqs
        tables = {"vllm": self.vllm[0].get_device_tensor(R).cpu().numpy(),
                  "blocktable": self.ours[0].get_device_tensor(R).cpu().numpy()}
        for row, ids in rows.items():
            for name, dev in tables.items():
                check(dev[row, : len(ids)].tolist() == ids,
                      f"{what}: {name} device table row {row} != the allocator's blocks")
        theirs = self.vllm[0].slot_mapping.gpu.cpu().numpy()
        ours = self.ours.slot_mapping(0).cpu().numpy()
        check(theirs.shape == ours.shape, f"{what}: slot buffers {theirs.shape} != {ours.shape}")
        diff = np.flatnonzero(theirs != ours)
        check(diff.size == 0, f"{what}: slot mappings differ at {diff.size} tokens, first "
                              f"{diff[:1].tolist()}: vllm {theirs[diff[:1]].tolist()} != "
                              f"blocktable {ours[diff[:1]].tolist()}")
        expected = slot_reference(tables["blocktable"], np.arange(len(qsl) - 1), qsl, positions,
                                  self.block_size)
        check(ours[: len(positions)].tolist() == expected.tolist(),
              f"{what}: slot mappings != the formula")
        check(bool((ours[len(positions):] == -1).all()), f"{what}: padding is not -1")

    def scribble(self) -> None:
        """Overwrite both slot buffers, so that the next check sees only fresh writes."""
        self.vllm[0].slot_mapping.gpu.fill_(-7)
        self.ours.slot_mapping(0).fill_(-7)


# ---------------------------------------------------------------------------------- timing
class BusyGpu:
    """Keeps the GPU busy while the host issues timed work, so that CUDA events bracket only
    the device work. ``late`` counts the times the GPU had caught up with the host anyway."""

    def __init__(self, busy_us: float) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        self.cycles = int(busy_us * 1e-3 * 1_000_000 / start.elapsed_time(end))
        self.late = 0

    def timed(self, fn: Callable[[], Any]) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Issue ``fn`` behind a busy GPU between two events (read them after a sync)."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(self.cycles)
        a.record()
        fn()
        b.record()
        self.late += bool(a.query())  # the sleep ended before the host had issued fn
        return a, b


def interleaved_replays(graphs: dict[str, torch.cuda.CUDAGraph], n: int
                        ) -> tuple[dict[str, list[float]], int]:
    """Device µs of ``n`` replays per graph, graphs interleaved, their order alternating; and
    how many replays the GPU reached before the host had issued them (``BusyGpu.late``)."""
    busy = BusyGpu(100.0)
    names = list(graphs)
    events: dict[str, list[tuple[Any, Any]]] = {k: [] for k in names}
    for i in range(n):
        for k in names[i % 2 :] + names[: i % 2]:
            events[k].append(busy.timed(graphs[k].replay))
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return {k: [a.elapsed_time(b) * 1e3 for a, b in ev] for k, ev in events.items()}, busy.late


def flushed_replays(graph: torch.cuda.CUDAGraph) -> list[float]:
    """Device µs of replays after an L2 flush, every sample of ``triton.testing.do_bench``."""
    import triton.testing

    return [ms * 1e3 for ms in triton.testing.do_bench(graph.replay, warmup=25, rep=200,
                                                       return_mode="all")]


# ---------------------------------------------------------------------------------- slot rows
def slot_mapping_rows(v: types.SimpleNamespace, args: argparse.Namespace,
                      device: torch.device) -> list[dict[str, Any]]:
    """Graph-replayed slot mapping of a decode and a prefill batch, both sides."""
    cuda = device.type == "cuda"
    bs, R, P = args.block_size, args.num_reqs, args.prompt_len
    rng = np.random.default_rng(args.seed)
    max_model_len = 16 * P
    sides = Sides(v, device, bs, R, max_model_len, max(R, 4 * P))
    seq_lens = rng.integers(P, max_model_len + 1, R)
    counts = -(-seq_lens // bs)
    ids = rng.integers(1, args.num_blocks, int(counts.sum()), dtype=np.int32)
    starts = np.concatenate(([0], np.cumsum(counts)))
    rows = {r: ids[starts[r] : starts[r + 1]].tolist() for r in range(R)}
    for r, row_ids in rows.items():
        sides.vllm.add_row((row_ids,), r)
    sides.vllm.commit_block_table(R)
    sides.ours.apply(StepUpdate.make(1, added=[RowBlocks(
        np.arange(R, dtype=np.int32), counts.astype(np.int32), ids)]))
    sides.ours.commit()

    batches = {  # name: (query lengths, positions), rows 0.. in order
        f"decode {R} x 1": (np.ones(R, np.int64), (seq_lens - 1).astype(np.int64)),
        f"prefill 4 x {P}": (np.full(4, P), np.tile(np.arange(P, dtype=np.int64), 4)),
    }
    out = []
    for name, (query_lens, positions) in batches.items():
        qsl = np.concatenate(([0], np.cumsum(query_lens))).astype(np.int32)
        num_reqs = len(query_lens)
        qsl_d = torch.from_numpy(qsl).to(device)
        pos_d = torch.from_numpy(positions).to(device)
        calls: dict[str, Callable[[], Any]] = {
            "vllm": partial(sides.vllm.compute_slot_mapping, num_reqs, qsl_d, pos_d),
            "blocktable": partial(sides.ours.compute_slot_mapping, qsl_d, pos_d),
        }
        what = f"slot mapping, {name}"
        if not cuda:  # dry run: one eager call each under the interpreter, then the checks
            times: dict[str, list[float]] = {}
            for side, call in calls.items():
                t0 = time.perf_counter()
                call()
                times[side] = [(time.perf_counter() - t0) * 1e6]
            sides.check(rows, qsl, positions, what)
            out.append(result_row(f"{what}, eager (CPU dry run: interpreter)", "us",
                                  times["blocktable"], times["vllm"], device="cpu"))
            continue
        graphs = {side: capture(call) for side, call in calls.items()}
        sides.scribble()
        for g in graphs.values():
            g.replay()
        sides.check(rows, qsl, positions, what + ", first replays")
        times, late = interleaved_replays(graphs, args.cuda_replays)
        flushed = {side: flushed_replays(g) for side, g in graphs.items()}
        sides.scribble()
        for g in graphs.values():
            g.replay()
        sides.check(rows, qsl, positions, what + ", after the timing")
        out.append(result_row(f"CUDA {what}, device time per graph replay", "us",
                              times["blocktable"], times["vllm"], device="cuda", late=late,
                              clock="CUDA events, GPU busy ahead, sides interleaved"))
        out.append(result_row(f"CUDA {what}, device time per graph replay, L2 flushed", "us",
                              flushed["blocktable"], flushed["vllm"], device="cuda",
                              clock="triton.testing.do_bench, all samples"))
    return out


# ---------------------------------------------------------------------------------- step rows
class VllmStep:
    """vLLM's block-table work of one step, as its model runner does it."""

    def __init__(self, v: types.SimpleNamespace, sides: Sides, max_num_tokens: int) -> None:
        cuda, device, R = sides.device.type == "cuda", sides.device, sides.max_num_reqs
        self.table = sides.vllm
        # the runner's pinned host buffers with device twins
        buffer = importlib.import_module("vllm.v1.utils").CpuGpuBuffer
        self.qsl = buffer(R + 1, dtype=torch.int32, device=device, pin_memory=cuda)
        self.positions = buffer(max_num_tokens, dtype=torch.int64, device=device,
                                pin_memory=cuda)

    def run(self, ops: list[tuple[bool, list[int], int]], num_rows: int, qsl: np.ndarray,
            positions: np.ndarray) -> None:
        """Row operations ``(add?, block ids, row)``, the commit of the first ``num_rows``
        rows (the persistent batch's requests), and the slots of the batch."""
        table = self.table
        for add, ids, row in ops:
            (table.add_row if add else table.append_row)((ids,), row)
        num_reqs, num_tokens = len(qsl) - 1, len(positions)
        table.commit_block_table(num_rows)
        self.qsl.np[: num_reqs + 1] = qsl
        self.positions.np[:num_tokens] = positions
        qsl_d = self.qsl.copy_to_gpu(num_reqs + 1)
        positions_d = self.positions.copy_to_gpu(num_tokens)
        table.compute_slot_mapping(num_reqs, qsl_d, positions_d)


def step_rows(v: types.SimpleNamespace, args: argparse.Namespace,
              device: torch.device) -> list[dict[str, Any]]:
    """The whole block-table step, both sides, over the allocator scenario's steps."""
    cuda = device.type == "cuda"
    bs, R, P = args.block_size, args.num_reqs, args.prompt_len
    workload = AllocatorWorkload(num_reqs=R, block_size=bs, prompt_len=P, shared_prefix_len=P // 2,
                                 decode_blocks=min(64, R // 2), seed=args.seed,
                                 token_format="list")
    steps = args.cuda_warmup + args.cuda_steps
    max_model_len = P + bs * (steps + 2)
    max_num_tokens = R + workload.arrivals * P  # every prompt uncached, one token for the rest
    alloc = BlocktableAllocator(True, "fast", bs, args.num_blocks, R)
    mgr = alloc.mgr
    sides = Sides(v, device, bs, R, max_model_len, max_num_tokens)
    theirs = VllmStep(v, sides, max_num_tokens)
    ours = CapturedStep(sides.ours)
    known: dict[int, int] = {}  # request -> blocks vLLM's table holds for it

    def table_ops(req_ids: list[int], added: set[int]) -> list[tuple[bool, list[int], int]]:
        ops = []
        for r in req_ids:
            ids = alloc.block_ids(r)
            start = 0 if r in added else known[r]
            known[r] = len(ids)
            if r in added or start < len(ids):
                ops.append((r in added, ids[start:], mgr.row_of(r)))
        return ops

    def batch(new: dict[int, int]) -> tuple[np.ndarray, np.ndarray, dict[int, list[int]]]:
        """Every running request in row order: an arrival's uncached tokens (``new``: hits),
        one token for the others; and each row's block ids."""
        by_row = {mgr.row_of(r): r for r in workload.running}
        check(sorted(by_row) == list(range(len(by_row))), "the running rows are not 0..n-1")
        pos_lists, rows = [], {}
        for row in range(len(by_row)):
            r = by_row[row]
            n = mgr.num_tokens(r)
            pos_lists.append(np.arange(new[r], n) if r in new else np.array([n - 1]))
            rows[row] = alloc.block_ids(r)
        qsl = np.concatenate(([0], np.cumsum([len(p) for p in pos_lists]))).astype(np.int32)
        return qsl, np.concatenate(pos_lists).astype(np.int64), rows

    # the fill: one request at a time, so that later ones find the shared prefix cached
    fill = cast(list[tuple[int, list[int]]], workload.fill())  # token_format="list"
    for req_id, prompt in fill:
        hits = alloc.admit([req_id], [prompt])
        alloc.allocate([req_id], [len(prompt) - hits[0]])
        alloc.mark_computed([req_id], [len(prompt) - hits[0]])
    fill_ids = [r for r, _ in fill]
    update = alloc.step_output(None)
    ops = table_ops(fill_ids, set(fill_ids))
    empty_qsl, no_tokens = np.zeros(1, np.int32), np.zeros(0, np.int64)
    theirs.run(ops, R, empty_qsl, no_tokens)
    ours.run(update, empty_qsl, no_tokens)
    sides.check({row: ids for _, ids, row in ops}, empty_qsl, no_tokens, "after the fill")

    busy = BusyGpu(5000.0) if cuda else None  # longer than the host takes to issue a step
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    issue: dict[str, list[float]] = {"vllm": [], "blocktable": []}
    done: dict[str, list[float]] = {"vllm": [], "blocktable": []}
    dev: dict[str, list[Any]] = {"vllm": [], "blocktable": []}
    for step in range(steps):
        events = workload.next_step()
        alloc.free(events.finished)
        alloc.append(events.decoding, events.sampled.tolist())
        hits = alloc.admit(events.new_ids, cast(list[list[int]], events.prompts))
        scheduled = events.new_ids + events.decoding
        num_new = [len(p) - h for p, h in zip(events.prompts, hits)] + [bs] * len(events.decoding)
        alloc.allocate(scheduled, num_new)
        update = alloc.step_output(None)
        alloc.mark_computed(scheduled, num_new)
        for r in events.finished:
            known.pop(r)
        ops = table_ops(scheduled, set(events.new_ids))
        qsl, positions, rows = batch(dict(zip(events.new_ids, hits)))
        runs: dict[str, Callable[[], Any]] = {"vllm": partial(theirs.run, ops, R, qsl, positions),
                "blocktable": partial(ours.run, update, qsl, positions)}
        timed = step >= args.cuda_warmup
        for name in (["vllm", "blocktable"] if step % 2 else ["blocktable", "vllm"]):
            sync()
            t0 = time.perf_counter()
            if busy is not None and step % 2 == 0:
                pair = busy.timed(runs[name])
                t1 = time.perf_counter()
                if timed:
                    dev[name].append(pair)
            else:
                runs[name]()
                t1 = time.perf_counter()
                sync()
                if timed:
                    done[name].append((time.perf_counter() - t0) * 1e6)
            if timed:
                issue[name].append((t1 - t0) * 1e6)
        sides.check(rows, qsl, positions, f"step {step}")
        sides.scribble()
    label = f"block-table step, {R} rows, {workload.arrivals} arrivals x {P} + decodes"
    if not cuda:
        return [result_row(f"{label}, host wall time (CPU dry run: interpreter)", "us",
                           issue["blocktable"], issue["vllm"], device="cpu")]
    sync()
    device_us = {k: [a.elapsed_time(b) * 1e3 for a, b in pairs] for k, pairs in dev.items()}
    assert busy is not None
    return [
        result_row(f"CUDA {label}, host wall time to issue", "us", issue["blocktable"],
                   issue["vllm"], device="cuda", clock="perf_counter, every step"),
        result_row(f"CUDA {label}, host wall time until its device work is done", "us",
                   done["blocktable"], done["vllm"], device="cuda",
                   clock="perf_counter to after a synchronize, odd steps"),
        result_row(f"CUDA {label}, device time (ours: one graph replay; vLLM: its eager "
                   "copies and kernel)", "us", device_us["blocktable"], device_us["vllm"],
                   device="cuda", late=busy.late,
                   clock="CUDA events, GPU busy ahead, even steps"),
    ]


def cuda_rows(v: types.SimpleNamespace, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every CUDA row (``args.cuda_device == "cpu"``: the dry run under the interpreter)."""
    device = torch.device(args.cuda_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the CUDA rows need a GPU (or --cuda-device cpu for a dry run)")
    return slot_mapping_rows(v, args, device) + step_rows(v, args, device)


__all__ = ["CheckFailed", "cuda_rows"]
