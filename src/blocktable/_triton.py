"""Optional Triton import and the backend choice for kernels.

Triton kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set
before ``triton`` was imported (that is how CI tests them). Without Triton, CPU paths only.
"""

from __future__ import annotations

import os
import warnings

import torch

try:  # pragma: no cover - depends on the platform
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")
TRITON_MISSING = (
    "backend='triton' needs the triton package; CUDA builds of torch bring it: pip install triton"
)
_warned_no_triton = False


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids. (``triton.cdiv`` is a constexpr function in recent
    Triton: about 7 µs a call on the lent H200's host, too slow for a per-step path.)"""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``), in plain Python."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Pick ``"triton"`` or ``"torch"``: ``auto`` means Triton on CUDA, torch on the CPU.

    ``auto`` on CUDA without Triton falls back to the torch kernels (same results, more
    launches per step) and warns once per process.
    """
    global _warned_no_triton
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        if HAS_TRITON:
            return "triton"
        if not _warned_no_triton:
            _warned_no_triton = True
            warnings.warn(
                "blocktable: triton is not installed, so backend='auto' on CUDA uses the torch "
                "kernels (same results, slower); CUDA builds of torch bring triton: "
                "pip install triton",
                RuntimeWarning,
                stacklevel=3,
            )
        return "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError(TRITON_MISSING)
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton "
                "is imported"
            )
    return backend


class Launcher:
    """Launch a ``@triton.jit`` kernel with less host work than ``kernel[grid](...)``.

    ``kernel[grid](...)`` binds arguments and recomputes the specialization key on every call
    (~10-40 µs of host time). This keeps the compiled kernel for each combination of the
    non-tensor, non-dynamic arguments seen and calls its launcher directly. Pointer alignment
    is not part of the key: a kernel launched through it must list every pointer whose
    alignment may vary in ``do_not_specialize_on_alignment`` (the others must always be
    16-byte aligned, e.g. allocation bases). Under the interpreter, or when a profiler hooked
    launches, it takes the ordinary path.

    Parameters
    ----------
    kernel : triton.JITFunction
        The kernel. Every call passes *all* its arguments positionally, constexprs included,
        in signature order, with tensors always in the same positions.
    dynamic : tuple of int
        Positions of the ``do_not_specialize`` integer arguments (left out of the key).
    """

    def __init__(self, kernel: object, dynamic: tuple[int, ...] = ()) -> None:
        self.kernel = kernel
        self.dynamic = frozenset(dynamic)
        self._compiled: dict[tuple, object] = {}
        self._static_pos: list[int] | None = None
        self._interpret = interpreting()

    def __call__(self, grid: tuple[int, ...], *args: object, num_warps: int = 4) -> None:
        if self._interpret or _launch_hook_installed():
            self.kernel[grid](*args, num_warps=num_warps)  # type: ignore[index]
            return
        if self._static_pos is None:
            self._static_pos = [
                i for i, a in enumerate(args)
                if not isinstance(a, torch.Tensor) and i not in self.dynamic
            ]
        key = (num_warps, *[args[i] for i in self._static_pos])
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, num_warps=num_warps)  # type: ignore[index]
            if compiled is not None and hasattr(compiled, "run"):
                self._compiled[key] = compiled
            return
        g = (tuple(grid) + (1, 1))[:3]
        stream = _current_stream(args[0].device.index)  # type: ignore[attr-defined]
        compiled.run(  # type: ignore[attr-defined]
            g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,  # type: ignore[attr-defined]
            None, None, None, *args,
        )


def _current_stream(device_index: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


def _launch_hook_installed() -> bool:
    """True when a profiler hooked kernel launches (Triton >= 3.4 keeps an empty HookChain)."""
    hook = getattr(_RUNTIME_KNOBS, "launch_enter_hook", None)
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True
