"""What attention reads, per group: padded device views, indexed-mode gathers, state indices
and the per-step metadata handed to attention.

:class:`AttentionViews` is a base of :class:`~blocktable.MultiGroupBlockTable`; its methods use
the table's storage and sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from blocktable._checks import check_count, check_index, check_row_of_batch, check_tensor
from blocktable.metadata import AttentionMetadata

if TYPE_CHECKING:
    from blocktable.config import GroupSpec
    from blocktable.storage import TableStorage
    from blocktable.table import GroupTable


class AttentionViews:
    """Views of the committed device tables in the shapes attention kernels read."""

    # provided by MultiGroupBlockTable
    specs: tuple[GroupSpec, ...]
    storage: TableStorage
    tables: list[GroupTable | None]
    max_num_reqs: int
    device: torch.device
    backend: str
    debug: bool
    _encoder_placeholder: torch.Tensor
    _gathered: dict[int, torch.Tensor]
    _state_out: dict[tuple[int, int], torch.Tensor]

    def _padded(self, num_reqs: int, num_reqs_padded: int | None) -> int:
        """``num_reqs_padded`` (default ``num_reqs``), checked to lie in [num_reqs, max]."""
        padded = num_reqs if num_reqs_padded is None else num_reqs_padded
        if isinstance(padded, bool) or not isinstance(padded, (int, np.integer)) or not (
            num_reqs <= padded <= self.max_num_reqs
        ):
            raise ValueError(
                f"num_reqs_padded={padded} must be an int in [num_reqs={num_reqs}, "
                f"max_num_reqs={self.max_num_reqs}]"
            )
        return int(padded)

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    def __getitem__(self, group: int) -> GroupTable:
        table = self.tables[check_index("group", group, self.num_groups)]
        if table is None:
            raise ValueError(f"group {group} is encoder-only and has no table")
        return table

    def require_committed(self, what: str) -> None:
        """Raise when the host rows changed since the last :meth:`commit`: ``what`` would read
        a device table that does not hold them yet."""
        if self.storage.changed:
            raise RuntimeError(
                f"{what} reads the device table, but rows changed on the host since the last "
                "commit(): call table.commit() after the step's row operations (add_row, "
                "append_row, apply, ...) and before slot mapping or attention views"
            )

    def device_view(self, group: int, num_reqs: int, num_reqs_padded: int | None = None) -> torch.Tensor:
        """int32 ``[num_reqs_padded, width]`` committed device table of ``group`` (condensed mode).

        Rows ``[num_reqs, num_reqs_padded)`` hold ``NULL_BLOCK_ID``; they must be empty rows of
        the table (a ``ValueError`` says so otherwise). Encoder-only groups get a zero
        ``[num_reqs_padded, 1]`` placeholder.
        """
        check_index("group", group, self.num_groups)
        num_reqs = check_count("num_reqs", num_reqs, self.max_num_reqs, "max_num_reqs")
        padded = self._padded(num_reqs, num_reqs_padded)
        if not self.specs[group].has_table:
            return self._encoder_placeholder[:padded]
        if padded > num_reqs:
            counts = self.storage.host_counts(group)[num_reqs:padded]
            dirty = self.storage.dirty_rows[group, num_reqs:padded]
            if counts.any() or dirty.any():
                row = num_reqs + int(np.argmax(counts.astype(bool) | dirty))
                raise ValueError(
                    f"pad row {row} in [num_reqs={num_reqs}, num_reqs_padded={padded}) of group "
                    f"{group} is not an empty committed row; clear it (clear_row) and commit"
                )
        self.require_committed("device_view")
        return self.storage.device_table(group)[:padded]

    def gather_view(
        self,
        group: int,
        row_of_batch: torch.Tensor,
        num_reqs_padded: int | None = None,
        *,
        row_of_batch_cpu: np.ndarray | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int32 ``[num_reqs_padded, width]`` table of ``group`` in batch order (indexed mode).

        Row ``i < num_reqs`` is table row ``row_of_batch[i]`` (int32 ``[num_reqs]`` on the
        device); pad rows hold ``NULL_BLOCK_ID``. Written on the device into a persistent buffer
        (allocated on first use; fixed address). Rows are checked against ``max_num_reqs`` from
        ``row_of_batch_cpu`` (its host copy) when given, and in debug mode; unchecked, a row out
        of range reads as an empty row.
        """
        check_index("group", group, self.num_groups)
        check_tensor("row_of_batch", row_of_batch, dtype=torch.int32, ndim=1, device=self.device)
        num_reqs = row_of_batch.numel()
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"row_of_batch has {num_reqs} rows, more than max_num_reqs")
        padded = self._padded(num_reqs, num_reqs_padded)
        check_row_of_batch(row_of_batch, row_of_batch_cpu, num_reqs=num_reqs,
                           max_num_reqs=self.max_num_reqs, device=self.device, debug=self.debug)
        self.require_committed("gather_view")
        return self._gather(group, row_of_batch, padded)

    def _gather(self, group: int, row_of_batch: torch.Tensor, padded: int) -> torch.Tensor:
        """:meth:`gather_view` on checked arguments."""
        from blocktable.gather import gather_rows

        if not self.specs[group].has_table:
            return self._encoder_placeholder[:padded]
        out = self._gathered.get(group)
        if out is None:
            out = torch.zeros_like(self.storage.device_table(group))
            self._gathered[group] = out
        gather_rows(self.backend, self.storage.device_table(group), row_of_batch, out[:padded])
        return out[:padded]

    def state_indices(
        self,
        group: int,
        seq_lens: torch.Tensor,
        num_reqs_padded: int | None = None,
        *,
        num_speculative_blocks: int = 0,
        row_of_batch: torch.Tensor | None = None,
        row_of_batch_cpu: np.ndarray | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int32 ``[num_reqs_padded, 1 + num_speculative_blocks]`` state blocks per request.

        For a state (Mamba-like) group: the block holding each request's last token,
        ``(seq_len - 1) // block_size`` clamped at 0, then the ``num_speculative_blocks`` blocks
        after it; ``NULL_BLOCK_ID`` past the row's entries and in pad rows. Written on the device
        into a persistent buffer (fixed address per ``num_speculative_blocks``). In indexed mode
        (``row_of_batch``, int32 ``[num_reqs]`` on the device) rows are checked as in
        :meth:`gather_view`; unchecked, a row out of range reads as an empty row.
        """
        from blocktable.state_indices import gather_state_indices

        table = self[group]
        num_reqs = check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1,
                                device=self.device).numel()
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"seq_lens has {num_reqs} entries, more than max_num_reqs")
        padded = self._padded(num_reqs, num_reqs_padded)
        check_count("num_speculative_blocks", num_speculative_blocks)
        if row_of_batch is not None:
            check_row_of_batch(row_of_batch, row_of_batch_cpu, num_reqs=num_reqs,
                               max_num_reqs=self.max_num_reqs, device=self.device,
                               debug=self.debug)
        key = (group, num_speculative_blocks)
        out = self._state_out.get(key)
        if out is None:
            out = torch.zeros(self.max_num_reqs, 1 + num_speculative_blocks, dtype=torch.int32,
                              device=self.device)
            self._state_out[key] = out
        self.require_committed("state_indices")
        gather_state_indices(
            self.storage.device_table(group), self.storage.device_counts(group), seq_lens,
            table.spec.kernel_block_size, row_of_batch, out[:padded],
        )
        return out[:padded]

    def build_metadata(
        self,
        query_start_loc: torch.Tensor,
        slot_mappings: list[torch.Tensor | None],
        *,
        num_tokens: int,
        num_reqs_padded: int | None = None,
        query_start_loc_cpu: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        seq_lens_cpu: torch.Tensor | None = None,
        row_of_batch: torch.Tensor | None = None,
        row_of_batch_cpu: np.ndarray | torch.Tensor | None = None,
    ) -> list[AttentionMetadata]:
        """Per group, what attention reads this step (see :class:`AttentionMetadata`).

        The fields every group shares are built once; each group then swaps in its own view
        (``device_view`` in condensed mode, ``gather_view`` with ``row_of_batch``) and slots.
        In indexed mode ``row_of_batch`` (int32 ``[num_reqs]``, device) must have one row per
        request. ``row_of_batch_cpu`` (its host copy) is checked and gives the host counts
        (``num_kernel_blocks_cpu``) without a device-to-host copy; without it, on CUDA, the
        counts are ``None`` and the rows are checked only in debug mode (a synchronizing copy).
        """
        check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1,
                     device=self.device)
        num_reqs = query_start_loc.numel() - 1
        if len(slot_mappings) != self.num_groups:
            raise ValueError(
                f"slot_mappings must hold one entry per group ({self.num_groups}), got "
                f"{len(slot_mappings)}"
            )
        if row_of_batch is None:
            rows: np.ndarray | None = np.arange(num_reqs)
        else:
            rows = check_row_of_batch(row_of_batch, row_of_batch_cpu, num_reqs=num_reqs,
                                      max_num_reqs=self.max_num_reqs, device=self.device,
                                      debug=self.debug)
        padded = self._padded(num_reqs, num_reqs_padded)
        self.require_committed("build_metadata")
        out: list[AttentionMetadata] = []
        common: AttentionMetadata | None = None
        for g in range(self.num_groups):
            if row_of_batch is None:
                view = self.device_view(g, num_reqs, padded)
            else:
                view = self._gather(g, row_of_batch, padded)
            table = self.tables[g]
            counts = (None if rows is None else np.zeros(num_reqs, np.int32) if table is None
                      else table.num_kernel_blocks[rows])
            if common is None:
                common = AttentionMetadata(
                    g, num_reqs, padded, num_tokens, query_start_loc, query_start_loc_cpu,
                    seq_lens, seq_lens_cpu, view, slot_mappings[g], counts,
                )
                out.append(common)
            else:
                out.append(common.for_group(g, view, slot_mappings[g], counts))
        return out
