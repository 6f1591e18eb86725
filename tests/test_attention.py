"""Paged attention: the torch reference against dense attention, the Triton decode kernel
against the float64 reference (relative error ||out - ref|| / ||ref||)."""

from __future__ import annotations

import math

import pytest
import torch
from fake_graph import graph_for

from blocktable.attention import paged_attention_reference, paged_decode_attention
from blocktable.constants import NULL_BLOCK_ID

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


def make_paged(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    extra_width: int = 1,
    seed: int = 0,
):
    """A cache with every request's blocks at random distinct ids (never the null block) and
    the table pointing at them; unused entries are NULL_BLOCK_ID."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    width = max(blocks_per_req) + extra_width
    num_blocks = sum(blocks_per_req) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.full((len(seq_lens), width), NULL_BLOCK_ID, dtype=torch.int32)
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return k_cache.to(device), v_cache.to(device), block_table.to(device), seq.to(device)


def gather_dense(cache: torch.Tensor, row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[seq_len, num_kv_heads, head_dim]``: a request's K or V in position order."""
    return cache[row.long()].flatten(0, 1)[:seq_len]


def dense_attention(q, k, v, q_pos, scale, window=None) -> torch.Tensor:
    """Textbook attention on contiguous float64 K/V with GQA by repeating KV heads."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    kv_pos = torch.arange(k.shape[0])
    allowed = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= kv_pos[None, :] > q_pos[:, None] - window
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("window", [None, 7])
def test_reference_matches_dense_attention(window: int | None) -> None:
    seq_lens, query_lens = [37, 16, 5, 50], [5, 16, 1, 12]  # prefill, chunked, decode
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    k_cache, v_cache, block_table, seq = make_paged(seq_lens, num_kv_heads, head_dim, 16)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0)], dtype=torch.int32)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens + 2, num_heads, head_dim, dtype=torch.float64)  # 2 pad
    out = paged_attention_reference(
        query,
        k_cache.double(),
        v_cache.double(),
        block_table,
        seq,
        query_start_loc,
        scale=0.3,
        sliding_window=window,
    )
    for r, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        tokens = slice(int(query_start_loc[r]), int(query_start_loc[r + 1]))
        q_pos = torch.arange(seq_len - query_len, seq_len)
        expected = dense_attention(
            query[tokens],
            gather_dense(k_cache, block_table[r], seq_len),
            gather_dense(v_cache, block_table[r], seq_len),
            q_pos,
            0.3,
            window,
        )
        torch.testing.assert_close(out[tokens], expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[num_tokens:], torch.zeros_like(out[num_tokens:]))


def test_reference_bad_inputs() -> None:
    k_cache, v_cache, block_table, seq = make_paged([20, 3], 1, 16, 16)
    query = torch.randn(4, 2, 16)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    paged_attention_reference(query, k_cache, v_cache, block_table, seq, qsl)
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \[3\]"):
        paged_attention_reference(query, k_cache, v_cache, block_table, seq, qsl[:2])
    with pytest.raises(TypeError, match="query_start_loc must have dtype torch.int32"):
        paged_attention_reference(query, k_cache, v_cache, block_table, seq, qsl.long())
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=1 must be >= its query_len=2"):
        paged_attention_reference(
            query, k_cache, v_cache, block_table, torch.tensor([20, 1], dtype=torch.int32), qsl
        )
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=60 puts 60 keys on this rank, .*width \* block_size=48"):
        paged_attention_reference(
            query, k_cache, v_cache, block_table, torch.tensor([60, 3], dtype=torch.int32), qsl
        )
    bad_table = block_table.clone()
    bad_table[0, 1] = k_cache.shape[0]
    with pytest.raises(IndexError, match=r"block_table\[0, 1\]=\d+ is out of range"):
        paged_attention_reference(query, k_cache, v_cache, bad_table, seq, qsl)


# ----------------------------------------------------------------------------- triton decode

DECODE_CASES = [
    # dtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens
    (torch.float32, 4, 2, 64, 16, [70, 1, 33]),
    (torch.float16, 4, 2, 64, 16, [70, 1, 33]),
    (torch.bfloat16, 4, 2, 64, 16, [70, 1, 33]),
    (torch.float16, 8, 1, 128, 32, [65, 64, 17]),  # MQA, a full last block
    (torch.bfloat16, 2, 2, 128, 64, [130, 2, 64]),  # MHA
    (torch.float32, 4, 4, 80, 16, [48, 31, 9]),  # head_dim not a power of two
]


@pytest.mark.parametrize(
    "case", DECODE_CASES, ids=lambda c: f"{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-b{c[4]}"
)
def test_decode_kernel_matches_float64_reference(triton_device: str, case) -> None:
    dtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens = case
    k_cache, v_cache, block_table, seq = make_paged(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, triton_device
    )
    query = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype).to(triton_device)
    out = paged_decode_attention(query, k_cache, v_cache, block_table, seq, backend="triton")
    ref = reference_decode(query, k_cache, v_cache, block_table, seq)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_kv_splits", [2, 8])
def test_decode_split_kv_matches_reference(triton_device: str, num_kv_splits: int) -> None:
    """Flash-decoding: more splits than some requests have blocks (empty splits), a pad row,
    a sliding window."""
    seq_lens = [70, 1, 0, 33]
    k_cache, v_cache, block_table, seq = make_paged(seq_lens, 2, 64, 16, torch.float16, seed=5)
    query = torch.randn(4, 4, 64).half()
    live = [0, 1, 3]
    for window in (None, 40):
        ref = reference_decode(
            query[live], k_cache, v_cache, block_table[live], seq[live], sliding_window=window
        )
        args = [t.to(triton_device) for t in (query, k_cache, v_cache, block_table, seq)]
        out = paged_decode_attention(
            *args, sliding_window=window, backend="triton", num_kv_splits=num_kv_splits
        )
        assert rel_err(out[live], ref) < TOLERANCE[torch.float16]
        assert torch.equal(out[2].cpu(), torch.zeros(4, 64, dtype=torch.float16))


def reference_decode(query, k_cache, v_cache, block_table, seq_lens, **kwargs) -> torch.Tensor:
    query_start_loc = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=query.device)
    return paged_attention_reference(
        query.double(),
        k_cache.double(),
        v_cache.double(),
        block_table,
        seq_lens,
        query_start_loc,
        **kwargs,
    )


def test_decode_sliding_window_never_reads_null_blocks(triton_device: str) -> None:
    window, block_size = 20, 16
    seq_lens = [70, 5, 36, 16]
    k_cache, v_cache, block_table, seq = make_paged(seq_lens, 2, 64, block_size, torch.float16)
    query = torch.randn(4, 4, 64).half()
    full = reference_decode(query, k_cache, v_cache, block_table, seq, sliding_window=window)
    # Blocks wholly before the window are released: NULL in the table, NaN in the null block.
    windowed = block_table.clone()
    for r, seq_len in enumerate(seq_lens):
        windowed[r, : max(0, seq_len - window) // block_size] = NULL_BLOCK_ID
    assert (windowed != block_table).any()
    k_cache[NULL_BLOCK_ID] = float("nan")
    v_cache[NULL_BLOCK_ID] = float("nan")
    args = [t.to(triton_device) for t in (query, k_cache, v_cache, windowed, seq)]
    out = paged_decode_attention(*args, sliding_window=window, backend="triton")
    assert torch.isfinite(out).all()
    assert rel_err(out, full) < TOLERANCE[torch.float16]
    ref = reference_decode(*args, sliding_window=window)
    assert rel_err(out, ref) < TOLERANCE[torch.float16]


def test_decode_with_kernel_blocks_expanded_from_manager_blocks(triton_device: str) -> None:
    """Manager block 64, kernel block 16: manager id b becomes kernel ids 4b .. 4b+3, and the
    same memory viewed as [num_blocks * 4, 16, ...] gives the same attention."""
    manager_block_size, kernel_block_size = 64, 16
    k = manager_block_size // kernel_block_size
    seq_lens = [130, 64, 3]
    k_cache, v_cache, manager_table, seq = make_paged(seq_lens, 2, 64, manager_block_size)
    query = torch.randn(3, 4, 64)
    expected = reference_decode(query, k_cache, v_cache, manager_table, seq)
    kernel_table = (manager_table[:, :, None] * k + torch.arange(k, dtype=torch.int32)).flatten(1)
    kernel_shape = (-1, kernel_block_size, *k_cache.shape[2:])
    args = [
        t.to(triton_device)
        for t in (query, k_cache.view(kernel_shape), v_cache.view(kernel_shape), kernel_table, seq)
    ]
    out = paged_decode_attention(*args, backend="triton")
    assert rel_err(out, expected) < TOLERANCE[torch.float32]


def test_decode_pad_rows_strided_cache_and_out(triton_device: str) -> None:
    """A CUDA-graph-padded batch: pad rows have seq_len 0 and an all-null row; the caches are
    halves of one [2, ...] tensor; the result goes into a caller's buffer."""
    k_cache, v_cache, block_table, seq = make_paged([40, 9], 2, 64, 16, torch.float16, seed=3)
    kv_cache = torch.stack([k_cache, v_cache]).to(triton_device)
    padded_table = torch.zeros(4, block_table.shape[1], dtype=torch.int32)
    padded_table[:2] = block_table
    seq_padded = torch.tensor([40, 9, 0], dtype=torch.int32)  # 3 of 4 table rows in the batch
    query = torch.randn(3, 4, 64).half()
    out = torch.full_like(query, float("nan")).to(triton_device)
    args = [
        t.to(triton_device) for t in (query, kv_cache[0], kv_cache[1], padded_table, seq_padded)
    ]
    result = paged_decode_attention(*args, out=out, backend="triton")
    assert result is out
    assert torch.equal(out[2].cpu(), torch.zeros(4, 64, dtype=torch.float16))
    ref = reference_decode(query[:2], k_cache, v_cache, block_table, seq)
    assert rel_err(out[:2], ref) < TOLERANCE[torch.float16]


