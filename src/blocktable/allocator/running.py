"""Running requests: their table rows, block rows and token ids, and the step's journal.

:class:`RunningRequests` is the half of :class:`~blocktable.allocator.KVCacheManager` that
does not know about block contents: it hands blocks out of the pools (``allocate_many``),
appends sampled tokens, releases a leaving request's blocks and row, answers queries about
running requests, and turns the step's row changes into a
:class:`~blocktable.update.StepUpdate`. Every batched call checks all its arguments before it
changes anything; the per-request calls are wrappers over the batched ones (``free`` and
``append_token_ids`` check and record the call, applied with the others of its kind by one
batched call at the next call of anything else), but for ``allocate``, which works on its one
request in Python ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from blocktable._checks import as_list, check_model_len, check_same_length, token_counts
from blocktable._fastnp import count_nonzero
from blocktable.allocator.checks import running_requests
from blocktable.allocator.errors import OutOfBlocksError
from blocktable.allocator.journal import StepJournal
from blocktable.allocator.pool import BlockPool
from blocktable.allocator.release import release_rows
from blocktable.allocator.request import RequestState
from blocktable.allocator.rows import RowAllocator
from blocktable.allocator.rowstate import RowState
from blocktable.token_ids import TokenIds, token_array, token_rows
from blocktable.update import RowBlocks, StepUpdate

ReqId = str | int
_ROW = attrgetter("row")
_MAX_NEW_TOKENS = 2**62  # tokens one call may allocate for a request (far above any pool)


class RunningRequests:
    """The running requests of one allocator, each holding a table row.

    Parameters
    ----------
    pools : sequence of BlockPool
        One per KV cache group.
    max_num_reqs : int
        Number of table rows.
    max_model_len : int or None
        The most tokens a request may hold.
    """

    def __init__(
        self, pools: Sequence[BlockPool], max_num_reqs: int, max_model_len: int | None
    ) -> None:
        self._pools = tuple(pools)
        self.block_sizes = tuple(pool.block_size for pool in self._pools)
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self._requests: dict[ReqId, RequestState] = {}
        self._preempted: set[ReqId] = set()
        self._rows: RowAllocator[RequestState] = RowAllocator(max_num_reqs)
        self._row_state = RowState(max_num_reqs, len(self._pools))
        self._journal = StepJournal(len(self._pools), self._row_state)
        self.num_preemptions = 0
        # Per-request calls of one kind (mark_computed, append_token_ids or free), checked when
        # made and recorded since the last call of any other method or kind (distinct
        # requests, in call order; per request what the batched call needs): applied by
        # _settle as one batched call. Calls of one kind on distinct requests commute, and
        # each was checked against the state the earlier ones leave for it, so the batched
        # call cannot fail.
        self._pending: dict[ReqId, object] = {}
        self._pending_kind = ""  # "computed", "append" or "free"

    @property
    def pools(self) -> tuple[BlockPool, ...]:
        """Per KV cache group, its block pool."""
        self._settle()
        return self._pools

    def _settle(self) -> None:
        """Apply the recorded per-request calls (one batched call); every other public method
        calls this first, so what it reads or changes is up to date."""
        pending = self._pending
        if pending:
            self._pending = {}
            req_ids, kind = list(pending), self._pending_kind
            if kind == "computed":
                self._apply_marks(req_ids, list(pending.values()))  # type: ignore[arg-type]
            elif kind == "append":
                self._apply_appends(req_ids, list(pending.values()))  # type: ignore[arg-type]
            else:
                self._release([self._requests[req_id] for req_id in req_ids])

    def _defer(self, kind: str, req_id: ReqId) -> RequestState | None:
        """Before a per-request call of ``kind`` is checked and recorded (``_pending_kind`` set
        to ``kind``, ``_pending[req_id]`` to what the batched call needs): settle unless the
        calls pending are of this kind on other requests; return the request, or None when
        ``req_id`` is not a running request's id (the batched call then checks and words it)."""
        if type(req_id) is not int and type(req_id) is not str:  # (maybe unhashable)
            self._settle()
            return None
        pending = self._pending
        if pending and (self._pending_kind != kind or req_id in pending):
            self._settle()
        return self._requests.get(req_id)

    def _apply_marks(self, req_ids: list[ReqId], counts: list[int]) -> None:
        raise NotImplementedError  # KVCacheManager.mark_computed_many's work, once checked

    def append_token_ids(self, req_id: ReqId, token_ids: int | TokenIds) -> None:
        """Append generated tokens (one int or a sequence) to the request's sequence.

        Same as ``append_token_ids_many([req_id], [token_ids])``: checked now; the work is done
        by one batched call of the requests appended to since the last call of any other
        method (see :meth:`mark_computed`).
        """
        req = self._defer("append", req_id)
        if req is None:
            self._settle()
            self.append_token_ids_many([req_id], [token_ids])
            return
        try:  # (the name naming the request is built only to raise)
            new = token_array("token_ids", token_ids)
        except (TypeError, ValueError):
            new = token_array(f"token_ids of request {req_id!r}", token_ids)
        if self.max_model_len is not None:
            self._check_request_len(req_id, "sequence", req.num_tokens + len(new))
        if not isinstance(token_ids, (list, tuple, int)):
            new = new.copy()  # (an array of the caller's, which may change before it is applied)
        self._pending_kind = "append"  # recorded (see _settle)
        self._pending[req_id] = new

    def _apply_appends(self, req_ids: list[ReqId], arrays: list[np.ndarray]) -> None:
        """Append ``arrays[i]`` (int64, checked) to running request ``req_ids[i]`` (distinct):
        arrays of one length as one block."""
        reqs = [self._requests[req_id] for req_id in req_ids]
        k = len(arrays[0])
        if len(arrays) > 1 and all(len(new) == k for new in arrays):
            self._append_rows(reqs, np.concatenate(arrays).reshape(len(arrays), k))
            return
        for req, new in zip(reqs, arrays):
            req.append_tokens(new)

    def append_token_ids_many(
        self, req_ids: Sequence[ReqId], token_ids: Sequence[int | TokenIds] | np.ndarray
    ) -> None:
        """Append tokens to several requests: ``token_ids[i]`` (an int, a sequence, or row ``i``
        of an int array ``[num_reqs, k]``) to ``req_ids[i]``. Checked fully before any write."""
        self._settle()
        req_ids, reqs = self._running(req_ids)
        if isinstance(token_ids, np.ndarray) and token_ids.ndim == 2:
            check_same_length("token_ids", token_ids, len(req_ids))
            # one conversion of the whole array; then every request appends a row of width k
            name = f"token_ids of request {req_ids[0]!r}" if req_ids else "token_ids"
            block = token_array(name, token_ids.reshape(-1)).reshape(token_ids.shape)
            self._append_rows(reqs, block)
            return
        token_ids = as_list("token_ids", token_ids)
        check_same_length("token_ids", token_ids, len(req_ids))
        rows_block = token_rows(token_ids) if len(token_ids) > 1 else None
        if rows_block is not None:  # (usually: lists of as many tokens each, converted at once)
            self._append_rows(reqs, rows_block)
            return
        arrays = [
            token_array(f"token_ids of request {r!r}", ids) for r, ids in zip(req_ids, token_ids)
        ]
        for req, new in zip(reqs, arrays):
            self._check_request_len(req.req_id, "sequence", req.num_tokens + len(new))
        for req, new in zip(reqs, arrays):
            req.append_tokens(new)

    def _append_rows(self, reqs: list[RequestState], block: np.ndarray) -> None:
        """Append row ``i`` of ``block`` (int64 ``[len(reqs), k]``) to ``reqs[i]``; checked
        against ``max_model_len`` before any write."""
        k = block.shape[1]
        num_tokens = self._row_state.num_tokens_mv
        if self.max_model_len is not None:
            for req in reqs:
                self._check_request_len(req.req_id, "sequence", num_tokens[req.row] + k)
        if not k or not reqs:
            return
        state = self._row_state
        rows = np.array([req.row for req in reqs], dtype=np.intp)
        starts = state.num_tokens[rows]
        # (count_nonzero: cheaper than all() here; argmax and an index than max())
        if count_nonzero(state.in_arena[rows]) == len(rows) and state.token_room(
            int(starts[starts.argmax()]) + k
        ):
            # every row in the token arena: one scatter on the flat arena, at each row's
            # first position plus 0 .. k - 1 (an [n, k] index; np.tile of 1-D passes costs
            # more)
            arena = state.tokens
            at = rows * arena.shape[1]
            at += starts
            arena.reshape(-1)[np.add.outer(at, np.arange(k))] = block
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
        if self._pending:  # (the call costs more than the test, once per decode request)
            self._settle()
        req = self._requests.get(req_id) if type(req_id) in (int, str) else None
        if req is not None and type(num_new_tokens) is int and num_new_tokens >= 0:
            # one request in Python ints: the batched call's arrays cost more than they save
            state, row, pools = self._row_state, req.row, self._pools
            total = state.num_computed_mv[row] + num_new_tokens
            lens, sizes = state.row_len_mvs, self.block_sizes
            # (several groups: every pool's free count first, all or nothing; one pool's take
            # checks its own and takes nothing when it fails)
            if (self.max_model_len is None or total <= self.max_model_len) and (
                len(pools) == 1
                or all(
                    -(-total // bs) - row_len[row] <= pool.num_free_blocks
                    for row_len, bs, pool in zip(lens, sizes, pools)
                )
            ):
                out: list[list[int]] = []
                try:
                    for g, pool in enumerate(pools):
                        row_len = lens[g]
                        start, end = row_len[row], -(-total // sizes[g])
                        if end <= start:  # (most decode steps: the last block has room)
                            out.append([])
                            continue
                        new = pool.take(end - start)
                        arena = state.blocks[g]
                        if arena.shape[1] < end:
                            arena = state.ensure_width(g, end)
                        arena[row, start:end] = new
                        row_len[row] = end
                        out.append(new.tolist())
                except OutOfBlocksError:
                    pass  # (one group, nothing taken: the batched call words the error)
                else:
                    state.update_num_slots(sizes, row)
                    return tuple(out)
        # an error (or a count of another integer type): the batched call checks and words it
        parts = self.allocate_many([req_id], [num_new_tokens])  # type: ignore[list-item]
        return tuple(part.block_ids.tolist() for part in parts)

    def can_allocate_many(
        self, req_ids: Sequence[ReqId], num_new_tokens: Sequence[int] | np.ndarray
    ) -> bool:
        """Whether :meth:`allocate_many` would succeed now (no side effects)."""
        self._settle()
        _, _, _, needs = self._needs(req_ids, num_new_tokens)
        return all(int(need.sum()) <= pool.num_free_blocks for need, pool in zip(needs, self._pools))

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
        self._settle()
        reqs, rows, old_lens, needs = self._needs(req_ids, num_new_tokens)
        totals = [int(need.sum()) for need in needs]
        for g, (pool, total) in enumerate(zip(self._pools, totals)):
            if total > pool.num_free_blocks:
                who = (f"request {reqs[0].req_id!r} needs" if len(reqs) == 1
                       else f"{len(reqs)} requests need")
                raise OutOfBlocksError(
                    f"{who} {total} new blocks in group {g}, {pool.num_free_blocks} free")
        state = self._row_state
        out = []
        for g, (pool, need, old_len, total) in enumerate(
            zip(self._pools, needs, old_lens, totals)
        ):
            if not total:
                out.append(RowBlocks())
                continue
            if count_nonzero(need) == len(need):  # (usually: every request grows)
                at, num, starts = rows, need, old_len
            else:
                got = need.nonzero()[0]
                at, num, starts = rows[got], need[got], old_len[got]
            ends = starts + num
            new = pool.take(total)
            arena = state.ensure_width(g, int(ends.max()))
            # each row's run of new ids: its first flat position in the (C-contiguous) arena
            # plus 0, 1, ... (where its run starts in `new`: the running sum before)
            first = at * arena.shape[1] + ends - num.cumsum()
            arena.reshape(-1)[first.repeat(num) + np.arange(total)] = new
            state.row_len[g][at] = ends
            n = len(at)
            data = np.concatenate((at, num, new), dtype=np.int32, casting="unsafe")
            flat = np.frombuffer(data.tobytes(), dtype=np.int32)  # read-only, immutable
            out.append(RowBlocks(flat[:n], flat[n : 2 * n], flat[2 * n :]))
        # the tokens every group's blocks hold, in the rows that grew
        sizes = self.block_sizes
        if len(sizes) == 1:
            if totals[0]:  # (the rows and row ends of the one group)
                state.num_slots[at] = ends * sizes[0]
        elif any(totals):
            grown = np.logical_or.reduce(needs)
            slots = np.minimum.reduce(
                [(old_len + need) * bs for old_len, need, bs in zip(old_lens, needs, sizes)]
            )
            state.num_slots[rows[grown]] = slots[grown]
        return tuple(out)

    def _needs(
        self, req_ids: Sequence[ReqId], num_new_tokens: Sequence[int] | np.ndarray
    ) -> tuple[list[RequestState], np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """The running requests of ``req_ids``, their rows (intp) and, per group, their row
        lengths and the blocks each needs for ``num_new_tokens`` more tokens (int64 arrays);
        checked, including ``max_model_len``."""
        reqs = running_requests(self._requests, self._preempted, as_list("req_ids", req_ids))
        counts = token_counts("num_new_tokens", num_new_tokens, len(reqs))
        if counts and max(counts) > _MAX_NEW_TOKENS:  # (int64 sums below)
            raise ValueError(f"num_new_tokens holds {max(counts)}, more than {_MAX_NEW_TOKENS}")
        state = self._row_state
        rows = np.fromiter(map(_ROW, reqs), np.intp, len(reqs))
        totals = state.num_computed[rows] + np.array(counts, dtype=np.int64)
        if self.max_model_len is not None and len(totals):
            over = totals > self.max_model_len
            if count_nonzero(over):
                i = int(over.argmax())
                self._check_request_len(reqs[i].req_id, "allocation", int(totals[i]))
        old_lens, needs = [], []
        for row_len, bs in zip(state.row_len, self.block_sizes):
            old_len = row_len[rows]
            # blocks for the total, less those held (lookahead may hold more)
            need = -(-totals // bs) - old_len
            np.maximum(need, 0, out=need)
            old_lens.append(old_len)
            needs.append(need)
        return reqs, rows, old_lens, needs

    def free(self, req_id: ReqId) -> None:
        """Release a finished request's blocks (cached ones stay findable) and its row.

        A preempted request (holding nothing) is forgotten. Blocks are queued tail first, so a
        request's tail is evicted before its (possibly shared) prefix. Same as
        ``free_many([req_id])``: checked now; the work is done by one batched call of the
        requests freed since the last call of any other method (see :meth:`mark_computed`).

        Raises
        ------
        KeyError
            Unknown request, or freed twice.
        """
        if self._defer("free", req_id) is None:  # preempted, or not a running request
            self._settle()
            self.free_many([req_id])
            return
        self._pending_kind = "free"  # recorded (see _settle)
        self._pending[req_id] = None

    def free_many(self, req_ids: Sequence[ReqId]) -> None:
        """:meth:`free` of several requests at once (in order); checked fully first."""
        self._settle()
        req_ids = as_list("req_ids", req_ids)
        preempted = self._preempted
        running = [r for r in req_ids if r not in preempted] if preempted else req_ids
        reqs = running_requests(self._requests, preempted, running)
        if preempted:
            if len(set(req_ids)) != len(req_ids):
                raise ValueError(f"req_ids holds a request twice: {req_ids!r}")
            preempted.difference_update(req_ids)
        self._release(reqs)

    def preempt(self, req_id: ReqId) -> None:
        """Release the request's blocks and row; it may come back with :meth:`add_request`.

        Its computed full blocks stay cached, so re-admission with all its tokens so far
        (prompt and generated) usually hits them.
        """
        self._settle()
        self._release([self._get(req_id)])
        self._preempted.add(req_id)
        self.num_preemptions += 1

    def take_step_update(self) -> StepUpdate:
        """The net row changes since the last call, as flat arrays for the table; then reset.

        Operations within one step merge as :mod:`blocktable.allocator.journal` describes.
        The update is trusted (checked here), read-only, and stamped with the block sizes, so
        a table built for another block size refuses its ids.
        """
        if self._pending:  # (_settle's own test: a decode step has nothing pending)
            self._settle()
        return self._journal.take(self.block_sizes)

    # ----------------------------------------------------------------- queries
    def __contains__(self, req_id: object) -> bool:
        self._settle()
        return req_id in self._requests

    def row_of(self, req_id: ReqId) -> int:
        """The table row of a running request."""
        self._settle()
        return self._get(req_id).row

    def rows_of(self, req_ids: Sequence[ReqId]) -> np.ndarray:
        """:meth:`row_of` of several running requests (distinct), in order.

        Returns
        -------
        np.ndarray
            int32 ``[len(req_ids)]`` on cpu, a new array.

        Raises
        ------
        KeyError
            A request that is not running (named); ``ValueError`` for one given twice,
            ``TypeError`` for ``req_ids`` not a list, tuple or 1-D array. Nothing changes.
        """
        self._settle()
        reqs = running_requests(self._requests, self._preempted, as_list("req_ids", req_ids))
        return np.fromiter(map(_ROW, reqs), np.int32, len(reqs))

    def block_ids(self, req_id: ReqId) -> tuple[list[int], ...]:
        """Per group, the request's manager block ids (``NULL_BLOCK_ID`` outside a window)."""
        self._settle()
        req = self._get(req_id)
        return tuple(req.blocks(g).tolist() for g in range(len(self._pools)))

    def num_computed_tokens(self, req_id: ReqId) -> int:
        """Tokens of the request already in the KV cache."""
        self._settle()
        return self._get(req_id).num_computed_tokens

    def num_tokens(self, req_id: ReqId) -> int:
        """Token ids known for the request (prompt plus appended)."""
        self._settle()
        return self._get(req_id).num_tokens

    def is_preempted(self, req_id: ReqId) -> bool:
        """Whether ``req_id`` was preempted and not re-admitted or freed since."""
        self._settle()
        return req_id in self._preempted

    @property
    def num_requests(self) -> int:
        """Running requests (each holds a row)."""
        self._settle()
        return len(self._requests)

    @property
    def num_free_rows(self) -> int:
        self._settle()
        return self._rows.num_free

    def _running(self, req_ids: Sequence[ReqId]) -> tuple[list, list[RequestState]]:
        """``req_ids`` as a list and their states; ``KeyError`` naming one not running,
        ``ValueError`` for a repeat."""
        req_ids = as_list("req_ids", req_ids)
        return req_ids, running_requests(self._requests, self._preempted, req_ids)

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

    def _release(self, reqs: list[RequestState]) -> None:
        """Free the rows and blocks of ``reqs`` (running, distinct)."""
        requests = self._requests
        for req in reqs:  # (checked: nothing below fails)
            del requests[req.req_id]
        self._rows.release_many(release_rows(self._row_state, self._pools, reqs))
