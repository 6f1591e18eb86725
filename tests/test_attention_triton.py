"""The Triton paged attention (prefill, chunks, decode, mixed) against the float64 reference.

Runs on CUDA when present, else on CPU tensors under Triton's interpreter (tiny shapes). Errors
are relative: ``||out - ref|| / ||ref||``; LSEs are compared where finite and must be ``-inf``
exactly where the reference's are.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from fake_graph import graph_for

from blocktable.attention import (
    KernelConfig,
    PagedAttention,
    paged_attention,
    paged_attention_reference,
    paged_decode_attention,
)
from blocktable.attention.cp_layout import CPLayout, global_positions, local_seq_len
from blocktable.attention.kernel_config import DecodeSchedule, default_config
from blocktable.config import CPConfig
from blocktable.constants import NULL_BLOCK_ID

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
LSE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def launch_paged_attention(
    out: torch.Tensor, lse: torch.Tensor | None, query: torch.Tensor, *args: object,
    config: KernelConfig | None = None, **kwargs: object,
) -> None:
    """The kernels on checked inputs through a fresh planner (its own workspace)."""
    PagedAttention(query.device, config).launch(out, lse, query, *args, **kwargs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / max(float(ref.norm()), 1e-30))


def check_lse(lse: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    lse, ref = lse.cpu().double(), ref.cpu().double()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    assert (lse[finite] - ref[finite]).abs().max().item() <= LSE_TOLERANCE[dtype]


def make_case(
    reqs: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    pad_tokens: int = 0,
    seed: int = 0,
    extra_rows: int = 0,
):
    """Requests ``(seq_len, query_len)`` with their blocks at random distinct ids (never the
    null block); the null block holds NaN (a read of it poisons the output)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(s / block_size) for s, _ in reqs]
    width = max(blocks + [1]) + 1
    num_blocks = sum(blocks) + 2
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.full((len(reqs) + extra_rows, width), NULL_BLOCK_ID, dtype=torch.int32)
    for r, n in enumerate(blocks):
        table[r, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_cache[NULL_BLOCK_ID] = float("nan")
    v_cache[NULL_BLOCK_ID] = float("nan")
    num_tokens = sum(q for _, q in reqs) + pad_tokens
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor(np.cumsum([0] + [q for _, q in reqs]), dtype=torch.int32)
    seq = torch.tensor([s for s, _ in reqs], dtype=torch.int32)
    return [t.to(device) for t in (query, k_cache, v_cache, table, seq, qsl)]


def reference(query, k_cache, v_cache, table, seq, qsl, **kwargs):
    return paged_attention_reference(
        query.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(), table.cpu(),
        seq.cpu(), qsl.cpu(), return_lse=True, **kwargs,
    )


# decode, prefill, a chunk over a cached prefix crossing blocks, an empty request, decode.
MIXED = [(13, 1), (9, 9), (23, 6), (0, 0), (5, 0), (2, 1)]

CASES = [
    # block_size, num_kv_heads, group, head_dim, dtype
    (4, 1, 1, 16, torch.float32),
    (6, 2, 2, 16, torch.float32),
    (16, 1, 4, 64, torch.float16),
    (32, 1, 8, 16, torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-kv{c[1]}-g{c[2]}-d{c[3]}-{c[4]}")
@pytest.mark.parametrize("window", [None, 7])
def test_mixed_batch_matches_reference(triton_device: str, case, window) -> None:
    block_size, num_kv_heads, group, head_dim, dtype = case
    args = make_case(MIXED, block_size, num_kv_heads, group, head_dim, dtype, triton_device,
                     pad_tokens=3, seed=block_size)
    out, lse = paged_attention(*args, sliding_window=window, scale=0.3, return_lse=True,
                               backend="triton")
    ref, ref_lse = reference(*args, sliding_window=window, scale=0.3)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOLERANCE[dtype]
    check_lse(lse, ref_lse, dtype)
    num_real = int(args[5][-1])
    assert (out[num_real:] == 0).all() and torch.isneginf(lse[num_real:]).all()


@pytest.mark.parametrize("window", [None, 7])
def test_min_query_len_leaves_every_request_to_the_prefill_kernel(
    triton_device: str, window, monkeypatch
) -> None:
    """A lower bound above the decode kernel's rows: one launch (no decode plan is built),
    and a bound that is wrong (decode requests, an empty one, pad tokens) changes nothing."""
    from blocktable.attention import planner

    args = make_case(MIXED, 6, 2, 2, 16, torch.float32, triton_device, pad_tokens=3, seed=11)
    ref, ref_lse = reference(*args, sliding_window=window)

    def no_decode(*a, **k):
        raise AssertionError("the decode kernel was planned")

    monkeypatch.setattr(planner.DecodePlan, "build", no_decode)
    out, lse = paged_attention(*args, sliding_window=window, min_query_len=9, return_lse=True,
                               backend="triton")
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    check_lse(lse, ref_lse, torch.float32)
    num_real = int(args[5][-1])
    assert (out[num_real:] == 0).all() and torch.isneginf(lse[num_real:]).all()
    monkeypatch.undo()  # a bound at or below the decode rows keeps both kernels
    out2 = paged_attention(*args, sliding_window=window, min_query_len=8, backend="triton")
    assert rel_err(out2, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_decode_step_split_kv(triton_device: str, num_kv_splits: int) -> None:
    """max_query_len=1: the decode kernel alone, keys split over programs (more splits than
    some requests have tiles), pad tokens after the last request."""
    reqs = [(37, 1), (1, 1), (0, 0), (20, 1)]
    args = make_case(reqs, 4, 2, 2, 16, torch.float32, triton_device, pad_tokens=2, seed=1)
    out, lse = paged_attention(*args, max_query_len=1, num_kv_splits=num_kv_splits,
                               return_lse=True, backend="triton")
    ref, ref_lse = reference(*args)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    check_lse(lse, ref_lse, torch.float32)


def test_short_queries_and_a_long_one_split(triton_device: str) -> None:
    """Spec-decode-like queries of 2 and 4 tokens (decode kernel, split) beside a prefill."""
    reqs = [(30, 2), (17, 17), (11, 4), (6, 3)]
    args = make_case(reqs, 6, 1, 4, 16, torch.float32, triton_device, seed=2)
    out, lse = paged_attention(*args, num_kv_splits=2, return_lse=True, backend="triton")
    ref, ref_lse = reference(*args)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    check_lse(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("max_query_len", [None, 1])
def test_window_never_reads_null_entries_before_it(triton_device: str, max_query_len) -> None:
    """Blocks wholly before every query's window are NULL in the table; the null block holds
    NaN; the window (5) cuts through blocks of 4."""
    window, block_size = 5, 4
    reqs = [(29, 1), (22, 1), (9, 1)] if max_query_len else [(29, 1), (22, 6), (9, 9)]
    query, k_cache, v_cache, table, seq, qsl = make_case(
        reqs, block_size, 1, 2, 16, torch.float32, "cpu", seed=3
    )
    full_ref, full_lse = reference(query, k_cache, v_cache, table, seq, qsl, sliding_window=window)
    for r, (seq_len, query_len) in enumerate(reqs):
        first_seen = max(0, seq_len - query_len - window + 1)
        table[r, : first_seen // block_size] = NULL_BLOCK_ID
    args = [t.to(triton_device) for t in (query, k_cache, v_cache, table, seq, qsl)]
    out, lse = paged_attention(*args, sliding_window=window, max_query_len=max_query_len,
                               return_lse=True, backend="triton")
    assert torch.isfinite(out).all()
    assert rel_err(out, full_ref) < TOLERANCE[torch.float32]
    check_lse(lse, full_lse, torch.float32)


def test_row_of_batch_strided_inputs_and_buffers_in_place(triton_device: str) -> None:
    """Indexed rows; K/V halves of one [num_blocks, 2, ...] tensor (interleaved strides); a
    query sliced from a wider tensor (not 16-byte aligned); out and lse_out filled with
    garbage beforehand and written in place."""
    reqs = [(10, 3), (7, 1), (18, 18)]
    query, k_cache, v_cache, table, seq, qsl = make_case(
        reqs, 4, 2, 2, 16, torch.float32, "cpu", pad_tokens=1, seed=4, extra_rows=2
    )
    perm = torch.tensor([4, 0, 2, 1, 3])
    table = table[perm.argsort()]  # request r's row is now perm[r]
    row_of_batch = perm[:3].int()
    kv = torch.stack([k_cache, v_cache], dim=1)  # [num_blocks, 2, block, heads, dim]
    wide = torch.randn(query.shape[0], query.shape[1], 40)
    wide[..., 5:21] = query
    dev = triton_device
    out = torch.full(query.shape, float("nan"), device=dev)
    lse_out = torch.full(query.shape[:2], 7.0, device=dev)
    result, lse = paged_attention(
        wide.to(dev)[..., 5:21], kv[:, 0].to(dev), kv[:, 1].to(dev), table.to(dev),
        seq.to(dev), qsl.to(dev), row_of_batch=row_of_batch.to(dev), out=out,
        lse_out=lse_out, backend="triton",
    )
    assert result is out and lse is lse_out
    ref, ref_lse = reference(query, k_cache, v_cache, table, seq, qsl, row_of_batch=row_of_batch)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    check_lse(lse_out, ref_lse, torch.float32)


@pytest.mark.parametrize("window", [None, 5])
def test_v_cache_with_other_strides_than_k_cache(triton_device: str, window) -> None:
    """K and V may be laid out differently (heads-major V): V's own strides are used."""
    args = make_case(MIXED, 4, 2, 2, 16, torch.float32, triton_device, pad_tokens=2, seed=12)
    query, k_cache, v_cache, table, seq, qsl = args
    v_other = v_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert v_other.stride() != k_cache.stride()
    torch.testing.assert_close(v_other, v_cache, rtol=0, atol=0, equal_nan=True)
    out = paged_attention(query, k_cache, v_other, table, seq, qsl, sliding_window=window,
                          backend="triton")
    ref, _ = reference(*args, sliding_window=window)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_out_of_range_block_ids_are_never_read(triton_device: str) -> None:
    """Corrupt table entries (beyond the cache, negative) and a seq_len beyond the row: no
    read outside the cache, finite output; the rest of the batch is unaffected."""
    reqs = [(12, 4), (9, 1), (6, 6)]
    query, k_cache, v_cache, table, seq, qsl = make_case(reqs, 4, 1, 2, 16, torch.float32, "cpu")
    ref, _ = reference(query, k_cache, v_cache, table, seq, qsl)
    table[0, 1] = k_cache.shape[0] + 1000
    table[0, 2] = -5
    seq_bad = seq.clone()
    seq_bad[2] = 4 * table.shape[1] + 40  # beyond the row: clamped on the device
    args = [t.to(triton_device) for t in (query, k_cache, v_cache, table, seq_bad, qsl)]
    out = paged_attention(*args, backend="triton")
    assert torch.isfinite(out[:4]).all()
    assert rel_err(out[4:5], ref[4:5]) < TOLERANCE[torch.float32]


def place_sharded(keys, values, table, block_size, world, rank, interleave, cp_block):
    """Caches holding rank ``rank``'s keys at its local positions through ``table``."""
    num_blocks = int(table.max()) + 1
    shape = (num_blocks, block_size, keys[0].shape[1], keys[0].shape[2])
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    kw = {"world_size": world, "rank": rank, "interleave": interleave,
          "manager_block_size": cp_block}
    for r, (k, v) in enumerate(zip(keys, values)):
        n = local_seq_len(k.shape[0], **kw)
        local = np.arange(n)
        glob = torch.from_numpy(global_positions(local, **kw))
        local_t = torch.from_numpy(local)
        ids = table[r, local_t // block_size].long()
        k_cache[ids, local_t % block_size] = k[glob]
        v_cache[ids, local_t % block_size] = v[glob]
    return k_cache, v_cache


@pytest.mark.parametrize(("world", "interleave"), [(2, 1), (2, 4), (3, 1), (3, 4)])
def test_cp_shards_merge_to_unsharded(triton_device: str, world: int, interleave: int) -> None:
    """Every rank's kernel output equals the reference on its shard, and the ranks' outputs
    merged by their LSEs equal attention over the unsharded sequence (LSE too)."""
    gen = torch.Generator().manual_seed(world * 10 + interleave)
    block_size, cp_block, heads, kv_heads, dim = 4, 8, 4, 2, 16
    reqs = [(21, 1), (11, 11), (26, 6), (2, 2), (0, 0)]  # a request shorter than I * W
    keys = [torch.randn(s, kv_heads, dim, generator=gen) for s, _ in reqs]
    values = [torch.randn(s, kv_heads, dim, generator=gen) for s, _ in reqs]
    qsl = torch.tensor(np.cumsum([0] + [q for _, q in reqs]), dtype=torch.int32)
    seq = torch.tensor([s for s, _ in reqs], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]) + 1, heads, dim, generator=gen)
    width = 8
    table = (torch.randperm(len(reqs) * width, generator=gen) + 1).int().view(len(reqs), width)
    full_k, full_v = place_sharded(keys, values, table, block_size, 1, 0, 1, cp_block)
    expected, expected_lse = reference(query, full_k, full_v, table, seq, qsl, sliding_window=9)
    outs, lses = [], []
    for rank in range(world):
        cp = CPConfig(world, rank, interleave)
        k_cache, v_cache = place_sharded(keys, values, table, block_size, world, rank,
                                         interleave, cp_block)
        args = [t.to(triton_device) for t in (query, k_cache, v_cache, table, seq, qsl)]
        out, lse = paged_attention(*args, cp=cp, cp_block_size=cp_block, sliding_window=9,
                                   return_lse=True, backend="triton")
        ref, ref_lse = reference(*args, cp=cp, cp_block_size=cp_block, sliding_window=9)
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
        check_lse(lse, ref_lse, torch.float32)
        outs.append(out.cpu().double())
        lses.append(lse.cpu().double())
    lse_all = torch.stack(lses)
    total = torch.logsumexp(lse_all, dim=0)
    weights = torch.where(torch.isfinite(lse_all), (lse_all - total).exp(), 0.0)
    merged = (weights[..., None] * torch.stack(outs)).sum(0)
    assert rel_err(merged, expected) < 1e-5
    check_lse(total, expected_lse, torch.float32)


def test_paged_decode_attention_lse_cp_and_row_of_batch(triton_device: str) -> None:
    """The decode entry point: block size 6, pad row (seq_len 0), CP rank 1 of 2, LSE."""
    reqs = [(30, 1), (0, 0), (13, 1)]
    query, k_cache, v_cache, table, seq, _ = make_case(reqs, 6, 1, 4, 16, torch.float32, "cpu")
    query = torch.randn(3, 4, 16)
    cp = CPConfig(2, 1, 2)
    dev = triton_device
    out, lse = paged_decode_attention(
        query.to(dev), k_cache.to(dev), v_cache.to(dev), table.to(dev), seq.to(dev),
        cp=cp, cp_block_size=12, return_lse=True, backend="triton", num_kv_splits=2,
    )
    torch_out, torch_lse = paged_decode_attention(
        query, k_cache, v_cache, table, seq, cp=cp, cp_block_size=12, return_lse=True,
        backend="torch",
    )
    assert rel_err(out, torch_out) < TOLERANCE[torch.float32]
    check_lse(lse, torch_lse, torch.float32)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()


def test_bad_inputs_are_clear_errors_before_the_launch(triton_device: str) -> None:
    args = make_case([(10, 2), (5, 1)], 4, 1, 2, 16, torch.float32, triton_device)
    query, k_cache, v_cache, table, seq, qsl = args
    with pytest.raises(TypeError, match="query must have dtype torch.float32"):
        paged_attention(query.half(), *args[1:], backend="triton")
    with pytest.raises(TypeError, match="k_cache must have dtype float32, float16, bfloat16"):
        paged_attention(*[a.double() if a.is_floating_point() else a for a in args],
                        backend="triton")
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \[3\]"):
        paged_attention(*args[:5], qsl[:2], backend="triton")
    with pytest.raises(ValueError, match=r"row_of_batch must have shape \[2\]"):
        paged_attention(*args, row_of_batch=qsl, backend="triton")
    with pytest.raises(ValueError, match=r"out must have shape"):
        paged_attention(*args, out=query[:1], backend="triton")
    with pytest.raises(TypeError, match="lse_out must have dtype torch.float32"):
        paged_attention(*args, lse_out=query[:, :, 0].double(), backend="triton")
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        paged_attention(*args, sliding_window=0, backend="triton")
    with pytest.raises(ValueError, match="max_query_len must be >= 1"):
        paged_attention(*args, max_query_len=0, backend="triton")
    with pytest.raises(ValueError, match="min_query_len must be >= 0"):
        paged_attention(*args, min_query_len=-1, backend="triton")
    with pytest.raises(TypeError, match="min_query_len must be an int"):
        paged_attention(*args, min_query_len=1.5, backend="triton")
    with pytest.raises(ValueError, match=r"min_query_len \(3\) must be <= max_query_len \(2\)"):
        paged_attention(*args, min_query_len=3, max_query_len=2, backend="triton")
    with pytest.raises(ValueError, match="cp_block_size=6 must be a multiple"):
        paged_attention(*args, cp=CPConfig(2, 0, 2), cp_block_size=6, backend="triton")
    with pytest.raises(ValueError, match=r"seq_lens_cpu\[0\]=100 must be >= 0 and put at most"):
        paged_attention(*args, seq_lens_cpu=[100, 5], backend="triton")
    with pytest.raises(ValueError, match="head_dim must be <= 256"):
        big = torch.zeros(2, 1, 1, 512, device=triton_device)
        paged_attention(torch.zeros(3, 2, 512, device=triton_device), big, big, table, seq, qsl,
                        backend="triton")
    if triton_device == "cpu":
        with pytest.raises(ValueError, match="v_cache must be on device"):
            paged_attention(query, k_cache, v_cache.to("meta"), table, seq, qsl,
                            backend="triton")


def test_mixed_step_replays_in_a_graph(triton_device: str) -> None:
    """Captured once with one batch (a CUDA graph, or its CPU stand-in under Triton's
    interpreter), replayed with other lengths (same shapes)."""
    dev = triton_device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter computes in numpy
    reqs = [(40, 1), (33, 20), (9, 1), (0, 0)]
    query, k_cache, v_cache, table, seq, qsl = make_case(reqs, 16, 2, 4, 64, dtype, dev,
                                                         pad_tokens=4)
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], device=dev)

    def step() -> None:
        paged_attention(query, k_cache, v_cache, table, seq, qsl, out=out, lse_out=lse,
                        backend="triton")

    step()
    graph = graph_for(dev)
    with graph.capture():
        step()
    new_reqs = [(41, 2), (45, 3), (16, 15), (0, 0)]  # within each row's blocks; more padding
    seq.copy_(torch.tensor([s for s, _ in new_reqs], dtype=torch.int32))
    qsl.copy_(torch.tensor(np.cumsum([0] + [q for _, q in new_reqs]), dtype=torch.int32))
    query.normal_()
    graph.replay()
    ref, ref_lse = reference(query, k_cache, v_cache, table, seq, qsl)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    check_lse(lse, ref_lse, dtype)


def test_many_requests_search_and_all_padding(triton_device: str) -> None:
    """More requests than one search level holds (16), random lengths; then a batch with no
    request at all (every token is padding) and an empty one."""
    gen = np.random.default_rng(7)
    reqs = [(int(q + gen.integers(0, 9)), int(q)) for q in gen.integers(0, 7, size=17)]
    args = make_case(reqs, 4, 1, 4, 16, torch.float32, triton_device, pad_tokens=30, seed=7)
    out, lse = paged_attention(*args, return_lse=True, backend="triton")
    ref, ref_lse = reference(*args)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    check_lse(lse, ref_lse, torch.float32)

    query, k_cache, v_cache, table, _, _ = args
    no_reqs = (torch.zeros(0, dtype=torch.int32, device=triton_device),
               torch.zeros(1, dtype=torch.int32, device=triton_device))
    for max_query_len in (None, 1):  # the prefill kernel's pad tiles, the decode kernel's
        out = torch.full_like(query, float("nan"))
        paged_attention(query, k_cache, v_cache, table, *no_reqs, out=out,
                        max_query_len=max_query_len, backend="triton")
        assert query.shape[0] > 64 and (out == 0).all()
    empty = paged_attention(query[:0], k_cache, v_cache, table, *no_reqs, backend="triton")
    assert empty.shape == (0, *query.shape[1:])


SCHEDULES = {
    "fused-prefetched-ids": DecodeSchedule(fused_combine=True, per_block_ids=False, num_stages=1),
    "fused-ids-per-block": DecodeSchedule(fused_combine=True, per_block_ids=True, num_stages=1),
    "combine-kernel": DecodeSchedule(fused_combine=False, per_block_ids=False, num_stages=1),
    "combine-kernel-ids-per-block": DecodeSchedule(False, True, 2),
}


@pytest.mark.parametrize("block_size", [4, 6])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_decode_schedules_match_reference(triton_device: str, schedule: str, block_size: int) -> None:
    """Every decode schedule (combine fused or in its own launch, block ids prefetched or one
    per block) on a mixed batch with a window, pad tokens, split decode keys and a corrupt
    block id (never read); block size 6 does not divide the tile (one id per block falls back
    to one per key)."""
    query, k_cache, v_cache, table, seq, qsl = make_case(
        MIXED, block_size, 2, 2, 16, torch.float32, "cpu", pad_tokens=2, seed=7
    )
    ref, ref_lse = reference(query, k_cache, v_cache, table, seq, qsl, sliding_window=7,
                             scale=0.3)
    table[3, table.shape[1] - 1] = k_cache.shape[0] + 99  # past request 3's keys: never used
    args = [t.to(triton_device) for t in (query, k_cache, v_cache, table, seq, qsl)]
    attention = PagedAttention(triton_device, default_config(16, 2, 4))
    for _ in range(2):  # the second call finds the workspace (and fused counters) reused
        out = torch.full_like(args[0], float("nan"))
        lse = torch.full(args[0].shape[:2], float("nan"), device=triton_device)
        attention.launch(out, lse, *args, None, 0.3, 7, CPLayout(), decode_only=False,
                         num_kv_splits=2, schedule=SCHEDULES[schedule])
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
        check_lse(lse, ref_lse, torch.float32)


@pytest.mark.parametrize(
    "tiles",
    [{"prefill_block_m": 16, "prefill_block_n": 16}, {"prefill_block_m": 32, "decode_block_n": 32},
     {"prefill_block_n": 32, "prefill_num_stages": 2}],
    ids=["m16-n16", "m32-decode-n32", "n32-2-stages"],
)
def test_tuned_configurations_match_reference(triton_device: str, tiles) -> None:
    """What users tune (tile sizes, stages) changes the schedule, never the result."""
    args = make_case(MIXED, 4, 2, 2, 16, torch.float32, triton_device, pad_tokens=2, seed=9)
    ref, ref_lse = reference(*args, sliding_window=7, scale=0.3)
    config = dataclasses.replace(default_config(16, 2, 4), num_kv_splits=2, **tiles)
    out, lse = PagedAttention(triton_device, config)(
        *args, sliding_window=7, scale=0.3, return_lse=True)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    check_lse(lse, ref_lse, torch.float32)


def test_bad_kernel_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="KernelConfig.prefill_block_n must be a power of two"):
        KernelConfig(prefill_block_n=48)
    with pytest.raises(ValueError, match="KernelConfig.decode_block_n must be >= 16"):
        KernelConfig(decode_block_n=8)
    with pytest.raises(ValueError, match="KernelConfig.decode_num_stages must be an int >= 1"):
        KernelConfig(decode_num_stages=0)
    with pytest.raises(TypeError, match="config must be a KernelConfig"):
        PagedAttention("cpu", {"prefill_block_m": 64})  # type: ignore[arg-type]


@pytest.mark.parametrize("group, head_dim", [(2, 16), (3, 24)])
@pytest.mark.parametrize("fused", [True, False])
def test_more_splits_than_one_merge_chunk(
    triton_device: str, fused: bool, group: int, head_dim: int
) -> None:
    """20 splits (two chunks of the merge, most of them without keys) on a decode step; a
    group of 3 pads the merged heads to 4 and head dim 24 the rows to 32."""
    reqs = [(90, 1), (3, 1), (0, 0)]
    query, k_cache, v_cache, table, seq, qsl = make_case(
        reqs, 4, 2, group, head_dim, torch.float32, triton_device, seed=3
    )
    ref, ref_lse = reference(query, k_cache, v_cache, table, seq, qsl, scale=0.25)
    attention = PagedAttention(triton_device, default_config(head_dim, group, 4))
    for _ in range(2):
        out = torch.full_like(query, float("nan"))
        lse = torch.full(query.shape[:2], float("nan"), device=triton_device)
        attention.launch(
            out, lse, query, k_cache, v_cache, table, seq, qsl, None, 0.25, None, CPLayout(),
            decode_only=True, num_kv_splits=20, schedule=DecodeSchedule(fused, False, 1),
        )
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
        check_lse(lse, ref_lse, torch.float32)


def test_repeated_decode_calls_reuse_their_checks(triton_device: str, monkeypatch) -> None:
    """A call whose inputs have the metadata of a checked one skips the checks and the launch
    set-up, yet reads the new values: new K/V, query and lengths give the new reference."""
    from blocktable.attention import planner

    reqs = [(29, 1), (0, 0), (7, 1)]
    query, k_cache, v_cache, table, seq, qsl = make_case(
        reqs, 4, 2, 2, 16, torch.float32, triton_device, seed=5
    )
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], device=triton_device)
    kwargs = {"out": out, "lse_out": lse, "max_query_len": 1, "num_kv_splits": 3,
              "backend": "triton"}
    paged_attention(query, k_cache, v_cache, table, seq, qsl, **kwargs)

    def not_again(*args: object) -> bool:
        raise AssertionError("the checks ran again")

    monkeypatch.setattr(planner, "inputs_look_valid", not_again)
    gen = torch.Generator().manual_seed(6)
    for lens in ([29, 0, 7], [12, 0, 30]):
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
        v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
        new_query = torch.randn(query.shape, generator=gen).to(triton_device)
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        paged_attention(new_query, k_cache, v_cache, table, seq, qsl, **kwargs)
        ref, ref_lse = reference(new_query, k_cache, v_cache, table, seq, qsl)
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
        check_lse(lse, ref_lse, torch.float32)
    monkeypatch.undo()
    # Other metadata is checked (and planned) afresh: a strided query view, then bad outputs.
    wide = torch.randn(query.shape[0], query.shape[1], 32, generator=gen).to(triton_device)
    view = wide[:, :, :16]
    result = paged_attention(view, k_cache, v_cache, table, seq, qsl, max_query_len=1,
                             num_kv_splits=3, backend="triton")
    assert rel_err(result, reference(view, k_cache, v_cache, table, seq, qsl)[0]) < 1e-4
    before = out.clone()
    with pytest.raises(TypeError, match="out must have dtype torch.float32"):
        paged_attention(query, k_cache, v_cache, table, seq, qsl,
                        **{**kwargs, "out": out.double()})
    with pytest.raises(ValueError, match="max_query_len must be >= 1"):
        paged_attention(query, k_cache, v_cache, table, seq, qsl, **{**kwargs, "max_query_len": 0})
    with pytest.raises(TypeError, match="query must have dtype torch.float32"):
        paged_attention(query.half(), k_cache, v_cache, table, seq, qsl, **kwargs)
    assert torch.equal(out, before)  # nothing written by the rejected calls (no NaN left)


