"""A Llama forward over a paged KV cache: blocktable's slot mapping writes, its table reads.

The weights (and the norm, MLP and rotary modules) come from a Hugging Face
``LlamaForCausalLM``; the attention is ours, so nothing here depends on transformers' attention
or cache internals. One step's tokens of all requests are flattened into ``[num_tokens]``
(varlen, no padding); per layer, K and V are scattered into the cache by slot mapping
(:func:`blocktable.kv_write.write_kv_cache`) and attention reads them back through the block
table, each request through its own table row (``row_of_batch``): no per-step copy of the table.
On CUDA that is :func:`blocktable.attention.paged_attention`'s Triton kernels; on the CPU the
batched torch attention of :mod:`blocktable.attention.torch_paged` in the model's dtype, planned
once per step for all layers (the float64 reference on request, for tests).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from blocktable.attention import paged_attention
from blocktable.attention.torch_paged import (
    TorchAttentionPlan,
    plan_torch_attention,
    torch_paged_attention,
)
from blocktable.kv_write import write_kv_cache

HFLlama = Any
"""A transformers ``LlamaForCausalLM`` (typed loosely: its submodules are found by name)."""


@dataclass(frozen=True)
class AttentionInputs:
    """What attention needs for one step, all on the model's device.

    Attributes
    ----------
    slot_mapping : torch.Tensor
        int64 ``[>= num_tokens]``: cache slot of each token (``PAD_SLOT_ID`` past the end).
    block_table : torch.Tensor
        int32 ``[max_num_reqs, width]``: the whole committed device table.
    row_of_batch : torch.Tensor
        int32 ``[num_reqs]``: the table row of each request of the batch.
    seq_lens : torch.Tensor
        int32 ``[num_reqs]``: tokens in the cache per request after this step.
    query_start_loc : torch.Tensor
        int32 ``[num_reqs + 1]``: request ``r``'s tokens are ``[qsl[r], qsl[r+1])``.
    max_query_len : int
        Host value: the most tokens any request has this step (1 on decode steps).
    min_query_len : int
        Host value: the fewest tokens any request has this step (0 when unknown): on a step
        of prompt chunks only, attention runs its prefill kernel alone.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    row_of_batch: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    min_query_len: int = 0
    torch_plan: TorchAttentionPlan | None = None


def tiny_llama(
    *,
    seed: int = 0,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    device: str | torch.device = "cpu",
) -> HFLlama:
    """A randomly initialized float32 ``LlamaForCausalLM`` small enough for a CPU test.

    ``initializer_range=0.2`` (instead of 0.02) spreads the logits so that greedy choices are
    not near-ties that float rounding could flip. No EOS token: generation runs to its length.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model: HFLlama = LlamaForCausalLM(config)
    return model.to(device=device, dtype=torch.float32).eval()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedLlama:
    """Runs a ``LlamaForCausalLM``'s layers over flattened varlen tokens and a paged KV cache.

    Parameters
    ----------
    hf_model : LlamaForCausalLM
        Source of weights and of the norm, MLP and rotary-embedding modules.
    num_blocks, block_size : int
        KV-cache geometry: ``num_blocks`` blocks (block 0 is the null block) of ``block_size``
        token slots, the block size the table's ids refer to.
    backend : {"torch", "triton"}
        Kernels for the KV write and attention: Triton (every step, any block size), or torch
        (CPU engines).
    attention : {"batched", "reference"}
        With the torch backend: batched torch ops in the model's dtype
        (:mod:`blocktable.attention.torch_paged`), or the float64 reference (slow; tests).

    Attributes
    ----------
    kv_cache : torch.Tensor
        ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` on the model's
        device, the model's dtype; ``kv_cache[layer, 0]`` holds keys, ``[layer, 1]`` values.
    """

    def __init__(
        self, hf_model: HFLlama, num_blocks: int, block_size: int, backend: str = "torch",
        attention: str = "batched",
    ) -> None:
        if attention not in ("batched", "reference"):
            raise ValueError(f"attention must be 'batched' or 'reference', got {attention!r}")
        config = hf_model.config
        self.backend = backend
        # A subclass with its own attention (context parallelism) needs no plan of ours.
        self.batched_torch = (backend == "torch" and attention == "batched"
                              and type(self)._attend is PagedLlama._attend)
        self.block_size = block_size
        self.hf = hf_model.eval()
        self.layers = hf_model.model.layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale: float = self.head_dim**-0.5
        weight = hf_model.lm_head.weight
        self.kv_cache = torch.zeros(
            len(self.layers), 2, num_blocks, block_size, self.num_kv_heads, self.head_dim,
            dtype=weight.dtype, device=weight.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionInputs,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step; return the logits of the tokens at ``logits_indices``.

        Parameters
        ----------
        input_ids, positions : torch.Tensor
            int64 ``[num_tokens]`` on the model's device: this step's tokens, request after
            request, and their positions in their sequences.
        attn : AttentionInputs
            Slot mapping, block table and lengths of this step.
        logits_indices : torch.Tensor
            int64 ``[n]``: which tokens need logits (usually each request's last).

        Returns
        -------
        torch.Tensor
            float32 ``[n, vocab_size]`` on the model's device.
        """
        num_tokens = input_ids.shape[0]
        if self.batched_torch:  # one plan (gather indices, masks) for every layer
            attn = replace(attn, torch_plan=plan_torch_attention(
                attn.block_table, attn.seq_lens, attn.query_start_loc, self.block_size,
                attn.row_of_batch))
        hidden = self.hf.model.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        # cos/sin: [1, num_tokens, head_dim] -> [num_tokens, 1, head_dim], shared by all heads.
        cos, sin = self.hf.model.rotary_emb(hidden, positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        for layer_idx, layer in enumerate(self.layers):
            attn_mod = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn_mod.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
            k = attn_mod.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = attn_mod.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = self.kv_cache[layer_idx, 0], self.kv_cache[layer_idx, 1]
            write_kv_cache(k, v, k_cache, v_cache, attn.slot_mapping, backend=self.backend)
            out = self._attend(q, k_cache, v_cache, attn)
            hidden = hidden + attn_mod.o_proj(out.reshape(num_tokens, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.hf.model.norm(hidden[logits_indices])
        return self.hf.lm_head(hidden).float()

    __call__ = forward

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionInputs
    ) -> torch.Tensor:
        if attn.torch_plan is not None:
            return torch_paged_attention(q, k_cache, v_cache, attn.torch_plan, self.scale)
        out = paged_attention(
            q, k_cache, v_cache, attn.block_table, attn.seq_lens, attn.query_start_loc,
            scale=self.scale, row_of_batch=attn.row_of_batch, max_query_len=attn.max_query_len,
            min_query_len=attn.min_query_len, backend=self.backend,
        )
        assert isinstance(out, torch.Tensor)  # no log-sum-exp asked for
        return out
