"""The allocator API an engine's scheduler calls every step: batched calls and per-request ones."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from blocktable._checks import (
    as_list,
    check_count,
    check_model_len,
    check_positive,
    check_same_length,
    token_counts,
)
from blocktable._fastnp import count_nonzero
from blocktable.allocator.checks import distinct_new_ids, raise_not_computable
from blocktable.allocator.errors import OutOfBlocksError, OutOfRowsError
from blocktable.allocator.integrity import check_manager_integrity
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.prefix import PromptPlan
from blocktable.allocator.prefix_cache import PrefixCache
from blocktable.allocator.release import release_outside_window
from blocktable.allocator.request import RequestState, check_req_id
from blocktable.allocator.running import ReqId, RunningRequests
from blocktable.allocator.spec import AllocatorGroupSpec
from blocktable.allocator.stats import PrefixCacheStats
from blocktable.block_hashing import ROOT_BLOCK_HASH, HashFn, byte_hash_fn
from blocktable.host_tier import HostTierStats, HostTransfers, check_host_blocks_fit
from blocktable.token_ids import TokenIds

# Host-tier ids are int32 (as device block ids): a bound far above any real host memory
MAX_HOST_BLOCKS = 2**31 - 2
_NO_PAIRS = np.zeros((0, 2), dtype=np.int32)
_NO_PAIRS.flags.writeable = False
_NO_TRANSFERS = HostTransfers(_NO_PAIRS, _NO_PAIRS)


class KVCacheManager(RunningRequests):
    """Block allocation for every KV cache group, per request, with prefix caching.

    Every running request holds one table row (``0 .. max_num_reqs - 1``, lowest free row first)
    from admission until :meth:`free`/:meth:`preempt` (indexed mode); the rows of
    :meth:`take_step_update` are these rows, and the block ids are manager block ids.

    Per step, an engine calls (each call has a batched form taking every request of the step,
    and a per-request form with the same semantics for simple engines):

    1. :meth:`free_many` for finished requests, :meth:`preempt` for preempted ones;
    2. :meth:`can_admit` to plan, then :meth:`add_requests` for admitted (or resumed) ones: it
       returns the number of prompt tokens found in the prefix cache, which need no compute;
    3. :meth:`allocate_many` for every request's tokens of this step (all-or-nothing);
    4. :meth:`take_step_update` and hand it to the table's batched update;
    5. after the forward: :meth:`mark_computed_many` (newly full blocks are hashed in one
       vectorized pass and become findable; sliding-window groups release blocks that left the
       window) and :meth:`append_token_ids_many` for sampled tokens.

    Parameters
    ----------
    groups : sequence of AllocatorGroupSpec
        One entry per KV cache group, each with its own block pool.
    max_num_reqs : int
        Number of table rows.
    enable_prefix_caching : bool
        Index full computed blocks so later requests with the same prefix share them.
    hash_fn : "fast", "sha256" or callable, optional
        The block hash reported for cached blocks (see :mod:`blocktable.block_hashing`):
        ``"fast"`` (default, the 64-bit block key), ``"sha256"`` (stable, collision-resistant
        identity across processes, namespace included) or ``callable(bytes) -> bytes`` chained
        like SHA-256. Lookups never trust a hash: they compare tokens and parents exactly.
    max_model_len : int, optional
        When given, a request may not grow past this many tokens (``ValueError``).
    max_records : int, optional
        Per pool, block contents the prefix index remembers, live or evicted (default
        ``max(2 * num_blocks, 4096)``); see :mod:`blocktable.allocator.index`.
    host_blocks : int
        Per group, blocks of a host tier (:mod:`blocktable.host_tier`; default 0,
        none): evicted cached blocks are offloaded there and restored on a prefix hit. The
        engine copies the pairs :meth:`take_transfers` returns every step. Needs prefix
        caching and full-attention groups; at most ``MAX_HOST_BLOCKS``.

    Examples
    --------
    >>> mgr = KVCacheManager([AllocatorGroupSpec(block_size=4, num_blocks=16)], max_num_reqs=2)
    >>> mgr.add_request("a", list(range(10)))
    0
    >>> mgr.allocate("a", 10)
    ([1, 2, 3],)
    >>> mgr.mark_computed("a", 10)
    >>> mgr.add_request("b", list(range(9)))  # the first two blocks are shared
    8
    >>> mgr.block_ids("b"), mgr.row_of("b")
    (([1, 2],), 1)
    """

    def __init__(
        self,
        groups: Sequence[AllocatorGroupSpec],
        max_num_reqs: int,
        *,
        enable_prefix_caching: bool = True,
        hash_fn: str | HashFn | None = None,
        max_model_len: int | None = None,
        max_records: int | None = None,
        host_blocks: int = 0,
    ) -> None:
        groups = tuple(groups)
        if not groups:
            raise ValueError("groups must hold at least one AllocatorGroupSpec")
        for i, spec in enumerate(groups):
            if not isinstance(spec, AllocatorGroupSpec):
                raise TypeError(
                    f"groups[{i}] must be an AllocatorGroupSpec, got {type(spec).__name__}"
                )
        check_positive("max_num_reqs", max_num_reqs)
        if max_model_len is not None:
            check_positive("max_model_len", max_model_len)
        if max_records is not None:
            check_positive("max_records", max_records)
        check_count("host_blocks", host_blocks, MAX_HOST_BLOCKS, "MAX_HOST_BLOCKS")
        check_host_blocks_fit(host_blocks, max(spec.block_size for spec in groups), len(groups))
        if host_blocks and not enable_prefix_caching:
            raise ValueError("host_blocks needs enable_prefix_caching=True (it keeps cached blocks)")
        if host_blocks and any(spec.sliding_window is not None for spec in groups):
            raise ValueError("host_blocks is supported for full-attention groups only")
        self.host_blocks = int(host_blocks)
        self.byte_hash_fn = byte_hash_fn(hash_fn)
        self.groups = groups
        self.max_num_reqs = int(max_num_reqs)
        self.max_model_len = max_model_len
        self.enable_prefix_caching = bool(enable_prefix_caching)
        pools = tuple(
            BlockPool(
                spec.num_blocks,
                spec.block_size,
                enable_caching=self.enable_prefix_caching,
                max_records=max_records,
                num_host_blocks=self.host_blocks,
            )
            for spec in groups
        )
        self.block_sizes = tuple(spec.block_size for spec in groups)
        self.windows = tuple(spec.sliding_window for spec in groups)
        self._has_windows = any(w is not None for w in self.windows)
        super().__init__(pools, self.max_num_reqs, max_model_len)
        self._prefix_cache = PrefixCache(
            pools,
            self.block_sizes,
            self.windows,
            self.max_num_reqs,
            enabled=self.enable_prefix_caching,
            byte_hash_fn=self.byte_hash_fn,
            max_model_len=max_model_len,
        )

    # ----------------------------------------------------------------- admission
    def lookup_prefix(self, prompt_token_ids: TokenIds, *, cache_namespace: object = None) -> int:
        """Tokens of this prompt the prefix cache would serve now; changes nothing.

        The number :meth:`add_request` would return for the same prompt and namespace (while
        the pools stay as they are). Prefix-cache statistics are not updated.
        """
        self._settle()
        return self._prefix_cache.lookup(prompt_token_ids, cache_namespace).num_cached_tokens

    def can_admit(
        self,
        prompt_token_ids: TokenIds,
        num_new_tokens: int | None = None,
        *,
        cache_namespace: object = None,
    ) -> bool:
        """Whether admitting this prompt and allocating its first chunk would succeed now.

        No side effects (no LRU reordering, no statistics). Counts a free row, the prefix hit
        (cached blocks are shared, not allocated) and, per group, the blocks for
        ``num_cached + num_new_tokens`` tokens; a hit block that sits in the free queue
        (reference count 0) leaves it on admission, so it counts as taken from the free pool.

        Parameters
        ----------
        prompt_token_ids : sequence of int, int numpy array or tensor ``[num_tokens]``
        num_new_tokens : int, optional
            Tokens computed in the first step after the hit (default: the rest of the prompt).
            Find the hit first with :meth:`lookup_prefix` to cut a chunk to a budget.
        cache_namespace : as in :meth:`add_request`

        Raises
        ------
        ValueError
            Empty prompt, or prompt or allocation longer than ``max_model_len``.
        """
        self._settle()
        plan = self._prefix_cache.lookup(prompt_token_ids, cache_namespace)
        num_cached = plan.num_cached_tokens
        if num_new_tokens is None:
            num_new_tokens = len(plan.tokens) - num_cached
        num_tokens = num_cached + check_count("num_new_tokens", num_new_tokens)
        check_model_len(self.max_model_len, "new request", "allocation", num_tokens)
        return self._rows.num_free > 0 and self._prefix_cache.fits(plan, num_tokens)

    def add_request(
        self, req_id: ReqId, prompt_token_ids: TokenIds, *, cache_namespace: object = None
    ) -> int:
        """Admit a request (or re-admit a preempted one with all its tokens so far).

        Assigns the lowest free row and shares the longest cached prefix every group can serve
        (see :mod:`blocktable.allocator.prefix`): full blocks only, a multiple of every group's
        block size, at least one prompt token left to compute. The request starts with
        ``num_computed_tokens`` equal to the return value. Same as
        ``add_requests([req_id], [prompt_token_ids])[0]``.

        Parameters
        ----------
        req_id : str or int
        prompt_token_ids : sequence of int, int numpy array or tensor ``[num_tokens]``
            At least one token.
        cache_namespace : None, str, int, bytes or tuple of them
            Only requests with equal namespaces share cached blocks (a LoRA id, a cache salt).

        Returns
        -------
        int
            Number of tokens served by the prefix cache.

        Raises
        ------
        ValueError
            ``req_id`` is already running, the prompt is empty or longer than ``max_model_len``.
        TypeError
            Token ids or namespace of the wrong type.
        OutOfRowsError
            No free row; nothing changed.
        """
        self._settle()
        req_ids = [req_id]
        distinct_new_ids(self._requests, req_ids)
        # (one-element lists built here: add_requests' list and length checks hold already)
        return self._add_checked(req_ids, [prompt_token_ids], [cache_namespace])[0]

    def add_requests(
        self,
        req_ids: Sequence[ReqId],
        prompts: Sequence[TokenIds],
        cache_namespaces: Sequence[object] | None = None,
    ) -> list[int]:
        """Admit several requests at once (one hashing pass, one lookup pass, one share).

        The same as :meth:`add_request` for each, in order; every argument is checked first, so
        a bad one (or too few free rows) changes nothing.

        Returns
        -------
        list of int
            Per request, the tokens served by the prefix cache.
        """
        self._settle()
        req_ids = as_list("req_ids", req_ids)
        distinct_new_ids(self._requests, req_ids)
        prompts = as_list("prompts", prompts)
        check_same_length("prompts", prompts, len(req_ids))
        if cache_namespaces is None:
            cache_namespaces = [None] * len(req_ids)
        else:
            cache_namespaces = as_list("cache_namespaces", cache_namespaces)
            check_same_length("cache_namespaces", cache_namespaces, len(req_ids))
        if not req_ids:
            return []  # a step without arrivals
        return self._add_checked(req_ids, prompts, cache_namespaces)

    def _add_checked(
        self, req_ids: list[ReqId], prompts: list[TokenIds], namespaces: list[object]
    ) -> list[int]:
        """:meth:`add_requests` once its lists are checked (new distinct ids, equal lengths,
        at least one request; settled): plans (checking the prompts), rows, admission."""
        plans, pending = self._prefix_cache.plan_many(req_ids, prompts, namespaces)
        if len(req_ids) > self._rows.num_free:
            raise OutOfRowsError(
                f"no free row for request {req_ids[self._rows.num_free]!r}: "
                f"{len(req_ids)} requests, {self._rows.num_free} free rows of {self.max_num_reqs}"
            )
        self._prefix_cache.find(plans, pending)
        self._admit(req_ids, plans, namespaces)
        return [plan.num_cached_tokens for plan in plans]

    def _admit(
        self, req_ids: list[ReqId], plans: list[PromptPlan], namespaces: list[object]
    ) -> None:
        """Give each planned prompt the lowest free row (checked before: enough free rows),
        its token ids and its prefix hit."""
        state, holders, requests = self._row_state, self._rows.holders, self._requests
        rows = self._rows.take_many([None] * len(plans))  # type: ignore[list-item]  # set below
        buffers = state.start_many(rows, [plan.tokens for plan in plans])  # copied
        num_groups = len(self._pools)
        reqs = []
        for req_id, plan, namespace, row, buffer in zip(req_ids, plans, namespaces, rows, buffers):
            req = RequestState(
                req_id,
                buffer,
                namespace,
                plan.namespace_bytes,
                plan.root,
                plan.seed,
                state,
                row,
                len(plan.tokens),
                [ROOT_BLOCK_HASH] * num_groups,
                plan.keys,  # read-only arrays (dicts the plan no longer uses)
                plan.states,
            )
            holders[row] = req
            requests[req_id] = req
            reqs.append(req)
        self._preempted.difference_update(req_ids)
        self._prefix_cache.admit(reqs, plans, state)

    # ----------------------------------------------------------------- computed tokens
    def mark_computed(self, req_id: ReqId, num_tokens: int) -> None:
        """Record that the next ``num_tokens`` tokens are now in the KV cache.

        Full blocks become findable by later requests; sliding-window groups release the
        blocks wholly outside the window of the next token to compute (their entries become
        ``NULL_BLOCK_ID`` and show up in ``StepUpdate.nulled``). Same as
        ``mark_computed_many([req_id], [num_tokens])``: checked now; the work is done by one
        :meth:`mark_computed_many` of the requests marked since the last call of any other
        method, which that call makes first (a request marked twice applies the first mark
        then), so the per-request form costs what the batched one costs.

        Raises
        ------
        ValueError
            The tokens are not known yet (append them first) or have no block allocated.
        """
        req = self._defer("computed", req_id)
        if req is None:
            self._settle()
            req = self._get(req_id)  # (raises)
        count = num_tokens
        if type(count) is not int or count < 0:
            count = check_count("num_tokens", num_tokens)
        state, row = self._row_state, req.row
        num_computed = state.num_computed_mv[row] + count
        if num_computed > state.num_slots_mv[row] or num_computed > state.num_tokens_mv[row]:
            raise_not_computable(req, num_computed, self.block_sizes)
        self._pending_kind = "computed"  # recorded (see _settle)
        self._pending[req_id] = count

    def mark_computed_many(
        self, req_ids: Sequence[ReqId], num_tokens: Sequence[int] | np.ndarray
    ) -> None:
        """:meth:`mark_computed` for every request of a step: one hashing pass for all newly
        full blocks, one registration and one release per group. Checked fully first."""
        self._settle()
        req_ids, reqs = self._running(req_ids)
        counts = token_counts("num_tokens", num_tokens, len(reqs))
        if not reqs:
            return
        state, rows = self._row_state, np.array([req.row for req in reqs], dtype=np.intp)
        num_computed = state.num_computed[rows] + np.array(counts, dtype=np.int64)
        # num_slots: what every group's blocks hold
        bad = num_computed > state.num_slots[rows]
        bad |= num_computed > state.num_tokens[rows]
        if count_nonzero(bad):
            i = int(bad.argmax())
            raise_not_computable(reqs[i], int(num_computed[i]), self.block_sizes)
        self._mark(reqs, rows, num_computed)

    def _apply_marks(self, req_ids: list[ReqId], counts: list[int]) -> None:
        """The recorded per-request marks: running distinct requests and counts each checked
        when recorded (not checked again)."""
        requests, state = self._requests, self._row_state
        reqs = [requests[req_id] for req_id in req_ids]
        rows = np.array([req.row for req in reqs], dtype=np.intp)
        self._mark(reqs, rows, state.num_computed[rows] + np.array(counts, dtype=np.int64))

    def _mark(self, reqs: list[RequestState], rows: np.ndarray, num_computed: np.ndarray) -> None:
        """Make ``num_computed`` (int64) the computed tokens of ``reqs`` (holding ``rows``,
        intp): register their newly full blocks, release what left a window."""
        state = self._row_state
        state.num_computed[rows] = num_computed
        self._prefix_cache.register(reqs, rows, state)
        if self._has_windows:
            for g, window in enumerate(self.windows):
                if window is not None:
                    release_outside_window(self._row_state, self._journal, self._pools[g], g,
                                           self.block_sizes[g], window, reqs)

    # ----------------------------------------------------------------- release
    def fork(self, parent_id: ReqId, child_id: ReqId) -> tuple[list[tuple[int, int]], ...]:
        """Admit ``child_id`` as a copy of ``parent_id`` (parallel sampling, beam search).

        The child shares the parent's full computed blocks and gets a private copy of the
        partial last computed block (copied now, since both will write into it next step).
        Blocks the parent allocated past its computed tokens are not shared. Fork between
        steps, after ``mark_computed``.

        Returns
        -------
        tuple of list of (int, int)
            Per group, the ``(src, dst)`` manager block copies the engine must perform on that
            group's KV cache before the child's next forward (at most one per group).

        Raises
        ------
        OutOfRowsError, OutOfBlocksError
            No free row, or no block for a partial-block copy; nothing changed.
        """
        self._settle()
        parent = self._get(parent_id)
        check_req_id("child_id", child_id)
        if child_id in self._requests or child_id in self._preempted:
            raise ValueError(f"child_id {child_id!r} is already a known request")
        self._rows.check_free(f"request {child_id!r}")
        num_computed = parent.num_computed_tokens
        for g, (pool, bs) in enumerate(zip(self._pools, self.block_sizes)):
            if num_computed % bs and pool.num_free_blocks < 1:
                raise OutOfBlocksError(f"fork of {parent_id!r}: no free block in group {g}")
        [row] = self._rows.take_many([None])  # type: ignore[list-item]  # holder set below
        child = parent.fork(child_id, row)
        self._rows.holders[row] = child
        self._prefix_cache.chains.copy_row(parent.row, row)
        copies: list[list[tuple[int, int]]] = []
        for g, (pool, bs) in enumerate(zip(self._pools, self.block_sizes)):
            num_full = num_computed // bs
            shared = parent.blocks(g)[:num_full].copy()
            real = shared[int(parent.num_skipped_blocks[g]) :]
            pool.share_many(real)
            child.set_blocks(g, shared)
            copies.append([])
            if num_computed % bs:
                [dst] = pool.take(1).tolist()
                child.append_block(g, dst)
                copies[g].append((int(parent.blocks(g)[num_full]), dst))
        self._row_state.update_num_slots(self.block_sizes, row)
        self._requests[child_id] = child
        return tuple(copies)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block content, so nothing is found by later lookups.

        Refused while any request holds blocks (running requests own them and their rows
        refer to the index): returns False and changes nothing. Otherwise every free cached
        block becomes a plain free block and True is returned. The prefix-cache counters are
        not reset (they count since the manager was built).
        """
        self._settle()
        return self._prefix_cache.reset(list(self._requests.values()))

    # ----------------------------------------------------------------- step result
    def num_free_blocks(self, group: int = 0) -> int:
        """Blocks of ``group`` that can be allocated now (uncached or evictable)."""
        self._settle()
        return self._pools[group].num_free_blocks

    def num_cached_blocks(self, group: int = 0) -> int:
        """Blocks of ``group`` findable by prefix lookup (held or free)."""
        self._settle()
        return self._pools[group].num_cached_blocks

    @property
    def prefix_cache(self) -> PrefixCache:
        """What is known about block contents (namespaces, hits, registration)."""
        self._settle()
        return self._prefix_cache

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        self._settle()
        return self._prefix_cache.stats

    # ----------------------------------------------------------------- host tier
    def take_transfers(self) -> tuple[HostTransfers, ...]:
        """Per group, the host-tier copies queued since the last call (call once per step,
        after admission and allocation, before the forward).

        The engine copies each group's ``offload`` pairs (device block -> host block) first,
        then its ``restore`` pairs (host block -> device block), before the first layer reads
        the step's blocks; the host blocks involved stay pinned until this call. Empty pairs
        when the manager has no host tier.
        """
        self._settle()
        return tuple(
            _NO_TRANSFERS if pool.host is None else pool.host.take_transfers()
            for pool in self._pools
        )

    @property
    def host_tier_stats(self) -> tuple[HostTierStats, ...]:
        """Per group, the host tier's block counters (all zero without a host tier)."""
        self._settle()
        return tuple(
            HostTierStats() if pool.host is None else pool.host.stats for pool in self._pools
        )

    def check_integrity(self) -> None:
        """Verify every invariant (refcounts, queues, index, rows); raise ``IntegrityError``.

        O(num_blocks + records + requests' blocks): for tests and debug modes.
        """
        self._settle()
        check_manager_integrity(self, self._requests, self._rows.holders, self._rows.free_rows())
