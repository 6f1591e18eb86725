"""The host copy of a paged KV cache: the tensors behind the allocator's host tier.

:meth:`KVCacheManager.take_transfers` says which blocks move; :class:`HostKVCache` moves them,
per step, one batched gather and one copy per direction:

* **offload** (device block -> host block), first: the step's evicted blocks are gathered on
  the device into one contiguous buffer and copied to pinned host memory; the device blocks may
  be written as soon as the gather is done;
* **restore** (host block -> device block), then: the host blocks are gathered on the host into
  a pinned buffer, copied to the device and scattered into the device blocks before the first
  layer reads them.

On CUDA both run on a side stream: the compute stream waits on an *event* recorded after the
offload gather and the restore scatter (no host synchronize), and the host scatter of an
offload happens when it is next needed (the next step's transfers, or a restore of a block it
wrote). On the CPU the same steps are plain index copies.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from blocktable.host_tier import HostTransfers

_BLOCK_DIM = 2  # kv_cache is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]


@dataclass
class HostCopyStats:
    """Bytes, blocks and time the copies took since the cache was built."""

    num_offloaded_blocks: int = 0
    num_restored_blocks: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0
    copy_time_s: float = 0.0  # host time in transfer() (CUDA: issuing the copies)


def available_host_bytes() -> int | None:
    """Host memory not in use now, in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class HostKVCache:
    """``num_host_blocks`` host blocks laid out like the device cache's blocks.

    Parameters
    ----------
    kv_cache : torch.Tensor
        The device cache, ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
        (any device; blocks along dim 2).
    num_host_blocks : int
        Host blocks (the allocator's ``host_blocks``); host block ids are
        ``1 .. num_host_blocks``, block 0 is unused.

    Attributes
    ----------
    host : torch.Tensor
        ``[num_layers, 2, num_host_blocks + 1, block_size, num_kv_heads, head_dim]`` on cpu,
        pinned when ``kv_cache`` is on CUDA, same dtype.

    Raises
    ------
    ValueError
        ``num_host_blocks`` below 1, or more bytes than the host has free: checked before
        anything is allocated.
    """

    def __init__(self, kv_cache: torch.Tensor, num_host_blocks: int) -> None:
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int):
            raise TypeError(f"num_host_blocks must be an int, got {type(num_host_blocks).__name__}")
        if num_host_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1, got {num_host_blocks}")
        if kv_cache.dim() != 6:
            raise ValueError(f"kv_cache must have 6 dims, got shape {tuple(kv_cache.shape)}")
        shape = list(kv_cache.shape)
        shape[_BLOCK_DIM] = num_host_blocks + 1
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        need, free = (num_host_blocks + 1) * self.block_bytes, available_host_bytes()
        if free is not None and need > free:
            raise ValueError(
                f"num_host_blocks={num_host_blocks} needs {need / 2**30:.2f} GiB of host memory "
                f"({self.block_bytes} bytes per block), {free / 2**30:.2f} GiB are free"
            )
        self.kv_cache = kv_cache
        self.cuda = kv_cache.device.type == "cuda"
        self.host = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=self.cuda)
        self.stats = HostCopyStats()
        if self.cuda:
            self.stream = torch.cuda.Stream(device=kv_cache.device)
        # an offload copied to the host but not yet scattered: (done event, pinned rows, ids)
        self._landing: tuple[torch.cuda.Event, torch.Tensor, torch.Tensor] | None = None

    # ----------------------------------------------------------------- one step
    def transfer(self, transfers: HostTransfers) -> None:
        """Perform one step's copies: offloads, then restores (see the module docstring).

        Call before the forward of the step whose allocations queued them; on CUDA the
        current stream waits on events, the host does not block.
        """
        t0 = time.perf_counter()
        offload, restore = transfers.offload, transfers.restore
        if len(offload):
            self._offload(offload[:, 0], offload[:, 1])
        if len(restore):
            self._restore(restore[:, 0], restore[:, 1])
        self.stats.num_offloaded_blocks += len(offload)
        self.stats.num_restored_blocks += len(restore)
        self.stats.offloaded_bytes += len(offload) * self.block_bytes
        self.stats.restored_bytes += len(restore) * self.block_bytes
        self.stats.copy_time_s += time.perf_counter() - t0

    def synchronize(self) -> None:
        """Wait for every issued copy and land pending offloads in :attr:`host`."""
        self._land()

    # ----------------------------------------------------------------- directions
    def _offload(self, device_ids: np.ndarray, host_ids: np.ndarray) -> None:
        src = torch.from_numpy(device_ids.astype(np.int64))
        dst = torch.from_numpy(host_ids.astype(np.int64))
        if not self.cuda:
            self.host.index_copy_(_BLOCK_DIM, dst, self.kv_cache.index_select(_BLOCK_DIM, src))
            return
        self._land()  # (the previous step's: long done, its event only checked)
        compute = torch.cuda.current_stream(self.kv_cache.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)  # the blocks hold what earlier steps wrote
            src_dev = src.to(self.kv_cache.device, non_blocking=True)
            gathered = self.kv_cache.index_select(_BLOCK_DIM, src_dev)
            gathered_event = torch.cuda.Event()
            gathered_event.record(self.stream)
            pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            pinned.copy_(gathered, non_blocking=True)
            gathered.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(gathered_event)  # the device blocks may be reused after the gather
        self._landing = (done, pinned, dst)

    def _restore(self, host_ids: np.ndarray, device_ids: np.ndarray) -> None:
        src = torch.from_numpy(host_ids.astype(np.int64))
        dst = torch.from_numpy(device_ids.astype(np.int64))
        if not self.cuda:
            self.kv_cache.index_copy_(_BLOCK_DIM, dst, self.host.index_select(_BLOCK_DIM, src))
            return
        if self._landing is not None and bool(np.isin(host_ids, self._landing[2].numpy()).any()):
            self._land()  # a block offloaded this very step comes back: it must land first
        shape = list(self.host.shape)
        shape[_BLOCK_DIM] = len(host_ids)
        pinned = torch.empty(shape, dtype=self.host.dtype, pin_memory=True)
        torch.index_select(self.host, _BLOCK_DIM, src, out=pinned)  # the host-side gather
        compute = torch.cuda.current_stream(self.kv_cache.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)  # after the offload gathers and earlier reads
            staged = pinned.to(self.kv_cache.device, non_blocking=True)
            dst_dev = dst.to(self.kv_cache.device, non_blocking=True)
            self.kv_cache.index_copy_(_BLOCK_DIM, dst_dev, staged)
            staged.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)  # the layers read the blocks after the scatter
        # the pinned buffer must outlive the async copy: keep it until the event passed
        self._restore_keepalive = (done, pinned)

    def _land(self) -> None:
        """Scatter the last offload's pinned rows into :attr:`host` once its copy is done."""
        if self._landing is None:
            return
        done, pinned, dst = self._landing
        done.synchronize()
        self.host.index_copy_(_BLOCK_DIM, dst, pinned)
        self._landing = None
