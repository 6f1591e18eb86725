"""vLLM's block-table constructors, returning blocktable's objects.

A port from vLLM starts by changing one import: these functions take exactly the arguments of
vLLM's constructors, in vLLM's order, and build a :class:`blocktable.BlockTable` or
:class:`blocktable.MultiGroupBlockTable` of the same width. The objects are ours: their methods
are listed against vLLM's, with every behaviour that differs on purpose, in
``docs/porting_from_vllm.md``.

========================================  =================================================
vLLM                                      here
========================================  =================================================
v0.25.1 and 0.33 ``BlockTable``           :func:`BlockTable`
v0.25.1 ``MultiGroupBlockTable``          :func:`MultiGroupBlockTable`
0.33 ``MultiGroupBlockTable``             :func:`MultiGroupBlockTableV033`
========================================  =================================================

vLLM reads the context-parallel world from its own process groups. Here context parallelism
is on only when asked: pass ``cp=CPConfig(world_size, rank)`` (keyword-only; the interleave
comes from ``cp_kv_cache_interleave_size``).

Examples
--------
>>> from blocktable.compat import BlockTable
>>> bt = BlockTable(16, 4, 16, 64, False, "cpu", 16, 1)  # vLLM's positional form
>>> bt.width  # max_num_blocks_per_req: the width in blocks, as in vLLM
16
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from blocktable.config import CPConfig, GroupKind, GroupSpec
from blocktable.constants import ROW_ALIGN_TOKENS

if TYPE_CHECKING:
    import torch

    from blocktable.multi_group import MultiGroupBlockTable as _MultiGroupBlockTable
    from blocktable.single_group import BlockTable as _BlockTable

__all__ = ["BlockTable", "MultiGroupBlockTable", "MultiGroupBlockTableV033"]

_SLOT_MODES = {"token_to_kv_slot": GroupKind.ATTENTION, "none": GroupKind.STATE}


def BlockTable(  # vLLM's class name: a port changes only the import
    block_size: int,
    max_num_reqs: int,
    max_num_blocks_per_req: int,
    max_num_batched_tokens: int,
    pin_memory: bool,
    device: str | torch.device,
    kernel_block_size: int,
    cp_kv_cache_interleave_size: int,
    slot_mapping_mode: object = "token_to_kv_slot",
    *,
    cp: CPConfig | None = None,
) -> _BlockTable:
    """A single-group table from vLLM's ``BlockTable`` arguments (v0.25.1; 0.33 added
    ``slot_mapping_mode``).

    Parameters
    ----------
    block_size : int
        Manager block size in tokens.
    max_num_reqs : int
        Rows.
    max_num_blocks_per_req : int
        Row width in manager blocks, as in vLLM: ``width = max_num_blocks_per_req * k`` kernel
        blocks with ``k = block_size // kernel_block_size``. Our tables round every width up
        so a row spans a multiple of 128 tokens (16 blocks of 16 stay 16; 10 become 16).
    max_num_batched_tokens : int
        Length of the slot-mapping buffer.
    pin_memory : bool
        Accepted for the signature; the host buffer is pinned whenever CUDA is available.
    device : str or torch.device
        Where the device copy and the slot mapping live.
    kernel_block_size : int
        The attention kernel's block size; must divide ``block_size``.
    cp_kv_cache_interleave_size : int
        Tokens dealt to one context-parallel rank at a time (used only with ``cp``).
    slot_mapping_mode : str or enum
        ``"token_to_kv_slot"`` (attention) or ``"none"`` (Mamba-like state indices, no slot
        mapping); vLLM's ``SlotMappingMode`` members are accepted too.
    cp : CPConfig or None
        This rank's place in a context-parallel group; ``None``: no context parallelism.
    """
    from blocktable.single_group import BlockTable as _Table

    _check_bool("pin_memory", pin_memory)
    kind = _slot_kind("slot_mapping_mode", slot_mapping_mode)
    width = _positive("max_num_blocks_per_req", max_num_blocks_per_req)
    cp_config = _cp(cp, cp_kv_cache_interleave_size)
    if kind is GroupKind.STATE:
        spec = GroupSpec(block_size=block_size, kernel_block_size=kernel_block_size,
                         kind=kind, max_num_blocks=width)
        return _build([spec], max_num_reqs, max_num_batched_tokens, device, cp_config)[0]
    return _Table(
        block_size, max_num_reqs,
        max_num_batched_tokens=max_num_batched_tokens,
        device=device,
        kernel_block_size=kernel_block_size,
        max_num_blocks=width,
        cp=cp_config,
    )


def MultiGroupBlockTable(  # vLLM's class name
    max_num_reqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    pin_memory: bool,
    device: str | torch.device,
    block_sizes: Sequence[int],
    kernel_block_sizes: Sequence[int],
    num_speculative_tokens: int = 0,
    cp_kv_cache_interleave_size: int = 1,
    *,
    cp: CPConfig | None = None,
) -> _MultiGroupBlockTable:
    """All groups' tables from vLLM v0.25.1's ``MultiGroupBlockTable`` arguments.

    Each group's width is ``max(ceil(max_model_len / (block_size * cp_world)), 1 +
    num_speculative_tokens)`` manager blocks, rounded up so a row spans a multiple of 128
    tokens (to a multiple of ``128 // gcd(128, block_size)`` blocks), times ``k`` kernel blocks.
    ``pin_memory``, ``cp`` and the interleave are as in :func:`BlockTable`.
    """
    _check_bool("pin_memory", pin_memory)
    _positive("max_model_len", max_model_len)
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
        raise TypeError("num_speculative_tokens must be an int")
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    _same_length(block_sizes, kernel_block_sizes=kernel_block_sizes)
    cp_config = _cp(cp, cp_kv_cache_interleave_size)
    widths = [
        _align(max(-(-max_model_len // (_positive("block_sizes[i]", bs) * cp_config.world_size)),
                   1 + num_speculative_tokens), bs)
        for bs in block_sizes
    ]
    specs = [
        GroupSpec(block_size=bs, kernel_block_size=kbs, max_num_blocks=n)
        for bs, kbs, n in zip(block_sizes, kernel_block_sizes, widths)
    ]
    return _build(specs, max_num_reqs, max_num_batched_tokens, device, cp_config)


def MultiGroupBlockTableV033(  # vLLM's class name, with the version
    max_num_reqs: int,
    max_num_batched_tokens: int,
    pin_memory: bool,
    device: str | torch.device,
    block_sizes: Sequence[int],
    kernel_block_sizes: Sequence[int],
    max_num_blocks: Sequence[int],
    cp_kv_cache_interleave_size: int = 1,
    slot_mapping_modes: Sequence[object] | None = None,
    *,
    cp: CPConfig | None = None,
) -> _MultiGroupBlockTable:
    """All groups' tables from vLLM 0.33's ``MultiGroupBlockTable`` arguments.

    The caller gives each group's width in manager blocks (``max_num_blocks``), rounded up so
    a row spans a multiple of 128 tokens (vLLM leaves state groups, ``slot_mapping_modes``
    ``"none"``, unrounded; here every row is rounded), then times ``k`` kernel blocks.
    """
    _check_bool("pin_memory", pin_memory)
    modes = list(slot_mapping_modes) if slot_mapping_modes is not None else (
        ["token_to_kv_slot"] * len(block_sizes)
    )
    _same_length(block_sizes, kernel_block_sizes=kernel_block_sizes,
                 max_num_blocks=max_num_blocks, slot_mapping_modes=modes)
    specs = []
    for g, (bs, kbs, n, mode) in enumerate(zip(block_sizes, kernel_block_sizes, max_num_blocks,
                                               modes)):
        kind = _slot_kind(f"slot_mapping_modes[{g}]", mode)
        n = _positive(f"max_num_blocks[{g}]", n)
        width = _align(n, _positive(f"block_sizes[{g}]", bs))
        specs.append(GroupSpec(block_size=bs, kernel_block_size=kbs, kind=kind,
                               max_num_blocks=width))
    return _build(specs, max_num_reqs, max_num_batched_tokens, device,
                  _cp(cp, cp_kv_cache_interleave_size))


# ---- helpers -----------------------------------------------------------------------------
def _build(specs: list[GroupSpec], max_num_reqs: int, max_num_batched_tokens: int,
           device: str | torch.device, cp: CPConfig) -> _MultiGroupBlockTable:
    from blocktable.multi_group import MultiGroupBlockTable as _Multi

    return _Multi(specs, max_num_reqs, None, max_num_batched_tokens, device, cp=cp)


def _align(num_blocks: int, block_size: int) -> int:
    """Round ``num_blocks`` up so ``num_blocks * block_size`` is a multiple of 128 tokens."""
    align = ROW_ALIGN_TOKENS // math.gcd(ROW_ALIGN_TOKENS, block_size)
    return -(-num_blocks // align) * align


def _cp(cp: CPConfig | None, interleave: int) -> CPConfig:
    _positive("cp_kv_cache_interleave_size", interleave)
    if cp is None:
        return CPConfig(1, 0, interleave)
    if not isinstance(cp, CPConfig):
        raise TypeError(f"cp must be a CPConfig or None, got {type(cp).__name__}")
    if cp.interleave not in (1, interleave):
        raise ValueError(
            f"cp.interleave={cp.interleave} differs from cp_kv_cache_interleave_size="
            f"{interleave}: give the interleave once"
        )
    return CPConfig(cp.world_size, cp.rank, interleave)


def _slot_kind(name: str, mode: object) -> GroupKind:
    value = getattr(mode, "value", mode)
    if not isinstance(value, str) or value.lower() not in _SLOT_MODES:
        raise ValueError(f"{name} must be 'token_to_kv_slot' or 'none', got {mode!r}")
    return _SLOT_MODES[value.lower()]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _same_length(block_sizes: Sequence[int], **others: Sequence[object]) -> None:
    for name, seq in others.items():
        if len(seq) != len(block_sizes):
            raise ValueError(
                f"{name} has {len(seq)} entries but block_sizes has {len(block_sizes)}"
            )
