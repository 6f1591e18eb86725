"""``blocktable demo --dcp N``: the demo's engine with every request's KV sharded over N processes.

N ranks are spawned (gloo on the CPU; NCCL with ``--device cuda``, one GPU per rank). Rank 0
schedules and broadcasts each step's plan; every rank writes only the KV it owns, attends its
shard and merges every layer's attention. The parent then checks every request's tokens and
logits against ``transformers.generate`` and its tokens against the single-process engine, and
prints the demo's tables plus each rank's KV usage.

With ``--model``, every rank loads the real model itself (a model does not cross a process
start) and rank 0 runs the real-model demo's chat requests (:mod:`blocktable.model_demo`) on
the distributed engine, then checks each answer against ``transformers.generate`` there and
sends its report to the parent, which prints it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from blocktable.demo import DemoOptions
    from blocktable.engine import EngineConfig, Request, Verification
    from blocktable.engine.dcp_runner import DCPResult
    from blocktable.engine.distributed import DistributedEngine
    from blocktable.engine.model import HFLlama
    from blocktable.hf_loader import LoadedModel, ModelSource
    from blocktable.model_demo import ChatReport

JOB_TIMEOUT_S = 3600.0  # a dead rank ends the job at once; this only bounds a stuck one
MODEL_PG_TIMEOUT_S = 600.0
"""With ``--model``: how long a collective waits for a peer. The ranks load the model
(tens of seconds on a small machine) before their first collective, and rank 0 verifies
its answers before it stops the others."""


def run_dcp_demo(opts: DemoOptions, console: Console | None = None) -> int:
    """Run the demo on ``opts.dcp`` processes; return the exit code.

    0: every request matches ``transformers.generate`` and the single-process engine;
    1: a mismatch; 2: transformers (or Triton for ``--merge-transport p2p``) is missing or
    ``--device cuda`` has fewer than ``opts.dcp`` GPUs; 3: a rank failed, died or stalled
    (one line blames it, every rank's error follows); 130 / 143: SIGINT / SIGTERM (one line;
    every rank is ended first).
    """
    from blocktable.context_parallel.launch import Interrupted

    console = console or Console()
    try:
        return _run(opts, console) if opts.model is None else _run_model(opts, console)
    except Interrupted as err:
        console.print(f"blocktable demo --dcp {opts.dcp}: {err}", soft_wrap=True)
        return err.exit_code
    except KeyboardInterrupt:  # after the ranks ended: verification or drawing
        console.print(f"blocktable demo --dcp {opts.dcp}: interrupted by SIGINT", soft_wrap=True)
        return 130


def _run(opts: DemoOptions, console: Console) -> int:
    try:
        import transformers
    except ImportError:
        console.print("blocktable demo needs transformers: pip install 'blocktable[demo]'")
        return 2
    import torch

    from blocktable.context_parallel.launch import RankFailedError, run_ranks
    from blocktable.engine import EngineConfig, LLMEngine, make_workload, run_workload, tiny_llama
    from blocktable.engine.dcp_runner import DCPRun, run_dcp_rank
    from blocktable.engine.verify import LOGITS_RTOL, verify_requests
    from blocktable.picture import draw_snapshot, pick_step

    world = opts.dcp
    from blocktable._triton import HAS_TRITON

    if opts.merge_transport == "p2p" and not HAS_TRITON:
        console.print("--merge-transport p2p needs triton: pip install triton")
        return 2
    if opts.device == "cuda" and torch.cuda.device_count() < world:
        console.print(f"--dcp {world} needs {world} GPUs, {torch.cuda.device_count()} visible")
        return 2
    say = (lambda *a: None) if opts.quiet else console.print
    transformers.logging.set_verbosity_error()
    model = tiny_llama(seed=opts.seed, device=opts.device)
    allocator_block_size = opts.block_size * world
    workload = make_workload(opts.num_requests, seed=opts.seed, block_size=opts.block_size,
                             vocab_size=model.config.vocab_size,
                             max_new_tokens=opts.max_new_tokens)
    max_model_len = max(len(w.prompt_token_ids) for w in workload) + opts.max_new_tokens
    config = EngineConfig(
        block_size=opts.block_size, num_blocks=opts.num_blocks, max_num_reqs=opts.num_requests,
        token_budget=opts.token_budget, max_model_len=max_model_len,
    )
    run = DCPRun(config, tuple(workload), interleave=opts.cp_interleave, model_seed=opts.seed,
                 device=opts.device, take_snapshots=True, merge_transport=opts.merge_transport)
    backend = "nccl" if opts.device == "cuda" else "gloo"
    say(f"[bold]blocktable demo --dcp {world}[/]: {opts.num_requests} requests on a tiny Llama "
        f"({model.config.num_hidden_layers} layers, {model.config.num_attention_heads} heads, "
        f"{model.config.num_key_value_heads} KV heads), {world} processes ({backend} on "
        f"{opts.device}, merge transport {opts.merge_transport}), interleave "
        f"{opts.cp_interleave}; each rank: {opts.num_blocks} blocks "
        f"of {opts.block_size} tokens; the allocator: blocks of {opts.block_size} x {world} = "
        f"{allocator_block_size} tokens; {opts.token_budget} tokens/step")
    t_start = time.perf_counter()
    try:
        results = run_ranks(run_dcp_rank, world, args=([run],), device=opts.device,
                            timeout_s=JOB_TIMEOUT_S)
    except RankFailedError as err:
        console.print(f"[red]FAILED[/]: {escape(err.summary)}", soft_wrap=True)
        console.print(escape("\n\n".join(str(err).split("\n\n")[1:])), highlight=False,
                      soft_wrap=True)
        return 3
    except TimeoutError as err:
        console.print(f"[red]FAILED[/]: {escape(str(err))}")
        return 3
    t_engine = time.perf_counter() - t_start
    per_rank = [r[0] for r in results]
    driver = per_rank[0]

    checks = verify_requests(model, driver.requests)
    single = LLMEngine(model, EngineConfig(
        block_size=allocator_block_size, num_blocks=opts.num_blocks,
        max_num_reqs=opts.num_requests, token_budget=opts.token_budget,
        max_model_len=max_model_len,
    ))
    run_workload(single, workload)
    single_tokens = {r.req_id: r.output_token_ids for r in single.requests.values()}
    same = {r.req_id: r.output_token_ids == single_tokens[r.req_id] for r in driver.requests}
    t_verify = time.perf_counter() - t_start - t_engine

    snap = pick_step(driver.snapshots)
    if opts.picture_step is not None:
        snap = {s.step: s for s in driver.snapshots}.get(opts.picture_step, snap)
    picture = draw_snapshot(snap, opts.out)
    num_ok = sum(c.ok and same[c.req_id] for c in checks)
    if not opts.quiet:
        console.print(_request_table(driver.requests, checks, same))
        console.print(_summary_table(opts, driver, checks, t_engine, t_verify, LOGITS_RTOL))
        console.print(_rank_table(per_rank, opts))
    console.print(
        f"{'[green]OK[/]' if num_ok == len(checks) else '[red]FAILED[/]'}: {num_ok}/{len(checks)} "
        f"requests match transformers.generate and the single-process engine (DCP {world}); "
        f"picture of step {snap.step} (rank 0's table) -> {picture}"
    )
    return 0 if num_ok == len(checks) else 1


def _request_table(
    requests: list[Request], checks: list[Verification], same: dict[str, bool]
) -> Table:
    t = Table(title="requests (arrived/ran/done: steps; hits: prefix-cached tokens)",
              title_justify="left")
    for col in ("request", "prompt", "new", "arrived", "ran", "done", "hits", "chunks",
                "preempts", "ok"):
        t.add_column(col, justify="right")
    ok = {c.req_id: c.ok and same[c.req_id] for c in checks}
    for req in requests:
        numbers = (len(req.prompt_token_ids), len(req.output_token_ids), req.arrival_step,
                   req.first_step, req.finish_step, req.num_cached_tokens,
                   req.num_prefill_chunks, req.num_preemptions)
        t.add_row(req.req_id, *map(str, numbers), "[green]yes[/]" if ok[req.req_id] else "[red]NO[/]")
    return t


def _summary_table(opts: DemoOptions, d: DCPResult, checks: list[Verification], t_engine: float,
                   t_verify: float, logits_rtol: float) -> Table:
    requests, steps = d.requests, d.steps
    busy = [s.table_time_s * 1e6 for s in steps if s.num_reqs]
    busy = busy[1:] or busy  # the first step pays one-time set-up costs
    max_diff = max((c.max_logits_diff for c in checks), default=0.0)
    num_ok = sum(c.ok for c in checks)
    peak_blocks = max((s.num_blocks_used for s in steps), default=0)
    hits = f"{d.num_hit_tokens}/{d.num_lookup_tokens}"
    hit_rate = d.num_hit_tokens / max(1, d.num_lookup_tokens)
    rows = [
        ("requests", f"{len(requests)} ({sum(r.is_finished for r in requests)} finished)"),
        ("tokens", (f"{sum(len(r.prompt_token_ids) for r in requests)} prompt, "
                   f"{sum(len(r.output_token_ids) for r in requests)} generated")),
        ("steps", f"{len(steps)} ({sum(s.num_tokens for s in steps)} tokens computed)"),
        ("KV pool", (f"{opts.num_blocks} blocks per rank (block 0 null), the same ids on every "
                    f"rank; block = {opts.block_size} tokens per rank, "
                    f"{opts.block_size * opts.dcp} tokens over all {opts.dcp} ranks")),
        ("blocks used (peak)", f"{peak_blocks} of {opts.num_blocks - 1}"),
        ("blocks at the end", f"{d.num_free_blocks} free, {d.num_cached_blocks} of them cached"),
        ("prefix cache", f"{hit_rate:.1%} of admitted tokens hit ({hits})"),
        ("preemptions", str(d.num_preemptions)),
        ("attention merge", (f"{d.merge_transport} (--merge-transport {opts.merge_transport}), "
                            "pattern all_reduce, every layer of every step")),
        ("prefill chunks", (f"{sum(r.num_prefill_chunks for r in requests)} "
                           f"(token budget {opts.token_budget}/step)")),
        ("block-table time / step",
         (f"mean {np.mean(busy):.1f} µs, p50 {np.median(busy):.1f} µs (rank 0 host: apply + "
         "commit + slot mapping; first step left out)")),
        ("verification", (f"{num_ok}/{len(checks)} match generate; max |Δlogits| {max_diff:.2e} "
                         f"(bound {logits_rtol:g} x max(1, |logits|))")),
        ("wall time", (f"{opts.dcp} ranks {t_engine:.1f} s (process start included), "
                      f"reference {t_verify:.1f} s")),
    ]
    t = Table(title="summary", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows:
        t.add_row(k, v)
    return t


def _rank_table(per_rank: list[DCPResult], opts: DemoOptions) -> Table:
    t = Table(title=f"KV per rank (interleave {opts.cp_interleave}; measured on each rank)",
              title_justify="left")
    for col in ("rank", "KV tokens written", "share", "KV tokens read (peak step)",
                "queries with no key here", "KV cache"):
        t.add_column(col, justify="right")
    total = sum(r.stats.kv_tokens_written for r in per_rank) or 1
    for r in per_rank:
        s = r.stats
        t.add_row(str(s.rank), str(s.kv_tokens_written), f"{s.kv_tokens_written / total:.1%}",
                  str(s.peak_kv_tokens), str(s.num_empty_queries),
                  f"{s.kv_cache_bytes / 1024:.1f} KiB")
    return t


@functools.lru_cache(maxsize=1)
def _load_once(source: ModelSource, device: str) -> tuple[LoadedModel, float]:
    """The model and tokenizer of ``source`` in this process, and the load time (s): the
    builder and the driver of a rank share one load."""
    from blocktable.hf_loader import load_model

    t0 = time.perf_counter()
    # Every rank's progress bars on one terminal are a garble (the GGUF reader's tqdm writes
    # to sys.stderr whatever transformers' settings); a failure still raises.
    with contextlib.redirect_stderr(io.StringIO()):
        loaded = load_model(source, device=device)
    return loaded, time.perf_counter() - t0


@dataclass(frozen=True)
class LoadInRank:
    """A :class:`~blocktable.engine.dcp_runner.ModelBuilder`: each rank loads ``source``."""

    source: ModelSource

    def __call__(self, device: Any) -> HFLlama:
        return _load_once(self.source, str(device))[0].model


@dataclass(frozen=True)
class ChatDriver:
    """A :class:`~blocktable.engine.dcp_runner.Driver`: rank 0 runs the real-model demo's
    requests, times ``transformers.generate`` and verifies; returns its
    :class:`~blocktable.model_demo.ChatReport`, or a one-line error when the requests
    cannot run (no step was taken then)."""

    source: ModelSource
    opts: DemoOptions
    threads: int  # torch threads per rank

    def __call__(self, engine: DistributedEngine, model: HFLlama) -> ChatReport | str:
        from blocktable.model_demo import RequestRefused, describe_model, plan_chat, run_chat

        opts, world = self.opts, engine.cp.world_size
        loaded, load_time_s = _load_once(self.source, str(model.lm_head.weight.device))
        plan = plan_chat(opts, model, loaded.tokenizer, loaded.label)
        if isinstance(plan, str):
            return plan
        if plan.num_requests > engine.config.max_num_reqs:  # model_run_config counted less
            return (f"the run has {plan.num_requests} requests, the engine "
                    f"{engine.config.max_num_reqs} table rows")
        where = f"by each of {world} processes ({opts.device})"
        header = (
            f"[bold]blocktable demo --dcp {world}[/]: "
            f"{describe_model(loaded.label, model, load_time_s, where)}, {self.threads} torch "
            f"thread{'s' if self.threads > 1 else ''} each, merge transport "
            f"{engine.merge_transport}, interleave {opts.cp_interleave}; each rank: "
            f"{opts.num_blocks} blocks of {opts.block_size} tokens, the allocator's: "
            f"{engine.allocator_block_size} tokens; {opts.token_budget} tokens/step; "
            f"{'greedy' if plan.sampling.greedy else f'sampling {plan.sampling}'}")
        try:
            report = run_chat(engine, model, loaded.tokenizer, plan, header,
                              snapshot_block_size=engine.allocator_block_size)
        except RequestRefused as exc:  # between two steps: the others can be stopped
            return str(exc)
        for r in report.requests:  # verified here; a vocabulary per token need not travel
            r.logits.clear()
        return report


def model_run_config(opts: DemoOptions) -> EngineConfig:
    """The distributed engine's sizes for the real-model demo (per rank, see
    :class:`~blocktable.engine.dcp_runner.DCPRun`)."""
    from blocktable.engine import EngineConfig
    from blocktable.model_demo import MAX_MODEL_LEN, QUESTIONS

    # the built-in questions, one with its own stop token, a long prompt and a follow-up
    num_requests = len(opts.prompts) or len(QUESTIONS) + 3
    return EngineConfig(
        block_size=opts.block_size, num_blocks=opts.num_blocks, max_num_reqs=num_requests,
        token_budget=opts.token_budget, max_model_len=MAX_MODEL_LEN,
        record_logits=opts.temperature == 0,
    )


def _run_model(opts: DemoOptions, console: Console) -> int:
    from blocktable._triton import HAS_TRITON
    from blocktable.context_parallel.launch import RankFailedError, run_ranks
    from blocktable.engine.dcp_runner import DCPRun, run_dcp_rank
    from blocktable.hf_loader import ModelLoadError, resolve_model
    from blocktable.model_demo import default_num_threads, print_report

    assert opts.model is not None
    world = opts.dcp
    say = (lambda *a: None) if opts.quiet else console.print
    if opts.merge_transport == "p2p" and not HAS_TRITON:
        console.print("--merge-transport p2p needs triton: pip install triton")
        return 2
    try:  # fetched once here, not by every rank at once
        source = resolve_model(opts.model, opts.model_cache, say=lambda s: say(s))
    except ModelLoadError as exc:
        print(f"blocktable demo: error: {exc}", file=sys.stderr)
        return 2
    threads = opts.threads or max(1, default_num_threads() // world)
    run = DCPRun(model_run_config(opts), (), interleave=opts.cp_interleave, device=opts.device,
                 merge_transport=opts.merge_transport, build_model=LoadInRank(source),
                 drive=ChatDriver(source, opts, threads))
    say(f"loading {source.label} in each of {world} processes ...")
    try:
        results = run_ranks(run_dcp_rank, world, args=([run],), device=opts.device,
                            timeout_s=JOB_TIMEOUT_S, pg_timeout_s=MODEL_PG_TIMEOUT_S,
                            num_threads=threads)
    except RankFailedError as err:
        console.print(f"[red]FAILED[/]: {escape(err.summary)}", soft_wrap=True)
        console.print(escape("\n\n".join(str(err).split("\n\n")[1:])), highlight=False,
                      soft_wrap=True)
        return 3
    except TimeoutError as err:
        console.print(f"[red]FAILED[/]: {escape(str(err))}")
        return 3
    per_rank = [r[0] for r in results]
    report = per_rank[0].driven
    if isinstance(report, str):
        print(f"blocktable demo: error: {report}", file=sys.stderr)
        return 2
    say(report.header)
    code = print_report(console, report, opts, opts.temperature == 0, extra_rows=(
        ("attention merge", f"{per_rank[0].merge_transport}, every layer of every step"),
        ("preemptions", str(per_rank[0].num_preemptions)),
    ), extra_tables=(_rank_table(per_rank, opts),))
    return code


__all__ = ["run_dcp_demo"]
