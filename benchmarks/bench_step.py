"""Per-step cost of the block table: slot mapping, commit, whole step, batched adds.

Scenarios: manager block 16, 1024 max requests, width 8192 (128K context), 8192 max batched
tokens. The captured step (:class:`blocktable.step.CapturedStep`: the update and the batch
staged in a pinned buffer, one CUDA-graph replay) is timed for decode-1024 and decode-256
beside the three-call step. On CUDA, kernel times are medians of CUDA-graph replays and device
times with a flushed L2 (``triton.testing.do_bench``: CUDA events around one call after an L2
flush; "flushed"); host times are medians of ``perf_counter`` over many calls. The
host-time floors of the machine (an empty torch op; on CUDA ``current_stream()`` and an empty
Triton launch, an empty graph replay) are measured in the same run and printed beside the
step's host issue time. On
the CPU, slot mapping is timed with torch's default intra-op threads and with one thread (the
CPU backend must not depend on them); only what was measured is printed.

    PYTHONPATH=src python benchmarks/bench_step.py                # CUDA
    PYTHONPATH=src python benchmarks/bench_step.py --device cpu   # the CPU path
    ... --json out.json

Prints a table at the end; ``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np
import torch
from floors import format_floors, measure_floors
from run_info import run_info

from blocktable import GroupSpec, MultiGroupBlockTable, RowBlocks, StepUpdate
from blocktable._compiled_loader import describe as compiled_part
from blocktable.step import CapturedStep

MAX_REQS = 1024
MAX_MODEL_LEN = 131072
MAX_TOKENS = 8192
BLOCK = 16

# vLLM anchors (its own code on one H200, 2026-11-29): graph / L2-flushed device time of
# the slot mapping (0.25.1, 0.33.0), µs
ANCHORS = {
    "decode-256": "2.5/6.1 (0.25.1), 2.2/9.9 (0.33.0)",
    "decode-1024": "3.8/7.4 (0.25.1), 2.9/6.1 (0.33.0)",
    "prefill-1x8192": "14.0/23.5 (0.25.1), 14.9/29.8 (0.33.0)",
    "prefill-4x2048": "4.4/9.5 (0.25.1), 4.5/11.7 (0.33.0)",
    "mixed-255+7937": "14.3/25.0 (0.25.1), 14.8/30.9 (0.33.0)",
    "3groups-mixed": "41.2/90.1 (0.25.1, 3 launches), 38.4/77.3 (0.33.0)",
}


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def build_table(specs, device, rng, seq_lens):
    """A table whose first len(seq_lens) rows hold enough blocks for those sequence lengths."""
    bt = MultiGroupBlockTable(specs, MAX_REQS, MAX_MODEL_LEN, MAX_TOKENS, device)
    rows = np.arange(len(seq_lens), dtype=np.int32)
    added = []
    for spec in specs:
        nb = (-(-np.asarray(seq_lens) // spec.block_size)).astype(np.int32)
        ids = rng.integers(1, 2**20, int(nb.sum()), dtype=np.int32)
        added.append(RowBlocks(rows, nb, ids))
    bt.apply(StepUpdate.make(len(specs), added=added))
    bt.commit()
    return bt


def batch(device, seq_lens, query_lens):
    """query_start_loc (int32) and positions (int64) on the device, plus the host qsl."""
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    pos = np.concatenate(
        [np.arange(s - q, s) for s, q in zip(seq_lens, query_lens)]
    ).astype(np.int64)
    qsl_cpu = torch.from_numpy(qsl)
    return qsl_cpu.to(device), torch.from_numpy(pos).to(device), qsl_cpu


def scenarios(rng):
    dec256 = rng.integers(512, 32768, 256)
    dec1024 = rng.integers(512, 32768, 1024)
    mixed = np.concatenate([rng.integers(512, 32768, 255), [7937]])
    return {
        "decode-256": (dec256, np.ones(256, np.int64)),
        "decode-1024": (dec1024, np.ones(1024, np.int64)),
        "prefill-1x8192": (np.array([8192]), np.array([8192])),
        "prefill-4x2048": (np.full(4, 2048), np.full(4, 2048)),
        "mixed-255+7937": (mixed, np.concatenate([np.ones(255, np.int64), [7937]])),
    }


def time_graph_us(fn, replays=200):
    """Median device time of one replay of a graph holding one call of ``fn``, and the
    amortized time per call of a graph holding 20 calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g1, g20 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        fn()
    with torch.cuda.graph(g20):
        for _ in range(20):
            fn()
    for _ in range(10):
        g1.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g1.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    amort = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g20.replay()
        b.record()
        b.synchronize()
        amort.append(a.elapsed_time(b) * 1e3 / 20)
    return statistics.median(times), statistics.median(amort)


