"""FlashInfer's CSR page table from the block table.

FlashInfer's paged KV cache describes request ``r`` by its pages
``kv_indices[kv_indptr[r] : kv_indptr[r+1]]`` and the number of tokens in its last page::

    num_pages[r]        = ceil(seq_lens[r] / page_size)        (0 for an empty request)
    kv_indptr           = [0, cumsum(num_pages)]                int32 [num_reqs + 1]
    kv_indices          = row r's first num_pages[r] ids, r = 0, 1, ...   int32 [kv_indptr[-1]]
    kv_last_page_len[r] = seq_lens[r] - (num_pages[r] - 1) * page_size    int32 [num_reqs]
                          (page_size for a full last page, 0 for an empty request)

``page_size`` is the kernel block size: the table's ids are FlashInfer page ids.
:func:`write_flashinfer_page_table` fills caller-owned device buffers without a host sync
(``device``, with the Triton kernel in ``csr_kernel``); :func:`flashinfer_indptr_host` and
:func:`flashinfer_page_table_host` give the same arrays with numpy from host-side sequence
lengths, for FlashInfer's ``plan()`` (``host``).
"""

from __future__ import annotations

from blocktable.flashinfer.device import write_flashinfer_page_table
from blocktable.flashinfer.host import flashinfer_indptr_host, flashinfer_page_table_host

__all__ = ["flashinfer_indptr_host", "flashinfer_page_table_host", "write_flashinfer_page_table"]
