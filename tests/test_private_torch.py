"""Private torch names live in one module (``blocktable._triton``), each behind a public
fallback, and a CUDA build of torch that drops one fails here, loudly."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from blocktable import _triton

PRIVATE = ("_cuda_getCurrentRawStream", "_cuda_getDevice")
SRC = Path(__file__).resolve().parents[1] / "src" / "blocktable"


def test_only_one_module_uses_private_torch_names():
    users = sorted(
        str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
        if re.search(r"torch\._C\b", p.read_text()) and p.name != "_triton.py"
    )
    assert users == [], f"torch._C used outside blocktable/_triton.py: {users}"


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch has no CUDA names")
def test_the_private_names_exist_in_this_cuda_build():
    missing = [name for name in PRIVATE if not hasattr(torch._C, name)]
    assert not missing, (f"torch {torch.__version__} dropped torch._C.{missing}: blocktable "
                         "falls back to the public API (slower launches); update _triton.py")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_public_fallbacks_give_the_same_answers(monkeypatch):
    fast = (_triton._current_device(), _triton._current_stream(0), _triton.raw_stream_getter()(0))
    # torch's public calls use the private names themselves: hide them from blocktable only
    monkeypatch.setattr(_triton, "_PRIVATE_C", types.SimpleNamespace())
    assert (_triton._current_device(), _triton._current_stream(0),
            _triton.raw_stream_getter()(0)) == fast


def test_the_raw_stream_getter_falls_back_to_the_public_call(monkeypatch):
    """Without the private name the getter is the public ``current_stream(i).cuda_stream``."""
    calls = []

    class Stream:
        cuda_stream = 0x1234

    def current_stream(index):
        calls.append(index)
        return Stream()

    monkeypatch.setattr(_triton, "_PRIVATE_C", types.SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    assert _triton.raw_stream_getter()(3) == 0x1234 and calls == [3]


def test_numpy_count_nonzero_without_its_wrapper_is_numpy_s_own():
    """``blocktable._fastnp`` takes numpy's C ``count_nonzero`` from a private module (numpy
    2.x), else the public wrapper: a numpy 2.x that moves it fails here, loudly."""
    import numpy as np

    from blocktable import _fastnp

    if int(np.__version__.split(".")[0]) >= 2:
        assert _fastnp.count_nonzero is not np.count_nonzero, (
            f"numpy {np.__version__} moved numpy._core.multiarray.count_nonzero: blocktable "
            "falls back to the wrapper (slower); update _fastnp.py")
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 300):
        a = rng.integers(0, 3, n).astype(np.int64)
        assert _fastnp.count_nonzero(a) == np.count_nonzero(a)
        assert _fastnp.count_nonzero(a > 0) == np.count_nonzero(a > 0)
