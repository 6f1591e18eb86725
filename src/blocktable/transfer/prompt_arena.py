"""Prompts kept back to back in one int64 buffer, each followed by a slot for its first token.

The prefill side keeps every submitted prompt until it is offered to the decode side. One
buffer for all of them, rather than an array per request, makes a round's token ids one slice
of it when the offered requests were submitted one after another (the usual round: submitted
together, prefilled in order): no copy per request when the offer is made, no array per
request to free after it. Other orders are gathered with one index. Each request's place in
the buffer, its length and its ``max_new_tokens`` are one row of a small int64 table, so a
round reads them with one dict pass and one index, not a list per field.

A region, once written, is never written again but for its first-token slot (the same value
each time the request is offered): the buffer is replaced, not reused, when it is compacted or
emptied, so an offer's view stays valid while its receiver reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        # per kept request, a row of _records (rows of dropped ones are reused): where its
        # prompt starts, its length plus the first-token slot, its max_new_tokens
        self._rows: dict[object, int] = {}
        self._records = np.zeros((64, 3), dtype=np.int64)  # on cpu, int64 [capacity, 3]
        self._free_rows: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._rows

    @property
    def num_tokens(self) -> int:
        """Token slots of the kept requests (prompts and their first-token slots)."""
        return int(self._records[list(self._rows.values()), 1].sum())

    def add(self, req_id: object, prompt_token_ids: Sequence[int] | np.ndarray,
            max_new_tokens: int = 0) -> None:
        """Keep ``req_id``'s prompt (copied), a slot for its first token after it, and its
        ``max_new_tokens`` (given back by :meth:`token_ids`).

        Raises
        ------
        KeyError
            ``req_id`` is kept already (nothing changes).
        """
        if req_id in self._rows:
            raise KeyError(f"request {req_id!r} is kept already")
        n = len(prompt_token_ids) + 1
        if self._end + n > self._buffer.size:
            self._compact(n)
        start = self._end
        self._buffer[start:start + n - 1] = prompt_token_ids
        self._end = start + n
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = len(self._rows)
            if row == self._records.shape[0]:
                self._records = np.concatenate((self._records, np.zeros_like(self._records)))
        self._records[row] = start, n, max_new_tokens
        self._rows[req_id] = row

    def drop(self, req_ids: Sequence[object]) -> None:
        """Forget these requests' prompts (unknown ids are skipped)."""
        rows = self._rows
        if len(req_ids) >= len(rows) and rows.keys() <= set(req_ids):
            rows.clear()  # all of them: the usual round hands every offer over
            self._free_rows.clear()
        else:
            free = self._free_rows
            for req_id in req_ids:
                row = rows.pop(req_id, None)
                if row is not None:
                    free.append(row)
        if not rows and self._end:  # a fresh buffer: a view handed out is never written over
            self._buffer = np.empty(self._buffer.size, dtype=np.int64)
            self._end = 0

    def token_ids(self, req_ids: Sequence[object], first_tokens: Sequence[int] | np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The token ids of ``req_ids`` (kept, distinct), each prompt then its first token,
        flat; and their ``max_new_tokens``.

        Returns
        -------
        token_ids : np.ndarray
            int64 ``[total]`` on cpu: request ``i``'s at ``token_ids[token_starts[i] :
            token_starts[i + 1]]``, ``first_tokens[i]`` last. A view of the buffer when the
            requests lie back to back in it in this order, else a new array.
        token_starts : np.ndarray
            int64 ``[len(req_ids) + 1]``.
        max_new_tokens : np.ndarray
            int64 ``[len(req_ids)]`` on cpu (a strided view of a new array).
        """
        n = len(req_ids)
        if not n:
            return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), _NONE
        # one dict pass for the round, then whole-array operations
        records = self._records[np.fromiter(map(self._rows.__getitem__, req_ids), np.intp, n)]
        starts = records[:, 0]
        token_starts = np.zeros(n + 1, dtype=np.int64)
        np.add.accumulate(records[:, 1], out=token_starts[1:])
        first = int(starts[0])
        # where each request's tokens start in the buffer, less where they go in the output
        shift = starts - token_starts[:-1]
        if not np.count_nonzero(shift != first):  # back to back, in this order: one slice
            out = self._buffer[first:first + int(token_starts[n])]
        else:
            out = self._buffer[np.arange(token_starts[n]) + shift.repeat(records[:, 1])]
        out[token_starts[1:] - 1] = first_tokens
        return out, token_starts, records[:, 2]

    def _compact(self, more: int) -> None:
        """A new buffer holding the kept prompts back to back (in their order here) and room
        for ``more`` tokens, twice what that needs (or ``min_capacity``)."""
        need = self.num_tokens + more
        buffer = np.empty(max(2 * need, self.min_capacity), dtype=np.int64)
        old, end, records = self._buffer, 0, self._records
        for row in sorted(self._rows.values(), key=lambda r: int(records[r, 0])):
            start, n = int(records[row, 0]), int(records[row, 1])
            buffer[end:end + n] = old[start:start + n]
            records[row, 0] = end
            end += n
        self._buffer, self._end = buffer, end


_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False
