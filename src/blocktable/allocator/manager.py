"""The per-request allocator API an engine's scheduler calls every step."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from blocktable._checks import check_positive
from blocktable.allocator.errors import OutOfBlocksError
from blocktable.allocator.hashing import HashFn, check_namespace, sha256_block_hash
from blocktable.allocator.integrity import check_manager_integrity
from blocktable.allocator.journal import StepJournal
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.prefix import (
    cache_full_blocks,
    find_cached_prefix,
    share_cached_prefix,
)
from blocktable.allocator.request import (
    TOKEN_BYTES,
    RequestState,
    TokenIds,
    check_count,
    check_req_id,
    token_bytes,
)
from blocktable.allocator.rows import RowAllocator
from blocktable.allocator.spec import AllocatorGroupSpec
from blocktable.allocator.stats import PrefixCacheStats
from blocktable.constants import NULL_BLOCK_ID
from blocktable.update import StepUpdate

ReqId = str | int


class KVCacheManager:
    """Block allocation for every KV cache group, per request, with prefix caching.

    Every running request holds one table row (``0 .. max_num_reqs - 1``, lowest free row first)
    from :meth:`add_request` until :meth:`free`/:meth:`preempt` (SPEC §3.5, indexed mode); the
    rows of :meth:`take_step_update` are these rows, and the block ids are manager block ids.

    Per step, an engine calls:

    1. ``free``/``preempt`` for finished or preempted requests;
    2. ``add_request`` for admitted (or resumed) ones: it returns the number of prompt tokens
       found in the prefix cache, which need no compute;
    3. ``can_allocate``/``allocate`` for every request's tokens of this step (all-or-nothing);
    4. ``take_step_update()`` and hand it to the table's batched update;
    5. after the forward: ``mark_computed`` (full blocks become findable; sliding-window groups
       release blocks that left the window) and ``append_token_ids`` for sampled tokens.

    Parameters
    ----------
    groups : sequence of AllocatorGroupSpec
        One entry per KV cache group, each with its own block pool.
    max_num_reqs : int
        Number of table rows.
    enable_prefix_caching : bool
        Index full computed blocks so later requests with the same prefix share them.
    hash_fn : callable, optional
        ``hash_fn(bytes) -> bytes`` for the chained block hashes (default SHA-256). Lookups
        compare tokens and prefixes exactly, so a weak or colliding ``hash_fn`` never shares
        wrong KV.
    max_model_len : int, optional
        When given, a request may not grow past this many tokens (``ValueError``).

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
        hash_fn: HashFn | None = None,
        max_model_len: int | None = None,
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
        if hash_fn is not None and not callable(hash_fn):
            raise TypeError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
        if max_model_len is not None:
            check_positive("max_model_len", max_model_len)
        self.groups = groups
        self.max_num_reqs = int(max_num_reqs)
        self.max_model_len = max_model_len
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hash_fn: HashFn = sha256_block_hash if hash_fn is None else hash_fn
        self.pools = tuple(
            BlockPool(spec.num_blocks, enable_caching=self.enable_prefix_caching) for spec in groups
        )
        self.block_sizes = tuple(spec.block_size for spec in groups)
        self._windows = tuple(spec.sliding_window for spec in groups)
        self._align_tokens = math.lcm(*self.block_sizes)
        self._single_group = len(groups) == 1  # allocate's fast path
        self._block_size0 = self.block_sizes[0]
        self._requests: dict[ReqId, RequestState] = {}
        self._preempted: set[ReqId] = set()
        self._rows: RowAllocator[RequestState] = RowAllocator(self.max_num_reqs)
        self._journal = StepJournal(len(groups))
        # prefix-cache counters as plain ints: a frozen dataclass per admission costs ~1 us
        self._num_queries = self._num_query_tokens = self._num_hit_tokens = 0
        self.num_preemptions = 0

    # ----------------------------------------------------------------- admission
    def lookup_prefix(
        self, prompt_token_ids: TokenIds, *, cache_namespace: object = None
    ) -> int:
        """Tokens of this prompt the prefix cache would serve now; changes nothing.

        The number :meth:`add_request` would return for the same prompt and namespace (while
        the pools stay as they are), for schedulers that plan admissions before making them.
        Prefix-cache statistics are not updated.
        """
        tokens = bytearray(token_bytes("prompt_token_ids", prompt_token_ids))
        if not tokens:
            raise ValueError("prompt_token_ids is empty")
        check_namespace(cache_namespace)
        if not self.enable_prefix_caching:
            return 0
        num_cached_tokens, _ = find_cached_prefix(
            self.pools, self.block_sizes, tokens, cache_namespace, self._align_tokens
        )
        return num_cached_tokens

    def add_request(
        self,
        req_id: ReqId,
        prompt_token_ids: TokenIds,
        *,
        cache_namespace: object = None,
    ) -> int:
        """Admit a request (or re-admit a preempted one with all its tokens so far).

        Assigns the lowest free row and shares the longest cached prefix: full blocks only, a
        multiple of every group's block size, at least one prompt token left to compute. The
        request starts with ``num_computed_tokens`` equal to the return value.

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
        check_req_id("req_id", req_id)
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already running")
        tokens = bytearray(token_bytes(f"prompt_token_ids of request {req_id!r}", prompt_token_ids))
        num_tokens = len(tokens) // TOKEN_BYTES
        if not num_tokens:
            raise ValueError(f"prompt_token_ids of request {req_id!r} is empty")
        self._check_model_len(req_id, "prompt", num_tokens)
        check_namespace(cache_namespace)
        self._rows.check_free(f"request {req_id!r}")
        num_cached_tokens, hits = 0, None
        if self.enable_prefix_caching:
            num_cached_tokens, hits = find_cached_prefix(
                self.pools, self.block_sizes, tokens, cache_namespace, self._align_tokens
            )
        req = RequestState(req_id, tokens, cache_namespace, len(self.groups))
        req.row = self._rows.take(req)
        self._journal.touch(req.row, None)
        if num_cached_tokens and hits is not None:
            skips = [self._num_skipped_blocks(g, num_cached_tokens) for g in range(len(hits))]
            share_cached_prefix(req, self.pools, hits, num_cached_tokens, skips)
            self._update_num_slots(req)
        self._requests[req_id] = req
        self._preempted.discard(req_id)
        self._num_queries += 1
        self._num_query_tokens += num_tokens
        self._num_hit_tokens += num_cached_tokens
        return num_cached_tokens

    def append_token_ids(self, req_id: ReqId, token_ids: int | TokenIds) -> None:
        """Append generated tokens (one int or a sequence) to the request's sequence."""
        req = self._get(req_id)
        new = token_bytes(f"token_ids of request {req_id!r}", token_ids)
        self._check_model_len(req_id, "sequence", (len(req.tokens) + len(new)) // TOKEN_BYTES)
        req.tokens += new

    # ----------------------------------------------------------------- allocation
    def can_allocate(self, req_id: ReqId, num_new_tokens: int) -> bool:
        """Whether :meth:`allocate` would succeed now (no side effects)."""
        req = self._requests.get(req_id) or self._get(req_id)
        needs = self._blocks_needed(req, num_new_tokens)
        return needs is None or all(
            need <= pool.num_free_blocks for need, pool in zip(needs, self.pools)
        )

    def allocate(self, req_id: ReqId, num_new_tokens: int) -> tuple[list[int], ...]:
        """Give the request blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        All-or-nothing over every group. Blocks already allocated (lookahead) are reused, so
        the result may be empty.

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
        req = self._requests.get(req_id) or self._get(req_id)
        if self._single_group:
            return self._allocate_single_group(req, num_new_tokens)
        needs = self._blocks_needed(req, num_new_tokens)
        if needs is None:
            return tuple([] for _ in self.pools)
        pools = self.pools
        for g, need in enumerate(needs):
            if need > pools[g].num_free_blocks:
                raise OutOfBlocksError(
                    f"request {req_id!r} needs {need} new blocks in group {g}, "
                    f"{pools[g].num_free_blocks} free"
                )
        if req.row not in self._journal.marks:
            self._journal.touch(req.row, req)
        result = tuple(pool.take(need) if need else [] for pool, need in zip(pools, needs))
        for blocks, new in zip(req.blocks, result):
            blocks += new
        self._update_num_slots(req)
        return result

    def _allocate_single_group(
        self, req: RequestState, num_new_tokens: int
    ) -> tuple[list[int], ...]:
        """:meth:`allocate` for the common one-group model: a decode step's call is ~1 us.

        Same checks as :meth:`_blocks_needed` (through :meth:`_tokens_after`).
        """
        num_tokens = self._tokens_after(req, num_new_tokens)
        if num_tokens <= req.num_slots:
            return ([],)
        block_size = self._block_size0
        blocks = req.blocks[0]
        need = -(-num_tokens // block_size) - len(blocks)
        pool = self.pools[0]
        if need > pool.num_free_blocks:
            raise OutOfBlocksError(
                f"request {req.req_id!r} needs {need} new blocks in group 0, "
                f"{pool.num_free_blocks} free"
            )
        marks = self._journal.marks
        if req.row not in marks:
            marks[req.row] = (req, (len(blocks),))  # StepJournal.touch, inlined
        new = pool.take(need)
        blocks += new
        req.num_slots = len(blocks) * block_size
        return (new,)

    def mark_computed(self, req_id: ReqId, num_tokens: int) -> None:
        """Record that the next ``num_tokens`` tokens are now in the KV cache.

        Full blocks become findable by later requests; sliding-window groups release the
        blocks wholly outside the window of the next token to compute (their entries become
        ``NULL_BLOCK_ID`` and show up in ``StepUpdate.nulled``).

        Raises
        ------
        ValueError
            The tokens are not known yet (append them first) or have no block allocated.
        """
        req = self._get(req_id)
        num_computed = req.num_computed_tokens + check_count("num_tokens", num_tokens)
        if num_computed > req.num_tokens:
            raise ValueError(
                f"request {req_id!r}: cannot mark {num_computed} tokens computed, only "
                f"{req.num_tokens} token ids are known (append_token_ids first)"
            )
        for g, (blocks, block_size) in enumerate(zip(req.blocks, self.block_sizes)):
            if num_computed > len(blocks) * block_size:
                raise ValueError(
                    f"request {req_id!r}: cannot mark {num_computed} tokens computed, group {g} "
                    f"has blocks for {len(blocks) * block_size} (allocate first)"
                )
        req.num_computed_tokens = num_computed
        if self.enable_prefix_caching:
            memo: dict[tuple[int, int], bytes] | None = {} if len(self.groups) > 1 else None
            for g, (pool, block_size) in enumerate(zip(self.pools, self.block_sizes)):
                cache_full_blocks(
                    pool, req, g, block_size, num_computed // block_size, self.hash_fn, memo
                )
        for g, window in enumerate(self._windows):
            if window is not None:
                self._release_outside_window(req, g, self._num_skipped_blocks(g, num_computed))

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
        if req_id in self._preempted:
            self._preempted.discard(req_id)
            return
        self._release(self._get(req_id))

    def preempt(self, req_id: ReqId) -> None:
        """Release the request's blocks and row; it may come back with :meth:`add_request`.

        Its computed full blocks stay cached, so re-admission with all its tokens so far
        (prompt and generated) usually hits them.
        """
        self._release(self._get(req_id))
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
        for g, (pool, block_size) in enumerate(zip(self.pools, self.block_sizes)):
            if num_computed % block_size and pool.num_free_blocks < 1:
                raise OutOfBlocksError(f"fork of {parent_id!r}: no free block in group {g}")
        child = parent.fork(child_id)
        child.row = self._rows.take(child)
        self._journal.touch(child.row, None)
        copies: list[list[tuple[int, int]]] = []
        for g, (pool, block_size) in enumerate(zip(self.pools, self.block_sizes)):
            num_full = num_computed // block_size
            shared = parent.blocks[g][:num_full]
            pool.share([b for b in shared if b != NULL_BLOCK_ID])
            child.blocks[g] = shared
            copies.append([])
            if num_computed % block_size:
                dst = pool.take(1)[0]
                shared.append(dst)
                copies[g].append((parent.blocks[g][num_full], dst))
        self._update_num_slots(child)
        self._requests[child_id] = child
        return tuple(copies)

    # ----------------------------------------------------------------- step result
    def take_step_update(self) -> StepUpdate:
        """The net row changes since the last call, as flat arrays for the table; then reset.

        See :mod:`blocktable.allocator.journal` for how operations within one step merge: a
        request admitted and allocated in the same step is only in ``added`` (cached hits and
        new blocks together); a freed row is in ``cleared_rows`` unless another request took
        it in the same step, in which case it is only in ``added``.
        """
        update = self._journal.take(self._rows.holders)
        # Stamp the block sizes so a table built for another block size refuses the ids.
        return dataclasses.replace(update, allocator_block_sizes=self.block_sizes)

    # ----------------------------------------------------------------- queries
    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def row_of(self, req_id: ReqId) -> int:
        """The table row of a running request."""
        return self._get(req_id).row

    def block_ids(self, req_id: ReqId) -> tuple[list[int], ...]:
        """Per group, a copy of the request's manager block ids (``NULL_BLOCK_ID`` outside a
        sliding window)."""
        return tuple(list(blocks) for blocks in self._get(req_id).blocks)

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
        return PrefixCacheStats(self._num_queries, self._num_query_tokens, self._num_hit_tokens)

    def check_integrity(self) -> None:
        """Verify every invariant (refcounts, queues, index, rows); raise ``IntegrityError``.

        O(num_blocks + index size + requests' blocks): for tests and debug modes.
        """
        check_manager_integrity(self, self._requests, self._rows.holders, self._rows.free_rows())

    # ----------------------------------------------------------------- internals
    def _get(self, req_id: ReqId) -> RequestState:
        req = self._requests.get(req_id)
        if req is None:
            if req_id in self._preempted:
                raise KeyError(f"request {req_id!r} is preempted (add_request it again)")
            raise KeyError(f"unknown request {req_id!r} (never added, or already freed)")
        return req

    def _check_model_len(self, req_id: ReqId, what: str, num_tokens: int) -> None:
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            raise ValueError(
                f"request {req_id!r}: {what} of {num_tokens} tokens exceeds "
                f"max_model_len={self.max_model_len}"
            )

    def _tokens_after(self, req: RequestState, num_new_tokens: int) -> int:
        """The request's token count once ``num_new_tokens`` more are computed (checked)."""
        if type(num_new_tokens) is not int or num_new_tokens < 0:
            num_new_tokens = check_count("num_new_tokens", num_new_tokens)
        num_tokens = req.num_computed_tokens + num_new_tokens
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            self._check_model_len(req.req_id, "allocation", num_tokens)
        return num_tokens

    def _blocks_needed(self, req: RequestState, num_new_tokens: int) -> list[int] | None:
        """New blocks per group for ``num_new_tokens`` more tokens; None when none at all."""
        num_tokens = self._tokens_after(req, num_new_tokens)
        if num_tokens <= req.num_slots:
            return None
        if len(req.blocks) == 1:
            return [-(-num_tokens // self.block_sizes[0]) - len(req.blocks[0])]
        return [
            max(0, -(-num_tokens // block_size) - len(blocks))
            for blocks, block_size in zip(req.blocks, self.block_sizes)
        ]

    def _update_num_slots(self, req: RequestState) -> None:
        req.num_slots = min(
            len(blocks) * block_size for blocks, block_size in zip(req.blocks, self.block_sizes)
        )

    def _num_skipped_blocks(self, group: int, num_computed_tokens: int) -> int:
        window = self._windows[group]
        if window is None:
            return 0
        return max(0, (num_computed_tokens - window + 1) // self.block_sizes[group])

    def _release_outside_window(self, req: RequestState, group: int, num_skipped: int) -> None:
        first = req.num_skipped_blocks[group]
        if num_skipped <= first:
            return
        self._journal.touch(req.row, req)
        blocks = req.blocks[group]
        # Entries before ``first`` are already null; these are real blocks, oldest first.
        self.pools[group].release(blocks[first:num_skipped])
        for i in range(first, num_skipped):
            blocks[i] = NULL_BLOCK_ID
            self._journal.null(req, group, i)
        req.num_skipped_blocks[group] = num_skipped

    def _release(self, req: RequestState) -> None:
        self._journal.touch(req.row, req)
        for pool, blocks in zip(self.pools, req.blocks):
            pool.release([b for b in reversed(blocks) if b != NULL_BLOCK_ID])
        self._rows.release(req.row)
        del self._requests[req.req_id]
