"""FlashInfer itself reads blocktable's CSR export: its decode and prefill wrappers must give
the reference's attention (empty requests included). Skipped without CUDA and ``flashinfer``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from blocktable.attention import paged_attention_reference
from blocktable.flashinfer import flashinfer_page_table_host, write_flashinfer_page_table

flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(flashinfer is None, reason="needs CUDA and flashinfer")

PAGE, HEADS, KV_HEADS, DIM = 16, 8, 2, 128


def make_batch(reqs: list[tuple[int, int]], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(s / PAGE) for s, _ in reqs]
    width = max(blocks) + 1
    num_blocks = sum(blocks) + 1
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()
    table = torch.zeros(len(reqs), width, dtype=torch.int32)
    at = 0
    for r, n in enumerate(blocks):
        table[r, :n] = ids[at : at + n]
        at += n
    shape = (num_blocks, PAGE, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16).cuda()
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16).cuda()
    qsl = torch.tensor(np.cumsum([0] + [q for _, q in reqs]), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), HEADS, DIM, generator=gen).to(torch.bfloat16).cuda()
    seq = torch.tensor([s for s, _ in reqs], dtype=torch.int32)
    return query, k_cache, v_cache, table.cuda(), seq.cuda(), qsl.cuda()


def csr_export(table: torch.Tensor, seq: torch.Tensor):
    num_reqs = seq.shape[0]
    kv_indptr = torch.empty(num_reqs + 1, dtype=torch.int32, device="cuda")
    kv_indices = torch.zeros(table.numel(), dtype=torch.int32, device="cuda")
    kv_last = torch.empty(num_reqs, dtype=torch.int32, device="cuda")
    write_flashinfer_page_table(table, seq, PAGE, kv_indptr, kv_indices, kv_last)
    host = flashinfer_page_table_host(table.cpu().numpy(), seq.cpu().numpy(), PAGE)
    assert kv_indptr.tolist() == host[0].tolist()
    assert kv_last.tolist() == host[2].tolist()
    return kv_indptr, kv_indices, kv_last


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().norm())


def test_flashinfer_decode_reads_the_export() -> None:
    reqs = [(37, 1), (16, 1), (200, 1), (1, 1)]
    query, k_cache, v_cache, table, seq, qsl = make_batch(reqs)
    kv_indptr, kv_indices, kv_last = csr_export(table, seq)
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    wrapper.plan(kv_indptr, kv_indices, kv_last, HEADS, KV_HEADS, DIM, PAGE,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out = wrapper.run(query, (k_cache, v_cache))
    ref = paged_attention_reference(query, k_cache, v_cache, table, seq, qsl)
    assert rel_err(out, ref) < 1e-2


def test_flashinfer_prefill_reads_the_export_with_empty_requests() -> None:
    """Prefill, a chunk over a cached prefix, decode, and empty requests
    (``kv_last_page_len = 0``, no pages, no queries)."""
    reqs = [(40, 40), (0, 0), (70, 23), (33, 1), (0, 0)]
    query, k_cache, v_cache, table, seq, qsl = make_batch(reqs, seed=1)
    kv_indptr, kv_indices, kv_last = csr_export(table, seq)
    assert kv_last[1].item() == 0 and kv_last[4].item() == 0
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    wrapper.plan(qsl, kv_indptr, kv_indices, kv_last, HEADS, KV_HEADS, DIM, PAGE, causal=True,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out = wrapper.run(query, (k_cache, v_cache))
    ref = paged_attention_reference(query, k_cache, v_cache, table, seq, qsl)
    assert rel_err(out, ref) < 1e-2
