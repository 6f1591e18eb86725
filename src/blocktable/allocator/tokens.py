"""Token ids of the running requests, in pages: a token table beside the block table.

Every row's token ids live in fixed-size pages of one int64 array, listed per row in a page
table (an arena like the block rows): token ``t`` of row ``r`` is entry ``t % page_size`` of page
``table[r, t // page_size]``. A step's appends to many rows are then one scatter, and the token
ids of the blocks they fill one gather, instead of a slice of each request's own buffer; pages
are taken and returned on a free stack, so nothing is compacted or copied when a row grows.
A row whose request leaves keeps up to :data:`KEEP_PAGES` pages for the next request to take
it (rows are reused lowest first), so a step's frees and admissions rarely move pages.
"""

from __future__ import annotations

import numpy as np

_MIN_PAGES = 64
_MIN_WIDTH = 4
_FEW_ROWS = 8  # reads of at most this many rows slice each row's pages
KEEP_PAGES = 64  # pages a row keeps when its request leaves (reused by the next one)


def page_size_for(block_sizes: tuple[int, ...]) -> int:
    """The page size for these block sizes: a power of two >= 64 and >= the largest block, so
    a block of a power-of-two size never straddles two pages."""
    size = 64
    while size < max(block_sizes):
        size *= 2
    return size


