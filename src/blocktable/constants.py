"""Constants shared by every layer of blocktable."""

from __future__ import annotations

NULL_BLOCK_ID: int = 0
"""Block 0 is reserved: never handed out; pad rows and "no block here" entries hold it."""

PAD_SLOT_ID: int = -1
"""A slot-mapping entry that KV writers must skip (padding, or a token another rank owns)."""

ROW_ALIGN_TOKENS: int = 128
"""Rows span a multiple of this many tokens (vLLM's rule, needed by some attention kernels)."""