def test_decode_cpu_path_matches_reference(device: str) -> None:
    """backend="auto" on CPU tensors takes the torch path (same answer, pad rows zero)."""
    k_cache, v_cache, block_table, _ = make_paged([40, 9], 2, 32, 16, seed=4)
    seq = torch.tensor([40, 0], dtype=torch.int32)
    query = torch.randn(2, 4, 32)
    args = [t.to(device) for t in (query, k_cache, v_cache, block_table, seq)]
    out = paged_decode_attention(*args, scale=0.5, sliding_window=17)
    ref = reference_decode(
        query[:1], k_cache, v_cache, block_table, seq[:1], scale=0.5, sliding_window=17
    )
    assert rel_err(out[:1], ref) < 1e-6
    assert torch.equal(out[1].cpu(), torch.zeros(4, 32))


def test_decode_bad_inputs_name_the_argument() -> None:
    k_cache, v_cache, block_table, seq = make_paged([20, 3], 2, 64, 16)
    query = torch.randn(2, 4, 64)
    with pytest.raises(TypeError, match="query must have dtype torch.float32"):
        paged_decode_attention(query.half(), k_cache, v_cache, block_table, seq)
    with pytest.raises(
        ValueError,
        match="query's num_heads=3 must be a positive multiple of k_cache's num_kv_heads=2",
    ):
        paged_decode_attention(query[:, :3], k_cache, v_cache, block_table, seq)
    with pytest.raises(ValueError, match=r"query must have shape \[\*, \*, 64\]"):
        paged_decode_attention(query[..., :32], k_cache, v_cache, block_table, seq)
    with pytest.raises(ValueError, match="query must have one token per request"):
        paged_decode_attention(query[:1], k_cache, v_cache, block_table, seq)
    with pytest.raises(TypeError, match="block_table must have dtype torch.int32"):
        paged_decode_attention(query, k_cache, v_cache, block_table.long(), seq)
    with pytest.raises(ValueError, match="block_table must have at least num_reqs=2 rows"):
        paged_decode_attention(query, k_cache, v_cache, block_table[:1], seq)
    with pytest.raises(TypeError, match="seq_lens must have dtype torch.int32"):
        paged_decode_attention(query, k_cache, v_cache, block_table, seq.long())
    with pytest.raises(ValueError, match="v_cache must have shape"):
        paged_decode_attention(query, k_cache, v_cache[:, :8], block_table, seq)
    with pytest.raises(TypeError, match="k_cache must have dtype float32, float16, bfloat16"):
        paged_decode_attention(query.double(), k_cache.double(), v_cache.double(), block_table, seq)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        paged_decode_attention(query, k_cache, v_cache, block_table, seq, sliding_window=0)
    with pytest.raises(ValueError, match=r"out must have shape \[2, 4, 64\]"):
        paged_decode_attention(query, k_cache, v_cache, block_table, seq, out=query[:1])
    with pytest.raises(ValueError, match="num_kv_splits must be a power of two, got 3"):
        paged_decode_attention(query, k_cache, v_cache, block_table, seq, num_kv_splits=3)
    with pytest.raises(ValueError, match="num_kv_splits must be >= 1, got 0"):
        paged_decode_attention(query, k_cache, v_cache, block_table, seq, num_kv_splits=0)


