"""One way for the benchmarks to capture a CUDA graph of the work they time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any], calls: int = 1, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn`` on the current device, after ``warmup`` calls
    on a side stream (kernels compiled, plans made, lazily allocated buffers in place). The
    graph is not replayed; the device is synchronized."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph
