"""Gather chunks of every layer's K and V into a contiguous buffer, and scatter it back.

One ``index_select`` over the cache viewed as ``[num_layers * 2, num_chunks, chunk_elems]``
reads every layer, K and V, of the chosen chunks (one launch); one ``index_copy_`` writes them.

A :class:`StagingBuffer` owns the memory a side gathers into or receives into, and splits a
transfer into *pieces* of about ``piece_bytes``: the piece ``k + 1`` is gathered while piece
``k`` is on the wire, and the receiver scatters piece ``k`` while ``k + 1`` arrives. Both sides
split the same number of rows the same way (:func:`piece_bounds`, the sender's rows per
piece), so the pieces match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch


def chunk_view(kv_cache: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """``kv_cache`` (``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
    contiguous) as ``[num_layers * 2, num_slots // chunk_tokens, chunk_tokens * num_kv_heads *
    head_dim]``, sharing its memory."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    num_layers, two, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if block_size % chunk_tokens:
        raise ValueError(f"chunk_tokens ({chunk_tokens}) must divide the cache's block size "
                         f"({block_size})")
    num_chunks = num_blocks * block_size // chunk_tokens
    return kv_cache.view(num_layers * two, num_chunks, chunk_tokens * num_kv_heads * head_dim)


def _rows_tensor(rows: np.ndarray, view: torch.Tensor, name: str) -> torch.Tensor:
    if rows.size and (rows.min() < 0 or rows.max() >= view.shape[1]):
        raise ValueError(f"{name} must lie in [0, {view.shape[1]}), got "
                         f"[{rows.min()}, {rows.max()}]")
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(view.device)


