"""``blocktable demo --offload``: a workload whose reusable prefixes do not fit the device pool.

Four long "system prompts" of half the pool each take turns (so each one's blocks are evicted
by the others' before it returns); then the first sessions come back for a second turn (their
whole first exchange is a prefix). The engine runs it twice, with a host tier and without,
reports what the tier moved and the prefill it saved, and checks every request of the host-tier
run against transformers' ``generate``.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from blocktable.demo import DemoOptions
    from blocktable.engine import LLMEngine

NUM_SYSTEM_PROMPTS = 4
TURN_LEN = 3  # tokens of a user turn


def offload_waves(opts: DemoOptions, vocab_size: int) -> list[list[tuple[str, list[int]]]]:
    """The first two waves of (request id, prompt): every system prompt with a user turn,
    twice over, in turn (the third wave, second turns, needs the first wave's answers)."""
    rng = random.Random(opts.seed)
    prompt_len = (opts.num_blocks // 2) * opts.block_size
    systems = [[rng.randrange(1, vocab_size) for _ in range(prompt_len)]
               for _ in range(NUM_SYSTEM_PROMPTS)]
    return [
        [(f"w{wave}s{s}", [*system, *(rng.randrange(1, vocab_size) for _ in range(TURN_LEN))])
         for s, system in enumerate(systems)]
        for wave in range(2)
    ]


def run_waves(engine: LLMEngine, opts: DemoOptions, vocab_size: int) -> None:
    """Run the workload's three waves on ``engine`` (each wave to completion)."""
    waves = offload_waves(opts, vocab_size)
    rng = random.Random(opts.seed + 1)
    for wave in waves:
        _run_wave(engine, wave, opts.max_new_tokens)
    returning = []  # the first wave's sessions, second turn
    for req_id, prompt in waves[0][:2]:
        first = engine.requests[req_id]
        turn = [rng.randrange(1, vocab_size) for _ in range(TURN_LEN)]
        returning.append((f"{req_id}t2", [*prompt, *first.output_token_ids, *turn]))
    _run_wave(engine, returning, opts.max_new_tokens)


def _run_wave(engine: LLMEngine, wave: list[tuple[str, list[int]]], max_new_tokens: int) -> None:
    for req_id, prompt in wave:
        engine.add_request(req_id, prompt, max_new_tokens)
    while engine.has_unfinished():
        engine.step()


def run_offload_demo(opts: DemoOptions, console: Console) -> int:
    """Run the offload demo; return 0 when every request matches transformers, else 1."""
    import transformers

    from blocktable.engine import EngineConfig, LLMEngine, tiny_llama
    from blocktable.engine.verify import verify_requests

    say = (lambda *a: None) if opts.quiet else console.print
    transformers.logging.set_verbosity_error()
    model = tiny_llama(seed=opts.seed, device=opts.device)
    vocab_size = model.config.vocab_size
    prompt_len = (opts.num_blocks // 2) * opts.block_size
    max_model_len = 2 * (prompt_len + TURN_LEN + opts.max_new_tokens)
    host_blocks = 4 * opts.num_blocks
    engines = {}
    for name, num_host in (("host tier", host_blocks), ("device only", 0)):
        engine = LLMEngine(model, EngineConfig(
            block_size=opts.block_size, num_blocks=opts.num_blocks, max_num_reqs=2,
            token_budget=opts.token_budget, max_model_len=max_model_len, host_blocks=num_host,
        ))
        run_waves(engine, opts, vocab_size)
        engines[name] = engine
    engine, plain = engines["host tier"], engines["device only"]
    say(f"[bold]blocktable demo --offload[/]: {NUM_SYSTEM_PROMPTS} system prompts of "
        f"{prompt_len} tokens, {opts.num_blocks} device blocks of {opts.block_size} tokens, "
        f"{host_blocks} host blocks, on {opts.device}")
    stats = engine.manager.prefix_cache_stats
    host = engine.manager.host_tier_stats[0]
    assert engine.host_cache is not None
    copies = engine.host_cache.stats
    console.print(f"host tier: offloaded {host.num_offloaded_blocks} blocks, restored "
                  f"{host.num_restored_blocks} blocks, {stats.num_host_hit_tokens} prompt tokens "
                  f"served from host", soft_wrap=True)
    computed, computed_plain = (stats.num_query_tokens - stats.num_hit_tokens,
                                plain.manager.prefix_cache_stats.num_query_tokens
                                - plain.manager.prefix_cache_stats.num_hit_tokens)
    console.print(f"prefill: {computed} prompt tokens computed with the host tier, "
                  f"{computed_plain} without ({computed_plain - computed} saved)", soft_wrap=True)
    say(f"copies: {copies.offloaded_bytes / 2**10:.0f} KiB offloaded, "
        f"{copies.restored_bytes / 2**10:.0f} KiB restored, "
        f"{copies.copy_time_s * 1e3:.2f} ms of host time")
    checks = verify_requests(model, engine.requests.values())
    checks += verify_requests(model, plain.requests.values())
    bad = [c.req_id for c in checks if not c.ok]
    if bad:
        console.print(f"[red]MISMATCH[/] against transformers: {', '.join(bad)}")
        return 1
    console.print(f"all {len(checks)} requests (both runs) match transformers")
    return 0
