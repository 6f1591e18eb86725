"""Prompts kept back to back in one int64 buffer, each followed by a slot for its first token.

The prefill side keeps every submitted prompt until it is offered to the decode side. One
buffer for all of them, rather than an array per request, makes a round's token ids one slice
of it when the offered requests were submitted one after another (the usual round: submitted
together, prefilled in order): no copy per request when the offer is made, no array per
request to free after it. The other fields of an offer (each prompt's place, its
``max_new_tokens``, its stop tokens) are kept the same way, in arrays (the stop tokens in
lists) in the order the requests were added (*entries*), so the usual round reads each of them
as one slice (a view: no conversion of a list), checked by one comparison of the offered ids
with the entries' ids. Other orders are gathered, one slice per request.

A region, once written, is never written again but for its first-token slot (the same value
each time the request is offered): the buffer and the entries' arrays are replaced, not
reused, when they are compacted or emptied, so an offer's views stay valid while its receiver
reads them.
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
        self._entry: dict[object, int] = {}  # kept request -> its entry
        # what the memory is renewed with once emptied (tokens, entries): the sizes reached
        self._capacity = (min_capacity, _MIN_ENTRIES)
        self._empty()

    def _empty(self) -> None:
        """No entries and no memory: the next :meth:`add` takes fresh memory of
        ``_capacity`` (not here: emptying is part of a transfer round, adding is not)."""
        self._buffer = _NONE  # on cpu, int64 [capacity]: the prompts, back to back
        self._reset_entries(0)

    def _reset_entries(self, capacity: int) -> None:
        """No entries, room for ``capacity`` (new arrays, never written over where written: an
        offer's views of them stay valid)."""
        self._ids: list[object] = []  # per entry: its request (None once dropped)
        # on cpu, int64 [capacity + 1]: entry e's tokens are buffer[ends[e]:ends[e + 1]], its
        # first token's slot the last of them
        self._token_ends = np.zeros(capacity + 1, dtype=np.int64) if capacity else _NO_ENDS
        self._max_new = np.zeros(capacity, dtype=np.int64) if capacity else _NONE
        self._stop_ids: list[int] = []  # every entry's stop tokens, each one's sorted
        self._stop_ends: list[int] = [0]  # entry e's: stop_ids[ends[e]:ends[e + 1]]

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._entry

    @property
    def num_tokens(self) -> int:
        """Token slots of the kept requests (prompts and their first-token slots)."""
        entries = np.fromiter(self._entry.values(), np.int64, len(self._entry))
        ends = self._token_ends
        return int((ends[entries + 1] - ends[entries]).sum())

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
        stops = sorted(set(stop_token_ids))
        n = len(prompt_token_ids) + 1
        e = len(self._ids)
        start = int(self._token_ends[e])
        if start + n > self._buffer.size or e == self._max_new.size:
            self._compact(n)
            e = len(self._ids)
            start = int(self._token_ends[e])
        self._buffer[start:start + n - 1] = prompt_token_ids
        self._entry[req_id] = e
        self._ids.append(req_id)
        self._token_ends[e + 1] = start + n
        self._max_new[e] = max_new_tokens
        self._stop_ids += stops
        self._stop_ends.append(len(self._stop_ids))

    def drop(self, req_ids: Sequence[object]) -> None:
        """Forget these requests' prompts (unknown ids are skipped)."""
        entry, ids = self._entry, self._ids
        # all of them (the usual round hands every offer over): the entries' own list of ids,
        # else a set of them
        if len(req_ids) >= len(entry) and (
                ids == req_ids or entry.keys() <= set(req_ids)):
            entry.clear()
        else:
            for req_id in req_ids:
                e = entry.pop(req_id, None)
                if e is not None:
                    ids[e] = None
        if not entry and ids:  # fresh memory next: a view handed out is never written over
            self._capacity = (max(self._buffer.size, self._capacity[0]),
                              max(self._max_new.size, self._capacity[1]))
            self._empty()

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
            int64 ``[len(req_ids)]`` (a view of this arena's memory when the tokens are).
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
        in_order = req_ids if type(req_ids) is list else list(req_ids)
        if self._ids[e0:e0 + n] == in_order:  # added one after another, in this order: slices
            bounds = self._token_ends[e0:e0 + n + 1]
            base = bounds.item(0)
            out = self._buffer[base:bounds.item(n)]
            token_starts = bounds - base
            max_new = self._max_new[e0:e0 + n]
            s0, s1 = self._stop_ends[e0], self._stop_ends[e0 + n]
            stops = (np.array(self._stop_ids[s0:s1], dtype=np.int64),
                     np.subtract(self._stop_ends[e0:e0 + n + 1], s0)) if s1 > s0 else (_NONE, None)
        else:
            out, token_starts, max_new, stops = self._gather(req_ids)
        out[token_starts[1:] - 1] = first_tokens
        return out, token_starts, max_new, *stops

    def _gather(self, req_ids: Sequence[object]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                           tuple[np.ndarray, np.ndarray | None]]:
        """:meth:`offer_arrays`' arrays of requests in any order (a new token array)."""
        entries = np.fromiter(map(self._entry.__getitem__, req_ids), np.int64, len(req_ids))
        ends, stop_ends, buffer = self._token_ends, self._stop_ends, self._buffer
        bounds = zip(ends[entries].tolist(), ends[entries + 1].tolist())
        out = np.concatenate([buffer[a:b] for a, b in bounds])
        token_starts = np.zeros(entries.size + 1, dtype=np.int64)
        np.cumsum(ends[entries + 1] - ends[entries], out=token_starts[1:])
        max_new = self._max_new[entries]
        stop_ids = [t for e in entries.tolist()
                    for t in self._stop_ids[stop_ends[e]:stop_ends[e + 1]]]
        if not stop_ids:
            return out, token_starts, max_new, (_NONE, None)
        stop_starts = np.zeros(entries.size + 1, dtype=np.int64)
        np.cumsum([stop_ends[e + 1] - stop_ends[e] for e in entries.tolist()],
                  out=stop_starts[1:])
        return out, token_starts, max_new, (np.array(stop_ids, dtype=np.int64), stop_starts)

    def _compact(self, more: int) -> None:
        """New memory holding the kept prompts back to back (in their order here) and room for
        ``more`` tokens, twice what that needs (or ``min_capacity``), and for twice the kept
        entries; entries renumbered."""
        need = self.num_tokens + more
        kept = sorted(self._entry.items(), key=lambda kv: kv[1])
        if kept:
            capacity, num_entries = max(2 * need, self.min_capacity), 2 * (len(kept) + 1)
        else:  # emptied: as large as before
            capacity, num_entries = max(need, self._capacity[0]), self._capacity[1]
        buffer = np.empty(capacity, dtype=np.int64)
        old = self._buffer
        ends, max_new, stop_ids, stop_ends = (self._token_ends, self._max_new, self._stop_ids,
                                              self._stop_ends)
        self._reset_entries(max(_MIN_ENTRIES, num_entries))
        self._buffer = buffer
        start = 0
        for e_new, (req_id, e) in enumerate(kept):
            a, b = int(ends[e]), int(ends[e + 1])
            buffer[start:start + b - a] = old[a:b]
            start += b - a
            self._entry[req_id] = e_new
            self._ids.append(req_id)
            self._token_ends[e_new + 1] = start
            self._max_new[e_new] = max_new[e]
            self._stop_ids += stop_ids[stop_ends[e]:stop_ends[e + 1]]
            self._stop_ends.append(len(self._stop_ids))


_MIN_ENTRIES = 64  # entries the per-entry arrays hold at first (doubled by a compaction)
_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False
_NO_ENDS = np.zeros(1, dtype=np.int64)  # no entry's ends (read-only)
_NO_ENDS.flags.writeable = False
