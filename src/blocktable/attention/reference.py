"""Paged attention in plain torch, one request at a time: the reference every kernel must match.

Request ``r`` has ``seq_len = seq_lens[r]`` tokens in the cache, the last
``query_len = query_start_loc[r+1] - query_start_loc[r]`` of them being this step's queries.
Query ``i`` sits at position ``seq_len - query_len + i`` and attends every position ``k`` with
``k <= position`` (causal) and, with a sliding window, ``k > position - sliding_window``.
Position ``k`` is read from ``cache[block_table[r, k // block_size], k % block_size]``; positions
no query can see are never read, so out-of-window entries may hold ``NULL_BLOCK_ID``.
"""

from __future__ import annotations

import torch

from blocktable._checks import check_tensor
from blocktable.attention._inputs import check_paged_inputs, check_sliding_window, resolve_scale

REFERENCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal paged attention over variable-length queries, computed in float64.

    Slow (a Python loop over requests, host syncs) and meant for tests and as the definition of
    what the kernels compute.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_tokens, num_heads, head_dim]``, the cache's dtype, on the cache's device.
        ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention: query head
        ``h`` reads KV head ``h // (num_heads // num_kv_heads)``). Tokens past
        ``query_start_loc[num_reqs]`` are padding and get zeros.
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, float32, float16, bfloat16 or
        float64; ``block_size`` is the kernel block size the table's ids refer to.
    block_table : torch.Tensor
        int32 ``[>= num_reqs, width]``, kernel block ids; row ``r`` belongs to request ``r``.
    seq_lens : torch.Tensor
        int32 ``[num_reqs]``, tokens in the cache per request, this step's included.
    query_start_loc : torch.Tensor
        int32 ``[num_reqs + 1]``, request ``r``'s queries are tokens
        ``[query_start_loc[r], query_start_loc[r+1])``.
    scale : float, optional
        Multiplies ``q . k``; default ``1 / sqrt(head_dim)``.
    sliding_window : int, optional
        Tokens a query sees, itself included; ``None`` for full attention.

    Returns
    -------
    torch.Tensor
        ``[num_tokens, num_heads, head_dim]``, the query's dtype and device.

    Raises
    ------
    ValueError
        When a request's query length exceeds its ``seq_len``, or ``seq_len`` exceeds the
        row's ``width * block_size``, or ``query_start_loc`` is not a valid offset vector.
    IndexError
        When a block id that must be read lies outside ``[0, num_blocks)``.

    Examples
    --------
    >>> import torch
    >>> from blocktable.attention import paged_attention_reference
    >>> k_cache = torch.randn(4, 16, 1, 8)
    >>> v_cache = torch.randn(4, 16, 1, 8)
    >>> block_table = torch.tensor([[2, 3]], dtype=torch.int32)   # 20 tokens: block 2 then 3
    >>> seq_lens = torch.tensor([20], dtype=torch.int32)
    >>> query_start_loc = torch.tensor([0, 4], dtype=torch.int32)  # the last 4 are new
    >>> out = paged_attention_reference(
    ...     torch.randn(4, 2, 8), k_cache, v_cache, block_table, seq_lens, query_start_loc)
    >>> out.shape
    torch.Size([4, 2, 8])
    """
    check_paged_inputs(query, k_cache, v_cache, block_table, seq_lens, REFERENCE_DTYPES)
    num_reqs = seq_lens.shape[0]
    check_tensor(
        "query_start_loc",
        query_start_loc,
        dtype=torch.int32,
        shape=(num_reqs + 1,),
        device=query.device,
    )
    window = check_sliding_window(sliding_window)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    scale = resolve_scale(scale, head_dim)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    _check_lengths(starts, lens, query.shape[0], block_table.shape[1] * block_size)

    group_size = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    for r in range(num_reqs):
        query_len, seq_len = starts[r + 1] - starts[r], lens[r]
        if query_len == 0:
            continue
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        # Only positions the first query can see are read: out-of-window blocks may be null.
        first = 0 if window is None else max(0, seq_len - query_len - window + 1)
        kv_pos = torch.arange(first, seq_len, device=query.device)
        block_ids = block_table[r, kv_pos // block_size].long()
        _check_block_ids(block_ids, kv_pos // block_size, r, num_blocks)
        k = k_cache[block_ids, kv_pos % block_size].double().repeat_interleave(group_size, 1)
        v = v_cache[block_ids, kv_pos % block_size].double().repeat_interleave(group_size, 1)
        q = query[starts[r] : starts[r + 1]].double()

        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        visible = kv_pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= kv_pos[None, :] > q_pos[:, None] - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[starts[r] : starts[r + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def _check_lengths(starts: list[int], lens: list[int], num_tokens: int, max_seq_len: int) -> None:
    if starts[0] != 0 or starts[-1] > num_tokens:
        raise ValueError(
            f"query_start_loc must start at 0 and end at most at num_tokens={num_tokens}, "
            f"got {starts[0]} and {starts[-1]}"
        )
    for r, seq_len in enumerate(lens):
        query_len = starts[r + 1] - starts[r]
        if query_len < 0:
            raise ValueError(f"query_start_loc must be non-decreasing, got {starts[r : r + 2]}")
        if not query_len <= seq_len <= max_seq_len:
            raise ValueError(
                f"seq_lens[{r}]={seq_len} must lie in [query_len={query_len}, "
                f"width * block_size={max_seq_len}]"
            )


def _check_block_ids(
    block_ids: torch.Tensor, block_indices: torch.Tensor, row: int, num_blocks: int
) -> None:
    bad = ((block_ids < 0) | (block_ids >= num_blocks)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise IndexError(
            f"block_table[{row}, {int(block_indices[i])}]={int(block_ids[i])} is out of range "
            f"[0, num_blocks={num_blocks})"
        )
