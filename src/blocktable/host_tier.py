"""The host tier of one pool: host-memory copies of cached block contents, indexed by record.

The pool's prefix index (:mod:`blocktable.allocator.index`, read and written here through
:class:`RecordIndex`) is shared by both tiers: a record's
``holder`` is its device block (0 once evicted from the device) and its ``host_block`` the host
block holding a copy (0 when none). A record is *findable* while either is set.

* **Offload.** When the device pool evicts a cached block whose content has no host copy, the
  content takes a host block (an empty one first, else the least recently used one, whose
  content is forgotten) and the pair ``(device block, host block)`` is queued: the engine must
  copy it before the device block is written again. With every host block pinned (see below)
  the content is simply dropped: a full host tier never blocks the device.
* **Restore.** A prefix hit on a record with no device holder gets a fresh device block; the
  pair ``(host block, device block)`` is queued: the engine copies it before any layer reads
  the block. The host copy stays (the tiers are inclusive), so a restored block that is evicted
  again costs no second copy.
* **Pins.** Host blocks that are the source or the destination of a queued pair are *pinned*
  until :meth:`HostTier.take_transfers`: they are never evicted in between, so a queued restore
  always reads what was offloaded, and no host block is written twice in one step. The engine
  copies offloads before restores (a device block evicted and restored into in one step is read
  before it is overwritten).

Host block ids are ``1 .. num_host_blocks`` (0 means "none", like the device null block); the
host tensor has ``num_host_blocks + 1`` blocks, block 0 unused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import numpy as np

from blocktable.block_queue import BlockQueue

_NO_PAIRS = np.zeros((0, 2), dtype=np.int32)
_NO_PAIRS.flags.writeable = False


def host_memory_bytes() -> int | None:
    """Physical memory of this host in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_blocks_fit(num_host_blocks: int, block_size: int, num_groups: int) -> None:
    """Raise ``ValueError`` when the allocator's bookkeeping for ``num_host_blocks`` host
    blocks per group (records with their token ids, queues) would not fit in host memory."""
    if not num_host_blocks:
        return
    # per host block: two index records (token ids, ids, key) and the tier's own entries
    per_block = 2 * (8 * block_size + 48) + 32
    need, have = num_host_blocks * per_block * num_groups, host_memory_bytes()
    if have is not None and need > have:
        raise ValueError(
            f"host_blocks={num_host_blocks} needs about {need / 2**30:.1f} GiB of bookkeeping "
            f"alone, more than this host's {have / 2**30:.1f} GiB of memory"
        )


@dataclass(frozen=True)
class HostTransfers:
    """The copies one group's KV cache needs before the next forward, in this order.

    Attributes
    ----------
    offload : np.ndarray
        On cpu, int32 ``[num_offloads, 2]``: ``(device block, host block)`` pairs; copy them
        first (before any device block is written by a restore or the forward).
    restore : np.ndarray
        On cpu, int32 ``[num_restores, 2]``: ``(host block, device block)`` pairs; copy them
        after the offloads, before the first layer reads the device blocks.
    """

    offload: np.ndarray
    restore: np.ndarray

    def __bool__(self) -> bool:
        return bool(len(self.offload) or len(self.restore))


@dataclass(frozen=True)
class HostTierStats:
    """Host-tier counters of one group since the manager was built (blocks).

    Attributes
    ----------
    num_host_blocks : int
        Host blocks of the tier.
    num_offloaded_blocks : int
        Device blocks copied to the host on eviction.
    num_restored_blocks : int
        Host blocks copied back to the device on a prefix hit.
    num_dropped_blocks : int
        Evicted contents not offloaded because every host block was pinned.
    num_host_evictions : int
        Host copies forgotten to make room for newer ones.
    """

    num_host_blocks: int = 0
    num_offloaded_blocks: int = 0
    num_restored_blocks: int = 0
    num_dropped_blocks: int = 0
    num_host_evictions: int = 0


