"""The block allocator: where block ids come from.

:class:`KVCacheManager` hands out manager block ids per request and KV cache group, with a
null block, LRU eviction, reference counts, exact prefix caching over chained block keys,
forking and sliding windows; :meth:`KVCacheManager.take_step_update` returns a step's row
changes as one :class:`~blocktable.update.StepUpdate` for the table's batched update.
``docs/allocator.md`` says how it is built and which choices an engine author should know.
"""

from __future__ import annotations

from blocktable.allocator.errors import IntegrityError, OutOfBlocksError, OutOfRowsError
from blocktable.allocator.manager import KVCacheManager
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.spec import AllocatorGroupSpec
from blocktable.allocator.stats import PrefixCacheStats
from blocktable.block_hashing import (
    ROOT_BLOCK_HASH,
    HashFn,
    fast_block_keys,
    hash_block_tokens,
    sha256_block_hash,
)
from blocktable.host_tier import HostTierStats, HostTransfers

__all__ = [
    "ROOT_BLOCK_HASH",
    "AllocatorGroupSpec",
    "BlockPool",
    "HashFn",
    "HostTierStats",
    "HostTransfers",
    "IntegrityError",
    "KVCacheManager",
    "OutOfBlocksError",
    "OutOfRowsError",
    "PrefixCacheStats",
    "fast_block_keys",
    "hash_block_tokens",
    "sha256_block_hash",
]
