"""``blocktable demo --disaggregate``: prefill in one process, decode in another.

Two ranks are spawned (gloo on the CPU; NCCL with ``--device cuda``, one GPU each). Rank 0
prefills every request and samples its first token; rank 1 admits it into its own allocator
(prefix hits included), receives only the blocks it lacks and decodes. The parent prints each
request's transfer, then checks every request's tokens against the single-process engine and
``transformers.generate`` (greedy, the same stop tokens).

The model is the tiny random one, or with ``--model`` a real one: the parent hands each
process the model's source and each loads it itself (a model does not cross a process start),
and the requests are the real-model demo's chat prompts with their stop tokens. Its
follow-up turn is left out: that prompt needs an answer only the decode side has.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from blocktable.demo import DemoOptions
    from blocktable.engine import EngineConfig, WorkloadRequest
    from blocktable.engine.dcp_runner import ModelBuilder
    from blocktable.engine.model import HFLlama
    from blocktable.hf_loader import LoadedModel

JOB_TIMEOUT_S = 600.0  # a dead rank ends the job at once; this only bounds a stuck one
TINY_TIMEOUT_S = 30.0  # longest wait on the peer for one operation (the tiny model)
MODEL_TIMEOUT_S = 300.0
"""With ``--model``: the first wait (the handshake) covers the slower side's model load, tens
of seconds on a small shared machine; a side that dies is still noticed at once."""


@dataclass(frozen=True)
class DisaggregatedRun:
    """What the parent spawns and checks: the same for the tiny model and a real one."""

    header: str
    model: HFLlama  # the parent's copy: the references run on it
    build_model: ModelBuilder  # how each side builds its own
    workload: tuple[WorkloadRequest, ...]
    config: EngineConfig  # both sides' engine, and the single-process reference's
    stop_token_ids: dict[str, frozenset[int]] = field(default_factory=dict)
    timeout_s: float = TINY_TIMEOUT_S
    num_threads: int | None = None  # torch threads per side (None: the cores shared out)
    tokenizer: Any = None  # a real model's: the answers are printed as text


def run_disaggregated_demo(opts: DemoOptions, console: Console,
                           loaded: LoadedModel | None = None) -> int:
    """Run it; return the exit code (0: every request matches, 1: a mismatch or a request
    that was refused, 2: a model that cannot be fetched or loaded, or prompts that cannot
    run, 3: a process failed, died or stalled). ``loaded``: ``opts.model`` already loaded
    in this process (each side still loads it itself)."""
    if opts.dcp != 1:
        raise ValueError(f"the disaggregated demo runs one decode process (dcp=1), got "
                         f"dcp={opts.dcp}")
    if opts.max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be >= 2 (the prefill side samples the first "
                         f"token), got {opts.max_new_tokens}")
    import transformers

    transformers.logging.set_verbosity_error()
    say = (lambda *a: None) if opts.quiet else (lambda s: console.print(s, soft_wrap=True))
    run = tiny_run(opts) if opts.model is None else model_run(opts, say, loaded)
    if isinstance(run, str):
        print(f"blocktable demo: error: {run}", file=sys.stderr)
        return 2
    say(run.header)
    return spawn_and_verify(run, opts.device, console, say)


def tiny_run(opts: DemoOptions) -> DisaggregatedRun:
    """The tiny random model on the engine demo's synthetic workload."""
    from blocktable.engine import EngineConfig, make_workload, tiny_llama
    from blocktable.engine.dcp_runner import TinyLlama

    model = tiny_llama(seed=opts.seed, device=opts.device)  # the references run there too
    workload = make_workload(opts.num_requests, seed=opts.seed, block_size=opts.block_size,
                             vocab_size=model.config.vocab_size,
                             max_new_tokens=opts.max_new_tokens)
    max_model_len = max(len(w.prompt_token_ids) for w in workload) + opts.max_new_tokens
    config = EngineConfig(block_size=opts.block_size, num_blocks=opts.num_blocks,
                          max_num_reqs=opts.num_requests, token_budget=opts.token_budget,
                          max_model_len=max_model_len)
    header = (f"[bold]blocktable demo --disaggregate[/]: {len(workload)} requests on a tiny "
              f"Llama; {_sides(opts)}")
    return DisaggregatedRun(header, model, TinyLlama(opts.seed), tuple(workload), config)


