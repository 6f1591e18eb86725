"""Optional Triton import and the backend choice for kernels.

Triton kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set
before ``triton`` was imported (that is how CI tests them). Without Triton, CPU paths only.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

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
    Triton, too slow to call on a per-step path.)"""
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


# Triton versions whose private launcher ABI (``CompiledKernel.run(gridX, gridY, gridZ, stream,
# function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``) the fast path was
# verified against: 3.6 on the GPU machine, 3.9 in CI. Other versions take the public
# ``kernel[grid](...)`` path; add a version here only after running the GPU tests on it.
FAST_LAUNCH_TRITON_VERSIONS: frozenset[tuple[int, int]] = frozenset({(3, 6), (3, 9)})
FAST_LAUNCH_ENV = "BLOCKTABLE_TRITON_FAST_LAUNCH"  # "0": never, "1": always, unset: allow-list


def triton_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed Triton, or ``None`` without Triton."""
    return parse_version(triton.__version__) if HAS_TRITON else None


def parse_version(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``"3.6.0+git1234"``; ``None`` if unparsable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def fast_launch_enabled(
    version: tuple[int, int] | None = None, env: str | None = None
) -> bool:
    """Whether :class:`Launcher` may call Triton's private launcher directly.

    Parameters
    ----------
    version : tuple of int or None
        ``(major, minor)`` of Triton; default the installed one.
    env : str or None
        Value of ``BLOCKTABLE_TRITON_FAST_LAUNCH``; default read from the environment. ``"0"``
        forces the public path, ``"1"`` the fast path (on an unverified version at your own
        risk); unset or empty: the fast path only on :data:`FAST_LAUNCH_TRITON_VERSIONS`.
    """
    if env is None:
        env = os.environ.get(FAST_LAUNCH_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{FAST_LAUNCH_ENV} must be 0, 1 or unset, got {env!r}")
    if env:
        return env == "1"
    return (version if version is not None else triton_version()) in FAST_LAUNCH_TRITON_VERSIONS


class Launcher:
    """Launch a ``@triton.jit`` kernel with less host work than ``kernel[grid](...)``.

    ``kernel[grid](...)`` binds arguments and recomputes the specialization key on every call,
    host time that can exceed a small kernel's run. This keeps the compiled kernel for each device and each
    combination of the non-tensor, non-dynamic arguments and tensor dtypes seen, and calls its
    launcher directly
    (Triton's private launcher ABI: only on :data:`FAST_LAUNCH_TRITON_VERSIONS`, see
    :func:`fast_launch_enabled`). A compiled kernel holds module and function handles of the
    device it was loaded on, so the device (of the first tensor argument) is part of the key,
    and every launch runs with that device current, as Triton expects. Pointer alignment is
    not part of the key: a kernel launched through it must list every pointer whose alignment
    may vary in ``do_not_specialize_on_alignment`` (the others must always be 16-byte aligned,
    e.g. allocation bases). A tensor descriptor (Gluon's or Triton's host-side TMA
    descriptor: an argument with ``base`` and ``block_shape``) is keyed by what Triton compiles
    for it: its base's dtype, block shape and shared layout; the launcher encodes its address,
    shape and strides anew at every launch. Under the interpreter, when a profiler hooked
    launches, or when the fast path is off, it takes the ordinary path.

    Parameters
    ----------
    kernel : triton.JITFunction
        The kernel. Every call passes *all* its arguments positionally, constexprs included,
        in signature order, with tensors always in the same positions; the first argument is
        a tensor on the device to launch on.
    dynamic : tuple of int
        Positions of the ``do_not_specialize`` integer arguments (left out of the key).
    fast : bool or None
        Use the fast path; default :func:`fast_launch_enabled`.
    """

    def __init__(
        self, kernel: object, dynamic: tuple[int, ...] = (), fast: bool | None = None
    ) -> None:
        self.kernel = kernel
        self.dynamic = frozenset(dynamic)
        self.fast = fast_launch_enabled() if fast is None else fast
        # (device index, num_warps, static args..., tensor dtypes...) -> compiled kernel loaded
        # on that device
        self._compiled: dict[tuple, object] = {}
        self._static_pos: list[int] | None = None
        self._tensor_pos: list[int] = []
        self._descriptor_pos: list[int] = []
        self._interpret = interpreting()

    def __call__(self, grid: tuple[int, ...], *args: object, num_warps: int = 4) -> None:
        if self._interpret:
            self.kernel[grid](*args, num_warps=num_warps)  # type: ignore[index]
            return
        device = _device_index(args[0])  # type: ignore[arg-type]
        if device == _current_device():
            self._launch(device, grid, args, num_warps)
        else:
            with _device_guard(device):
                self._launch(device, grid, args, num_warps)

    def _launch(
        self, device: int, grid: tuple[int, ...], args: tuple[object, ...], num_warps: int
    ) -> None:
        """Launch on ``device``, which is current."""
        if not self.fast or _launch_hook_installed():
            self.kernel[grid](*args, num_warps=num_warps)  # type: ignore[index]
            return
        key = self._key(device, args, num_warps)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, num_warps=num_warps)  # type: ignore[index]
            if compiled is not None and hasattr(compiled, "run"):
                self._compiled[key] = compiled
            return
        g = (tuple(grid) + (1, 1))[:3]
        compiled.run(  # type: ignore[attr-defined]
            g[0], g[1], g[2], _current_stream(device), compiled.function,  # type: ignore[attr-defined]
            compiled.packed_metadata, None, None, None, *args,  # type: ignore[attr-defined]
        )

    def _key(self, device: int, args: tuple[object, ...], num_warps: int) -> tuple:
        if self._static_pos is None:
            self._tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            self._descriptor_pos = [i for i, a in enumerate(args) if _is_descriptor(a)]
            self._static_pos = [
                i for i in range(len(args))
                if i not in self.dynamic and i not in self._tensor_pos
                and i not in self._descriptor_pos
            ]
        # A kernel compiled for one tensor dtype computes garbage on another: dtypes are keyed.
        return (
            device,
            num_warps,
            *[args[i] for i in self._static_pos],
            *[args[i].dtype for i in self._tensor_pos],  # type: ignore[attr-defined]
            *[_descriptor_key(args[i]) for i in self._descriptor_pos],
        )

    def bind(
        self, args: tuple[object, ...], num_warps: int = 4
    ) -> Callable[..., None] | None:
        """A launch function, ``launch(grid, *args)``, for later calls whose static (non-tensor,
        non-dynamic) arguments and tensor dtypes equal those of ``args``: it skips the
        per-call key. The caller guarantees the equality (e.g. by caching the result under its
        own key). ``None`` when the kernel was not compiled for ``args`` yet (launch once
        through ``__call__`` first), under the interpreter, or when the fast path is off."""
        if self._interpret or not self.fast:
            return None
        device = _device_index(args[0])  # type: ignore[arg-type]
        compiled = self._compiled.get(self._key(device, args, num_warps))
        if compiled is None:
            return None
        run = compiled.run  # type: ignore[attr-defined]
        function = compiled.function  # type: ignore[attr-defined]
        packed = compiled.packed_metadata  # type: ignore[attr-defined]

        def launch(grid: tuple[int, int, int], *call_args: object) -> None:
            if device != _current_device() or _launch_hook_installed():
                self(grid, *call_args, num_warps=num_warps)
                return
            run(grid[0], grid[1], grid[2], _current_stream(device), function, packed, None, None,
                None, *call_args)

        return launch


def _is_descriptor(arg: object) -> bool:
    """Whether ``arg`` is a host-side tensor descriptor (Gluon's or ``triton.tools``')."""
    return not isinstance(arg, torch.Tensor) and hasattr(arg, "base") and hasattr(
        arg, "block_shape")


def _descriptor_key(desc: object) -> tuple:
    """What Triton compiles a kernel for, of a tensor descriptor argument: the class, its
    base's dtype, block shape, shared layout and out-of-bounds padding (not its address,
    shape or strides, which the launcher encodes at every launch)."""
    return (type(desc), desc.base.dtype, tuple(desc.block_shape),  # type: ignore[attr-defined]
            getattr(desc, "layout", None), getattr(desc, "padding", None))


def on_device(tensor: torch.Tensor) -> AbstractContextManager[object]:
    """Make ``tensor``'s CUDA device current for a Triton launch (Triton launches on the
    current device); a no-op when it already is, or for a CPU tensor."""
    if tensor.device.type != "cuda":
        return nullcontext()
    device = _device_index(tensor)
    return nullcontext() if device == _current_device() else _device_guard(device)


def _device_index(tensor: torch.Tensor) -> int:
    index = tensor.device.index
    return 0 if index is None else int(index)


# where the private names are looked up: torch's own, or (in a test of the fallbacks) a stand-in
# without them, since torch's public calls use the same names internally
_PRIVATE_C: object = torch._C


def _current_device() -> int:
    get = getattr(_PRIVATE_C, "_cuda_getDevice", None)
    return int(get()) if get is not None else torch.cuda.current_device()


def _device_guard(device: int) -> AbstractContextManager[object]:
    return torch.cuda.device(device)


def _current_stream(device_index: int) -> int:
    raw = getattr(_PRIVATE_C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


def raw_stream_getter() -> Callable[[int], int]:
    """``f(device_index)``: that device's current CUDA stream as a raw ``cudaStream_t`` (an
    int): torch's private lookup where it has one (one C call), else the public
    ``torch.cuda.current_stream(i).cuda_stream``."""
    raw = getattr(_PRIVATE_C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw  # type: ignore[no-any-return]
    return lambda index: int(torch.cuda.current_stream(index).cuda_stream)


_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


def _launch_hook_installed() -> bool:
    """True when a profiler hooked kernel launches (Triton >= 3.4 keeps an empty HookChain)."""
    hook = getattr(_RUNTIME_KNOBS, "launch_enter_hook", None)
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True
