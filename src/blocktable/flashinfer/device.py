"""Write FlashInfer's CSR page table into caller-owned device buffers, from the device table."""

from __future__ import annotations

import torch

from blocktable._checks import check_positive, check_tensor
from blocktable._triton import on_device, resolve_backend
from blocktable.flashinfer.csr_kernel import launch_flashinfer_page_table
from blocktable.flashinfer.host import num_pages_host


def write_flashinfer_page_table(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    seq_lens_cpu: object | None = None,
    backend: str = "auto",
) -> None:
    """Write FlashInfer's ``kv_indptr``, ``kv_indices`` and ``kv_last_page_len`` on the device.

    No host sync, no allocation and one launch on CUDA, so it can be captured in a CUDA graph.
    Entries of ``kv_indices`` past ``kv_indptr[-1]`` are left as they were.

    Parameters
    ----------
    block_table : torch.Tensor
        int32 ``[>= num_reqs, width]``, kernel block ids (the table's device view).
    seq_lens : torch.Tensor
        int32 ``[num_reqs]`` on the table's device, tokens in the cache per request.
    page_size : int
        Tokens per page: the kernel block size of the table.
    kv_indptr : torch.Tensor
        int32 ``[num_reqs + 1]``, contiguous, on the table's device; written.
    kv_indices : torch.Tensor
        int32 ``[capacity]``, contiguous, on the table's device; ``[0, kv_indptr[-1])`` is
        written, and nothing is ever written past ``capacity``.
    kv_last_page_len : torch.Tensor
        int32 ``[num_reqs]``, contiguous, on the table's device; written.
    seq_lens_cpu : array-like, optional
        Host copy of ``seq_lens`` (list, numpy array or CPU tensor). When given, the page count
        is checked against ``capacity`` and ``width`` with no device read. Without it,
        ``capacity`` must hold every row whole (``num_reqs * width``).
    backend : {"auto", "triton", "torch"}
        ``"auto"``: the Triton kernel on CUDA, torch ops on CPU. ``"triton"`` on CPU tensors
        needs ``TRITON_INTERPRET=1``; ``"torch"`` on CUDA synchronizes (boolean masking).
        Both give identical arrays.

    Raises
    ------
    ValueError
        When ``kv_indices`` is too small, or a host-side ``seq_len`` exceeds
        ``width * page_size``. A device-side ``seq_len`` beyond the row is clamped to the row.

    Examples
    --------
    >>> import torch
    >>> from blocktable.flashinfer import write_flashinfer_page_table
    >>> block_table = torch.tensor([[5, 6, 0], [7, 0, 0]], dtype=torch.int32)
    >>> seq_lens = torch.tensor([20, 16], dtype=torch.int32)
    >>> kv_indptr = torch.empty(3, dtype=torch.int32)
    >>> kv_indices = torch.zeros(6, dtype=torch.int32)
    >>> kv_last_page_len = torch.empty(2, dtype=torch.int32)
    >>> write_flashinfer_page_table(block_table, seq_lens, 16, kv_indptr, kv_indices,
    ...                             kv_last_page_len)
    >>> kv_indptr.tolist(), kv_indices[:3].tolist(), kv_last_page_len.tolist()
    ([0, 2, 3], [5, 6, 7], [4, 16])
    """
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    device = block_table.device
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=device)
    num_reqs, width = seq_lens.shape[0], block_table.shape[1]
    if block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table must have at least num_reqs={num_reqs} rows (one per entry of "
            f"seq_lens), got {block_table.shape[0]}"
        )
    page_size = check_positive("page_size", page_size)
    backend = resolve_backend(backend, device)
    i32 = torch.int32
    check_tensor(
        "kv_indptr", kv_indptr, dtype=i32, shape=(num_reqs + 1,), device=device, contiguous=True
    )
    check_tensor("kv_indices", kv_indices, dtype=i32, ndim=1, device=device, contiguous=True)
    check_tensor(
        "kv_last_page_len",
        kv_last_page_len,
        dtype=i32,
        shape=(num_reqs,),
        device=device,
        contiguous=True,
    )
    capacity = kv_indices.shape[0]
    if seq_lens_cpu is None:
        if capacity < num_reqs * width:
            raise ValueError(
                f"kv_indices holds {capacity} entries, less than num_reqs * width = "
                f"{num_reqs * width}: pass seq_lens_cpu so the real page count can be checked"
            )
    else:
        num_pages = num_pages_host("seq_lens_cpu", seq_lens_cpu, page_size, num_reqs, width)
        if capacity < num_pages.sum():
            raise ValueError(
                f"kv_indices holds {capacity} entries, less than the {int(num_pages.sum())} "
                f"pages of seq_lens_cpu"
            )

    if num_reqs == 0:
        kv_indptr.zero_()
    elif backend == "triton":
        with on_device(block_table):
            launch_flashinfer_page_table(
                block_table, seq_lens, page_size, kv_indptr, kv_indices, kv_last_page_len
            )
    else:
        _write_torch(
            block_table[:num_reqs], seq_lens, page_size, kv_indptr, kv_indices, kv_last_page_len
        )


def _write_torch(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
) -> None:
    width = block_table.shape[1]
    seq = seq_lens.long().clamp_min(0)
    num_pages = ((seq + page_size - 1) // page_size).clamp_max(width)
    kv_indptr[0] = 0
    kv_indptr[1:] = torch.cumsum(num_pages, 0)
    last = (seq - (num_pages - 1) * page_size).clamp_max(page_size)
    kv_last_page_len.copy_(torch.where(num_pages > 0, last, 0))
    in_use = torch.arange(width, device=block_table.device)[None, :] < num_pages[:, None]
    ids = block_table[in_use][: kv_indices.shape[0]]  # row-major: row 0's pages first
    kv_indices[: ids.shape[0]] = ids
