"""What the two sides say to each other, one round at a time.

A round is one message each way: the prefill side sends an :class:`OfferBatch` (the
requests ready to move, and ``done``); the decode side answers a
:class:`PlanBatch` (per offer: send its tokens from the first one this side's prefix cache
lacks, wait, or refused; and how many requests of the previous round's data arrived). For the
offers to send, the prefill side maps those tokens to its own cache rows and sends the data:
:func:`data_status` and the buffer's pieces, tensors only.

Batches are a few flat numpy arrays, not an object per request: on the wire they are those
arrays as int64 words and the request ids' text, in a fixed binary form
(:mod:`~blocktable.transfer.wire_format`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from blocktable.transfer.wire_format import register_message

_NO_INDEX = np.zeros(0, dtype=np.int64)
_NO_INDEX.flags.writeable = False


class PlanStatus(enum.IntEnum):
    SEND = 0  # blocks allocated on the decode side: send these rows
    WAIT = 1  # the decode side is full now; offer it again later
    REFUSED = 2  # it can never fit on the decode side: the prefill side drops it


@register_message(1)
@dataclass(eq=False, slots=True)  # (not frozen: a frozen __init__ sets each field by a call)
class OfferBatch:
    """Requests ready to move, one array per field: request ``i``'s token ids (its prompt,
    then the first token the prefill side sampled) are ``token_ids[token_starts[i] :
    token_starts[i + 1]]``.

    A request's stopping rules travel with it: ``max_new_tokens`` and its stop tokens,
    ``stop_token_ids[stop_starts[i] : stop_starts[i + 1]]`` (``stop_starts`` is ``None`` when
    no request of the batch has any).

    The token ids are int64, the dtype the decode side's allocator reads without a copy. The
    prefill side's block ids do not travel: it maps the tokens the plan asks for to its own
    rows. ``done``: nothing is left on the prefill side after these (the decode side finishes
    alone)."""

    WIRE_NUM_ARRAYS = 5

    req_ids: tuple[str, ...]
    token_ids: np.ndarray  # on cpu, int64 [total tokens]: each prompt, then its first token
    token_starts: np.ndarray  # on cpu, int64 [num_reqs + 1]
    max_new_tokens: np.ndarray  # on cpu, int64 [num_reqs]
    # on cpu, int64 [total stop tokens]; int64 [num_reqs + 1] or None (no request has any)
    stop_token_ids: np.ndarray = field(default_factory=lambda: _NO_INDEX)
    stop_starts: np.ndarray | None = None
    done: bool = False

    @classmethod
    def empty(cls, done: bool = False) -> OfferBatch:
        none = np.zeros(0, dtype=np.int64)
        return cls((), none, np.zeros(1, dtype=np.int64), none, done=done)

    def __len__(self) -> int:
        return len(self.req_ids)

    @property
    def num_prompt_tokens(self) -> np.ndarray:
        """int64 ``[num_reqs]``: each prompt's length (its first token excluded)."""
        starts = self.token_starts
        num = starts[1:] - starts[:-1]
        num -= 1
        return num

    @property
    def first_tokens(self) -> np.ndarray:
        """int64 ``[num_reqs]``: the token each request's decode starts from."""
        return self.token_ids[self.token_starts[1:] - 1]

    def prompt(self, i: int) -> np.ndarray:
        """Request ``i``'s prompt (a view)."""
        return self.token_ids[self.token_starts[i]:self.token_starts[i + 1] - 1]

    def stops(self, index: np.ndarray | None = None) -> list[frozenset[int]]:
        """The stop tokens of the requests at ``index`` (``None``: all), in that order."""
        rows = range(len(self.req_ids)) if index is None else index.tolist()
        starts = self.stop_starts
        if starts is None:
            return [frozenset()] * len(rows)
        ids = self.stop_token_ids.tolist()
        bounds = starts.tolist()
        return [frozenset(ids[bounds[i]:bounds[i + 1]]) for i in rows]

    def to_wire(self) -> tuple[tuple[np.ndarray, ...], tuple[str, ...], int]:
        starts = _NO_INDEX if self.stop_starts is None else self.stop_starts
        return ((self.token_ids, self.token_starts, self.max_new_tokens, self.stop_token_ids,
                 starts), self.req_ids, int(self.done))

    @classmethod
    def from_wire(cls, arrays: list[np.ndarray], texts: list[str], value: int = 0
                  ) -> OfferBatch:
        """The batch again; raises ``ValueError`` naming the first field whose length does
        not fit the others (a malformed message)."""
        n = len(texts)
        if len(arrays) != 5:
            raise ValueError(f"malformed OfferBatch of {n} requests: {len(arrays)} arrays, 5 "
                             "expected")
        token_ids, token_starts, max_new_tokens, stop_ids, stop_starts = arrays
        rest, done = tuple(texts), bool(value)
        if (not stop_starts.size and not stop_ids.size  # the usual round: no stop tokens
                and token_starts.size == n + 1 and max_new_tokens.size == n
                and token_ids.size == token_starts.item(-1)):
            return cls(rest, token_ids, token_starts, max_new_tokens, done=done)
        checks: list[tuple[str, np.ndarray, int | np.ndarray]] = [
            ("token_starts", token_starts, n + 1), ("max_new_tokens", max_new_tokens, n),
            ("token_ids", token_ids, token_starts[-1:])]
        if stop_starts.size:
            checks += [("stop_starts", stop_starts, n + 1),
                       ("stop_token_ids", stop_ids, stop_starts[-1:])]
        else:
            checks.append(("stop_token_ids", stop_ids, 0))
        for name, array, size in checks:  # the offsets' length is checked before they count
            want = size if isinstance(size, int) else int(size.sum())
            if array.size != want:
                raise ValueError(f"malformed OfferBatch of {n} requests: {name} holds "
                                 f"{array.size} entries, {want} expected")
        return cls(rest, token_ids, token_starts, max_new_tokens, stop_ids,
                   stop_starts if stop_starts.size else None, done)


