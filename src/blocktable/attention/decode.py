"""Paged decode attention: one query token per request, read through the block table.

On CUDA it launches the Triton kernel of :mod:`blocktable.attention.triton_decode`; on CPU it
computes :func:`~blocktable.attention.reference.paged_attention_reference` (same contract).
"""

from __future__ import annotations

import torch

from blocktable._checks import check_positive, check_tensor
from blocktable._triton import on_device, resolve_backend
from blocktable.attention._inputs import check_paged_inputs, check_sliding_window, resolve_scale
from blocktable.attention.reference import paged_attention_reference
from blocktable.attention.triton_decode import default_num_kv_splits, launch_paged_decode

DECODE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per request over its paged KV cache (decode).

    Request ``r``'s query sits at position ``seq_lens[r] - 1`` and attends positions
    ``[max(0, seq_len - sliding_window), seq_len)``, read through ``block_table[r]``. Launch
    shapes depend on tensor shapes only and no value is read on the host, so it can be
    captured in a CUDA graph.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_reqs, num_heads, head_dim]``, the cache's dtype, on the cache's device, any
        strides. ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention).
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, float32, float16 or bfloat16, any
        strides. ``block_size`` (the kernel block size) must be a power of two, ``>= 16`` on
        the Triton path.
    block_table : torch.Tensor
        int32 ``[>= num_reqs, width]`` on the cache's device, kernel block ids. Entries before
        the window may be ``NULL_BLOCK_ID``: they are not read.
    seq_lens : torch.Tensor
        int32 ``[num_reqs]`` on the cache's device, tokens in the cache per request, this
        step's included. A request with ``seq_len`` 0 (a pad row) gets zeros. On the Triton
        path ``seq_len`` is clamped to ``width * block_size`` and a block id outside
        ``[0, num_blocks)`` is skipped: never a read outside the table or the cache.
    scale : float, optional
        Multiplies ``q . k``; default ``1 / sqrt(head_dim)``.
    sliding_window : int, optional
        Tokens the query sees, itself included; ``None`` for full attention.
    out : torch.Tensor, optional
        ``[num_reqs, num_heads, head_dim]``, the query's dtype and device, written in place.
    backend : {"auto", "triton", "torch"}
        ``"auto"``: the Triton kernel on CUDA, ``"torch"`` on CPU, which computes
        :func:`paged_attention_reference` (slow, synchronizes). ``"triton"`` on CPU tensors
        needs ``TRITON_INTERPRET=1``.
    num_kv_splits : int, optional
        Programs sharing each request's blocks (flash-decoding), a power of two. ``None``
        (default) picks enough to fill the GPU from ``num_reqs``, ``num_kv_heads`` and
        ``width`` alone, so a captured CUDA graph stays valid. With more than one split a
        float32 workspace of ``num_reqs * num_heads * num_kv_splits * head_dim`` is allocated.

    Returns
    -------
    torch.Tensor
        ``out`` (or a new tensor), ``[num_reqs, num_heads, head_dim]``. Scores, softmax and the
        weighted sum accumulate in float32.

    Examples
    --------
    >>> import torch
    >>> from blocktable.attention import paged_decode_attention
    >>> k_cache = torch.randn(4, 16, 1, 64)
    >>> v_cache = torch.randn(4, 16, 1, 64)
    >>> block_table = torch.tensor([[1, 3], [2, 0]], dtype=torch.int32)
    >>> seq_lens = torch.tensor([20, 5], dtype=torch.int32)
    >>> out = paged_decode_attention(
    ...     torch.randn(2, 4, 64), k_cache, v_cache, block_table, seq_lens)
    >>> out.shape
    torch.Size([2, 4, 64])
    """
    check_paged_inputs(query, k_cache, v_cache, block_table, seq_lens, DECODE_DTYPES)
    num_reqs = seq_lens.shape[0]
    if query.shape[0] != num_reqs:
        raise ValueError(
            f"query must have one token per request (num_reqs={num_reqs} from seq_lens), "
            f"got shape {list(query.shape)}"
        )
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size & (block_size - 1):
        raise ValueError(f"k_cache's block_size must be a power of two, got {block_size}")
    window = check_sliding_window(sliding_window)
    scale = resolve_scale(scale, head_dim)
    backend = resolve_backend(backend, query.device)
    if num_kv_splits is not None:
        num_kv_splits = check_positive("num_kv_splits", num_kv_splits)
        if num_kv_splits & (num_kv_splits - 1):
            raise ValueError(f"num_kv_splits must be a power of two, got {num_kv_splits}")
    if out is None:
        out = torch.empty_like(query)
    else:
        check_tensor("out", out, dtype=query.dtype, shape=query.shape, device=query.device)
    if num_reqs == 0:
        return out

    if backend == "torch":
        return _decode_with_reference(
            query, k_cache, v_cache, block_table, seq_lens, scale, window, out
        )
    if block_size < 16:
        raise ValueError(
            f"k_cache's block_size must be >= 16 for the Triton kernel, got {block_size}"
        )
    if num_kv_splits is None:
        width = block_table.shape[1]
        num_kv_splits = default_num_kv_splits(num_reqs, num_kv_heads, width, query.device)
    with on_device(query):
        launch_paged_decode(
            out, query, k_cache, v_cache, block_table, seq_lens, scale, window, num_kv_splits
        )
    return out


def _decode_with_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> torch.Tensor:
    # The reference has no query for pad rows (seq_len 0): leave them out, they get zeros.
    live = (seq_lens > 0).nonzero().squeeze(1)
    out.zero_()
    if live.numel():
        query_start_loc = torch.arange(live.numel() + 1, dtype=torch.int32, device=query.device)
        out[live] = paged_attention_reference(
            query[live],
            k_cache,
            v_cache,
            block_table[live],
            seq_lens[live],
            query_start_loc,
            scale=scale,
            sliding_window=window,
        )
    return out
