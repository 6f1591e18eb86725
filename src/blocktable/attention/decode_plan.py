"""Host side of the decode kernel: its workspace, and a plan worked out once per shape.

Everything here depends on tensor shapes, strides and dtypes only (never on values held on
the device), so the launches can be captured in a CUDA graph, and a kept :class:`DecodePlan`
binds its launches to the compiled kernels so that a repeated call does little host work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blocktable._triton import HAS_TRITON, Launcher, cdiv, interpreting, next_power_of_2
from blocktable.attention.cp_layout import CPLayout
from blocktable.attention.kernel_config import (
    DecodeSchedule,
    KernelConfig,
    decode_rows,
    decode_schedule,
    default_config,
)
from blocktable.attention.triton_tiles import LOG2_E

if HAS_TRITON:
    from blocktable.attention import triton_decode as _dec

PAD_ITERS = 16  # pad tokens zeroed per extra decode program, in BLOCK_Q steps
_INTERPRET = interpreting()
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class DecodeWorkspace:
    """The split-KV scratch of one owner on one device: partial outputs and log-sum-exps per
    shape, and the zeroed arrival counters of the fused combine per size.

    Buffers are allocated on first use and kept while the owner lives (a captured CUDA graph
    may hold their addresses); two owners never share one, so two planners can run on two
    streams of a device at once.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # float32 ([rows, heads, splits, block_d], [rows, heads, splits]) by that shape
        self._partials: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._counters: dict[int, torch.Tensor] = {}  # int32 [size] on device, by size

    def partials(
        self, num_rows: int, num_heads: int, splits: int, block_d: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``part_o [num_rows, num_heads, splits, block_d]`` and ``part_lse
        [num_rows, num_heads, splits]`` on the device (uninitialized: every split writes its
        slots before they are read)."""
        key = (num_rows, num_heads, splits, block_d)
        found = self._partials.get(key)
        if found is None:
            part_o = torch.empty(key, dtype=torch.float32, device=self.device)
            part_lse = torch.empty(key[:3], dtype=torch.float32, device=self.device)
            found = self._partials[key] = (part_o, part_lse)
        return found

    def counters(self, size: int) -> torch.Tensor:
        """int32 ``[size]`` zeros on the device; the fused combine leaves them at zero."""
        found = self._counters.get(size)
        if found is None:
            found = self._counters[size] = torch.zeros(size, dtype=torch.int32, device=self.device)
        return found

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer allocated so far (for tests and memory accounting)."""
        return [t for pair in self._partials.values() for t in pair] + list(
            self._counters.values()
        )


def _dynamic_positions(kernel: object, names: tuple[str, ...]) -> tuple[int, ...]:
    arg_names = list(kernel.arg_names)  # type: ignore[attr-defined]
    return tuple(arg_names.index(n) for n in names)


if HAS_TRITON:
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


def tile_sizes(head_dim: int, group_size: int) -> tuple[int, int, int, int]:
    """``(BLOCK_D, GROUP_PAD, decode BLOCK_M, decode BLOCK_Q)``."""
    return (max(16, next_power_of_2(head_dim)), *decode_rows(group_size))


def tensor_strides(
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
) -> tuple[int, ...]:
    """The strides the kernels take, in their argument order."""
    lse_strides = lse_out.stride() if lse_out is not None else (0, 0)
    return (*out.stride(), *lse_strides, *query.stride(), *k_cache.stride(), *v_cache.stride(),
            *block_table.stride())


class DecodePlan:
    """Everything the decode launch (and its split-KV combine) takes that depends on shapes,
    strides, dtypes and options only, worked out once: the grid, the workspace, the arguments
    after the tensors, and, after the first kept call, launch functions bound to the compiled
    kernels. :meth:`run` is the whole host work of a call on tensors with the metadata the
    plan was built from."""

    def __init__(
        self,
        grid: tuple[int, int, int],
        combine_grid: tuple[int, int, int] | None,
        partials: tuple[torch.Tensor, torch.Tensor] | None,
        counters: torch.Tensor | None,
        tail: tuple[object, ...],
        combine_tail: tuple[object, ...],
        num_warps: int,
    ) -> None:
        self.grid = grid
        self.combine_grid = combine_grid  # None: one split, or the fused combine
        self.partials = partials  # float32 (part_o, part_lse) on the device, or None
        self.counters = counters  # int32 arrival counters of the fused combine, or None
        self.tail = tail  # decode kernel arguments after the tensors
        self.combine_tail = combine_tail
        self.num_warps = num_warps
        # [aligned decode, unaligned decode, combine] bound launch functions, once compiled
        self._bound: list[Callable[..., None] | None] = [None, None, None]

    @classmethod
    def build(
        cls,
        workspace: DecodeWorkspace,
        out: torch.Tensor,
        lse_out: torch.Tensor | None,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        row_of_batch: torch.Tensor | None,
        scale: float,
        sliding_window: int | None,
        cp: CPLayout,
        strides: tuple[int, ...],
        *,
        decode_only: bool,
        config: KernelConfig | None = None,
        num_kv_splits: int | None = None,
        schedule: DecodeSchedule | None = None,
    ) -> DecodePlan | None:
        """The plan of checked inputs (``strides``: :func:`tensor_strides`), or ``None`` when
        no decode program runs. ``config`` ``None``: :func:`default_config` with the stages
        chosen by :func:`decode_schedule`; a given configuration keeps its stages.
        ``schedule`` overrides the rule (benchmarks and tests compare schedules)."""
        num_tokens, num_heads, head_dim = query.shape
        num_reqs = seq_lens.shape[0]
        has_qsl = query_start_loc is not None
        block_d, group_pad, dec_m, dec_q = tile_sizes(head_dim, num_heads // k_cache.shape[2])
        # With qsl, programs num_reqs, ... zero the pad tokens when the prefill kernel does not
        # run.
        extra = cdiv(num_tokens, PAD_ITERS * dec_q) if has_qsl and decode_only else 0
        if num_tokens == 0 or num_reqs + extra == 0:
            return None
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        num_rows, width = block_table.shape
        group = num_heads // num_kv_heads
        choose_stages = config is None
        if config is None:
            config = default_config(head_dim, group, query.element_size())
        splits = num_kv_splits or config.num_kv_splits or _dec.default_num_kv_splits(
            num_reqs, num_kv_heads, width, query.device, block_size
        )
        splits = splits if num_reqs > 0 else 1
        if schedule is None:
            schedule = decode_schedule(config, splits, num_reqs, num_kv_heads, width, block_size,
                                       choose_stages=choose_stages)
        per_block = config.decode_block_n % block_size == 0 and not block_size & (block_size - 1)
        # ids mode 2: one id per block; 1: one per key in the tile's own iteration (the
        # fallback of 2 where the block size does not fit the tile); 0: prefetched a tile ahead.
        ids_mode = (2 if per_block else 1) if schedule.per_block_ids else 0
        split = splits > 1
        slots = dec_q if has_qsl else 1
        partials = workspace.partials(num_reqs * slots, num_heads, splits, block_d) if split else None
        fused = split and schedule.fused_combine
        counters = workspace.counters(num_reqs * num_kv_heads) if fused else None
        has_lse = lse_out is not None
        lse_strides = lse_out.stride() if lse_out is not None else (0, 0)
        window = sliding_window or 0
        dtype = DTYPE_NAMES[query.dtype]
        chunk = _dec.merge_chunk(group_pad, block_d)
        same_kv = strides[8:12] == strides[12:16]  # k_cache and v_cache
        tail = (
            scale * LOG2_E, window, num_reqs, num_tokens, splits, splits, num_blocks, num_rows,
            width, cp.world_size, cp.rank, cp.interleave, cp.block_size, *strides,
            group, group_pad, dec_m, dec_q, slots, PAD_ITERS, config.decode_block_n, head_dim,
            block_d, block_size, has_qsl, row_of_batch is not None, cp.world_size > 1,
            window > 0, has_lse, split, _INTERPRET and dtype != "fp32", schedule.num_stages,
            ids_mode, fused, chunk,
            # One offset computation for K and V: a gain with the fused combine only (see
            # BENCHMARKS.md), so only there.
            fused and same_kv, dtype,
        )
        combine_grid = None
        combine_tail: tuple[object, ...] = ()
        if split and not fused:
            combine_grid = (num_reqs * slots, num_kv_heads, 1)
            combine_tail = (
                splits, splits, *out.stride(), *lse_strides, group, group_pad, dec_q, slots,
                head_dim, block_d, has_qsl, has_lse, chunk, dtype,
            )
        return cls(
            (num_reqs + extra, num_kv_heads, splits), combine_grid, partials, counters, tail,
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
        part_o, part_lse = (out, out) if self.partials is None else self.partials
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