@register_message(2)
@dataclass(eq=False, slots=True)  # (not frozen: a frozen __init__ sets each field by a call)
class PlanBatch:
    """The decode side's answer to an :class:`OfferBatch`, in its order: per offer, its status
    and, for a SEND offer, the prompt tokens this side's prefix cache already holds (a
    multiple of the moved chunk; the prefill side sends the tokens from there to the prompt's
    end, mapped to its own rows)."""

    WIRE_NUM_ARRAYS = 3

    statuses: np.ndarray  # on cpu, int64 [num_reqs]: PlanStatus values
    num_hit: np.ndarray  # on cpu, int64 [num_reqs]: prompt tokens not sent (0 unless SEND)
    reasons: dict[int, str]  # offer index -> why it was refused
    num_acked: int = 0  # the previous round's sent requests, now in the decode side's cache

    def to_wire(self) -> tuple[tuple[np.ndarray, ...], list[str], int]:
        reasons = self.reasons
        at = np.fromiter(reasons, np.int64, len(reasons)) if reasons else _NO_INDEX
        return (self.statuses, self.num_hit, at), list(reasons.values()), self.num_acked

    @classmethod
    def from_wire(cls, arrays: list[np.ndarray], texts: list[str], value: int = 0
                  ) -> PlanBatch:
        """The plan again; raises ``ValueError`` naming the field that does not fit."""
        if len(arrays) != 3:
            raise ValueError(f"malformed PlanBatch: {len(arrays)} arrays, 3 expected")
        statuses, num_hit, reason_at = arrays
        if num_hit.size != statuses.size:
            raise ValueError(f"malformed PlanBatch of {statuses.size} offers: num_hit holds "
                             f"{num_hit.size} entries, {statuses.size} expected")
        if reason_at.size != len(texts):
            raise ValueError(f"malformed PlanBatch of {statuses.size} offers: {reason_at.size} "
                             f"reasons' offers, {len(texts)} reasons")
        reasons = dict(zip(reason_at.tolist(), texts)) if texts else {}
        return cls(statuses, num_hit, reasons, value)


def data_status(gathered: bool, rows_per_piece: int) -> np.ndarray:
    """The two int64 that lead a round's data (no pickle): whether the buffer follows (else
    the decode side recomputes the planned requests) and its rows per piece."""
    return np.array([int(gathered), rows_per_piece], dtype=np.int64)
