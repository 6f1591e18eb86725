"""The Gluon prefill kernel compiled for sm_90 without a GPU (Triton's bundled ptxas): the
loader's tensor copies and plain loads, the consumers' wgmma and the mbarrier waits between
them are in its machine code, for the default launch shape and others.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COMPILE_SCRIPT = r'''
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
if "nvidia" not in getattr(triton.backends, "backends", {}):
    sys.exit(77)
from blocktable.attention import gluon_prefill as ws
if not ws.HAS_GLUON:
    sys.exit(77)
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

group, block_n, stages, head_dim, block_size, out = sys.argv[1:]
group, block_n, stages, head_dim, block_size = map(
    int, (group, block_n, stages, head_dim, block_size))
chunk = min(block_size, block_n)
cache = torch.empty(64 * block_size, 8 * head_dim, dtype=torch.bfloat16)
layout = gl.NVMMASharedLayout.get_default_for([chunk, head_dim], gl.bfloat16)
desc = ws.TensorDescriptor(cache, list(cache.shape), list(cache.stride()), [chunk, head_dim],
                           layout)
kernel = ws.gluon_prefill_kernel
consts = dict(GROUP=group, GROUP_PAD=group, BLOCK_Q=128 // group, BLOCK_N=block_n,
              HEAD_DIM=head_dim, BLOCK_SIZE=block_size, RADIX=16, INDEXED=False, HAS_LSE=True,
              NUM_STAGES=stages)
pointers = {"out_ptr": "bf16", "lse_ptr": "fp32", "query_ptr": "bf16", "k_cache_ptr": "bf16",
            "v_cache_ptr": "bf16", "table_ptr": "i32", "seq_lens_ptr": "i32", "qsl_ptr": "i32",
            "row_of_batch_ptr": "i32"}
signature, attrs = {}, {}
for i, name in enumerate(kernel.arg_names):
    if name in pointers:
        signature[name] = "*" + pointers[name]
        attrs[(i,)] = [["tt.divisibility", 16]]
    elif name in ("k_desc", "v_desc"):
        signature[name] = mangle_type(desc)
    elif name in consts:
        signature[name] = "constexpr"
    elif name == "qk_scale":
        signature[name] = "fp32"
    else:
        signature[name] = "i32"
        if "stride" in name and name != "table_stride_c":
            attrs[(i,)] = [["tt.divisibility", 16]]
compiled = triton.compile(GluonASTSource(kernel, signature, consts, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "ptx_version": 87})
with open(out + ".cubin", "wb") as f:
    f.write(compiled.asm["cubin"])
'''


@pytest.mark.parametrize("shape", [
    # group, block_n, stages, head_dim, kernel block size: the default launch, then others
    (4, 64, 4, 128, 16), (8, 64, 3, 128, 256), (2, 128, 2, 64, 64),
], ids=lambda s: "g{}-n{}-s{}-d{}-b{}".format(*s))
def test_kernel_compiles_to_tma_and_wgmma(shape, tmp_path: Path) -> None:
    """The kernel lowers for sm_90: the loader's tensor copies and the gathered chunk's plain
    loads, the consumers' wgmma and the mbarrier waits between them are in its machine
    code."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = tmp_path / "kernel"
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, *map(str, shape), str(out)], env=env,
        capture_output=True, text=True, timeout=300, check=False,
    )
    if proc.returncode == 77:
        pytest.skip("this Triton has no NVIDIA backend or no Gluon")
    assert proc.returncode == 0, proc.stderr[-3000:]
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "cuobjdump").exists():
        pytest.skip("this Triton ships no cuobjdump")
    sass = subprocess.run([str(tools / "cuobjdump"), "-sass", f"{out}.cubin"],
                          capture_output=True, text=True, timeout=120, check=True).stdout
    for op in ("UTMALDG", "HGMMA.64x", "SYNCS.PHASECHK", "LDG.E"):
        assert op in sass, op
