"""Host side of the Triton paged attention: configurations, workspace, one launch path.

Everything here depends on tensor shapes only (never on values held on the device), so the
launches can be captured in a CUDA graph, and the cached :class:`~blocktable._triton.Launcher`
keeps the host work per call to a few microseconds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from blocktable._triton import HAS_TRITON, Launcher, cdiv, interpreting, next_power_of_2
from blocktable.attention.split_rule import DECODE_LONG_SPLIT_KEYS, FUSED_COMBINE_MAX_PROGRAMS
from blocktable.attention.triton_tiles import LOG2_E

if HAS_TRITON:
    from blocktable.attention import triton_decode as _dec
    from blocktable.attention import triton_prefill as _pre
    from blocktable.attention.triton_tiles import HAS_WS_RANGE
else:
    HAS_WS_RANGE = False

SEARCH_RADIX = 16
PAD_ITERS = 16
_INTERPRET = interpreting()


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and schedules of the two kernels (see :func:`default_config`)."""

    prefill_block_m: int = 128  # query rows (tokens x GQA group) per prefill tile
    prefill_block_n: int = 64  # keys per tile
    prefill_num_warps: int = 8
    prefill_num_stages: int = 3
    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    num_kv_splits: int | None = None  # None: chosen from shapes (default_num_kv_splits)
    # Variants of the inner loop (attend_tiles), one compilation each:
    # ids_mode 0: each tile's block ids are prefetched one tile ahead (loop-carried);
    # 1: loaded in the tile's own iteration, one per key (the pipeliner schedules them);
    # 2: as 1, one id per block broadcast over its keys (when the block size is a power of
    # two dividing block_n; else 1).
    prefill_ids_mode: int = 0
    decode_ids_mode: int = 0
    # fa_loop: the softmax scale in one FMA per score and P @ V accumulated into the rescaled
    # accumulator in place; False: the original order (scores scaled, then a separate add).
    prefill_fa_loop: bool = True
    decode_fa_loop: bool = True
    # pack_gqa: a prefill tile is BLOCK_M // GROUP_PAD tokens x the query heads of one KV head
    # (one K/V read serves the group); False: BLOCK_M tokens of one query head.
    prefill_pack_gqa: bool = True
    # decode_wide_combine: the combine kernel loads MERGE_CHUNK splits of a head at once;
    # False: one split after the other. (Without a configuration given, the decode options
    # are chosen from shapes: see default_decode_config.)
    decode_wide_combine: bool = False
    # decode_fused_combine: no combine launch; the last split program of each (request, KV
    # head) to finish (an atomic counter) merges the partials, every head of the group per
    # load: one launch per decode step saves a launch's host time and the gap between two
    # kernels on the device.
    decode_fused_combine: bool = True
    # decode_single_loop: the decode kernel's own inner loop (attend_decode_tiles: one masked
    # loop, each tile's V loaded beside its K, block ids per tile: ids_mode 2 where it applies,
    # else 1); False: the loop shared with the prefill kernel (attend_segments).
    decode_single_loop: bool = False
    # Prefill loop options (with either of the first two, block ids are read in each tile's
    # iteration, ids_mode 0 meaning 1, in the FMA loop order):
    # prefill_prescale_q: q multiplied by scale * log2(e) once, before the loop (scores leave
    # the product in the log2 domain);
    prefill_prescale_q: bool = False
    # prefill_warp_specialize: Triton's warp-specialized loops (tl.range(warp_specialize=True),
    # Triton >= 3.4; how much of it a backend implements depends on the GPU and version):
    # 0 none, 1 every loop, 2 only the loop over unmasked tiles;
    prefill_warp_specialize: int = 0
    # prefill_pair_tiles: each program runs query tiles j and n - 1 - j of its request, so
    # that every program of a causal prefill has the same work (half as many programs).
    prefill_pair_tiles: bool = False
    # prefill_search_radix: lanes per level of the device search for a program's request (a
    # power of two >= 2); one level serves up to radix - 1 requests.
    prefill_search_radix: int = SEARCH_RADIX


