"""The Gluon prefill kernel compiled for sm_90 without a GPU (Triton's bundled ptxas): the
loader's tensor copies and plain loads, the consumers' wgmma and the mbarrier waits between
them are in its machine code, for the default launch shape and others; the PTX pass leaves
the partitions' own register moves only, and the consumers' products are pipelined.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from blocktable.attention.gluon_prefill import CONSUMER_REGS
from blocktable.attention.gluon_ptx import KERNEL_NAME, make_hook, strip_idle_register_moves

ROOT = Path(__file__).resolve().parents[1]

COMPILE_SCRIPT = r'''
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type
if "nvidia" not in getattr(triton.backends, "backends", {}):
    sys.exit(77)
from blocktable.attention import gluon_prefill as ws  # (its import installs the PTX pass)
from blocktable.attention import prefill_launch as launch
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
queries = torch.empty(256, 32 * head_dim, dtype=torch.bfloat16)
q_layout = gl.NVMMASharedLayout.get_default_for([64, head_dim], gl.bfloat16)
q_desc = ws.TensorDescriptor(queries, list(queries.shape), list(queries.stride()),
                             [64 // group, head_dim], q_layout)
kernel = ws.gluon_prefill_kernel
consts = dict(GROUP=group, GROUP_PAD=group, BLOCK_Q=128 // group, BLOCK_N=block_n,
              HEAD_DIM=head_dim, BLOCK_SIZE=block_size, RADIX=launch.GLUON_SEARCH_RADIX,
              INDEXED=False, HAS_LSE=True, NUM_STAGES=stages, TMA_OUT=True)
pointers = {"out_ptr": "bf16", "lse_ptr": "fp32", "k_cache_ptr": "bf16",
            "v_cache_ptr": "bf16", "table_ptr": "i32", "seq_lens_ptr": "i32", "qsl_ptr": "i32",
            "row_of_batch_ptr": "i32", "work_ptr": "i32"}
signature, attrs = {}, {}
for i, name in enumerate(kernel.arg_names):
    if name in pointers:
        signature[name] = "*" + pointers[name]
        attrs[(i,)] = [["tt.divisibility", 16]]
    elif name in ("k_desc", "v_desc"):
        signature[name] = mangle_type(desc)
    elif name in ("q_desc", "o_desc"):
        signature[name] = mangle_type(q_desc)
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
with open(out + ".ptx", "w") as f:
    f.write(compiled.asm["ptx"])
'''


@pytest.mark.parametrize("shape", [
    # group, block_n, stages, head_dim, kernel block size: the default launch, then others
    (4, 64, 4, 128, 16), (8, 64, 3, 128, 256), (2, 128, 2, 64, 64),
], ids=lambda s: "g{}-n{}-s{}-d{}-b{}".format(*s))
def test_kernel_compiles_to_tma_and_wgmma(shape, tmp_path: Path) -> None:
    """The kernel lowers for sm_90: the loader's tensor copies, its work-item claims and the
    gathered chunk's plain loads, the consumers' wgmma, the mbarrier waits between them and
    the output's tensor copies and the consumers' per-warp vote on rescaling are in its
    machine code."""
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
    # (copies in and out, the work items' claims, wgmma, mbarrier waits, the gathered chunk,
    # the vote)
    for op in ("UTMALDG", "UTMASTG", "ATOMG.E.ADD", "HGMMA.64x", "SYNCS.PHASECHK", "LDG.E",
               "VOTE.ANY"):
        assert op in sass, op
    # The PTX pass left the partitions' own register moves only, and every warp of the launch
    # holds the .maxnreg the loader's and the consumers' budgets add up to.
    ptx = Path(f"{out}.ptx").read_text()
    moves = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx)
    maxnreg = int(re.search(r"^\.maxnreg (\d+)", ptx, re.MULTILINE).group(1))
    regs = CONSUMER_REGS
    assert sorted(moves) == [("dec", str(3 * maxnreg - 2 * regs)), ("inc", str(regs)),
                             ("inc", str(regs))], moves
    usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", f"{out}.cubin"],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"REG:{maxnreg}" in usage, usage
    if shape[1] == 64:  # the launcher's tiles: each product's wgmma steps follow each other
        hgmma, waits = sass.count("HGMMA."), sass.count("WARPGROUP.DEPBAR")
        assert 4 * waits <= hgmma, (hgmma, waits)


def test_ptx_pass_keeps_only_the_partitions_moves() -> None:
    """The pass drops the idle-state moves, keeps the loader's and the consumers', and leaves
    PTX of another shape alone (``None``)."""
    body = ("\tsetmaxnreg.inc.sync.aligned.u32 \t256;\n\tsetmaxnreg.dec.sync.aligned.u32 \t120;\n"
            "\tsetmaxnreg.inc.sync.aligned.u32 \t216;\n\tsetmaxnreg.inc.sync.aligned.u32 \t216;\n"
            "\tsetmaxnreg.dec.sync.aligned.u32 \t72;\n\tret;\n")
    ptx = ".reqntid 384\n.maxnreg 168\n" + body
    out = strip_idle_register_moves(ptx, 216)
    assert out is not None
    assert "\t256;" not in out and "\t120;" not in out
    assert out.count("u32 \t216;") == 2 and out.count("u32 \t72;") == 1 and "ret;" in out
    assert strip_idle_register_moves(body, 216) is None  # no .maxnreg
    assert strip_idle_register_moves(ptx, 232) is None  # budgets that do not add up
    assert strip_idle_register_moves(ptx.replace("\t72;", "\t64;"), 216) is None


def test_ptx_hook_patches_only_the_kernel_and_chains() -> None:
    """The hook wraps the PTX stage for the named kernel only, runs the hook installed before
    it, and adds its share to the cache key (Triton 3.7 on)."""
    ptx = (".maxnreg 168\n\tsetmaxnreg.dec.sync.aligned.u32 \t120;\n"
           "\tsetmaxnreg.inc.sync.aligned.u32 \t216;\n\tsetmaxnreg.inc.sync.aligned.u32 \t216;\n"
           "\tsetmaxnreg.dec.sync.aligned.u32 \t72;\n")
    calls = []

    def previous(*args):
        calls.append(len(args))
        return ("theirs", "d") if not args else None

    hook = make_hook(previous, 216)
    key, digest = hook()
    ours, our_digest = make_hook(None, 216)()
    assert key == "theirs" + ours and digest not in ("d", our_digest)
    for name, patched in ((KERNEL_NAME, True), ("another_kernel", False)):
        stages = {"ptx": lambda src, metadata, name=name: (metadata.update(name=name), ptx)[1]}
        hook(None, stages, None, None, 90)
        out = stages["ptx"](None, {})
        assert ("\t120;" not in out) == patched and out.count("\t216;") == 2
    assert calls == [0, 5, 5]
