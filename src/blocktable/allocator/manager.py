"""The allocator API an engine's scheduler calls every step: batched calls and per-request ones."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from blocktable._checks import check_count, check_positive
from blocktable.allocator.checks import (
    as_list,
    check_model_len,
    check_same_length,
    distinct_new_ids,
    running_requests,
    token_counts,
)
from blocktable.allocator.errors import OutOfBlocksError, OutOfRowsError
from blocktable.allocator.hashing import (
    ROOT_BLOCK_HASH,
    HashFn,
    sha256_block_hash,
)
from blocktable.allocator.integrity import check_manager_integrity
from blocktable.allocator.journal import StepJournal
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.prefix import PromptPlan
from blocktable.allocator.prefix_cache import PrefixCache
from blocktable.allocator.request import (
    RequestState,
    TokenIds,
    check_req_id,
    token_array,
)
from blocktable.allocator.rows import RowAllocator
from blocktable.allocator.rowstate import RowState
from blocktable.allocator.spec import AllocatorGroupSpec
from blocktable.allocator.stats import PrefixCacheStats
from blocktable.constants import NULL_BLOCK_ID
from blocktable.update import RowBlocks, StepUpdate

ReqId = str | int
_INT64 = np.dtype(np.int64)


class KVCacheManager:
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

    The counts, row lengths and block ids of running requests live in arrays indexed by row
    (per group an int32 array ``[max_num_reqs, width]``, the width doubling up to the longest
    row so far), token ids in an int64 array of the same rows (at most 4096 per row; longer
    sequences in a buffer of their own); a batched call costs a few numpy passes
    over its rows, tokens and blocks plus well under 1 us per request, and a long prompt's
    chunks cost what one allocation of the whole prompt costs (keys are computed once, at
    admission).

    Parameters
    ----------
    groups : sequence of AllocatorGroupSpec
        One entry per KV cache group, each with its own block pool.
    max_num_reqs : int
        Number of table rows.
    enable_prefix_caching : bool
        Index full computed blocks so later requests with the same prefix share them.
    hash_fn : "fast", "sha256" or callable, optional
        The block hash reported for cached blocks (see :mod:`blocktable.allocator.hashing`):
        ``"fast"`` (default, the 64-bit block key), ``"sha256"`` (stable, collision-resistant
        identity across processes, namespace included) or ``callable(bytes) -> bytes`` chained
        like SHA-256. Lookups never trust a hash: they compare tokens and parents exactly.
    max_model_len : int, optional
        When given, a request may not grow past this many tokens (``ValueError``).
    max_records : int, optional
        Per pool, block contents the prefix index remembers, live or evicted (default
        ``max(2 * num_blocks, 4096)``); see :mod:`blocktable.allocator.index`.

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
        self.byte_hash_fn = _byte_hash_fn(hash_fn)
        self.groups = groups
        self.max_num_reqs = int(max_num_reqs)
        self.max_model_len = max_model_len
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.pools = tuple(
            BlockPool(
                spec.num_blocks,
                spec.block_size,
                enable_caching=self.enable_prefix_caching,
                max_records=max_records,
            )
            for spec in groups
        )
        self.block_sizes = tuple(spec.block_size for spec in groups)
        self.windows = tuple(spec.sliding_window for spec in groups)
        self._has_windows = any(w is not None for w in self.windows)
        self._requests: dict[ReqId, RequestState] = {}
        self._preempted: set[ReqId] = set()
        # the last batched call's (req_ids, their states, their rows): a step's calls often
        # name the same requests (allocate_many, then mark_computed_many); dropped whenever a
        # request leaves (a request's state and row are fixed while it runs)
        self._last_batch: tuple[list, list[RequestState], np.ndarray] | None = None
        self._rows: RowAllocator[RequestState] = RowAllocator(self.max_num_reqs)
        self._row_state = RowState(self.max_num_reqs, len(groups))
        self._journal = StepJournal(len(groups), self._row_state)
        self.prefix_cache = PrefixCache(
            self.pools,
            self.block_sizes,
            self.windows,
            self.max_num_reqs,
            enabled=self.enable_prefix_caching,
            byte_hash_fn=self.byte_hash_fn,
            max_model_len=max_model_len,
        )
        self.num_preemptions = 0

    # ----------------------------------------------------------------- admission
    def lookup_prefix(self, prompt_token_ids: TokenIds, *, cache_namespace: object = None) -> int:
        """Tokens of this prompt the prefix cache would serve now; changes nothing.

        The number :meth:`add_request` would return for the same prompt and namespace (while
        the pools stay as they are). Prefix-cache statistics are not updated.
        """
        return self.prefix_cache.lookup(prompt_token_ids, cache_namespace).num_cached_tokens

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
        plan = self.prefix_cache.lookup(prompt_token_ids, cache_namespace)
        num_cached = plan.num_cached_tokens
        if num_new_tokens is None:
            num_new_tokens = len(plan.tokens) - num_cached
        num_tokens = num_cached + check_count("num_new_tokens", num_new_tokens)
        check_model_len(self.max_model_len, "new request", "allocation", num_tokens)
        return self._rows.num_free > 0 and self.prefix_cache.fits(plan, num_tokens)

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
        return self.add_requests([req_id], [prompt_token_ids], [cache_namespace])[0]

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
        plans, pending = self.prefix_cache.plan_many(req_ids, prompts, cache_namespaces)
        if len(req_ids) > self._rows.num_free:
            raise OutOfRowsError(
                f"no free row for request {req_ids[self._rows.num_free]!r}: "
                f"{len(req_ids)} requests, {self._rows.num_free} free rows of {self.max_num_reqs}"
            )
        self.prefix_cache.find(plans, pending)
        self._admit(req_ids, plans, cache_namespaces)
        return [plan.num_cached_tokens for plan in plans]

    def _admit(
        self, req_ids: list[ReqId], plans: list[PromptPlan], namespaces: list[object]
    ) -> None:
        """Give each planned prompt the lowest free row (checked before: enough free rows),
        its token ids and its prefix hit."""
        state, holders, requests = self._row_state, self._rows.holders, self._requests
        rows = self._rows.take_many([None] * len(plans))  # type: ignore[list-item]  # set below
        self._journal.touch(rows)  # free, or freed earlier in this step
        buffers = state.start_many(rows, [plan.tokens for plan in plans])  # copied
        num_groups = len(self.pools)
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
        for req_id in req_ids:
            self._preempted.discard(req_id)
        self.prefix_cache.admit(reqs, plans, state)

    def append_token_ids(self, req_id: ReqId, token_ids: int | TokenIds) -> None:
        """Append generated tokens (one int or a sequence) to the request's sequence."""
        self.append_token_ids_many([req_id], [token_ids])

    def append_token_ids_many(
        self, req_ids: Sequence[ReqId], token_ids: Sequence[int | TokenIds] | np.ndarray
    ) -> None:
        """Append tokens to several requests: ``token_ids[i]`` (an int, a sequence, or row ``i``
        of an int array ``[num_reqs, k]``) to ``req_ids[i]``. Checked fully before any write."""
        req_ids, reqs, rows = self._running(req_ids)
        if isinstance(token_ids, np.ndarray) and token_ids.ndim == 2:
            check_same_length("token_ids", token_ids, len(req_ids))
            # one conversion of the whole array; then every request appends a row of width k
            name = f"token_ids of request {req_ids[0]!r}" if req_ids else "token_ids"
            block = token_array(name, token_ids.reshape(-1)).reshape(token_ids.shape)
            self._append_rows(reqs, rows, block)
            return
        token_ids = as_list("token_ids", token_ids)
        check_same_length("token_ids", token_ids, len(req_ids))
        arrays = [
            token_array(f"token_ids of request {r!r}", ids) for r, ids in zip(req_ids, token_ids)
        ]
        for req, new in zip(reqs, arrays):
            self._check_request_len(req.req_id, "sequence", req.num_tokens + len(new))
        for req, new in zip(reqs, arrays):
            req.append_tokens(new)

    def _append_rows(self, reqs: list[RequestState], rows: np.ndarray, block: np.ndarray) -> None:
        """Append row ``i`` of ``block`` (int64 ``[len(reqs), k]``) to ``reqs[i]`` (holding
        ``rows[i]``, intp); checked against ``max_model_len`` before any write."""
        k = block.shape[1]
        num_tokens = self._row_state.num_tokens_mv
        if self.max_model_len is not None:
            for req in reqs:
                self._check_request_len(req.req_id, "sequence", num_tokens[req.row] + k)
        if not k or not reqs:
            return
        state = self._row_state
        starts = state.num_tokens[rows]
        # (count_nonzero: ~1 us cheaper than all() here; argmax and an index than max())
        if np.count_nonzero(state.in_arena[rows]) == len(rows) and state.token_room(
            int(starts[starts.argmax()]) + k
        ):
            # every row in the token arena: one scatter on the flat arena, at each row's
            # first position repeated k times plus 0 .. k - 1 (1-D passes: a broadcast
            # [n, 1] + [k] add, or a put, costs about twice as much)
            arena = state.tokens
            at = rows * arena.shape[1]
            at += starts
            at = at.repeat(k)
            at += _tiled_iota(k, len(rows))
            arena.reshape(-1)[at] = block.reshape(-1)
            starts += k
            state.num_tokens[rows] = starts
            return
        for req, new in zip(reqs, block):
            row = req.row
            n = num_tokens[row]
            req.room(n + k)[n : n + k] = new
            num_tokens[row] = n + k

    # ----------------------------------------------------------------- allocation
    def can_allocate(self, req_id: ReqId, num_new_tokens: int) -> bool:
        """Whether :meth:`allocate` would succeed now (no side effects)."""
        return self.can_allocate_many([req_id], [num_new_tokens])

    def allocate(self, req_id: ReqId, num_new_tokens: int) -> tuple[list[int], ...]:
        """Give the request blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        All-or-nothing over every group. Blocks already allocated (lookahead) are reused, so
        the result may be empty. Same as :meth:`allocate_many` of this one request.

        Returns
        -------
        tuple of list of int
            Per group, the new manager block ids appended to the request's row.

        Raises
        ------
        OutOfBlocksError
            Some group lacks free blocks; nothing was allocated, the pools are unchanged.
        ValueError
            The request would exceed ``max_model_len``.
        """
        return tuple(part.block_ids.tolist() for part in self.allocate_many([req_id], [num_new_tokens]))

    def can_allocate_many(
        self, req_ids: Sequence[ReqId], num_new_tokens: Sequence[int] | np.ndarray
    ) -> bool:
        """Whether :meth:`allocate_many` would succeed now (no side effects)."""
        _, _, needs = self._needs(req_ids, num_new_tokens)
        return all(
            int(need.sum()) <= pool.num_free_blocks for need, pool in zip(needs, self.pools)
        )

    def allocate_many(
        self, req_ids: Sequence[ReqId], num_new_tokens: Sequence[int] | np.ndarray
    ) -> tuple[RowBlocks, ...]:
        """:meth:`allocate` for every request of a step at once: one take per group.

        All-or-nothing over every request and group: on any error (unknown or repeated request,
        lengths that disagree, ``max_model_len``, too few free blocks) nothing changes.

        Parameters
        ----------
        req_ids : sequence of request ids ``[n]``, distinct
        num_new_tokens : sequence of int or int array ``[n]``

        Returns
        -------
        tuple of RowBlocks
            Per group: ``rows`` (int32 ``[k]``, the table rows of the requests that got new
            blocks, in call order), ``num_blocks`` (int32 ``[k]``) and the new ids (int32);
            read-only arrays.
        """
        reqs, rows, needs = self._needs(req_ids, num_new_tokens)
        for g, (pool, need) in enumerate(zip(self.pools, needs)):
            total = int(need.sum())
            if total > pool.num_free_blocks:
                who = (f"request {reqs[0].req_id!r} needs" if len(reqs) == 1
                       else f"{len(reqs)} requests need")
                raise OutOfBlocksError(
                    f"{who} {total} new blocks in group {g}, {pool.num_free_blocks} free")
        grows = np.logical_or.reduce(needs, axis=0) if len(rows) else np.zeros(0, bool)
        self._journal.touch(rows[grows])
        state = self._row_state
        out = []
        for g, (pool, need) in enumerate(zip(self.pools, needs)):
            got = np.flatnonzero(need)
            if not len(got):
                out.append(RowBlocks())
                continue
            g_rows, num = rows[got], need[got]
            new = pool.take(int(num.sum()))
            starts = state.row_len[g].take(g_rows)
            ends = starts + num
            arena = state.ensure_width(g, int(ends.max()))
            # each row's run of new ids: its first flat position in the (C-contiguous) arena
            # plus 0, 1, ... (where its run starts in `new`: the running sum before it)
            first = g_rows * arena.shape[1] + starts - (np.cumsum(num) - num)
            arena.reshape(-1)[first.repeat(num) + np.arange(len(new))] = new
            state.row_len[g][g_rows] = ends
            data = np.concatenate((g_rows, num, new), dtype=np.int32, casting="unsafe")
            flat = np.frombuffer(data.tobytes(), dtype=np.int32)  # read-only, immutable
            n = len(g_rows)
            out.append(RowBlocks(flat[:n], flat[n : 2 * n], flat[2 * n :]))
        if np.count_nonzero(grows):
            grown = rows[grows]
            slots = state.row_len[0].take(grown) * self.block_sizes[0]
            for g in range(1, len(self.pools)):
                np.minimum(slots, state.row_len[g].take(grown) * self.block_sizes[g], out=slots)
            state.num_slots[grown] = slots
        return tuple(out)

    def _needs(
        self, req_ids: Sequence[ReqId], num_new_tokens: Sequence[int] | np.ndarray
    ) -> tuple[list[RequestState], np.ndarray, list[np.ndarray]]:
        """The running requests of ``req_ids``, their rows (intp) and, per group, the blocks
        each needs for ``num_new_tokens`` more tokens (int64 ``[n]``); checked, including
        ``max_model_len``."""
        req_ids, reqs, rows = self._running(req_ids)
        counts = token_counts("num_new_tokens", num_new_tokens, len(reqs))
        state = self._row_state
        totals = state.num_computed.take(rows) + np.array(counts, dtype=np.int64)
        if self.max_model_len is not None and len(reqs):
            over = np.flatnonzero(totals > self.max_model_len)
            if len(over):
                i = int(over[0])
                self._check_request_len(reqs[i].req_id, "allocation", int(totals[i]))
        needs = []
        for g, bs in enumerate(self.block_sizes):
            need = -(-totals // bs) - state.row_len[g].take(rows)
            needs.append(np.maximum(need, 0))
        return reqs, rows, needs

    # ----------------------------------------------------------------- computed tokens
    def mark_computed(self, req_id: ReqId, num_tokens: int) -> None:
        """Record that the next ``num_tokens`` tokens are now in the KV cache.

        Full blocks become findable by later requests; sliding-window groups release the
        blocks wholly outside the window of the next token to compute (their entries become
        ``NULL_BLOCK_ID`` and show up in ``StepUpdate.nulled``). Same as
        ``mark_computed_many([req_id], [num_tokens])``.

        Raises
        ------
        ValueError
            The tokens are not known yet (append them first) or have no block allocated.
        """
        self.mark_computed_many([req_id], [num_tokens])

    def mark_computed_many(
        self, req_ids: Sequence[ReqId], num_tokens: Sequence[int] | np.ndarray
    ) -> None:
        """:meth:`mark_computed` for every request of a step: one hashing pass for all newly
        full blocks, one registration and one release per group. Checked fully first."""
        req_ids, reqs, rows = self._running(req_ids)
        counts = token_counts("num_tokens", num_tokens, len(reqs))
        if not reqs:
            return
        state = self._row_state
        num_computed = state.num_computed[rows] + np.array(counts, dtype=np.int64)
        # num_slots: what every group's blocks hold
        bad = num_computed > state.num_slots[rows]
        bad |= num_computed > state.num_tokens[rows]
        if np.count_nonzero(bad):  # (cheaper than any() on bools)
            i = int(bad.argmax())
            self._check_computed(reqs[i], int(num_computed[i]))
            raise AssertionError("a count past num_slots or num_tokens passed the checks")
        state.num_computed[rows] = num_computed
        self.prefix_cache.register(reqs, rows, state)
        if self._has_windows:
            for g, window in enumerate(self.windows):
                if window is not None:
                    self._release_outside_window(reqs, g, window)

    def _check_computed(self, req: RequestState, num_computed: int) -> None:
        """Raise ``ValueError`` unless ``req`` has token ids and blocks for ``num_computed``."""
        if num_computed > req.num_tokens:
            raise ValueError(
                f"request {req.req_id!r}: cannot mark {num_computed} tokens computed, only "
                f"{req.num_tokens} token ids are known (append_token_ids first)"
            )
        for g, (row_len, bs) in enumerate(zip(req.row_len.tolist(), self.block_sizes)):
            if num_computed > row_len * bs:
                raise ValueError(
                    f"request {req.req_id!r}: cannot mark {num_computed} tokens computed, "
                    f"group {g} has blocks for {row_len * bs} (allocate first)"
                )

    # ----------------------------------------------------------------- release
    def free(self, req_id: ReqId) -> None:
        """Release a finished request's blocks (cached ones stay findable) and its row.

        A preempted request (holding nothing) is forgotten. Blocks are queued tail first, so a
        request's tail is evicted before its (possibly shared) prefix.

        Raises
        ------
        KeyError
            Unknown request, or freed twice.
        """
        self.free_many([req_id])

    def free_many(self, req_ids: Sequence[ReqId]) -> None:
        """:meth:`free` of several requests at once (in order); checked fully first."""
        req_ids = as_list("req_ids", req_ids)
        preempted = self._preempted
        running = [r for r in req_ids if r not in preempted] if preempted else req_ids
        reqs = running_requests(self._requests, preempted, running)
        if preempted:
            if len(set(req_ids)) != len(req_ids):
                raise ValueError(f"req_ids holds a request twice: {req_ids!r}")
            for req_id in req_ids:
                preempted.discard(req_id)
        self._release(reqs)

    def preempt(self, req_id: ReqId) -> None:
        """Release the request's blocks and row; it may come back with :meth:`add_request`.

        Its computed full blocks stay cached, so re-admission with all its tokens so far
        (prompt and generated) usually hits them.
        """
        self._release([self._get(req_id)])
        self._preempted.add(req_id)
        self.num_preemptions += 1

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
        parent = self._get(parent_id)
        check_req_id("child_id", child_id)
        if child_id in self._requests or child_id in self._preempted:
            raise ValueError(f"child_id {child_id!r} is already a known request")
        self._rows.check_free(f"request {child_id!r}")
        num_computed = parent.num_computed_tokens
        for g, (pool, bs) in enumerate(zip(self.pools, self.block_sizes)):
            if num_computed % bs and pool.num_free_blocks < 1:
                raise OutOfBlocksError(f"fork of {parent_id!r}: no free block in group {g}")
        row = self._rows.take(None)  # type: ignore[arg-type]  # the holder is set below
        self._journal.touch([row])
        child = parent.fork(child_id, row)
        self._rows.holders[row] = child
        self.prefix_cache.chains.copy_row(parent.row, row)
        copies: list[list[tuple[int, int]]] = []
        for g, (pool, bs) in enumerate(zip(self.pools, self.block_sizes)):
            num_full = num_computed // bs
            shared = parent.blocks(g)[:num_full].copy()
            real = shared[int(parent.num_skipped_blocks[g]) :]
            pool.share(real, np.ones(len(real), dtype=np.int32))
            child.set_blocks(g, shared)
            copies.append([])
            if num_computed % bs:
                dst = pool.take_one()
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
        return self.prefix_cache.reset(list(self._requests.values()))

    # ----------------------------------------------------------------- step result
    def take_step_update(self) -> StepUpdate:
        """The net row changes since the last call, as flat arrays for the table; then reset.

        See :mod:`blocktable.allocator.journal` for how operations within one step merge: a
        request admitted and allocated in the same step is only in ``added`` (cached hits and
        new blocks together); a freed row is in ``cleared_rows`` unless another request took
        it in the same step, in which case it is only in ``added``. The update is built with
        ``trusted=True`` (rows, counts and ids checked here) from read-only arrays.
        """
        # Stamp the block sizes so a table built for another block size refuses the ids.
        return self._journal.take(self.block_sizes)

    # ----------------------------------------------------------------- queries
    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def row_of(self, req_id: ReqId) -> int:
        """The table row of a running request."""
        return self._get(req_id).row

    def block_ids(self, req_id: ReqId) -> tuple[list[int], ...]:
        """Per group, the request's manager block ids (``NULL_BLOCK_ID`` outside a window)."""
        req = self._get(req_id)
        return tuple(req.blocks(g).tolist() for g in range(len(self.pools)))

    def num_computed_tokens(self, req_id: ReqId) -> int:
        """Tokens of the request already in the KV cache."""
        return self._get(req_id).num_computed_tokens

    def num_tokens(self, req_id: ReqId) -> int:
        """Token ids known for the request (prompt plus appended)."""
        return self._get(req_id).num_tokens

    def is_preempted(self, req_id: ReqId) -> bool:
        """Whether ``req_id`` was preempted and not re-admitted or freed since."""
        return req_id in self._preempted

    @property
    def num_requests(self) -> int:
        """Running requests (each holds a row)."""
        return len(self._requests)

    @property
    def num_free_rows(self) -> int:
        return self._rows.num_free

    def num_free_blocks(self, group: int = 0) -> int:
        """Blocks of ``group`` that can be allocated now (uncached or evictable)."""
        return self.pools[group].num_free_blocks

    def num_cached_blocks(self, group: int = 0) -> int:
        """Blocks of ``group`` findable by prefix lookup (held or free)."""
        return self.pools[group].num_cached_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_cache.stats

    def check_integrity(self) -> None:
        """Verify every invariant (refcounts, queues, index, rows); raise ``IntegrityError``.

        O(num_blocks + records + requests' blocks): for tests and debug modes.
        """
        check_manager_integrity(self, self._requests, self._rows.holders, self._rows.free_rows())

    # ----------------------------------------------------------------- internals
    def _running(self, req_ids: Sequence[ReqId]) -> tuple[list, list[RequestState], np.ndarray]:
        """``req_ids`` as a list, their states and their rows (intp ``[n]``, read-only);
        ``KeyError`` naming one not running, ``ValueError`` for a repeat. The last call's
        answer when it named the same requests (nobody left since)."""
        req_ids = as_list("req_ids", req_ids)
        last = self._last_batch
        if last is not None and last[0] == req_ids:
            return req_ids, last[1], last[2]
        reqs = running_requests(self._requests, self._preempted, req_ids)
        rows = np.array([req.row for req in reqs], dtype=np.intp)
        rows.flags.writeable = False
        self._last_batch = (req_ids.copy(), reqs, rows)
        return req_ids, reqs, rows

    def _get(self, req_id: ReqId) -> RequestState:
        req = self._requests.get(req_id)
        if req is None:
            if req_id in self._preempted:
                raise KeyError(f"request {req_id!r} is preempted (add_request it again)")
            raise KeyError(f"unknown request {req_id!r} (never added, or already freed)")
        return req

    def _check_request_len(self, req_id: ReqId, what: str, num_tokens: int) -> None:
        """:func:`check_model_len` naming a request (the message is built only to raise)."""
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            check_model_len(self.max_model_len, f"request {req_id!r}", what, num_tokens)

    def _release_outside_window(self, reqs: list[RequestState], g: int, window: int) -> None:
        bs = self.block_sizes[g]
        released: list[np.ndarray] = []
        state = self._row_state
        for req in reqs:
            row = req.row
            first = int(state.num_skipped[g, row])
            skip = max(0, (int(state.num_computed[row]) - window + 1) // bs)
            if skip <= first:
                continue
            self._journal.touch([row])
            entries = state.blocks[g][row]
            released.append(entries[first:skip].copy())  # oldest first
            entries[first:skip] = NULL_BLOCK_ID
            for i in range(first, skip):
                self._journal.null(row, g, i)
            state.num_skipped[g, row] = skip
        if released:
            ids = released[0] if len(released) == 1 else np.concatenate(released)
            self.pools[g].release(ids, may_repeat=len(released) > 1)

    def _release(self, reqs: list[RequestState]) -> None:
        """Free the rows and blocks of ``reqs`` (running, distinct): per group, a reversed
        slice of each request's row (tail first, read through memoryviews), one concatenation
        and one release; then the rows."""
        state, requests = self._row_state, self._requests
        self._last_batch = None  # it may name a request of reqs
        rows = []
        for req in reqs:  # (checked: nothing below fails)
            rows.append(req.row)
            del requests[req.req_id]
        self._journal.touch(rows)
        for pool, arena, row_len, num_skipped in zip(
            self.pools, state.blocks, state.row_len_mvs, state.num_skipped_mvs
        ):
            parts = []
            for row in rows:
                n, skip = row_len[row], num_skipped[row]
                if n > skip:
                    parts.append(arena[row, n - 1 : skip - 1 if skip else None : -1])
            if parts:
                ids = np.concatenate(parts, dtype=np.intp)
                pool.release(ids, may_repeat=len(parts) > 1)
        state.stop(rows)
        self._rows.release_many(rows)


_TILED_IOTAS: dict[int, np.ndarray] = {}  # k -> 0 .. k - 1 repeated (int64), grown on demand


def _tiled_iota(k: int, n: int) -> np.ndarray:
    """``0 .. k - 1`` repeated ``n`` times: int64 ``[n * k]``, read-only (a prefix of a cached
    array: steps append the same number of tokens to a varying number of requests)."""
    tiled = _TILED_IOTAS.get(k)
    if tiled is None or len(tiled) < n * k:
        if n * k > 1 << 20:  # (too large to keep)
            return np.tile(np.arange(k, dtype=np.int64), n)
        reps = max(n, 64, 0 if tiled is None else 2 * len(tiled) // k)
        tiled = np.tile(np.arange(k, dtype=np.int64), reps)
        tiled.flags.writeable = False
        _TILED_IOTAS[k] = tiled
    return tiled[: n * k]


def _byte_hash_fn(hash_fn: object) -> HashFn | None:
    """The byte-chained hash function a ``hash_fn`` argument selects (None: the fast key)."""
    if hash_fn is None or hash_fn == "fast":
        return None
    if hash_fn == "sha256":
        return sha256_block_hash
    if isinstance(hash_fn, str):
        raise ValueError(  # noqa: TRY004 (a str of the right type, naming no hash)
            f"hash_fn must be 'fast', 'sha256' or a callable, got {hash_fn!r}"
        )
    if not callable(hash_fn):
        raise TypeError(
            f"hash_fn must be 'fast', 'sha256' or a callable, got {type(hash_fn).__name__}"
        )
    return hash_fn  # type: ignore[return-value]
