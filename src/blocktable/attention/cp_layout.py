"""Where a rank's keys sit in the global sequence when context parallelism shards the KV cache.

With ``W = cp.world_size`` ranks, interleave ``I`` and manager block size ``M`` (the ownership
unit), global position ``p`` lies in virtual block ``j = p // (M*W)`` at offset ``v = p % (M*W)``
and belongs to rank ``(v // I) % W``. On its owner it is *local position*
``l = j*M + (v // (W*I))*I + v % I``: rank ``r``'s keys, in global order, are its local
positions ``0, 1, 2, ...``, read through the table row like an unsharded sequence (kernel block
``l // block_size``, offset ``l % block_size``). Without CP (``W = 1``) local and global
positions are equal.

::

    M = 4, W = 2, I = 2                 global positions 0..15
    rank 0 owns  0  1  4  5 |  8  9 12 13      local 0..7
    rank 1 owns  2  3  6  7 | 10 11 14 15      local 0..7
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class CPLayout:
    """Where this rank's keys sit, as the kernels take it (``(1, 0, 1, 1)``: no CP)."""

    world_size: int = 1
    rank: int = 0
    interleave: int = 1
    block_size: int = 1  # the manager block size: the unit of ownership


def local_seq_len(
    seq_len: int | np.ndarray,
    *,
    world_size: int,
    rank: int,
    interleave: int,
    manager_block_size: int,
) -> int | np.ndarray:
    """How many of the global positions ``[0, seq_len)`` rank ``rank`` owns (numpy or int)."""
    virtual = manager_block_size * world_size
    stride = world_size * interleave
    rem = seq_len % virtual
    in_round = np.clip(rem % stride - rank * interleave, 0, interleave)
    out = (seq_len // virtual) * manager_block_size + (rem // stride) * interleave + in_round
    return int(out) if np.ndim(out) == 0 else out


def global_positions(
    local_positions: np.ndarray,
    *,
    world_size: int,
    rank: int,
    interleave: int,
    manager_block_size: int,
) -> np.ndarray:
    """Global position of each of rank ``rank``'s local positions (int64, same shape)."""
    local = np.asarray(local_positions, dtype=np.int64)
    offset = local % manager_block_size
    return (
        (local // manager_block_size) * manager_block_size * world_size
        + (offset // interleave) * world_size * interleave
        + rank * interleave
        + offset % interleave
    )
