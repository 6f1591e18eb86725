"""The blocks of one KV cache group: reference counts, the free queues and the prefix index."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from blocktable._fastnp import count_nonzero
from blocktable.allocator.errors import IntegrityError, OutOfBlocksError
from blocktable.allocator.index import PrefixIndex
from blocktable.allocator.integrity import check_pool_integrity
from blocktable.block_queue import BlockQueue, last_occurrences
from blocktable.host_tier import HostTier

# The reference a release drops, in the dtype of ref_counts (a Python int would take ufunc.at's
# slow path, ~20x slower; a 0-d array costs a little less per call than a numpy scalar).
_ONE = np.ones((), dtype=np.int32)


class BlockPool:
    """``num_blocks`` blocks of one KV cache group; block 0 is the null block, never handed out.

    A block is *owned* (reference count > 0: held by that many requests) or *free*. Free blocks
    wait in two queues, and :meth:`take` empties them in this order:

    1. free blocks holding no cached content, least recently freed first;
    2. free cached blocks, least recently used first. Taking one *evicts* it: its record dies
       (see :mod:`blocktable.allocator.index`), so no lookup returns it for its old content.

    :meth:`release` queues blocks in the order given; the manager passes a request's blocks
    tail first, so its tail is evicted before the prefix other requests may share.

    A block computed with content that an owned block already holds becomes a *duplicate*:
    owned, not indexed, and promoted to holder when the holder is freed, so content stays
    findable while any request owns a copy. A content computed while its holder is free moves
    to the new block (the old one becomes an uncached free block).

    Parameters
    ----------
    num_blocks : int
        Pool size including the null block; at least 2.
    block_size : int
        Tokens per block (the records of the prefix index store them).
    enable_caching : bool
        When False, nothing is ever cached and every free block is uncached.
    max_records : int, optional
        Records the prefix index keeps, live or dead (see :class:`PrefixIndex`).
    num_host_blocks : int
        Blocks of a host tier (:class:`~blocktable.host_tier.HostTier`) that keeps
        evicted contents findable; 0 (default): none, evicted contents are forgotten.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 1,
        *,
        enable_caching: bool = True,
        max_records: int | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Per block id, on cpu:
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.record = np.full(num_blocks, -1, dtype=np.int64)  # record slot held, -1 = none
        self.dup_of = np.full(num_blocks, -1, dtype=np.int64)  # record an owned copy duplicates
        self.dups: dict[int, list[int]] = {}  # record slot -> its owned duplicate blocks
        self.uncached = BlockQueue(num_blocks, np.arange(1, num_blocks, dtype=np.int32))
        self.cached = BlockQueue(num_blocks)  # least recently used first
        self.index = PrefixIndex(num_blocks, block_size, max_records, num_host_blocks)
        self.host = HostTier(num_host_blocks, self.index) if num_host_blocks else None
        self.num_cached_blocks = 0  # blocks whose content is findable (owned or free)

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that :meth:`take` can hand out now (uncached or evictable)."""
        return len(self.uncached) + len(self.cached)

    def ref_count(self, block_id: int) -> int:
        """How many requests hold ``block_id``."""
        return int(self.ref_counts[block_id])

    def content_id(self, block_id: int) -> int | None:
        """The content id of a cached block (its holder's record), else None."""
        slot = int(self.record[block_id])
        return int(self.index.cid[slot]) if slot >= 0 else None

    def block_hash(self, block_id: int) -> int | bytes | None:
        """The block hash of the content a cached or duplicate block holds, else None.

        The fast block key (int) unless the manager keeps byte-chained hashes.
        """
        slot = int(self.record[block_id])
        if slot < 0:
            slot = int(self.dup_of[block_id])
        if slot < 0:
            return None
        stored = self.index.hashes[slot]
        return int(self.index.key[slot]) if stored is None else stored  # type: ignore[return-value]

    def eviction_order(self) -> list[int]:
        """Free block ids in the order :meth:`take` hands them out (for tests and debugging)."""
        return [*self.uncached.ids().tolist(), *self.cached.ids().tolist()]

    # ----------------------------------------------------------------- blocks
    def take(self, num_blocks: int) -> np.ndarray:
        """Hand out ``num_blocks`` free blocks with reference count 1 (int32, evicting cached).

        Raises
        ------
        OutOfBlocksError
            When fewer blocks are free; nothing is taken.
        """
        num_uncached = len(self.uncached)
        if num_blocks <= num_uncached:
            block_ids = self.uncached.pop(num_blocks)
            # (an int32 index costs a cast inside every gather and scatter, more than one astype)
            self.ref_counts[block_ids.astype(np.intp)] = 1
            if self.host is not None and self.host.has_pending_restores:
                self.host.cancel_restores(block_ids)
            return block_ids
        num_evict = num_blocks - num_uncached
        if num_evict > len(self.cached):
            raise OutOfBlocksError(
                f"need {num_blocks} blocks, {self.num_free_blocks} free of {self.num_blocks - 1}"
            )
        evicted = self.cached.pop(num_evict)
        at = evicted.astype(np.intp)
        self._evict(at)
        self.ref_counts[at] = 1
        if num_uncached:
            uncached = self.uncached.pop(num_uncached)
            self.ref_counts[uncached.astype(np.intp)] = 1
            evicted = np.concatenate((uncached, evicted))
        if self.host is not None and self.host.has_pending_restores:
            self.host.cancel_restores(evicted)
        return evicted

    def _evict(self, block_ids: np.ndarray) -> None:
        """Kill the records of cached ``block_ids`` (intp ``[n]``, just popped: distinct)."""
        record = self.record
        slots = record.take(block_ids)
        if self.host is not None:
            self.host.offload(slots, block_ids)
        self.index.kill(slots)
        record[block_ids] = -1
        self.num_cached_blocks -= len(block_ids)

    def share_many(self, block_ids: np.ndarray) -> None:
        """One more reference per entry of ``block_ids`` (cached or owned; repeats allowed);
        free ones leave the free queue."""
        ref_counts = self.ref_counts
        refs = ref_counts.take(block_ids)
        if count_nonzero(refs) < len(refs):  # some were free
            self.cached.remove(last_occurrences(block_ids[refs == 0]))
        np.add.at(ref_counts, block_ids, _ONE)

    def release(self, block_ids: np.ndarray, *, may_repeat: bool = False) -> None:
        """Drop one reference per entry; blocks reaching 0 join the free queues in order.

        ``block_ids`` (int32 or, faster, intp) may repeat an id only with ``may_repeat``
        (several requests released at once); such a block is queued where its last reference
        was dropped.
        """
        ref_counts = self.ref_counts
        np.subtract.at(ref_counts, block_ids, _ONE)  # faster than -= even without repeats
        left = ref_counts.take(block_ids)
        # count_nonzero, argmin and boolean indexing: the cheapest numpy calls for these tests
        freed = block_ids[left == 0] if count_nonzero(left) else block_ids
        if len(freed):
            self.queue_freed(freed, may_repeat=may_repeat)

    def queue_freed(self, freed: np.ndarray, *, may_repeat: bool = False) -> None:
        """Queue blocks whose last reference was just dropped (``freed``: int32 or intp, in
        release order; an id repeated only with ``may_repeat``, queued where it occurs last):
        the cached ones for eviction, the others as plain free blocks."""
        if self.dups:
            if may_repeat:
                freed, may_repeat = last_occurrences(freed), False
            self._release_duplicates(freed)
        slots = self.record.take(freed)
        cached = slots >= 0
        if count_nonzero(cached) == len(freed):  # (usually: full computed blocks)
            self.cached.extend(freed, may_repeat=may_repeat)
            return
        self.uncached.extend(freed[~cached], may_repeat=may_repeat)
        self.cached.extend(freed[cached], may_repeat=may_repeat)

    def _release_duplicates(self, freed: np.ndarray) -> None:
        """Freed duplicates are forgotten; freed holders with an owned duplicate hand over.

        ``freed``: the freed block ids (distinct), in release order.
        """
        record, dup_of, dups = self.record, self.dup_of, self.dups
        if len(freed) > 32:
            # Only freed duplicates and freed holders of a record with duplicates change (a
            # handover promotes a duplicate, never another block): drop the others first.
            # Holders are never duplicates (dup_of -1): mark them -2 for one gather.
            holders = self.index.holder[np.fromiter(dups, dtype=np.int64, count=len(dups))]
            dup_of[holders] = -2
            freed = freed[dup_of.take(freed) != -1]
            dup_of[holders] = -1
        for block_id in freed.tolist():
            slot = int(dup_of[block_id])
            if slot >= 0:
                copies = dups[slot]
                copies.remove(block_id)
                if not copies:
                    del dups[slot]
                dup_of[block_id] = -1
                continue
            slot = int(record[block_id])
            if slot >= 0 and slot in dups:
                copies = dups[slot]
                new_holder = copies.pop()
                if not copies:
                    del dups[slot]
                dup_of[new_holder] = -1
                record[new_holder] = slot
                self.index.holder[slot] = new_holder
                record[block_id] = -1

    # ----------------------------------------------------------------- prefix index
    def cache(
        self,
        block_ids: np.ndarray,
        keys: np.ndarray,
        tokens: np.ndarray,
        chain_starts: np.ndarray,
        first_parents: np.ndarray,
        hashes: Sequence[object] | None = None,
    ) -> np.ndarray:
        """Make owned, full, computed blocks findable; return their content ids (int64).

        ``block_ids`` (int32 ``[n]``), their ``keys`` (uint64) and ``tokens`` (int64
        ``[n, block_size]``) are chains of blocks: chain ``j`` starts at entry
        ``chain_starts[j]`` (int64 ``[m]``, ascending, the first 0) and its first block's
        parent content id is ``first_parents[j]`` (int64 ``[m]``); every other block's parent
        is the content of the entry before it. ``hashes``: block hashes to keep when they are
        not the keys.
        """
        n = len(block_ids)
        index = self.index
        slots = index.take_slots(n)
        if index.file_absent(keys, slots):
            # content ids are consecutive: the parent of an entry inside a chain is cids - 1
            cids = np.arange(index.next_cid, index.next_cid + n, dtype=np.int64)
            parent_ids = cids - 1
            parent_ids[chain_starts] = first_parents
            self._file_new(block_ids, tokens, slots, cids, parent_ids)
            if hashes is not None:
                index.any_hashes = True
                for slot, block_hash in zip(slots.tolist(), hashes):
                    index.hashes[slot] = block_hash
            return cids
        index.untake_slots(slots)
        parents = np.zeros(n, dtype=np.int64)  # 0: the content of the entry before
        parents[chain_starts] = first_parents
        return self._cache_one_by_one(block_ids, keys, tokens, parents, hashes)

    def _file_new(
        self,
        block_ids: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
        cids: np.ndarray,
        parent_ids: np.ndarray,
    ) -> None:
        """Write the records of new contents at ``slots`` (their keys are filed already;
        ``cids`` continue ``index.next_cid``), held by ``block_ids``."""
        index = self.index
        index.next_cid += len(slots)
        index.cid[slots] = cids
        index.parent[slots] = parent_ids
        index.write_tokens(slots, tokens)
        index.holder[slots] = block_ids  # (index.key: written by file_absent)
        # (an int32 index costs a cast per element inside the scatter: more than one astype)
        self.record[block_ids.astype(np.intp, copy=False)] = slots
        self.num_cached_blocks += len(slots)

    def _cache_one_by_one(
        self,
        block_ids: np.ndarray,
        keys: np.ndarray,
        tokens: np.ndarray,
        parents: np.ndarray,
        hashes: Sequence[object] | None,
    ) -> np.ndarray:
        """:meth:`cache` when some key is already filed (recomputed, duplicated or colliding)."""
        index, record, ref_counts = self.index, self.record, self.ref_counts
        cids = np.zeros(len(block_ids), dtype=np.int64)
        prev = 0
        for i, block_id in enumerate(block_ids.tolist()):
            parent = int(parents[i]) or prev
            key = keys[i : i + 1]
            slot = index.find_one(int(key[0]))
            if slot >= 0:
                if int(index.parent[slot]) == parent and (index.tokens[slot] == tokens[i]).all():
                    prev = cids[i] = int(index.cid[slot])
                    holder = int(index.holder[slot])
                    if holder == 0:  # evicted: this block holds it again
                        index.holder[slot] = block_id
                        record[block_id] = slot
                        self.num_cached_blocks += 1
                    elif ref_counts[holder]:
                        self.dup_of[block_id] = slot
                        self.dups.setdefault(slot, []).append(block_id)
                    else:  # the holder is free: keep the owned copy
                        self.cached.remove(np.array([holder]))
                        self.uncached.append(holder)
                        record[holder] = -1
                        index.holder[slot] = block_id
                        record[block_id] = slot
                    continue
                self._displace(slot)
            [slot] = index.take_slots(1).tolist()
            prev = cids[i] = index.next_cid
            index.next_cid += 1
            index.cid[slot] = prev
            index.parent[slot] = parent
            index.tokens[slot] = tokens[i]
            index.holder[slot] = block_id
            index.hashes[slot] = None if hashes is None else hashes[i]
            index.any_hashes |= hashes is not None
            index.file_one(int(key[0]), slot)
            record[block_id] = slot
            self.num_cached_blocks += 1
        return cids

    def _displace(self, slot: int) -> None:
        """Another content takes ``slot``'s key: the record and its holder's cache state go."""
        holder = int(self.index.holder[slot])
        if holder:
            if not self.ref_counts[holder]:
                self.cached.remove(np.array([holder]))
                self.uncached.append(holder)
            self.record[holder] = -1
            self.num_cached_blocks -= 1
        for block_id in self.dups.pop(slot, []):
            self.dup_of[block_id] = -1
        if self.host is not None:
            self.host.forget_record(slot)
        self.index.drop(np.array([slot]))

    def reset_cache(self) -> None:
        """Forget every cached content (every block must be free): all become uncached."""
        cached = self.cached.ids()
        self.cached.remove(cached)
        self.uncached.extend(cached)
        self.record[:] = -1
        self.index.clear()
        if self.host is not None:
            self.host.clear()
        self.num_cached_blocks = 0

    def restore(self, slots: np.ndarray) -> np.ndarray:
        """Give records ``slots`` (distinct, int64 ``[n]``, findable only on the host) fresh
        device blocks holding them again (reference count 1 each, like :meth:`take`) and queue
        their copies from the host; return the blocks (int32 ``[n]``).

        Raises
        ------
        OutOfBlocksError
            Fewer than ``n`` free blocks; nothing changed.
        """
        host = self.host
        if host is None:
            raise ValueError("this pool has no host tier")
        if len(slots) > self.num_free_blocks:
            raise OutOfBlocksError(
                f"restore needs {len(slots)} blocks, {self.num_free_blocks} free"
            )
        host_blocks = host.pin_sources(slots)  # (before the take: it may evict on the host)
        block_ids = self.take(len(slots))
        at = block_ids.astype(np.intp)
        self.record[at] = slots
        self.index.holder[slots] = block_ids
        self.num_cached_blocks += len(slots)
        host.restore(host_blocks, block_ids)
        return block_ids

    def check_integrity(self, expected_ref_counts: Sequence[int] | np.ndarray) -> None:
        """Check refcounts against ``expected_ref_counts`` and the queues against the index.

        See :func:`blocktable.allocator.integrity.check_pool_integrity`.
        """
        check_pool_integrity(self, expected_ref_counts)
        if self.host is not None:
            self.host.check_integrity(_host_tier_failed)


def _host_tier_failed(msg: str) -> NoReturn:
    raise IntegrityError(f"host tier: {msg}")
