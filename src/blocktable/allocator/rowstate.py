"""Per-row state of the running requests: counts and block rows in arrays indexed by table row.

A request holds one table row from admission until it is freed or preempted, so what the
batched calls of a step read and write for every request (token counts, row lengths, block ids)
lives in arrays indexed by that row rather than on each request's object: a step's decode
requests are then handled with a few gathers and scatters over their rows, not a Python loop
reaching each request's object, lists and buffers (cold cache lines, at a thousand running
requests).

The block rows of group ``g`` are one int32 arena ``blocks[g]`` of shape ``[num_rows, width]``:
row ``r`` holds its request's manager block ids in its first ``row_len[g, r]`` entries. The
width grows (doubling) to the longest row held so far, so the arena costs as much host memory
as a block table of the same rows and width: ``num_rows * width * 4`` bytes per group.

Token ids live in an int64 arena ``tokens`` ``[num_rows, token_width]`` too, the width doubling
up to :data:`TOKEN_ROW_CAP` (32 MB at 1024 rows); a longer sequence moves to a buffer of its
own (``in_arena[r]`` False), so memory stays bounded however long the context.
"""

from __future__ import annotations

import numpy as np

_MIN_WIDTH = 16
_MIN_TOKEN_WIDTH = 256
TOKEN_ROW_CAP = 4096  # token ids a row of the token arena holds at most
_FEW_ROWS = 16  # gathers of at most this many rows slice each row


