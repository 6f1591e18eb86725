"""The block allocator: where block ids come from.

:class:`KVCacheManager` hands out manager block ids per request and KV cache group, with a
null block, LRU eviction, reference counts, exact prefix caching over chained block keys,
forking and sliding windows; :meth:`KVCacheManager.take_step_update` returns a step's row
changes as one :class:`~blocktable.update.StepUpdate` for the table's batched update.

How it is built, and the choices an engine author should know:

* **Where things live.** :class:`KVCacheManager` (:mod:`~blocktable.allocator.manager`:
  admission, computed tokens, fork, reset) builds on
  :class:`~blocktable.allocator.running.RunningRequests` (rows, block rows, token ids,
  allocation, release, the step's journal); a
  :class:`~blocktable.allocator.prefix_cache.PrefixCache` holds what is known about block
  contents (namespaces, hits, registration); each group's
  :class:`~blocktable.allocator.pool.BlockPool` holds reference counts, free queues and its
  prefix index.
* **Batched calls.** ``add_requests``, ``allocate_many``, ``mark_computed_many``,
  ``free_many`` and ``append_token_ids_many`` take every request of a step; ``add_request``,
  ``allocate``, ``free`` and ``append_token_ids`` are thin wrappers that call them for one
  request; ``mark_computed`` checks its request and records it, and the next call of any
  other method applies the recorded marks as one ``mark_computed_many`` (so a loop of
  per-request marks costs one batched call). Every argument of a batched call is checked
  before anything changes, so a bad id, a repeated id, lengths that disagree,
  ``max_model_len`` or a step that does not fit raise with every pool, row and counter as
  it was.
* **Arrays.** Token ids are a numpy int64 buffer per request and a request's row an int32
  buffer per group (a decode step writes one id into it; a free or a step's journal slices
  and concatenates these arrays); pools, free queues and records are numpy arrays
  (:mod:`~blocktable.allocator.pool`, :mod:`~blocktable.block_queue`,
  :mod:`~blocktable.allocator.index`); the prefix index maps keys to records in a ``dict``.
* **Keys, once per token.** A prompt's block keys are computed at admission in one vectorized
  pass for all prompts of the call (:mod:`~blocktable.block_hashing`); chunks of a long
  prompt reuse them, and blocks filled by generated tokens are keyed when registered, all
  requests of a call in one pass. Chunked prefill therefore hashes what one allocation does.
* **Exact hits.** A key only names a record; a block is shared when its stored tokens and its
  parent's content id match, whatever the key. Records survive eviction (dead, bounded by
  ``max_records``), so the prefix before a sliding window still verifies after its blocks were
  evicted.
* **Block hashes.** ``hash_fn="fast"`` (default) reports the 64-bit key; ``"sha256"`` (or a
  callable) keeps a byte-chained digest with the namespace for identity across processes.
* **Sliding windows and hybrid models.** A hit is a resume point every group can serve; a
  sliding-window group needs only the blocks its window reads (see
  :mod:`~blocktable.allocator.prefix`), so it never caps a full-attention group to less than
  both can serve.
* **Host tier.** With ``host_blocks=N`` each group keeps up to ``N`` evicted cached blocks in
  host memory (:mod:`~blocktable.host_tier`), in the same prefix index: a hit may be
  on the device, on the host, or split, and host blocks get fresh device blocks at admission.
  :meth:`KVCacheManager.take_transfers` returns each step's copies (offloads, then restores)
  for the engine to perform before the forward; the table sees ordinary device blocks.
* **Planning.** ``lookup_prefix`` and ``can_admit`` have no side effects (``can_admit`` counts
  hit blocks taken out of the free queue); ``reset_prefix_cache`` forgets every cached content
  and refuses (returns False) while any block is held.
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