class RecordIndex(Protocol):
    """What the host tier reads and writes of a prefix index's records (all on cpu, by record
    slot): ``cid`` (int64, 0 for an unused slot), ``holder`` (int32, the device block, 0 when
    evicted) and ``host_block`` (int32, the host block holding a copy, 0 when none);
    ``kill(slots)`` marks records with no copy left as dead (recyclable)."""

    cid: np.ndarray
    holder: np.ndarray
    host_block: np.ndarray | None

    def kill(self, slots: np.ndarray) -> None: ...


class HostTier:
    """``num_host_blocks`` host blocks holding copies of the contents of ``index``'s records.

    Parameters
    ----------
    num_host_blocks : int
        Host blocks (at least 1).
    index : RecordIndex
        The pool's prefix index; its ``host_block`` array is this tier's record side.
    """

    def __init__(self, num_host_blocks: int, index: RecordIndex) -> None:
        if index.host_block is None:
            raise ValueError("the prefix index was built without a host tier")
        self.num_host_blocks = num_host_blocks
        self.index = index
        n = num_host_blocks + 1
        self.record = np.full(n, -1, dtype=np.int64)  # on cpu, per host block: record slot
        self.empty = BlockQueue(n, np.arange(1, n, dtype=np.int32))  # holding no content
        self.lru = BlockQueue(n)  # holding a content, unpinned, least recently used first
        self.pinned = np.zeros(n, dtype=bool)  # on cpu, per host block
        self._pins: list[np.ndarray] = []  # pinned host blocks (int32), in pin order
        self._offloads: list[np.ndarray] = []  # int32 [n, 2]: (device block, host block)
        self._restores: dict[int, int] = {}  # device block -> host block
        self.num_offloaded = self.num_restored = self.num_dropped = self.num_evicted = 0

    @property
    def stats(self) -> HostTierStats:
        return HostTierStats(
            self.num_host_blocks,
            self.num_offloaded,
            self.num_restored,
            self.num_dropped,
            self.num_evicted,
        )

    @property
    def has_pending_restores(self) -> bool:
        return bool(self._restores)

    # ----------------------------------------------------------------- device eviction
    def offload(self, slots: np.ndarray, block_ids: np.ndarray) -> None:
        """The device blocks ``block_ids`` holding records ``slots`` (both ``[n]``, distinct,
        in eviction order) are being evicted: keep each content on the host (queue its copy),
        or drop it when no host block can be had (the last ones of the call are dropped)."""
        host_block = self.index.host_block
        assert host_block is not None
        copies = host_block[slots]
        on_host = copies != 0
        if np.count_nonzero(on_host):
            # a copy is on the host already (restored earlier): it was just used
            used = copies[on_host]
            used = used[~self.pinned[used]]
            self.lru.remove(used)
            self.lru.extend(used)
            slots, block_ids = slots[~on_host], block_ids[~on_host]
        n = len(slots)
        if not n:
            return
        hbs = self.empty.pop(min(n, len(self.empty)))
        if len(hbs) < n:
            evicted = self.lru.pop(min(n - len(hbs), len(self.lru)))
            self._forget_copies(evicted)
            self.num_evicted += len(evicted)
            hbs = np.concatenate((hbs, evicted))
        m = len(hbs)
        self.num_dropped += n - m
        if not m:
            return
        at = hbs.astype(np.intp)
        self.record[at] = slots[:m]
        host_block[slots[:m]] = hbs
        self.pinned[at] = True
        self._pins.append(hbs)
        self._offloads.append(np.stack((block_ids[:m].astype(np.int32), hbs), axis=1))
        self.num_offloaded += m

    def _forget_copies(self, hbs: np.ndarray) -> None:
        """Host blocks ``hbs`` (just popped) no longer hold their records' contents."""
        index = self.index
        assert index.host_block is not None
        at = hbs.astype(np.intp)
        slots = self.record[at]
        self.record[at] = -1
        index.host_block[slots] = 0
        dead = slots[index.holder[slots] == 0]
        if len(dead):
            index.kill(dead)  # now recyclable, like any dead record

    # ----------------------------------------------------------------- restore
    def pin_sources(self, slots: np.ndarray) -> np.ndarray:
        """Pin the host copies of records ``slots`` (distinct, on the host) before device
        blocks are taken for them (a take may offload, and must not evict these); return the
        host blocks (int64 ``[n]``)."""
        assert self.index.host_block is not None
        hbs = self.index.host_block[slots]
        free = hbs[~self.pinned[hbs]]  # (unpinned copies wait in the LRU queue)
        if len(free):
            self.lru.remove(free)
            self.pinned[free] = True
            self._pins.append(free)
        return hbs

    def restore(self, host_blocks: np.ndarray, block_ids: np.ndarray) -> None:
        """Queue the copies of pinned ``host_blocks`` into the device blocks ``block_ids``."""
        for hb, block_id in zip(host_blocks.tolist(), block_ids.tolist()):
            self._restores[block_id] = hb
        self.num_restored += len(block_ids)

    def cancel_restores(self, block_ids: np.ndarray) -> None:
        """Device blocks handed out again before their queued restore was taken: the restore
        is dropped (the block's new user writes it; two copies into one block would race)."""
        for block_id in block_ids.tolist():
            self._restores.pop(block_id, None)

    # ----------------------------------------------------------------- step output
    def take_transfers(self) -> HostTransfers:
        """The queued copies (offloads, then restores) since the last call; unpins their host
        blocks (most recently used last)."""
        offload = np.concatenate(self._offloads) if self._offloads else _NO_PAIRS
        restore = (
            np.array([(hb, d) for d, hb in self._restores.items()], dtype=np.int32)
            if self._restores
            else _NO_PAIRS
        )
        self._offloads, self._restores = [], {}
        if self._pins:
            pins = np.concatenate(self._pins)
            self._pins = []
            self.pinned[pins] = False
            held = self.record[pins] >= 0
            self.lru.extend(pins[held])
            self.empty.extend(pins[~held])  # their records left the index meanwhile
        return HostTransfers(offload, restore)

    # ----------------------------------------------------------------- index changes
    def forget_record(self, slot: int) -> None:
        """Record ``slot`` leaves the index (its key went to another content): drop its copy."""
        assert self.index.host_block is not None
        hb = int(self.index.host_block[slot])
        if not hb:
            return
        self.index.host_block[slot] = 0
        self.record[hb] = -1
        if not self.pinned[hb]:  # (a pinned one goes to `empty` when unpinned)
            self.lru.remove(np.array([hb], dtype=np.int32))
            self.empty.append(hb)

    def clear(self) -> None:
        """Forget every host copy (the index was cleared)."""
        held = self.lru.ids()
        self.lru.remove(held)
        self.empty.extend(held)
        self.record[:] = -1

    # ----------------------------------------------------------------- checks
    def check_integrity(self, fail: Callable[[str], NoReturn]) -> None:
        """Records and host blocks point to each other; every host block is empty, in the
        LRU queue or pinned, exactly once; host copies belong to used records. ``fail(msg)``
        raises what the caller reports an inconsistency with."""
        index = self.index
        assert index.host_block is not None

        empty, lru = self.empty.ids().tolist(), self.lru.ids().tolist()
        pins = [hb for hb in range(1, self.num_host_blocks + 1) if self.pinned[hb]]
        listed = np.concatenate(self._pins).tolist() if self._pins else []
        if sorted(pins) != sorted(listed):
            fail("pin list and pin flags disagree")
        every = empty + lru + pins
        if sorted(every) != list(range(1, self.num_host_blocks + 1)):
            fail("a host block is lost or listed twice (empty, LRU, pinned)")
        if any(self.record[hb] >= 0 for hb in empty):
            fail("an empty host block holds a record")
        if any(self.record[hb] < 0 for hb in lru):
            fail("a host block in the LRU queue holds no record")
        on_host = np.flatnonzero(index.host_block[: len(index.cid)])
        if (index.cid[on_host] == 0).any():
            fail("a host copy belongs to an unused record")
        hbs = index.host_block[on_host].astype(np.int64)
        if not np.array_equal(self.record[hbs], on_host):
            fail("a record and its host block do not point to each other")
        held = np.flatnonzero(self.record >= 0)
        if len(held) != len(on_host):
            fail(f"{len(held)} host blocks hold records, {len(on_host)} records are on the host")
        for hb in self._restores.values():
            if not self.pinned[hb]:
                fail(f"queued restore from host block {hb}, which is not pinned")


