"""Configuration of a block table: context parallelism and one spec per KV cache group."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from blocktable._checks import check_positive
from blocktable.constants import ROW_ALIGN_TOKENS

if TYPE_CHECKING:
    from blocktable.update import StepUpdate

KERNEL_ID_LIMIT = 2**31
"""Kernel block ids are stored as int32: every kernel id lies in ``[0, KERNEL_ID_LIMIT)``."""


class GroupKind(str, Enum):
    """What a KV cache group's table is used for."""

    ATTENTION = "attention"
    """Token slots: the table maps positions to KV slots (full or sliding-window attention)."""
    STATE = "state"
    """Mamba-like state: the table holds state indices; no slot mapping."""
    ENCODER_ONLY = "encoder_only"
    """No table at all; attention gets a ``(num_reqs_padded, 1)`` zero placeholder."""


@dataclass(frozen=True)
class CPConfig:
    """Context parallelism: this rank's place among ``world_size`` ranks sharding the KV cache.

    A token belongs to rank ``(v // interleave) % world_size`` where ``v`` is its offset in its
    virtual block of ``manager_block_size * world_size`` tokens (``docs/layout.md``).
    """

    world_size: int = 1
    rank: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        check_positive("cp world_size", self.world_size)
        check_positive("cp interleave", self.interleave)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise TypeError(f"cp rank must be an int, got {type(self.rank).__name__}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"cp rank={self.rank} is out of range [0, world_size={self.world_size})"
            )

    @classmethod
    def from_dcp_pcp(
        cls,
        dcp_world_size: int = 1,
        dcp_rank: int = 0,
        pcp_world_size: int = 1,
        pcp_rank: int = 0,
        interleave: int = 1,
    ) -> CPConfig:
        """Combine decode-CP and prefill-CP: ``world = pcp*dcp``, ``rank = pcp_rank*dcp + dcp_rank``."""
        check_positive("dcp_world_size", dcp_world_size)
        check_positive("pcp_world_size", pcp_world_size)
        if not 0 <= dcp_rank < dcp_world_size:
            raise ValueError(f"dcp_rank={dcp_rank} is out of range [0, {dcp_world_size})")
        if not 0 <= pcp_rank < pcp_world_size:
            raise ValueError(f"pcp_rank={pcp_rank} is out of range [0, {pcp_world_size})")
        return cls(
            world_size=pcp_world_size * dcp_world_size,
            rank=pcp_rank * dcp_world_size + dcp_rank,
            interleave=interleave,
        )

    @classmethod
    def from_process_group(cls, group: object, interleave: int = 1) -> CPConfig:
        """World size and rank of ``group``, an initialized ``torch.distributed`` process group.

        The group is required: context parallelism is never read implicitly from the default
        process group (a tensor-parallel job would otherwise drop part of its KV). Pass
        ``torch.distributed.group.WORLD`` to shard over every process.

        Raises
        ------
        TypeError
            When ``group`` is ``None`` or not a ``torch.distributed.ProcessGroup``.
        RuntimeError
            When ``torch.distributed`` is not initialized.
        """
        import torch.distributed as dist

        if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                "group must be a torch.distributed.ProcessGroup (e.g. "
                f"torch.distributed.group.WORLD), got {type(group).__name__}"
            )
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: no process group to read")
        return cls(
            world_size=dist.get_world_size(group),
            rank=dist.get_rank(group),
            interleave=interleave,
        )


