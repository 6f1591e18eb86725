"""The Gluon prefill kernel (Hopper) against the float64 reference, and the choice between it
and the portable Triton kernel.

The GPU tests run where a Hopper GPU and Triton's Gluon are present; the choice's errors are
checked everywhere.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_attention_triton import (
    MIXED,
    TOLERANCE,
    check_lse,
    make_case,
    reference,
    rel_err,
)

from blocktable.attention import KernelConfig, PagedAttention
from blocktable.attention.cp_layout import CPLayout
from blocktable.attention.gluon_prefill import HAS_GLUON, supports
from blocktable.attention.kernel_config import default_config
from blocktable.attention.prefill_launch import gluon_reason

HOPPER = (
    HAS_GLUON and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs a Hopper GPU")

# The request mixes of the Triton tests, and long ones: several query tiles, a chunk over a
# cached prefix that starts mid-block, a decode beside a prefill, an empty request.
LONG = [(40, 40), (37, 29), (30, 21), (13, 1), (9, 8)]
BIG = [(1000, 1000), (1337, 300), (257, 1), (0, 0), (700, 700), (129, 64)]


def run_prefill(args, kernel: str, *, lse: bool = True, window=None, row_of_batch=None,
                prefill_only: bool = True, scale: float = 0.3, heads_apart: bool = False):
    """Output and LSE (poisoned with NaN first) of one launch through ``kernel``; with
    ``heads_apart``, an output whose heads lie ``2 * head_dim`` elements apart (a view of
    every other half of a NaN buffer)."""
    query = args[0]
    group = query.shape[1] // args[1].shape[2]
    config = dataclasses.replace(
        default_config(query.shape[2], group, query.element_size()), prefill_kernel=kernel
    )
    if heads_apart:
        num_tokens, num_heads, head_dim = query.shape
        out = torch.full((num_tokens, num_heads, 2 * head_dim), float("nan"),
                         dtype=query.dtype, device=query.device)[..., :head_dim]
    else:
        out = torch.full_like(query, float("nan"))
    lse_out = torch.full(query.shape[:2], float("nan"), device=query.device) if lse else None
    PagedAttention(query.device, config).launch(
        out, lse_out, *args, row_of_batch, scale, window, CPLayout(), decode_only=False,
        prefill_only=prefill_only,
    )
    return out, lse_out


@pytest.fixture
def gluon_launches(monkeypatch) -> list[int]:
    """A list that gains an entry at each launch of the Gluon kernel (the launch still runs)."""
    from blocktable.attention import prefill_launch

    launches: list[int] = []
    real = prefill_launch._launch_gluon
    monkeypatch.setattr(prefill_launch, "_launch_gluon",
                        lambda *a, **k: (launches.append(1), real(*a, **k)))
    return launches


def assert_work_counters_zeroed() -> None:
    """Every launch's work-item counters are back to zero (the last program of a launch
    resets them, so the next launch needs no memset)."""
    from blocktable.attention import prefill_launch

    for counters in prefill_launch._WORK_COUNTERS.values():
        assert counters.tolist() == [0, 0]


def test_the_choice_is_checked() -> None:
    with pytest.raises(ValueError, match="prefill_kernel must be one of"):
        KernelConfig(prefill_kernel="cuda")
    assert supports("fp32", 128, 1, 0) is not None
    assert supports("bf16", 96, 1, 0) is not None
    assert supports("bf16", 128, 2, 0) is not None
    assert supports("bf16", 128, 1, 7) is not None


def test_forcing_gluon_where_it_cannot_run_is_a_clear_error(triton_device: str) -> None:
    args = make_case(LONG, 4, 2, 2, 16, torch.float32, triton_device, seed=1)
    with pytest.raises(ValueError, match="prefill_kernel='gluon' cannot serve"):
        run_prefill(args, "gluon")
    if triton_device == "cpu":
        bf16 = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in args]
        assert gluon_reason(bf16[0], bf16[1], bf16[2], bf16[0], 2, 0, CPLayout()) is not None


@needs_hopper
@pytest.mark.parametrize("block_size, head_dim, reason", [
    (4, 64, "kernel block size 4"), (48, 64, "kernel block size 48"), (16, 32, "head_dim 32"),
])
def test_forcing_gluon_on_a_layout_it_does_not_serve_names_why(block_size, head_dim,
                                                                reason) -> None:
    args = make_case(LONG, block_size, 2, 2, head_dim, torch.bfloat16, "cuda", seed=3)
    with pytest.raises(ValueError, match=reason):
        run_prefill(args, "gluon")
    out, _ = run_prefill(args, "auto")  # the Triton kernel
    ref, _ = reference(*args, scale=0.3)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@needs_hopper
def test_gluon_names_a_group_or_query_layout_its_copies_do_not_serve() -> None:
    """Its query copies take a GQA group of at most 8 heads lying side by side in memory;
    forced, other inputs are an error naming why, and "auto" runs them on the Triton kernel."""
    wide = make_case(LONG, 16, 1, 16, 128, torch.bfloat16, "cuda", seed=4)
    apart = list(make_case(LONG, 16, 2, 2, 128, torch.bfloat16, "cuda", seed=5))
    apart[0] = apart[0].transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D], heads outer
    for args, reason in ((wide, "a GQA group over 8"), (apart, "heads are not side by side")):
        with pytest.raises(ValueError, match=reason):
            run_prefill(args, "gluon")
        out, _ = run_prefill(args, "auto")  # the Triton kernel
        ref, _ = reference(*args, scale=0.3)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


CASES = [
    # block_size, num_kv_heads, group, head_dim, dtype: the kernel block sizes, head sizes and
    # GQA groups the Gluon kernel serves (pages shorter than a tile, one tile, longer).
    (16, 1, 4, 64, torch.float16),
    (16, 8, 4, 128, torch.bfloat16),
    (32, 1, 8, 64, torch.bfloat16),
    (64, 2, 8, 128, torch.float16),
    (128, 4, 2, 64, torch.bfloat16),
    (256, 2, 1, 128, torch.bfloat16),
]


@needs_hopper
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-kv{c[1]}-g{c[2]}-d{c[3]}-{c[4]}")
@pytest.mark.parametrize("reqs", [MIXED, LONG, BIG], ids=["mixed", "long", "big"])
def test_gluon_matches_reference(case, reqs) -> None:
    block_size, num_kv_heads, group, head_dim, dtype = case
    args = make_case(reqs, block_size, num_kv_heads, group, head_dim, dtype, "cuda",
                     pad_tokens=5, seed=block_size + head_dim)
    out, lse = run_prefill(args, "gluon")
    ref, ref_lse = reference(*args, scale=0.3)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    check_lse(lse, ref_lse, dtype)
    # Each row against the reference too (a norm can hide one bad row).
    worst = (out.double().cpu() - ref).abs().max().item()
    assert worst < 4 * TOLERANCE[dtype], worst


@needs_hopper
@pytest.mark.parametrize("num_reqs", [31, 32, 70, 1100])
def test_gluon_finds_every_tiles_request_among_many(num_reqs: int) -> None:
    """Request counts on both sides of one search level's width, and past two levels: short
    prompts over cached prefixes, decodes and empty requests, in a permuted table."""
    gen = torch.Generator().manual_seed(num_reqs)
    reqs = []
    for _ in range(num_reqs):
        query_len = int(torch.randint(0, 48, (1,), generator=gen))
        reqs.append((query_len + int(torch.randint(0, 40, (1,), generator=gen)), query_len))
    args = make_case(reqs, 16, 2, 4, 128, torch.bfloat16, "cuda", pad_tokens=3, seed=num_reqs)
    rows = torch.randperm(num_reqs, generator=gen).to(torch.int32)
    table = args[3]
    permuted = table.clone()
    permuted[rows.long()] = table[:num_reqs]
    ref, ref_lse = reference(*args, scale=0.3)
    out, lse = run_prefill(args, "gluon")
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    check_lse(lse, ref_lse, torch.bfloat16)
    args[3] = permuted
    out_rows, _ = run_prefill(args, "gluon", row_of_batch=rows.cuda())
    assert torch.equal(out_rows, out)


@needs_hopper
@pytest.mark.parametrize("prefill_only", [True, False])
def test_gluon_and_triton_agree_with_row_of_batch_and_no_lse(prefill_only: bool) -> None:
    args = make_case(BIG, 16, 2, 4, 128, torch.bfloat16, "cuda", pad_tokens=3, seed=4,
                     extra_rows=3)
    rows = torch.tensor([2, 0, 1, 5, 4, 3], dtype=torch.int32, device="cuda")
    table = args[3]
    permuted = table.clone()
    permuted[rows.long()] = table[: len(BIG)]
    args[3] = permuted
    out_g, _ = run_prefill(args, "gluon", lse=False, row_of_batch=rows, prefill_only=prefill_only)
    out_t, _ = run_prefill(args, "triton", lse=False, row_of_batch=rows,
                           prefill_only=prefill_only)
    args[3] = table
    ref, _ = reference(*args, scale=0.3)
    assert rel_err(out_g, ref) < TOLERANCE[torch.bfloat16]
    assert rel_err(out_t, ref) < TOLERANCE[torch.bfloat16]


@needs_hopper
def test_auto_picks_gluon_where_enabled_and_triton_for_what_it_cannot_serve(
    gluon_launches,
) -> None:
    from blocktable.attention import gluon_prefill, prefill_launch

    args = make_case(LONG, 16, 2, 4, 64, torch.bfloat16, "cuda", seed=2)
    run_prefill(args, "auto")
    expected = [1] if prefill_launch.AUTO_PICKS_GLUON else []
    assert gluon_launches == expected
    out_w, _ = run_prefill(args, "auto", window=7)  # a window: the Triton kernel
    assert gluon_launches == expected
    ref, _ = reference(*args, scale=0.3, sliding_window=7)
    assert rel_err(out_w, ref) < TOLERANCE[torch.bfloat16]
    assert gluon_prefill.HAS_GLUON


@needs_hopper
def test_gluon_prefill_replays_in_a_cuda_graph() -> None:
    import numpy as np

    from blocktable.attention import paged_attention

    reqs = [(400, 300), (33, 20), (900, 1), (0, 0)]
    query, k_cache, v_cache, table, seq, qsl = make_case(
        reqs, 16, 2, 4, 128, torch.bfloat16, "cuda", pad_tokens=4
    )
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], device="cuda")

    def step() -> None:
        paged_attention(query, k_cache, v_cache, table, seq, qsl, out=out, lse_out=lse)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_reqs = [(399, 200), (48, 30), (899, 15), (0, 0)]  # within each row's blocks
    seq.copy_(torch.tensor([s for s, _ in new_reqs], dtype=torch.int32))
    qsl.copy_(torch.tensor(np.cumsum([0] + [q for _, q in new_reqs]), dtype=torch.int32))
    query.normal_()
    out.fill_(float("nan"))
    graph.replay()
    ref, ref_lse = reference(query, k_cache, v_cache, table, seq, qsl)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    check_lse(lse, ref_lse, torch.bfloat16)


@needs_hopper
@pytest.mark.parametrize("tiles", [
    {"block_n": 64, "stages": 3}, {"block_n": 128, "stages": 2}, {"block_n": 32, "stages": 4},
    # a program per work item; programs past the multiprocessors' room (a second wave)
    {"programs_per_sm": 0}, {"programs_per_sm": 0, "block_n": 128, "stages": 2},
    {"programs_per_sm": 3},
], ids=str)
def test_gluon_launch_shapes_match_reference(tiles, monkeypatch) -> None:
    from blocktable.attention import prefill_launch

    monkeypatch.setattr(prefill_launch, "GLUON_TILES", prefill_launch.GluonTiles(**tiles))
    args = make_case(BIG + LONG, 16, 2, 4, 128, torch.bfloat16, "cuda", pad_tokens=2, seed=9)
    ref, ref_lse = reference(*args, scale=0.3)
    for _ in range(3):  # launches after the first find the work-item counters zeroed again
        out, lse = run_prefill(args, "gluon")
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
        check_lse(lse, ref_lse, torch.bfloat16)
    assert_work_counters_zeroed()


@needs_hopper
@pytest.mark.parametrize("programs_per_sm", [1, 0])
@pytest.mark.parametrize("with_prompt", [True, False], ids=["decodes-and-a-prompt", "decodes-only"])
def test_gluon_ends_launches_of_items_with_no_rows_for_it(programs_per_sm, with_prompt,
                                                         gluon_launches, monkeypatch) -> None:
    """A mixed batch whose decodes are the decode kernel's: the Gluon kernel's loader claims
    item after item with no rows for it (the decodes', the empty requests', every request's
    spare tile), runs of them longer than the grid, and with no prompt every item of the
    launch; every launch still ends, the rows match the reference, and the work counters
    are zero again after it."""
    from blocktable.attention import prefill_launch

    monkeypatch.setattr(prefill_launch, "GLUON_TILES",
                        prefill_launch.GluonTiles(programs_per_sm=programs_per_sm))
    reqs = [(40 + r % 50, 1) if r % 7 else (r % 30, 0) for r in range(600)]
    if with_prompt:
        reqs[450] = (900, 700)
    args = make_case(reqs, 16, 2, 4, 128, torch.bfloat16, "cuda", pad_tokens=3, seed=11)
    ref, ref_lse = reference(*args, scale=0.3)
    for _ in range(2):
        out, lse = run_prefill(args, "gluon", prefill_only=False)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
        check_lse(lse, ref_lse, torch.bfloat16)
    assert len(gluon_launches) == 2, "the Gluon kernel did not run"
    assert_work_counters_zeroed()


@needs_hopper
@pytest.mark.parametrize("heads_apart", [False, True], ids=["heads-side-by-side", "heads-apart"])
@pytest.mark.parametrize("case", CASES + [(16, 2, 3, 128, torch.bfloat16),
                                          (32, 1, 6, 64, torch.float16)],
                         ids=lambda c: f"b{c[0]}-kv{c[1]}-g{c[2]}-d{c[3]}-{c[4]}")
def test_gluon_output_rows_match_reference_however_stored(case, heads_apart) -> None:
    """Heads side by side: a tile whose rows are all tokens of its request leaves through
    the copy engine, the rest from registers; heads apart: every row from registers. Every
    row equals the reference, and no copy touches a neighbouring request's rows, the pad
    tokens or the memory between the heads."""
    block_size, num_kv_heads, group, head_dim, dtype = case
    args = make_case(MIXED + BIG + LONG, block_size, num_kv_heads, group, head_dim, dtype,
                     "cuda", pad_tokens=5, seed=group + head_dim)
    out, lse = run_prefill(args, "gluon", heads_apart=heads_apart)
    ref, ref_lse = reference(*args, scale=0.3)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    check_lse(lse, ref_lse, dtype)
    worst = (out.double().cpu() - ref).abs().max().item()
    assert worst < 4 * TOLERANCE[dtype], worst
    if heads_apart:
        base = out.as_strided((out.shape[0], out.shape[1], 2 * head_dim), out.stride())
        assert base[..., head_dim:].isnan().all()  # between the heads: never written


@needs_hopper
@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_gluon_never_reads_slots_past_the_causal_bound(block_size, gluon_launches) -> None:
    """Slots past each request's last key hold NaN (an unused slot may hold anything): the
    kernel's output stays finite and equal to the reference."""
    reqs = [(1000, 1000), (333, 77), (129, 129), (17, 17), (250, 3)]
    args = make_case(reqs, block_size, 2, 4, 128, torch.bfloat16, "cuda", seed=block_size)
    ref, ref_lse = reference(*args, scale=0.3)
    _, k_cache, v_cache, table, _, _ = args
    for r, (seq_len, _) in enumerate(reqs):
        last = (seq_len - 1) // block_size
        block = int(table[r, last])
        k_cache[block, seq_len % block_size or block_size:] = float("nan")
        v_cache[block, seq_len % block_size or block_size:] = float("nan")
    out, lse = run_prefill(args, "gluon")
    assert gluon_launches, "the Gluon kernel did not run"
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    check_lse(lse, ref_lse, torch.bfloat16)


