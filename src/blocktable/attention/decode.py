"""Paged decode attention: one query token per request, read through the block table.

On CUDA (or with ``backend="triton"``) it launches the decode kernel of
:mod:`blocktable.attention.triton_decode` (one launch; split keys merged by the last split);
on the CPU it computes :func:`~blocktable.attention.reference.paged_attention_reference`.
"""

from __future__ import annotations

import torch

from blocktable._checks import check_positive, check_tensor
from blocktable._triton import HAS_TRITON, resolve_backend
from blocktable.attention._inputs import (
    check_outputs,
    check_paged_inputs,
    check_sliding_window,
    check_triton_common,
    inputs_look_valid,
    resolve_scale,
    with_lse,
)
from blocktable.attention.paged import default_planner
from blocktable.attention.reference import paged_attention_reference
from blocktable.config import CPConfig

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
    row_of_batch: torch.Tensor | None = None,
    cp: CPConfig | None = None,
    cp_block_size: int | None = None,
    lse_out: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new token per request over its paged KV cache (decode).

    Request ``r``'s query sits at global position ``seq_lens[r] - 1`` and attends positions
    ``[max(0, seq_len - sliding_window), seq_len)``, read through ``block_table[r]`` (or
    ``block_table[row_of_batch[r]]``). Launch shapes depend on tensor shapes only and no value
    is read on the host, so it can be captured in a CUDA graph.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_reqs, num_heads, head_dim]``, the cache's dtype, on the cache's device, any
        strides. ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention).
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, float32, float16 or bfloat16, any
        strides, any block size (the kernel block size).
    block_table : torch.Tensor
        int32 ``[>= num_reqs, width]`` on the cache's device, kernel block ids. Entries before
        the window may be ``NULL_BLOCK_ID``: they are not read.
    seq_lens : torch.Tensor
        int32 ``[num_reqs]`` on the cache's device, tokens in the sequence per request (on all
        CP ranks together), this step's included. A request with ``seq_len`` 0 (a pad row)
        gets zeros. On the Triton path ``seq_len`` is clamped to the row and a block id
        outside ``[0, num_blocks)`` is never dereferenced: never a read outside the table or
        the cache.
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
        Programs sharing each request's keys (flash-decoding), a power of two. ``None``
        (default) picks enough to fill the GPU from ``num_reqs``, ``num_kv_heads`` and
        ``width`` alone. The split workspace is the device's default planner's.
    row_of_batch : torch.Tensor, optional
        int32 ``[num_reqs]``, the table row of each request (indexed mode).
    cp, cp_block_size : optional
        Context parallelism, as in :func:`paged_attention_reference`: the cache holds this
        rank's keys at local positions, masked by global position.
    lse_out : torch.Tensor, optional
        float32 ``[num_reqs, num_heads]``, written in place with the log-sum-exp (implies
        ``return_lse``).
    return_lse : bool
        Also return the natural-log log-sum-exp of each query's visible scores (``-inf`` where
        none is visible).

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``out`` (or a new tensor), ``[num_reqs, num_heads, head_dim]`` (and the LSE). Scores,
        softmax and the weighted sum accumulate in float32.

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
    if not inputs_look_valid(
        query, k_cache, v_cache, block_table, seq_lens, None, row_of_batch, out, lse_out
    ):  # the slow checks say what is wrong
        check_paged_inputs(query, k_cache, v_cache, block_table, seq_lens, DECODE_DTYPES)
        if row_of_batch is not None:
            check_tensor(
                "row_of_batch", row_of_batch, dtype=torch.int32, shape=(seq_lens.shape[0],),
                device=query.device,
            )
    num_reqs = seq_lens.shape[0]
    if query.shape[0] != num_reqs:
        raise ValueError(
            f"query must have one token per request (num_reqs={num_reqs} from seq_lens), "
            f"got shape {list(query.shape)}"
        )
    window = check_sliding_window(sliding_window)
    scale = resolve_scale(scale, query.shape[2])
    if not (backend == "auto" and HAS_TRITON and query.is_cuda):  # (the per-step case: fast)
        backend = resolve_backend(backend, query.device)
    if num_kv_splits is not None:
        num_kv_splits = check_positive("num_kv_splits", num_kv_splits)
        if num_kv_splits & (num_kv_splits - 1):
            raise ValueError(f"num_kv_splits must be a power of two, got {num_kv_splits}")
    want_lse = return_lse or lse_out is not None
    layout = check_triton_common(query, k_cache, cp, cp_block_size, None)
    out, lse_out = check_outputs(query, out, lse_out, want_lse)
    if num_reqs == 0:
        return with_lse(out, lse_out)
    if backend == "torch":
        _decode_with_reference(
            query, k_cache, v_cache, block_table, seq_lens, scale, window, row_of_batch, cp,
            cp_block_size, out, lse_out,
        )
    else:
        default_planner(query.device).launch(
            out, lse_out, query, k_cache, v_cache, block_table, seq_lens, None, row_of_batch,
            scale, window, layout, decode_only=True, num_kv_splits=num_kv_splits,
        )
    return with_lse(out, lse_out)


def _decode_with_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    row_of_batch: torch.Tensor | None,
    cp: CPConfig | None,
    cp_block_size: int | None,
    out: torch.Tensor,
    lse_out: torch.Tensor | None,
) -> None:
    # The reference has no query for pad rows (seq_len 0): leave them out, they get zeros.
    live = (seq_lens > 0).nonzero().squeeze(1)
    out.zero_()
    if lse_out is not None:
        lse_out.fill_(float("-inf"))
    if not live.numel():
        return
    query_start_loc = torch.arange(live.numel() + 1, dtype=torch.int32, device=query.device)
    rows = row_of_batch[live] if row_of_batch is not None else None
    result, lse = paged_attention_reference(
        query[live], k_cache, v_cache, block_table if rows is not None else block_table[live],
        seq_lens[live], query_start_loc, scale=scale, sliding_window=window, row_of_batch=rows,
        cp=cp, cp_block_size=cp_block_size, return_lse=True,
    )
    out[live] = result
    if lse_out is not None:
        lse_out[live] = lse
