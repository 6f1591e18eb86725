"""The vLLM side-by-side harness: its import hook, its workload, and that disagreement fails.

The hook is exercised on a small fake wheel tree (no network); the full harness runs on a tiny
scenario only when a vLLM wheel is already in the benchmark cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from allocator_workload import AllocatorWorkload
from vllm_shim import Stub, StubBase


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(BENCH)])
    return env


def test_stub_is_permissive_and_false() -> None:
    s = Stub("m.x")
    assert isinstance(s.a.b, Stub)
    assert not s  # features gated on a stubbed flag stay off
    assert list(s) == []

    def f() -> int:
        return 3

    assert s.jit(f) is f  # used as a decorator, it returns the function
    assert s.jit(do_not_specialize=["n"])(f) is f

    class Sub(s.Base, s.Other["T"]):  # subclassing stubs gives a working class
        def own(self) -> int:
            return 1

    obj = Sub(1, key=2)
    assert isinstance(obj, StubBase) and obj.own() == 1 and isinstance(obj.missing, Stub)


def test_hook_runs_real_modules_and_stubs_the_rest(tmp_path: Path) -> None:
    """A fake wheel: the real module imports stubbed vllm modules and an absent package."""
    wheel = tmp_path / "vllm-9.9.9"
    pkg = wheel / "vllm" / "utils"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("UTILS = 'real package'\n")
    (pkg / "math_utils.py").write_text(textwrap.dedent("""
        import zmq  # absent here: stubbed
        from vllm.logger import init_logger
        from vllm.triton_utils import triton

        logger = init_logger(__name__)

        @triton.jit
        def cdiv(a, b):
            logger.debug("called")
            return -(-a // b)
    """))
    (wheel / ".unpacked").touch()
    code = textwrap.dedent(f"""
        import importlib.util, os, sys
        os.environ["BLOCKTABLE_BENCH_CACHE"] = {str(tmp_path)!r}
        zmq_installed = importlib.util.find_spec("zmq") is not None
        import vllm_shim
        vllm_shim.REAL_MODULES = frozenset({{"vllm.utils", "vllm.utils.math_utils"}})
        v = vllm_shim.load_vllm("9.9.9")
        assert v.math_utils.cdiv(7, 2) == 4
        assert v.utils.UTILS == "real package"
        assert isinstance(sys.modules["vllm.logger"], vllm_shim.StubModule)
        assert isinstance(sys.modules["zmq"], vllm_shim.StubModule) == (not zmq_installed)
        import multiprocessing.connection  # the standard library is left alone
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(), timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_workload_matches_the_scenario() -> None:
    w = AllocatorWorkload(num_reqs=32, prompt_len=64, shared_prefix_len=32, arrivals=4,
                          decode_blocks=8, block_size=16, token_format="list")
    fill = w.fill()
    assert [r for r, _ in fill] == list(range(32))
    assert fill[0][1][:32] == fill[2][1][:32]  # every other prompt shares the prefix
    assert fill[1][1][:32] != fill[0][1][:32]
    running_before = list(w.running)
    e = w.next_step()
    assert e.finished == running_before[:4]  # the oldest finish
    assert e.new_ids == list(range(32, 36))
    assert len(set(e.decoding)) == 8 and not set(e.decoding) & set(e.finished)
    assert e.sampled.shape == (8, 16) and e.sampled.dtype == np.int64
    assert list(w.running) == running_before[4:] + e.new_ids


def test_workload_is_deterministic() -> None:
    a, b = AllocatorWorkload(num_reqs=16, seed=3), AllocatorWorkload(num_reqs=16, seed=3)
    assert all(np.array_equal(p, q) for (_, p), (_, q) in zip(a.fill(), b.fill()))
    ea, eb = a.next_step(), b.next_step()
    assert ea.decoding == eb.decoding and np.array_equal(ea.sampled, eb.sampled)


def test_disagreement_fails() -> None:
    import vs_vllm

    class Side:
        def __init__(self, name: str, free: int, blocks: list[int]) -> None:
            self.name, self.free, self.blocks = name, free, blocks

        def num_free_blocks(self) -> int:
            return self.free

        def block_ids(self, req_id: int) -> list[int]:
            return self.blocks

    vs_vllm.check_sides([Side("a", 5, [1, 2]), Side("b", 5, [1, 2])], [0], "same")
    with pytest.raises(vs_vllm.CheckFailed, match="free blocks"):
        vs_vllm.check_sides([Side("a", 5, [1, 2]), Side("b", 4, [1, 2])], [0], "free")
    with pytest.raises(vs_vllm.CheckFailed, match="request 0"):
        vs_vllm.check_sides([Side("a", 5, [1, 2]), Side("b", 5, [1, 3])], [0], "rows")


def test_slot_reference() -> None:
    import vs_vllm

    table = np.array([[5, 7, 0], [2, 9, 4]], dtype=np.int32)
    qsl = np.array([0, 2, 3])
    positions = np.array([3, 4, 9])
    rows = np.array([1, 0])
    got = vs_vllm.slot_reference(table, rows, qsl, positions, 4)
    assert got.tolist() == [2 * 4 + 3, 9 * 4 + 0, 0 * 4 + 1]


def _cached_wheel() -> bool:
    from vllm_shim import cache_dir

    return any((cache_dir() / "wheels").glob("vllm-0.33.0-*.whl")) or (
        cache_dir() / "vllm-0.33.0" / ".unpacked").exists()


@pytest.mark.skipif(not _cached_wheel(), reason="no vLLM 0.33.0 wheel in the benchmark cache")
def test_side_by_side_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(BENCH / "vs_vllm.py"), "--steps", "3", "--warmup", "1",
           "--long-reps", "1", "--long-prompt-len", "4096", "--num-reqs", "96",
           "--num-blocks", "16000", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    data = json.loads(out.read_text())
    assert {"commit", "date", "machine", "python", "torch", "vllm", "rows"} <= set(data)
    for row in data["rows"]:
        assert row["blocktable"]["n"] >= 1
        if row["vllm"] is not None:
            assert row["ratio"] == pytest.approx(row["vllm"]["median"]
                                                 / row["blocktable"]["median"])


def test_per_request_allocate_benchmark_tiny_run(tmp_path: Path) -> None:
    """Both ways of a per-request allocate run the same events and agree every step."""
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(BENCH / "bench_per_request_allocate.py"), "--steps", "4",
           "--warmup", "1", "--num-reqs", "96", "--num-blocks", "16000", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    data = json.loads(out.read_text())
    assert set(data["rows"]) == {"one-request path", "thin wrapper"}
    assert all(row["n"] == 4 for row in data["rows"].values())
