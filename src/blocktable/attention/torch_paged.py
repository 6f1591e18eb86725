"""Paged attention in batched torch ops, in the cache's dtype: the CPU engine's attention.

One step is planned once (:func:`plan_torch_attention`: which cache slots each request reads,
which of them each query sees) and the plan serves every layer
(:func:`torch_paged_attention`). Requests are split into two groups, one query token each
(decode) and longer (prefill chunks), so that a decode batch is never padded to a prompt's
length; each group is one ``scaled_dot_product_attention`` call over its keys gathered from
the cache. :func:`~blocktable.attention.reference.paged_attention_reference` (float64, a loop
over requests) stays the definition this is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class _Group:
    """Requests of one step attended by one call.

    Attributes
    ----------
    token_index : torch.Tensor
        int64 ``[num_group_tokens]``: each of the group's query tokens in the step's
        flattened tokens.
    padded_index : torch.Tensor
        int64 ``[num_group_tokens]``: where that token sits in ``[num_group_reqs *
        max_query_len]`` (request-major, padded).
    slots : torch.Tensor
        int64 ``[num_group_reqs, max_seq_len]``: flat cache slot (``block * block_size +
        offset``) of each key a request reads; slot 0 past its length (masked out).
    mask : torch.Tensor or None
        bool ``[num_group_reqs, 1, max_query_len, max_seq_len]``: True where a query sees a
        key; ``None`` when there is no padding and no causality to mask (decode with equal
        lengths).
    max_query_len : int
    """

    token_index: torch.Tensor
    padded_index: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None
    max_query_len: int


@dataclass(frozen=True)
class TorchAttentionPlan:
    """One step's attention plan, shared by every layer (see :func:`plan_torch_attention`)."""

    num_tokens: int
    groups: tuple[_Group, ...]


def plan_torch_attention(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    row_of_batch: torch.Tensor | None = None,
) -> TorchAttentionPlan:
    """Plan one step of :func:`torch_paged_attention` (reads the lengths on the host).

    Parameters
    ----------
    block_table : torch.Tensor
        int32 ``[>= num_reqs, width]``: kernel block ids, row ``r`` for request ``r`` unless
        ``row_of_batch`` says otherwise.
    seq_lens : torch.Tensor
        int32 ``[num_reqs]``: tokens in each request's cache after this step (>= 1).
    query_start_loc : torch.Tensor
        int32 ``[num_reqs + 1]``: request ``r``'s queries are tokens ``[qsl[r], qsl[r+1])``,
        its last ``qsl[r+1] - qsl[r]`` positions.
    block_size : int
        Tokens per block of the cache the table's ids refer to.
    row_of_batch : torch.Tensor, optional
        int32 ``[num_reqs]``: the table row of each request.

    Returns
    -------
    TorchAttentionPlan
        Index tensors on ``block_table``'s device.
    """
    device = block_table.device
    qsl = query_start_loc.to("cpu", torch.int64)
    lens = seq_lens.to("cpu", torch.int64)
    num_reqs = lens.shape[0]
    query_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
    rows = (torch.arange(num_reqs) if row_of_batch is None
            else row_of_batch[:num_reqs].to("cpu", torch.int64))
    table = block_table.to("cpu", torch.int64)
    is_decode = query_lens == 1
    groups = []
    for members in (is_decode.nonzero().squeeze(1), (~is_decode).nonzero().squeeze(1)):
        if members.numel():
            groups.append(_plan_group(table[rows[members]], lens[members], qsl[members],
                                      query_lens[members], block_size, device))
    return TorchAttentionPlan(int(qsl[num_reqs]), tuple(groups))


def _plan_group(
    table_rows: torch.Tensor,  # int64 [n, width] on cpu
    seq_lens: torch.Tensor,  # int64 [n] on cpu
    starts: torch.Tensor,  # int64 [n] on cpu: each request's first query token
    query_lens: torch.Tensor,  # int64 [n] on cpu
    block_size: int,
    device: torch.device,
) -> _Group:
    max_seq_len = int(seq_lens.max())
    max_query_len = int(query_lens.max())
    key_pos = torch.arange(max_seq_len)
    blocks = table_rows[:, key_pos // block_size]  # [n, max_seq_len]
    slots = blocks * block_size + key_pos % block_size
    in_seq = key_pos[None, :] < seq_lens[:, None]
    slots = torch.where(in_seq, slots, 0)
    query_off = torch.arange(max_query_len)
    # query i of request r sits at position seq_len - query_len + i and sees keys up to it
    query_pos = (seq_lens - query_lens)[:, None] + query_off[None, :]  # [n, max_query_len]
    mask: torch.Tensor | None = None
    if max_query_len > 1 or bool((seq_lens != max_seq_len).any()):
        visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & in_seq[:, None, :]
        # pad queries see key 0 only, so that no row of the softmax is empty
        visible[:, :, 0] = True
        mask = visible[:, None].to(device)
    in_query = query_off[None, :] < query_lens[:, None]  # [n, max_query_len]
    padded_index = in_query.reshape(-1).nonzero().squeeze(1)
    token_index = (starts[:, None] + query_off[None, :]).reshape(-1)[padded_index]
    return _Group(token_index.to(device), padded_index.to(device), slots.to(device), mask,
                  max_query_len)


def torch_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Causal paged attention of one planned step, in the cache's dtype.

    Parameters
    ----------
    query : torch.Tensor
        ``[>= num_tokens, num_heads, head_dim]``, the cache's dtype and device; ``num_heads``
        a multiple of ``num_kv_heads``. Rows past ``plan.num_tokens`` get zeros.
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
    plan : TorchAttentionPlan
        From :func:`plan_torch_attention` for this step.
    scale : float
        Multiplies ``q . k``.

    Returns
    -------
    torch.Tensor
        ``[query.shape[0], num_heads, head_dim]``, the query's dtype and device.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    keys = k_cache.view(-1, num_kv_heads, head_dim)
    values = v_cache.view(-1, num_kv_heads, head_dim)
    out = query.new_zeros(query.shape)
    for g in plan.groups:
        n = g.slots.shape[0]
        q = query.new_zeros(n * g.max_query_len, num_heads, head_dim)
        q[g.padded_index] = query[g.token_index]
        q = q.view(n, g.max_query_len, num_heads, head_dim).transpose(1, 2)
        k = keys[g.slots].transpose(1, 2)  # [n, num_kv_heads, max_seq_len, head_dim]
        v = values[g.slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        o = o.transpose(1, 2).reshape(n * g.max_query_len, num_heads, head_dim)
        out[g.token_index] = o[g.padded_index]
    return out
