"""``PagedAttention``: a step planned once runs every layer, each object owns its workspace.

Runs on CUDA when present, else on CPU tensors under Triton's interpreter (tiny shapes).
"""

from __future__ import annotations

import pytest
import torch
from test_attention_triton import TOLERANCE, check_lse, make_case, reference, rel_err

from blocktable.attention import PagedAttention, paged_attention
from blocktable.attention.paged import default_planner

DECODE = [(29, 1), (0, 0), (7, 1), (13, 1)]


def _pointers(attention: PagedAttention) -> set[int]:
    return {t.data_ptr() for t in attention.workspace.buffers()}


@pytest.mark.parametrize("num_reqs", [2, 9])
def test_two_planners_on_one_device_do_not_share_workspaces(
    triton_device: str, num_reqs: int
) -> None:
    """Split decode steps through two planners (2 requests: the fused combine and its
    counters; 9: the combine kernel) allocate two sets of buffers, neither the default
    planner's, and each gives the reference."""
    reqs = [(3 + 7 * r % 31, 1) for r in range(num_reqs)]
    args = make_case(reqs, 4, 2, 2, 16, torch.float32, triton_device, seed=num_reqs)
    ref, ref_lse = reference(*args)
    paged_attention(*args, max_query_len=1, num_kv_splits=4, backend="triton")
    first, second = PagedAttention(triton_device), PagedAttention(triton_device)
    for attention in (first, second):
        out, lse = attention(*args, max_query_len=1, num_kv_splits=4, return_lse=True)
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
        check_lse(lse, ref_lse, torch.float32)
    assert _pointers(first) and _pointers(second)
    assert not _pointers(first) & _pointers(second)
    shared = _pointers(default_planner(torch.device(triton_device)))
    assert not (_pointers(first) | _pointers(second)) & shared
    fused = num_reqs * 2 <= 16  # (request, KV head) pairs: see decode_schedule
    assert len(first.workspace.buffers()) == (3 if fused else 2)  # partials (+ counters)


def test_a_plan_runs_every_layer_and_rejects_other_metadata(triton_device: str) -> None:
    """One plan, three layers' caches: each layer's reference. Inputs with other metadata
    (a longer batch, an output of another dtype) are a ValueError that writes nothing."""
    query, k_cache, v_cache, table, seq, qsl = make_case(
        DECODE, 4, 2, 2, 16, torch.float32, triton_device, seed=2)
    attention = PagedAttention(triton_device)
    out = torch.empty_like(query)
    plan = attention.plan(query, k_cache, v_cache, table, seq, qsl, out=out, max_query_len=1,
                          num_kv_splits=2, return_lse=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        k = torch.randn(k_cache.shape, generator=gen).to(triton_device)
        v = torch.randn(v_cache.shape, generator=gen).to(triton_device)
        q = torch.randn(query.shape, generator=gen).to(triton_device)
        result, lse = plan.run(q, k, v, table, seq, qsl, out=out)
        assert result is out
        ref, ref_lse = reference(q, k, v, table, seq, qsl)
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
        check_lse(lse, ref_lse, torch.float32)
    before = out.clone()
    longer = make_case(DECODE * 2, 4, 2, 2, 16, torch.float32, triton_device, seed=2)
    with pytest.raises(ValueError, match="plan this step again"):
        plan.run(*longer, out=torch.empty_like(longer[0]))
    with pytest.raises(ValueError, match="plan this step again"):
        plan.run(query, k_cache, v_cache, table, seq, qsl)  # planned with an out
    with pytest.raises(ValueError, match="plan this step again"):
        plan.run(query.double(), k_cache, v_cache, table, seq, qsl, out=out)
    assert torch.equal(out, before)


def test_planner_checks_its_device_and_keeps_at_most_max_plans(triton_device: str) -> None:
    args = make_case(DECODE, 4, 2, 2, 16, torch.float32, triton_device, seed=4)
    with pytest.raises(ValueError, match="query must be on meta"):
        PagedAttention("meta").plan(*args)
    with pytest.raises(ValueError, match="max_plans must be >= 1"):
        PagedAttention(triton_device, max_plans=0)
    attention = PagedAttention(triton_device, max_plans=1)
    attention(*args, max_query_len=1)
    attention(*args, max_query_len=1, num_kv_splits=2)
    assert len(attention._plans) == 1
