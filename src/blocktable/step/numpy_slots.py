"""The CPU backend's slot mapping for a captured step, whose batch has already been checked.

:func:`blocktable.slot_mapping.torch_impl.slot_mapping_numpy` serves any batch: it finds each
token's request with a search, clamps rows and positions, and re-checks what it reads. A
captured step has checked its batch before (``query_start_loc`` well formed, rows inside the
table), so :class:`CheckedSlots` keeps only the per-token work, with the views and row bases
prepared once: for a decode batch (one token per request) token ``t`` belongs to request
``t`` and needs no search. Groups with context parallelism, a kernel block size that is not a
power of two, or a negative position take the general function. Results are bit-identical to
it (the tests compare them on random steps).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from blocktable.slot_mapping.params import SlotGroupParams
from blocktable.slot_mapping.torch_impl import slot_mapping_numpy


class _Group(NamedTuple):
    counts: np.ndarray  # on cpu, int32 [max_num_reqs]: view of the group's counts
    table: np.ndarray  # on cpu, int32 [max_num_reqs * width]: view of the group's table
    row_base: np.ndarray  # int64 [max_num_reqs]: row * width
    shift: int  # log2 of the kernel block size
    mask: int  # kernel block size - 1
    kernel_block_size: int


class CheckedSlots:
    """Slot mapping of checked batches into ``out`` (int64 ``[groups, max_num_tokens]``).

    Parameters
    ----------
    flat_table : np.ndarray
        int32 ``[num_entries]``, the flat table buffer (on cpu) the slots are read from.
    params : list of SlotGroupParams
        One per token-slot group, the row of ``out`` it fills.
    max_num_reqs : int
        Rows of each group's table.
    max_num_tokens : int
        Most tokens in a batch.
    """

    def __init__(self, flat_table: np.ndarray, params: list[SlotGroupParams],
                 max_num_reqs: int, max_num_tokens: int) -> None:
        self.flat_table = flat_table
        self.params = params
        self.max_num_reqs = max_num_reqs
        self.fast = all(p.cp_world_size == 1 and p.kernel_block_size & (p.kernel_block_size - 1)
                        == 0 for p in params)
        self.groups = [
            _Group(
                flat_table[p.counts_offset : p.counts_offset + max_num_reqs],
                flat_table[p.table_offset : p.table_offset + max_num_reqs * p.width],
                np.arange(max_num_reqs, dtype=np.int64) * p.width,
                p.kernel_block_size.bit_length() - 1,
                p.kernel_block_size - 1,
                p.kernel_block_size,
            )
            for p in params
        ] if self.fast else []
        self._tokens = np.arange(max_num_tokens, dtype=np.int32)

    def map(self, qsl: np.ndarray, positions: np.ndarray, rows: np.ndarray,
            out: np.ndarray, decode: bool) -> None:
        """Fill ``out[:, :num_tokens]`` (``num_tokens = len(positions)``).

        ``qsl`` int32 ``[num_reqs + 1]`` starts at 0, never decreases and ends at
        ``num_tokens``; ``rows`` int32 ``[num_reqs]`` lie in ``[0, max_num_reqs)``;
        ``decode``: ``qsl`` is ``0, 1, ..., num_reqs`` (one token per request).
        """
        num_tokens = len(positions)
        if not num_tokens:
            return
        # argmin rather than np.minimum.reduce: about half the cost with cold caches
        if not self.fast or positions[positions.argmin()] < 0:
            slot_mapping_numpy(self.flat_table, self.params, qsl, positions, rows, out,
                               self.max_num_reqs)
            return
        if decode:
            token_rows = rows
        else:
            token_rows = rows.take(qsl[1:].searchsorted(self._tokens[:num_tokens], side="right"))
        for g, out_g in zip(self.groups, out):
            block_index = positions >> g.shift
            no_slot = block_index >= g.counts.take(token_rows)
            entry = g.row_base.take(token_rows)
            entry += block_index
            # a block index past the row's count may read another row's entry: PAD anyway
            block_id = g.table.take(entry, mode="clip")
            no_slot |= block_id == NULL_BLOCK_ID
            np.multiply(block_id, g.kernel_block_size, out=out_g)
            out_g += positions & g.mask
            np.putmask(out_g, no_slot, PAD_SLOT_ID)
