"""One KV cache group's block table on the host: row operations that check before they write.

A :class:`GroupTable` is a view of one group inside a :class:`MultiGroupBlockTable`, which owns
the buffers, the commit and the slot mapping (``table[g]`` returns it). The single-group table
users build directly, :class:`blocktable.BlockTable`, is this view over a private one-group
table (:mod:`blocktable.single_group`).

Every operation validates all of its input before the first write, so a rejected call leaves the
table exactly as it was. Block ids are manager ids; each becomes ``k`` kernel ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from blocktable import _compiled_loader as _loader
from blocktable._checks import as_index_array, check_block_ids, check_index
from blocktable.config import GroupSpec
from blocktable.constants import NULL_BLOCK_ID
from blocktable.storage import TableStorage

if TYPE_CHECKING:
    from blocktable.multi_group import MultiGroupBlockTable

class GroupTable:
    """Rows of kernel block ids for one KV cache group.

    Attributes
    ----------
    spec : GroupSpec
        The group's block sizes and kind.
    width : int
        Row width in kernel blocks.
    block_table_np : np.ndarray
        int32 ``[max_num_reqs, width]`` on cpu: the host table (read it; write through the ops).
    num_kernel_blocks : np.ndarray
        int32 ``[max_num_reqs]`` on cpu: filled kernel blocks per row.
    """

    owner: MultiGroupBlockTable
    group: int

    def __init__(self, owner: MultiGroupBlockTable, group: int) -> None:
        """The table of ``group`` inside ``owner`` (how the owner builds its per-group views)."""
        self.owner = owner
        self.group = group
        self.spec: GroupSpec = owner.specs[group]
        self.storage: TableStorage = owner.storage
        self.max_num_reqs = owner.max_num_reqs
        self.width = self.storage.widths[group]
        self.offset = int(self.storage.table_offsets[group])  # of this table in the flat buffer
        self.k = self.spec.blocks_per_manager_block
        self.block_table_np = self.storage.host_table(group)
        self.num_kernel_blocks = self.storage.host_counts(group)
        # work space of the batched-update check (int64 / bool [max_num_reqs])
        self.scratch_counts = np.zeros(self.max_num_reqs, dtype=np.int64)
        self.scratch_seen = np.zeros(self.max_num_reqs, dtype=bool)
        self.block_id_bound = self.spec.block_id_bound
        self.num_blocks_declared = self.spec.num_blocks is not None
        # the compiled batched update, bound to this group's arrays (None: numpy does it)
        compiled = _loader.COMPILED
        st = self.storage
        self.writer = None if compiled is None else compiled.GroupWriter(
            self.block_table_np.reshape(-1), self.num_kernel_blocks, self.width, self.k,
            self.block_id_bound, self.offset, self.scratch_counts,
            self.scratch_seen.view(np.uint8), st.dirty_rows[group].view(np.uint8), st.journal,
            st.journal_len)

    # ---- checks (no writes) -------------------------------------------------------------
    def kernel_ids(self, block_ids: object, name: str = "block_ids") -> np.ndarray:
        """Validate manager ids and expand them to int32 kernel ids (null stays null)."""
        kind, compiled, ids = type(block_ids), _loader.COMPILED, None
        if (kind is list or kind is tuple) and compiled is not None:
            try:  # a list of ints (the common case) in one compiled loop
                ids = compiled.int64_from_ints(block_ids, name)
            except (TypeError, OverflowError):
                pass  # as_index_array raises, worded as on every other path
        if ids is None:
            ids = as_index_array(name, block_ids)
        check_block_ids(name, ids, self.block_id_bound, self.num_blocks_declared)
        if self.k == 1:
            return ids.astype(np.int32)
        expanded = ids[:, None] * self.k + np.arange(self.k)
        expanded[ids == NULL_BLOCK_ID] = NULL_BLOCK_ID
        return expanded.reshape(-1).astype(np.int32)

    def check_fits(self, row: int, num_kernel_blocks: int, op: str) -> None:
        """Raise ``ValueError`` (naming ``op``) if ``row`` cannot hold ``num_kernel_blocks``."""
        if num_kernel_blocks > self.width:
            raise ValueError(
                f"{op}: row {row} would hold {num_kernel_blocks} kernel blocks, more than the "
                f"row width {self.width} (group {self.group})"
            )

    # ---- public row operations (this group only) ----------------------------------------
    def add_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Replace row ``row_idx`` with ``block_ids`` (manager ids); entries past them become null."""
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        ids = self.kernel_ids(block_ids)
        self.check_fits(row, len(ids), "add_row")
        self.storage.before_host_write()
        self.storage.write_add(self.group, row, ids)

    def append_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Append ``block_ids`` (manager ids) after the row's filled entries; empty is a no-op."""
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        ids = self.kernel_ids(block_ids)
        if len(ids) == 0:
            return
        self.check_fits(row, int(self.num_kernel_blocks[row]) + len(ids), "append_row")
        self.storage.before_host_write()
        self.storage.write_append(self.group, row, ids)

    def clear_row(self, row_idx: int) -> None:
        """Set the row's filled entries to the null block and its count to 0."""
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        self.storage.before_host_write()
        self.storage.write_clear_row(self.group, row)

    def move_row(self, src: int, tgt: int) -> None:
        """Move row ``src`` to ``tgt`` (batch condense); ``src`` is left empty."""
        s = check_index("src", src, self.max_num_reqs)
        t = check_index("tgt", tgt, self.max_num_reqs)
        if s == t:
            return
        self.storage.before_host_write()
        self.storage.write_move(self.group, s, t)

    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange rows ``src`` and ``tgt`` (batch reorder)."""
        s = check_index("src", src, self.max_num_reqs)
        t = check_index("tgt", tgt, self.max_num_reqs)
        if s == t:
            return
        self.storage.before_host_write()
        self.storage.write_swap(self.group, s, t)

    def clear(self) -> None:
        """Empty every row (entries and counts)."""
        self.storage.before_host_write()
        self.storage.write_clear(self.group)

    # ---- reading --------------------------------------------------------------------------
    def row(self, row_idx: int) -> np.ndarray:
        """The filled entries of a row as *kernel* block ids (a copy; int32 ``[count]``).

        With ``kernel_block_size < block_size`` each manager id ``b`` given to ``add_row`` /
        ``append_row`` appears as ``k`` kernel ids ``b*k .. b*k+k-1``; the null block as ``k``
        zeros.
        """
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        return self.block_table_np[row, : self.num_kernel_blocks[row]].copy()

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """int32 ``[num_reqs, width]`` device view of the committed table (condensed mode)."""
        return self.owner.device_view(self.group, num_reqs)

    def get_cpu_tensor(self) -> torch.Tensor:
        """int32 ``[max_num_reqs, width]`` CPU tensor viewing the host table."""
        return torch.from_numpy(self.block_table_np)

    # ---- forwarded to the owner -----------------------------------------------------------
    def commit(self, num_reqs: int | None = None) -> None:
        """Bring the device copy up to date (all groups of the owner)."""
        self.owner.commit(num_reqs)

    def compute_slot_mapping(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        *,
        row_of_batch: torch.Tensor | None = None,
        query_start_loc_cpu: torch.Tensor | None = None,
        row_of_batch_cpu: np.ndarray | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This group's int64 ``[max_num_batched_tokens]`` slot mapping (arguments as in
        :meth:`MultiGroupBlockTable.compute_slot_mapping`)."""
        slots = self.owner.compute_slot_mapping(
            query_start_loc, positions, row_of_batch=row_of_batch,
            query_start_loc_cpu=query_start_loc_cpu, row_of_batch_cpu=row_of_batch_cpu,
        )
        result = slots[self.group]
        if result is None:
            raise ValueError(f"group {self.group} ({self.spec.kind.value}) has no slot mapping")
        return result

    @property
    def slot_mapping(self) -> torch.Tensor:
        """The persistent int64 ``[max_num_batched_tokens]`` slot buffer of this group."""
        return self.owner.slot_mapping(self.group)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if an invariant of the host table does not hold."""
        counts = self.num_kernel_blocks
        if counts.min(initial=0) < 0 or counts.max(initial=0) > self.width:
            raise AssertionError(f"group {self.group}: a count is outside [0, {self.width}]")
        cols = np.arange(self.width)
        stale = (cols[None, :] >= counts[:, None]) & (self.block_table_np != NULL_BLOCK_ID)
        if stale.any():
            r, c = np.argwhere(stale)[0]
            raise AssertionError(f"group {self.group}: row {r} holds an id past its count at {c}")
        if (self.block_table_np < 0).any():
            raise AssertionError(f"group {self.group}: negative block id")
