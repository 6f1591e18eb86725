"""FlashInfer's CSR arrays from host-side sequence lengths, with numpy (no device read)."""

from __future__ import annotations

import numpy as np

from blocktable._checks import as_index_array, check_positive


def num_pages_host(
    name: str, seq_lens: object, page_size: int, num_reqs: int | None, width: int | None
) -> np.ndarray:
    """Pages per request, ``ceil(seq_len / page_size)``, checking the lengths named ``name``."""
    seq = as_index_array(name, seq_lens)
    if num_reqs is not None and seq.shape[0] != num_reqs:
        raise ValueError(f"{name} must have shape [{num_reqs}], got {list(seq.shape)}")
    if seq.size and seq.min() < 0:
        i = int(np.argmin(seq))
        raise ValueError(f"{name}[{i}]={int(seq[i])} must be >= 0")
    num_pages = -(-seq // page_size)
    if width is not None and seq.size and num_pages.max() > width:
        i = int(np.argmax(num_pages))
        raise ValueError(
            f"{name}[{i}]={int(seq[i])} exceeds the row's width * page_size = {width * page_size}"
        )
    return num_pages


def flashinfer_indptr_host(seq_lens: object, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``kv_indptr`` and ``kv_last_page_len`` from host-side sequence lengths, with numpy.

    What FlashInfer's ``plan()`` reads on the host, with no device-to-host copy.

    Parameters
    ----------
    seq_lens : array-like
        ``[num_reqs]`` integers >= 0 on the host (list, numpy array or CPU tensor).
    page_size : int
        Tokens per page (the kernel block size).

    Returns
    -------
    kv_indptr : np.ndarray
        int32 ``[num_reqs + 1]``.
    kv_last_page_len : np.ndarray
        int32 ``[num_reqs]``.

    Examples
    --------
    >>> from blocktable.flashinfer import flashinfer_indptr_host
    >>> kv_indptr, kv_last_page_len = flashinfer_indptr_host([20, 16, 0], 16)
    >>> kv_indptr.tolist(), kv_last_page_len.tolist()
    ([0, 2, 3, 3], [4, 16, 0])
    """
    page_size = check_positive("page_size", page_size)
    seq = as_index_array("seq_lens", seq_lens)
    num_pages = num_pages_host("seq_lens", seq, page_size, None, None)
    kv_indptr = np.zeros(seq.shape[0] + 1, dtype=np.int32)
    np.cumsum(num_pages, out=kv_indptr[1:], dtype=np.int32)
    kv_last_page_len = np.where(num_pages > 0, seq - (num_pages - 1) * page_size, 0)
    return kv_indptr, kv_last_page_len.astype(np.int32)


def flashinfer_page_table_host(
    block_table: np.ndarray, seq_lens: object, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All three FlashInfer arrays from the host-side block table, with numpy.

    Parameters
    ----------
    block_table : np.ndarray
        int32 ``[>= num_reqs, width]`` on the host (the table's numpy view), kernel block ids.
    seq_lens : array-like
        ``[num_reqs]`` integers in ``[0, width * page_size]`` on the host.
    page_size : int
        Tokens per page (the kernel block size).

    Returns
    -------
    kv_indptr : np.ndarray
        int32 ``[num_reqs + 1]``.
    kv_indices : np.ndarray
        int32 ``[kv_indptr[-1]]``.
    kv_last_page_len : np.ndarray
        int32 ``[num_reqs]``.

    Examples
    --------
    >>> import numpy as np
    >>> from blocktable.flashinfer import flashinfer_page_table_host
    >>> table = np.array([[5, 6, 0], [7, 0, 0]], dtype=np.int32)
    >>> [a.tolist() for a in flashinfer_page_table_host(table, [20, 16], 16)]
    [[0, 2, 3], [5, 6, 7], [4, 16]]
    """
    table = np.asarray(block_table)
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
        raise ValueError(
            f"block_table must be a 2-D integer array, got shape {list(table.shape)} and "
            f"dtype {table.dtype}"
        )
    page_size = check_positive("page_size", page_size)
    seq = as_index_array("seq_lens", seq_lens)
    if table.shape[0] < seq.shape[0]:
        raise ValueError(
            f"block_table must have at least num_reqs={seq.shape[0]} rows, got {table.shape[0]}"
        )
    num_pages = num_pages_host("seq_lens", seq, page_size, None, table.shape[1])
    kv_indptr, kv_last_page_len = flashinfer_indptr_host(seq, page_size)
    in_use = np.arange(table.shape[1])[None, :] < num_pages[:, None]
    kv_indices = table[: seq.shape[0]][in_use].astype(np.int32)
    return kv_indptr, kv_indices, kv_last_page_len