class RowState:
    """Counts and block rows of every table row (on cpu; entries of free rows are stale).

    Attributes
    ----------
    num_computed : int64 ``[num_rows]``
        Tokens of the row's request already in the KV cache.
    num_tokens : int64 ``[num_rows]``
        Token ids known for the request (prompt plus appended).
    num_prompt : int64 ``[num_rows]``
        Token ids at admission (the prompt, whose block keys were computed then).
    num_slots : int64 ``[num_rows]``
        Tokens the allocated blocks of every group can hold.
    row_len : int64 ``[num_groups, num_rows]``
        Manager blocks in the row, per group.
    num_skipped : int64 ``[num_groups, num_rows]``
        Leading entries that left a sliding window (``NULL_BLOCK_ID``), per group.
    blocks : list of int32 ``[num_rows, width_g]``
        Per group, the block ids of each row (the first ``row_len[g, r]`` entries).
    tokens : int64 ``[num_rows, token_width]``
        The token ids of each row whose request fits (``in_arena``): its first
        ``num_tokens[r]`` entries.
    in_arena : bool ``[num_rows]``
        Whether the row's token ids are in ``tokens`` (else in its request's own buffer).
    holder_gen : int64 ``[num_rows]``
        A number given to each admission (never reused), 0 for a free row: the step journal
        tells a row's holder at its last take from the live one by comparing these.
    """

    def __init__(self, num_rows: int, num_groups: int) -> None:
        self.num_rows = num_rows
        self.num_computed = np.zeros(num_rows, dtype=np.int64)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_slots = np.zeros(num_rows, dtype=np.int64)
        self.row_len = np.zeros((num_groups, num_rows), dtype=np.int64)
        self.num_skipped = np.zeros((num_groups, num_rows), dtype=np.int64)
        self.blocks = [np.zeros((num_rows, _MIN_WIDTH), dtype=np.int32) for _ in range(num_groups)]
        self.num_prompt = np.zeros(num_rows, dtype=np.int64)  # prompt tokens at admission
        self.tokens = np.zeros((num_rows, _MIN_TOKEN_WIDTH), dtype=np.int64)
        self.in_arena = np.zeros(num_rows, dtype=bool)
        self.holder_gen = np.zeros(num_rows, dtype=np.int64)
        self._next_gen = 1
        self._views()

    def _views(self) -> None:
        # Scalar paths (one request) read and write through memoryviews, which give and take
        # Python ints (a numpy scalar read costs about twice as much); none of these arrays
        # is ever reallocated.
        self.num_computed_mv = self.num_computed.data
        self.num_tokens_mv = self.num_tokens.data
        self.num_slots_mv = self.num_slots.data
        self.row_len_mvs = [a.data for a in self.row_len]  # per group: [row]
        self.num_skipped_mvs = [a.data for a in self.num_skipped]
        self.holder_gen_mv = self.holder_gen.data
        self.num_prompt_mv = self.num_prompt.data
        self.in_arena_mv = self.in_arena.data

    def __getstate__(self) -> dict[str, object]:  # memoryviews do not pickle or copy
        return {k: v for k, v in self.__dict__.items() if not k.endswith(("_mv", "_mvs"))}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._views()

    def start_many(self, rows: list[int], prompts: list[np.ndarray]) -> list[np.ndarray | None]:
        """New requests take ``rows`` (distinct), each with its prompt's token ids (int64,
        copied) and nothing else. Per row: None when the ids went into the row of the token
        arena, else the buffer of their own they went into (with room to grow; see
        :meth:`take_tokens`). One loop with the views bound once (a step admits a few
        requests: scalar writes beat array calls here)."""
        gen = self._next_gen
        self._next_gen = gen + len(rows)
        holder_gen, num_computed, num_slots = (
            self.holder_gen_mv,
            self.num_computed_mv,
            self.num_slots_mv,
        )
        num_tokens, num_prompt, in_arena = self.num_tokens_mv, self.num_prompt_mv, self.in_arena_mv
        group_mvs = list(zip(self.row_len_mvs, self.num_skipped_mvs))
        arena = self.tokens
        width = arena.shape[1]
        copyto = np.copyto  # (cheaper than a slice assignment)
        out: list[np.ndarray | None] = []
        for row, tokens in zip(rows, prompts):
            n = len(tokens)
            holder_gen[row] = gen
            gen += 1
            num_computed[row] = 0
            num_tokens[row] = n
            num_prompt[row] = n
            num_slots[row] = 0
            for row_len, num_skipped in group_mvs:
                row_len[row] = 0
                num_skipped[row] = 0
            if n <= width:
                copyto(arena[row, :n], tokens)
                in_arena[row] = True
                out.append(None)
            else:
                out.append(self.take_tokens(row, tokens))
                arena = self.tokens  # (grown, or not)
                width = arena.shape[1]
        return out

    def stop(self, rows: list[int]) -> None:
        """The requests of ``rows`` left (their entries are stale from now on)."""
        holder_gen = self.holder_gen_mv
        for row in rows:
            holder_gen[row] = 0

    def take_tokens(self, row: int, tokens: np.ndarray) -> np.ndarray | None:
        """Copy a new request's ``tokens`` (int64) into ``row`` of the token arena and return
        None, or, when they do not fit, into a buffer of its own (with room to grow) and
        return that (:meth:`start_many` calls it)."""
        n = len(tokens)
        if n <= self.tokens.shape[1] or self.token_room(n):
            self.tokens[row, :n] = tokens
            self.in_arena_mv[row] = True
            return None
        self.in_arena_mv[row] = False
        buffer = np.empty(n + (n >> 2) + 16, dtype=np.int64)
        buffer[:n] = tokens
        return buffer

    def token_room(self, size: int) -> bool:
        """Whether the token arena's rows hold ``size`` ids (it grows, doubling, up to
        :data:`TOKEN_ROW_CAP`)."""
        width = self.tokens.shape[1]
        if size <= width:
            return True
        if size > TOKEN_ROW_CAP:
            return False
        new = np.zeros((self.num_rows, min(TOKEN_ROW_CAP, max(size, 2 * width))), np.int64)
        new[:, :width] = self.tokens
        self.tokens = new
        return True

    def ensure_width(self, group: int, width: int) -> np.ndarray:
        """The arena of ``group``, grown (doubling) to hold rows of ``width`` blocks."""
        arena = self.blocks[group]
        if arena.shape[1] >= width:
            return arena
        new = np.zeros((self.num_rows, max(width, 2 * arena.shape[1])), dtype=np.int32)
        new[:, : arena.shape[1]] = arena
        self.blocks[group] = new
        return new

    def row(self, group: int, row: int) -> np.ndarray:
        """Row ``row`` of ``group``: int32 ``[row_len[group, row]]``, a view of the arena."""
        return self.blocks[group][row, : self.row_len[group, row]]

    def set_row(self, group: int, row: int, block_ids: np.ndarray) -> None:
        """Make ``block_ids`` (int32) the whole row ``row`` of ``group``."""
        k = len(block_ids)
        arena = self.ensure_width(group, k)
        arena[row, :k] = block_ids
        self.row_len[group, row] = k

    def update_num_slots(self, block_sizes: tuple[int, ...], row: int) -> None:
        """``num_slots[row]``: what the smallest group's blocks hold."""
        if len(block_sizes) == 1:
            self.num_slots_mv[row] = self.row_len_mvs[0][row] * block_sizes[0]
        else:
            self.num_slots[row] = min(
                n * bs for n, bs in zip(self.row_len[:, row].tolist(), block_sizes)
            )

    def gather(
        self, group: int, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray
    ) -> np.ndarray:
        """``blocks[group][rows[i], starts[i] : starts[i] + counts[i]]`` for every ``i``,
        concatenated (int32; ``rows``, ``starts``, ``counts``: int64 or intp ``[n]``)."""
        arena = self.blocks[group]
        n = len(counts)
        if not n:
            return arena[0, :0].copy()
        if counts.min() == 1 == counts.max():  # one entry a row (decode steps)
            return arena[rows, starts]
        if n <= _FEW_ROWS:  # a slice per row: cheaper than building indices for a few rows
            parts = [
                arena[row, start : start + count]
                for row, start, count in zip(rows.tolist(), starts.tolist(), counts.tolist())
            ]
            return parts[0].copy() if n == 1 else np.concatenate(parts)
        total = int(counts.sum())
        ends = np.cumsum(counts)
        # flat position of each entry in the (C-contiguous) arena: its row's first position
        # plus its place within the row's part (one index array, not a (row, col) pair)
        at = np.arange(total, dtype=np.int64)
        at += np.repeat(rows * arena.shape[1] + starts - (ends - counts), counts)
        return arena.reshape(-1).take(at)