@needs_hopper
def test_gluon_matches_reference_as_scores_climb_tile_after_tile() -> None:
    """Scores that grow with the key's position: steeply for some query heads (the running
    max moves at every tile), gently for others (it moves every few tiles), not at all or
    falling for the rest, so that some warps rescale their rows and others skip it, tile
    after tile."""
    reqs = [(700, 700), (300, 120), (129, 64), (37, 29)]
    query, k_cache, v_cache, table, seq, qsl = make_case(
        reqs, 16, 2, 4, 128, torch.bfloat16, "cuda", pad_tokens=3, seed=5)
    # Key t of each request gets 23 * t / 64 in dimension 0, and each query head a slope
    # there: with scale 0.3, slope 1 adds about 10 (in log2 units) to the scores per 64 keys.
    for r, (seq_len, _) in enumerate(reqs):
        t = torch.arange(seq_len, device="cuda")
        ramp = (23.0 * t / 64).to(k_cache.dtype)
        k_cache[table[r, t // 16].long(), t % 16, :, 0] = ramp[:, None]
    slopes = torch.tensor([1.0, 0.25, -1.0, 0.0, 0.5, 2.0, -0.25, 0.1], device="cuda")
    query[:, :, 0] = slopes.to(query.dtype)
    args = [query, k_cache, v_cache, table, seq, qsl]
    ref, ref_lse = reference(*args, scale=0.3)
    out, lse = run_prefill(args, "gluon")
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    check_lse(lse, ref_lse, torch.bfloat16)
    worst = (out.double().cpu() - ref).abs().max().item()
    assert worst < 4 * TOLERANCE[torch.bfloat16], worst


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view 4 bytes past a 16-byte boundary (a slice of a larger buffer,
    as an engine's metadata often is)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 == t.element_size()
    return view


@needs_hopper
@pytest.mark.parametrize("indexed", [False, True], ids=["rows-in-order", "row-of-batch"])
def test_gluon_reuses_one_compilation_whatever_the_metadatas_alignment(indexed: bool) -> None:
    """The launcher keeps the kernel compiled at the first launch: a later launch whose
    table, lengths, start offsets, rows and LSE lie at other alignments runs on it, and
    matches the reference."""
    from blocktable.attention import prefill_launch

    args = make_case(LONG + BIG, 16, 2, 4, 128, torch.bfloat16, "cuda", pad_tokens=3, seed=11)
    ref, ref_lse = reference(*args, scale=0.3)
    rows = torch.arange(len(LONG + BIG), dtype=torch.int32, device="cuda") if indexed else None
    out, lse = run_prefill(args, "gluon", row_of_batch=rows)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    check_lse(lse, ref_lse, torch.bfloat16)
    compiled = dict(prefill_launch._gluon_launch._compiled)
    query, k_cache, v_cache, table, seq, qsl = args
    config = dataclasses.replace(default_config(128, 4, 2), prefill_kernel="gluon")
    out_s = torch.full_like(query, float("nan"))
    lse_s = _shifted(torch.full(query.shape[:2], float("nan"), device="cuda"))
    PagedAttention(query.device, config).launch(
        out_s, lse_s, query, k_cache, v_cache, _shifted(table), _shifted(seq), _shifted(qsl),
        None if rows is None else _shifted(rows), 0.3, None, CPLayout(), decode_only=False,
        prefill_only=True,
    )
    if prefill_launch._gluon_launch.fast:
        assert prefill_launch._gluon_launch._compiled == compiled  # no second compilation
    assert torch.equal(out_s, out)
    assert torch.equal(lse_s, lse)
