"""A reference block allocator in plain Python: the oracle the stateful tests run beside
:class:`~blocktable.allocator.KVCacheManager`, operation by operation.

It keeps the same policy with the plainest data structures (lists, dicts, ordered dicts), one
block at a time, so that every block id the real allocator hands out can be predicted:

* free blocks wait in two queues: uncached ones (least recently freed first) and cached ones
  (least recently used first); a take empties the uncached queue first and *evicts* cached
  blocks after it (their content stays known, dead, for sliding-window verification);
* a request's blocks are released tail first when it leaves, oldest first when they leave a
  sliding window; a block is queued when its last reference is dropped;
* a content is a namespace and the token ids up to the end of a block. Computing a content
  whose holder is owned makes the block a *duplicate* (promoted when the holder is freed);
  computing one whose holder is free moves the content to the new block (the old one becomes
  uncached); computing a dead one revives it in the new block. Within one call, blocks of
  prompts (whose keys were made at admission) are registered before generated ones;
* a prompt's hit is the largest ``n`` (a multiple of every block size, one token left) that
  every group serves: a full-attention group when blocks ``0 .. n/bs - 1`` are cached, a
  sliding-window group when the blocks its window reads are cached and the ones before them
  were computed once.

Argument checking is the real allocator's business: the reference is only called with valid
arguments, but it refuses a step that does not fit (``OutOfBlocksError``/``OutOfRowsError``)
and then changes nothing.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from blocktable.allocator import AllocatorGroupSpec, OutOfBlocksError, OutOfRowsError

NULL = 0
Content = tuple  # (namespace, token ids up to the end of the block)


@dataclass
class Pool:
    """The blocks of one group."""

    num_blocks: int
    refs: list[int] = field(init=False)
    uncached: OrderedDict[int, None] = field(init=False)  # free, no content; oldest first
    cached: OrderedDict[int, None] = field(init=False)  # free, with content; LRU first
    content: dict[int, Content] = field(default_factory=dict)  # holder block -> content
    holder: dict[Content, int] = field(default_factory=dict)  # content -> block, 0 = dead
    dups: dict[Content, list[int]] = field(default_factory=dict)  # content -> duplicates
    dup_of: dict[int, Content] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.refs = [0] * self.num_blocks
        self.uncached = OrderedDict.fromkeys(range(1, self.num_blocks))
        self.cached = OrderedDict()

    def num_free(self) -> int:
        return len(self.uncached) + len(self.cached)

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.uncached:
                block, _ = self.uncached.popitem(last=False)
            else:
                block, _ = self.cached.popitem(last=False)
                self.holder[self.content.pop(block)] = NULL  # evicted: the content dies
            self.refs[block] = 1
            out.append(block)
        return out

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.cached[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block]:
            return
        if block in self.dup_of:  # a duplicate is forgotten
            self.dups[self.dup_of.pop(block)].remove(block)
        elif block in self.content and self.dups.get(self.content[block]):
            content = self.content.pop(block)  # the content moves to a duplicate
            new_holder = self.dups[content].pop()
            del self.dup_of[new_holder]
            self.content[new_holder] = content
            self.holder[content] = new_holder
        (self.cached if block in self.content else self.uncached)[block] = None

    def register(self, block: int, content: Content) -> None:
        """``block`` (owned) was computed with ``content``."""
        old = self.holder.get(content, NULL)
        if old != NULL and self.refs[old]:
            self.dup_of[block] = content
            self.dups.setdefault(content, []).append(block)
            return
        if old != NULL:  # its holder is free: the content moves, the old block is uncached
            del self.cached[old]
            del self.content[old]
            self.uncached[old] = None
        self.holder[content] = block
        self.content[block] = content


@dataclass
class Request:
    tokens: list[int]
    namespace: object
    row: int
    num_prompt: int
    computed: int = 0
    blocks: list[list[int]] = field(default_factory=list)  # per group
    num_hashed: list[int] = field(default_factory=list)  # per group
    skipped: list[int] = field(default_factory=list)  # per group: leading null entries


class ReferenceAllocator:
    """The allocator's observable behaviour, one block at a time."""

    def __init__(self, groups: list[AllocatorGroupSpec], max_num_reqs: int,
                 enable_prefix_caching: bool = True) -> None:
        self.groups = groups
        self.sizes = [g.block_size for g in groups]
        self.windows = [g.sliding_window for g in groups]
        self.align = math.lcm(*self.sizes)
        self.caching = enable_prefix_caching
        self.pools = [Pool(g.num_blocks) for g in groups]
        self.free_rows = list(range(max_num_reqs))
        self.reqs: dict[object, Request] = {}

    # ------------------------------------------------------------------ queries
    def block_ids(self, req_id: object) -> tuple[list[int], ...]:
        return tuple(list(blocks) for blocks in self.reqs[req_id].blocks)

    def num_cached_blocks(self, g: int) -> int:
        return len(self.pools[g].content)

    def eviction_order(self, g: int) -> list[int]:
        return [*self.pools[g].uncached, *self.pools[g].cached]

    def contents(self, tokens: list[int], namespace: object, g: int) -> list[Content]:
        bs = self.sizes[g]
        return [(namespace, tuple(tokens[: (i + 1) * bs])) for i in range(len(tokens) // bs)]

    def lookup_prefix(self, tokens: list[int], namespace: object = None) -> int:
        if not self.caching:
            return 0
        per_group = [self.contents(tokens, namespace, g) for g in range(len(self.pools))]
        for n in range((len(tokens) - 1) // self.align * self.align, 0, -self.align):
            if all(self._serves(g, per_group[g], n) for g in range(len(self.pools))):
                return n
        return 0

    def _serves(self, g: int, contents: list[Content], n: int) -> bool:
        bs, window, holder = self.sizes[g], self.windows[g], self.pools[g].holder
        lo = 0 if window is None else max(0, (n - window + 1) // bs)
        return all(c in holder for c in contents[:lo]) and all(
            holder.get(c, NULL) != NULL for c in contents[lo : n // bs])

    def can_admit(self, tokens: list[int], num_new_tokens: int | None = None,
                  namespace: object = None) -> bool:
        hit = self.lookup_prefix(tokens, namespace)
        total = hit + (len(tokens) - hit if num_new_tokens is None else num_new_tokens)
        if not self.free_rows:
            return False
        for g, (pool, bs) in enumerate(zip(self.pools, self.sizes)):
            hit_blocks = [pool.holder[c] for c in self.contents(tokens, namespace, g)
                          [self._skip(g, hit) : hit // bs]]
            taken = sum(pool.refs[b] == 0 for b in hit_blocks)
            if -(-total // bs) - hit // bs > pool.num_free() - taken:
                return False
        return True

    def _skip(self, g: int, num_tokens: int) -> int:
        window = self.windows[g]
        return 0 if window is None else max(0, (num_tokens - window + 1) // self.sizes[g])

    # ------------------------------------------------------------------ operations
    def add_requests(self, req_ids: list, prompts: list[list[int]],
                     namespaces: list | None = None) -> list[int]:
        namespaces = namespaces or [None] * len(req_ids)
        if len(req_ids) > len(self.free_rows):
            raise OutOfRowsError("no free row")
        hits = [self.lookup_prefix(p, ns) for p, ns in zip(prompts, namespaces)]  # before any
        for req_id, tokens, ns, hit in zip(req_ids, prompts, namespaces, hits):
            req = Request(list(tokens), ns, heapq.heappop(self.free_rows), len(tokens), hit)
            for g, pool in enumerate(self.pools):
                skip = self._skip(g, hit)
                shared = [pool.holder[c] for c in self.contents(tokens, ns, g)[skip : hit // self.sizes[g]]]
                for block in shared:
                    pool.share(block)
                req.blocks.append([NULL] * skip + shared)
                req.num_hashed.append(hit // self.sizes[g])
                req.skipped.append(skip)
            self.reqs[req_id] = req
        return hits

    def allocate_many(self, req_ids: list, num_new_tokens: list[int]) -> list[list[list[int]]]:
        """Per group, per request, the new block ids."""
        needs = [[max(0, -(-(self.reqs[r].computed + n) // bs) - len(self.reqs[r].blocks[g]))
                  for r, n in zip(req_ids, num_new_tokens)] for g, bs in enumerate(self.sizes)]
        for g, pool in enumerate(self.pools):
            if sum(needs[g]) > pool.num_free():
                raise OutOfBlocksError(f"group {g}")
        out = []
        for g, pool in enumerate(self.pools):
            new = [pool.take(need) for need in needs[g]]
            for r, blocks in zip(req_ids, new):
                self.reqs[r].blocks[g] += blocks
            out.append(new)
        return out

    def append_token_ids_many(self, req_ids: list, token_ids: list[list[int]]) -> None:
        for r, tokens in zip(req_ids, token_ids):
            self.reqs[r].tokens += tokens

    def mark_computed_many(self, req_ids: list, num_tokens: list[int]) -> None:
        reqs = [self.reqs[r] for r in req_ids]
        for req, n in zip(reqs, num_tokens):
            req.computed += n
        for g, (pool, bs) in enumerate(zip(self.pools, self.sizes)):
            if self.caching:  # prompt blocks first, then generated ones
                prompt = [r for r in reqs if r.computed // bs * bs <= r.num_prompt]
                for req in prompt + [r for r in reqs if r not in prompt]:
                    contents = self.contents(req.tokens, req.namespace, g)
                    for i in range(req.num_hashed[g], req.computed // bs):
                        pool.register(req.blocks[g][i], contents[i])
                    req.num_hashed[g] = max(req.num_hashed[g], req.computed // bs)
            for req in reqs:  # blocks that left the window, oldest first
                skip = self._skip(g, req.computed)
                for i in range(req.skipped[g], skip):
                    pool.release(req.blocks[g][i])
                    req.blocks[g][i] = NULL
                req.skipped[g] = max(req.skipped[g], skip)

    def free_many(self, req_ids: list) -> None:
        for r in req_ids:
            req = self.reqs.pop(r, None)
            if req is None:
                continue  # preempted: holds nothing
            for g, pool in enumerate(self.pools):
                for block in reversed(req.blocks[g][req.skipped[g]:]):
                    pool.release(block)
            heapq.heappush(self.free_rows, req.row)

    def fork(self, parent_id: object, child_id: object) -> list[list[tuple[int, int]]]:
        parent = self.reqs[parent_id]
        if not self.free_rows:
            raise OutOfRowsError("no free row")
        partial = [parent.computed % bs != 0 for bs in self.sizes]
        if any(p and pool.num_free() < 1 for p, pool in zip(partial, self.pools)):
            raise OutOfBlocksError("fork")
        child = Request(list(parent.tokens), parent.namespace, heapq.heappop(self.free_rows),
                        parent.num_prompt, parent.computed, num_hashed=list(parent.num_hashed),
                        skipped=list(parent.skipped))
        copies = []
        for g, (pool, bs) in enumerate(zip(self.pools, self.sizes)):
            num_full = parent.computed // bs
            shared = parent.blocks[g][:num_full]
            for block in shared[parent.skipped[g]:]:
                pool.share(block)
            child.blocks.append(list(shared))
            copies.append([])
            if partial[g]:
                [dst] = pool.take(1)
                child.blocks[g].append(dst)
                copies[g].append((parent.blocks[g][num_full], dst))
        self.reqs[child_id] = child
        return copies

    def reset_prefix_cache(self) -> bool:
        if any(any(pool.refs) for pool in self.pools):
            return False
        for pool in self.pools:
            pool.uncached.update(pool.cached)
            pool.cached.clear()
            pool.content.clear()
            pool.holder.clear()
        return True
