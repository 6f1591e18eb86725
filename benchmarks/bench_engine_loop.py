"""Block-table host time per engine step: the demo's workload and a 256-request decode workload.

Runs :class:`blocktable.engine.LLMEngine` (a tiny random Llama) and reports, per workload, the
p50 over steps of ``StepResult.table_time_s`` (host time of the block-table step: the
captured step by default, and apply + commit + slot mapping as "(3 calls)" beside it) and
of ``inputs_time_s`` (host time building the step's input tensors), beside the floors of this
machine measured in the same run (an empty torch op; on CUDA ``current_stream()`` and an empty
Triton launch).

- ``demo``: ``blocktable demo``'s workload (8 requests, staggered arrivals, shared prefixes,
  chunked prefill, preemption; block size ``--block-size``), run ``--repeats`` times; the first
  step of each run is left out (one-time set-up).
- ``decode-256``: 256 requests with 16-63-token prompts, admitted together, then decoded
  ``--decode-steps`` steps (block size 16: every step 1 in 16 rows gains a block); only
  decode-only steps count.

    PYTHONPATH=src python benchmarks/bench_engine_loop.py --device cpu
    PYTHONPATH=src python benchmarks/bench_engine_loop.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics

import numpy as np
import torch
from floors import format_floors, measure_floors

from blocktable.demo import DemoOptions
from blocktable.engine import EngineConfig, LLMEngine, make_workload, run_workload, tiny_llama


def p50_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6 if values else float("nan")


def demo_workload(device: str, block_size: int, repeats: int, captured: bool) -> dict:
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
        results = [r for r in run_workload(engine, workload) if r.num_reqs][1:]
        table += [r.table_time_s for r in results]
        inputs += [getattr(r, "inputs_time_s", float("nan")) for r in results]
    return {"steps": len(table), "table_p50_us": p50_us(table),
            "table_mean_us": statistics.mean(table) * 1e6, "inputs_p50_us": p50_us(inputs)}


def decode_workload(device: str, num_reqs: int, decode_steps: int, captured: bool) -> dict:
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
    table, inputs = [], []
    while engine.has_unfinished():
        r = engine.step()
        if r.num_reqs == num_reqs and r.num_tokens == num_reqs:
            table.append(r.table_time_s)
            inputs.append(getattr(r, "inputs_time_s", float("nan")))
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
    args = ap.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    res: dict = {"device": args.device, "torch": torch.__version__, "cpus": os.cpu_count(),
                 "torch_threads": torch.get_num_threads(), "numpy": np.__version__}
    if args.device == "cuda":
        res["card"] = torch.cuda.get_device_name()
    res["floors"] = measure_floors(args.device)
    names = ["demo", f"decode-{args.num_reqs}"]
    for captured, suffix in ((True, ""), (False, " (3 calls)")):
        res["demo" + suffix] = demo_workload(args.device, args.block_size, args.repeats,
                                             captured)
        res[names[1] + suffix] = decode_workload(args.device, args.num_reqs, args.decode_steps,
                                                 captured)
    res["floors_after"] = measure_floors(args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    where = res.get("card", f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    print(f"\nengine loop, block-table host time per step on {where}, torch {torch.__version__}")
    print(f"{'workload':<24}{'steps':>6}{'table p50 µs':>14}{'table mean µs':>15}"
          f"{'inputs p50 µs':>15}")
    for name in (*names, *(n + " (3 calls)" for n in names)):
        r = res[name]
        print(f"{name:<24}{r['steps']:>6}{r['table_p50_us']:>14.1f}{r['table_mean_us']:>15.1f}"
              f"{r['inputs_p50_us']:>15.1f}")
    print("table = the step's update, commit and slot mapping: the captured step (staged "
          "writes + one graph replay; numpy on the CPU), or (3 calls) apply + commit + "
          "compute_slot_mapping; inputs = the step's input tensors")
    print(format_floors(res["floors"]))


if __name__ == "__main__":
    main()
