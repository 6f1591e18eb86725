"""Paged attention that reads K/V through the block table.

- :func:`paged_attention_reference`: varlen causal attention in plain torch (float64), the
  definition every kernel is tested against.
- :func:`paged_attention`: any mix of prefill, chunks and decode in one call, with optional
  log-sum-exp output and context-parallel shards.
- :func:`paged_decode_attention`: one query token per request, a Triton kernel on CUDA.
- :class:`PagedAttention`: the Triton path as an object that plans a step once
  (:meth:`~PagedAttention.plan`), runs it per layer and owns its split-KV workspace;
  :class:`KernelConfig` holds what it lets you tune.
"""

from __future__ import annotations

from blocktable.attention.decode import paged_decode_attention
from blocktable.attention.kernel_config import KernelConfig
from blocktable.attention.paged import paged_attention
from blocktable.attention.planner import AttentionPlan, PagedAttention
from blocktable.attention.reference import paged_attention_reference

__all__ = [
    "AttentionPlan",
    "KernelConfig",
    "PagedAttention",
    "paged_attention",
    "paged_attention_reference",
    "paged_decode_attention",
]
