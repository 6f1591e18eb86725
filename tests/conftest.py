"""Test configuration: Triton runs under its interpreter on machines without CUDA.

``TRITON_INTERPRET`` must be set before ``triton`` is first imported, so it is set here, at
collection time. On a CUDA machine the real compiler is used and every device-parametrized test
also runs on ``cuda``.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu", "cuda"] if HAS_CUDA else ["cpu"]
# Where Triton kernels run in tests: real CUDA when present, else CPU tensors under the interpreter.
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def triton_device() -> str:
    return TRITON_DEVICE
