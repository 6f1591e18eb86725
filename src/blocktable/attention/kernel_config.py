"""What users tune in the Triton paged attention, and what is chosen for them from shapes.

:class:`KernelConfig` holds the tile sizes, warps, pipeline stages and split count of the two
kernels; :func:`default_config` picks them by head size. :class:`DecodeSchedule` is how the
decode kernel runs one shape (the split-KV combine, the block-id loads, the stages), chosen
by :func:`decode_schedule` from shapes only, never from a device value, so that a captured
CUDA graph stays valid. The measurements behind both rules are in BENCHMARKS.md
(``benchmarks/sweep_decode.py --quick`` re-checks the decode rule on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools

from blocktable._triton import interpreting, next_power_of_2

_INTERPRET = interpreting()
FUSED_COMBINE_MAX_PROGRAMS = 16  # num_reqs * num_kv_heads up to which the combine is fused
DECODE_LONG_SPLIT_KEYS = 2048  # keys per split (of the widest row) from which a split is long
PREFILL_KERNELS = ("auto", "gluon", "triton")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options of the prefill and decode kernels.

    Attributes
    ----------
    prefill_block_m : int
        Query rows (tokens x query heads of one KV head) per prefill tile; a power of two
        >= 16 (raised to the GQA group size rounded up to a power of two).
    prefill_block_n, decode_block_n : int
        Keys per tile; a power of two >= 16.
    prefill_num_warps, decode_num_warps : int
        Warps per program; a power of two.
    prefill_num_stages, decode_num_stages : int
        Software-pipeline stages of the key loop; >= 1.
    num_kv_splits : int or None
        Programs sharing a decode request's keys (flash-decoding), a power of two; ``None``:
        chosen from shapes (:func:`~blocktable.attention.triton_decode.default_num_kv_splits`).
    prefill_kernel : {"auto", "gluon", "triton"}
        Which prefill kernel runs: ``"auto"``, the Gluon kernel for Hopper
        (:mod:`~blocktable.attention.gluon_prefill`) where it serves the inputs, else the
        Triton kernel; ``"gluon"``, the Gluon kernel or a ``ValueError`` saying why not;
        ``"triton"``, the portable Triton kernel (the one the CPU interpreter runs). The
        ``prefill_*`` tile fields tune the Triton kernel only.
    """

    prefill_block_m: int = 128
    prefill_block_n: int = 64
    prefill_num_warps: int = 8
    prefill_num_stages: int = 3
    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    num_kv_splits: int | None = None
    prefill_kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(
                f"KernelConfig.prefill_kernel must be one of {PREFILL_KERNELS}, "
                f"got {self.prefill_kernel!r}"
            )
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "prefill_kernel" or field.name == "num_kv_splits" and value is None:
                continue
            if type(value) is not int or value < 1:
                raise ValueError(f"KernelConfig.{field.name} must be an int >= 1, got {value!r}")
            if field.name.endswith("_stages"):
                continue
            if value & (value - 1):
                raise ValueError(
                    f"KernelConfig.{field.name} must be a power of two, got {value}"
                )
            if field.name.endswith(("_block_m", "_block_n")) and value < 16:
                raise ValueError(f"KernelConfig.{field.name} must be >= 16, got {value}")


@functools.lru_cache(maxsize=64)
def default_config(head_dim: int, group_size: int, element_size: int = 2) -> KernelConfig:
    """The configuration used unless one is given, by head size (4-byte elements get smaller
    tiles, so that float32 tiles fit in shared memory)."""
    if _INTERPRET:  # small tiles: the interpreter's cost grows with tile area
        return KernelConfig(16 * max(1, next_power_of_2(group_size) // 4), 16, 4, 1, 16, 4, 1)
    block_d = max(16, next_power_of_2(head_dim))
    if element_size > 2:
        if block_d <= 128:
            return KernelConfig(64, 32, 4, 2, 32, 4, 2)
        return KernelConfig(32, 32, 4, 1, 16, 4, 2)
    if block_d <= 64:
        return KernelConfig(128, 64, 4, 3, 64, 4, 3)
    if block_d <= 128:
        return KernelConfig(128, 64, 8, 3, 64, 4, 2)
    return KernelConfig(64, 32, 4, 2, 32, 4, 2)


@dataclasses.dataclass(frozen=True)
class DecodeSchedule:
    """How the decode kernel runs one shape.

    Attributes
    ----------
    fused_combine : bool
        With more than one split: the last split program of each (request, KV head) to
        finish merges the partials (an atomic counter), so a decode step is one launch;
        ``False``: a combine kernel in a second launch.
    per_block_ids : bool
        Each tile loads one block id per block and broadcasts it over the block's keys (when
        the block size is a power of two dividing ``decode_block_n``); ``False``: each
        tile's ids (one per key) are prefetched while the tile before it computes.
    num_stages : int
        Software-pipeline stages of the key loop.
    """

    fused_combine: bool
    per_block_ids: bool
    num_stages: int


@functools.lru_cache(maxsize=256)
def decode_schedule(
    config: KernelConfig,
    splits: int,
    num_reqs: int,
    num_kv_heads: int,
    width_blocks: int,
    block_size: int,
    *,
    choose_stages: bool = True,
) -> DecodeSchedule:
    """The schedule of ``splits`` splits of rows of ``width_blocks`` blocks of ``block_size``
    keys, ``num_reqs`` requests of ``num_kv_heads`` KV heads: the combine is fused while the
    grid is small (few programs wait for the last split); ids per block for short splits
    (below ``DECODE_LONG_SPLIT_KEYS`` keys of the widest row), where the table loads dominate;
    3 stages for long fused splits (few programs, long loops) when ``choose_stages``, else
    ``config.decode_num_stages``. Reads shapes only."""
    split = splits > 1
    fused = split and num_reqs * num_kv_heads <= FUSED_COMBINE_MAX_PROGRAMS
    long_splits = width_blocks * block_size // splits >= DECODE_LONG_SPLIT_KEYS
    per_block = config.decode_block_n % block_size == 0 and not block_size & (block_size - 1)
    stages = config.decode_num_stages
    if choose_stages and fused and long_splits:
        stages = 3
    return DecodeSchedule(fused, split and per_block and not long_splits, stages)


@functools.lru_cache(maxsize=256)
def decode_rows(group_size: int) -> tuple[int, int, int]:
    """``(GROUP_PAD, BLOCK_M, BLOCK_Q)`` of the decode tile: the GQA group padded to a power
    of two, rows padded to 16 (``tl.dot``'s minimum), query tokens that fit."""
    group_pad = next_power_of_2(group_size)
    block_m = max(16, group_pad)
    return group_pad, block_m, block_m // group_pad
