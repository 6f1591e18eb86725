"""The context-parallel engine's requests stop and sample as the single-process engine's do.

One spawned gloo job (two ranks, the tiny model built in each rank by a builder object) whose
driver adds requests with their own stop tokens, a seeded sampled request and a plain greedy
one, then steps to the end. The tokens must equal :class:`~blocktable.engine.LLMEngine`'s on
the same requests, and the greedy ones ``transformers.generate``'s with the same stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from blocktable.context_parallel.launch import run_ranks
from blocktable.engine import EngineConfig, LLMEngine, tiny_llama, verify_requests
from blocktable.engine.dcp_runner import DCPResult, DCPRun, TinyLlama, run_dcp_rank
from blocktable.engine.sampling import GREEDY, SamplingParams

TIMEOUT_S = 240.0  # the whole job; a hang ends here (children are killed)
WORLD = 2
BLOCK_SIZE = 4  # per rank; the allocator's block spans both ranks
MAX_NEW_TOKENS = 10
PROMPTS = {"stopped": (3, 14, 15, 92, 65, 35, 89, 79, 32), "sampled": (27, 18, 28, 18, 28),
           "plain": (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)}
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7)


@dataclass(frozen=True)
class Spec:
    """One request: prompt, stop tokens, sampling."""

    req_id: str
    prompt: tuple[int, ...]
    stops: frozenset[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class AddAndRun:
    """A driver: add every request at step 0, step until all finished."""

    specs: tuple[Spec, ...]

    def __call__(self, engine: Any, model: Any) -> int:
        for s in self.specs:
            engine.add_request(s.req_id, s.prompt, MAX_NEW_TOKENS, stop_token_ids=s.stops,
                               sampling=s.sampling)
        while engine.has_unfinished():
            engine.step()
        return int(engine.step_index)


def _config(block_size: int) -> EngineConfig:
    return EngineConfig(block_size=block_size, num_blocks=16, max_num_reqs=4, token_budget=12,
                        max_model_len=32)


def _single(model: torch.nn.Module, specs: tuple[Spec, ...]) -> dict[str, Any]:
    engine = LLMEngine(model, _config(BLOCK_SIZE * WORLD))
    for s in specs:
        engine.add_request(s.req_id, s.prompt, MAX_NEW_TOKENS, stop_token_ids=s.stops,
                           sampling=s.sampling)
    while engine.has_unfinished():
        engine.step()
    return engine.requests


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def specs(model: torch.nn.Module) -> tuple[Spec, ...]:
    # The stop token: the third token the stopped prompt generates greedily without stops, so
    # the request must end there (a stop that never comes would test nothing).
    free = _single(model, (Spec("stopped", PROMPTS["stopped"], frozenset(), GREEDY),))
    stop = free["stopped"].output_token_ids[2]
    return (Spec("stopped", PROMPTS["stopped"], frozenset({stop, 255}), GREEDY),
            Spec("sampled", PROMPTS["sampled"], frozenset(), SAMPLED),
            Spec("plain", PROMPTS["plain"], frozenset(), GREEDY))


@pytest.fixture(scope="module")
def driver(specs: tuple[Spec, ...]) -> DCPResult:
    run = DCPRun(_config(BLOCK_SIZE), (), build_model=TinyLlama(3), drive=AddAndRun(specs))
    results = run_ranks(run_dcp_rank, WORLD, args=([run],), timeout_s=TIMEOUT_S)
    assert results[1][0].driven is None and results[1][0].requests == []  # a follower
    return results[0][0]


def test_stop_tokens_and_sampling_match_one_process(
    driver: DCPResult, specs: tuple[Spec, ...], model: torch.nn.Module
) -> None:
    got = {r.req_id: r for r in driver.requests}
    want = _single(model, specs)
    assert driver.driven == max(r.finish_step for r in want.values()) + 1  # steps run
    for req_id, w in want.items():
        assert got[req_id].output_token_ids == w.output_token_ids, req_id
        assert got[req_id].finish_reason == w.finish_reason, req_id
    stopped = got["stopped"]
    assert stopped.finish_reason == "stop" and len(stopped.output_token_ids) <= 3
    assert stopped.output_token_ids[-1] in stopped.stop_token_ids
    assert got["plain"].finish_reason == "length"
    assert got["sampled"].sampling == SAMPLED


def test_greedy_requests_match_generate_with_their_stops(
    driver: DCPResult, model: torch.nn.Module
) -> None:
    greedy = [r for r in driver.requests if r.sampling.greedy]
    checks = verify_requests(model, greedy)
    assert len(checks) == 2 and all(c.ok for c in checks), checks
