"""Per-request bookkeeping of the manager (numpy rows and tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from blocktable.allocator.rowstate import RowState


def check_req_id(name: str, req_id: object) -> None:
    """Request ids are str or int (not bool)."""
    kind = type(req_id)
    if kind is int or kind is str:  # the common case, without isinstance's walk
        return
    if isinstance(req_id, bool) or not isinstance(req_id, (str, int)):
        raise TypeError(f"{name} must be a str or int, got {type(req_id).__name__}")


def grown(buffer: np.ndarray, size: int) -> np.ndarray:
    """``buffer`` if it holds ``size`` entries, else a copy with room for at least ``size``
    (and some more: sequences keep growing by a few entries per step)."""
    if len(buffer) >= size:
        return buffer
    new = np.zeros(max(size + (size >> 2) + 16, 2 * len(buffer)), dtype=buffer.dtype)
    new[: len(buffer)] = buffer
    return new


class RequestState:
    """What the manager knows about one running request.

    The counts and block rows the batched calls touch every step live in the manager's
    :class:`~blocktable.allocator.rowstate.RowState`, indexed by the request's table ``row``
    (held from admission until freed); the properties here read and write them there (for
    the per-request paths and checks; batched paths gather the rows' entries at once).
    ``blocks(g)`` is the request's row in group ``g``: manager block ids, logical block ``j``
    at index ``j``; entries of sliding-window groups that left the window hold
    ``NULL_BLOCK_ID`` (always a prefix of the row, ``num_skipped_blocks[g]`` long). How many
    blocks are registered in the prefix index and where the key chain stands are kept per row
    in the manager's :class:`KeyChains`; ``parent_hashes[g]`` is the byte-chained hash of the
    last registered block of group ``g`` (only kept with byte hashes). ``keys[bs]`` and
    ``prompt_states[bs]`` are the block keys and key chain states of the prompt's full blocks
    for block size ``bs`` (computed at admission, read-only; the first
    ``num_prompt_tokens // bs`` blocks).
    """

    __slots__ = (
        "_buffer",
        "keys",
        "namespace",
        "namespace_bytes",
        "num_prompt_tokens",
        "parent_hashes",
        "prompt_states",
        "req_id",
        "root",
        "row",
        "rows",
        "seed",
    )

    def __init__(
        self,
        req_id: str | int,
        tokens: np.ndarray | None,
        namespace: object,
        namespace_bytes: bytes,
        root: int,
        seed: int,
        rows: RowState,
        row: int,
        num_prompt_tokens: int,
        parent_hashes: list[bytes],
        keys: dict[int, np.ndarray],
        prompt_states: dict[int, np.ndarray],
    ) -> None:
        """A request holding ``row`` of ``rows`` (the caller starts that row there), its
        token ids in the row's token arena (``tokens`` None) or the first ``num_tokens`` of
        ``tokens`` (int64, a buffer of its own, with room to grow). ``parent_hashes``,
        ``keys`` and ``prompt_states`` are kept as given (not copied). Callers pass every
        argument positionally: a step admits several requests, and keywords cost more."""
        self.req_id = req_id
        self.rows = rows
        self.row = row
        self._buffer = tokens  # on cpu, int64 [capacity], or None: the arena's row
        self.namespace = namespace
        self.namespace_bytes = namespace_bytes
        self.root = root  # parent content id of the first block (negative: the namespace)
        self.seed = seed  # key chain state before the first block (the namespace's)
        self.parent_hashes = parent_hashes  # per group (byte hashes only)
        self.keys = keys  # block size -> uint64 [full prompt blocks], read-only
        self.prompt_states = prompt_states  # block size -> uint64 [full prompt blocks]
        self.num_prompt_tokens = num_prompt_tokens  # at admission (keys cover them)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens already in the KV cache."""
        return self.rows.num_computed_mv[self.row]  # type: ignore[no-any-return]

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.rows.num_computed_mv[self.row] = value

    @property
    def num_tokens(self) -> int:
        """Token ids known (prompt plus appended)."""
        return self.rows.num_tokens_mv[self.row]  # type: ignore[no-any-return]

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        self.rows.num_tokens_mv[self.row] = value

    @property
    def num_slots(self) -> int:
        """Tokens the allocated blocks of every group can hold."""
        return self.rows.num_slots_mv[self.row]  # type: ignore[no-any-return]

    @property
    def row_len(self) -> np.ndarray:
        """Blocks in the row of each group: int64 ``[num_groups]``, a writable view."""
        return self.rows.row_len[:, self.row]

    @property
    def num_skipped_blocks(self) -> np.ndarray:
        """Leading null entries of each group: int64 ``[num_groups]``, a writable view."""
        return self.rows.num_skipped[:, self.row]

    def blocks(self, group: int) -> np.ndarray:
        """The row of ``group``: int32 ``[row_len[group]]``, a view of the arena (valid until
        the arena grows)."""
        return self.rows.row(group, self.row)

    def append_block(self, group: int, block_id: int) -> None:
        """Append one id to the row of ``group``."""
        rows, row = self.rows, self.row
        row_len = rows.row_len_mvs[group]
        n = row_len[row]
        rows.ensure_width(group, n + 1)[row, n] = block_id
        row_len[row] = n + 1

    def set_blocks(self, group: int, block_ids: np.ndarray) -> None:
        """Make ``block_ids`` (int32) the row of ``group``."""
        self.rows.set_row(group, self.row, block_ids)

    @property
    def tokens(self) -> np.ndarray:
        """Where the token ids are: int64 ``[capacity]``, the first ``num_tokens`` of it (a
        view of the arena's row, valid until the arena grows, or the request's own buffer)."""
        buffer = self._buffer
        return self.rows.tokens[self.row] if buffer is None else buffer

    def room(self, size: int) -> np.ndarray:
        """:attr:`tokens` with room for ``size`` ids (the arena widened, or the ids moved to a
        buffer of their own when the arena's rows cannot hold them)."""
        buffer, rows, row = self._buffer, self.rows, self.row
        if buffer is not None:
            buffer = self._buffer = grown(buffer, size)
            return buffer
        if rows.token_room(size):
            return rows.tokens[row]
        n = rows.num_tokens_mv[row]
        buffer = self._buffer = np.empty(size + (size >> 2) + 16, dtype=np.int64)
        buffer[:n] = rows.tokens[row, :n]
        rows.in_arena_mv[row] = False
        return buffer

    def token_array(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Token ids ``start .. stop - 1`` (default: all known): int64, a view of the buffer."""
        return self.tokens[start : self.num_tokens if stop is None else stop]

    def token_ids(self) -> list[int]:
        """The token ids as a list (for tests and debugging)."""
        return self.token_array().tolist()

    def append_tokens(self, new: np.ndarray) -> None:
        rows, row = self.rows, self.row
        n = rows.num_tokens_mv[row]
        self.room(n + len(new))[n : n + len(new)] = new
        rows.num_tokens_mv[row] = n + len(new)

    def fork(self, req_id: str | int, row: int) -> RequestState:
        """A copy under a new id holding ``row``: tokens, computed count and chains' hashes
        copied, no blocks (the caller fills them)."""
        child = RequestState(
            req_id,
            self.rows.start_many([row], [self.tokens[: self.num_tokens]])[0],
            self.namespace,
            self.namespace_bytes,
            self.root,
            self.seed,
            self.rows,
            row,
            self.num_prompt_tokens,
            list(self.parent_hashes),
            dict(self.keys),  # read-only arrays
            dict(self.prompt_states),
        )
        child.num_computed_tokens = self.num_computed_tokens
        child.num_skipped_blocks[:] = self.num_skipped_blocks
        self.rows.num_prompt[row] = self.rows.num_prompt[self.row]
        return child


class PlannedChain(Protocol):
    """What :meth:`KeyChains.admit_many` reads of a planned prompt."""

    root: int
    seed: int
    keys: dict[int, np.ndarray]
    states: dict[int, np.ndarray]


class KeyChains:
    """Where each request's registration stands, per table row (all on cpu).

    For the request holding ``row``: per group ``g``, its first ``num_hashed[g][row]`` blocks
    are full, computed and registered in the prefix index, and ``parent_cid[g][row]`` is the
    content id of the last of them (the parent of the next one; the namespace's root id when
    none is). Per block size ``bs``, ``num_keys[bs][row]`` blocks are keyed and
    ``state[bs][row]`` is the key chain state ``K`` after the last of them (the namespace
    seed when none is).

    Kept in arrays indexed by the row rather than on each request, so a step's registration
    reads and writes them for all its requests with one gather and one scatter each, instead
    of touching a list or dictionary of every request (cold cache lines, at a thousand
    running requests).
    """

    def __init__(self, num_rows: int, block_sizes: Sequence[int]) -> None:
        sizes = sorted(set(block_sizes))
        self.num_hashed = [np.zeros(num_rows, dtype=np.int64) for _ in block_sizes]  # [rows]
        self.parent_cid = [np.zeros(num_rows, dtype=np.int64) for _ in block_sizes]  # [rows]
        self.num_keys = {bs: np.zeros(num_rows, dtype=np.int64) for bs in sizes}  # [num_rows]
        self.state = {bs: np.zeros(num_rows, dtype=np.uint64) for bs in sizes}  # [num_rows]
        self._views()

    def _views(self) -> None:
        # scalar writes through memoryviews (Python ints; the arrays are never reallocated)
        self._start_mvs = [(a.data, b.data) for a, b in zip(self.num_hashed, self.parent_cid)]
        self._set_mvs = {bs: (self.num_keys[bs].data, self.state[bs].data) for bs in self.state}

    def __getstate__(self) -> dict[str, object]:  # memoryviews do not pickle or copy
        return {k: v for k, v in self.__dict__.items() if not k.endswith("_mvs")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._views()

    def admit_many(self, rows: list[int], plans: Sequence[PlannedChain]) -> None:
        """Requests take ``rows``: with ``plans[i]``'s root, seed, keys and states, nothing is
        registered yet, every group's parent is the root; per block size ``bs`` the prompt's
        keys ``keys[bs]`` (uint64) are keyed, the chain state after them being
        ``states[bs][-1]`` (the seed where there is none)."""
        start_mvs, set_mvs = self._start_mvs, self._set_mvs
        for row, plan in zip(rows, plans):
            root, seed, states = plan.root, plan.seed, plan.states
            for num_hashed, parent_cid in start_mvs:
                num_hashed[row] = 0
                parent_cid[row] = root
            for bs, bs_keys in plan.keys.items():
                n = len(bs_keys)
                num_keys_mv, state_mv = set_mvs[bs]
                num_keys_mv[row] = n
                state_mv[row] = states[bs].item(n - 1) if n else seed

    def group_views(self, group: int) -> tuple[memoryview, memoryview]:
        """``num_hashed[group]`` and ``parent_cid[group]`` as memoryviews (scalar writes of
        Python ints)."""
        return self._start_mvs[group]

    def copy_row(self, src: int, dst: int) -> None:
        """Row ``dst`` continues the chains of row ``src`` (a fork)."""
        for num_hashed, parent_cid in zip(self.num_hashed, self.parent_cid):
            num_hashed[dst] = num_hashed[src]
            parent_cid[dst] = parent_cid[src]
        for bs in self.num_keys:
            self.num_keys[bs][dst] = self.num_keys[bs][src]
            self.state[bs][dst] = self.state[bs][src]