def gather_chunks(kv_cache: torch.Tensor, rows: np.ndarray, chunk_tokens: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Those chunk rows of every layer, as a contiguous ``[num_layers * 2, len(rows),
    chunk_tokens * num_kv_heads * head_dim]`` tensor (the cache's dtype and device): ``out``
    when given (that shape, contiguous), else a new tensor."""
    view = chunk_view(kv_cache, chunk_tokens)
    index = _rows_tensor(rows, view, "rows")
    if out is None:
        return view.index_select(1, index)
    _check_buffer(out, view, len(rows), "out")
    return torch.index_select(view, 1, index, out=out)


def scatter_chunks(kv_cache: torch.Tensor, rows: np.ndarray, chunk_tokens: int,
                   buffer: torch.Tensor) -> None:
    """Write ``buffer`` (as :func:`gather_chunks` returns) into those chunk rows."""
    view = chunk_view(kv_cache, chunk_tokens)
    _check_buffer(buffer, view, len(rows), "buffer")
    _scatter_rows(view, _rows_tensor(rows, view, "rows"), buffer)


def _scatter_rows(view: torch.Tensor, index: torch.Tensor, buffer: torch.Tensor) -> None:
    """``view[:, index] = buffer`` (both checked by the caller)."""
    # index_copy_ walks element by element on the CPU: 8-byte words move 4x fewer of them
    # than bfloat16 (the bytes written are the same)
    if (view.shape[2] * view.element_size()) % 8 == 0 and view.dtype.itemsize < 8:
        view, buffer = view.view(torch.int64), buffer.view(torch.int64)
    view.index_copy_(1, index, buffer)


def _check_buffer(buffer: torch.Tensor, view: torch.Tensor, num_rows: int, name: str) -> None:
    expected = (view.shape[0], num_rows, view.shape[2])
    if (tuple(buffer.shape) != expected or buffer.dtype != view.dtype
            or buffer.device != view.device or not buffer.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous {view.dtype} {list(expected)} on "
                         f"{view.device}, got {buffer.dtype} {list(buffer.shape)} on "
                         f"{buffer.device}")


GPU_PIECE_BYTES = 64 << 20
"""A GPU side's send-buffer pieces unless told (:func:`default_piece_bytes`)."""


def default_piece_bytes(device: torch.device | str) -> int:
    """The send buffer's piece size for a cache on ``device`` unless a side is told: 64 MiB
    pieces on a GPU, each gathered by a kernel while the one before travels; the whole buffer
    at once on the CPU, where the gather and the scatter share the cores and the memory bus
    with the wire's own copies (measured with ``benchmarks/bench_transfer.py`` on 2 cores:
    pieces sent while the next is gathered cost more CPU time than they overlapped)."""
    return GPU_PIECE_BYTES if torch.device(device).type == "cuda" else 1 << 62


def piece_bounds(num_rows: int, rows_per_piece: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` splitting ``num_rows`` rows into pieces of ``rows_per_piece``
    (the last may be shorter); no piece for no rows."""
    if rows_per_piece < 1:
        raise ValueError(f"rows_per_piece must be >= 1, got {rows_per_piece}")
    return [(a, min(a + rows_per_piece, num_rows)) for a in range(0, num_rows, rows_per_piece)]


class StagingBuffer:
    """One side's reusable memory for moved chunks, split into pieces.

    Allocated once and grown (never shrunk) when a larger transfer comes: a fresh buffer per
    round would make every round fault in its pages, which on the CPU costs more than the copy.

    Parameters
    ----------
    piece_bytes : int
        Bytes per piece (rounded down to whole rows, at least one row). A very large value
        sends one piece: one gather launch and one send.
    """

    def __init__(self, piece_bytes: int = GPU_PIECE_BYTES) -> None:
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
        self.piece_bytes = int(piece_bytes)
        self._memory: torch.Tensor | None = None  # flat, the cache's dtype and device

    def rows_per_piece(self, view: torch.Tensor) -> int:
        """Chunk rows per piece for a cache seen as ``view`` (:func:`chunk_view`)."""
        row_bytes = view.shape[0] * view.shape[2] * view.element_size()
        return max(1, self.piece_bytes // row_bytes)

    def pieces(self, view: torch.Tensor, num_rows: int, rows_per_piece: int | None = None
               ) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, stop, piece)`` for each piece of ``num_rows`` rows: ``piece`` is a
        contiguous ``[num_layers * 2, stop - start, chunk_elems]`` tensor in this buffer's
        memory (valid until the next call). ``rows_per_piece``: the sender's split (default
        this buffer's own)."""
        bounds = piece_bounds(num_rows, rows_per_piece or self.rows_per_piece(view))
        layers2, row_elems = view.shape[0], view.shape[2]
        need = layers2 * num_rows * row_elems
        memory = self._memory
        if (memory is None or memory.numel() < need or memory.dtype != view.dtype
                or memory.device != view.device):
            memory = self._memory = torch.empty(need, dtype=view.dtype, device=view.device)
        out, offset = [], 0
        for a, b in bounds:
            size = layers2 * (b - a) * row_elems
            out.append((a, b, memory[offset:offset + size].view(layers2, b - a, row_elems)))
            offset += size
        return out

    def gather(self, kv_cache: torch.Tensor, rows: np.ndarray, chunk_tokens: int
               ) -> Iterator[torch.Tensor]:
        """Piece after piece of :func:`gather_chunks` for ``rows``, each gathered when the
        caller asks for it (after sending the one before). ``rows`` are checked and converted
        here, once, before any piece: a bad row raises at the call, not halfway through a
        transfer."""
        view = chunk_view(kv_cache, chunk_tokens)
        index = _rows_tensor(rows, view, "rows")
        pieces = self.pieces(view, len(rows))
        return (torch.index_select(view, 1, index[a:b], out=piece) for a, b, piece in pieces)

    def scatter(self, kv_cache: torch.Tensor, rows: np.ndarray, chunk_tokens: int,
                rows_per_piece: int,
                receive: Callable[[Sequence[torch.Tensor]], Iterator[int]]) -> None:
        """Receive the sender's pieces of ``rows`` into this buffer and write each into the
        cache (:func:`scatter_chunks`) while the next one arrives. ``receive``: a transport's
        ``recv_tensors``; ``rows_per_piece``: the sender's split. ``rows`` are checked and
        converted once, before anything is received."""
        view = chunk_view(kv_cache, chunk_tokens)
        index = _rows_tensor(rows, view, "rows")
        pieces = self.pieces(view, len(rows), rows_per_piece)
        for k in receive([piece for _, _, piece in pieces]):
            start, stop, piece = pieces[k]
            _scatter_rows(view, index[start:stop], piece)