@dataclass(frozen=True, init=False)
class GroupSpec:
    """One KV cache group's table.

    Attributes
    ----------
    block_size : int
        Manager block size in tokens (the allocator's unit; block ids given to the table).
    kernel_block_size : int
        Block size the attention kernel reads; must divide ``block_size``. Given as ``None``
        (the default) it is ``block_size``. One manager block ``b`` becomes kernel blocks
        ``b*k .. b*k+k-1`` with ``k = block_size // kernel_block_size`` (the null block stays
        null).
    kind : GroupKind
        Token slots, state indices, or encoder-only (no table).
    cp_sharded : bool
        Whether context parallelism shards this group's KV (only then does CP apply to it).
    max_num_blocks : int or None
        Explicit row width in manager blocks; overrides the derivation from ``max_model_len``.
        Rounded up like the derived width, so a row spans a multiple of 128 tokens (some
        attention kernels need it): ``max_num_blocks=1875`` at ``block_size=64`` gives 1876.
    num_blocks : int or None
        Declared number of manager blocks in the pool; when given, ids must be in
        ``[0, num_blocks)``. See :attr:`block_id_bound`.
    """

    block_size: int
    kernel_block_size: int
    kind: GroupKind
    cp_sharded: bool
    max_num_blocks: int | None
    num_blocks: int | None

    def __init__(
        self,
        block_size: int,
        kernel_block_size: int | None = None,
        kind: GroupKind | str = GroupKind.ATTENTION,
        cp_sharded: bool = True,
        max_num_blocks: int | None = None,
        num_blocks: int | None = None,
    ) -> None:
        check_positive("block_size", block_size)
        if kernel_block_size is None:
            kernel_block_size = block_size
        check_positive("kernel_block_size", kernel_block_size)
        if block_size % kernel_block_size != 0:
            raise ValueError(
                f"kernel_block_size={kernel_block_size} must divide block_size={block_size}"
            )
        for name, value in (("block_size", block_size), ("kernel_block_size", kernel_block_size),
                            ("kind", GroupKind(kind)), ("cp_sharded", cp_sharded),
                            ("max_num_blocks", max_num_blocks), ("num_blocks", num_blocks)):
            object.__setattr__(self, name, value)
        if self.max_num_blocks is not None:
            check_positive("max_num_blocks", self.max_num_blocks)
        if self.num_blocks is not None:
            check_positive("num_blocks", self.num_blocks)
            limit = KERNEL_ID_LIMIT // self.blocks_per_manager_block
            if self.num_blocks > limit:
                raise ValueError(
                    f"num_blocks={self.num_blocks} exceeds {limit}, the most manager blocks whose "
                    f"kernel ids fit int32 (2**31 // {self.blocks_per_manager_block} kernel blocks "
                    "per manager block)"
                )

    @property
    def blocks_per_manager_block(self) -> int:
        """``k``: kernel blocks per manager block."""
        return self.block_size // self.kernel_block_size

    @property
    def block_id_bound(self) -> int:
        """Manager block ids lie in ``[0, block_id_bound)``: ``num_blocks`` when declared, else
        ``2**31 // k``, the largest bound whose kernel ids ``id*k .. id*k + k - 1`` fit the
        int32 table (``k`` kernel blocks per manager block). Slots ``kernel_id *
        kernel_block_size + offset`` are int64 and always fit."""
        if self.num_blocks is not None:
            return self.num_blocks
        return KERNEL_ID_LIMIT // self.blocks_per_manager_block

    @property
    def has_table(self) -> bool:
        return self.kind is not GroupKind.ENCODER_ONLY

    @property
    def has_slots(self) -> bool:
        return self.kind is GroupKind.ATTENTION


def effective_cp(spec: GroupSpec, cp: CPConfig) -> CPConfig:
    """The CP setting that applies to ``spec``: ``cp`` if the group is sharded, else world 1."""
    if spec.cp_sharded and spec.kind is GroupKind.ATTENTION:
        return cp
    return CPConfig(1, 0, 1)


def check_cp_for_group(spec: GroupSpec, cp: CPConfig) -> None:
    """Raise ``ValueError`` if the interleave does not divide the group's manager block size."""
    eff = effective_cp(spec, cp)
    if eff.world_size > 1 and spec.block_size % eff.interleave != 0:
        raise ValueError(
            f"cp interleave={eff.interleave} must divide block_size={spec.block_size}"
        )


def row_width(spec: GroupSpec, max_model_len: int, cp: CPConfig) -> int:
    """Row width in kernel blocks.

    ``ceil(max_model_len / (block_size * cp_world))`` manager blocks, or ``spec.max_num_blocks``
    when given, rounded up to a multiple of ``128 // gcd(128, block_size)`` so a row spans a
    multiple of 128 tokens, then times ``k``.
    """
    if spec.max_num_blocks is not None:
        manager_width = spec.max_num_blocks
    else:
        check_positive("max_model_len", max_model_len)
        world = effective_cp(spec, cp).world_size
        manager_width = -(-max_model_len // (spec.block_size * world))
    align = ROW_ALIGN_TOKENS // math.gcd(ROW_ALIGN_TOKENS, spec.block_size)
    manager_width = -(-manager_width // align) * align
    return manager_width * spec.blocks_per_manager_block


def check_update_block_sizes(
    specs: Sequence[GroupSpec], cp: CPConfig, update: StepUpdate
) -> None:
    """Raise ``ValueError`` unless ``update`` was built for the allocator block sizes of ``specs``.

    Group ``g`` expects ``specs[g].block_size * world`` tokens per allocator block, ``world``
    being the CP world when the group is sharded, else 1. Updates that carry no block sizes
    (``update.allocator_block_sizes is None``) pass.
    """
    sizes = update.allocator_block_sizes
    if sizes is None:
        return
    if len(sizes) != len(specs):
        raise ValueError(
            f"update.allocator_block_sizes has {len(sizes)} entries, the table has "
            f"{len(specs)} groups"
        )
    for g, (spec, size) in enumerate(zip(specs, sizes)):
        if spec.kind is GroupKind.ENCODER_ONLY:
            continue
        world = effective_cp(spec, cp).world_size
        if int(size) != spec.block_size * world:
            raise ValueError(
                f"group {g}: the update comes from an allocator with block_size={size}, but "
                f"this table has block_size={spec.block_size} and cp world_size={world}, so its "
                f"allocator must use block_size={spec.block_size} x {world} = "
                f"{spec.block_size * world} (build both with blocktable.group_layout.GroupLayout)"
            )