def time_host_us(fn, n=300, sync=None):
    for _ in range(10):
        fn()
    if sync:
        sync()
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    if sync:
        sync()
    return median_us(t)


def bench_slot_mapping(device, rng, results):
    cuda = device == "cuda"
    specs1 = [GroupSpec(BLOCK)]
    specs3 = [GroupSpec(16), GroupSpec(32, kernel_block_size=16), GroupSpec(64)]
    cases = scenarios(rng)
    cases["3groups-mixed"] = cases["mixed-255+7937"]
    for name, (seq_lens, q_lens) in cases.items():
        specs = specs3 if name == "3groups-mixed" else specs1
        bt = build_table(specs, device, rng, seq_lens)
        qsl, pos, qsl_cpu = batch(device, seq_lens, q_lens)

        def call(bt=bt, qsl=qsl, pos=pos, qsl_cpu=qsl_cpu):
            bt.compute_slot_mapping(qsl, pos, query_start_loc_cpu=qsl_cpu)

        row = {"scenario": name, "tokens": int(pos.numel()), "groups": len(specs)}
        if cuda:
            import triton.testing

            row["graph_us"], row["graph_amortized_us"] = time_graph_us(call)
            row["flushed_us"] = triton.testing.do_bench(call, warmup=50, rep=300,
                                                        return_mode="median") * 1e3
            row["host_us"] = time_host_us(call, sync=torch.cuda.synchronize)
            row["vllm_anchor_graph_flushed_us"] = ANCHORS[name]
        else:
            threads = torch.get_num_threads()
            row["host_us"] = time_host_us(call, n=200)
            torch.set_num_threads(1)
            row["host_1thread_us"] = time_host_us(call, n=200)
            torch.set_num_threads(threads)
            row["torch_threads"] = threads
        results["slot_mapping"].append(row)


def decode_updates(rng, num_steps, rows_per_step=64, num_rows=1024):
    ups = []
    for _ in range(num_steps):
        rows = rng.choice(num_rows, rows_per_step, replace=False).astype(np.int32)
        ids = rng.integers(1, 2**20, rows_per_step, dtype=np.int32)
        ups.append(StepUpdate.make(1, appended=[RowBlocks(rows, np.ones(rows_per_step, np.int32), ids)]))
    return ups


def as_journal_update(update: StepUpdate, num_rows: int) -> StepUpdate:
    """``update`` (one-block appends to distinct rows in range) as the allocator's journal hands
    it out: marked trusted (its rows listed once, its counts summing to its ids)."""
    return dataclasses.replace(update, trusted=True)


