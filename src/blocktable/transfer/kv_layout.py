"""The KV-cache facts two sides must agree on before any block moves."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from blocktable.transfer.transfer_errors import HandshakeError

CACHE_LAYOUT = "layer,kv,block,token,kv_head,head_dim"
"""The engine's cache order (:class:`blocktable.engine.PagedLlama`'s ``kv_cache``)."""

MUST_MATCH = ("cache_layout", "num_layers", "num_kv_heads", "head_dim", "dtype")
"""Fields that must be equal on both sides. Block sizes may differ: the transfer maps tokens
through each side's own slot formula, so they are exchanged and checked only for sense."""


@dataclass(frozen=True)
class KVCacheLayout:
    """One side's KV cache as the other side needs to know it.

    Attributes
    ----------
    num_layers, num_kv_heads, head_dim : int
        The model's attention geometry.
    dtype : str
        The cache's torch dtype, e.g. ``"torch.float32"``.
    block_size : int
        Tokens per manager block: what the allocator's block ids count.
    kernel_block_size : int
        Tokens per physical block of the cache (divides ``block_size``).
    cache_layout : str
        Dimension order of the cache tensor.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    kernel_block_size: int
    cache_layout: str = CACHE_LAYOUT

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "kernel_block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.block_size % self.kernel_block_size:
            raise ValueError(
                f"kernel_block_size ({self.kernel_block_size}) must divide block_size "
                f"({self.block_size})"
            )

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor, block_size: int,
                 kernel_block_size: int | None = None) -> KVCacheLayout:
        """The layout of a cache ``[num_layers, 2, num_kernel_blocks, kernel_block_size,
        num_kv_heads, head_dim]``."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                "kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, "
                f"head_dim], got shape {tuple(kv_cache.shape)}"
            )
        num_layers, _, _, cache_block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(int(num_layers), int(num_kv_heads), int(head_dim), str(kv_cache.dtype),
                   block_size, kernel_block_size or int(cache_block_size))

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer."""
        itemsize = torch.empty(0, dtype=getattr(torch, self.dtype.split(".")[-1])).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_compatible(local: KVCacheLayout, remote: KVCacheLayout, local_role: str,
                     remote_role: str) -> None:
    """Raise :class:`HandshakeError` naming the first field in :data:`MUST_MATCH` that
    differs, with both sides' values."""
    for field in MUST_MATCH:
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            raise HandshakeError(field, mine, theirs, local_role, remote_role)