# ----------------------------------------------------------------- admission
def fit_restores(
    plans: Sequence[Any],
    pools: Sequence[Any],
    block_sizes: Sequence[int],
    align_tokens: int,
    cap_hit: Callable[[Any, int, Sequence[int]], None],
) -> None:
    """Cap hits whose host blocks would find no free device block, the plans of one call
    in order, so that restoring at admission never runs out of blocks. Free device blocks
    that are hits themselves leave the free queue first: they do not count as free.

    ``plans``: the call's prompt plans (``num_cached_tokens``, per group ``hit_slots``);
    ``pools``: per group, a block pool (``host``, ``index.holder``, ``ref_counts``,
    ``num_free_blocks``); ``cap_hit(plan, num_tokens, block_sizes)`` shortens a plan's hit."""
    hits = [plan for plan in plans if plan.num_cached_tokens]
    if not any(
        pool.host is not None
        and any(np.count_nonzero(pool.index.holder[plan.hit_slots[g]] == 0) for plan in hits)
        for g, pool in enumerate(pools)
    ):
        return  # every hit is on the device (the common case): nothing to restore
    budgets: list[int | None] = []
    for g, pool in enumerate(pools):
        if pool.host is None:
            budgets.append(None)
            continue
        on_device: set[int] = set()
        for plan in plans:
            if plan.num_cached_tokens:
                blocks = pool.index.holder[plan.hit_slots[g]]
                on_device.update(blocks[pool.ref_counts[blocks] == 0].tolist())
        on_device.discard(0)
        budgets.append(pool.num_free_blocks - len(on_device))
    seen: list[set[int]] = [set() for _ in pools]  # restores counted already
    for plan in plans:
        n = plan.num_cached_tokens
        if not n:
            continue
        for g, (pool, bs, budget) in enumerate(zip(pools, block_sizes, budgets)):
            if budget is None:
                continue
            slots = plan.hit_slots[g][: n // bs]
            host_only = slots[pool.index.holder[slots] == 0].tolist()
            new = [i for i, slot in enumerate(host_only) if slot not in seen[g]]
            if len(new) > budget:  # the first restore that does not fit ends the hit
                first = int(np.flatnonzero(slots == host_only[new[budget]])[0])
                n = min(n, first * bs)
        n = n // align_tokens * align_tokens
        if n < plan.num_cached_tokens:
            cap_hit(plan, n, block_sizes)
        for g, (pool, bs, budget) in enumerate(zip(pools, block_sizes, budgets)):
            if budget is None or not n:
                continue
            slots = plan.hit_slots[g]
            fresh = set(slots[pool.index.holder[slots] == 0].tolist()) - seen[g]
            seen[g] |= fresh
            budgets[g] = budget - len(fresh)


def restore_hits(pool: Any, hit_slots: list[np.ndarray]) -> np.ndarray | None:
    """Give the hits' records that are only on the host fresh device blocks (restores
    queued on the pool's host tier); return those blocks (int32, one reference each), or
    None when every hit block is on the device. The hits' device blocks are shared first
    (one reference per hit) so that the restore's take cannot evict them. ``hit_slots``: per
    hit, the record slots of one group's pool ``pool``."""
    slots = hit_slots[0] if len(hit_slots) == 1 else np.concatenate(hit_slots)
    held = pool.index.holder[slots]
    on_host = held == 0
    if not np.count_nonzero(on_host):
        return None
    pool.share_many(held[~on_host])
    need, first = np.unique(slots[on_host], return_index=True)
    return pool.restore(need[np.argsort(first)])  # (in prompt order)