def bench_step(device, rng, results):
    """decode-1024 steady state: 64 rows gain a block; apply + commit + slot map + sync."""
    cuda = device == "cuda"
    seq_lens, q_lens = scenarios(rng)["decode-1024"]
    bt = build_table([GroupSpec(BLOCK)], device, rng, seq_lens)
    qsl, pos, qsl_cpu = batch(device, seq_lens, q_lens)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = 400
    ups = decode_updates(rng, n + 20)
    # commit alone: device time (events) and bytes
    commit_dev, commit_host, apply_host, bytes_moved = [], [], [], []
    for u in ups[:200]:
        t0 = time.perf_counter()
        bt.apply(u)
        apply_host.append(time.perf_counter() - t0)
        if cuda:
            # Keep the GPU busy while the host issues the commit, so the events bracket only
            # the commit's device work (copy + scatter), not the host's time to issue it.
            torch.cuda._sleep(1_000_000)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t1 = time.perf_counter()
        stats = bt.commit()
        t2 = time.perf_counter()
        if cuda:
            b.record()
            b.synchronize()
            commit_dev.append(a.elapsed_time(b) * 1e3)
        commit_host.append(t2 - t1)
        bytes_moved.append(stats.bytes_h2d)
    sync()
    row = {
        "apply_host_us": median_us(apply_host),
        "commit_host_us": median_us(commit_host),
        "commit_bytes": int(statistics.median(bytes_moved)),
    }
    if cuda:
        row["commit_anchor"] = "614 us, 32 MiB (vLLM full copy)"
    if cuda:
        row["commit_device_us"] = statistics.median(commit_dev)
    # whole step: host time to issue apply + commit + slot mapping, then wall time to done
    issue, total, parts = [], [], {"apply": [], "commit": [], "slot_mapping": []}
    for u in ups[200:]:
        sync()
        t0 = time.perf_counter()
        bt.apply(u)
        ta = time.perf_counter()
        bt.commit()
        tc = time.perf_counter()
        bt.compute_slot_mapping(qsl, pos, query_start_loc_cpu=qsl_cpu)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        issue.append(t1 - t0)
        total.append(t2 - t0)
        parts["apply"].append(ta - t0)
        parts["commit"].append(tc - ta)
        parts["slot_mapping"].append(t1 - tc)
    row.update({
        "step_us": median_us(total),
        "step_issue_us": median_us(issue),
        **{f"step_{k}_host_us": median_us(v) for k, v in parts.items()},
    })
    if cuda:
        row["step_anchor"] = "805 / 703 us (host issue 258 / 130 us)"
    assert bt.device_equals_host()
    results["step"] = row


def graph_floors(results):
    """Host time of replaying a graph that holds one empty Triton kernel, and of an eager
    pinned 64 KiB host-to-device copy (CUDA only)."""
    from floors import _empty_kernel

    from blocktable._triton import Launcher

    results["graph_floors"] = {}
    t = torch.zeros(1, device="cuda")
    launch = Launcher(_empty_kernel)
    launch((1,), t, 16)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch((1,), t, 16)
    sync = torch.cuda.synchronize
    results["graph_floors"]["empty_graph_replay_us"] = time_host_us(g.replay, n=2000, sync=sync)
    src = torch.zeros(16384, dtype=torch.int32, pin_memory=True)
    dst = torch.zeros(16384, dtype=torch.int32, device="cuda")
    results["graph_floors"]["pinned_copy_64k_us"] = time_host_us(
        lambda: dst.copy_(src, non_blocking=True), n=2000, sync=sync)


