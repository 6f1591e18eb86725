"""End to end: the continuous-batching engine on blocktable equals transformers' generate.

The workload is built so that every path runs (and the test checks that it did): requests
arrive and finish at different steps, share prompt prefixes of >= 2 full blocks (prefix-cache
hits), have prompts longer than the token budget (chunked prefill) and need more KV than the
pool holds (preemption and recompute), in an indexed-mode table whose rows are not the batch
order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from blocktable.engine import (
    EngineConfig,
    LLMEngine,
    SchedulerOutput,
    make_workload,
    run_workload,
    tiny_llama,
    verify_requests,
)
from blocktable.engine.verify import LOGITS_RTOL

CASES = {
    # block size 4, prefix cache on: 8 requests through a 17-block pool
    "bs4-prefix": {"block_size": 4, "num_blocks": 18, "token_budget": 16, "prefix": True,
                   "seed": 0},
    # block size 8 and no prefix cache: preempted requests recompute everything
    "bs8-noprefix": {"block_size": 8, "num_blocks": 12, "token_budget": 20, "prefix": False,
                     "seed": 1},
}


@dataclass
class Observed:
    """What the step hook saw."""

    rows_out_of_batch_order: int = 0  # steps whose row_of_batch was not 0..n-1
    mixed_steps: int = 0  # steps with a prefill chunk and a decode together
    snapshots_checked: int = 0
    errors: list[str] = field(default_factory=list)


def _check_step(engine: LLMEngine, batch: SchedulerOutput, seen: Observed) -> None:
    """Table rows equal the allocator's block lists; record which paths this step takes."""
    manager, table = engine.manager, engine.table[0]
    rows = [manager.row_of(s.request.req_id) for s in batch.scheduled]
    if rows != list(range(len(rows))):
        seen.rows_out_of_batch_order += 1
    lens = {s.num_new_tokens for s in batch.scheduled}
    if 1 in lens and len(lens) > 1:
        seen.mixed_steps += 1
    for req in engine.scheduler.running:
        row = manager.row_of(req.req_id)
        got = table.block_table_np[row, : table.num_kernel_blocks[row]].tolist()
        if got != manager.block_ids(req.req_id)[0]:
            seen.errors.append(f"step {engine.step_index} row {row}: {got}")
    manager.check_integrity()
    engine.table.check_integrity()
    seen.snapshots_checked += 1


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=0)


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request: pytest.FixtureRequest, model: torch.nn.Module) -> tuple[LLMEngine, Observed, dict]:
    case = CASES[request.param]
    workload = make_workload(8, seed=case["seed"], block_size=case["block_size"],
                             max_new_tokens=10)
    max_model_len = max(len(w.prompt_token_ids) for w in workload) + 10
    engine = LLMEngine(model, EngineConfig(
        block_size=case["block_size"], num_blocks=case["num_blocks"], max_num_reqs=8,
        token_budget=case["token_budget"], max_model_len=max_model_len,
        enable_prefix_caching=case["prefix"],
    ))
    seen = Observed()
    run_workload(engine, workload, hook=lambda eng, batch: _check_step(eng, batch, seen))
    return engine, seen, case


def test_every_path_ran(run: tuple[LLMEngine, Observed, dict]) -> None:
    engine, seen, case = run
    reqs = list(engine.requests.values())
    assert not seen.errors, seen.errors[:3]
    assert all(r.is_finished and len(r.output_token_ids) == r.max_new_tokens for r in reqs)
    # Arrivals and finishes at different steps, more than one request in flight.
    assert len({r.arrival_step for r in reqs}) >= 4
    assert len({r.finish_step for r in reqs}) >= 4
    assert not engine.scheduler.running and not engine.scheduler.waiting
    # Chunked prefill: a prompt longer than the budget took several steps.
    assert max(len(r.prompt_token_ids) for r in reqs) > case["token_budget"]
    assert sum(r.num_prefill_chunks for r in reqs) >= 1
    assert seen.mixed_steps >= 1
    # Preemption, and the preempted requests finished after recomputing.
    assert engine.manager.num_preemptions >= 1
    assert any(r.num_preemptions for r in reqs)
    # Indexed mode: some step's batch order differed from the rows.
    assert seen.rows_out_of_batch_order >= 1
    hits = [r.num_cached_tokens for r in reqs]
    if case["prefix"]:
        assert engine.manager.prefix_cache_stats.num_hit_tokens > 0
        assert engine.scheduler.num_hit_tokens == sum(hits)
        assert max(hits) >= 2 * case["block_size"]
        assert sum(h >= 2 * case["block_size"] for h in hits) >= 2
    else:
        assert max(hits) == 0
    # Everything is given back at the end.
    assert engine.manager.num_free_blocks() == case["num_blocks"] - 1
    assert engine.manager.num_free_rows == 8


