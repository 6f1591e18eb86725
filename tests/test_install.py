"""What a fresh install brings: torch and numpy only; the demo's rich and matplotlib stay out
of ``import blocktable``; without Triton the GPU path says so, and ``auto`` falls back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


# A site hook that makes ``import triton`` fail in a process and in every process it spawns
# (they inherit PYTHONPATH), as on a machine where triton was never installed.
NO_TRITON_SITE = """
import sys

class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTriton())
"""

# Kernel modules that only hold Triton kernels: the package imports them only where Triton is.
TRITON_ONLY_MODULES = {"blocktable.attention.triton_decode", "blocktable.attention.triton_prefill"}


def _env(*paths: Path) -> dict[str, str]:
    parts = [*map(str, paths), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(parts)}


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(), timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_core_dependencies_are_torch_and_numpy() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split(";")[0].strip() for d in project["dependencies"]}
    assert names == {"torch", "numpy"}
    extras = project["optional-dependencies"]
    assert {"rich", "matplotlib", "transformers"} <= {d.split(">")[0] for d in extras["demo"]}
    triton = [d for d in extras["test"] if d.startswith("triton")]
    assert len(triton) == 1 and "aarch64" in triton[0] and "x86_64" in triton[0]


def test_import_blocktable_is_light_and_every_name_resolves() -> None:
    out = _run(
        "import sys, blocktable\n"
        "print('torch' in sys.modules, 'numpy' in sys.modules)\n"
        "from blocktable import *\n"
        "import blocktable.compat\n"
        "print(all(getattr(blocktable, n) is not None for n in blocktable.__all__)\n"
        "      and sorted(blocktable.__all__) == sorted(blocktable._EXPORTS))\n"
        "print(sorted(m for m in ('rich', 'matplotlib') if m in sys.modules))\n"
    )
    assert out.split("\n")[:3] == ["False False", "True", "[]"]


def test_without_triton_the_gpu_path_says_so() -> None:
    out = _run(
        "import sys, warnings\n"
        "sys.modules['triton'] = None  # as if not installed\n"
        "import torch\n"
        "from blocktable import GroupSpec, MultiGroupBlockTable\n"
        "from blocktable._triton import HAS_TRITON, resolve_backend\n"
        "assert not HAS_TRITON\n"
        "try:\n"
        "    MultiGroupBlockTable([GroupSpec(16)], 2, 64, backend='triton')\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    picks = [resolve_backend('auto', torch.device('cuda', 0)) for _ in range(3)]\n"
        "print(picks, len(caught), caught[0].category.__name__)\n"
        "print(resolve_backend('auto', torch.device('cpu')))\n"
        "bt = MultiGroupBlockTable([GroupSpec(4)], 2, 64, 8)  # the CPU path needs no triton\n"
        "bt.add_row(([3],), 0); bt.commit()\n"
        "qsl = torch.tensor([0, 1], dtype=torch.int32)\n"
        "print(bt.compute_slot_mapping(qsl, torch.tensor([2]))[0][:2].tolist())\n"
        "import blocktable.attention, blocktable.engine, blocktable.cli  # the demo's imports\n"
        "print(blocktable.attention.kernel_config.FUSED_COMBINE_MAX_PROGRAMS)\n"
    )
    lines = out.splitlines()
    assert lines[0] == ("backend='triton' needs the triton package; CUDA builds of torch bring "
                        "it: pip install triton")
    assert lines[1] == "['torch', 'torch', 'torch'] 1 RuntimeWarning"  # warned once
    assert lines[2] == "torch"
    assert lines[3] == "[14, -1]"
    assert lines[4] == "16"  # the attention and engine modules import without triton


def test_demo_model_constants_match_the_model() -> None:
    pytest.importorskip("transformers")
    from blocktable.demo import KV_BYTES_PER_TOKEN, MODEL_MAX_POSITIONS
    from blocktable.engine import tiny_llama

    config = tiny_llama().config
    per_token = (config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim
                 * torch.finfo(torch.float32).bits // 8)
    assert KV_BYTES_PER_TOKEN == per_token
    assert MODEL_MAX_POSITIONS == config.max_position_embeddings
    from blocktable.cli import MAX_BLOCK_SIZE, MAX_NEW_TOKENS

    assert 6 * MAX_BLOCK_SIZE + MAX_NEW_TOKENS <= MODEL_MAX_POSITIONS


def test_without_triton_every_public_module_imports_and_the_dcp_demo_runs(
    tmp_path: Path,
) -> None:
    (tmp_path / "sitecustomize.py").write_text(NO_TRITON_SITE)
    png = tmp_path / "dcp.png"
    # The README's [demo] install: the demo with two spawned ranks (gloo, the collectives),
    # in the same process as the imports (one interpreter start less). Tight: 8 blocks per
    # rank of 2 tokens (4 per allocator block) force preemptions.
    args = ["demo", "--dcp", "2", "--cp-interleave", "2", "--num-requests", "4",
            "--max-new-tokens", "4", "--block-size", "2", "--num-blocks", "8",
            "--token-budget", "8", "--out", str(png)]
    code = (
        "import importlib, pkgutil, sys, blocktable\n"
        "from blocktable import *\n"
        "from blocktable import AttentionMerger\n"
        "failed = []\n"
        "for m in pkgutil.walk_packages(blocktable.__path__, 'blocktable.'):\n"
        "    if m.name.endswith('__main__'):\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ImportError as exc:\n"
        "        failed.append(m.name)\n"
        "print('triton' in sys.modules and sys.modules['triton'] is not None)\n"
        "print(sorted(failed))\n"
        "from blocktable._triton import HAS_TRITON\n"
        "print(HAS_TRITON)\n"
        "from blocktable.demo import DemoOptions\n"
        "from blocktable.dcp_demo import run_dcp_demo\n"
        "opts = DemoOptions(dcp=2, device='cuda', merge_transport='p2p')\n"
        "print('exit', run_dcp_demo(opts))\n"
        "from blocktable.cli import main\n"
        f"print('exit', main({args!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(tmp_path), timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:5] == [
        "False", str(sorted(TRITON_ONLY_MODULES)), "False",
        "--merge-transport p2p needs triton: pip install triton", "exit 2",
    ]
    assert lines[-1] == "exit 0", proc.stdout + proc.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    text = "\n".join(lines[5:])
    flat = " ".join(text.split())  # the console wraps long lines
    assert "4/4 requests match transformers.generate and the single-process engine (DCP 2)" in flat
    assert "KV per rank" in text
    written = [int(m) for m in re.findall(r"│\s+[01] │\s+(\d+) │\s+[\d.]+% │", text)]
    computed = re.search(r"\((\d+) tokens computed\)", text)
    assert len(written) == 2 and min(written) > 0 and computed is not None
    assert sum(written) == int(computed.group(1))  # every token written by exactly one rank
    # gloo on the CPU: auto chooses the collectives
    assert re.search(r"attention merge\s+│\s+collectives \(--merge-transport auto\)", text)
