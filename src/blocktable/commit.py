"""Incremental commit: move only what changed on the host to the device.

The storage journals every written run of entries and marks every touched row. A commit
drains those changes into a staging buffer as ``(flat index, value)`` pairs (the entries and
the touched rows' counts) and scatters them into the device table: on CUDA one asynchronous
copy of the staging buffer and one scatter kernel, on the CPU backend a numpy ``put`` on the
calling thread (no torch op, so no intra-op thread pool). Bytes moved are ``8 * changed
entries``, not ``4 * num_reqs * width``. Two staging buffers alternate; a buffer is refilled
only after the copy that read it has finished (a CUDA event says so). When the changes outgrow
the staging buffer, the changed row span of each group is copied directly instead; host writes
then wait for that copy (:meth:`TableStorage.before_host_write`).

:meth:`Committer.stage` is the one way changes become pairs: :class:`blocktable.step.CapturedStep`
stages into its own buffer with it, and launches the same scatter kernel from a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from blocktable import _compiled_loader as _loader
from blocktable._host_loops import fill_staging
from blocktable._triton import HAS_TRITON, Launcher, cdiv, tl, triton
from blocktable.storage import TableStorage

FULL = -1  # Committer.stage: the changes did not fit the buffer (nothing was drained)


class CommitStats(NamedTuple):
    """What one commit moved."""

    num_entries: int  # table entries and counts written on the device
    bytes_h2d: int  # host-to-device bytes
    full_copy: bool  # True when the changed row spans were copied instead of scattered


_NOTHING = CommitStats(0, 0, False)


class Committer:
    """Brings ``storage.device_tensor`` up to date with ``storage.host``.

    Parameters
    ----------
    storage : TableStorage
        The buffers to keep in sync.
    backend : str
        ``"triton"`` (scatter kernel) or ``"torch"`` (numpy on CPU tensors).

    The capacity of each staging buffer in changed entries is the storage's
    ``journal_capacity``; beyond it a commit copies row spans.
    """

    def __init__(self, storage: TableStorage, backend: str) -> None:
        self.storage = storage
        self.backend = backend
        self.capacity = storage.journal_capacity
        # the compiled gathering of the pairs, bound to the storage's journal, dirty rows
        # (as flat uint8, the same memory) and host buffer, where the install built it (else
        # numpy)
        compiled = _loader.COMPILED
        stager = None if compiled is None else compiled.PairStager(
            storage.journal, storage.journal_len, storage.dirty_rows.reshape(-1).view(np.uint8),
            storage.counts_offset, storage.host)
        self.compiled_stager = stager
        self._compiled_fill = None if stager is None else stager.fill
        cuda = storage.device.type == "cuda"
        # on cpu (pinned with CUDA), int32 [2, 1 + 2*capacity]: count, indices, values
        self._staging_host = torch.zeros(2, 1 + 2 * self.capacity, dtype=torch.int32,
                                         pin_memory=storage.pinned)
        self._staging_np = self._staging_host.numpy()
        # on device, int32 [1 + 2*capacity]: what the scatter kernel reads (triton backend)
        self._staging_dev = (torch.zeros(1 + 2 * self.capacity, dtype=torch.int32,
                                         device=storage.device)
                             if backend == "triton" else None)
        # one reusable event per staging buffer: recorded after the copy that reads it
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._in_flight = [False, False]
        self._next = 0
        self._device_np = storage.device_np
        self.last: CommitStats = _NOTHING

    def stage(self, staging: np.ndarray, capacity: int) -> int:
        """Drain every change since the last commit into ``staging`` (int32
        ``[>= 1 + 2 * capacity]`` on cpu: the number of pairs, then their flat indices, then
        their values, packed) and return how many pairs; or :data:`FULL`, draining and writing
        nothing, when they exceed ``capacity``."""
        st = self.storage
        if not st.changed:
            staging[0] = 0
            return 0
        if self._compiled_fill is not None:
            n = self._compiled_fill(staging, capacity)
        else:
            n = fill_staging(st.journal, st.journal_len, st.dirty_rows, st.counts_offset,
                             st.host, staging, capacity)
        if n >= 0:
            st.changed = False  # fill_staging reset the dirty rows and the journal
        return n

    def scatter_on_host(self, staging: np.ndarray) -> None:
        """The CPU backend's device write of the pairs staged in ``staging``."""
        assert self._device_np is not None
        n = int(staging[0])
        self._device_np.put(staging[1 : 1 + n], staging[1 + n : 1 + 2 * n])

    def commit(self) -> CommitStats:
        """Move every change since the last commit to the device (asynchronously on CUDA)."""
        st = self.storage
        if not st.changed:
            self.last = _NOTHING
            return self.last
        slot = self._next
        event = self._events[slot]
        if self._in_flight[slot] and event is not None:
            event.synchronize()  # the copy that last read this buffer must be done
        buf = self._staging_np[slot]
        n = self.stage(buf, self.capacity)
        if n == FULL:
            groups, rows = np.nonzero(st.dirty_rows)
            self.last = self._copy_spans(groups, rows)
            st.reset_changes()
            return self.last
        if self._device_np is not None:
            self.scatter_on_host(buf)
        else:
            assert self._staging_dev is not None
            dev = self._staging_dev[: 1 + 2 * n]
            dev.copy_(self._staging_host[slot, : 1 + 2 * n], non_blocking=True)
            launch_staged_scatter(st.device_tensor, dev, dev, n, dev.numel())  # (no batch)
            if event is not None:
                event.record()
                self._in_flight[slot] = True
            self._next ^= 1
        self.last = CommitStats(n, 8 * n, False)
        return self.last

    def _copy_spans(self, groups: np.ndarray, rows: np.ndarray) -> CommitStats:
        """The large change: copy each group's changed row span, and all counts."""
        st = self.storage
        spans = []
        for g in np.unique(groups):
            g_rows = rows[groups == g]
            w = st.widths[g]
            start = int(st.table_offsets[g]) + int(g_rows.min()) * w
            stop = int(st.table_offsets[g]) + (int(g_rows.max()) + 1) * w
            spans.append((start, stop))
        spans.append((st.counts_offset, st.num_entries))
        moved = 0
        for start, stop in spans:
            if self._device_np is not None:
                self._device_np[start:stop] = st.host[start:stop]
            else:
                st.device_tensor[start:stop].copy_(st.host_tensor[start:stop], non_blocking=True)
            moved += stop - start
        if st.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            st.host_read_event = event
        return CommitStats(moved, 4 * moved, True)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_words", "batch_offset"],
                do_not_specialize_on_alignment=["staging_ptr", "dev_ptr"])
    def _staged_scatter_kernel(
        table_ptr,  # int32 [num_entries]: the flat device table
        staging_ptr,  # int32 [num_words]: the pair count, indices, values, then batch words
        dev_ptr,  # int32 [num_words]: where the device reads the batch (words from batch_offset on)
        num_words,  # the staging buffer's length
        batch_offset,  # word offset of the batch (num_words: no batch); unspecialized, as is
        # num_words, so the table's commit (both follow its pair count) compiles once
        BLOCK: tl.constexpr,
    ):
        # The count is read from memory, not passed as an argument: one launch (and one CUDA
        # graph node) serves every step.
        n = tl.load(staging_ptr)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        index = tl.load(staging_ptr + 1 + offs, mask=mask, other=0)
        value = tl.load(staging_ptr + 1 + n + offs, mask=mask, other=0)
        tl.store(table_ptr + index, value, mask=mask)
        in_batch = batch_offset + offs < num_words
        word = tl.load(staging_ptr + batch_offset + offs, mask=in_batch, other=0)
        tl.store(dev_ptr + batch_offset + offs, word, mask=in_batch)

    _scatter_launch = Launcher(_staged_scatter_kernel, dynamic=(3, 4))

SCATTER_BLOCK = 1024


def launch_staged_scatter(flat_table: torch.Tensor, staging: torch.Tensor, dev: torch.Tensor,
                          max_pairs: int, batch_offset: int) -> None:
    """One launch for a staging buffer: ``flat_table[index[i]] = value[i]`` for the
    ``staging[0]`` pairs that follow the count (indices, then values), and the batch words
    ``staging[batch_offset:]`` copied to ``dev[batch_offset:]``; grid from the capacities, so
    one launch (one graph node) serves every step.

    ``staging`` is int32 ``[num_words]``: pinned host memory, which a CUDA kernel reads in
    place (so a captured step is kernels only), or a tensor on the table's device. ``dev`` is
    int32 ``[num_words]`` on the table's device (it may be ``staging`` itself when
    ``batch_offset == num_words``: no batch)."""
    if not HAS_TRITON:
        raise RuntimeError("the device scatter needs the triton package (CUDA builds of torch "
                           "bring it: pip install triton)")
    num_words = staging.numel()
    most = max(max_pairs, num_words - batch_offset)
    _scatter_launch((max(1, cdiv(most, SCATTER_BLOCK)),), flat_table, staging, dev, num_words,
                    batch_offset, SCATTER_BLOCK)
