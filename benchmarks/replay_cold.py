"""Host time of one CUDA-graph replay of the captured step's graph, with the CPU caches cold.

In an engine's loop the model runs between two table steps, so the graph replay finds the
driver's code and data out of the CPU caches: it costs several times its warm time. This
script replays, warm (back to back) and cold (after walking ``--evict-mib`` of host memory),
the captured step's own graph and graphs holding parts of it, to show which part of the
replay's host cost is the copy node and which the kernels:

- ``step``: the captured step's graph as it runs where the device reads pinned host memory
  (kernels only: the scatter reads the staging buffer in place and brings the batch across,
  the slot mapping, the mailbox post);
- ``step, copied``: the captured step's graph with the staging buffer copied to the device
  first (a copy node, the scatter, the slot mapping);
- ``copy``: the staging copy alone;
- ``kernels``: the scatter and the slot mapping without the copy;
- ``one kernel``: one tiny kernel (the least a graph replay costs).

Each graph is also launched by the package's compiled call to the driver (``graph_launch``,
what :class:`CapturedStep` uses where it can; the ``driver`` columns), against torch's
``CUDAGraph.replay()``.

Each replay is followed by a ``torch.cuda.synchronize()`` outside the timed region. The
``wall`` column times, warm, a replay through the end of its device work (replay, then
synchronize), less an empty synchronize: what the graph costs a step that waits for it.

    PYTHONPATH=src python benchmarks/replay_cold.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch
from floors import format_floors, measure_floors
from run_info import run_info

from blocktable import GroupSpec, MultiGroupBlockTable
from blocktable._native_loader import native_module
from blocktable.step import CapturedStep
from blocktable.step.kernels import launch_staged_scatter


def capture(work: Callable[[], None]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()  # warm-up outside the capture (compiles the kernels)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    torch.cuda.synchronize()
    return graph


def driver_launch(native: ModuleType, graph: torch.cuda.CUDAGraph) -> Callable[[], None]:
    """Launch ``graph`` as :class:`CapturedStep` does where it can: one compiled call to the
    driver, on the current stream."""
    launch, raw_stream = native.graph_launch, torch._C._cuda_getCurrentRawStream
    handle, context, device = graph.raw_cuda_graph_exec(), native.cuda_context(), 0
    if launch(handle, raw_stream(device), context) < 0:
        raise RuntimeError("graph_launch declined: no current context")

    def run() -> None:
        launch(handle, raw_stream(device), context)

    return run


def replay_us(replay: Callable[[], None], reps: int, evict: np.ndarray | None) -> float:
    samples = []
    for _ in range(reps):
        if evict is not None:
            evict += 1  # walks the whole buffer: the CPU caches hold it, not the driver's state
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def wall_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median of (replay + synchronize) less the median of an empty synchronize, warm."""
    def median_us(work: Callable[[], None]) -> float:
        samples = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            work()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e6

    return median_us(graph.replay) - median_us(lambda: None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--evict-mib", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    table = MultiGroupBlockTable([GroupSpec(16, num_blocks=65536)], 1024, 32768, 8192, "cuda",
                                 backend="triton")
    step = CapturedStep(table)
    assert step._graphs is not None and step.reads_in_place
    CapturedStep.try_in_place = False
    copied = CapturedStep(table)
    CapturedStep.try_in_place = True
    assert copied._graphs is not None and not copied.reads_in_place
    dev, host = step._dev, step._host[0]
    flat = table.storage.device_tensor
    L = step.layout
    mailbox = torch.zeros(2, dtype=torch.int32, device="cuda")
    tiny = torch.zeros(1, device="cuda")

    def kernels() -> None:
        launch_staged_scatter(flat, dev, mailbox, L.max_pairs)
        table.launch_slot_mapping_unchecked(step._d_qsl, step._d_positions, step._d_rows)

    graphs = {
        "step": step._graphs[0],
        "step, copied": copied._graphs[0],
        "copy": capture(lambda: dev.copy_(host, non_blocking=True)),
        "kernels": capture(kernels),
        "one kernel": capture(lambda: tiny.add_(1)),
    }
    evict = np.zeros(args.evict_mib << 17, dtype=np.int64)  # MiB of int64
    res: dict = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "evict_mib": args.evict_mib, "reps": args.reps, "replay_host_us": {}}
    native = native_module()
    driver = (native is not None and hasattr(native, "graph_launch")
              and hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"))
    res["floors_before"] = measure_floors("cuda")
    for _ in range(2):  # the second round is the one reported (the first warms everything up)
        for name, graph in graphs.items():
            t = {"warm": replay_us(graph.replay, args.reps, None),
                 "cold": replay_us(graph.replay, args.reps, evict),
                 "wall": wall_us(graph, args.reps)}
            if driver:
                launch = driver_launch(native, graph)
                t["driver warm"] = replay_us(launch, args.reps, None)
                t["driver cold"] = replay_us(launch, args.reps, evict)
            res["replay_host_us"][name] = t
    res["floors_after"] = measure_floors("cuda")
    print(f"graph replay host time on {res['card']} (torch {res['torch']}), median of "
          f"{args.reps}; cold = after walking {args.evict_mib} MiB of host memory; driver = "
          "the compiled graph_launch")
    print(format_floors(res["floors_before"]))
    print(f"{'graph':<14}{'warm µs':>10}{'cold µs':>10}{'wall µs':>10}"
          f"{'driver warm':>13}{'driver cold':>13}")
    for name, t in res["replay_host_us"].items():
        extra = (f"{t['driver warm']:>13.2f}{t['driver cold']:>13.2f}" if driver else "")
        print(f"{name:<14}{t['warm']:>10.2f}{t['cold']:>10.2f}{t['wall']:>10.2f}{extra}")
    print(format_floors(res["floors_after"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": run_info(), **res}, f, indent=2)


if __name__ == "__main__":
    main()