def test_decode_triton_takes_any_block_size(triton_device: str) -> None:
    """Tiles are decoupled from blocks: block sizes 8 and 12 (not a power of two) work."""
    for block_size in (8, 12):
        k_cache, v_cache, block_table, seq = make_paged([20, 3], 2, 64, block_size)
        query = torch.randn(2, 4, 64)
        ref = reference_decode(query, k_cache, v_cache, block_table, seq)
        args = [t.to(triton_device) for t in (query, k_cache, v_cache, block_table, seq)]
        out = paged_decode_attention(*args, backend="triton")
        assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_decode_and_kv_write_replay_in_a_graph(triton_device: str) -> None:
    """One decode step, KV write then attention, captured once (a CUDA graph, or its CPU
    stand-in under Triton's interpreter) and replayed with new data."""
    from blocktable.kv_write import write_kv_cache

    dev = triton_device
    k_cache, v_cache, block_table, seq = make_paged([40, 9, 0], 2, 64, 16, torch.float16, dev)
    query = torch.randn(3, 4, 64, device=dev).half()
    key, value = torch.randn(2, 3, 2, 64, device=dev).half()
    slot_mapping = torch.full((8,), -1, dtype=torch.int64, device=dev)
    out = torch.empty_like(query)

    def step() -> None:
        # check=False: on CPU tensors the slots are checked on the host by default (free
        # there, a sync on CUDA, where the default skips it)
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping, backend="triton", check=False)
        paged_decode_attention(query, k_cache, v_cache, block_table, seq, out=out,
                               backend="triton")

    step()  # compile outside the capture
    graph = graph_for(dev)
    with graph.capture():
        step()
    seq.copy_(torch.tensor([41, 10, 0], dtype=torch.int32))  # each live request grows by one
    positions = seq[:2].long() - 1
    rows = block_table[:2].long()
    slots = rows.gather(1, (positions // 16)[:, None])[:, 0] * 16 + positions % 16
    slot_mapping[:2] = slots
    query.normal_()
    key.normal_()
    value.normal_()
    graph.replay()
    assert torch.equal(k_cache.flatten(0, 1)[slots[1]], key[1])
    ref = reference_decode(query[:2], k_cache, v_cache, block_table[:2], seq[:2])
    assert rel_err(out[:2], ref) < TOLERANCE[torch.float16]
    assert torch.equal(out[2], torch.zeros_like(out[2]))
