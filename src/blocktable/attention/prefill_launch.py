"""Host side of the prefill kernel: one launch over every request longer than the decode
kernel takes (or every request), from shapes only (never a device value)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from blocktable._triton import HAS_TRITON, Launcher, cdiv, interpreting, raw_stream_getter
from blocktable.attention.cp_layout import CPLayout
from blocktable.attention.decode_plan import DTYPE_NAMES, tile_sizes
from blocktable.attention.kernel_config import KernelConfig
from blocktable.attention.triton_tiles import LOG2_E

if HAS_TRITON:
    from blocktable.attention import triton_prefill as _pre
from blocktable.attention import gluon_prefill as _gluon

SEARCH_RADIX = 16  # lanes per level of the device search for a program's request
# The Gluon kernel's: one warp's lanes, so that up to 31 requests take one level.
GLUON_SEARCH_RADIX = 32
# Whether prefill_kernel="auto" takes the Gluon kernel where it serves the inputs: on. On an
# H200 it is 1.27-1.40x the Triton kernel on the benchmark's three prefill shapes and passes
# the Triton kernel's tests in its place (BENCHMARKS.md).
AUTO_PICKS_GLUON = True
_INTERPRET = interpreting()


@functools.lru_cache(maxsize=4096)
def search_stride(num_reqs: int, radix: int = SEARCH_RADIX) -> int:
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
if _gluon.HAS_GLUON:
    _gluon_launch = Launcher(
        _gluon.gluon_prefill_kernel,
        _dynamic_positions(_gluon.gluon_prefill_kernel, _gluon.GLUON_DYNAMIC_ARGS),
    )


def launch_prefill(
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    row_of_batch: torch.Tensor | None,
    scale: float,
    sliding_window: int | None,
    cp: CPLayout,
    strides: tuple[int, ...],
    config: KernelConfig,
    *,
    short_query_len: int,
    aligned: bool,
) -> None:
    """Launch the prefill kernel on checked inputs; requests of at most ``short_query_len``
    query tokens are left to the decode kernel (0: the prefill kernel takes every request)."""
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_rows, width = block_table.shape
    group = num_heads // num_kv_heads
    block_d, group_pad, _, _ = tile_sizes(head_dim, group)
    dtype = DTYPE_NAMES[query.dtype]
    window = sliding_window or 0
    block_m = max(config.prefill_block_m, group_pad)
    block_q = block_m // group_pad
    if config.prefill_kernel == "gluon" or config.prefill_kernel == "auto" and AUTO_PICKS_GLUON:
        reason = gluon_reason(query, k_cache, v_cache, out, group_pad, window, cp)
        if reason is None:
            _launch_gluon(
                out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                row_of_batch, scale, strides, group, group_pad, short_query_len,
            )
            return
        if config.prefill_kernel == "gluon":
            raise ValueError(f"prefill_kernel='gluon' cannot serve these inputs: {reason}")
    launch = _prefill_launch if aligned else _prefill_launch_unaligned
    launch(
        (cdiv(num_tokens, block_q) + num_reqs, num_kv_heads),
        out, seq_lens if lse_out is None else lse_out, query, k_cache, v_cache, block_table,
        seq_lens, query_start_loc, seq_lens if row_of_batch is None else row_of_batch,
        scale * LOG2_E, window, num_reqs, num_tokens, short_query_len, num_blocks, num_rows,
        width, cp.world_size, cp.rank, cp.interleave, cp.block_size,
        search_stride(num_reqs), *strides,
        group, group_pad, block_m, block_q, config.prefill_block_n, head_dim, block_d,
        block_size, SEARCH_RADIX, row_of_batch is not None, cp.world_size > 1, window > 0,
        lse_out is not None, _INTERPRET and dtype != "fp32", config.prefill_num_stages,
        0, strides[8:12] == strides[12:16], dtype,  # block ids prefetched a tile ahead
        num_warps=config.prefill_num_warps,
    )


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def gluon_reason(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    group_pad: int,
    window: int,
    cp: CPLayout,
) -> str | None:
    """``None`` when the Gluon prefill kernel serves these (checked) inputs, else why not:
    it needs what :func:`gluon_prefill.supports` asks, a Hopper GPU, 16-byte aligned tensors
    with a contiguous head dimension and other strides in multiples of 16 elements, a query
    whose heads lie side by side (copied by TMA), a GQA group of at most 8, and a cache whose
    blocks are contiguous ``[block_size, num_kv_heads, head_dim]`` pieces of a power of two
    from 16 slots up (its loader copies whole page chunks), under 2**31 slots in all."""
    reason = _gluon.supports(DTYPE_NAMES[query.dtype], query.shape[2], cp.world_size, window)
    if reason is not None:
        return reason
    if not query.is_cuda or _capability(query.device)[0] != 9:
        return "not a Hopper (sm_90) GPU"
    if group_pad > 8:  # (a head's box of 64 // group_pad query rows: whole swizzle periods)
        return "a GQA group over 8"
    if query.stride(1) != query.shape[2]:
        return "query's heads are not side by side"
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        strides = t.stride()
        if strides[-1] != 1 or any(s % 16 for s in strides[:-1]) or t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned with a contiguous head dimension"
    num_blocks, block_size, _, head_dim = k_cache.shape
    if block_size < _gluon.GLUON_MIN_BLOCK_SIZE or block_size & (block_size - 1):
        return (f"kernel block size {block_size} (it takes a power of two from "
                f"{_gluon.GLUON_MIN_BLOCK_SIZE} up)")
    if num_blocks * block_size >= 2**31:
        return "a cache of 2**31 slots or more"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        b, s, h, _ = t.stride()
        if h != head_dim or b != block_size * s:
            return f"{name}'s blocks are not contiguous [block_size, num_kv_heads, head_dim]"
    return None


@dataclasses.dataclass(frozen=True)
class GluonTiles:
    """Launch shape of the Gluon kernel: keys per tile and tiles in flight (shared memory
    holds ``stages`` K and V tiles beside the queries)."""

    block_n: int = 64
    stages: int = 4
    # Programs per multiprocessor, each taking work items (query tile, KV head) as it is
    # ready for more, so that its loader copies the next item's queries and keys while its
    # consumers finish the last one's; 0: a program per item.
    programs_per_sm: int = 1


GLUON_TILES = GluonTiles()  # from the sweeps of benchmarks/notes_gluon.md


def _launch_gluon(
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    row_of_batch: torch.Tensor | None,
    scale: float,
    strides: tuple[int, ...],
    group: int,
    group_pad: int,
    short_query_len: int,
) -> None:
    num_tokens, _, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_rows, width = block_table.shape
    tiles = GLUON_TILES
    block_q = 2 * _gluon.CONSUMER_ROWS // group_pad
    o_t, o_h, _, lse_t, lse_h, _, _, _, k_b, k_s, _, _, v_b, v_s, _, _, tb_r, tb_c = strides
    cache_rows = num_blocks * block_size
    k_desc, v_desc = _descriptors(k_cache, v_cache, min(block_size, tiles.block_n))
    q_desc = _query_descriptor(query, _gluon.CONSUMER_ROWS // group_pad)
    # Output rows by the copy engine where the output's heads lie side by side, like the
    # query's (its alignment is checked by gluon_reason); else stored from registers.
    tma_out = out.stride(1) == head_dim
    o_desc = _query_descriptor(out, _gluon.CONSUMER_ROWS // group_pad) if tma_out else q_desc
    num_programs = (cdiv(num_tokens, block_q) + num_reqs) * num_kv_heads  # one per item
    if tiles.programs_per_sm:
        num_programs = min(num_programs, tiles.programs_per_sm * _multiprocessors(query.device))
    _gluon_launch(
        (num_programs,), out, seq_lens if lse_out is None else lse_out, q_desc, o_desc, k_desc,
        v_desc, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        seq_lens if row_of_batch is None else row_of_batch, _work_counters(query.device),
        scale * LOG2_E, num_reqs, num_tokens, short_query_len, num_blocks, num_rows, width,
        search_stride(num_reqs, GLUON_SEARCH_RADIX), cache_rows, num_kv_heads, o_t, o_h, lse_t,
        lse_h, k_b, k_s, v_b, v_s, tb_r, tb_c,
        group, group_pad, block_q, tiles.block_n, head_dim, block_size, GLUON_SEARCH_RADIX,
        row_of_batch is not None, lse_out is not None, tiles.stages, tma_out, num_warps=4,
    )


_raw_stream = raw_stream_getter()
_WORK_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _work_counters(device: torch.device) -> torch.Tensor:
    """The kernel's work-item counters on ``device`` (int32 ``[2]``: items claimed, programs
    done), zero between launches: each launch's last program zeroes them, so no launch needs
    a memset before it and a CUDA graph may capture it alone. One pair per stream, so that
    launches on two streams never share one (a CUDA graph keeps the pair of the stream it was
    captured on: graphs captured on one stream must not be replayed at the same time)."""
    key = (device, _raw_stream(device.index))
    if key not in _WORK_COUNTERS:
        _WORK_COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return _WORK_COUNTERS[key]


def _row_descriptor(t: torch.Tensor, num_rows: int, row_stride: int, box_rows: int,
                    buffer_rows: int) -> object:
    """TMA descriptor of ``t`` (its last two dimensions heads and ``head_dim``, the heads side
    by side) seen as ``[num_rows, heads * head_dim]`` rows ``row_stride`` elements apart,
    copying ``[box_rows, head_dim]`` boxes (one head's rows) into shared buffers of
    ``buffer_rows`` rows, in their swizzled layout."""
    heads, head_dim = t.shape[-2:]
    layout = _shared_layout(buffer_rows, head_dim, t.dtype == torch.float16)
    return _gluon.TensorDescriptor(t, [num_rows, heads * head_dim], [row_stride, 1],
                                   [box_rows, head_dim], layout)


@functools.lru_cache(maxsize=64)
def _shared_layout(rows: int, head_dim: int, fp16: bool) -> object:
    """The swizzled shared-memory layout of a ``[rows, head_dim]`` float16 (else bfloat16)
    buffer, built once: Gluon would build it anew for each of a launch's four descriptors,
    on the host's path of every step."""
    gl = _gluon.gl
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim],
                                                gl.float16 if fp16 else gl.bfloat16)


def _query_descriptor(query: torch.Tensor, tokens: int) -> object:
    """The query (or the output, of its shape) seen as ``[num_tokens, num_heads * head_dim]``
    (its heads side by side: checked by :func:`gluon_reason` for the query, by the launcher
    for the output), copying ``[tokens, head_dim]`` boxes (one head of a consumer's tokens)
    between it and the kernel's query buffers."""
    return _row_descriptor(query, query.shape[0], query.stride(0), tokens,
                           _gluon.CONSUMER_ROWS)


def _descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: int) -> tuple:
    """The two caches seen as ``[num_blocks * block_size, num_kv_heads * head_dim]`` (rows:
    slots), copying ``[chunk, head_dim]`` boxes."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    return tuple(_row_descriptor(t, num_slots, t.stride(1), chunk, chunk)
                 for t in (k_cache, v_cache))
