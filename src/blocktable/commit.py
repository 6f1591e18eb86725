"""Incremental commit: move only what changed on the host to the device.

Each commit gathers the changed entries of every group (the storage's journal of written runs)
and their rows' counts as ``(flat index, value)`` pairs into a pinned staging buffer, then
launches *one* scatter kernel that reads the staging buffer directly (pinned memory is mapped
into the device's address space; where that is refused, one asynchronous copy to a device
buffer comes first). Bytes moved are ``8 * changed entries``, not ``4 * num_reqs * width``. Two
staging buffers alternate; a buffer is refilled only after the kernel that read it has finished
(a CUDA event says so). When the change outgrows the staging buffer, the changed row span of
each group is copied directly from the host table instead; host writes then wait for that copy
(:meth:`TableStorage.before_host_write`). On the CPU the pairs are written with numpy into
the CPU copy, on the calling thread (no torch op, so no intra-op thread pool).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from blocktable._host_loops import fill_staging
from blocktable._triton import HAS_TRITON, Launcher, cdiv, tl, triton
from blocktable.storage import TableStorage


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
        ``"triton"`` (scatter kernel) or ``"torch"`` (indexed assignment; CPU tensors).
    staging_entries : int or None
        Capacity of each staging buffer in changed entries; beyond it a commit copies row spans.
        Default: ``max(1024, num_entries // 40)``, so the two pinned staging buffers add at
        most ~10% to the table's pinned memory for large tables.
    """

    def __init__(
        self, storage: TableStorage, backend: str, staging_entries: int | None = None
    ) -> None:
        self.storage = storage
        self.backend = backend
        cap = staging_entries if staging_entries is not None else max(
            1024, storage.num_entries // 40
        )
        self.capacity = int(cap)
        storage.set_journal_capacity(self.capacity)
        pin = storage.pinned
        # on cpu (pinned with CUDA), int32 [2, 2*capacity]: indices then values, two buffers
        self._staging_host = torch.zeros(2, 2 * self.capacity, dtype=torch.int32, pin_memory=pin)
        self._staging_np = self._staging_host.numpy()
        # on device, int32 [2*capacity]; only the copy path needs it (made on first use)
        self._staging_dev: torch.Tensor | None = None
        cuda = storage.device.type == "cuda"
        # one reusable event per staging buffer: recorded after the copy that reads it
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._in_flight = [False, False]
        self._staging_rows = [self._staging_host[0], self._staging_host[1]]  # sliced once
        # Pinned memory is mapped into the device's address space (unified addressing), so the
        # scatter kernel can read the staging buffer itself: no separate copy to issue. If the
        # platform refuses, the first commit falls back to copy + scatter for good.
        self._zero_copy = cuda and backend == "triton"
        self._device_index = storage.device.index or 0
        self._stream_raw: int | None = None
        self._stream: torch.cuda.Stream | None = None
        self._next = 0
        # on cpu, int32 [num_entries]: the CPU "device" copy as numpy (same memory), so a CPU
        # commit is numpy work on one thread, whatever torch's intra-op thread pool is doing
        self._device_np = storage.device_tensor.numpy() if storage.device.type == "cpu" else None
        self.last: CommitStats = _NOTHING

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
        n = fill_staging(st.journal, st.journal_len, st.dirty_rows, st.counts_offset,
                         st.host, buf, self.capacity)
        if n < 0:
            groups, rows = np.nonzero(st.dirty_rows)
            self.last = self._copy_spans(groups, rows)
        else:
            self._next ^= 1
            self._scatter(slot, n)
            self.last = CommitStats(n, 8 * n, False)
            st.changed = False  # fill_staging reset the dirty rows and the journal
            return self.last
        st.reset_changes()
        return self.last

    # ---- small change: staged scatter -------------------------------------------------
    def _scatter(self, slot: int, n: int) -> None:
        """Write the ``n`` staged pairs of buffer ``slot`` into the device table."""
        st = self.storage
        if self._device_np is not None:
            buf = self._staging_np[slot]
            self._device_np.put(buf[:n], buf[n : 2 * n])
            return
        if self.backend == "torch":
            index = torch.from_numpy(self._staging_np[slot, :n].astype(np.int64))
            st.device_tensor[index.to(st.device)] = self._staging_host[slot, n : 2 * n].to(
                st.device
            )
            return
        if not (self._zero_copy and self._scatter_from_host(slot, n)):
            if self._staging_dev is None:
                self._staging_dev = torch.zeros(
                    2 * self.capacity, dtype=torch.int32, device=st.device
                )
            dev = self._staging_dev[: 2 * n]
            dev.copy_(self._staging_host[slot, : 2 * n], non_blocking=True)
            _launch_scatter(st.device_tensor, dev, n)
        event = self._events[slot]
        if event is not None:
            event.record(self._current_stream())
            self._in_flight[slot] = True

    def _scatter_from_host(self, slot: int, n: int) -> bool:
        try:
            _launch_scatter(self.storage.device_tensor, self._staging_rows[slot], n)
        except Exception:  # noqa: BLE001 - any refusal means: use the copy path
            self._zero_copy = False
            return False
        return True

    def _current_stream(self) -> torch.cuda.Stream:
        """The current stream, without building a new Stream object on every call."""
        index = self._device_index
        raw = int(torch._C._cuda_getCurrentRawStream(index))
        if raw != self._stream_raw or self._stream is None:
            self._stream = torch.cuda.current_stream(index)
            self._stream_raw = raw
        return self._stream

    # ---- large change: copy each group's changed row span -------------------------------
    def _copy_spans(self, groups: np.ndarray, rows: np.ndarray) -> CommitStats:
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

    @triton.jit(do_not_specialize=["num_entries"], do_not_specialize_on_alignment=["staging_ptr"])
    def _scatter_kernel(dst_ptr, staging_ptr, num_entries, BLOCK: tl.constexpr):
        """``dst[staging[i]] = staging[num_entries + i]`` for ``i < num_entries``."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < num_entries
        index = tl.load(staging_ptr + offs, mask=mask, other=0)
        value = tl.load(staging_ptr + num_entries + offs, mask=mask, other=0)
        tl.store(dst_ptr + index, value, mask=mask)


_SCATTER_BLOCK = 1024


_scatter_launcher = Launcher(_scatter_kernel, dynamic=(2,)) if HAS_TRITON else None


def _launch_scatter(dst: torch.Tensor, staging: torch.Tensor, num_entries: int) -> None:
    if _scatter_launcher is None:
        raise RuntimeError("the Triton commit path needs the triton package")
    grid = (cdiv(num_entries, _SCATTER_BLOCK),)
    _scatter_launcher(grid, dst, staging, num_entries, _SCATTER_BLOCK)
