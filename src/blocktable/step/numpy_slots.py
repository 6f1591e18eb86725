"""The CPU backend's slot mapping for a captured step, whose batch has already been checked.

:func:`blocktable.slot_mapping.torch_impl.slot_mapping_numpy` serves any batch: it finds each
token's request with a search, clamps rows and positions, and re-checks what it reads. A
captured step has checked its batch before (``query_start_loc`` well formed, rows inside the
table), so :class:`CheckedSlots` keeps only the per-token work, with the views and row bases
prepared once: for a decode batch (one token per request) token ``t`` belongs to request
``t`` and needs no search. A table holds the null block past each row's count (an invariant
every write keeps), so a position inside the row's width but past its count reads the null
block and becomes ``PAD_SLOT_ID`` without comparing it with the count: one range test of the
positions (negative or past a row's width: the general function) replaces that per-token
comparison. Groups with context parallelism take the general function too. Results are
bit-identical to it (the tests compare them on random steps). Where the package's compiled
loops are built, each group's slots are one compiled call (``map_slots``) that does the same.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import numpy as np

from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from blocktable.slot_mapping.params import SlotGroupParams
from blocktable.slot_mapping.torch_impl import slot_mapping_numpy


class _Group(NamedTuple):
    table: np.ndarray  # on cpu, int32 [max_num_reqs * width]: view of the group's table
    width: int  # kernel blocks per row
    size: int  # the kernel block size, in tokens
    row_base: np.ndarray  # int64 [max_num_reqs]: row * width
    shift: int  # log2 of the kernel block size; -1 if it is not a power of two
    # the kernel block size, its log2 and the offset mask as 0-d int64 arrays: a ufunc converts
    # a Python int operand on every call (about a third more with cold caches)
    size_0d: np.ndarray
    shift_0d: np.ndarray
    mask_0d: np.ndarray


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
    native : module or None
        The compiled helpers (:mod:`blocktable._native_loader`), or ``None``: numpy.
    """

    def __init__(self, flat_table: np.ndarray, params: list[SlotGroupParams],
                 max_num_reqs: int, max_num_tokens: int, native: ModuleType | None = None
                 ) -> None:
        self.native = native
        self.flat_table = flat_table
        self.params = params
        self.max_num_reqs = max_num_reqs
        self.fast = all(p.cp_world_size == 1 for p in params)
        self.groups = []
        for p in params if self.fast else []:
            size = p.kernel_block_size
            shift = size.bit_length() - 1 if size & (size - 1) == 0 else -1
            self.groups.append(_Group(
                flat_table[p.table_offset : p.table_offset + max_num_reqs * p.width],
                p.width, size, np.arange(max_num_reqs, dtype=np.int64) * p.width, shift,
                np.array(size, np.int64), np.array(max(shift, 0), np.int64),
                np.array(size - 1, np.int64),
            ))
        # one group (the common model): its compiled call's arguments (table, width, kernel
        # block size), bound once; None for several groups
        self.one_group = (None if len(self.groups) != 1 else
                          (self.groups[0].table, self.groups[0].width, self.groups[0].size))
        self._tokens = np.arange(max_num_tokens, dtype=np.int32)
        # positions in [0, bound) lie inside every group's row width
        self._position_bound = min((p.width * p.kernel_block_size for p in params), default=0)

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
        native = self.native
        if native is not None and self.fast:  # one compiled pass per group
            by_request = None if decode else qsl
            one = self.one_group
            if one is not None:  # (no loop: the common model has one group)
                if native.map_slots(one[0], positions, by_request, rows, out[0], one[1], one[2],
                                    self.max_num_reqs) >= 0:
                    return
            else:
                for g, out_g in zip(self.groups, out):
                    if native.map_slots(g.table, positions, by_request, rows, out_g, g.width,
                                        g.size, self.max_num_reqs) < 0:
                        break  # a position or a row outside: the general function
                else:
                    return
            slot_mapping_numpy(self.flat_table, self.params, qsl, positions, rows, out,
                               self.max_num_reqs)
            return
        # one argmax on a uint64 view: a negative position wraps past the bound
        wide = positions.view(np.uint64)
        if not self.fast or wide[wide.argmax()] >= self._position_bound:
            slot_mapping_numpy(self.flat_table, self.params, qsl, positions, rows, out,
                               self.max_num_reqs)
            return
        if decode:
            token_rows = rows
        else:
            token_rows = rows.take(qsl[1:].searchsorted(self._tokens[:num_tokens], side="right"))
        for g, out_g in zip(self.groups, out):
            # positions are >= 0 here (a shift and a mask are ~5x cheaper than a division)
            if g.shift >= 0:
                block_index, offset = positions >> g.shift_0d, positions & g.mask_0d
            else:
                block_index, offset = np.divmod(positions, g.size_0d)
            entry = g.row_base.take(token_rows)
            entry += block_index  # inside the row: the positions are below its width
            block_id = g.table.take(entry)  # the null block past the row's count
            np.multiply(block_id, g.size_0d, out=out_g)
            out_g += offset
            # ids are >= 0 and the null block is 0: when the smallest id read is not null, no
            # token reads it (one argmin instead of a comparison and a putmask: a decode
            # step's tokens all have their blocks)
            if block_id[block_id.argmin()] == NULL_BLOCK_ID:
                np.putmask(out_g, block_id == NULL_BLOCK_ID, PAD_SLOT_ID)
