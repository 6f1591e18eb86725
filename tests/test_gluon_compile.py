"""The Gluon prefill kernel compiled for sm_90 without a GPU (Triton's bundled ptxas), and its
machine code checked for the hazard that made the pipelined loop write NaN rows.

In the pipelined loop the ``P @ V`` wgmma of tile ``i`` reads P from registers while the
softmax of tile ``i + 1`` runs; a wgmma reads its register operands until the wait that retires
it. The check: in the SASS, no instruction writes P's registers between that wgmma and the
``WARPGROUP.DEPBAR.LE gsb0, 0x0`` that retires it (the loop's end, then its head up to the wait).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COMPILE_SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
if "nvidia" not in getattr(triton.backends, "backends", {}):
    sys.exit(77)
from blocktable.attention import gluon_prefill
if not gluon_prefill.HAS_GLUON:
    sys.exit(77)
try:
    from triton.experimental.gluon._runtime import GluonASTSource
except ImportError:
    sys.exit(77)

kernel = gluon_prefill.gluon_prefill_kernel
group, block_m, block_n, stages, warps, head_dim, out = sys.argv[1:]
group, block_m, block_n, stages, warps, head_dim = map(
    int, (group, block_m, block_n, stages, warps, head_dim))
consts = dict(GROUP=group, GROUP_PAD=group, BLOCK_M=block_m, BLOCK_Q=block_m // group,
              BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_SIZE=16, RADIX=16, INDEXED=False,
              HAS_LSE=True, NUM_STAGES=stages, PIPELINED=True, num_warps=warps)
pointers = {"out_ptr": "bf16", "lse_ptr": "fp32", "query_ptr": "bf16", "k_cache_ptr": "bf16",
            "v_cache_ptr": "bf16", "table_ptr": "i32", "seq_lens_ptr": "i32", "qsl_ptr": "i32",
            "row_of_batch_ptr": "i32"}
signature, attrs = {}, {}
for i, name in enumerate(kernel.arg_names):
    if name in pointers:
        signature[name] = "*" + pointers[name]
        attrs[(i,)] = [["tt.divisibility", 16]]
    elif name in consts:
        signature[name] = "constexpr"
    elif name == "qk_scale":
        signature[name] = "fp32"
    else:
        signature[name] = "i32"
        if "stride" in name and name != "table_stride_c":  # as the launcher's checks ask
            attrs[(i,)] = [["tt.divisibility", 16]]
# PTX 8.8, which the CUDA 12 ptxas (Triton 3.6's for sm_90) takes as well as Triton's own.
compiled = triton.compile(GluonASTSource(kernel, signature, consts, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "ptx_version": 88})
with open(out + ".cubin", "wb") as f:
    f.write(compiled.asm["cubin"])
with open(out + ".ptx", "w") as f:
    f.write(compiled.asm["ptx"])
'''


WS_COMPILE_SCRIPT = r'''
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
if "nvidia" not in getattr(triton.backends, "backends", {}):
    sys.exit(77)
from blocktable.attention import gluon_prefill_ws as ws
if not ws.HAS_GLUON_WS:
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
kernel = ws.gluon_ws_prefill_kernel
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


def p_writes_before_retiring_wait(sass: str) -> tuple[list[int], list[str]]:
    """P's registers (the A operands of the loop's register-A wgmma) and every instruction
    that writes one of them while that wgmma may still run."""
    code = [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    p_regs: set[int] = set()
    last = None
    for k, (_, ins) in enumerate(code):
        m = re.match(r"HGMMA\.64x\d+x\d+\.F32\.\w+ R\d+, R(\d+),", ins)
        if m:  # a register A operand spans 4 registers per k-step
            p_regs |= {int(m.group(1)) + r for r in range(4)}
            last = k
    assert last is not None, "no wgmma with a register operand: the loop changed shape"
    after = code[last + 1:]
    back = next(i for i, (_, ins) in enumerate(after)
                if (m := re.search(r"BRA 0x([0-9a-f]+)", ins)) and int(m.group(1), 16) < code[last][0])
    head = int(re.search(r"BRA 0x([0-9a-f]+)", after[back][1]).group(1), 16)
    window = after[:back]  # the rest of this iteration
    start = next(k for k, (addr, _) in enumerate(code) if addr == head)
    for item in code[start:]:  # the next iteration, up to the wait that retires the wgmma
        if item[1].startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"):
            break
        window.append(item)
    hits = [f"{addr:04x} {ins}" for addr, ins in window
            if (m := re.match(r"(?:@!?U?P\w+ )?[A-Z][\w.]* R(\d+)\b", ins))
            and int(m.group(1)) in p_regs]
    return sorted(p_regs), hits


def test_the_checker_sees_a_write_to_p_before_the_wait() -> None:
    sass = """
        /*0100*/  FMNMX R20, R8, R9, !PT ;
        /*0110*/  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0120*/  F2FP.BF16.F32.PACK_AB R20, R9, R8 ;
        /*0130*/  HGMMA.64x64x16.F32.BF16 R0, R20, gdesc[UR8].tnspB, R0, gsb0 ;
        /*0140*/  WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0150*/  @P1 BRA 0x100 ;
    """
    regs, hits = p_writes_before_retiring_wait(sass)
    assert regs == [20, 21, 22, 23]
    assert hits == ["0100 FMNMX R20, R8, R9, !PT"]  # the pack after the wait is fine
    regs, hits = p_writes_before_retiring_wait(sass.replace("FMNMX R20", "FMNMX R30"))
    assert hits == []


@pytest.mark.parametrize("shape", [
    # group, block_m, block_n, stages, warps, head_dim: the default launch and the sweep's
    (4, 128, 64, 3, 8, 128), (4, 128, 32, 4, 8, 128), (4, 64, 64, 3, 4, 128), (2, 128, 64, 3, 8, 32),
], ids=lambda s: "g{}-m{}-n{}-s{}-w{}-d{}".format(*s))
def test_pipelined_loop_keeps_p_until_its_wgmma_retires(shape, tmp_path: Path) -> None:
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
    if not (tools / "cuobjdump").exists() or not (tools / "ptxas").exists():
        pytest.skip("this Triton ships no cuobjdump or ptxas")
    # Triton's cubin (its newest ptxas) and the same PTX through the CUDA 12 ptxas: the
    # register allocator of the latter reused P's registers in flight before the fix.
    cuda12 = tmp_path / "cuda12.cubin"
    subprocess.run([str(tools / "ptxas"), "-arch=sm_90a", f"{out}.ptx", "-o", str(cuda12)],
                   capture_output=True, text=True, timeout=300, check=True)
    for cubin in (Path(f"{out}.cubin"), cuda12):
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, timeout=120, check=True).stdout
        regs, hits = p_writes_before_retiring_wait(sass)
        assert not hits, f"{cubin.name}: P in R{regs[0]}-R{regs[-1]} overwritten: {hits[:5]}"


@pytest.mark.parametrize("shape", [
    # group, block_n, stages, head_dim, kernel block size
    (4, 128, 2, 128, 16), (8, 64, 3, 128, 256), (2, 128, 2, 64, 64),
], ids=lambda s: "g{}-n{}-s{}-d{}-b{}".format(*s))
def test_warp_specialized_kernel_compiles_to_tma_and_wgmma(shape, tmp_path: Path) -> None:
    """The warp-specialized kernel lowers for sm_90: the loader's tensor copies, the
    consumers' wgmma and the mbarrier waits between them are in its machine code."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = tmp_path / "kernel"
    proc = subprocess.run(
        [sys.executable, "-c", WS_COMPILE_SCRIPT, *map(str, shape), str(out)], env=env,
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
