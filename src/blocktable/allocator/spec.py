"""Configuration of one KV cache group as the allocator sees it."""

from __future__ import annotations

from dataclasses import dataclass

from blocktable._checks import check_positive


@dataclass(frozen=True)
class AllocatorGroupSpec:
    """One KV cache group: its block size, pool size and attention window.

    Attributes
    ----------
    block_size : int
        Manager block size, in tokens (the table may split it into smaller kernel blocks).
    num_blocks : int
        Blocks in this group's pool, *including* the null block 0, so ``num_blocks - 1`` can be
        handed out. At least 2.
    sliding_window : int or None
        Window in tokens for sliding-window attention (a token at position ``p`` attends to
        ``[p - sliding_window + 1, p]``); ``None`` for full attention.

    Examples
    --------
    >>> AllocatorGroupSpec(block_size=16, num_blocks=1024, sliding_window=4096)
    AllocatorGroupSpec(block_size=16, num_blocks=1024, sliding_window=4096)
    """

    block_size: int
    num_blocks: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        check_positive("block_size", self.block_size)
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(self.num_blocks).__name__}")
        if self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the reserved null block), "
                f"got {self.num_blocks}"
            )
        if self.sliding_window is not None:
            check_positive("sliding_window", self.sliding_window)
