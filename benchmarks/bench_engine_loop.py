"""Block-table host time per engine step: the demo's workload and a 256-request decode workload.

Runs :class:`blocktable.engine.LLMEngine` (a tiny random Llama) and reports, per workload, the
p50 over steps of ``StepResult.table_time_s`` (host time of the block-table step: the
captured step by default, and apply + commit + slot mapping as "(3 calls)" beside it) and
of ``inputs_time_s`` (host time building the step's input tensors), beside the floors of this
machine measured in the same run, before and after the workloads (an empty torch op, an empty
numpy op warm and with the caches cold; on CUDA ``current_stream()`` and an empty Triton
launch).

- ``demo``: ``blocktable demo``'s workload (8 requests, staggered arrivals, shared prefixes,
  chunked prefill, preemption; block size ``--block-size``), run ``--repeats`` times; the first
  step of each run is left out (one-time set-up).
- ``decode-256``: 256 requests with 16-63-token prompts, admitted together, then decoded
  ``--decode-steps`` steps (block size 16: every step 1 in 16 rows gains a block); only
  decode-only steps count.

    PYTHONPATH=src python benchmarks/bench_engine_loop.py --device cpu
    PYTHONPATH=src python benchmarks/bench_engine_loop.py --device cuda --json out.json

``--cold-ops`` instead times single numpy calls of the step warm and with the caches cold (as
between engine steps): in the loop the count and the kind of calls matter more than sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch
from floors import format_floors, measure_floors
from run_info import run_info

import blocktable.step.runner as step_runner
from blocktable.demo import DemoOptions
from blocktable.engine import EngineConfig, LLMEngine, make_workload, run_workload, tiny_llama


def p50_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6 if values else float("nan")


class Breakdown:
    """Per-step host time of the pieces of the engine's table step, measured by wrapping them.

    Each piece is timed with ``perf_counter`` around the call (its children included); a
    piece's *self* time is its time minus its timed children. Times are summed per step and
    the p50 over steps is reported, in µs and in units of this machine's numpy-op floor.
    The wrappers add ~0.1 µs each: use the plain run for the table's total.
    """

    # piece -> its parent piece ("" for the table's top level)
    PIECES: ClassVar[dict[str, str]] = {
        "take_step_update": "",
        "journal.take": "take_step_update",
        "host_views": "",
        "step.run": "",
        "step.run_staged": "",
        "run._check_batch": "step.run",
        "run._check_values": "step.run_staged",
        "run.apply_and_stage": "step.run_staged",
        "run.stager.stage": "step.run",
        "run._run_numpy": "step.run",
        "run._run_device": "step.run",
        "run.graph_launch": "step.run_staged",
        "apply": "",
        "commit": "",
        "compute_slot_mapping": "",
    }

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.steps: list[dict[str, float]] = []
        self.step_calls: list[dict[str, int]] = []
        self._undo: list[Callable[[], None]] = []

    def timed(self, fn: Callable, name: str) -> Callable:
        """``fn``, its time and calls added to piece ``name``."""
        acc, calls, clock = self.step, self.calls, time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] += clock() - t0
                calls[name] += 1

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def wrap(self, owner: object, attr: str, name: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:  # not in this version of the code
            return
        setattr(owner, attr, self.timed(fn, name))
        if isinstance(owner, type) or type(owner).__name__ == "module":
            self._undo.append(lambda: setattr(owner, attr, fn))
        else:
            self._undo.append(lambda: delattr(owner, attr))

    def install(self, engine: LLMEngine) -> None:
        self.wrap(engine.manager, "take_step_update", "take_step_update")
        self.wrap(engine.manager._journal, "take", "journal.take")
        step = engine.captured_step
        if step is not None:
            self.wrap(engine._inputs, "host_views", "host_views")
            self.wrap(step, "run", "step.run")
            self.wrap(step, "run_staged", "step.run_staged")
            self.wrap(step, "_check_arrays", "run._check_arrays")
            self.wrap(step_runner, "_check_batch_values", "run._check_batch_values")
            self.wrap(engine.table, "apply", "run.apply")
            self.wrap(engine.table, "apply_and_stage", "run.apply_and_stage")
            self.wrap(engine.table.committer, "stage", "run.committer.stage")
            self.wrap(step_runner, "slot_mapping_numpy", "run.slot_mapping_numpy")
            self.wrap(step, "_device_work", "run._device_work")  # CUDA without a graph
            launches = getattr(step, "_launches", None)
            graphs = getattr(step, "_graphs", None)  # (older checkouts)
            if launches and (getattr(step, "launch_kind", None) in ("driver", "replay")
                             or graphs is not None):  # the graph launches, per staging buffer
                for i, launch in enumerate(launches):
                    launches[i] = self.timed(launch, "run.graph_launch")
                self._undo.append(lambda: launches.__setitem__(slice(None), [
                    getattr(f, "__wrapped__", f) for f in launches]))
            for graph in (graphs or ()) if launches is None else ():  # older checkouts
                try:
                    self.wrap(graph, "replay", "run.graph_launch")
                except (AttributeError, TypeError):  # a graph object without instance attributes
                    break
        else:
            self.wrap(engine.table, "apply", "apply")
            self.wrap(engine.table, "commit", "commit")
            self.wrap(engine.table, "compute_slot_mapping", "compute_slot_mapping")

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def end_step(self, keep: bool) -> None:
        if keep:
            self.steps.append(dict(self.step))
            self.step_calls.append(dict(self.calls))
        self.step.clear()
        self.calls.clear()

    def summary(self, table_p50_us: float) -> dict:
        """p50 per piece (µs), total and self, over the kept steps."""
        out = {}
        children: dict[str, list[str]] = defaultdict(list)
        for name, parent in self.PIECES.items():
            children[parent].append(name)
        # the pieces of run are the pieces of run_staged too (a step calls one of the two)
        children["step.run_staged"] += [n for n in children["step.run"]
                                        if n != "run._check_batch"]
        for name in self.PIECES:
            values = [st.get(name, 0.0) for st in self.steps]
            if not any(values):
                continue
            own = [st.get(name, 0.0) - sum(st.get(c, 0.0) for c in children[name])
                   for st in self.steps]
            out[name] = {"p50_us": p50_us(values), "self_p50_us": p50_us(own),
                         "calls_per_step": statistics.mean(c.get(name, 0)
                                                           for c in self.step_calls)}
        top = [sum(st.get(n, 0.0) for n in children[""]) for st in self.steps]
        out["sum of top-level pieces"] = {"p50_us": p50_us(top)}
        out["table_time_s (unwrapped run)"] = {"p50_us": table_p50_us}
        return out


def demo_workload(device: str, block_size: int, repeats: int, captured: bool,
                  breakdown: Breakdown | None = None) -> dict:
    opts = DemoOptions(device=device, block_size=block_size)
    model = tiny_llama(seed=opts.seed, device=device)
    workload = make_workload(opts.num_requests, seed=opts.seed, block_size=block_size,
                             vocab_size=model.config.vocab_size,
                             max_new_tokens=opts.max_new_tokens)
    max_model_len = max(len(w.prompt_token_ids) for w in workload) + opts.max_new_tokens
    # the demo's pool holds 20 blocks of 4 tokens; keep its token capacity at other sizes
    num_blocks = max(opts.num_blocks * 4 // block_size, -(-max_model_len // block_size) + 1)
    table, inputs = [], []
    for _ in range(repeats):
        engine = LLMEngine(model, EngineConfig(
            block_size=block_size, num_blocks=num_blocks, max_num_reqs=opts.num_requests,
            token_budget=opts.token_budget, max_model_len=max_model_len, record_logits=False,
            captured_step=captured,
        ))
        if breakdown is not None:
            breakdown.install(engine)
            on_step = (lambda r: breakdown.end_step(r.num_reqs > 0 and r.step > 0))
        else:
            on_step = None
        results = [r for r in run_workload(engine, workload, on_step=on_step)
                   if r.num_reqs][1:]
        if breakdown is not None:
            breakdown.uninstall()
        table += [r.table_time_s for r in results]
        inputs += [getattr(r, "inputs_time_s", float("nan")) for r in results]
    return {"steps": len(table), "table_p50_us": p50_us(table),
            "table_mean_us": statistics.mean(table) * 1e6, "inputs_p50_us": p50_us(inputs)}


def decode_engine(device: str, num_reqs: int, decode_steps: int, captured: bool) -> LLMEngine:
    """The decode workload's engine (a tiny random Llama, block size 16), its ``num_reqs``
    requests added: 16-63-token prompts, each to generate ``decode_steps + 1`` tokens."""
    block_size = 16
    model = tiny_llama(seed=0, device=device)
    rng = random.Random(0)
    max_len = 64 + decode_steps + 1
    engine = LLMEngine(model, EngineConfig(
        block_size=block_size, num_blocks=num_reqs * -(-max_len // block_size) + 1,
        max_num_reqs=num_reqs, token_budget=num_reqs * 64, max_model_len=max_len,
        enable_prefix_caching=False, record_logits=False, captured_step=captured,
    ))
    for i in range(num_reqs):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(16, 63))]
        engine.add_request(f"r{i}", prompt, decode_steps + 1)
    return engine


def decode_workload(device: str, num_reqs: int, decode_steps: int, captured: bool,
                    breakdown: Breakdown | None = None) -> dict:
    engine = decode_engine(device, num_reqs, decode_steps, captured)
    table, inputs = [], []
    if breakdown is not None:
        breakdown.install(engine)
    first = True
    while engine.has_unfinished():
        r = engine.step()
        decode = r.num_reqs == num_reqs and r.num_tokens == num_reqs
        if decode:
            table.append(r.table_time_s)
            inputs.append(getattr(r, "inputs_time_s", float("nan")))
        if breakdown is not None:
            breakdown.end_step(decode and not first)
        first = first and not decode
    if breakdown is not None:
        breakdown.uninstall()
    table = table[1:]
    inputs = inputs[1:]
    return {"steps": len(table), "table_p50_us": p50_us(table),
            "table_mean_us": statistics.mean(table) * 1e6, "inputs_p50_us": p50_us(inputs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--block-size", type=int, default=4, help="the demo workload's block size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--breakdown", action="store_true",
                    help="also run each workload with its table step's pieces timed apart")
    ap.add_argument("--captured-only", action="store_true",
                    help="skip the three-call runs (quicker before/after comparisons)")
    ap.add_argument("--cold-ops", action="store_true",
                    help="only time single numpy calls of the step with the caches cold")
    args = ap.parse_args()
    if args.cold_ops:
        res_cold = cold_ops()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**run_info(), "calls": res_cold}, f, indent=2)
        print("\nnumpy calls on 256 int32 entries, p50 µs: warm (called back to back) and cold "
              "(after 32 MB of other memory traffic, as between engine steps)")
        print(f"{'call':<34}{'warm':>8}{'cold':>8}")
        for name, r in res_cold.items():
            print(f"{name:<34}{r['warm_us']:>8.2f}{r['cold_us']:>8.2f}")
        return
    import transformers

    transformers.logging.set_verbosity_error()
    res: dict = {**run_info(), "device": args.device, "cpus": os.cpu_count(),
                 "torch_threads": torch.get_num_threads()}
    if args.device == "cuda":
        res["card"] = torch.cuda.get_device_name()
    res["floors"] = measure_floors(args.device, cold=True)
    names = ["demo", f"decode-{args.num_reqs}"]
    paths = ((True, ""),) if args.captured_only else ((True, ""), (False, " (3 calls)"))
    for captured, suffix in paths:
        res["demo" + suffix] = demo_workload(args.device, args.block_size, args.repeats,
                                             captured)
        res[names[1] + suffix] = decode_workload(args.device, args.num_reqs, args.decode_steps,
                                                 captured)
    if args.breakdown:
        for captured, suffix in paths:
            for name in names:
                bd = Breakdown()
                if name == "demo":
                    demo_workload(args.device, args.block_size, args.repeats, captured, bd)
                else:
                    decode_workload(args.device, args.num_reqs, args.decode_steps, captured, bd)
                res["breakdown " + name + suffix] = bd.summary(res[name + suffix]["table_p50_us"])
    res["floors_after"] = measure_floors(args.device, cold=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    where = res.get("card", f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    print(f"\nengine loop, block-table host time per step on {where}, torch {torch.__version__}")
    print(f"{'workload':<24}{'steps':>6}{'table p50 µs':>14}{'table mean µs':>15}"
          f"{'inputs p50 µs':>15}")
    for name in (*names, *(n + " (3 calls)" for n in names)):
        if name not in res:
            continue
        r = res[name]
        print(f"{name:<24}{r['steps']:>6}{r['table_p50_us']:>14.1f}{r['table_mean_us']:>15.1f}"
              f"{r['inputs_p50_us']:>15.1f}")
    print("table = the step's update, commit and slot mapping: the captured step (staged "
          "writes + one graph replay; numpy on the CPU), or (3 calls) apply + commit + "
          "compute_slot_mapping; inputs = the step's input tensors")
    print(format_floors(res["floors"]) + " (before); " + format_floors(res["floors_after"])[8:]
          + " (after)")
    if args.breakdown:
        print_breakdown(res)


def cold_ops(num: int = 256, repeats: int = 150) -> dict:
    """p50 µs of single numpy calls of a decode step on ``num`` entries, warm and cold.

    Cold: each call follows a pass over 32 MB of float64 (a stand-in for the model's work
    between two engine steps), so numpy's code and the arrays have left the CPU caches.
    """
    rng = np.random.default_rng(0)
    rows = rng.permutation(num).astype(np.int32)
    rows_u32 = rows.view(np.uint32)
    table = rng.integers(0, 1000, num * 64).astype(np.int32)
    positions = rng.integers(0, 1024, num).astype(np.int64)
    out32, out64 = np.empty(num, np.int32), np.empty(num, np.int64)
    mask = np.zeros(num, bool)
    qsl, qsl_ref = np.arange(num + 1, dtype=np.int32), np.arange(1025, dtype=np.int32).tobytes()
    calls: dict[str, Callable[[], object]] = {
        "none (Python call only)": lambda: None,
        "np.maximum.reduce": lambda: np.maximum.reduce(rows_u32),
        "ndarray.max()": lambda: rows.max(),
        "a[a.argmax()]": lambda: rows_u32[rows_u32.argmax()],
        "np.count_nonzero": lambda: np.count_nonzero(rows),
        "ndarray.any() (bool)": lambda: mask.any(),
        "np.bincount(minlength)": lambda: np.bincount(rows, minlength=num),
        "take": lambda: table.take(rows),
        "put": lambda: table.put(rows, rows),
        "add, int32 out=": lambda: np.add(rows, 5, out=out32),
        "multiply, int32 -> int64 out=": lambda: np.multiply(rows, 16, out=out64),
        "right_shift, int64 out=": lambda: np.right_shift(positions, 4, out=out64),
        "greater_equal -> bool": lambda: rows >= 200,
        "putmask": lambda: np.putmask(out32, mask, -1),
        "tobytes() == bytes": lambda: qsl.tobytes() == qsl_ref[: 4 * num + 4],
    }
    traffic = np.ones(4_000_000)
    res = {}
    for name, call in calls.items():
        warm, cold = [], []
        for _ in range(repeats):
            traffic *= 1.0000001
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            call()
            t2 = time.perf_counter()
            cold.append(t1 - t0)
            warm.append(t2 - t1)
        res[name] = {"warm_us": p50_us(warm), "cold_us": p50_us(cold)}
    return res


def print_breakdown(res: dict) -> None:
    floor = res["floors"]["numpy_op_us"]
    print(f"\nbreakdown (pieces timed apart, p50 over steps per piece; floor units = µs / "
          f"numpy op {floor:.2f} µs; self = without the timed pieces below it)")
    for key, pieces in res.items():
        if not key.startswith("breakdown "):
            continue
        print(f"{key[len('breakdown '):]}")
        print(f"  {'piece':<30}{'calls/step':>11}{'p50 µs':>9}{'floors':>8}{'self µs':>9}"
              f"{'floors':>8}")
        for name, r in pieces.items():
            calls = f"{r['calls_per_step']:.2f}" if "calls_per_step" in r else ""
            line = f"  {name:<30}{calls:>11}{r['p50_us']:>9.1f}{r['p50_us'] / floor:>8.1f}"
            if "self_p50_us" in r:
                line += f"{r['self_p50_us']:>9.1f}{r['self_p50_us'] / floor:>8.1f}"
            print(line)


if __name__ == "__main__":
    main()
