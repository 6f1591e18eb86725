"""Host-time floors of this machine, measured beside a benchmark in the same run.

An empty torch op and an empty numpy op on every device; on CUDA also
``torch.cuda.current_stream()`` and an empty Triton kernel launched through blocktable's cached
:class:`~blocktable._triton.Launcher` (and through ``kernel[grid]`` for contrast).

With ``cold=True`` also the same numpy op with the CPU caches cold: each call follows a pass
over 32 MB of other memory, as an engine's table step follows the model's forward. Engine
loops compare against this one: machines differ far more in it than in the warm floor.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _empty_kernel(x_ptr, BLOCK: tl.constexpr):  # module level: Triton reads `tl` here
        pass

except ImportError:  # pragma: no cover - no triton
    _empty_kernel = None


def host_us(fn: Callable[[], object], n: int = 2000, warmup: int = 50) -> float:
    """Median host time of one call of ``fn`` in µs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def cold_us(fn: Callable[[], object], n: int = 200) -> float:
    """Median host time of one call of ``fn`` in µs, each call after a pass over 32 MB."""
    traffic = np.ones(4_000_000)  # float64: 32 MB
    fn()
    samples = []
    for _ in range(n):
        traffic *= 1.0000001
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def measure_floors(device: str, cold: bool = False) -> dict[str, float]:
    """µs per call of the cheapest things a step does on ``device`` (``cold``: and the numpy
    op with cold CPU caches)."""
    t = torch.zeros(1, device=device)
    a = np.zeros(1)
    out = {
        "empty_torch_op_us": host_us(lambda: t.add_(0)),
        "numpy_op_us": host_us(lambda: np.add(a, 1, out=a)),
    }
    if cold:
        out["cold_numpy_op_us"] = cold_us(lambda: np.add(a, 1, out=a))
    if device == "cuda":
        out["current_stream_us"] = host_us(torch.cuda.current_stream)
        if _empty_kernel is None:
            return out
        from blocktable._triton import Launcher

        launch = Launcher(_empty_kernel)
        out["empty_triton_launch_cached_us"] = host_us(lambda: launch((1,), t, 16))
        out["empty_triton_launch_grid_us"] = host_us(lambda: _empty_kernel[(1,)](t, BLOCK=16))
        torch.cuda.synchronize()
    return out


def format_floors(floors: dict[str, float]) -> str:
    names = {
        "empty_torch_op_us": "empty torch op", "numpy_op_us": "numpy op",
        "cold_numpy_op_us": "numpy op with cold caches",
        "current_stream_us": "current_stream()",
        "empty_triton_launch_cached_us": "empty Triton launch (cached launcher)",
        "empty_triton_launch_grid_us": "empty Triton launch (kernel[grid])",
    }
    return "floors: " + ", ".join(f"{names[k]} {v:.2f} µs" for k, v in floors.items())
