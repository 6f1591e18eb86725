"""Token choice: greedy, seeded temperature / top-k / top-p sampling, and stop tokens in the
engine, checked against transformers' generate with the same stopping rules."""

from __future__ import annotations

import pytest
import torch

from blocktable.engine import EngineConfig, LLMEngine, reference_generate, tiny_llama
from blocktable.engine.sampling import GREEDY, SamplingParams, sample_token
from blocktable.engine.verify import verify_requests


def test_greedy_takes_the_first_largest_logit() -> None:
    logits = torch.tensor([0.5, 2.0, 2.0, -1.0])
    assert sample_token(logits, GREEDY, None) == 1


def test_top_k_and_top_p_restrict_the_draws() -> None:
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, 2.8])
    params = SamplingParams(temperature=5.0, top_k=2, seed=1)
    gen = params.make_generator()
    assert {sample_token(logits, params, gen) for _ in range(300)} == {0, 1}
    # probabilities at temperature 1: ~[.36, .32, .02, .01, .29]: .36 < .6 <= .36 + .32
    params = SamplingParams(temperature=1.0, top_p=0.6, seed=2)
    gen = params.make_generator()
    assert {sample_token(logits, params, gen) for _ in range(300)} == {0, 1}
    # a tiny top_p keeps the most likely token only
    params = SamplingParams(temperature=1.0, top_p=1e-6, seed=3)
    gen = params.make_generator()
    assert {sample_token(logits, params, gen) for _ in range(50)} == {0}


def test_seeded_draws_repeat_and_differ_across_seeds() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        params = SamplingParams(temperature=2.0, seed=seed)
        gen = params.make_generator()
        return [sample_token(logits, params, gen) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


@pytest.mark.parametrize("kwargs,needle", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_params(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=0)


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_stop_token_ends_a_request_as_generate_does(model: torch.nn.Module) -> None:
    prompt = [5, 17, 99, 3, 42, 8, 1]
    full, _ = reference_generate(model, prompt, 10)  # no stop: runs to the length
    stop = full[3]
    first = full.index(stop)  # the first time it appears
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=32))
    stopped = engine.add_request("stop", prompt, 10, stop_token_ids=[stop])
    long = engine.add_request("long", prompt, 10)
    _run(engine)
    assert stopped.output_token_ids == full[: first + 1] and stopped.finish_reason == "stop"
    assert long.output_token_ids == full and long.finish_reason == "length"
    ref, _ = reference_generate(model, prompt, 10, stop_token_ids={stop})
    assert ref == stopped.output_token_ids
    assert all(c.ok for c in verify_requests(model, [stopped, long]))
    assert engine.manager.num_free_blocks() == 31  # the stopped request gave its blocks back


def test_verification_notices_a_missed_stop(model: torch.nn.Module) -> None:
    prompt = [5, 17, 99, 3, 42, 8, 1]
    full, _ = reference_generate(model, prompt, 10)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=32))
    req = engine.add_request("r", prompt, 10)
    _run(engine)
    req.stop_token_ids = frozenset({full[2]})  # as if the engine had ignored this stop
    (check,) = verify_requests(model, [req])
    assert not check.tokens_match and not check.ok


def test_sampled_request_ignores_its_batch(model: torch.nn.Module) -> None:
    params = SamplingParams(temperature=1.5, top_k=20, seed=11)
    prompt = [9, 8, 7, 6, 5]

    def tokens(with_others: bool) -> list[int]:
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=48, token_budget=8))
        if with_others:
            engine.add_request("other", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 6)
        req = engine.add_request("s", prompt, 8, sampling=params)
        _run(engine)
        return req.output_token_ids

    alone = tokens(False)
    assert alone == tokens(True)
    assert alone != reference_generate(model, prompt, 8)[0]  # it did sample
    with pytest.raises(ValueError, match="sampled"):
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=16))
        req = engine.add_request("s", prompt, 2, sampling=params)
        _run(engine)
        verify_requests(model, [req])
