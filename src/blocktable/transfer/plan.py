"""Which cache rows move: a request's tokens mapped through each side's own slot formula.

Both sides place token ``p`` of a request at slot ``block_ids[p // block_size] * block_size +
p % block_size`` (the table's slot mapping; with kernel blocks the slot is the same number).
The transfer moves *chunks* of ``chunk_tokens = gcd(block_size_a, block_size_b)`` tokens: a
chunk starting at a multiple of ``chunk_tokens`` lies inside one block on both sides, so its
slots are contiguous on both and it is one row of the cache viewed as
``[num_layers * 2, num_slots // chunk_tokens, chunk_tokens * num_kv_heads * head_dim]``.
Equal block sizes make chunks whole blocks; different ones need no other code. A prompt of
12 tokens, prefill blocks of 4 tokens, decode blocks of 8 (chunks of 4)::

    tokens            0..3    4..7    8..11
    prefill blocks    7       2       9        -> prefill rows 7, 2, 9
    decode blocks     3 (tokens 0..7)  5       -> decode rows  6, 7, 10
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def chunk_tokens_of(block_size_a: int, block_size_b: int, interleave: int = 0) -> int:
    """Tokens per transferred chunk: the largest run contiguous in both caches (and, towards
    a context-parallel side, inside one rank's run of ``interleave`` tokens)."""
    return math.gcd(block_size_a, block_size_b, interleave)


def slots_reference(block_ids: Sequence[int], block_size: int, positions: Sequence[int]
                    ) -> list[int]:
    """The slot of each token position (plain Python; the reference for :func:`chunk_rows`)."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


def chunk_rows(block_ids: Sequence[int] | np.ndarray, block_size: int, chunk_tokens: int,
               first_token: int, num_tokens: int) -> np.ndarray:
    """Cache rows (in chunks of ``chunk_tokens``) holding tokens ``[first_token,
    first_token + num_tokens)`` of one request, in token order: :func:`chunk_rows_many` for
    one request.

    Returns
    -------
    np.ndarray
        int64 ``[ceil(num_tokens / chunk_tokens)]`` on cpu: row ``r`` holds slots
        ``[r * chunk_tokens, (r + 1) * chunk_tokens)``.
    """
    ids = np.asarray(block_ids, dtype=np.int64)
    rows, _ = chunk_rows_many(ids, np.zeros(1, np.int64), np.array([ids.size]), block_size,
                              chunk_tokens, np.array([first_token]), np.array([num_tokens]))
    return rows


def chunk_rows_many(block_ids: np.ndarray, block_starts: np.ndarray | None,
                    block_counts: np.ndarray, block_size: int, chunk_tokens: int,
                    first_tokens: np.ndarray | None, num_tokens: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The chunk rows of several requests at once (a few numpy passes, no loop per request).

    Parameters
    ----------
    block_ids : np.ndarray
        int ``[total_blocks]``: every request's manager block ids, request ``i``'s at
        ``block_ids[block_starts[i] : block_starts[i] + block_counts[i]]``, in token order;
        or int ``[num_rows, width]``, a block table: request ``i``'s blocks lead its row
        ``block_starts[i]``.
    block_starts : np.ndarray or None
        int ``[num_reqs]``: where each request's blocks start (or its row of a table);
        ``None``: the requests' blocks lie back to back in a flat ``block_ids`` (request
        ``i``'s start where request ``i - 1``'s end), as an allocator hands them out.
    block_counts : np.ndarray
        int ``[num_reqs]``.
    block_size : int
        Tokens per manager block on that side.
    chunk_tokens : int
        Divides ``block_size`` and every ``first_tokens`` entry.
    first_tokens : np.ndarray or None
        int ``[num_reqs]``; ``None``: every request moves from its token 0.
    num_tokens : np.ndarray
        int ``[num_reqs]``: each request moves tokens ``[first, first + num)``.

    Returns
    -------
    rows : np.ndarray
        int64 ``[total_chunks]``, request after request, each in token order. A last partial
        chunk moves whole (its tail slots lie in the same block on both sides and are
        overwritten later).
    num_rows : np.ndarray
        int64 ``[num_reqs]``: each request's rows, back to back in ``rows``.
    """
    # (a round's mapping is a few dozen numpy calls: each one is spared where it can be, and
    # the checks count with count_nonzero, a C call, rather than any/min, Python wrappers)
    num = np.asarray(num_tokens, dtype=np.int64)
    first_chunks: np.ndarray | None = None
    if first_tokens is not None:
        first = np.asarray(first_tokens, np.int64)
        if np.count_nonzero(first):  # else no request starts past its token 0
            first_chunks, off = np.divmod(first, chunk_tokens)
            if np.count_nonzero(off) or np.count_nonzero(first < 0):
                raise ValueError(
                    f"chunk_tokens ({chunk_tokens}) must divide block_size ({block_size}) and "
                    f"every first token, which must be >= 0 (got {first.tolist()})")
    q, rem = divmod(block_size, chunk_tokens)  # chunks per block
    if rem:
        raise ValueError(f"chunk_tokens ({chunk_tokens}) must divide block_size ({block_size})"
                         " and every first token")
    if np.count_nonzero(num < 0):
        raise ValueError(f"num_tokens must be >= 0, got {num.tolist()}")
    # (a new array: it is returned)
    counts = num.copy() if chunk_tokens == 1 else (num + (chunk_tokens - 1)) // chunk_tokens
    # chunks each request's blocks hold past the ones it moves (from its first block on):
    # negative means its blocks are too few
    counts_blocks = np.asarray(block_counts)  # (an int32 table's counts: no conversion)
    spare = (counts_blocks * q if q > 1 else counts_blocks) - counts
    if first_chunks is not None:
        spare -= first_chunks
    tight = not np.count_nonzero(spare)  # the common round: the blocks hold just the chunks
    if not tight:
        short = spare < 0
        if first_chunks is not None:
            short &= num > 0  # no tokens: nothing read
        if np.count_nonzero(short):
            i = int(short.argmax())
            end = (0 if first_chunks is None else int(first_chunks[i]) * chunk_tokens
                   ) + int(num[i])
            raise ValueError(
                f"request {i}: block_ids holds {counts_blocks[i]} blocks of {block_size} "
                f"tokens; tokens up to {end} need {-(-end // block_size)}"
            )
    ids = np.asarray(block_ids)
    if ids.ndim == 2:  # a table: request i's blocks lead its row block_starts[i]
        if block_starts is None:
            raise ValueError("block_starts must give each request's row of a block table")
        rows_of = np.asarray(block_starts)
        if first_chunks is None and q == 1:  # each request's rows: the first blocks of its row
            if counts.size and int(np.maximum.reduce(counts)) > ids.shape[1]:
                raise ValueError(f"a block table of {ids.shape[1]} blocks per row is too "
                                 f"narrow for {int(counts.max())} blocks")
            return leading_blocks(ids, rows_of, counts, leading_masks(ids.shape[1])), counts
        block_starts, ids = rows_of.astype(np.int64) * ids.shape[1], ids.reshape(-1)
    row_starts = np.zeros(num.size + 1, dtype=np.int64)
    np.add.accumulate(counts, out=row_starts[1:])
    total = int(row_starts[-1])
    # chunk j of request i, counted in chunks from the start of the flat block_ids:
    # q * (its block's flat position) + (its chunk inside that block) = j + shift[i]
    shift: np.ndarray | None
    if block_starts is None:  # back to back: the chunks the earlier requests skip
        if first_chunks is None and tight:  # every request's rows follow the last one's
            shift = None
        else:
            shift = np.zeros(num.size, dtype=np.int64)
            skipped = spare[:-1] if first_chunks is None else spare[:-1] + first_chunks[:-1]
            np.add.accumulate(skipped, out=shift[1:])
            if first_chunks is not None:
                shift += first_chunks
    else:
        starts = np.asarray(block_starts, dtype=np.int64)
        shift = (starts * q if q > 1 else starts) - row_starts[:-1]
        if first_chunks is not None:
            shift += first_chunks
        if not np.count_nonzero(shift):
            shift = None
    if shift is None and q == 1:  # every request's chunks are its blocks, back to back
        return ids[:total].astype(np.int64), counts
    offset = np.arange(total)
    if shift is not None:
        offset += shift.repeat(counts)
    if q == 1:
        return ids[offset].astype(np.int64), counts
    return ids[offset // q].astype(np.int64) * q + offset % q, counts


@functools.lru_cache(maxsize=8)
def leading_masks(width: int) -> np.ndarray:
    """bool ``[width + 1, width]``, read-only: row ``c`` holds ``c`` leading ``True``, the
    masks of :func:`leading_blocks`, indexed per request (cheaper than a broadcast comparison
    at every width, and more so with a round's caches cold). Windows of one ``2 * width``
    array, not ``width ** 2`` bytes; made once per width (read-only, so shared)."""
    stair = np.zeros(2 * width, dtype=bool)
    stair[:width] = True
    return sliding_window_view(stair, width)[::-1]


def leading_blocks(table: np.ndarray, rows: np.ndarray, counts: np.ndarray,
                   masks: np.ndarray) -> np.ndarray:
    """The first ``counts[i]`` block ids of row ``rows[i]`` of ``table``, request after request
    (int64 ``[sum(counts)]``): :func:`chunk_rows_many` of whole blocks from each request's
    token 0, unchecked (its caller vouches for the arguments: ``table`` int ``[num_rows,
    width]``, ``rows`` in range, ``0 <= counts <= width``, both int ``[num_reqs]``, and
    ``masks`` equal to :func:`leading_masks` of ``width``).
    """
    # (an index, not take: take first copies the whole window view, width ** 2 bytes)
    return table.take(rows, axis=0)[masks[counts]].astype(np.int64)


def dcp_chunk_rows_many(block_ids: np.ndarray, block_starts: np.ndarray,
                        block_counts: np.ndarray, block_size: int, world_size: int,
                        interleave: int, chunk_tokens: int, first_tokens: np.ndarray,
                        num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each chunk of several requests lands on a context-parallel (DCP) side: the
    owning rank and its row there, by the table's CP slot formula.

    Every rank holds the same block ids; an allocator block holds ``block_size * world_size``
    tokens, and token ``p`` (offset ``v = p % (block_size * world_size)`` in its block ``b``)
    lives on rank ``(v // interleave) % world_size`` at slot ``block_ids[b] * block_size +
    (v // (world_size * interleave)) * interleave + v % interleave``. A chunk of
    ``chunk_tokens`` (dividing ``interleave``) starts a run of one rank, so it is contiguous
    there.

    Parameters
    ----------
    block_ids, block_starts, block_counts : np.ndarray
        As :func:`chunk_rows_many`: every request's allocator block ids (the same on every
        rank), int.
    block_size : int
        Tokens per block on one rank (the table's block size; the allocator's is
        ``block_size * world_size``); a multiple of ``interleave``.
    world_size, interleave : int
        The DCP group's size and its runs of tokens per rank.
    chunk_tokens : int
        Divides ``interleave`` and every ``first_tokens`` entry.
    first_tokens, num_tokens : np.ndarray
        int ``[num_reqs]``: each request moves tokens ``[first, first + num)``.

    Returns
    -------
    owners : np.ndarray
        int64 ``[total_chunks]``: the rank holding each chunk, request after request, each in
        token order.
    rows : np.ndarray
        int64 ``[total_chunks]``: its row on that rank (slot ``// chunk_tokens``).
    row_starts : np.ndarray
        int64 ``[num_reqs + 1]``: request ``i``'s chunks are ``[row_starts[i],
        row_starts[i + 1])``.
    """
    for name, value in (("world_size", world_size), ("interleave", interleave),
                        ("chunk_tokens", chunk_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if interleave % chunk_tokens or block_size % interleave:
        raise ValueError(f"chunk_tokens ({chunk_tokens}) must divide interleave ({interleave}), "
                         f"and interleave the block size ({block_size})")
    first = np.asarray(first_tokens, dtype=np.int64)
    num = np.asarray(num_tokens, dtype=np.int64)
    if (first % chunk_tokens).any() or (num < 0).any():
        raise ValueError(f"first tokens must be multiples of chunk_tokens ({chunk_tokens}) and "
                         f"num_tokens >= 0, got {first.tolist()} and {num.tolist()}")
    virtual = block_size * world_size
    counts_blocks = np.asarray(block_counts, dtype=np.int64)
    needed = -(-(first + num) // virtual) * (num > 0)
    short = np.flatnonzero(needed > counts_blocks)
    if short.size:
        i = int(short[0])
        raise ValueError(f"request {i}: block_ids holds {counts_blocks[i]} blocks of {virtual} "
                         f"tokens; tokens up to {first[i] + num[i]} need {needed[i]}")
    counts = -(-num // chunk_tokens)
    row_starts = np.zeros(num.size + 1, dtype=np.int64)
    np.cumsum(counts, out=row_starts[1:])
    # each chunk's first token position p, its block (flat index into block_ids) and offset v
    p = (np.repeat(first - row_starts[:-1] * chunk_tokens, counts)
         + np.arange(row_starts[-1]) * chunk_tokens)
    block = np.repeat(np.asarray(block_starts, dtype=np.int64), counts) + p // virtual
    v = p % virtual
    owners = (v // interleave) % world_size
    local = (v // (world_size * interleave)) * interleave + v % interleave
    slots = np.asarray(block_ids, dtype=np.int64)[block] * block_size + local
    return owners, slots // chunk_tokens, row_starts
