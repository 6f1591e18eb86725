"""Which cache rows move: a request's tokens mapped through each side's own slot formula.

Both sides place token ``p`` of a request at slot ``block_ids[p // block_size] * block_size +
p % block_size`` (the table's slot mapping; with kernel blocks the slot is the same number).
The transfer moves *chunks* of ``chunk_tokens = gcd(block_size_a, block_size_b)`` tokens: a
chunk starting at a multiple of ``chunk_tokens`` lies inside one block on both sides, so its
slots are contiguous on both and it is one row of the cache viewed as
``[num_layers * 2, num_slots // chunk_tokens, chunk_tokens * num_kv_heads * head_dim]``.
Equal block sizes make chunks whole blocks; different ones need no other code. A prompt of
12 tokens, prefill blocks of 4 tokens, decode blocks of 8 (chunks of 4)::

    tokens            0..3    4..7    8..11
    prefill blocks    7       2       9        -> prefill rows 7, 2, 9
    decode blocks     3 (tokens 0..7)  5       -> decode rows  6, 7, 10
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def chunk_tokens_of(block_size_a: int, block_size_b: int) -> int:
    """Tokens per transferred chunk: the largest run contiguous in both caches."""
    return math.gcd(block_size_a, block_size_b)


def slots_reference(block_ids: Sequence[int], block_size: int, positions: Sequence[int]
                    ) -> list[int]:
    """The slot of each token position (plain Python; the reference for :func:`chunk_rows`)."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


def chunk_rows(block_ids: Sequence[int] | np.ndarray, block_size: int, chunk_tokens: int,
               first_token: int, num_tokens: int) -> np.ndarray:
    """Cache rows (in chunks of ``chunk_tokens``) holding tokens ``[first_token,
    first_token + num_tokens)``, in token order.

    Parameters
    ----------
    block_ids : sequence of int
        The request's manager block ids, ``[>= ceil((first_token + num_tokens) / block_size)]``.
    block_size : int
        Tokens per manager block on this side.
    chunk_tokens : int
        Divides ``block_size`` and ``first_token``.

    Returns
    -------
    np.ndarray
        int64 ``[ceil(num_tokens / chunk_tokens)]`` on cpu: row ``r`` holds slots
        ``[r * chunk_tokens, (r + 1) * chunk_tokens)``. A last partial chunk moves whole (its
        tail slots belong to the same block on both sides and are overwritten later).
    """
    if block_size % chunk_tokens or first_token % chunk_tokens:
        raise ValueError(
            f"chunk_tokens ({chunk_tokens}) must divide block_size ({block_size}) and "
            f"first_token ({first_token})"
        )
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    ids = np.asarray(block_ids, dtype=np.int64)
    starts = np.arange(first_token, first_token + num_tokens, chunk_tokens, dtype=np.int64)
    if starts.size and (starts[-1] // block_size) >= ids.size:
        raise ValueError(
            f"block_ids holds {ids.size} blocks of {block_size} tokens; tokens up to "
            f"{first_token + num_tokens} need {-(-(first_token + num_tokens) // block_size)}"
        )
    slots = ids[starts // block_size] * block_size + starts % block_size
    return slots // chunk_tokens


def num_blocks_touched(block_size: int, first_token: int, num_tokens: int) -> int:
    """Blocks of ``block_size`` that tokens ``[first_token, first_token + num_tokens)``
    write into (``first_token`` is block-aligned: the tokens past a prefix hit)."""
    return -(-(first_token + num_tokens) // block_size) - first_token // block_size
