"""The prefix cache: what is known about block contents across every group's pool.

:class:`PrefixCache` plans admissions (namespaces, block keys, hits), shares the hits, files
newly full computed blocks and forgets everything on reset; it keeps its counters and, per
table row, where each request's registration stands (:class:`KeyChains`). The block pools
(:mod:`blocktable.allocator.pool`) keep reference counts and free queues; the requests' rows
and counts live in :class:`~blocktable.allocator.rowstate.RowState`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np

from blocktable._checks import check_model_len
from blocktable._fastnp import count_nonzero
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.prefix import PromptPlan, find_hits, prompt_keys
from blocktable.allocator.register import register_computed_blocks
from blocktable.allocator.request import KeyChains, RequestState
from blocktable.allocator.rowstate import RowState
from blocktable.allocator.stats import PrefixCacheStats
from blocktable.block_hashing import ChainPowers, HashFn, encode_namespace, namespace_seed
from blocktable.constants import NULL_BLOCK_ID
from blocktable.host_tier import fit_restores, restore_hits
from blocktable.token_ids import TokenIds, token_array

_INT64 = np.dtype(np.int64)
Namespaces = dict[bytes, tuple[int, int]]  # encoding -> (root content id, key seed)


class PrefixCache:
    """Prefix caching over the pools of every KV cache group.

    Parameters
    ----------
    pools : sequence of BlockPool
        One per group; each holds its group's prefix index.
    block_sizes, windows : sequences of int and int or None
        Per group, the block size and sliding window.
    num_rows : int
        Table rows (the registration state is kept per row).
    enabled : bool
        When False nothing is looked up or filed.
    byte_hash_fn : callable or None
        The byte-chained block hash to keep beside the fast key (None: the key only).
    max_model_len : int or None
        Longest prompt accepted.
    """

    def __init__(
        self,
        pools: Sequence[BlockPool],
        block_sizes: Sequence[int],
        windows: Sequence[int | None],
        num_rows: int,
        *,
        enabled: bool,
        byte_hash_fn: HashFn | None,
        max_model_len: int | None,
    ) -> None:
        self.pools = tuple(pools)
        self.block_sizes = tuple(block_sizes)
        self.windows = tuple(windows)
        self.enabled = enabled
        self.byte_hash_fn = byte_hash_fn
        self.max_model_len = max_model_len
        self.align_tokens = math.lcm(*self.block_sizes)
        self.powers = {bs: ChainPowers(bs) for bs in sorted(set(self.block_sizes))}
        self.chains = KeyChains(num_rows, self.block_sizes)
        self.namespaces: Namespaces = {}
        self._none_namespace: tuple[int, int] | None = None  # namespaces[b""] once interned
        self.num_queries = self.num_query_tokens = self.num_hit_tokens = 0
        self.num_host_hit_tokens = 0
        self.has_host_tier = any(pool.host is not None for pool in self.pools)

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self.num_queries, self.num_query_tokens, self.num_hit_tokens, self.num_host_hit_tokens
        )

    # ----------------------------------------------------------------- planning
    def plan_many(
        self, req_ids: list, prompts: list, namespaces: list
    ) -> tuple[list[PromptPlan], Namespaces]:
        """Checked plans of prompts (token ids read, not kept), and the namespaces they use
        that are not interned yet (pass them to :meth:`find` to intern them)."""
        pending: Namespaces = {}
        plans = []
        none_namespace = self._none_namespace
        root, seed = (0, 0) if none_namespace is None else none_namespace
        max_len = sys.maxsize if self.max_model_len is None else self.max_model_len
        for r, p, ns in zip(req_ids, prompts, namespaces):
            # plan()'s common cases (no namespace; an int64 array, or a list of ints), inline;
            # anything else, or a bad prompt, goes through plan(), which names the request
            if ns is None and none_namespace is not None:
                kind = type(p)
                if kind is np.ndarray:
                    if p.dtype is _INT64 and p.ndim == 1 and 0 < len(p) <= max_len:
                        plans.append(PromptPlan(p, root, seed))
                        continue
                elif kind is list and 0 < len(p) <= max_len:
                    try:
                        tokens = token_array("prompt_token_ids", p)
                    except (TypeError, ValueError):
                        pass  # (plan() raises again, naming the request)
                    else:
                        plans.append(PromptPlan(tokens, root, seed))
                        continue
            plans.append(self.plan(p, ns, pending, req_id=r))
        return plans, pending

    def plan(
        self, prompt: TokenIds, namespace: object, pending: Namespaces, *, req_id: object = None
    ) -> PromptPlan:
        """The plan of one prompt (``req_id``, when given, is named in errors); a namespace
        seen for the first time is added to ``pending``."""
        name = "prompt_token_ids" if req_id is None else f"prompt_token_ids of request {req_id!r}"
        tokens = token_array(name, prompt)
        if not len(tokens):
            raise ValueError(f"{name} is empty")
        who = "new request" if req_id is None else f"request {req_id!r}"
        check_model_len(self.max_model_len, who, "prompt", len(tokens))
        if namespace is None and self._none_namespace is not None:
            return PromptPlan(tokens, *self._none_namespace, b"")
        encoded = encode_namespace(namespace)  # checks it
        found = self.namespaces.get(encoded) or pending.get(encoded)
        if found is None:
            found = (-(len(self.namespaces) + len(pending) + 1), namespace_seed(encoded))
            pending[encoded] = found
        return PromptPlan(tokens, found[0], found[1], encoded)

    def find(self, plans: list[PromptPlan], pending: Namespaces | None = None) -> None:
        """Fill every plan's keys and hit (no side effect on the pools); intern ``pending``
        (the plans' new namespaces, when they are being admitted)."""
        if pending is not None:
            self.namespaces.update(pending)
            if self._none_namespace is None:
                self._none_namespace = self.namespaces.get(b"")
        if not self.enabled:
            for plan in plans:
                plan.hit_slots = [np.zeros(0, np.int64) for _ in self.pools]
            return
        prompt_keys(plans, self.powers)
        find_hits(plans, self.pools, self.block_sizes, self.windows, self.align_tokens)
        if self.has_host_tier:
            fit_restores(plans, self.pools, self.block_sizes, self.align_tokens, _cap_hit)

    def lookup(self, prompt: TokenIds, namespace: object) -> PromptPlan:
        """The plan of one prompt with its hit, changing nothing."""
        plan = self.plan(prompt, namespace, {})
        self.find([plan])
        return plan

    def fits(self, plan: PromptPlan, num_tokens: int) -> bool:
        """Whether every pool has the blocks for ``num_tokens`` tokens of a request admitted
        with ``plan``'s hit (hit blocks in a free queue leave it: they count as taken)."""
        n = plan.num_cached_tokens
        for pool, bs, slots in zip(self.pools, self.block_sizes, plan.hit_slots):
            taken = int(count_nonzero(pool.ref_counts[pool.index.holder[slots]] == 0))
            if -(-num_tokens // bs) - n // bs > pool.num_free_blocks - taken:
                return False
        return True

    # ----------------------------------------------------------------- admission
    def admit(
        self, reqs: list[RequestState], plans: list[PromptPlan], state: RowState
    ) -> None:
        """Start the chains of admitted requests and share their hits (their rows were
        started in ``state``, empty)."""
        self.chains.admit_many([req.row for req in reqs], plans)
        self.num_queries += len(plans)
        hits = []
        for req, plan in zip(reqs, plans):
            self.num_query_tokens += len(plan.tokens)
            if plan.num_cached_tokens:
                hits.append((req, plan))
        if hits:
            self._share_hits(hits, state)

    def _share_hits(self, hits: list[tuple[RequestState, PromptPlan]], state: RowState) -> None:
        """Make the cached blocks of each plan's hit its request's rows and move its chains
        past them: per group, one gather of every distinct hit's blocks and one share. A hit
        of ``n`` tokens fills ``n // bs`` entries of every group's row (null entries first), so
        the request's computed tokens and slots are ``n``. Plans that followed one lookup hold
        the same slots (one array): their blocks are gathered once."""
        chains = self.chains
        byte_hashes = self.byte_hash_fn is not None
        num_cached = [plan.num_cached_tokens for _, plan in hits]
        hit_rows = [req.row for req, _ in hits]
        num_host = [0] * len(hits)  # per hit, tokens served from the host tier
        for g, (pool, bs) in enumerate(zip(self.pools, self.block_sizes)):
            index = pool.index
            holder, cid = index.holder, index.cid
            arena = state.ensure_width(g, max(num_cached) // bs)
            row_len, num_skipped = state.row_len_mvs[g], state.num_skipped_mvs[g]
            num_hashed, parent_cid = chains.group_views(g)
            restored = (
                restore_hits(pool, [plan.hit_slots[g] for _, plan in hits])
                if pool.host is not None
                else None
            )
            gathered: dict[int, tuple[np.ndarray, int]] = {}  # id(slots) -> blocks, last cid
            parts = []
            for (req, plan), row, n in zip(hits, hit_rows, num_cached):
                slots = plan.hit_slots[g]
                found = gathered.get(id(slots))
                if found is None:
                    found = gathered[id(slots)] = (holder[slots], cid.item(plan.last_slots[g]))
                blocks, last_cid = found
                parts.append(blocks)
                hi, skip = n // bs, plan.num_skipped[g]
                if skip:
                    arena[row, :skip] = NULL_BLOCK_ID
                arena[row, skip:hi] = blocks
                row_len[row] = hi
                num_skipped[row] = skip
                num_hashed[row] = hi
                parent_cid[row] = last_cid
                if byte_hashes:
                    req.parent_hashes[g] = index.hashes[plan.last_slots[g]]  # type: ignore[call-overload]
            blocks = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if restored is not None:
                # (the device hits were shared before the restore; a restored block was
                # taken with one reference)
                from_host = np.isin(blocks, restored)
                pool.share_many(blocks[from_host])
                pool.ref_counts[restored.astype(np.intp)] -= 1
                host_tokens = [int(count_nonzero(np.isin(b, restored))) * bs for b in parts]
                for i, t in enumerate(host_tokens):
                    num_host[i] = max(num_host[i], t)
            elif len(blocks):
                pool.share_many(blocks)
        num_computed, num_slots = state.num_computed_mv, state.num_slots_mv
        for row, n in zip(hit_rows, num_cached):
            num_computed[row] = n
            num_slots[row] = n
        self.num_hit_tokens += sum(num_cached)
        self.num_host_hit_tokens += sum(num_host)

    # ----------------------------------------------------------------- computed blocks
    def register(self, reqs: list[RequestState], rows: np.ndarray, state: RowState) -> None:
        """File every full computed block of ``reqs`` (holding ``rows``, intp) not filed yet."""
        if self.enabled:
            register_computed_blocks(reqs, rows, state, self.pools, self.block_sizes,
                                     self.powers, self.byte_hash_fn, self.chains)

    def reset(self, requests: Sequence[RequestState]) -> bool:
        """Forget every cached content, unless a block is held (then False, nothing changes).

        ``requests``: the running requests (holding no block, their chains move on).
        """
        if any(int(pool.ref_counts.max()) > 0 for pool in self.pools):
            return False
        for pool in self.pools:
            pool.reset_cache()
        for req in requests:
            for g, pool in enumerate(self.pools):
                if self.chains.num_hashed[g][req.row]:
                    # Its blocks all left a window: the parent's record is gone, so later
                    # blocks chain to a content id no record has (never findable, never wrong).
                    self.chains.parent_cid[g][req.row] = pool.index.next_cid
                    pool.index.next_cid += 1
        return True


def _cap_hit(plan: PromptPlan, num_tokens: int, block_sizes: Sequence[int]) -> None:
    """Shorten ``plan``'s hit to ``num_tokens`` (full-attention groups; new lists: plans with
    one hit share theirs)."""
    plan.num_cached_tokens = num_tokens
    plan.num_skipped = [0] * len(block_sizes)
    plan.hit_slots = [s[: num_tokens // bs] for s, bs in zip(plan.hit_slots, block_sizes)]
    plan.last_slots = [int(s[-1]) if len(s) else -1 for s in plan.hit_slots]
