"""What the two sides say to each other, one round at a time.

A round: the prefill side sends a :class:`Round` (requests ready to move, or ``done``); the
decode side answers one :class:`Plan` per offer; for the plans that say ``SEND`` the prefill
side sends a :class:`DataHeader` and one buffer; the decode side answers an :class:`Ack`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PlanStatus(str, enum.Enum):
    SEND = "send"  # blocks allocated on the decode side: send these rows
    WAIT = "wait"  # the decode side is full now; offer it again later
    REFUSED = "refused"  # it can never fit on the decode side: the prefill side drops it


@dataclass(frozen=True)
class Offer:
    """A request whose prompt is prefilled and whose first token is sampled."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    first_token: int
    max_new_tokens: int
    block_ids: tuple[int, ...]  # the prefill side's manager block ids, in token order


@dataclass(frozen=True)
class Plan:
    """The decode side's answer to one offer."""

    req_id: str
    status: PlanStatus
    src_rows: tuple[int, ...] = ()  # prefill cache chunk rows to send, in this order
    num_blocks: int = 0  # decode-side blocks the rows fill
    reason: str = ""


@dataclass(frozen=True)
class Round:
    offers: tuple[Offer, ...]
    done: bool  # nothing left on the prefill side: the decode side finishes alone


@dataclass(frozen=True)
class DataHeader:
    """Which of the planned requests the buffer holds, in plan order; ``failed`` ones were not
    gathered (the decode side recomputes them)."""

    sent: tuple[str, ...]
    failed: tuple[str, ...]


@dataclass(frozen=True)
class Ack:
    received: tuple[str, ...]
