"""Checks shared by the paged-attention functions; every error names the argument."""

from __future__ import annotations

import math

import torch

from blocktable._checks import check_positive, check_tensor


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