@functools.lru_cache(maxsize=64)
def default_config(head_dim: int, group_size: int, element_size: int = 2) -> KernelConfig:
    """The configuration used unless one is given, by head size (and 4-byte elements:
    smaller tiles, so that float32 tiles fit in shared memory)."""
    if _INTERPRET:  # small tiles: the interpreter's cost grows with tile area
        return KernelConfig(16 * max(1, next_power_of_2(group_size) // 4), 16, 4, 1, 16, 4, 1)
    block_d = max(16, next_power_of_2(head_dim))
    if element_size > 2:
        if block_d <= 64:
            return KernelConfig(64, 32, 4, 2, 32, 4, 2)
        if block_d <= 128:
            return KernelConfig(64, 32, 4, 2, 32, 4, 2)
        return KernelConfig(32, 32, 4, 1, 16, 4, 2)
    if block_d <= 64:
        return KernelConfig(128, 64, 4, 3, 64, 4, 3)
    if block_d <= 128:
        return KernelConfig(128, 64, 8, 3, 64, 4, 2)
    return KernelConfig(64, 32, 4, 2, 32, 4, 2)


# The decode options of the default configuration, chosen from shapes (H200, bf16, 32 query /
# 8 KV heads, head dim 128, page 16, graph-replayed µs, three sweeps on 2026-11-30):
# - the fused combine wins only at small batch: B=1 x 8192 (32 splits) 17.1 fused vs 22.8
#   loop, 22.7 wide; B=1 x 131072 135.3 fused vs 160.9 loop; but B=8 x 32768 (8 splits) 306.0
#   fused vs 256.3 wide (2 stages, ids 0). So fused while num_reqs * num_kv_heads <= 16, else
#   the wide combine;
# - block ids per block (ids_mode 2) win when splits are short: B=1 x 8192 (256 keys a split)
#   15.1 vs 17.5 with ids 0; with long splits they lose: B=1 x 131072 (4096 keys a split)
#   146.3 vs 135.3, and unsplit B=64 x 4096 329.2 vs 247.3. So ids 2 below
#   DECODE_LONG_SPLIT_KEYS keys a split (of the widest row), else 0;
# - 3 stages win with long splits at small batch (few programs): B=1 x 131072 135.3 vs 158.8
#   with 2; they lose with short splits (B=1 x 8192 15.9 vs 15.1) and with many programs
#   (B=8 x 32768, 512 programs: 315.1 vs 256.3). So 3 for long splits while the combine is
#   fused, else the stages of default_config;
# - more than 32 splits lose (B=1 x 131072: 153.8 at 64 splits vs 146.3 at 32, same options),
#   see triton_decode.MAX_KV_SPLITS.


@functools.lru_cache(maxsize=256)
def default_decode_config(
    base: KernelConfig, splits: int, num_reqs: int, num_kv_heads: int, width: int,
    block_size: int,
) -> KernelConfig:
    """``base`` (a :func:`default_config`) with the decode options chosen from shapes only (the
    rule and its measurements are in the comment above): the combine, the block-id loads and
    the pipeline stages for ``splits`` splits of rows of ``width`` blocks of ``block_size``
    keys, ``num_reqs`` requests of ``num_kv_heads`` KV heads. Never reads a device value."""
    split = splits > 1
    fused = split and num_reqs * num_kv_heads <= FUSED_COMBINE_MAX_PROGRAMS
    long_splits = width * block_size // splits >= DECODE_LONG_SPLIT_KEYS
    per_block = base.decode_block_n % block_size == 0 and not block_size & (block_size - 1)
    stages = 3 if fused and long_splits else base.decode_num_stages
    return dataclasses.replace(
        base, decode_fused_combine=fused, decode_wide_combine=split and not fused,
        decode_ids_mode=2 if split and per_block and not long_splits else 0,
        decode_num_stages=stages,
    )


@functools.lru_cache(maxsize=256)
def _ids_mode(mode: int, block_n: int, block_size: int) -> int:
    """``mode``, or 1 where one id per block does not apply (see :class:`KernelConfig`)."""
    if mode not in (0, 1, 2):
        raise ValueError(f"ids_mode must be 0, 1 or 2, got {mode}")
    if mode == 2 and (block_n % block_size or block_size & (block_size - 1)):
        return 1
    return mode


@dataclasses.dataclass(frozen=True)
class CPLayout:
    """Where this rank's keys sit (see :mod:`blocktable.attention.cp_layout`)."""

    world_size: int = 1
    rank: int = 0
    interleave: int = 1
    block_size: int = 1  # the manager block size: the unit of ownership


@functools.lru_cache(maxsize=256)
def decode_rows(group_size: int) -> tuple[int, int, int]:
    """``(GROUP_PAD, BLOCK_M, BLOCK_Q)`` of the decode tile: the GQA group padded to a power
    of two, rows padded to 16 (``tl.dot``'s minimum), query tokens that fit."""
    group_pad = next_power_of_2(group_size)
    block_m = max(16, group_pad)
    return group_pad, block_m, block_m // group_pad


@functools.lru_cache(maxsize=256)
def _tile_sizes(head_dim: int, group_size: int) -> tuple[int, int, int, int]:
    """``(BLOCK_D, GROUP_PAD, decode BLOCK_M, decode BLOCK_Q)``."""
    return (max(16, next_power_of_2(head_dim)), *decode_rows(group_size))


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 arrival counters of the fused combine, per (device, size); the kernel
    leaves them at zero. Never freed (a captured CUDA graph may hold their address)."""
    key = (device, size)
    found = _COUNTERS.get(key)
    if found is None:
        found = _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return found


def _workspace(
    device: torch.device, slots: int, num_heads: int, splits: int, block_d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV partials, allocated once per (device, shape) and reused by every call. Never
    freed: a captured CUDA graph may hold their addresses."""
    key = (device, slots, num_heads, splits, block_d)
    found = _WORKSPACES.get(key)
    if found is None:
        part_o = torch.empty((slots, num_heads, splits, block_d), dtype=torch.float32,
                             device=device)
        part_lse = torch.empty((slots, num_heads, splits), dtype=torch.float32, device=device)
        found = _WORKSPACES[key] = (part_o, part_lse)
    return found


@functools.lru_cache(maxsize=4096)
def _search_stride(num_reqs: int, radix: int = SEARCH_RADIX) -> int:
    """``radix ** (levels - 1)`` for a search over ``num_reqs + 1`` start offsets."""
    stride = 1
    while stride * radix < num_reqs + 1:
        stride *= radix
    return stride


def _dynamic_positions(kernel: object, names: tuple[str, ...]) -> tuple[int, ...]:
    arg_names = list(kernel.arg_names)  # type: ignore[attr-defined]
    return tuple(arg_names.index(n) for n in names)


if HAS_TRITON:
    _prefill_launch = Launcher(
        _pre.prefill_kernel, _dynamic_positions(_pre.prefill_kernel, _pre.PREFILL_DYNAMIC_ARGS)
    )
    _prefill_launch_unaligned = Launcher(
        _pre.prefill_kernel_unaligned,
        _dynamic_positions(_pre.prefill_kernel_unaligned, _pre.PREFILL_DYNAMIC_ARGS),
    )
    _decode_launch = Launcher(
        _dec.decode_kernel, _dynamic_positions(_dec.decode_kernel, _dec.DECODE_DYNAMIC_ARGS)
    )
    _decode_launch_unaligned = Launcher(
        _dec.decode_kernel_unaligned,
        _dynamic_positions(_dec.decode_kernel_unaligned, _dec.DECODE_DYNAMIC_ARGS),
    )
    _combine_launch = Launcher(
        _dec.combine_kernel, _dynamic_positions(_dec.combine_kernel, _dec.COMBINE_DYNAMIC_ARGS)
    )

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class DecodePlan:
    """Everything the decode launch (and its split-KV combine) takes that depends on shapes,
    strides, dtypes and options only, worked out once: the grid, the workspace, the arguments
    after the tensors, and, after the first call, launch functions bound to the compiled
    kernels (no per-call key). :meth:`run` is the whole host work of a call on tensors with
    the metadata the plan was built from (the caller keys plans by that metadata)."""

    def __init__(
        self,
        grid: tuple[int, int, int],
        combine_grid: tuple[int, int, int] | None,
        workspace: tuple[torch.Tensor, torch.Tensor] | None,
        counters: torch.Tensor | None,
        tail: tuple[object, ...],
        combine_tail: tuple[object, ...],
        num_warps: int,
    ) -> None:
        self.grid = grid
        self.combine_grid = combine_grid  # None: one split, or the fused combine
        self.workspace = workspace  # float32 (part_o, part_lse) on the device, or None
        self.counters = counters  # int32 arrival counters of the fused combine, or None
        self.tail = tail  # decode kernel arguments after the tensors
        self.combine_tail = combine_tail
        self.num_warps = num_warps
        # [aligned decode, unaligned decode, combine] bound launch functions, once compiled
        self._bound: list[Callable[..., None] | None] = [None, None, None]

    @classmethod
    def build(
        cls,
        out: torch.Tensor,
        lse_out: torch.Tensor | None,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        row_of_batch: torch.Tensor | None,
        scale: float,
        sliding_window: int | None,
        cp: CPLayout,
        *,
        decode_only: bool,
        config: KernelConfig | None = None,
        num_kv_splits: int | None = None,
        strides: tuple[int, ...] | None = None,
    ) -> DecodePlan | None:
        """The plan of checked inputs (``strides``: those of :func:`_strides`, when known), or
        ``None`` when no decode program runs."""
        num_tokens, num_heads, head_dim = query.shape
        num_reqs = seq_lens.shape[0]
        has_qsl = query_start_loc is not None
        block_d, group_pad, dec_m, dec_q = _tile_sizes(head_dim, num_heads // k_cache.shape[2])
        # With qsl, programs num_reqs, ... zero the pad tokens when the prefill kernel does not
        # run.
        extra = cdiv(num_tokens, PAD_ITERS * dec_q) if has_qsl and decode_only else 0
        if num_tokens == 0 or num_reqs + extra == 0:
            return None
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        num_rows, width = block_table.shape
        group = num_heads // num_kv_heads
        given = config is not None
        if config is None:
            config = default_config(head_dim, group, query.element_size())
        splits = num_kv_splits or config.num_kv_splits or _dec.default_num_kv_splits(
            num_reqs, num_kv_heads, width, query.device, block_size
        )
        splits = splits if num_reqs > 0 else 1
        if not given:  # a caller's configuration is taken as given
            config = default_decode_config(config, splits, num_reqs, num_kv_heads, width,
                                           block_size)
        dec_ids = _ids_mode(config.decode_ids_mode, config.decode_block_n, block_size)
        split = splits > 1
        slots = dec_q if has_qsl else 1
        workspace = None
        if split:
            workspace = _workspace(query.device, num_reqs * slots, num_heads, splits, block_d)
        fused = split and config.decode_fused_combine
        counters = _counters(query.device, num_reqs * num_kv_heads) if fused else None
        has_lse = lse_out is not None
        lse_strides = lse_out.stride() if lse_out is not None else (0, 0)
        if strides is None:
            strides = _strides(out, lse_out, query, k_cache, v_cache, block_table)
        window = sliding_window or 0
        dtype = _DTYPE_NAMES[query.dtype]
        chunk = _dec.merge_chunk(group_pad, block_d)
        tail = (
            scale * LOG2_E, window, num_reqs, num_tokens, splits, splits, num_blocks, num_rows,
            width, cp.world_size, cp.rank, cp.interleave, cp.block_size, *strides,
            group, group_pad, dec_m, dec_q, slots, PAD_ITERS, config.decode_block_n, head_dim,
            block_d, block_size, has_qsl, row_of_batch is not None, cp.world_size > 1,
            window > 0, has_lse, split, _INTERPRET and dtype != "fp32", config.decode_num_stages,
            dec_ids, config.decode_fa_loop, fused, chunk, config.decode_single_loop,
            # One offset computation for K and V: measured faster with the fused combine
            # (B=1 x 8192: 14.8 vs 15.1 µs, x 131072: 131.6 vs 133.6 on an H200) and slower
            # without it (B=8 x 32768: 317 vs 255), so only there.
            fused and k_cache.stride() == v_cache.stride(), dtype,
        )
        combine_grid = None
        combine_tail: tuple[object, ...] = ()
        if split and not fused:
            combine_grid = (num_reqs * slots, num_kv_heads, 1)
            combine_tail = (
                splits, splits, *out.stride(), *lse_strides, group, group_pad, dec_q, slots,
                head_dim, block_d, has_qsl, has_lse, config.decode_wide_combine, chunk, dtype,
            )
        return cls(
            (num_reqs + extra, num_kv_heads, splits), combine_grid, workspace, counters, tail,
            combine_tail, config.decode_num_warps,
        )

    def run(
        self,
        out: torch.Tensor,
        lse_out: torch.Tensor | None,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        row_of_batch: torch.Tensor | None,
        aligned: bool,
        bind: bool = True,
    ) -> None:
        """Launch on tensors with the plan's metadata (``aligned``: the data pointers of
        ``query``, the caches and ``out`` are multiples of 16 bytes; ``bind``: bind the
        launches for the next call, when the plan is kept)."""
        lse_arg = seq_lens if lse_out is None else lse_out  # never read without HAS_LSE
        qsl_arg = seq_lens if query_start_loc is None else query_start_loc
        rob_arg = seq_lens if row_of_batch is None else row_of_batch
        part_o, part_lse = (out, out) if self.workspace is None else self.workspace
        counters = seq_lens if self.counters is None else self.counters
        args = (
            out, lse_arg, part_o, part_lse, counters, query, k_cache, v_cache, block_table,
            seq_lens, qsl_arg, rob_arg, *self.tail,
        )
        which = 0 if aligned else 1
        launch = self._bound[which]
        if launch is not None:
            launch(self.grid, *args)
        else:
            launcher = _decode_launch if aligned else _decode_launch_unaligned
            launcher(self.grid, *args, num_warps=self.num_warps)
            if bind:
                self._bound[which] = launcher.bind(args, self.num_warps)
        if self.combine_grid is None:
            return
        args = (out, lse_arg, part_o, part_lse, qsl_arg, *self.combine_tail)
        launch = self._bound[2]
        if launch is not None:
            launch(self.combine_grid, *args)
        else:
            _combine_launch(self.combine_grid, *args, num_warps=4)
            if bind:
                self._bound[2] = _combine_launch.bind(args, 4)


def _strides(
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
) -> tuple[int, ...]:
    lse_strides = lse_out.stride() if lse_out is not None else (0, 0)
    return (*out.stride(), *lse_strides, *query.stride(), *k_cache.stride(), *v_cache.stride(),
            *block_table.stride())


def launch_paged_attention(
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    row_of_batch: torch.Tensor | None,
    scale: float,
    sliding_window: int | None,
    cp: CPLayout,
    *,
    decode_only: bool,
    prefill_only: bool = False,
    config: KernelConfig | None = None,
    num_kv_splits: int | None = None,
) -> None:
    """Launch the kernels on checked inputs.

    ``query_start_loc`` ``None`` means one query per request (token ``r`` of request ``r``).
    ``decode_only``: every request has at most ``decode_rows(group)[2]`` query tokens, so the
    prefill kernel is not launched (it is, for the pad tokens, only when there are some).
    ``prefill_only``: the decode kernel is not launched and the prefill kernel serves every
    request, short ones included (ignored with ``decode_only``).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0:
        return
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_rows, width = block_table.shape
    group = num_heads // num_kv_heads
    given = config
    if config is None:
        config = default_config(head_dim, group, query.element_size())
    block_d, group_pad, _, dec_q = _tile_sizes(head_dim, group)
    # Checked before any launch, so that a bad configuration writes nothing (DecodePlan.build
    # checks the decode ids mode).
    pre_ids = _ids_mode(config.prefill_ids_mode, config.prefill_block_n, block_size)
    radix = config.prefill_search_radix
    if radix < 2 or radix & (radix - 1):
        raise ValueError(f"prefill_search_radix must be a power of two >= 2, got {radix}")
    if config.prefill_warp_specialize not in (0, 1, 2):
        raise ValueError(
            f"prefill_warp_specialize must be 0, 1 or 2, got {config.prefill_warp_specialize}"
        )
    if config.prefill_warp_specialize and not HAS_WS_RANGE and not decode_only:
        raise ValueError(
            "prefill_warp_specialize needs tl.range(warp_specialize=...) (Triton >= 3.4)"
        )
    dtype = _DTYPE_NAMES[query.dtype]
    dot_fp32 = _INTERPRET and dtype != "fp32"
    has_lse = lse_out is not None
    lse_arg = lse_out if lse_out is not None else seq_lens  # never read without HAS_LSE
    indexed = row_of_batch is not None
    rob_arg = row_of_batch if row_of_batch is not None else seq_lens
    qsl_arg = query_start_loc if query_start_loc is not None else seq_lens
    has_cp = cp.world_size > 1
    window = sliding_window or 0
    qk_scale = scale * LOG2_E
    pointers = k_cache.data_ptr() | v_cache.data_ptr() | query.data_ptr() | out.data_ptr()
    aligned = pointers % 16 == 0  # else the compilation that assumes nothing
    strides = _strides(out, lse_out, query, k_cache, v_cache, block_table)
    cp_args = (cp.world_size, cp.rank, cp.interleave, cp.block_size)

    prefill_only = prefill_only and not decode_only
    plan = None if prefill_only else DecodePlan.build(
        out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc, row_of_batch,
        scale, sliding_window, cp, decode_only=decode_only, config=given,
        num_kv_splits=num_kv_splits, strides=strides,
    )
    if plan is not None:
        plan.run(out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                 row_of_batch, aligned, bind=False)
    if decode_only:
        return
    pack = config.prefill_pack_gqa
    if pack:
        block_m = max(config.prefill_block_m, group_pad)
        block_q = block_m // group_pad
    else:
        block_m = block_q = max(config.prefill_block_m, 16)
    # Prescaled q and warp-specialized loops read each tile's block ids in its own iteration
    # (ids mode 0 becomes 1) and take the FMA loop order.
    new_loop = bool(config.prefill_prescale_q or config.prefill_warp_specialize)
    loop_ids = 1 if new_loop and pre_ids == 0 else pre_ids
    slot_q = 2 * block_q if config.prefill_pair_tiles else block_q  # tokens per program
    launch = _prefill_launch if aligned else _prefill_launch_unaligned
    launch(
        (cdiv(num_tokens, slot_q) + num_reqs, num_kv_heads if pack else num_heads),
        out, lse_arg, query, k_cache, v_cache, block_table, seq_lens, qsl_arg, rob_arg,
        qk_scale, window, num_reqs, num_tokens,
        0 if prefill_only or num_reqs == 0 else dec_q,  # requests this short: the decode kernel's
        num_blocks,
        num_rows, width, *cp_args, _search_stride(num_reqs, radix), *strides,
        group, group_pad, block_m, block_q, config.prefill_block_n, head_dim, block_d,
        block_size, radix, indexed, has_cp, window > 0, has_lse, dot_fp32,
        config.prefill_num_stages,
        loop_ids, config.prefill_fa_loop or new_loop, pack, config.prefill_prescale_q,
        int(config.prefill_warp_specialize), config.prefill_pair_tiles,
        k_cache.stride() == v_cache.stride(), dtype,
        num_warps=config.prefill_num_warps,
    )
