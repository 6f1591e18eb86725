"""Prompts kept back to back in one int64 buffer, each followed by a slot for its first token.

The prefill side keeps every submitted prompt until it is offered to the decode side. One
buffer for all of them, rather than an array per request, makes a round's token ids one slice
of it when the offered requests were submitted one after another (the usual round: submitted
together, prefilled in order): no copy per request when the offer is made, no array per
request to free after it. Other orders are gathered, one slice per request.

A region, once written, is never written again but for its first-token slot (the same value
each time the request is offered): the buffer is replaced, not reused, when it is compacted or
emptied, so an offer's view stays valid while its receiver reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np


class PromptArena:
    """The kept prompts of the requests of one side, by request id.

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
        # per kept request: where its prompt starts, and its length plus the first-token slot
        self._starts: dict[object, int] = {}
        self._lengths: dict[object, int] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._starts

    @property
    def num_tokens(self) -> int:
        """Token slots of the kept requests (prompts and their first-token slots)."""
        return sum(self._lengths.values())

    def add(self, req_id: object, prompt_token_ids: Sequence[int] | np.ndarray) -> None:
        """Keep ``req_id``'s prompt (copied), a slot for its first token after it.

        Raises
        ------
        KeyError
            ``req_id`` is kept already (nothing changes).
        """
        if req_id in self._starts:
            raise KeyError(f"request {req_id!r} is kept already")
        n = len(prompt_token_ids) + 1
        if self._end + n > self._buffer.size:
            self._compact(n)
        start = self._end
        self._buffer[start:start + n - 1] = prompt_token_ids
        self._end = start + n
        self._starts[req_id] = start
        self._lengths[req_id] = n

    def drop(self, req_ids: Sequence[object]) -> None:
        """Forget these requests' prompts (unknown ids are skipped)."""
        starts, lengths = self._starts, self._lengths
        if len(req_ids) >= len(starts) and starts.keys() <= set(req_ids):
            starts.clear()  # all of them: the usual round hands every offer over
            lengths.clear()
        else:
            for req_id in req_ids:
                if starts.pop(req_id, None) is not None:
                    del lengths[req_id]
        if not starts and self._end:  # a fresh buffer: a view handed out is never written over
            self._buffer = np.empty(self._buffer.size, dtype=np.int64)
            self._end = 0

    def token_ids(self, req_ids: Sequence[object], first_tokens: Sequence[int]
                  ) -> tuple[np.ndarray, np.ndarray]:
        """The token ids of ``req_ids`` (kept), each prompt then its first token, flat.

        Returns
        -------
        token_ids : np.ndarray
            int64 ``[total]`` on cpu: request ``i``'s at ``token_ids[token_starts[i] :
            token_starts[i + 1]]``, ``first_tokens[i]`` last. A view of the buffer when the
            requests lie back to back in it in this order, else a new array.
        token_starts : np.ndarray
            int64 ``[len(req_ids) + 1]``.
        """
        if not req_ids:
            return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
        starts = list(map(self._starts.__getitem__, req_ids))
        lengths = list(map(self._lengths.__getitem__, req_ids))
        ends = list(accumulate(lengths, initial=starts[0]))
        token_starts = np.array(ends, dtype=np.int64)
        token_starts -= starts[0]
        if ends[:-1] == starts:  # back to back, in this order: one slice
            out = self._buffer[starts[0]:ends[-1]]
        else:
            buffer = self._buffer
            out = np.concatenate([buffer[a:a + n] for a, n in zip(starts, lengths)])
        out[token_starts[1:] - 1] = first_tokens
        return out, token_starts

    def _compact(self, more: int) -> None:
        """A new buffer holding the kept prompts back to back (in their order here) and room
        for ``more`` tokens, twice what that needs (or ``min_capacity``)."""
        need = self.num_tokens + more
        buffer = np.empty(max(2 * need, self.min_capacity), dtype=np.int64)
        old, end = self._buffer, 0
        for req_id, start in sorted(self._starts.items(), key=lambda kv: kv[1]):
            n = self._lengths[req_id]
            buffer[end:end + n] = old[start:start + n]
            self._starts[req_id] = end
            end += n
        self._buffer, self._end = buffer, end
