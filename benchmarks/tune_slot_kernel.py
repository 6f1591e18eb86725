"""Tune the slot-mapping kernel (tokens per program, search radix, warps) and profile the host.

    PYTHONPATH=src python benchmarks/tune_slot_kernel.py [--json out.json]

Part 1 times each kernel variant on the step scenarios of ``bench_step.py`` as CUDA-graph replays
(20 launches per graph, time per launch); each variant's slots must equal the public call's, or
the script exits 1. Part 2 times host primitives and cProfiles a decode-1024 step, so
the per-step host cost can be read off function by function.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import numpy as np
import torch
from bench_step import BLOCK, batch, build_table, decode_updates, scenarios, time_graph_us
from run_info import run_info

from blocktable import GroupSpec
from blocktable.slot_mapping.fused_kernel import launch_slot_mapping


def tune(rng, out):
    cases = scenarios(rng)
    cases["3groups-mixed"] = cases["mixed-255+7937"]
    variants = [(b, r, w) for b in (64, 128, 256) for r in (2, 4, 16) for w in (4, 8)]
    rows = []
    for name, (seq_lens, q_lens) in cases.items():
        specs = ([GroupSpec(16), GroupSpec(32, 16), GroupSpec(64)] if name == "3groups-mixed"
                 else [GroupSpec(BLOCK)])
        bt = build_table(specs, "cuda", rng, seq_lens)
        qsl, pos, _ = batch("cuda", seq_lens, q_lens)
        bt.compute_slot_mapping(qsl, pos)
        expected = bt._slots.clone()
        for block, radix, warps in variants:
            def call(bt=bt, qsl=qsl, pos=pos, block=block, radix=radix, warps=warps):
                launch_slot_mapping(bt.storage.device_tensor, bt._packed_params, qsl, pos, None,
                                    bt._slots, max_num_reqs=bt.max_num_reqs, pow2=True,
                                    has_cp=False, block=block, radix=radix, num_warps=warps)
            bt._slots.fill_(-7)
            call()
            n = pos.numel()  # the tail's padding is not the variant's job
            if not torch.equal(bt._slots[:, :n], expected[:, :n]):
                raise SystemExit(f"FAILED: {name}: variant {(block, radix, warps)} maps other "
                                 "slots than the public call")
            us = time_graph_us(call, replays=30)[1]  # per launch, 20 launches a graph
            rows.append({"scenario": name, "block": block, "radix": radix, "warps": warps,
                         "us": us})
    out["variants"] = rows
    best = {}
    for r in rows:
        key = (r["block"], r["radix"], r["warps"])
        best.setdefault(key, []).append(r["us"])
    ranked = sorted(best.items(), key=lambda kv: max(kv[1]))
    print("\nvariant (block, radix, warps): worst / mean over scenarios, µs per launch in a graph")
    for key, us in ranked[:8]:
        print(f"  {key}: {max(us):.2f} / {statistics.mean(us):.2f}   " +
              " ".join(f"{u:.2f}" for u in us))


def prim(name, fn, n=2000):
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return name, (time.perf_counter() - t0) / n * 1e6


def profile_host(rng, out):
    seq_lens, q_lens = scenarios(rng)["decode-1024"]
    bt = build_table([GroupSpec(BLOCK)], "cuda", rng, seq_lens)
    qsl, pos, qsl_cpu = batch("cuda", seq_lens, q_lens)
    ups = decode_updates(rng, 2400)
    pinned = torch.zeros(4096, dtype=torch.int32, pin_memory=True)
    dev = torch.zeros(4096, dtype=torch.int32, device="cuda")
    ev = torch.cuda.Event()
    stream = torch.cuda.current_stream()
    a = np.zeros(1024, np.int32)
    prims = [
        prim("numpy a[idx] (64 of 1024)", lambda: a[ups[0].appended[0].rows]),
        prim("torch.cuda.current_stream()", torch.cuda.current_stream),
        prim("torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0)),
        prim("event.record()", ev.record),
        prim("event.record(cached stream)", lambda: ev.record(stream)),
        prim("event.query()", ev.query),
        prim("copy_ 1 KiB pinned->device non_blocking", lambda: dev[:256].copy_(pinned[:256], non_blocking=True)),
        prim("tensor slice [:256]", lambda: pinned[:256]),
        prim("empty torch op (dev.add_(0))", lambda: dev.add_(0)),
    ]
    torch.cuda.synchronize()
    it = iter(ups)
    prims.append(prim("apply (64 appended rows)", lambda: bt.apply(next(it)), n=400))
    prims.append(prim("commit after apply", lambda: (bt.apply(next(it)), bt.commit()), n=400))
    prims.append(prim("compute_slot_mapping (host)", lambda: bt.compute_slot_mapping(qsl, pos, query_start_loc_cpu=qsl_cpu), n=400))
    torch.cuda.synchronize()
    for name, us in prims:
        print(f"  {name:<45}{us:8.2f} µs")
    out["host_primitives_us"] = dict(prims)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(500):
        bt.apply(next(it))
        bt.commit()
        bt.compute_slot_mapping(qsl, pos, query_start_loc_cpu=qsl_cpu)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    out["profile"] = s.getvalue()
    print(s.getvalue()[:6000])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--skip-tune", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    out: dict = {"card": torch.cuda.get_device_name()}
    profile_host(rng, out)
    if not args.skip_tune:
        tune(rng, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_info(), **out}, f, indent=2)


if __name__ == "__main__":
    main()
