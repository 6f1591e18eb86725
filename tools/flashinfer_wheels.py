"""Fetch FlashInfer wheels small enough to carry to a machine without network access.

FlashInfer 0.2.14 is published only as a source archive: it is built here into a pure-Python
wheel (its kernels are JIT-compiled where it runs). FlashInfer 0.7.4's wheel is ~100 MB, mostly
CUDA sources of kernels this project never calls; the slim copy keeps every Python module (so
``import flashinfer`` works as released), the headers it compiles against, and only the
top-level ``data/csrc`` files, which is where its batch decode and prefill JIT sources live.
``apache-tvm-ffi`` is its one import-time need not already on the device image.

    python tools/flashinfer_wheels.py DEST            # DEST/fi02/*.whl and DEST/fi07/*.whl

Each folder is installed on its own (two versions of one package stop an install)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DEST/fi02/*.whl
"""

from __future__ import annotations

import base64
import hashlib
import pathlib
import subprocess
import sys
import tempfile
import zipfile

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


# The packages that `import flashinfer, flashinfer.decode, flashinfer.prefill` loads (0.7.4);
# every Python file in them is kept, the rest of its ~110 MB of Python is not.
IMPORTED_PACKAGES = frozenset({
    "flashinfer", "flashinfer/attention", "flashinfer/attn_scores", "flashinfer/autotuner",
    "flashinfer/cake_causal_conv1d_det_train_backend", "flashinfer/cake_gated_act_mxfp8_backend",
    "flashinfer/cake_gdp_backend", "flashinfer/cake_mhc_det_train_backend",
    "flashinfer/cake_mhc_det_train_head_backend", "flashinfer/cake_muse_spark_norm_backend",
    "flashinfer/cake_rmsnorm_det_train_backend",
    "flashinfer/cake_rmsnorm_silu_gate_det_train_backend",
    "flashinfer/cake_rmsnorm_silu_gate_train_backend", "flashinfer/cake_rmsnorm_train_backend",
    "flashinfer/cudnn", "flashinfer/cute_dsl", "flashinfer/cutile", "flashinfer/experimental",
    "flashinfer/experimental/cake_nvfp4_per_token", "flashinfer/fused_moe",
    "flashinfer/fused_moe/backends", "flashinfer/fused_moe/backends/cudnn_frost",
    "flashinfer/fused_moe/backends/cudnn_frost/bf16",
    "flashinfer/fused_moe/backends/cudnn_frost/mxfp8",
    "flashinfer/fused_moe/backends/cudnn_frost/mxfp8_mxfp4",
    "flashinfer/fused_moe/backends/cudnn_frost/nvfp4",
    "flashinfer/fused_moe/backends/frost_low_latency",
    "flashinfer/fused_moe/backends/frost_low_latency/fma", "flashinfer/fused_moe/backends/trtllm",
    "flashinfer/fused_moe/cute_dsl", "flashinfer/fused_moe/shared", "flashinfer/gdn_kernels",
    "flashinfer/gdn_kernels/blackwell", "flashinfer/gdn_kernels/delta_rule_dsl",
    "flashinfer/gdn_kernels/experimental", "flashinfer/gemm", "flashinfer/gemm/kernels",
    "flashinfer/gemm/kernels/native_bf16_fp4", "flashinfer/grouped_mm",
    "flashinfer/grouped_mm/cudnn", "flashinfer/grouped_mm/cute_sm120_fp8_groupwise",
    "flashinfer/grouped_mm/cute_sm120_mxfp8_groupwise", "flashinfer/jit",
    "flashinfer/jit/attention", "flashinfer/jit/attention/fmha_v2", "flashinfer/jit/gemm",
    "flashinfer/jit/gemm/cutlass", "flashinfer/jit/mamba", "flashinfer/kda_kernels",
    "flashinfer/kda_kernels/sm120_prefill", "flashinfer/mamba", "flashinfer/megamoe",
    "flashinfer/mla", "flashinfer/mla/_batch_mla", "flashinfer/mla/_batch_mla/_backends",
    "flashinfer/msa_ops", "flashinfer/norm", "flashinfer/prims_ts", "flashinfer/prims_ts/gemm",
    "flashinfer/quantization", "flashinfer/topk_varlen", "flashinfer/trace",
    "flashinfer/trace/templates",
})


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download_binary(dest: pathlib.Path, requirement: str) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
        "--implementation", "cp", *platforms, "-d", str(dest), requirement)


def keep_in_slim_07(name: str) -> bool:
    """Whether a member of the 0.7 wheel is needed to import it and JIT its attention."""
    if ".dist-info/" in name:
        return not name.endswith("RECORD")
    if name.endswith((".py", ".json", ".typed")):
        return name.rpartition("/")[0] in IMPORTED_PACKAGES or name.startswith("flashinfer/jit/")
    for folder in ("include", "cutlass/include", "cutlass/tools", "cccl", "spdlog"):
        if name.startswith(f"flashinfer/data/{folder}/"):
            return True
    rest = name.removeprefix("flashinfer/data/csrc/")
    return rest != name and "/" not in rest


def slim_wheel(source: pathlib.Path, target: pathlib.Path) -> None:
    """Copy the members ``keep_in_slim_07`` keeps, with a RECORD of their hashes."""
    record: list[str] = []
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(
        target, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9
    ) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.is_dir() or not keep_in_slim_07(info.filename):
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{info.filename},sha256={digest.decode()},{len(data)}")
        record.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(record) + "\n")


def main() -> int:
    dest = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".whl")
    fi02, fi07 = dest / "fi02", dest / "fi07"
    fi02.mkdir(parents=True, exist_ok=True)
    fi07.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "--no-deps", "--no-binary=flashinfer-python", "-d", tmp,
            "flashinfer-python==0.2.14.post1")
        sdist = next(pathlib.Path(tmp).glob("flashinfer_python-*.tar.gz"))
        pip("wheel", "--no-deps", "-w", str(fi02), str(sdist))
        download_binary(pathlib.Path(tmp), "flashinfer-python==0.7.4")
        full = next(pathlib.Path(tmp).glob("flashinfer_python-0.7.4-*.whl"))
        slim_wheel(full, fi07 / full.name)
    download_binary(fi07, "apache-tvm-ffi==0.1.15.post2")
    for path in sorted(dest.glob("*/*.whl")):
        print(f"{path.stat().st_size / 2**20:6.1f} MiB  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
