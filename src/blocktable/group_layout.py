"""One description of a KV cache group from which the allocator's and the table's specs follow.

Under context parallelism every rank holds the same block ids, and a physical block on a rank
holds that rank's share of a *virtual block* of ``block_size * world_size`` tokens. The
allocator counts tokens per virtual block, the table (and the KV cache) per physical block::

    block_size = 4, world = 2, interleave = 2        allocator block 7 = 8 tokens
    tokens 0..7 of block 7:   0  1  2  3  4  5  6  7
    owner rank:               0  0  1  1  0  0  1  1
    rank 0 physical block 7:  0  1  4  5      rank 1 physical block 7:  2  3  6  7

So the allocator's block size is the table's block size times the CP world (1 for groups the
CP does not shard). :class:`GroupLayout` builds both specs from one description, and
:func:`blocktable.config.check_update_block_sizes` is how a table refuses ids from an allocator
of another size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from blocktable._checks import check_positive
from blocktable.allocator.spec import AllocatorGroupSpec
from blocktable.config import CPConfig, GroupSpec, effective_cp


@dataclass(frozen=True)
class GroupLayout:
    """A KV cache group as seen by one rank: its physical blocks and how the CP shards them.

    Attributes
    ----------
    block_size : int
        Tokens per physical block on each rank: the table's (manager) block size.
    num_blocks : int
        Physical blocks per rank, the null block included; every rank holds the same ids.
    kernel_block_size : int or None
        Block size the attention kernel reads (divides ``block_size``); defaults to it.
    sliding_window : int or None
        Sliding-window attention width in tokens (the allocator releases blocks behind it).
    cp_sharded : bool
        Whether context parallelism shards this group's KV.

    Examples
    --------
    >>> from blocktable.config import CPConfig
    >>> layout = GroupLayout(block_size=16, num_blocks=1024)
    >>> layout.allocator_spec(CPConfig(world_size=2, rank=1)).block_size
    32
    >>> layout.table_spec().block_size
    16
    """

    block_size: int
    num_blocks: int
    kernel_block_size: int | None = None
    sliding_window: int | None = None
    cp_sharded: bool = True

    def __post_init__(self) -> None:
        check_positive("block_size", self.block_size)
        self.table_spec()  # validates kernel_block_size and num_blocks

    def table_spec(self) -> GroupSpec:
        """The table's spec: physical blocks of ``block_size`` tokens, ids below ``num_blocks``."""
        return GroupSpec(
            block_size=self.block_size,
            kernel_block_size=self.kernel_block_size,
            cp_sharded=self.cp_sharded,
            num_blocks=self.num_blocks,
        )

    def allocator_block_size(self, cp: CPConfig) -> int:
        """Tokens per allocator block: ``block_size`` times the CP world that shards this group."""
        return self.block_size * effective_cp(self.table_spec(), cp).world_size

    def allocator_spec(self, cp: CPConfig) -> AllocatorGroupSpec:
        """The allocator's spec: virtual blocks of ``block_size * world`` tokens, same ids."""
        return AllocatorGroupSpec(
            block_size=self.allocator_block_size(cp),
            num_blocks=self.num_blocks,
            sliding_window=self.sliding_window,
        )


def build_specs(
    layouts: Sequence[GroupLayout], cp: CPConfig
) -> tuple[list[AllocatorGroupSpec], list[GroupSpec]]:
    """The allocator's and the table's specs of every group, in group order."""
    return [lay.allocator_spec(cp) for lay in layouts], [lay.table_spec() for lay in layouts]
