"""blocktable: paged KV-cache block tables, slot mapping and allocator for LLM inference.

Data flow of one step (SPEC §4): allocator -> table (host) -> commit -> slot mapping (device)
-> consumers (KV write, paged attention).
"""

from __future__ import annotations

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager, OutOfBlocksError
from blocktable.attention import paged_attention_reference, paged_decode_attention
from blocktable.commit import CommitStats
from blocktable.config import CPConfig, GroupKind, GroupSpec, row_width
from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from blocktable.flashinfer import (
    flashinfer_indptr_host,
    flashinfer_page_table_host,
    write_flashinfer_page_table,
)
from blocktable.group_layout import GroupLayout
from blocktable.kv_write import write_kv_cache
from blocktable.metadata import AttentionMetadata
from blocktable.multi_group import MultiGroupBlockTable
from blocktable.slot_mapping import SlotMappingError, slot_mapping_reference
from blocktable.table import BlockTable
from blocktable.update import RowBlocks, RowEntries, StepUpdate

__version__ = "0.1.0"

__all__ = [
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "AllocatorGroupSpec",
    "AttentionMetadata",
    "BlockTable",
    "CPConfig",
    "CommitStats",
    "GroupKind",
    "GroupLayout",
    "GroupSpec",
    "KVCacheManager",
    "MultiGroupBlockTable",
    "OutOfBlocksError",
    "RowBlocks",
    "RowEntries",
    "SlotMappingError",
    "StepUpdate",
    "flashinfer_indptr_host",
    "flashinfer_page_table_host",
    "paged_attention_reference",
    "paged_decode_attention",
    "row_width",
    "slot_mapping_reference",
    "write_flashinfer_page_table",
    "write_kv_cache",
]
