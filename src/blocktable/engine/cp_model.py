"""The paged Llama of one context-parallel rank: attend over this rank's KV shard, then merge.

Every rank runs the whole (replicated) model on every token of the step. Per layer it writes
only the keys and values it owns (the table maps other ranks' tokens to ``PAD_SLOT_ID``, which
the KV writer skips), attends every query over its own keys with
:func:`~blocktable.attention.paged_attention` (global causal positions, log-sum-exp returned),
and the ranks merge their partial outputs exactly with an attention merger (all-reduce,
all-gather + reduce-scatter, or all-to-all), so every rank continues with the same full output.
"""

from __future__ import annotations

from typing import Protocol

import torch

from blocktable.attention import paged_attention
from blocktable.config import CPConfig
from blocktable.engine.model import AttentionInputs, HFLlama, PagedLlama


class Merger(Protocol):
    """What the model needs of an attention merger (``blocktable.context_parallel``)."""

    def merge(
        self, out: torch.Tensor, lse: torch.Tensor, *, gather_heads: bool = False,
        step: int | None = None,
    ) -> torch.Tensor:
        """``step``: the engine's step, which a merger may compare between the ranks."""
        ...


class CPPagedLlama(PagedLlama):
    """:class:`~blocktable.engine.model.PagedLlama` whose attention is sharded over CP ranks.

    Parameters
    ----------
    hf_model : LlamaForCausalLM
        The model, the same weights on every rank.
    num_blocks, block_size : int
        This rank's KV cache: ``num_blocks`` blocks of ``block_size`` tokens (kernel blocks).
    backend : {"torch", "triton"}
        KV-write and attention kernels (``"torch"``: the float64 reference attention).
    cp : CPConfig
        This rank's place in the CP group (world, rank, interleave).
    cp_block_size : int
        The table's manager block size: the unit in which CP ownership is decided.
    merger : Merger
        Merges per-rank outputs and LSEs into the full output (all heads, on every rank).

    Attributes
    ----------
    num_empty_queries : torch.Tensor
        int64 scalar on the model's device: query tokens (of layer 0, head 0) for which this
        rank held no visible key, summed over steps (read it with ``int()`` at the end).
    step : int or None
        The engine's step, set before each forward and handed to every merge.
    """

    def __init__(
        self,
        hf_model: HFLlama,
        num_blocks: int,
        block_size: int,
        backend: str,
        *,
        cp: CPConfig,
        cp_block_size: int,
        merger: Merger,
    ) -> None:
        super().__init__(hf_model, num_blocks, block_size, backend)
        self.cp = cp
        self.cp_block_size = cp_block_size
        self.merger = merger
        self.step: int | None = None
        device = hf_model.lm_head.weight.device
        self.num_empty_queries = torch.zeros((), dtype=torch.int64, device=device)

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionInputs
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        out, lse = paged_attention(
            q, k_cache, v_cache, attn.block_table, attn.seq_lens, attn.query_start_loc,
            scale=self.scale, row_of_batch=attn.row_of_batch, max_query_len=attn.max_query_len,
            min_query_len=attn.min_query_len, cp=self.cp, cp_block_size=self.cp_block_size, return_lse=True, backend=self.backend,
        )
        if k_cache.data_ptr() == self.kv_cache[0, 0].data_ptr():  # layer 0: once per step
            self.num_empty_queries += torch.isinf(lse[:num_tokens, 0]).sum()  # no host sync
        return self.merger.merge(out, lse, gather_heads=True, step=self.step)[:num_tokens]
