"""Tokens per second of the engine with a real model beside ``transformers.generate``.

Both sides get the same prompts (the real-model demo's chat questions, all at once), the same
``--max-new-tokens``, the same stop tokens (the model's end-of-turn) and the same torch thread
count; ``generate`` runs them as one left-padded batch. Runs alternate (engine, generate,
engine, ...) ``--repeats`` times per thread count and the median is reported. The engine's
CPU attention is the batched torch path in the model's dtype; ``--reference`` adds the engine
with the float64 reference attention (slow) for comparison.

    PYTHONPATH=src python benchmarks/bench_model.py --threads 1 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blocktable.engine import EngineConfig, LLMEngine
from blocktable.engine.chat import encode_chat, model_stop_token_ids
from blocktable.engine.model import PagedLlama
from blocktable.engine.verify import timed_generate_batched
from blocktable.hf_loader import load_model, resolve_model
from blocktable.model_demo import LONG_PROMPT, QUESTIONS, SENTENCE_QUESTION, SYSTEM_PROMPT


def engine_run(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
               stops: frozenset[int], attention: str) -> tuple[int, float, list[list[int]]]:
    """Generated tokens, seconds, and the tokens of each prompt."""
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=256,
                                           max_num_reqs=len(prompts), token_budget=512,
                                           max_model_len=2048, record_logits=False))
    if attention != "batched":
        engine.model = PagedLlama(model, 256, 16, "torch", attention=attention)
    reqs = [engine.add_request(str(i), p, max_new_tokens, stop_token_ids=stops)
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed_s = time.perf_counter() - t0
    return sum(len(r.output_token_ids) for r in reqs), elapsed_s, [r.output_token_ids for r in reqs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--reference", action="store_true",
                        help="also time the engine with the float64 reference attention")
    args = parser.parse_args()

    loaded = load_model(resolve_model(args.model))
    model, tok = loaded.model, loaded.tokenizer
    stops = model_stop_token_ids(model, tok)
    questions = [*QUESTIONS, SENTENCE_QUESTION, LONG_PROMPT, "What is the capital of Italy?"]
    prompts = [encode_chat(tok, [{"role": "system", "content": SYSTEM_PROMPT},
                                 {"role": "user", "content": q}]) for q in questions]
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(stops)
    sides = ["engine", "generate"] + (["engine (float64 reference)"] if args.reference else [])
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        rates: dict[str, list[float]] = {s: [] for s in sides}
        same = True
        for _ in range(args.repeats):
            n, t, engine_tokens = engine_run(model, prompts, args.max_new_tokens, stops,
                                             "batched")
            rates["engine"].append(n / t)
            hf_tokens, t_hf = timed_generate_batched(model, prompts, args.max_new_tokens, stops,
                                                     pad_token_id=pad)
            rates["generate"].append(sum(map(len, hf_tokens)) / t_hf)
            same = same and hf_tokens == engine_tokens
            if args.reference:
                n, t, _ = engine_run(model, prompts, args.max_new_tokens, stops, "reference")
                rates["engine (float64 reference)"].append(n / t)
        for side in sides:
            rows.append((threads, side, statistics.median(rates[side]), min(rates[side]),
                         max(rates[side])))
        print(f"threads {threads}: batched generate's tokens equal the engine's: {same}")

    print(f"\n{args.model}: {len(prompts)} prompts ({sum(map(len, prompts))} tokens), "
          f"max_new_tokens {args.max_new_tokens}, stop at end-of-turn, {args.repeats} repeats, "
          f"torch {torch.__version__}")
    print(f"{'threads':>7}  {'side':<28} {'tok/s p50':>9} {'min':>7} {'max':>7}")
    for threads, side, p50, low, high in rows:
        print(f"{threads:>7}  {side:<28} {p50:9.1f} {low:7.1f} {high:7.1f}")


if __name__ == "__main__":
    main()
