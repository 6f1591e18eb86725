"""Prefill/decode disaggregation: move a request's KV blocks from one engine to another.

- :mod:`~blocktable.transfer.kv_layout`: the cache facts both sides must share (handshake);
- :mod:`~blocktable.transfer.transport`: the wire (:class:`Transport`), over
  ``torch.distributed`` point-to-point (gloo on the CPU, NCCL on GPUs);
- :mod:`~blocktable.transfer.plan`: which cache rows move, mapped through token positions;
- :mod:`~blocktable.transfer.buffers`: the gather into a reusable staging buffer, sent in
  pieces, and the scatter;
- :mod:`~blocktable.transfer.prefill_side` / :mod:`~blocktable.transfer.decode_side`: the two sides;
- :mod:`~blocktable.transfer.dcp_transfer`: a context-parallel decode side, each rank receiving
  only the chunks it owns;
- :mod:`~blocktable.transfer.messages`: what they say to each other each round;
- :mod:`~blocktable.transfer.prompt_arena`: the prefill side's submitted prompts, back to back
  in one buffer;
- :mod:`~blocktable.transfer.wire_format`: how a message travels (a fixed int64 header, its
  small arrays and strings in one buffer, its large arrays as they are).

See ``docs/disaggregation.md``.
"""

from __future__ import annotations

from blocktable.transfer.decode_side import DecodeStats, DecodeWorker, TransferRecord
from blocktable.transfer.kv_handshake import handshake
from blocktable.transfer.kv_layout import KVCacheLayout, check_compatible
from blocktable.transfer.local import QueueTransport, local_pair
from blocktable.transfer.plan import (
    chunk_rows,
    chunk_rows_many,
    chunk_tokens_of,
    dcp_chunk_rows_many,
)
from blocktable.transfer.prefill_side import PrefillStats, PrefillWorker
from blocktable.transfer.transfer_errors import HandshakeError, PeerLostError, TransferError
from blocktable.transfer.transport import TorchDistributedTransport, Transport

__all__ = [
    "DecodeStats",
    "DecodeWorker",
    "HandshakeError",
    "KVCacheLayout",
    "PeerLostError",
    "PrefillStats",
    "PrefillWorker",
    "QueueTransport",
    "TorchDistributedTransport",
    "TransferError",
    "TransferRecord",
    "Transport",
    "check_compatible",
    "chunk_rows",
    "chunk_rows_many",
    "chunk_tokens_of",
    "dcp_chunk_rows_many",
    "handshake",
    "local_pair",
]
