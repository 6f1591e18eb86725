"""The exact merge of partial attention states, in float64: what every merge path must equal.

Rank ``r`` of a context-parallel group attends over its shard of the keys and returns, per
query token and head, its partial output ``o_r`` (softmax-weighted over its own keys only) and
the natural-log log-sum-exp ``lse_r`` of its scores (``-inf`` where it holds no visible key).
The attention over all keys is then::

    m   = max_r lse_r                     (0 where every lse_r is -inf)
    lse = m + ln sum_r exp(lse_r - m)
    o   = sum_r exp(lse_r - lse) * o_r    (0 where every lse_r is -inf)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blocktable._checks import check_tensor


def merge_attention_reference(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the partial attention states of every rank, in float64.

    Parameters
    ----------
    outs : sequence of torch.Tensor
        One per rank, ``[num_tokens, num_heads, head_dim]``, any float dtype, any device.
    lses : sequence of torch.Tensor
        One per rank, ``[num_tokens, num_heads]``, any float dtype, natural log; ``-inf`` where
        the rank holds no key of that query (its ``out`` row is then ignored).

    Returns
    -------
    out : torch.Tensor
        float64 ``[num_tokens, num_heads, head_dim]`` on the inputs' device; zeros in rows
        where every rank's LSE is ``-inf``.
    lse : torch.Tensor
        float64 ``[num_tokens, num_heads]``; ``-inf`` where every rank's LSE is ``-inf``.

    Examples
    --------
    >>> import math, torch
    >>> o0, o1 = torch.ones(1, 1, 2), 3 * torch.ones(1, 1, 2)
    >>> l0 = torch.tensor([[0.0]]); l1 = torch.tensor([[math.log(3.0)]])
    >>> out, lse = merge_attention_reference([o0, o1], [l0, l1])
    >>> [round(x, 5) for x in out.flatten().tolist()], round(lse.item(), 5) == round(math.log(4), 5)
    ([2.5, 2.5], True)
    """
    if len(outs) != len(lses):
        raise ValueError(
            f"outs and lses must have one entry per rank, got {len(outs)} and {len(lses)}"
        )
    if len(outs) == 0:
        raise ValueError("outs must hold at least one rank's partial output")
    first = check_tensor("outs[0]", outs[0], ndim=3)
    num_tokens, num_heads, head_dim = first.shape
    for r, (o, lse) in enumerate(zip(outs, lses)):
        check_tensor(f"outs[{r}]", o, shape=[num_tokens, num_heads, head_dim])
        check_tensor(f"lses[{r}]", lse, shape=[num_tokens, num_heads])
    o = torch.stack([t.to(torch.float64) for t in outs])  # [world, T, H, D]
    lse = torch.stack([t.to(torch.float64) for t in lses])  # [world, T, H]
    m = lse.amax(dim=0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    weight = torch.exp(lse - m)  # exp(-inf) = 0: empty shards drop out
    total = weight.sum(dim=0)
    merged_lse = m + torch.log(total)  # log(0) = -inf where every rank is empty
    scale = torch.where(total > 0, weight / total, torch.zeros_like(weight))
    contrib = torch.where(scale[..., None] > 0, o * scale[..., None], torch.zeros_like(o))
    return contrib.sum(dim=0), merged_lse