def model_run(opts: DemoOptions, say: Any, loaded: LoadedModel | None = None
              ) -> DisaggregatedRun | str:
    """``opts.model``'s chat requests (the real-model demo's, or ``opts.prompts``), or a
    one-line error."""
    import torch

    from blocktable.dcp_demo import LoadInRank
    from blocktable.engine import EngineConfig, WorkloadRequest
    from blocktable.hf_loader import ModelLoadError, load_model, resolve_model
    from blocktable.model_demo import default_num_threads, describe_model, plan_chat

    assert opts.model is not None
    threads = opts.threads or max(1, default_num_threads() // 2)
    torch.set_num_threads(threads)  # the parent's references
    try:  # fetched once here, not by both sides at once
        source = resolve_model(opts.model, opts.model_cache, say=lambda s: say(s))
        t0 = time.perf_counter()
        if loaded is None:
            say(f"loading {source.label} ...")
            loaded = load_model(source, device=opts.device)
    except ModelLoadError as exc:
        return str(exc)
    t_load = time.perf_counter() - t0
    model, tokenizer = loaded.model, loaded.tokenizer
    plan = plan_chat(opts, model, tokenizer, loaded.label)
    if isinstance(plan, str):
        return plan
    if not plan.sampling.greedy:
        return ("--disaggregate decodes greedily (a sampler's state does not move with the "
                f"KV), got --temperature {opts.temperature:g}")
    workload = tuple(WorkloadRequest(r.req_id, tuple(r.prompt_token_ids), plan.max_new_tokens,
                                     r.arrival_step) for r in plan.requests)
    config = EngineConfig(block_size=opts.block_size, num_blocks=opts.num_blocks,
                          max_num_reqs=len(workload), token_budget=opts.token_budget,
                          max_model_len=plan.max_model_len)
    left_out = (" (q0's follow-up turn is left out: its prompt needs q0's answer, which only "
                "the decode side has)" if plan.follows_up else "")
    header = (f"[bold]blocktable demo --disaggregate[/]: "
              f"{describe_model(loaded.label, model, t_load, 'here')}; {len(workload)} "
              f"request{'s' if len(workload) > 1 else ''}{left_out}; {_sides(opts)}, each process loading {source.label} "
              f"itself, {threads} torch thread{'s' if threads > 1 else ''} each; greedy")
    return DisaggregatedRun(header, model, LoadInRank(source), workload, config,
                            {r.req_id: r.stop_token_ids for r in plan.requests},
                            MODEL_TIMEOUT_S, threads, tokenizer)


def _sides(opts: DemoOptions) -> str:
    backend = "nccl" if opts.device == "cuda" else "gloo"
    return (f"prefill on rank 0, decode on rank 1 ({backend} on {opts.device}); each side "
            f"{opts.num_blocks} blocks of {opts.block_size} tokens")


def spawn_and_verify(run: DisaggregatedRun, device: str, console: Console, say: Any) -> int:
    """Spawn the two sides, print the transfers, verify every request; the exit code."""
    from rich.markup import escape

    from blocktable.context_parallel.launch import RankFailedError, run_ranks
    from blocktable.engine.verify import reference_generate
    from blocktable.transfer.session import Session, run_side

    session = Session(prefill=run.config, decode=run.config, workload=run.workload,
                      stop_token_ids=run.stop_token_ids, prefill_model=run.build_model,
                      decode_model=run.build_model, device=device, timeout_s=run.timeout_s)
    try:
        prefill, decode = run_ranks(run_side, 2, args=(session,), device=device,
                                    timeout_s=JOB_TIMEOUT_S,
                                    pg_timeout_s=max(60.0, run.timeout_s),
                                    num_threads=run.num_threads)
    except (RankFailedError, TimeoutError) as err:
        console.print(f"[red]FAILED[/]: {escape(getattr(err, 'summary', str(err)))}",
                      soft_wrap=True)
        return 3
    print_transfers(decode, prefill, say)
    got = {**decode["tokens"], **prefill["finished"]}
    single = single_engine_tokens(run)
    num_ok = 0
    for w in run.workload:
        stops = run.stop_token_ids.get(w.req_id, frozenset())
        ref, _ = reference_generate(run.model, list(w.prompt_token_ids), w.max_new_tokens,
                                    stops)
        ok = got.get(w.req_id) == single[w.req_id] == ref
        num_ok += ok
        if run.tokenizer is not None:
            text = run.tokenizer.decode([t for t in got.get(w.req_id, []) if t not in stops],
                                        skip_special_tokens=True).strip()
            say(f"[bold]{w.req_id}[/]: {escape(text)}")
        if not ok:
            console.print(f"[red]{w.req_id}[/]: disaggregated {got.get(w.req_id)}, single "
                          f"engine {single[w.req_id]}, transformers {ref}", soft_wrap=True)
    stopping = "same stop tokens" if run.stop_token_ids else "no stop tokens"
    console.print(f"{'[green]OK[/]' if num_ok == len(run.workload) else '[red]FAILED[/]'}: "
                  f"{num_ok}/{len(run.workload)} requests decoded after a transfer match the "
                  f"single engine and transformers.generate (greedy, {stopping})",
                  soft_wrap=True)
    return 0 if num_ok == len(run.workload) else 1


def single_engine_tokens(run: DisaggregatedRun) -> dict[str, list[int]]:
    """Every request's tokens from one engine in this process (all submitted at once, as to
    the prefill side)."""
    from blocktable.engine import LLMEngine

    engine = LLMEngine(run.model, run.config)
    for w in run.workload:
        engine.add_request(w.req_id, w.prompt_token_ids, w.max_new_tokens,
                           stop_token_ids=run.stop_token_ids.get(w.req_id, ()))
    while engine.has_unfinished():
        engine.step()
    engine.manager.check_integrity()
    return {r.req_id: r.output_token_ids for r in engine.requests.values()}


def print_transfers(decode: dict[str, Any], prefill: dict[str, Any], say: Any) -> None:
    """One line per request and a total (a buffer's time is shared by its requests)."""
    total_blocks = total_bytes = 0
    total_s = 0.0
    for req_id, num_blocks, num_bytes, time_s, num_hit, batch in decode["transfers"]:
        note = f"; {num_hit} prompt tokens were prefix-cache hits" if num_hit else ""
        shared = f" (one buffer for {batch} requests)" if batch > 1 else ""
        say(f"{req_id}: transferred {_blocks(num_blocks)} ({num_bytes} bytes) in "
            f"{time_s * 1e3:.2f} ms{shared}{note}")
        total_blocks += num_blocks
        total_bytes += num_bytes
        total_s += time_s / batch
    for req_id in prefill["finished"]:
        say(f"{req_id}: its first token is a stop token; finished on the prefill side, "
            "nothing to transfer")
    for req_id in decode["refused"]:
        say(f"{req_id}: refused by the decode side (it can never fit there)")
    for req_id in decode["recomputed"]:
        say(f"{req_id}: transfer failed; recomputed on the decode side")
    rate = f", {total_bytes / total_s / 2**20:.1f} MiB/s" if total_s > 0 else ""
    say(f"total: transferred {_blocks(total_blocks)} ({total_bytes} bytes) in "
        f"{total_s * 1e3:.2f} ms{rate}; {decode['num_waits']} offers waited for free blocks")


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"
