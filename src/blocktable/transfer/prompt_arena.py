"""Prompts kept back to back in one int64 buffer, each followed by a slot for its first token.

The prefill side keeps every submitted prompt until it is offered to the decode side. One
buffer for all of them, rather than an array per request, makes a round's token ids one slice
of it when the offered requests were submitted one after another (the usual round: submitted
together, prefilled in order): no copy per request when the offer is made, no array per
request to free after it. The other fields of an offer (each prompt's place, its
``max_new_tokens``, its stop tokens) are kept the same way, in lists in the order the
requests were added (*entries*), so the usual round reads each of them as one slice, checked
by one comparison of the offered ids with the entries' ids. Other orders are gathered, one
slice per request.

A region, once written, is never written again but for its first-token slot (the same value
each time the request is offered): the buffer is replaced, not reused, when it is compacted or
emptied, so an offer's view stays valid while its receiver reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class PromptArena:
    """The kept prompts of the requests of one side, by request id, each with its
    ``max_new_tokens`` and stop tokens.

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
        self._entry: dict[object, int] = {}  # kept request -> its entry
        self._reset_entries()

    def _reset_entries(self) -> None:
        """No entries (lists, never written over: an offer copies what it reads of them)."""
        self._ids: list[object] = []  # per entry: its request (None once dropped)
        self._token_ends: list[int] = [0]  # entry e's tokens: buffer[ends[e]:ends[e + 1]]
        self._max_new: list[int] = []
        self._stop_ids: list[int] = []  # every entry's stop tokens, each one's sorted
        self._stop_ends: list[int] = [0]  # entry e's: stop_ids[ends[e]:ends[e + 1]]

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._entry

    @property
    def num_tokens(self) -> int:
        """Token slots of the kept requests (prompts and their first-token slots)."""
        ends = self._token_ends
        return sum(ends[e + 1] - ends[e] for e in self._entry.values())

    def add(self, req_id: object, prompt_token_ids: Sequence[int] | np.ndarray,
            max_new_tokens: int = 0, stop_token_ids: Iterable[int] = ()) -> None:
        """Keep ``req_id``'s prompt (copied), a slot for its first token after it, its
        ``max_new_tokens`` and its stop tokens (given back by :meth:`offer_arrays`).

        Raises
        ------
        KeyError
            ``req_id`` is kept already (nothing changes).
        """
        if req_id in self._entry:
            raise KeyError(f"request {req_id!r} is kept already")
        n = len(prompt_token_ids) + 1
        start = self._token_ends[-1]
        if start + n > self._buffer.size:
            self._compact(n)
            start = self._token_ends[-1]
        self._buffer[start:start + n - 1] = prompt_token_ids
        self._entry[req_id] = len(self._ids)
        self._ids.append(req_id)
        self._token_ends.append(start + n)
        self._max_new.append(max_new_tokens)
        self._stop_ids += sorted(set(stop_token_ids))
        self._stop_ends.append(len(self._stop_ids))

    def drop(self, req_ids: Sequence[object]) -> None:
        """Forget these requests' prompts (unknown ids are skipped)."""
        entry, ids = self._entry, self._ids
        # all of them (the usual round hands every offer over): the entries' own list of ids,
        # else a set of them
        if len(req_ids) >= len(entry) and (
                ids == list(req_ids) or entry.keys() <= set(req_ids)):
            entry.clear()
        else:
            for req_id in req_ids:
                e = entry.pop(req_id, None)
                if e is not None:
                    ids[e] = None
        if not entry and self._ids:  # a fresh buffer: a view handed out is never written over
            self._buffer = np.empty(self._buffer.size, dtype=np.int64)
            self._reset_entries()

    def offer_arrays(self, req_ids: Sequence[object], first_tokens: Sequence[int]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                np.ndarray | None]:
        """The arrays of an offer of ``req_ids`` (kept, distinct): their token ids, each prompt
        then its first token, flat; their ``max_new_tokens``; their stop tokens.

        Returns
        -------
        token_ids : np.ndarray
            int64 ``[total]`` on cpu: request ``i``'s at ``token_ids[token_starts[i] :
            token_starts[i + 1]]``, ``first_tokens[i]`` last. A view of the buffer when the
            requests were added one after another in this order, else a new array.
        token_starts : np.ndarray
            int64 ``[len(req_ids) + 1]``.
        max_new_tokens : np.ndarray
            int64 ``[len(req_ids)]``.
        stop_token_ids, stop_starts : np.ndarray, np.ndarray or None
            int64 ``[total stop tokens]`` (each request's sorted) and int64
            ``[len(req_ids) + 1]``; ``(empty, None)`` when none of them has any.

        Raises
        ------
        KeyError
            A request that is not kept (nothing changes).
        """
        n = len(req_ids)
        if not n:
            return _NONE, np.zeros(1, dtype=np.int64), _NONE, _NONE, None
        e0 = self._entry[req_ids[0]]
        ends, stop_ends = self._token_ends, self._stop_ends
        if self._ids[e0:e0 + n] == list(req_ids):  # added one after another, in this order: slices
            base = ends[e0]
            out = self._buffer[base:ends[e0 + n]]
            token_starts = np.subtract(ends[e0:e0 + n + 1], base)
            max_new = np.array(self._max_new[e0:e0 + n], dtype=np.int64)
            s0, s1 = stop_ends[e0], stop_ends[e0 + n]
            stops = (np.array(self._stop_ids[s0:s1], dtype=np.int64),
                     np.subtract(stop_ends[e0:e0 + n + 1], s0)) if s1 > s0 else (_NONE, None)
        else:
            out, token_starts, max_new, stops = self._gather(req_ids)
        out[token_starts[1:] - 1] = first_tokens
        return out, token_starts, max_new, *stops

    def _gather(self, req_ids: Sequence[object]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                           tuple[np.ndarray, np.ndarray | None]]:
        """:meth:`offer_arrays`' arrays of requests in any order (a new token array)."""
        entries = list(map(self._entry.__getitem__, req_ids))
        ends, stop_ends, buffer = self._token_ends, self._stop_ends, self._buffer
        out = np.concatenate([buffer[ends[e]:ends[e + 1]] for e in entries])
        token_starts = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum([ends[e + 1] - ends[e] for e in entries], out=token_starts[1:])
        max_new = np.array([self._max_new[e] for e in entries], dtype=np.int64)
        stop_ids = [t for e in entries for t in self._stop_ids[stop_ends[e]:stop_ends[e + 1]]]
        if not stop_ids:
            return out, token_starts, max_new, (_NONE, None)
        stop_starts = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum([stop_ends[e + 1] - stop_ends[e] for e in entries], out=stop_starts[1:])
        return out, token_starts, max_new, (np.array(stop_ids, dtype=np.int64), stop_starts)

    def _compact(self, more: int) -> None:
        """A new buffer holding the kept prompts back to back (in their order here) and room
        for ``more`` tokens, twice what that needs (or ``min_capacity``); entries renumbered."""
        need = self.num_tokens + more
        buffer = np.empty(max(2 * need, self.min_capacity), dtype=np.int64)
        old, kept = self._buffer, sorted(self._entry.items(), key=lambda kv: kv[1])
        ends, max_new, stop_ids, stop_ends = (self._token_ends, self._max_new, self._stop_ids,
                                              self._stop_ends)
        self._reset_entries()
        self._buffer = buffer
        for req_id, e in kept:
            start, n = self._token_ends[-1], ends[e + 1] - ends[e]
            buffer[start:start + n] = old[ends[e]:ends[e + 1]]
            self._entry[req_id] = len(self._ids)
            self._ids.append(req_id)
            self._token_ends.append(start + n)
            self._max_new.append(max_new[e])
            self._stop_ids += stop_ids[stop_ends[e]:stop_ends[e + 1]]
            self._stop_ends.append(len(self._stop_ids))


_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False