def bench_captured(device, rng, results):
    """The captured step (``CapturedStep.run``: update + staged batch + one replay) for
    decode-1024 (64 rows gain a block) and decode-256 (16 rows): host issue time and wall, with
    the batch passed to ``run`` and (where the code has it) written into ``batch_views()``
    before ``run_staged``."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results["captured"] = []
    for name, num_rows, rows_per_step in (("decode-1024", 1024, 64), ("decode-256", 256, 16)):
        seq_lens = rng.integers(512, 32768, num_rows)
        bt = build_table([GroupSpec(BLOCK)], device, rng, seq_lens)
        step = CapturedStep(bt)
        qsl = np.arange(num_rows + 1, dtype=np.int32)
        pos = (seq_lens - 1).astype(np.int64)
        rows = np.arange(num_rows, dtype=np.int32)
        n = 600
        ups = decode_updates(rng, n + 20, rows_per_step, num_rows)
        device_work: list[float] = []
        if not cuda:  # time the CPU slot mapping apart: the rest is what CUDA's host issues
            host_work = bt.map_slots_on_host

            def timed(*args, host_work=host_work, device_work=device_work):
                t = time.perf_counter()
                host_work(*args)
                device_work.append(time.perf_counter() - t)

            bt.map_slots_on_host = timed
        for u in ups[:20]:
            step.run(u, qsl, pos, rows)
        row = {"scenario": name, "rows_gaining_a_block": rows_per_step,
               "launch": step.launch_kind}
        # run: the batch passed as arrays; staged: written into batch_views() by the caller
        # (as the engine does) before the timed run_staged
        kinds = [("", ups[20:220])]
        if hasattr(step, "run_staged"):
            kinds.append(("staged_", ups[220:420]))
            # the allocator's updates come marked trusted
            kinds.append(("trusted_", [as_journal_update(u, num_rows) for u in ups[420:]]))
        for kind, steps in kinds:
            issue, wall = [], []
            device_work.clear()
            for u in steps:
                if kind:
                    views = step.batch_views()
                    views.query_start_loc[: num_rows + 1] = qsl
                    views.positions[:num_rows] = pos
                    views.row_of_batch[:num_rows] = rows
                sync()
                t0 = time.perf_counter()
                if kind:
                    step.run_staged(u, num_rows, num_rows, with_seq_lens=False)
                else:
                    step.run(u, qsl, pos, rows)
                t1 = time.perf_counter()
                sync()
                t2 = time.perf_counter()
                issue.append(t1 - t0)
                wall.append(t2 - t0)
            row[kind + "step_us"] = median_us(wall)
            row[kind + "step_issue_us"] = median_us(issue)
            if device_work:
                row[kind + "host_part_us"] = median_us(
                    [a - b for a, b in zip(issue, device_work)])
        if step.launch_kind in ("driver", "replay"):
            sync()
            step._views[0].header[0] = 0  # replays scatter no (stale) pair
            # the step's own launch of its graph (the driver's, where the compiled part is
            # built, else torch's replay)
            row["launch_alone_host_us"] = time_host_us(step._launches[0], n=400, sync=sync)
        sync()
        assert bt.device_equals_host()
        results["captured"].append(row)


def bench_batched_add(device, rng, results):
    """1024 rows x 512 ids: one batched apply vs 1024 add_row calls (host)."""
    bt = MultiGroupBlockTable([GroupSpec(BLOCK)], MAX_REQS, MAX_MODEL_LEN, MAX_TOKENS, device)
    rows = np.arange(1024, dtype=np.int32)
    ids = rng.integers(1, 2**20, 1024 * 512, dtype=np.int32)
    upd = StepUpdate.make(1, added=[RowBlocks(rows, np.full(1024, 512, np.int32), ids)])
    lists = [ids[i * 512 : (i + 1) * 512] for i in range(1024)]
    per_row, batched = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for r in range(1024):
            bt.add_row((lists[r],), r)
        per_row.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        bt.apply(upd)
        batched.append(time.perf_counter() - t0)
    results["batched_add"] = {
        "per_row_ms": statistics.median(per_row) * 1e3,
        "batched_ms": statistics.median(batched) * 1e3,
        "speedup": statistics.median(per_row) / statistics.median(batched),
    }
    st = bt.storage
    table_bytes = MAX_REQS * bt[0].width * 4
    pinned = st.host_tensor.numel() * 4 + bt.committer._staging_host.numel() * 4
    staging_dev = bt.committer._staging_dev
    dev = st.device_tensor.numel() * 4 + (0 if staging_dev is None else staging_dev.numel() * 4)
    results["memory"] = {
        "table_bytes": table_bytes,
        "pinned_over_table": pinned / table_bytes,
        "device_over_table": dev / table_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", default=None, help="write all numbers to this file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    results: dict = {**run_info(), "device": args.device, "slot_mapping": []}
    if args.device == "cuda":
        results["card"] = torch.cuda.get_device_name()
    results["cpu_host_loops"] = compiled_part()
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    results["floors"] = measure_floors(args.device)
    bench_slot_mapping(args.device, rng, results)
    bench_step(args.device, rng, results)
    bench_captured(args.device, rng, results)
    if args.device == "cuda":
        graph_floors(results)
    bench_batched_add(args.device, rng, results)
    results["floors_after"] = measure_floors(args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print_table(results)


def print_table(results: dict) -> None:
    cuda = results["device"] == "cuda"
    where = results.get(
        "card", f"cpu ({results['slot_mapping'][0].get('torch_threads')} torch threads)")
    print(f"\nblocktable per-step benchmark on {where} (torch {results['torch']}, triton "
          f"{results.get('triton')}, CPU host loops {results['cpu_host_loops']})")
    if cuda:
        print(f"{'scenario':<16}{'tokens':>7}{'graph µs':>10}{'graph/20':>10}{'flushed µs':>12}"
              f"{'host µs':>9}   vLLM graph/flushed µs")
        for r in results["slot_mapping"]:
            print(f"{r['scenario']:<16}{r['tokens']:>7}{r['graph_us']:>10.2f}"
                  f"{r['graph_amortized_us']:>10.2f}{r['flushed_us']:>12.2f}{r['host_us']:>9.1f}   "
                  f"{r['vllm_anchor_graph_flushed_us']}")
    else:
        print(f"{'scenario':<16}{'tokens':>7}{'host µs':>9}{'1 thread':>10}")
        for r in results["slot_mapping"]:
            print(f"{r['scenario']:<16}{r['tokens']:>7}{r['host_us']:>9.1f}"
                  f"{r['host_1thread_us']:>10.1f}")
    s = results["step"]
    commit = f"commit {s['commit_host_us']:.1f} µs host"
    if cuda:
        commit += (f" / {s['commit_device_us']:.1f} µs device, {s['commit_bytes']} B "
                   f"(vLLM {s['commit_anchor']})")
    else:
        commit += f", {s['commit_bytes']} B"
    print(f"decode-1024 step: apply {s['apply_host_us']:.1f} µs host, {commit}")
    print(f"decode-1024 whole step: {s['step_us']:.1f} µs wall, host issue "
          f"{s['step_issue_us']:.1f} µs (apply {s['step_apply_host_us']:.1f} + commit "
          f"{s['step_commit_host_us']:.1f} + slot mapping {s['step_slot_mapping_host_us']:.1f})"
          + (f" (vLLM {s['step_anchor']})" if cuda else ""))
    for c in results["captured"]:
        extra = (f", its launch alone ({c['launch']}) {c['launch_alone_host_us']:.1f} µs host"
                 if "launch_alone_host_us" in c else "")
        if "host_part_us" in c:
            extra += f", without the numpy device work {c['host_part_us']:.1f} µs"

        print(f"captured {c['scenario']} step ({c['rows_gaining_a_block']} rows gain a block): "
              f"{c['step_us']:.1f} µs wall, host issue {c['step_issue_us']:.1f} µs{extra}"
              + f" (launch: {c['launch']})")
        if "staged_step_us" in c:
            staged = (f", without the numpy device work {c['staged_host_part_us']:.1f} µs"
                      if "staged_host_part_us" in c else "")
            print(f"  the same with the batch written into batch_views() first (run_staged): "
                  f"{c['staged_step_us']:.1f} µs wall, host issue "
                  f"{c['staged_step_issue_us']:.1f} µs{staged}")
        if "trusted_step_us" in c:
            trusted = (f", without the numpy device work {c['trusted_host_part_us']:.1f} µs"
                       if "trusted_host_part_us" in c else "")
            print(f"  the same with the allocator's update (trusted: the checks it made are skipped): "
                  f"{c['trusted_step_us']:.1f} µs wall, host issue "
                  f"{c['trusted_step_issue_us']:.1f} µs{trusted}")
    print(format_floors(results["floors"]))
    if cuda:
        f = results["graph_floors"]
        print(f"floors: empty graph replay {f['empty_graph_replay_us']:.2f} µs, pinned 64 KiB "
              f"copy {f['pinned_copy_64k_us']:.2f} µs (host)")
    b, m = results["batched_add"], results["memory"]
    print(f"batched add 1024x512: {b['batched_ms']:.2f} ms vs per-row {b['per_row_ms']:.2f} ms "
          f"({b['speedup']:.1f}x); memory: pinned {m['pinned_over_table']:.3f}x, device "
          f"{m['device_over_table']:.3f}x table")


if __name__ == "__main__":
    main()
