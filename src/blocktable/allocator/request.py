"""Per-request bookkeeping of the manager (numpy rows and tokens), and token-id conversion."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from blocktable._checks import as_index_array

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
"""Token ids as the manager accepts them: a list/tuple of ints, an int array or tensor."""

_EMPTY_TOKENS = np.zeros(0, dtype=np.int64)
_EMPTY_ROW = np.zeros(0, dtype=np.int32)  # shared, never written (grown before a write)


def check_req_id(name: str, req_id: object) -> None:
    """Request ids are str or int (not bool)."""
    if isinstance(req_id, bool) or not isinstance(req_id, (str, int)):
        raise TypeError(f"{name} must be a str or int, got {type(req_id).__name__}")


def token_array(name: str, value: object) -> np.ndarray:
    """Token ids as an int64 array (1-D, on cpu); ``TypeError`` naming ``name`` if not integers.

    Accepts one int, lists and tuples of ints, 1-D integer numpy arrays and CPU integer
    tensors. (``struct.pack`` validates and converts a Python list in one C loop, faster than
    ``np.array``.) An int64 array is returned as is, not copied: callers copy what they keep.
    """
    if isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 1:
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = (int(value),)
    elif isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0:
        value = value.reshape(1)
    if isinstance(value, (list, tuple)):
        if not value:
            return _EMPTY_TOKENS
        try:
            return np.frombuffer(struct.pack(f"={len(value)}q", *value), dtype=np.int64)
        except struct.error as exc:
            raise TypeError(f"{name} must hold int64 token ids: {exc}") from None
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return as_index_array(name, value).astype(np.int64, copy=False)
    raise TypeError(
        f"{name} must be an int, list, tuple, numpy array or tensor of ints, "
        f"got {type(value).__name__}"
    )


def grown(buffer: np.ndarray, size: int) -> np.ndarray:
    """``buffer`` if it holds ``size`` entries, else a copy with room for at least ``size``
    (and some more: rows and sequences keep growing by a few entries per step)."""
    if len(buffer) >= size:
        return buffer
    new = np.zeros(max(size + (size >> 2) + 16, 2 * len(buffer)), dtype=buffer.dtype)
    new[: len(buffer)] = buffer
    return new


class RequestState:
    """What the manager knows about one running request.

    ``blocks(g)`` is the request's row in group ``g``: the first ``row_len[g]`` entries of the
    int32 buffer ``block_buf[g]``, manager block ids, logical block ``j`` at index ``j``
    (batched calls slice and concatenate these arrays, so a free or a step's journal is a few
    array operations); entries of sliding-window groups that left the window hold
    ``NULL_BLOCK_ID`` (always a prefix of the row, ``num_skipped_blocks[g]`` long). How many
    blocks are registered in the prefix index and where the key chain stands are kept per row
    in the manager's :class:`KeyChains`; ``parent_hashes[g]`` is the byte-chained hash of the
    last registered block of group ``g`` (only kept with byte hashes). ``keys[bs]`` and
    ``prompt_states[bs]`` are the block keys and key chain states of the prompt's full blocks
    for block size ``bs`` (computed at admission, read-only; the first
    ``num_prompt_tokens // bs`` blocks).
    """

    __slots__ = (
        "block_buf",
        "keys",
        "namespace",
        "namespace_bytes",
        "num_computed_tokens",
        "num_prompt_tokens",
        "num_skipped_blocks",
        "num_slots",
        "num_tokens",
        "parent_hashes",
        "prompt_states",
        "req_id",
        "root",
        "row",
        "row_len",
        "seed",
        "tokens",
    )

    def __init__(
        self,
        req_id: str | int,
        tokens: np.ndarray,
        namespace: object,
        namespace_bytes: bytes,
        root: int,
        num_groups: int,
        seed: int = 0,
    ) -> None:
        self.req_id = req_id
        self.row = -1  # set by the manager
        self.tokens = tokens  # on cpu, int64 [capacity]; the first num_tokens are the ids
        self.num_tokens = len(tokens)
        self.namespace = namespace
        self.namespace_bytes = namespace_bytes
        self.root = root  # parent content id of the first block (negative: the namespace)
        self.seed = seed  # key chain state before the first block (the namespace's)
        self.num_computed_tokens = 0
        self.num_slots = 0  # tokens the allocated blocks of every group can hold
        self.block_buf = [_EMPTY_ROW] * num_groups  # on cpu, int32 [capacity] per group
        self.row_len = [0] * num_groups  # manager blocks in the row of each group
        self.num_skipped_blocks = [0] * num_groups
        self.parent_hashes: list[bytes] = [b""] * num_groups
        self.keys: dict[int, np.ndarray] = {}  # block size -> uint64 [capacity]
        self.prompt_states: dict[int, np.ndarray] = {}  # block size -> uint64 [full blocks]
        self.num_prompt_tokens = len(tokens)  # tokens at admission (keys[bs] covers them)

    def blocks(self, group: int) -> np.ndarray:
        """The row of ``group``: int32 ``[row_len[group]]``, a view of the buffer."""
        return self.block_buf[group][: self.row_len[group]]

    def append_blocks(self, group: int, block_ids: np.ndarray) -> None:
        """Append ``block_ids`` (int32) to the row of ``group``."""
        n, k = self.row_len[group], len(block_ids)
        buf = self.block_buf[group]
        if len(buf) < n + k:
            buf = self.block_buf[group] = grown(buf, n + k)
        buf[n : n + k] = block_ids
        self.row_len[group] = n + k

    def append_block(self, group: int, block_id: int) -> None:
        """Append one id to the row of ``group`` (the decode path)."""
        n = self.row_len[group]
        buf = self.block_buf[group]
        if len(buf) <= n:
            buf = self.block_buf[group] = grown(buf, n + 1)
        buf[n] = block_id
        self.row_len[group] = n + 1

    def set_blocks(self, group: int, block_ids: np.ndarray) -> None:
        """Make ``block_ids`` (int32, a new array the request keeps) the row of ``group``."""
        self.block_buf[group] = block_ids
        self.row_len[group] = len(block_ids)

    def token_ids(self) -> list[int]:
        """The token ids as a list (for tests and debugging)."""
        return self.tokens[: self.num_tokens].tolist()

    def append_tokens(self, new: np.ndarray) -> None:
        n = self.num_tokens
        tokens = self.tokens = grown(self.tokens, n + len(new))
        tokens[n : n + len(new)] = new
        self.num_tokens = n + len(new)

    def fork(self, req_id: str | int) -> RequestState:
        """A copy under a new id, without a row and blocks (the caller fills them)."""
        child = RequestState(
            req_id,
            self.tokens[: self.num_tokens].copy(),
            self.namespace,
            self.namespace_bytes,
            self.root,
            len(self.block_buf),
            self.seed,
        )
        child.num_computed_tokens = self.num_computed_tokens
        child.num_skipped_blocks = list(self.num_skipped_blocks)
        child.parent_hashes = list(self.parent_hashes)
        child.keys = dict(self.keys)  # read-only arrays
        child.prompt_states = dict(self.prompt_states)
        child.num_prompt_tokens = self.num_prompt_tokens
        return child


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

    def start(self, row: int, root: int) -> None:
        """A request takes ``row``: nothing registered yet, every group's parent is ``root``."""
        for num_hashed, parent_cid in zip(self.num_hashed, self.parent_cid):
            num_hashed[row] = 0
            parent_cid[row] = root

    def set(self, row: int, bs: int, num_keys: int, state: int) -> None:
        self.num_keys[bs][row] = num_keys
        self.state[bs][row] = state

    def copy_row(self, src: int, dst: int) -> None:
        """Row ``dst`` continues the chains of row ``src`` (a fork)."""
        for num_hashed, parent_cid in zip(self.num_hashed, self.parent_cid):
            num_hashed[dst] = num_hashed[src]
            parent_cid[dst] = parent_cid[src]
        for bs in self.num_keys:
            self.num_keys[bs][dst] = self.num_keys[bs][src]
            self.state[bs][dst] = self.state[bs][src]
