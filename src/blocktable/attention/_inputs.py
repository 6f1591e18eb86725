"""Checks shared by the paged-attention functions; every error names the argument."""

from __future__ import annotations

import math

import numpy as np
import torch

from blocktable._checks import as_index_array, check_positive, check_tensor
from blocktable.attention.cp_layout import CPLayout, local_seq_len
from blocktable.config import CPConfig

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
NO_CP = CPLayout()


def check_paged_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """Check the cache, query, table and sequence lengths against each other."""
    check_tensor("k_cache", k_cache, ndim=4)
    if k_cache.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"k_cache must have dtype {names}, got {k_cache.dtype}")
    _, _, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, shape=k_cache.shape, device=device)
    check_tensor("query", query, dtype=k_cache.dtype, shape=(None, None, head_dim), device=device)
    num_heads = query.shape[1]
    if num_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"query's num_heads={num_heads} must be a positive multiple of k_cache's "
            f"num_kv_heads={num_kv_heads}"
        )
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=device)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device)
    if block_table.shape[0] < seq_lens.shape[0]:
        raise ValueError(
            f"block_table must have at least num_reqs={seq_lens.shape[0]} rows (one per entry "
            f"of seq_lens), got {block_table.shape[0]}"
        )


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``scale``, or ``1 / sqrt(head_dim)`` when it is ``None``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_sliding_window(sliding_window: int | None) -> int | None:
    """``None`` (full attention) or a window of at least one token."""
    return None if sliding_window is None else check_positive("sliding_window", sliding_window)


def with_lse(
    out: torch.Tensor, lse_out: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return out if lse_out is None else (out, lse_out)


def inputs_look_valid(
    query: object,
    k_cache: object,
    v_cache: object,
    block_table: object,
    seq_lens: object,
    query_start_loc: object,
    row_of_batch: object,
    out: object,
    lse_out: object,
) -> bool:
    """A fast yes to the checks of the Triton path (a no is explained by the slow checks)."""
    try:
        dtype = k_cache.dtype  # type: ignore[attr-defined]
        dev = k_cache.device  # type: ignore[attr-defined]
        kshape = k_cache.shape  # type: ignore[attr-defined]
        qshape = query.shape  # type: ignore[attr-defined]
        num_reqs = seq_lens.shape[0]  # type: ignore[attr-defined]
        i32 = torch.int32
        ok = (
            dtype in TRITON_DTYPES
            and len(kshape) == 4
            and v_cache.dtype is dtype  # type: ignore[attr-defined]
            and v_cache.shape == kshape  # type: ignore[attr-defined]
            and query.dtype is dtype  # type: ignore[attr-defined]
            and len(qshape) == 3
            and qshape[2] == kshape[3]
            and qshape[1] > 0
            and qshape[1] % kshape[2] == 0
            and seq_lens.dtype is i32  # type: ignore[attr-defined]
            and seq_lens.dim() == 1  # type: ignore[attr-defined]
            and block_table.dtype is i32  # type: ignore[attr-defined]
            and block_table.dim() == 2  # type: ignore[attr-defined]
            and block_table.shape[0] >= num_reqs  # type: ignore[attr-defined]
            and (
                query_start_loc is None
                or (query_start_loc.dtype is i32  # type: ignore[attr-defined]
                    and query_start_loc.shape == (num_reqs + 1,))  # type: ignore[attr-defined]
            )
            and (
                row_of_batch is None
                or (row_of_batch.dtype is i32  # type: ignore[attr-defined]
                    and row_of_batch.shape == (num_reqs,))  # type: ignore[attr-defined]
            )
        )
        if not ok:
            return False
        tensors = [v_cache, query, seq_lens, block_table]
        if query_start_loc is not None:
            tensors.append(query_start_loc)
        if row_of_batch is not None:
            tensors.append(row_of_batch)
        if out is not None:
            tensors.append(out)
        if lse_out is not None:
            tensors.append(lse_out)
        return all(t.device == dev for t in tensors)  # type: ignore[attr-defined]
    except AttributeError:
        return False


def check_triton_common(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    cp: CPConfig | None,
    cp_block_size: int | None,
    num_kv_splits: int | None,
) -> CPLayout:
    """Checks of the Triton path beyond :func:`check_paged_inputs`; the CP layout."""
    if query.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM}, got {query.shape[2]}")
    if num_kv_splits is not None:
        check_positive("num_kv_splits", num_kv_splits)
    if cp is None and cp_block_size is None:
        return NO_CP
    layout = cp_layout_args(cp, cp_block_size, k_cache.shape[1])
    return CPLayout(
        layout["world_size"], layout["rank"], layout["interleave"], layout["manager_block_size"]
    )


def check_outputs(
    query: torch.Tensor, out: torch.Tensor | None, lse_out: torch.Tensor | None, want_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The caller's output buffers (checked), or new ones."""
    if out is None:
        out = torch.empty_like(query)
    elif not (out.dtype is query.dtype and out.shape == query.shape
              and out.device == query.device):
        check_tensor("out", out, dtype=query.dtype, shape=query.shape, device=query.device)
    if lse_out is not None:
        check_tensor(
            "lse_out", lse_out, dtype=torch.float32, shape=query.shape[:2], device=query.device
        )
    elif want_lse:
        lse_out = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    return out, lse_out


def check_seq_lens_host(
    seq_lens_cpu: object, num_reqs: int, layout: CPLayout, row_capacity: int
) -> None:
    """Raise when a host-side ``seq_len`` puts more keys on this rank than its row holds."""
    seq = as_index_array("seq_lens_cpu", seq_lens_cpu)
    if seq.shape[0] != num_reqs:
        raise ValueError(f"seq_lens_cpu must have shape [{num_reqs}], got {list(seq.shape)}")
    local = np.asarray(
        local_seq_len(
            seq, world_size=layout.world_size, rank=layout.rank, interleave=layout.interleave,
            manager_block_size=layout.block_size,
        )
    )
    if seq.size and (seq.min() < 0 or local.max() > row_capacity):
        i = int(np.argmax((seq < 0) | (local > row_capacity)))
        raise ValueError(
            f"seq_lens_cpu[{i}]={int(seq[i])} must be >= 0 and put at most width * block_size="
            f"{row_capacity} keys on this rank"
        )


def cp_layout_args(cp: CPConfig | None, cp_block_size: int | None, block_size: int) -> dict[str, int]:
    """The keyword arguments of :mod:`~blocktable.attention.cp_layout` for this call."""
    if cp is not None and not isinstance(cp, CPConfig):
        raise TypeError(f"cp must be a CPConfig or None, got {type(cp).__name__}")
    cp = cp or CPConfig()
    manager_block_size = block_size if cp_block_size is None else cp_block_size
    check_positive("cp_block_size", manager_block_size)
    if manager_block_size % block_size:
        raise ValueError(
            f"cp_block_size={manager_block_size} must be a multiple of k_cache's "
            f"block_size={block_size}"
        )
    if cp.world_size > 1 and manager_block_size % cp.interleave:
        raise ValueError(
            f"cp interleave={cp.interleave} must divide cp_block_size={manager_block_size}"
        )
    return {
        "world_size": cp.world_size,
        "rank": cp.rank,
        "interleave": cp.interleave,
        "manager_block_size": manager_block_size,
    }
