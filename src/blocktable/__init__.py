"""blocktable: paged KV-cache block tables, slot mapping and allocator for LLM inference.

Data flow of one step: allocator -> table (host) -> commit -> slot mapping (device) ->
consumers (KV write, paged attention). ``docs/integration.md`` shows where each call goes.

The names below are imported on first use, so ``import blocktable`` (and the ``blocktable``
command's ``--help``) does not import torch; ``from blocktable import MultiGroupBlockTable``
does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "AllocatorGroupSpec": "blocktable.allocator",
    "KVCacheManager": "blocktable.allocator",
    "OutOfBlocksError": "blocktable.allocator",
    "OutOfRowsError": "blocktable.allocator",
    "PagedAttention": "blocktable.attention",
    "paged_attention": "blocktable.attention",
    "paged_attention_reference": "blocktable.attention",
    "paged_decode_attention": "blocktable.attention",
    "CommitStats": "blocktable.commit",
    "AttentionMerger": "blocktable.context_parallel",
    "merge_attention_reference": "blocktable.context_parallel",
    "GroupLayout": "blocktable.group_layout",
    "CPConfig": "blocktable.config",
    "GroupKind": "blocktable.config",
    "GroupSpec": "blocktable.config",
    "row_width": "blocktable.config",
    "NULL_BLOCK_ID": "blocktable.constants",
    "PAD_SLOT_ID": "blocktable.constants",
    "flashinfer_indptr_host": "blocktable.flashinfer",
    "flashinfer_page_table_host": "blocktable.flashinfer",
    "write_flashinfer_page_table": "blocktable.flashinfer",
    "write_kv_cache": "blocktable.kv_write",
    "AttentionMetadata": "blocktable.metadata",
    "MultiGroupBlockTable": "blocktable.multi_group",
    "SlotMappingError": "blocktable.slot_mapping",
    "slot_mapping_reference": "blocktable.slot_mapping",
    "CapturedStep": "blocktable.step",
    "BlockTable": "blocktable.single_group",
    "RowBlocks": "blocktable.update",
    "RowEntries": "blocktable.update",
    "StepUpdate": "blocktable.update",
}

__all__ = [
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "AllocatorGroupSpec",
    "AttentionMerger",
    "AttentionMetadata",
    "BlockTable",
    "CPConfig",
    "CapturedStep",
    "CommitStats",
    "GroupKind",
    "GroupLayout",
    "GroupSpec",
    "KVCacheManager",
    "MultiGroupBlockTable",
    "OutOfBlocksError",
    "OutOfRowsError",
    "PagedAttention",
    "RowBlocks",
    "RowEntries",
    "SlotMappingError",
    "StepUpdate",
    "flashinfer_indptr_host",
    "flashinfer_page_table_host",
    "merge_attention_reference",
    "paged_attention",
    "paged_attention_reference",
    "paged_decode_attention",
    "row_width",
    "slot_mapping_reference",
    "write_flashinfer_page_table",
    "write_kv_cache",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'blocktable' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # what type checkers and IDEs see
    from blocktable.allocator import (
        AllocatorGroupSpec,
        KVCacheManager,
        OutOfBlocksError,
        OutOfRowsError,
    )
    from blocktable.attention import (
        PagedAttention,
        paged_attention,
        paged_attention_reference,
        paged_decode_attention,
    )
    from blocktable.commit import CommitStats
    from blocktable.config import CPConfig, GroupKind, GroupSpec, row_width
    from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID
    from blocktable.context_parallel import AttentionMerger, merge_attention_reference
    from blocktable.flashinfer import (
        flashinfer_indptr_host,
        flashinfer_page_table_host,
        write_flashinfer_page_table,
    )
    from blocktable.group_layout import GroupLayout
    from blocktable.kv_write import write_kv_cache
    from blocktable.metadata import AttentionMetadata
    from blocktable.multi_group import MultiGroupBlockTable
    from blocktable.single_group import BlockTable
    from blocktable.slot_mapping import SlotMappingError, slot_mapping_reference
    from blocktable.step import CapturedStep
    from blocktable.update import RowBlocks, RowEntries, StepUpdate
