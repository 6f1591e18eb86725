"""Prompts kept back to back in one int64 buffer, each followed by a slot for its first token.

The prefill side keeps every submitted prompt until it is offered to the decode side. One
buffer for all of them, rather than an array per request, makes a round's token ids one slice
of it when the offered requests were submitted one after another (the usual round: submitted
together, prefilled in order): no copy per request when the offer is made, no array per
request to free after it. Other orders are gathered, one slice per request. Each request's
place in the buffer, its length and its ``max_new_tokens`` are one tuple, read for a round
in one dict pass.

A region, once written, is never written again but for its first-token slot (the same value
each time the request is offered): the buffer is replaced, not reused, when it is compacted or
emptied, so an offer's view stays valid while its receiver reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np


class PromptArena:
    """The kept prompts of the requests of one side, by request id, each with its
    ``max_new_tokens``.

    Parameters
    ----------
    min_capacity : int
        Tokens the buffer holds at least (it doubles past the live tokens when full).
    """

    def __init__(self, min_capacity: int = 1 << 15) -> None:
        if min_capacity < 1:
            raise ValueError(f"min_capacity must be >= 1, got {min_capacity}")
        self.min_capacity = min_capacity
        self._buffer = np.empty(min_capacity, dtype=np.int64)
        self._end = 0  # the buffer's first unwritten entry
        # per kept request: where its prompt starts, its length plus the first-token slot,
        # and its max_new_tokens (one tuple: a round reads all three in one dict pass)
        self._kept: dict[object, tuple[int, int, int]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._kept

    @property
    def num_tokens(self) -> int:
        """Token slots of the kept requests (prompts and their first-token slots)."""
        return sum(n for _, n, _ in self._kept.values())

    def add(self, req_id: object, prompt_token_ids: Sequence[int] | np.ndarray,
            max_new_tokens: int = 0) -> None:
        """Keep ``req_id``'s prompt (copied), a slot for its first token after it, and its
        ``max_new_tokens`` (given back by :meth:`token_ids`).

        Raises
        ------
        KeyError
            ``req_id`` is kept already (nothing changes).
        """
        if req_id in self._kept:
            raise KeyError(f"request {req_id!r} is kept already")
        n = len(prompt_token_ids) + 1
        if self._end + n > self._buffer.size:
            self._compact(n)
        start = self._end
        self._buffer[start:start + n - 1] = prompt_token_ids
        self._end = start + n
        self._kept[req_id] = (start, n, max_new_tokens)

    def drop(self, req_ids: Sequence[object]) -> None:
        """Forget these requests' prompts (unknown ids are skipped)."""
        kept = self._kept
        if len(req_ids) >= len(kept) and kept.keys() <= set(req_ids):
            kept.clear()  # all of them: the usual round hands every offer over
        else:
            for req_id in req_ids:
                kept.pop(req_id, None)
        if not kept and self._end:  # a fresh buffer: a view handed out is never written over
            self._buffer = np.empty(self._buffer.size, dtype=np.int64)
            self._end = 0

    def token_ids(self, req_ids: Sequence[object], first_tokens: Sequence[int]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The token ids of ``req_ids`` (kept), each prompt then its first token, flat; and
        their ``max_new_tokens``.

        Returns
        -------
        token_ids : np.ndarray
            int64 ``[total]`` on cpu: request ``i``'s at ``token_ids[token_starts[i] :
            token_starts[i + 1]]``, ``first_tokens[i]`` last. A view of the buffer when the
            requests lie back to back in it in this order, else a new array.
        token_starts : np.ndarray
            int64 ``[len(req_ids) + 1]``.
        max_new_tokens : np.ndarray
            int64 ``[len(req_ids)]`` on cpu.
        """
        if not req_ids:
            return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), _NONE
        # (a few passes over Python lists cost less than numpy calls here, caches cold)
        starts, lengths, max_new = zip(*map(self._kept.__getitem__, req_ids))
        ends = list(accumulate(lengths, initial=starts[0]))
        token_starts = np.array(ends, dtype=np.int64)
        token_starts -= starts[0]
        if tuple(ends[:-1]) == starts:  # back to back, in this order: one slice
            out = self._buffer[starts[0]:ends[-1]]
        else:
            buffer = self._buffer
            out = np.concatenate([buffer[a:a + n] for a, n in zip(starts, lengths)])
        out[token_starts[1:] - 1] = first_tokens
        return out, token_starts, np.array(max_new, dtype=np.int64)

    def _compact(self, more: int) -> None:
        """A new buffer holding the kept prompts back to back (in their order here) and room
        for ``more`` tokens, twice what that needs (or ``min_capacity``)."""
        need = self.num_tokens + more
        buffer = np.empty(max(2 * need, self.min_capacity), dtype=np.int64)
        old, end, kept = self._buffer, 0, self._kept
        for req_id, (start, n, max_new) in sorted(kept.items(), key=lambda kv: kv[1][0]):
            buffer[end:end + n] = old[start:start + n]
            kept[req_id] = (end, n, max_new)
            end += n
        self._buffer, self._end = buffer, end


_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False
