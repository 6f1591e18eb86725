"""The host/device buffer behind every group's table, and what changed since the last commit.

All groups' tables and their per-row counts live in *one* flat ``int32`` buffer, so that one
commit moves every group's changes in a single host-to-device copy. Layout::

    [ table of group 0 : R x W0 | table of group 1 : R x W1 | ... | counts : G x R ]

Three views of it: a numpy array that row operations write, the CPU tensor it views (pinned
when CUDA is present), and the device tensor kernels read. The device tensor is allocated once,
so its address is fixed for CUDA graphs. Its contents change only in
:meth:`blocktable.commit.Committer.commit`. The ``write_*`` methods are the row writes of every
table; they trust their input (:class:`~blocktable.table.GroupTable` and
:class:`~blocktable.MultiGroupBlockTable` check everything first) and record what they change.
"""

from __future__ import annotations

import numpy as np
import torch

from blocktable.constants import NULL_BLOCK_ID


class TableStorage:
    """Flat host and device buffers for ``len(widths)`` tables of ``max_num_reqs`` rows.

    Parameters
    ----------
    widths : list of int
        Row width of each group's table in kernel blocks (0 for a group without a table).
    max_num_reqs : int
        Rows per table.
    device : torch.device
        Where the device copy lives (``cpu`` keeps a separate CPU copy with the same semantics).
    """

    def __init__(self, widths: list[int], max_num_reqs: int, device: torch.device,
                 journal_capacity: int | None = None) -> None:
        self.widths = list(widths)
        self.max_num_reqs = max_num_reqs
        self.num_groups = len(widths)
        self.device = device
        sizes = [max_num_reqs * w for w in widths]
        self.table_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._table_offsets = self.table_offsets.tolist()
        self.counts_offset = int(sum(sizes))
        self.num_entries = self.counts_offset + self.num_groups * max_num_reqs
        if self.num_entries > np.iinfo(np.int32).max:
            raise ValueError(
                f"the tables need {self.num_entries} entries, more than int32 indexing allows "
                f"({np.iinfo(np.int32).max}); lower max_num_reqs or max_model_len"
            )
        self.pinned = torch.cuda.is_available()
        self.host_tensor = torch.zeros(  # on cpu, int32 [num_entries], pinned with CUDA
            self.num_entries, dtype=torch.int32, pin_memory=self.pinned
        )
        self.host: np.ndarray = self.host_tensor.numpy()  # on cpu, same memory
        self.device_tensor = torch.zeros(  # on device, int32 [num_entries]
            self.num_entries, dtype=torch.int32, device=device
        )
        # the CPU backend's device copy as numpy (same memory; None on an accelerator): its
        # writes are numpy work on the calling thread, whatever torch's thread pool is doing
        self.device_np: np.ndarray | None = (
            self.device_tensor.numpy() if device.type == "cpu" else None)
        # What changed since the last commit: the rows (for counts and checks) and a journal of
        # the flat indices written (may repeat an index). When the journal overflows
        # (``journal_len[0] == -1``) the commit copies each group's changed row span instead.
        self.dirty_rows = np.zeros((self.num_groups, max_num_reqs), dtype=bool)
        # the most written indices journaled between commits (then overflow): the commit's
        # staging capacity, by default about 1/40 of the entries
        self.journal_capacity = (int(journal_capacity) if journal_capacity is not None
                                 else max(1024, self.num_entries // 40))
        self.journal = np.zeros((self.journal_capacity, 2), dtype=np.int64)  # runs: start, length
        self.journal_len = np.zeros(2, dtype=np.int64)  # runs, indices; -1 runs: overflow
        self.changed = False
        # An asynchronous copy that reads ``host_tensor`` directly (the large-commit path):
        # host writes must wait for it.
        self.host_read_event: torch.cuda.Event | None = None
        self._tables = [self.host_table(g) for g in range(self.num_groups)]
        self._counts = [self.host_counts(g) for g in range(self.num_groups)]
        # One-row writes read and write scalars through memoryviews (Python ints; a numpy
        # scalar costs more); none of these arrays is ever reallocated.
        self._counts_mv = [c.data for c in self._counts]
        self._dirty_mv = [d.data for d in self.dirty_rows]
        self._journal_mv = self.journal.reshape(-1).data
        self._journal_len_mv = self.journal_len.data

    # ---- views -------------------------------------------------------------------------
    def host_table(self, group: int) -> np.ndarray:
        """int32 ``[max_num_reqs, width]`` numpy view of one group's host table."""
        start = int(self.table_offsets[group])
        width = self.widths[group]
        return self.host[start : start + self.max_num_reqs * width].reshape(
            self.max_num_reqs, width
        )

    def host_counts(self, group: int) -> np.ndarray:
        """int32 ``[max_num_reqs]`` numpy view of one group's filled-entry counts."""
        start = self.counts_offset + group * self.max_num_reqs
        return self.host[start : start + self.max_num_reqs]

    def device_table(self, group: int) -> torch.Tensor:
        """int32 ``[max_num_reqs, width]`` view of one group's device table (fixed address)."""
        start = int(self.table_offsets[group])
        width = self.widths[group]
        return self.device_tensor[start : start + self.max_num_reqs * width].view(
            self.max_num_reqs, width
        )

    def device_counts(self, group: int) -> torch.Tensor:
        """int32 ``[max_num_reqs]`` view of one group's device counts."""
        start = self.counts_offset + group * self.max_num_reqs
        return self.device_tensor[start : start + self.max_num_reqs]

    # ---- change tracking ---------------------------------------------------------------
    def before_host_write(self) -> None:
        """Wait until no copy still reads the host buffer (only after a large commit)."""
        if self.host_read_event is not None:
            self.host_read_event.synchronize()
            self.host_read_event = None

    def record_run(self, group: int, row: int, start: int, length: int) -> None:
        """Note that ``row`` of ``group`` changed, writing flat entries ``[start, start+length)``."""
        self._dirty_mv[group][row] = True
        self.changed = True
        journal_len = self._journal_len_mv
        runs = journal_len[0]
        if runs < 0 or length <= 0:
            return
        total = journal_len[1] + length
        if runs >= self.journal_capacity or total > self.journal_capacity:
            journal_len[0] = -1
            return
        self._journal_mv[2 * runs] = start
        self._journal_mv[2 * runs + 1] = length
        journal_len[0] = runs + 1
        journal_len[1] = total

    def record_rows(self, group: int, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Vectorized :meth:`record_run` for several rows (flat ``starts``)."""
        self.dirty_rows[group, rows] = True
        self.changed = True
        runs = int(self.journal_len[0])
        keep = lengths > 0
        starts, lengths = starts[keep], lengths[keep]
        total = int(self.journal_len[1]) + int(lengths.sum())
        if runs < 0 or not len(lengths):
            return
        if runs + len(lengths) > len(self.journal) or total > len(self.journal):
            self.journal_len[0] = -1
            return
        self.journal[runs : runs + len(lengths), 0] = starts
        self.journal[runs : runs + len(lengths), 1] = lengths
        self.journal_len[0] = runs + len(lengths)
        self.journal_len[1] = total

    # ---- row writes (inputs already checked; every change recorded) -------------------
    def _record(self, group: int, row: int, lo: int, hi: int) -> None:
        """Note for the next commit that columns ``[lo, hi)`` of ``row`` of ``group`` changed."""
        start = self._table_offsets[group] + row * self.widths[group] + lo
        self.record_run(group, row, start, hi - lo)

    def write_add(self, group: int, row: int, kernel_ids: np.ndarray) -> None:
        """Replace ``row`` with ``kernel_ids`` (int32, fits the width); null the stale tail."""
        table, counts = self._tables[group], self._counts_mv[group]
        old, new = counts[row], len(kernel_ids)
        table[row, :new] = kernel_ids
        if old > new:
            table[row, new:old] = NULL_BLOCK_ID
        counts[row] = new
        self._record(group, row, 0, max(old, new))

    def write_append(self, group: int, row: int, kernel_ids: np.ndarray) -> None:
        """Append ``kernel_ids`` (int32, fits the width) after the row's filled entries."""
        table, counts = self._tables[group], self._counts_mv[group]
        start = counts[row]
        stop = start + len(kernel_ids)
        table[row, start:stop] = kernel_ids
        counts[row] = stop
        self._record(group, row, start, stop)

    def write_clear_row(self, group: int, row: int) -> None:
        """Null the row's filled entries and set its count to 0."""
        table, counts = self._tables[group], self._counts[group]
        old = int(counts[row])
        table[row, :old] = NULL_BLOCK_ID
        counts[row] = 0
        self._record(group, row, 0, old)

    def write_move(self, group: int, src: int, dst: int) -> None:
        """Move row ``src`` to ``dst`` (``src != dst``); ``src`` is left empty."""
        table, counts = self._tables[group], self._counts[group]
        n_src, n_dst = int(counts[src]), int(counts[dst])
        table[dst, :n_src] = table[src, :n_src]
        if n_dst > n_src:
            table[dst, n_src:n_dst] = NULL_BLOCK_ID
        counts[dst] = n_src
        self._record(group, dst, 0, max(n_src, n_dst))
        self.write_clear_row(group, src)

    def write_swap(self, group: int, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (``a != b``)."""
        table, counts = self._tables[group], self._counts[group]
        n = max(int(counts[a]), int(counts[b]))
        table[[a, b], :n] = table[[b, a], :n]
        counts[[a, b]] = counts[[b, a]]
        self._record(group, a, 0, n)
        self._record(group, b, 0, n)

    def write_clear(self, group: int) -> None:
        """Empty every row of ``group``."""
        table, counts = self._tables[group], self._counts[group]
        rows = np.nonzero(counts)[0]
        starts = int(self.table_offsets[group]) + rows * self.widths[group]
        self.record_rows(group, rows, starts, counts[rows].astype(np.int64))
        table[rows] = NULL_BLOCK_ID
        counts[:] = 0

    def reset_changes(self) -> None:
        self.dirty_rows[:] = False
        self.journal_len[:] = 0
        self.changed = False
