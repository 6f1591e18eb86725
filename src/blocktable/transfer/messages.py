"""What the two sides say to each other, one round at a time.

A round: the prefill side sends a :class:`Round` (an :class:`OfferBatch` of requests ready to
move, or ``done``); the decode side answers a :class:`PlanBatch` (per offer: send these rows,
wait, or refused); for the offers to send the prefill side sends a :class:`DataHeader` and one
buffer; the decode side answers an :class:`Ack`.

Batches are a few flat numpy arrays, not an object per request: they pickle as a few buffers.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class PlanStatus(enum.IntEnum):
    SEND = 0  # blocks allocated on the decode side: send these rows
    WAIT = 1  # the decode side is full now; offer it again later
    REFUSED = 2  # it can never fit on the decode side: the prefill side drops it


@dataclass(frozen=True, eq=False)
class Offer:
    """A request whose prompt is prefilled and whose first token is sampled."""

    req_id: str
    prompt_token_ids: np.ndarray  # on cpu, int64 [num_prompt_tokens]
    first_token: int
    max_new_tokens: int
    block_ids: np.ndarray  # on cpu, int32 [num_blocks]: the prefill side's, in token order


def _starts(lengths: Sequence[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


@dataclass(frozen=True, eq=False)
class OfferBatch:
    """Offers flattened: request ``i``'s prompt is ``prompt_token_ids[prompt_starts[i] :
    prompt_starts[i + 1]]``, its blocks ``block_ids[block_starts[i] : block_starts[i + 1]]``."""

    req_ids: tuple[str, ...]
    prompt_token_ids: np.ndarray  # on cpu, int64 [total prompt tokens]
    prompt_starts: np.ndarray  # on cpu, int64 [num_reqs + 1]
    first_tokens: np.ndarray  # on cpu, int64 [num_reqs]
    max_new_tokens: np.ndarray  # on cpu, int64 [num_reqs]
    block_ids: np.ndarray  # on cpu, int32 [total blocks]
    block_starts: np.ndarray  # on cpu, int64 [num_reqs + 1]

    @classmethod
    def of(cls, offers: Sequence[Offer]) -> OfferBatch:
        if not offers:
            empty = np.zeros(0, dtype=np.int64)
            return cls((), empty, np.zeros(1, np.int64), empty, empty,
                       np.zeros(0, np.int32), np.zeros(1, np.int64))
        return cls(
            tuple(o.req_id for o in offers),
            np.concatenate([o.prompt_token_ids for o in offers]),
            _starts([o.prompt_token_ids.size for o in offers]),
            np.array([o.first_token for o in offers], dtype=np.int64),
            np.array([o.max_new_tokens for o in offers], dtype=np.int64),
            np.concatenate([o.block_ids for o in offers]),
            _starts([o.block_ids.size for o in offers]),
        )

    def __len__(self) -> int:
        return len(self.req_ids)

    def offer(self, i: int) -> Offer:
        """Request ``i`` (views into the batch's arrays)."""
        p, b = self.prompt_starts, self.block_starts
        return Offer(self.req_ids[i], self.prompt_token_ids[p[i]:p[i + 1]],
                     int(self.first_tokens[i]), int(self.max_new_tokens[i]),
                     self.block_ids[b[i]:b[i + 1]])


@dataclass(frozen=True, eq=False)
class PlanBatch:
    """The decode side's answer to an :class:`OfferBatch`, in its order."""

    statuses: np.ndarray  # on cpu, int8 [num_reqs]: PlanStatus values
    src_rows: np.ndarray  # on cpu, int64 [total chunks]: the SEND offers' prefill rows, in order
    num_blocks: np.ndarray  # on cpu, int64 [num_reqs]: decode blocks each SEND offer fills
    reasons: dict[int, str]  # offer index -> why it was refused


@dataclass(frozen=True)
class Round:
    offers: OfferBatch
    done: bool  # nothing left on the prefill side: the decode side finishes alone


@dataclass(frozen=True)
class DataHeader:
    """Which of the planned requests the buffer holds, in plan order; ``failed`` ones were not
    gathered (the decode side recomputes them)."""

    sent: tuple[str, ...]
    failed: tuple[str, ...]
    rows_per_piece: int = 1  # the buffer comes in pieces of this many chunk rows


@dataclass(frozen=True)
class Ack:
    received: tuple[str, ...]