@pytest.mark.parametrize("per_block_ids", [False, True])
def test_split_decode_with_cp_and_window(triton_device: str, per_block_ids: bool) -> None:
    """Decode on rank 1 of 2 (interleave 4), a window cutting through blocks, keys split three
    ways, a pad row, and a NaN block before the window (never read)."""
    gen = torch.Generator().manual_seed(11)
    block_size, cp_block, kv_heads, group, dim = 4, 8, 2, 2, 16
    reqs = [(37, 1), (26, 1), (2, 1), (0, 0)]
    keys = [torch.randn(s, kv_heads, dim, generator=gen) for s, _ in reqs]
    values = [torch.randn(s, kv_heads, dim, generator=gen) for s, _ in reqs]
    qsl = torch.tensor(np.cumsum([0] + [q for _, q in reqs]), dtype=torch.int32)
    seq = torch.tensor([s for s, _ in reqs], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), kv_heads * group, dim, generator=gen)
    table = (torch.randperm(len(reqs) * 8, generator=gen) + 1).int().view(len(reqs), 8)
    cp = CPConfig(2, 1, 4)
    k_cache, v_cache = place_sharded(keys, values, table, block_size, 2, 1, 4, cp_block)
    ref, ref_lse = reference(query, k_cache, v_cache, table, seq, qsl, cp=cp,
                             cp_block_size=cp_block, sliding_window=9)
    table[0, 0] = 0  # NaN block: rank 1 holds 17 of request 0's keys, the window starts at 12
    args = [t.to(triton_device) for t in (query, k_cache, v_cache, table, seq, qsl)]
    out = torch.full_like(args[0], float("nan"))
    lse = torch.full(args[0].shape[:2], float("nan"), device=triton_device)
    PagedAttention(triton_device).launch(
        out, lse, *args, None, 0.25, 9, CPLayout(2, 1, 4, cp_block), decode_only=True,
        num_kv_splits=3, schedule=DecodeSchedule(True, per_block_ids, 1),
    )
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    check_lse(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize("block_m", [16, 32])
def test_long_prefills(triton_device: str, block_m: int, window) -> None:
    """Prefills of several query tiles, a chunk over a cached prefix that crosses blocks, a
    decode and a pad token, through the prefill kernel alone, against the float64 reference
    (LSE too)."""
    reqs = [(40, 40), (37, 29), (30, 21), (13, 1), (9, 8)]
    args = make_case(reqs, 4, 2, 2, 16, torch.float32, triton_device, pad_tokens=1, seed=11)
    config = dataclasses.replace(default_config(16, 2, 4), prefill_block_m=block_m)
    out = torch.full_like(args[0], float("nan"))
    lse = torch.full(args[0].shape[:2], float("nan"), device=triton_device)
    launch_paged_attention(out, lse, *args, None, 0.3, window, CPLayout(), decode_only=False,
                           prefill_only=True, config=config)
    ref, ref_lse = reference(*args, sliding_window=window, scale=0.3)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    check_lse(lse, ref_lse, torch.float32)


def test_prefill_zeros_every_pad_token(triton_device: str) -> None:
    """The programs past the last request cover every pad token: a batch of one short
    prefill and 37 pad tokens, then one of padding only."""
    query, k_cache, v_cache, table, seq, qsl = make_case(
        [(11, 9)], 4, 1, 2, 16, torch.float32, triton_device, pad_tokens=37, seed=5
    )
    ref, _ = reference(query, k_cache, v_cache, table, seq, qsl)
    for lens in ((seq, qsl), (seq[:0], qsl[:1])):
        out = torch.full_like(query, float("nan"))
        launch_paged_attention(
            out, None, query, k_cache, v_cache, table, *lens, None, 1.0 / 4, None, CPLayout(),
            decode_only=False, prefill_only=True,
        )
        expected = ref if lens[0].numel() else torch.zeros_like(ref)
        assert rel_err(out, expected) < TOLERANCE[torch.float32]
