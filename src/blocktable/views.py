"""What attention reads, per group: padded device views, indexed-mode gathers, state indices
and the per-step metadata (what attention reads each step).

:class:`AttentionViews` is a base of :class:`~blocktable.MultiGroupBlockTable`; its methods use
the table's storage and sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from blocktable._checks import check_count, check_index, check_tensor
from blocktable.metadata import AttentionMetadata

if TYPE_CHECKING:
    from blocktable.config import GroupSpec
    from blocktable.storage import TableStorage
    from blocktable.table import BlockTable


class AttentionViews:
    """Views of the committed device tables in the shapes attention kernels read."""

    # provided by MultiGroupBlockTable
    specs: tuple[GroupSpec, ...]
    storage: TableStorage
    tables: list[BlockTable | None]
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

    def __getitem__(self, group: int) -> BlockTable:
        table = self.tables[check_index("group", group, self.num_groups)]
        if table is None:
            raise ValueError(f"group {group} is encoder-only and has no table")
        return table

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
        return self.storage.device_table(group)[:padded]

    def gather_view(
        self, group: int, row_of_batch: torch.Tensor, num_reqs_padded: int | None = None
    ) -> torch.Tensor:
        """int32 ``[num_reqs_padded, width]`` table of ``group`` in batch order (indexed mode).

        Row ``i < num_reqs`` is table row ``row_of_batch[i]``; pad rows hold ``NULL_BLOCK_ID``.
        Written on the device into a persistent buffer (allocated on first use; fixed address).
        """
        from blocktable.gather import gather_rows

        check_index("group", group, self.num_groups)
        num_reqs = row_of_batch.numel() if isinstance(row_of_batch, torch.Tensor) else -1
        check_tensor("row_of_batch", row_of_batch, dtype=torch.int32, ndim=1, device=self.device)
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"row_of_batch has {num_reqs} rows, more than max_num_reqs")
        padded = self._padded(num_reqs, num_reqs_padded)
        if not self.specs[group].has_table:
            return self._encoder_placeholder[:padded]
        if row_of_batch.device.type == "cpu" or self.debug:
            rows = row_of_batch.cpu().numpy()
            if len(rows) and (rows.min() < 0 or rows.max() >= self.max_num_reqs):
                raise IndexError(f"row_of_batch holds a row outside [0, {self.max_num_reqs})")
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
    ) -> torch.Tensor:
        """int32 ``[num_reqs_padded, 1 + num_speculative_blocks]`` state blocks per request.

        For a state (Mamba-like) group: the block holding each request's last token,
        ``(seq_len - 1) // block_size`` clamped at 0, then the ``num_speculative_blocks`` blocks
        after it; ``NULL_BLOCK_ID`` past the row's entries and in pad rows. Written on the device
        into a persistent buffer (fixed address per ``num_speculative_blocks``).
        """
        from blocktable.state_indices import gather_state_indices

        table = self[group]
        num_reqs = check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1,
                                device=self.device).numel()
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"seq_lens has {num_reqs} entries, more than max_num_reqs")
        padded = self._padded(num_reqs, num_reqs_padded)
        if num_speculative_blocks < 0:
            raise ValueError(f"num_speculative_blocks must be >= 0, got {num_speculative_blocks}")
        if row_of_batch is not None:
            check_tensor("row_of_batch", row_of_batch, dtype=torch.int32, shape=[num_reqs],
                         device=self.device)
        key = (group, num_speculative_blocks)
        out = self._state_out.get(key)
        if out is None:
            out = torch.zeros(self.max_num_reqs, 1 + num_speculative_blocks, dtype=torch.int32,
                              device=self.device)
            self._state_out[key] = out
        gather_state_indices(
            self.storage.device_table(group), self.storage.device_counts(group), seq_lens,
            table.spec.kernel_size, row_of_batch, out[:padded],
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
        row_of_batch_cpu: np.ndarray | None = None,
    ) -> list[AttentionMetadata]:
        """Per group, what attention reads this step (see :class:`AttentionMetadata`).

        The fields every group shares are built once; each group then swaps in its own view
        (``device_view`` in condensed mode, ``gather_view`` with ``row_of_batch``) and slots.
        ``row_of_batch_cpu`` (host rows) gives the host counts without a device copy in
        indexed mode.
        """
        num_reqs = query_start_loc.numel() - 1
        padded = num_reqs if num_reqs_padded is None else num_reqs_padded
        if row_of_batch is not None and row_of_batch_cpu is None:
            row_of_batch_cpu = row_of_batch.cpu().numpy()
        rows = np.arange(num_reqs) if row_of_batch_cpu is None else np.asarray(row_of_batch_cpu)
        out: list[AttentionMetadata] = []
        common: AttentionMetadata | None = None
        for g in range(self.num_groups):
            if row_of_batch is None:
                view = self.device_view(g, num_reqs, padded)
            else:
                view = self.gather_view(g, row_of_batch, padded)
            table = self.tables[g]
            counts = (np.zeros(num_reqs, np.int32) if table is None
                      else table.num_blocks_per_row[rows].copy())
            if common is None:
                common = AttentionMetadata(
                    g, num_reqs, padded, num_tokens, query_start_loc, query_start_loc_cpu,
                    seq_lens, seq_lens_cpu, view, slot_mappings[g], counts,
                )
                out.append(common)
            else:
                out.append(common.for_group(g, view, slot_mappings[g], counts))
        return out
