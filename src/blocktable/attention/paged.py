"""``paged_attention``: one entry point for every step (prefill, chunks, decode, mixed batches).

The torch backend computes :func:`~blocktable.attention.reference.paged_attention_reference`
(float64, slow, synchronizes: CPU engines and tests). The Triton backend runs the kernels.
"""

from __future__ import annotations

import torch

from blocktable._checks import check_tensor
from blocktable._triton import resolve_backend
from blocktable.attention.reference import paged_attention_reference
from blocktable.config import CPConfig


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    row_of_batch: torch.Tensor | None = None,
    cp: CPConfig | None = None,
    cp_block_size: int | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal paged attention of a varlen batch, reading K/V through the block table.

    Same contract as :func:`~blocktable.attention.reference.paged_attention_reference`
    (shapes, ``row_of_batch``, context parallelism, log-sum-exp), plus caller-owned outputs.

    Parameters
    ----------
    out : torch.Tensor, optional
        ``[num_tokens, num_heads, head_dim]``, the query's dtype and device, written in place.
    lse_out : torch.Tensor, optional
        float32 ``[num_tokens, num_heads]`` on the query's device, written in place (implies
        ``return_lse``).
    backend : {"auto", "triton", "torch"}
        ``"auto"``: Triton on CUDA, the float64 reference on the CPU.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        The output (and the LSE when ``return_lse`` or ``lse_out`` is given).
    """
    backend = resolve_backend(backend, query.device)
    if out is not None:
        check_tensor("out", out, dtype=query.dtype, shape=query.shape, device=query.device)
    want_lse = return_lse or lse_out is not None
    if lse_out is not None:
        check_tensor(
            "lse_out", lse_out, dtype=torch.float32, shape=query.shape[:2], device=query.device
        )
    result, lse = paged_attention_reference(
        query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=scale,
        sliding_window=sliding_window, row_of_batch=row_of_batch, cp=cp,
        cp_block_size=cp_block_size, return_lse=True,
    )
    if out is not None:
        out.copy_(result)
        result = out
    if lse_out is not None:
        lse_out.copy_(lse)
        lse = lse_out
    return (result, lse) if want_lse else result
