"""Optional Triton import and the backend choice for kernels.

Triton kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set
before ``triton`` was imported (that is how CI tests them). Without Triton, CPU paths only.
"""

from __future__ import annotations

import os

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


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Pick ``"triton"`` or ``"torch"``: ``auto`` means Triton on CUDA, torch on the CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' needs the triton package")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton "
                "is imported"
            )
    return backend
