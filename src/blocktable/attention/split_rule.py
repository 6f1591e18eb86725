"""Bounds of the decode kernel's shape rules (how many splits, which combine), shared by the
launcher and the split count without Triton: the launcher imports them on any install."""

from __future__ import annotations

FUSED_COMBINE_MAX_PROGRAMS = 16  # num_reqs * num_kv_heads up to which the combine is fused
DECODE_LONG_SPLIT_KEYS = 2048  # keys per split (of the widest row) from which a split is long
