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
        from vllm.compilation.decorators import support_torch_compile
        from vllm.v1.attention.backends.utils import PAD_SLOT_ID

        logger = init_logger(__name__)

        @support_torch_compile
        def cdiv(a, b):
            logger.debug("called")
            return -(-a // b)
    """))
    backends = wheel / "vllm" / "v1" / "attention" / "backends"
    backends.mkdir(parents=True)
    (backends / "utils.py").write_text("import nothing_here\nPAD_SLOT_ID = -3\n")
    (wheel / ".unpacked").touch()
    code = textwrap.dedent(f"""
        import importlib.util, os, sys
        os.environ["BLOCKTABLE_BENCH_CACHE"] = {str(tmp_path)!r}
        zmq_installed = importlib.util.find_spec("zmq") is not None
        import vllm_shim
        vllm_shim.REAL_MODULES = frozenset({{"vllm.utils", "vllm.utils.math_utils"}})
        v = vllm_shim.load_vllm("9.9.9")
        assert v.math_utils.cdiv(7, 2) == 4
        assert v.math_utils.PAD_SLOT_ID == -3  # a stub's constant, read from the source
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


def test_export_subset_holds_what_the_hook_reads(tmp_path: Path) -> None:
    """The exported subset serves the same imports with nothing downloaded."""
    import vllm_shim

    wheel = tmp_path / "unpacked"
    (wheel / "vllm" / "utils").mkdir(parents=True)
    (wheel / "vllm" / "utils" / "__init__.py").write_text("UTILS = 1\n")
    (wheel / "vllm" / "utils" / "math_utils.py").write_text("X = 2\n")
    (wheel / "vllm" / "big_unused.py").write_text("Y = 3\n")
    real = vllm_shim.REAL_MODULES
    constants = vllm_shim.CONSTANTS
    try:
        vllm_shim.REAL_MODULES = frozenset({"vllm.utils", "vllm.utils.math_utils"})
        vllm_shim.CONSTANTS = {}
        copies = vllm_shim.export_subset(wheel, tmp_path / "subset")
        with pytest.raises(FileNotFoundError, match="not in the unpacked vLLM tree"):
            vllm_shim.REAL_MODULES = frozenset({"vllm.absent"})
            vllm_shim.export_subset(wheel, tmp_path / "other")
    finally:
        vllm_shim.REAL_MODULES, vllm_shim.CONSTANTS = real, constants
    got = sorted(str(c.relative_to(tmp_path / "subset")) for c in copies)
    assert got == ["vllm/utils/__init__.py", "vllm/utils/math_utils.py"]
    assert (tmp_path / "subset" / "vllm" / "utils" / "math_utils.py").read_text() == "X = 2\n"


def test_every_real_module_file_is_exported() -> None:
    """Each real module and constant source maps to one file of the tree, none twice."""
    import vllm_shim

    files = vllm_shim.module_files(Path("/tree"))
    assert len(set(files)) == len(vllm_shim.REAL_MODULES) + len(vllm_shim.CONSTANTS)
    assert Path("/tree/vllm/v1/worker/block_table.py") in files


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


_CUDA_CHECKS = textwrap.dedent("""
    import sys
    import numpy as np, torch
    from vllm_shim import load_vllm
    v = load_vllm("0.33.0")
    import vs_vllm_cuda
    from vs_vllm_sides import CheckFailed
    from blocktable import RowBlocks, StepUpdate

    sides = vs_vllm_cuda.Sides(v, torch.device("cpu"), 4, 3, 32, 16)
    rows = {0: [5, 6], 1: [7], 2: [9, 3, 2]}
    for r, ids in rows.items():
        sides.vllm.add_row((ids,), r)
    sides.vllm.commit_block_table(3)
    sides.ours.apply(StepUpdate.make(1, added=[RowBlocks.from_lists(list(rows),
                                                                    list(rows.values()))]))
    sides.ours.commit()
    qsl = np.array([0, 2, 3, 5], np.int32)
    pos = np.array([0, 7, 3, 10, 11], np.int64)
    q, p = torch.from_numpy(qsl), torch.from_numpy(pos)
    sides.vllm.compute_slot_mapping(3, q, p)  # vLLM's Triton kernel, in the interpreter
    sides.ours.compute_slot_mapping(q, p)
    sides.check(rows, qsl, pos, "same")
    assert sides.ours.slot_mapping(0)[:5].tolist() == [20, 27, 31, 10, 11]

    def fails(what):
        try:
            sides.check(rows, qsl, pos, what)
        except CheckFailed as e:
            print("caught:", e)
        else:
            sys.exit(what + ": not caught")

    ours, theirs = sides.ours.slot_mapping(0), sides.vllm[0].slot_mapping.gpu
    ours[1] += 1; fails("one slot"); ours[1] -= 1
    theirs[9] = 0; fails("padding"); theirs[9] = -1
    sides.vllm[0].block_table.gpu[2, 1] += 1; fails("device table")
    print("ok")
""")


@pytest.mark.skipif(not _cached_wheel(), reason="no vLLM 0.33.0 wheel in the benchmark cache")
def test_cuda_rows_compare_vllms_kernel_and_catch_differences() -> None:
    """vLLM's own slot-mapping kernel and ours agree; a changed slot, padding entry or device
    table entry on either side fails the check."""
    env = _env() | {"TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _CUDA_CHECKS], capture_output=True, text=True,
                         env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("caught:") == 3 and out.stdout.strip().endswith("ok")


@pytest.mark.skipif(not _cached_wheel(), reason="no vLLM 0.33.0 wheel in the benchmark cache")
def test_cuda_rows_dry_run(tmp_path: Path) -> None:
    """The CUDA rows' inputs and checks, both sides' kernels in Triton's interpreter, from an
    exported subset of the wheel (nothing downloaded)."""
    subset, out = tmp_path / "vllm-subset", tmp_path / "out.json"
    base = [sys.executable, str(BENCH / "vs_vllm.py")]
    env = _env() | {"TRITON_INTERPRET": "1"}
    res = subprocess.run(base + ["--export-vllm-subset", str(subset)], capture_output=True,
                         text=True, env=env, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sum(f.stat().st_size for f in subset.rglob("*") if f.is_file()) < 2 << 20
    cmd = base + ["--vllm-dir", str(subset), "--cuda-only", "--cuda-device", "cpu",
                  "--num-reqs", "16", "--prompt-len", "64", "--num-blocks", "4000",
                  "--cuda-steps", "3", "--cuda-warmup", "1", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [r["name"].split(",")[0] for r in rows] == ["slot mapping"] * 2 + ["block-table step"]
    assert all(r["vllm"]["n"] >= 1 and r["blocktable"]["n"] >= 1 for r in rows)
