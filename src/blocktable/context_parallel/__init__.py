"""Context parallelism across processes: merging the partial attention of every rank.

- :func:`merge_attention_reference`: the exact merge in float64, the definition.
- :class:`AttentionMerger`: the merge over a ``torch.distributed`` group (gloo on CPU, NCCL on
  GPUs) with persistent buffers, one Triton launch on CUDA, capturable in a CUDA graph; with
  ``transport="p2p"`` (GPUs of one node) no collective at all: one kernel per call that writes
  into the peers' symmetric memory.
- :class:`ConfigMismatchError`, :class:`CallMismatchError`: the ranks disagree on a setting
  (found once, at construction) or call the merge out of step (found at the call).
"""

from __future__ import annotations

from blocktable.context_parallel.agreement import ConfigMismatchError
from blocktable.context_parallel.merge import (
    PATTERNS,
    TRANSPORTS,
    AttentionMerger,
    CallMismatchError,
)
from blocktable.context_parallel.reference import merge_attention_reference

__all__ = [
    "PATTERNS",
    "TRANSPORTS",
    "AttentionMerger",
    "CallMismatchError",
    "ConfigMismatchError",
    "merge_attention_reference",
]