class TokenPages:
    """Token ids of ``num_rows`` rows, ``page_size`` ids per page (all on cpu).

    Attributes
    ----------
    pages : int64 ``[num_pages, page_size]``
        Page contents; free pages hold stale ids.
    table : int64 ``[num_rows, width]``
        Per row, its pages in order (the first ``num_pages[r]`` entries).
    num_pages : int64 ``[num_rows]``
        Pages held by each row (at least enough for its token ids; a free row keeps a few).
    """

    def __init__(self, num_rows: int, page_size: int) -> None:
        self.page_size = page_size
        self.pages = np.zeros((_MIN_PAGES, page_size), dtype=np.int64)
        self.table = np.zeros((num_rows, _MIN_WIDTH), dtype=np.int64)
        self.num_pages = np.zeros(num_rows, dtype=np.int64)
        self._free = np.arange(_MIN_PAGES - 1, -1, -1, dtype=np.int64)  # a stack, top last
        self._num_free = _MIN_PAGES
        self._num_pages_mv = self.num_pages.data

    def __getstate__(self) -> dict[str, object]:  # memoryviews do not pickle or copy
        return {k: v for k, v in self.__dict__.items() if not k.endswith("_mv")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._num_pages_mv = self.num_pages.data
    # ----------------------------------------------------------------- pages
    def _pop(self, n: int) -> np.ndarray:
        """``n`` free page ids (the page array doubles when too few are free)."""
        if self._num_free < n:
            old = len(self.pages)
            size = max(2 * old, old + n - self._num_free)
            pages = np.zeros((size, self.page_size), dtype=np.int64)
            pages[:old] = self.pages
            self.pages = pages
            free = np.empty(size, dtype=np.int64)
            new = np.arange(size - 1, old - 1, -1, dtype=np.int64)
            free[: len(new)] = new  # new pages at the bottom of the stack
            free[len(new) : len(new) + self._num_free] = self._free[: self._num_free]
            self._free = free
            self._num_free += len(new)
        top = self._num_free
        self._num_free = top - n
        return self._free[top - n : top].copy()

    def _push(self, page_ids: np.ndarray) -> None:
        n, top = len(page_ids), self._num_free
        self._free[top : top + n] = page_ids
        self._num_free = top + n

    def _width(self, width: int) -> np.ndarray:
        table = self.table
        if table.shape[1] >= width:
            return table
        new = np.zeros((len(table), max(width, 2 * table.shape[1])), dtype=np.int64)
        new[:, : table.shape[1]] = table
        self.table = new
        return new

    def reserve(self, rows: np.ndarray, num_tokens: np.ndarray) -> None:
        """Give each of ``rows`` (distinct, intp) pages for its first ``num_tokens`` ids."""
        held = self.num_pages[rows]
        need = -(-num_tokens // self.page_size) - held
        np.maximum(need, 0, out=need)
        total = int(need.sum())
        if not total:
            return
        new = self._pop(total)
        got = np.flatnonzero(need)
        rows, need, held = rows[got], need[got], held[got]
        table = self._width(int((held + need).max()))
        if len(got) == total:
            table[rows, held] = new
        else:
            cols = np.arange(total, dtype=np.int64)
            cols += np.repeat(held - (np.cumsum(need) - need), need)
            table[np.repeat(rows, need), cols] = new
        self.num_pages[rows] = held + need

    def reserve_one(self, row: int, num_tokens: int) -> None:
        """:meth:`reserve` of one row."""
        held = self._num_pages_mv[row]
        need = -(-num_tokens // self.page_size) - held
        if need > 0:
            self._width(held + need)[row, held : held + need] = self._pop(need)
            self._num_pages_mv[row] = held + need

    def release(self, rows: list[int], keep: int = KEEP_PAGES) -> None:
        """The requests of ``rows`` (distinct) left: each row keeps its first ``keep`` pages
        (for the next request taking it) and returns the others to the free stack."""
        num_pages, table = self._num_pages_mv, self.table
        for row in rows:
            n = num_pages[row]
            if n > keep:
                self._push(table[row, keep:n])
                num_pages[row] = keep

    # ----------------------------------------------------------------- token ids
    def write(self, row: int, start: int, tokens: np.ndarray) -> None:
        """Write ``tokens`` (int64 ``[k]``) at positions ``start ..`` of ``row``: the part in
        the first page, whole pages, and the part in the last page, each one copy."""
        k = len(tokens)
        if not k:
            return
        self.reserve_one(row, start + k)
        size, pages = self.page_size, self.pages
        first, at = divmod(start, size)
        page_ids = self.table[row, first : (start + k - 1) // size + 1]
        if at:  # the rest of the first page
            head = min(k, size - at)
            pages[page_ids[0], at : at + head] = tokens[:head]
            tokens, page_ids = tokens[head:], page_ids[1:]
        full = len(tokens) // size
        if full:
            pages[page_ids[:full]] = tokens[: full * size].reshape(full, size)
        if len(tokens) > full * size:
            pages[page_ids[full], : len(tokens) - full * size] = tokens[full * size :]

    def write_prompts(self, rows: list[int], prompts: list[np.ndarray]) -> None:
        """Write each of ``prompts`` (int64 ``[n_i]``) from position 0 of its row of ``rows``
        (distinct): one reservation, then whole pages per prompt."""
        at = np.array(rows, dtype=np.intp)
        self.reserve(at, np.array([len(p) for p in prompts], dtype=np.int64))
        size, pages, table = self.page_size, self.pages, self.table
        for row, tokens in zip(rows, prompts):
            full, rest = divmod(len(tokens), size)
            if full:
                pages[table[row, :full]] = tokens[: full * size].reshape(full, size)
            if rest:
                pages[table[row, full], :rest] = tokens[full * size :]

    def write_rows(self, rows: np.ndarray, starts: np.ndarray, tokens: np.ndarray) -> None:
        """Write row ``i`` of ``tokens`` (int64 ``[n, k]``) at positions ``starts[i] ..`` of
        ``rows[i]`` (distinct, intp)."""
        k = tokens.shape[1]
        if not k or not len(rows):
            return
        self.reserve(rows, starts + k)
        size = self.page_size
        offsets = starts % size
        if k <= size and int(offsets.max()) + k <= size:  # each row's part in one page
            flat = self.table[rows, starts // size]
            flat *= size
            flat += offsets
            self.pages.reshape(-1)[flat[:, None] + np.arange(k)] = tokens
            return
        positions = starts[:, None] + np.arange(k)
        page_ids = self.table[rows[:, None], positions // size]
        page_ids *= size
        page_ids += positions % size
        self.pages.reshape(-1)[page_ids] = tokens

    def read(self, row: int, start: int, stop: int) -> np.ndarray:
        """Token ids ``start .. stop - 1`` of ``row`` (int64; a view of the pages or a copy:
        use it before the next write)."""
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        size = self.page_size
        first, last = start // size, (stop - 1) // size
        if first == last:
            return self.pages[self.table[row, first], start - first * size : stop - first * size]
        data = self.pages[self.table[row, first : last + 1]].reshape(-1)
        return data[start - first * size : stop - first * size]

    def read_many(self, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Token ids ``starts[i] .. starts[i] + lengths[i] - 1`` of ``rows[i]`` for every ``i``,
        concatenated (int64; ``rows``, ``starts``, ``lengths``: int64 or intp ``[n]``)."""
        n = len(rows)
        if n <= _FEW_ROWS:
            parts = [
                self.read(row, start, start + length)
                for row, start, length in zip(rows.tolist(), starts.tolist(), lengths.tolist())
            ]
            if not parts:
                return np.zeros(0, dtype=np.int64)
            return parts[0].copy() if n == 1 else np.concatenate(parts)
        size = self.page_size
        first = starts // size
        num = (starts + lengths - 1) // size - first + 1  # pages per segment (lengths >= 1)
        if int(num.max()) == 1:  # each segment inside one page (a decode step's blocks)
            data = self.pages[self.table[rows, first]]  # [n, page_size]
            offsets = starts - first * size
            k = int(lengths[0])
            if (lengths == k).all():
                return data[np.arange(n)[:, None], offsets[:, None] + np.arange(k)].reshape(-1)
        # general: the segments' pages, then each segment cut from them
        ends = np.cumsum(num)
        cols = np.arange(int(ends[-1]), dtype=np.int64)
        cols += np.repeat(first - (ends - num), num)
        data = self.pages[self.table[np.repeat(rows, num), cols]].reshape(-1)
        seg_at = (ends - num) * size + (starts - first * size)  # where each segment starts
        total_ends = np.cumsum(lengths)
        positions = np.arange(int(total_ends[-1]), dtype=np.int64)
        positions += np.repeat(seg_at - (total_ends - lengths), lengths)
        return data[positions]
