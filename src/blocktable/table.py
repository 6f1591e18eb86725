"""One KV cache group's block table on the host: row operations that check before they write.

A :class:`BlockTable` is a view of one group inside a :class:`MultiGroupBlockTable`, which owns
the buffers, the commit and the slot mapping. Build a single-group table directly with
``BlockTable(block_size=..., max_num_reqs=..., max_model_len=..., ...)``; it then owns a private
one-group :class:`MultiGroupBlockTable` and forwards ``commit``/``compute_slot_mapping`` to it.

Every operation validates all of its input before the first write, so a rejected call leaves the
table exactly as it was. Block ids are manager ids; each becomes ``k`` kernel ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from blocktable._checks import as_index_array, check_index
from blocktable.config import GroupSpec
from blocktable.constants import NULL_BLOCK_ID
from blocktable.storage import TableStorage

if TYPE_CHECKING:
    from blocktable.multi_group import MultiGroupBlockTable

_INT32_MAX = np.iinfo(np.int32).max


class BlockTable:
    """Rows of kernel block ids for one KV cache group.

    Attributes
    ----------
    spec : GroupSpec
        The group's block sizes and kind.
    width : int
        Row width in kernel blocks.
    block_table_np : np.ndarray
        int32 ``[max_num_reqs, width]`` on cpu: the host table (read it; write through the ops).
    num_blocks_per_row : np.ndarray
        int32 ``[max_num_reqs]`` on cpu: filled kernel blocks per row.
    """

    owner: MultiGroupBlockTable
    group: int

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        *positional: object,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 8192,
        device: str | torch.device = "cpu",
        kernel_block_size: int | None = None,
        max_num_blocks: int | None = None,
        num_blocks: int | None = None,
        **options: Any,
    ) -> None:
        """Standalone single-group table.

        Everything after ``max_num_reqs`` is keyword-only: vLLM's ``BlockTable`` takes
        ``max_num_blocks_per_req`` third, where a positional ``max_model_len`` would silently
        give another width. ``blocktable.compat.BlockTable`` takes vLLM's positional form.
        ``max_num_blocks`` is the width in manager blocks; ``options`` are
        :class:`MultiGroupBlockTable`'s keyword options (``cp``, ``backend``, ...).
        """
        from blocktable.multi_group import MultiGroupBlockTable

        if positional:
            raise TypeError(
                f"BlockTable(block_size, max_num_reqs, *, max_model_len=..., ...) takes "
                f"2 positional arguments, got {2 + len(positional)}: pass the others by "
                "keyword. For vLLM's positional form (block_size, max_num_reqs, "
                "max_num_blocks_per_req, max_num_batched_tokens, pin_memory, device, "
                "kernel_block_size, cp_kv_cache_interleave_size) use blocktable.compat.BlockTable"
            )
        spec = GroupSpec(
            block_size=block_size,
            kernel_block_size=kernel_block_size,
            max_num_blocks=max_num_blocks,
            num_blocks=num_blocks,
        )
        owner = MultiGroupBlockTable(
            [spec], max_num_reqs, max_model_len, max_num_batched_tokens, device, **options
        )
        self._bind(owner, 0)

    @classmethod
    def _for_group(cls, owner: MultiGroupBlockTable, group: int) -> BlockTable:
        table = cls.__new__(cls)
        table._bind(owner, group)
        return table

    def _bind(self, owner: MultiGroupBlockTable, group: int) -> None:
        self.owner = owner
        self.group = group
        self.spec: GroupSpec = owner.specs[group]
        self.storage: TableStorage = owner.storage
        self.max_num_reqs = owner.max_num_reqs
        self.width = self.storage.widths[group]
        self.offset = int(self.storage.table_offsets[group])  # of this table in the flat buffer
        self.k = self.spec.blocks_per_manager_block
        self.block_table_np = self.storage.host_table(group)
        self.num_blocks_per_row = self.storage.host_counts(group)
        # work space of the compiled batched-update check (int64 / bool [max_num_reqs])
        self.scratch_counts = np.zeros(self.max_num_reqs, dtype=np.int64)
        self.scratch_seen = np.zeros(self.max_num_reqs, dtype=bool)
        self.max_manager_id = self.spec.num_blocks if self.spec.num_blocks is not None else (
            (_INT32_MAX - self.k + 1) // self.k + 1
        )

    # ---- checks (no writes) -------------------------------------------------------------
    def kernel_ids(self, block_ids: object, name: str = "block_ids") -> np.ndarray:
        """Validate manager ids and expand them to int32 kernel ids (null stays null)."""
        ids = as_index_array(name, block_ids)
        if len(ids):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.max_manager_id:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"{name} holds block id {bad}, outside [0, {self.max_manager_id})"
                    + (" (num_blocks)" if self.spec.num_blocks is not None else "")
                )
        if self.k == 1:
            return ids.astype(np.int32)
        expanded = ids[:, None] * self.k + np.arange(self.k)
        expanded[ids == NULL_BLOCK_ID] = NULL_BLOCK_ID
        return expanded.reshape(-1).astype(np.int32)

    def _check_fits(self, row: int, num_kernel_blocks: int, what: str) -> None:
        if num_kernel_blocks > self.width:
            raise ValueError(
                f"{what}: row {row} would hold {num_kernel_blocks} kernel blocks, more than the "
                f"row width {self.width} (group {self.group})"
            )

    # ---- writes (inputs already checked) -----------------------------------------------
    def _record(self, row: int, lo: int, hi: int) -> None:
        """Note for the next commit that columns ``[lo, hi)`` of ``row`` changed."""
        self.storage.record_run(self.group, row, self.offset + row * self.width + lo, hi - lo)

    def _write_add(self, row: int, kernel_ids: np.ndarray) -> None:
        old = int(self.num_blocks_per_row[row])
        new = len(kernel_ids)
        self.block_table_np[row, :new] = kernel_ids
        if old > new:
            self.block_table_np[row, new:old] = NULL_BLOCK_ID
        self.num_blocks_per_row[row] = new
        self._record(row, 0, max(old, new))

    def _write_append(self, row: int, kernel_ids: np.ndarray) -> None:
        start = int(self.num_blocks_per_row[row])
        stop = start + len(kernel_ids)
        self.block_table_np[row, start:stop] = kernel_ids
        self.num_blocks_per_row[row] = stop
        self._record(row, start, stop)

    def _write_clear_row(self, row: int) -> None:
        old = int(self.num_blocks_per_row[row])
        self.block_table_np[row, :old] = NULL_BLOCK_ID
        self.num_blocks_per_row[row] = 0
        self._record(row, 0, old)

    def _write_move(self, src: int, dst: int) -> None:
        n_src = int(self.num_blocks_per_row[src])
        n_dst = int(self.num_blocks_per_row[dst])
        self.block_table_np[dst, :n_src] = self.block_table_np[src, :n_src]
        if n_dst > n_src:
            self.block_table_np[dst, n_src:n_dst] = NULL_BLOCK_ID
        self.num_blocks_per_row[dst] = n_src
        self._record(dst, 0, max(n_src, n_dst))
        self._write_clear_row(src)

    def _write_swap(self, a: int, b: int) -> None:
        n = max(int(self.num_blocks_per_row[a]), int(self.num_blocks_per_row[b]))
        self.block_table_np[[a, b], :n] = self.block_table_np[[b, a], :n]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]
        self._record(a, 0, n)
        self._record(b, 0, n)

    def _write_clear(self) -> None:
        counts = self.num_blocks_per_row
        rows = np.nonzero(counts)[0]
        self.storage.record_rows(
            self.group, rows, self.offset + rows * self.width, counts[rows].astype(np.int64)
        )
        self.block_table_np[rows] = NULL_BLOCK_ID
        counts[:] = 0

    # ---- public row operations (this group only) ----------------------------------------
    def add_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Replace row ``row_idx`` with ``block_ids`` (manager ids); entries past them become null."""
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        ids = self.kernel_ids(block_ids)
        self._check_fits(row, len(ids), "add_row")
        self.storage.before_host_write()
        self._write_add(row, ids)

    def append_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Append ``block_ids`` (manager ids) after the row's filled entries; empty is a no-op."""
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        ids = self.kernel_ids(block_ids)
        if len(ids) == 0:
            return
        self._check_fits(row, int(self.num_blocks_per_row[row]) + len(ids), "append_row")
        self.storage.before_host_write()
        self._write_append(row, ids)

    def clear_row(self, row_idx: int) -> None:
        """Set the row's filled entries to the null block and its count to 0."""
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        self.storage.before_host_write()
        self._write_clear_row(row)

    def move_row(self, src: int, tgt: int) -> None:
        """Move row ``src`` to ``tgt`` (batch condense); ``src`` is left empty."""
        s = check_index("src", src, self.max_num_reqs)
        t = check_index("tgt", tgt, self.max_num_reqs)
        if s == t:
            return
        self.storage.before_host_write()
        self._write_move(s, t)

    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange rows ``src`` and ``tgt`` (batch reorder)."""
        s = check_index("src", src, self.max_num_reqs)
        t = check_index("tgt", tgt, self.max_num_reqs)
        if s == t:
            return
        self.storage.before_host_write()
        self._write_swap(s, t)

    def clear(self) -> None:
        """Empty every row (entries and counts)."""
        self.storage.before_host_write()
        self._write_clear()

    # ---- reading --------------------------------------------------------------------------
    def row(self, row_idx: int) -> np.ndarray:
        """The filled entries of a row as *kernel* block ids (a copy; int32 ``[count]``).

        With ``kernel_block_size < block_size`` each manager id ``b`` given to ``add_row`` /
        ``append_row`` appears as ``k`` kernel ids ``b*k .. b*k+k-1``; the null block as ``k``
        zeros.
        """
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        return self.block_table_np[row, : self.num_blocks_per_row[row]].copy()

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
        self, query_start_loc: torch.Tensor, positions: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """This group's int64 ``[max_num_batched_tokens]`` slot mapping (see the owner)."""
        slots = self.owner.compute_slot_mapping(query_start_loc, positions, **kwargs)
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
        counts = self.num_blocks_per_row
        if counts.min(initial=0) < 0 or counts.max(initial=0) > self.width:
            raise AssertionError(f"group {self.group}: a count is outside [0, {self.width}]")
        cols = np.arange(self.width)
        stale = (cols[None, :] >= counts[:, None]) & (self.block_table_np != NULL_BLOCK_ID)
        if stale.any():
            r, c = np.argwhere(stale)[0]
            raise AssertionError(f"group {self.group}: row {r} holds an id past its count at {c}")
        if (self.block_table_np < 0).any():
            raise AssertionError(f"group {self.group}: negative block id")
