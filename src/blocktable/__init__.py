"""blocktable: paged KV-cache block tables, slot mapping and allocator for LLM inference.

Data flow of one step (SPEC §4): allocator -> table (host) -> commit -> slot mapping (device)
-> consumers (KV write, paged attention).
"""

from __future__ import annotations

from blocktable.commit import CommitStats
from blocktable.config import CPConfig, GroupKind, GroupSpec, row_width
from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from blocktable.multi_group import MultiGroupBlockTable
from blocktable.slot_mapping import SlotMappingError, slot_mapping_reference
from blocktable.table import BlockTable
from blocktable.update import RowBlocks, RowEntries, StepUpdate

__version__ = "0.1.0"

__all__ = [
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "BlockTable",
    "CPConfig",
    "CommitStats",
    "GroupKind",
    "GroupSpec",
    "MultiGroupBlockTable",
    "RowBlocks",
    "RowEntries",
    "SlotMappingError",
    "StepUpdate",
    "row_width",
    "slot_mapping_reference",
]
