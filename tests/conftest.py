"""Test configuration: Triton runs under its interpreter on machines without CUDA.

``TRITON_INTERPRET`` must be set before ``triton`` is first imported, so it is set here, at
collection time. On a CUDA machine the real compiler is used and every device-parametrized test
also runs on ``cuda``.

The stateful (hypothesis) tests run their CI example counts through :func:`examples`;
``BLOCKTABLE_TEST_EXAMPLES_SCALE=10 python -m pytest tests/test_*stateful*.py`` runs ten times
as many, for a long search before a release or after a change to the allocator or the table.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

EXAMPLES_SCALE = float(os.environ.get("BLOCKTABLE_TEST_EXAMPLES_SCALE", "1"))
if not EXAMPLES_SCALE > 0:
    raise ValueError(f"BLOCKTABLE_TEST_EXAMPLES_SCALE must be > 0, got {EXAMPLES_SCALE}")


def examples(ci_count: int) -> int:
    """A stateful test's ``max_examples``: ``ci_count`` in CI, scaled by
    ``BLOCKTABLE_TEST_EXAMPLES_SCALE`` for a long run."""
    return max(1, round(ci_count * EXAMPLES_SCALE))


DEVICES = ["cpu", "cuda"] if HAS_CUDA else ["cpu"]
# Where Triton kernels run in tests: real CUDA when present, else CPU tensors under the interpreter.
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def triton_device() -> str:
    return TRITON_DEVICE


@pytest.fixture(params=["compiled", "numpy"])
def compiled_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the compiled step loops and with numpy doing their work: tables made
    inside the test take the mode. Where the install built no compiled part, the compiled run
    fails in CI (which builds it) and is skipped elsewhere with the reason."""
    import blocktable._compiled_loader as loader

    if request.param == "compiled":
        if loader.COMPILED is None:
            if os.environ.get("CI"):
                pytest.fail("blocktable._compiled is not built: CI installs with a C compiler")
            pytest.skip("blocktable._compiled is not built here (no C compiler at install)")
    else:
        monkeypatch.setattr(loader, "COMPILED", None)
    return str(request.param)
