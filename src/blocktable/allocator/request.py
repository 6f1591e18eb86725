"""Per-request bookkeeping of the manager, and the conversion of token ids."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from blocktable._checks import as_index_array
from blocktable.allocator.hashing import ROOT_BLOCK_HASH, encode_namespace

TOKEN_BYTES = 8  # token ids are stored and hashed as little-endian int64

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
"""Token ids as the manager accepts them: a list/tuple of ints, an int array or tensor."""


def check_req_id(name: str, req_id: object) -> None:
    """Request ids are str or int (not bool)."""
    if isinstance(req_id, bool) or not isinstance(req_id, (str, int)):
        raise TypeError(f"{name} must be a str or int, got {type(req_id).__name__}")


def token_bytes(name: str, value: object) -> bytes:
    """Token ids as little-endian int64 bytes; ``TypeError`` naming ``name`` if not integers.

    Accepts one int, lists and tuples of ints, 1-D integer numpy arrays and CPU integer
    tensors. (``struct.pack`` validates and converts a Python list in one C loop.)
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = (int(value),)
    elif isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0:
        value = value.reshape(1)
    if isinstance(value, (list, tuple)):
        try:
            return struct.pack(f"<{len(value)}q", *value)
        except struct.error as exc:
            raise TypeError(f"{name} must hold int64 token ids: {exc}") from None
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return as_index_array(name, value).astype("<i8", copy=False).tobytes()
    raise TypeError(
        f"{name} must be an int, list, tuple, numpy array or tensor of ints, "
        f"got {type(value).__name__}"
    )


def block_token_bytes(tokens: bytearray, block_size: int, first: int, stop: int) -> list[bytes]:
    """The token bytes of full blocks ``first .. stop-1``."""
    step = block_size * TOKEN_BYTES
    with memoryview(tokens) as view:
        return [view[i * step : (i + 1) * step].tobytes() for i in range(first, stop)]


class RequestState:
    """What the manager knows about one running request.

    ``blocks[g]`` is the request's row in group ``g``: manager block ids, logical block ``j`` at
    index ``j``; entries of sliding-window groups that left the window hold ``NULL_BLOCK_ID``
    (always a prefix of the row, ``num_skipped_blocks[g]`` long). The first
    ``num_hashed_blocks[g]`` blocks are full, computed and in the prefix index (when caching is
    on); ``parent_prefixes[g]``/``parent_hashes[g]`` name the content of the last of them (the
    parent part of the next block's cache key) and its hash.
    """

    __slots__ = (
        "blocks",
        "namespace",
        "namespace_bytes",
        "num_computed_tokens",
        "num_hashed_blocks",
        "num_skipped_blocks",
        "num_slots",
        "parent_hashes",
        "parent_prefixes",
        "req_id",
        "row",
        "tokens",
    )

    def __init__(
        self, req_id: str | int, tokens: bytearray, namespace: object, num_groups: int
    ) -> None:
        self.req_id = req_id
        self.row = -1  # set by the manager
        self.tokens = tokens  # on cpu, little-endian int64 [num_tokens], as bytes
        self.namespace = namespace
        self.namespace_bytes = encode_namespace(namespace)
        self.num_computed_tokens = 0
        self.num_slots = 0  # tokens the allocated blocks of every group can hold
        self.blocks: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_skipped_blocks = [0] * num_groups
        self.num_hashed_blocks = [0] * num_groups
        # hashing.root_prefix, without encoding the namespace a second time
        self.parent_prefixes = [b"R" + self.namespace_bytes] * num_groups
        self.parent_hashes = [ROOT_BLOCK_HASH] * num_groups

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    def token_ids(self) -> list[int]:
        """The token ids as a list (for tests and debugging)."""
        return np.frombuffer(self.tokens, dtype="<i8").tolist()

    def fork(self, req_id: str | int) -> RequestState:
        """A copy under a new id, without a row (blocks copied as lists; refs are the caller's)."""
        child = RequestState(req_id, bytearray(self.tokens), self.namespace, 0)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_slots = self.num_slots
        child.blocks = [list(b) for b in self.blocks]
        child.num_skipped_blocks = list(self.num_skipped_blocks)
        child.num_hashed_blocks = list(self.num_hashed_blocks)
        child.parent_prefixes = list(self.parent_prefixes)
        child.parent_hashes = list(self.parent_hashes)
        return child
