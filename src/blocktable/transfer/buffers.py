"""Gather chunks of every layer's K and V into one contiguous buffer, and scatter it back.

One ``index_select`` over the cache viewed as ``[num_layers * 2, num_chunks, chunk_elems]``
reads every layer, K and V, of the chosen chunks (one launch); one ``index_copy_`` writes them.
"""

from __future__ import annotations

import numpy as np
import torch


def chunk_view(kv_cache: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """``kv_cache`` (``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
    contiguous) as ``[num_layers * 2, num_slots // chunk_tokens, chunk_tokens * num_kv_heads *
    head_dim]``, sharing its memory."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    num_layers, two, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if block_size % chunk_tokens:
        raise ValueError(f"chunk_tokens ({chunk_tokens}) must divide the cache's block size "
                         f"({block_size})")
    num_chunks = num_blocks * block_size // chunk_tokens
    return kv_cache.view(num_layers * two, num_chunks, chunk_tokens * num_kv_heads * head_dim)


def _rows_tensor(rows: np.ndarray, view: torch.Tensor, name: str) -> torch.Tensor:
    if rows.size and (rows.min() < 0 or rows.max() >= view.shape[1]):
        raise ValueError(f"{name} must lie in [0, {view.shape[1]}), got "
                         f"[{rows.min()}, {rows.max()}]")
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(view.device)


def gather_chunks(kv_cache: torch.Tensor, rows: np.ndarray, chunk_tokens: int) -> torch.Tensor:
    """A new contiguous ``[num_layers * 2, len(rows), chunk_tokens * num_kv_heads * head_dim]``
    buffer (the cache's dtype and device) holding those chunk rows of every layer."""
    view = chunk_view(kv_cache, chunk_tokens)
    return view.index_select(1, _rows_tensor(rows, view, "rows"))


def scatter_chunks(kv_cache: torch.Tensor, rows: np.ndarray, chunk_tokens: int,
                   buffer: torch.Tensor) -> None:
    """Write ``buffer`` (as :func:`gather_chunks` returns) into those chunk rows."""
    view = chunk_view(kv_cache, chunk_tokens)
    expected = (view.shape[0], len(rows), view.shape[2])
    if tuple(buffer.shape) != expected or buffer.dtype != view.dtype:
        raise ValueError(f"buffer must be {view.dtype} {list(expected)}, got {buffer.dtype} "
                         f"{list(buffer.shape)}")
    view.index_copy_(1, _rows_tensor(rows, view, "rows"), buffer)
