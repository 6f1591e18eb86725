"""Paged attention in plain torch, one request at a time: the reference every kernel must match.

Request ``r`` has ``seq_len = seq_lens[r]`` tokens in its sequence, the last
``query_len = query_start_loc[r+1] - query_start_loc[r]`` of them being this step's queries.
Query ``i`` sits at position ``seq_len - query_len + i`` and attends every position ``k`` with
``k <= position`` (causal) and, with a sliding window, ``k > position - sliding_window``.
Position ``k`` is read from ``cache[block_table[row, k // block_size], k % block_size]``;
positions no query can see are never read, so out-of-window entries may hold ``NULL_BLOCK_ID``.

Under context parallelism the cache holds only this rank's keys, at *local* positions (see
:mod:`blocktable.attention.cp_layout`); queries still attend by *global* position, so a rank
computes its share of every query's attention and returns the log-sum-exp that lets the ranks
merge their shares exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from blocktable._checks import check_tensor
from blocktable.attention._inputs import (
    check_paged_inputs,
    check_sliding_window,
    cp_layout_args,
    resolve_scale,
)
from blocktable.attention.cp_layout import global_positions, local_seq_len
from blocktable.config import CPConfig

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
    row_of_batch: torch.Tensor | None = None,
    cp: CPConfig | None = None,
    cp_block_size: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
        int32 ``[>= num_reqs, width]``, kernel block ids; row ``r`` belongs to request ``r``
        unless ``row_of_batch`` says otherwise.
    seq_lens : torch.Tensor
        int32 ``[num_reqs]``, tokens in each request's whole sequence (on all CP ranks
        together), this step's included.
    query_start_loc : torch.Tensor
        int32 ``[num_reqs + 1]``, request ``r``'s queries are tokens
        ``[query_start_loc[r], query_start_loc[r+1])``.
    scale : float, optional
        Multiplies ``q . k``; default ``1 / sqrt(head_dim)``.
    sliding_window : int, optional
        Tokens a query sees, itself included; ``None`` for full attention.
    row_of_batch : torch.Tensor, optional
        int32 ``[num_reqs]``, the table row of each request (indexed mode).
    cp : CPConfig, optional
        Context parallelism: the cache holds rank ``cp.rank``'s keys only, at local positions;
        ``None`` or world 1 means the whole sequence is here.
    cp_block_size : int, optional
        The manager block size (tokens) in which CP ownership is decided; a multiple of the
        cache's block size; defaults to it.
    return_lse : bool
        Also return the natural-log log-sum-exp of each query's visible scores
        (``scale * q . k``): float32 ``[num_tokens, num_heads]``, ``-inf`` (and a zero output)
        where this rank holds no key the query sees, and for pad tokens.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``[num_tokens, num_heads, head_dim]``, the query's dtype and device (and the LSE).

    Raises
    ------
    ValueError
        When a request's query length exceeds its ``seq_len``, or the keys this rank holds
        exceed the row's ``width * block_size``, or ``query_start_loc`` is not a valid offset
        vector, or the CP block size / interleave do not fit the cache's block size.
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
    layout = cp_layout_args(cp, cp_block_size, block_size)
    rows = list(range(num_reqs))
    if row_of_batch is not None:
        check_tensor(
            "row_of_batch", row_of_batch, dtype=torch.int32, shape=(num_reqs,), device=query.device
        )
        rows = row_of_batch.tolist()
        for r, row in enumerate(rows):
            if not 0 <= row < block_table.shape[0]:
                raise IndexError(
                    f"row_of_batch[{r}]={row} is out of range [0, {block_table.shape[0]}) "
                    "(block_table rows)"
                )
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    local_lens = [int(local_seq_len(n, **layout)) for n in lens]
    _check_lengths(starts, lens, local_lens, query.shape[0], block_table.shape[1] * block_size)

    group_size = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float32, device=query.device)
    for r in range(num_reqs):
        query_len, seq_len = starts[r + 1] - starts[r], lens[r]
        if query_len == 0:
            continue
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        local = np.arange(local_lens[r], dtype=np.int64)
        kv_global = global_positions(local, **layout)
        # Only keys some query of this step sees are read: out-of-window blocks may be null.
        first = 0 if window is None else seq_len - query_len - window + 1
        local = local[kv_global >= first]
        kv_pos = torch.from_numpy(kv_global[kv_global >= first]).to(query.device)
        local_t = torch.from_numpy(local).to(query.device)
        block_ids = block_table[rows[r], local_t // block_size].long()
        _check_block_ids(block_ids, local_t // block_size, rows[r], num_blocks)
        k = k_cache[block_ids, local_t % block_size].double().repeat_interleave(group_size, 1)
        v = v_cache[block_ids, local_t % block_size].double().repeat_interleave(group_size, 1)
        q = query[starts[r] : starts[r + 1]].double()

        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        visible = kv_pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= kv_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [h, q]; -inf where nothing is visible
        seen = torch.isfinite(row_lse)
        probs = torch.where(seen[..., None], (scores - row_lse[..., None]).exp(), 0.0)
        out[starts[r] : starts[r + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        lse[starts[r] : starts[r + 1]] = row_lse.T.float()
    return (out, lse) if return_lse else out


def _check_lengths(
    starts: list[int], lens: list[int], local_lens: list[int], num_tokens: int, max_seq_len: int
) -> None:
    if starts[0] != 0 or starts[-1] > num_tokens:
        raise ValueError(
            f"query_start_loc must start at 0 and end at most at num_tokens={num_tokens}, "
            f"got {starts[0]} and {starts[-1]}"
        )
    for r, seq_len in enumerate(lens):
        query_len = starts[r + 1] - starts[r]
        if query_len < 0:
            raise ValueError(f"query_start_loc must be non-decreasing, got {starts[r : r + 2]}")
        if query_len > seq_len:
            raise ValueError(f"seq_lens[{r}]={seq_len} must be >= its query_len={query_len}")
        if local_lens[r] > max_seq_len:
            raise ValueError(
                f"seq_lens[{r}]={seq_len} puts {local_lens[r]} keys on this rank, more than "
                f"its row holds (width * block_size={max_seq_len})"
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