def test_equals_transformers_generate(
    run: tuple[LLMEngine, Observed, dict], model: torch.nn.Module
) -> None:
    engine, _, _ = run
    checks = verify_requests(model, engine.requests.values())
    bad = [c for c in checks if not c.tokens_match]
    assert not bad, f"tokens differ from transformers.generate for {[c.req_id for c in bad]}"
    diffs = np.array([c.max_logits_diff for c in checks])
    assert np.isfinite(diffs).all()
    assert all(c.max_logits_diff <= c.logits_bound for c in checks), diffs
    assert all(c.logits_bound <= LOGITS_RTOL * 100 for c in checks)  # logits are O(1..10)
    assert all(c.ok for c in checks)


def test_request_that_cannot_fit_is_rejected(model: torch.nn.Module) -> None:
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=5, max_model_len=64))
    with pytest.raises(ValueError, match="blocks"):
        engine.add_request("big", list(range(20)), max_new_tokens=4)  # 23 tokens > 4 blocks
    engine.add_request("ok", list(range(10)), max_new_tokens=7)  # 16 tokens = 4 blocks
    with pytest.raises(ValueError, match="already added"):
        engine.add_request("ok", [1], max_new_tokens=1)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.requests["ok"].output_token_ids) == 7


def test_gpu_code_path_under_the_triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend="triton"``: slot mapping, KV writes and attention of every step (prefill,
    chunks, mixed, decode) through the Triton kernels, never the reference (on CUDA when there
    is one, else on CPU tensors under Triton's interpreter)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest) or CUDA")
    model = tiny_llama(seed=0, device=device)
    import blocktable.attention.paged as paged_mod
    import blocktable.engine.model as model_mod

    def no_reference(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the engine's triton backend reached the reference attention")

    monkeypatch.setattr(paged_mod, "paged_attention_reference", no_reference)
    num_decode_calls = num_calls = 0
    real_attention = model_mod.paged_attention

    def counting_attention(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal num_decode_calls, num_calls
        num_calls += 1
        num_decode_calls += kwargs["max_query_len"] == 1
        assert kwargs["backend"] == "triton"
        return real_attention(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(model_mod, "paged_attention", counting_attention)
    workload = make_workload(5, seed=0, block_size=16, max_new_tokens=6, num_prefix_blocks=2,
                             max_suffix_len=8)
    engine = LLMEngine(model, EngineConfig(
        block_size=16, num_blocks=6, max_num_reqs=5, token_budget=24, max_model_len=64,
        backend="triton",
    ))
    run_workload(engine, workload)
    assert engine.table.backend == "triton"
    assert num_calls > num_decode_calls > 0
    assert engine.manager.num_preemptions >= 1 and engine.scheduler.num_hit_tokens > 0
    assert all(c.ok for c in verify_requests(model, engine.requests.values()))


@pytest.mark.parametrize("decode", [True, False])
def test_batch_inputs_staged_equal_own_buffers(decode: bool) -> None:
    """fill_staged writes into a captured step's staging exactly what fill writes into the
    engine's own buffers, and the same ids and logits' indices; a decode batch (one token per
    request) takes the shortcut for positions."""
    from blocktable import GroupSpec, MultiGroupBlockTable, StepUpdate
    from blocktable.engine.batch_inputs import BatchInputBuffers, staged_payload_words
    from blocktable.step import CapturedStep

    rng = np.random.default_rng(4 + decode)
    own, staged = BatchInputBuffers(8, 40, torch.device("cpu")), BatchInputBuffers(
        8, 40, torch.device("cpu"))
    step = CapturedStep(MultiGroupBlockTable([GroupSpec(4)], 8, 64, 40),
                        payload_words=staged_payload_words(8, 40))
    for _ in range(5):
        n = int(rng.integers(1, 9))
        starts = rng.integers(0, 50, n).astype(np.int64)
        num_new = np.ones(n, np.int64) if decode else rng.integers(1, 6, n).astype(np.int64)
        rows = rng.permutation(8)[:n].astype(np.int32)
        ids = rng.integers(0, 100, int(num_new.sum())).tolist()
        a = own.fill(starts, num_new, rows, ids)
        views = step.batch_views()
        b = staged.fill_staged(starts, num_new, rows, ids, views, step.device_payload)
        t = a.num_tokens
        assert b.num_tokens == t
        want_pos = np.concatenate([np.arange(s, s + k) for s, k in zip(starts, num_new)])
        np.testing.assert_array_equal(a.positions.numpy(), want_pos)
        np.testing.assert_array_equal(views.positions[:t], want_pos)
        np.testing.assert_array_equal(views.query_start_loc[: n + 1], a.query_start_loc.numpy())
        np.testing.assert_array_equal(views.row_of_batch[:n], rows)
        np.testing.assert_array_equal(views.seq_lens[:n], a.seq_lens.numpy())
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.logits_indices, b.logits_indices)
        step.run_staged(StepUpdate.empty(1), n, t)
