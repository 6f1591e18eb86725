"""``blocktable demo``: run the engine on a synthetic workload, verify it, summarize, draw.

Every request's greedy tokens and logits are checked against transformers' ``generate`` on
that prompt alone; the run exits 1 if any differs. This module imports nothing heavy at the
top (the command line reads :class:`DemoOptions` before deciding to run anything); rich,
numpy, torch and matplotlib are imported when the demo runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from blocktable.engine import LLMEngine, StepResult, Verification

# The demo's model (blocktable.engine.model.tiny_llama's defaults; a test keeps them in step):
# 2 layers x (K and V) x 2 KV heads x head dim 16 x 4 bytes (float32) per token.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
MODEL_MAX_POSITIONS = 512


class DemoUsageError(ValueError):
    """An option that only the run could check (``--picture-step`` past the last step)."""


@dataclass(frozen=True)
class DemoOptions:
    """The demo's knobs (see ``blocktable demo --help``)."""

    num_requests: int = 8
    seed: int = 0
    block_size: int = 4
    num_blocks: int = 20
    max_new_tokens: int = 12
    token_budget: int = 16
    device: str = "cpu"
    out: Path = Path("blocktable_demo.png")
    picture_step: int | None = None
    quiet: bool = False
    dcp: int = 1  # decode context parallelism: processes sharding every request's KV
    cp_interleave: int = 1  # tokens in a row on one rank before the next rank's run
    merge_transport: str = "auto"  # with dcp > 1: "auto", "collectives" or "p2p"
    # a real model (blocktable.model_demo) instead of the tiny random one
    model: str | None = None  # a known name, a .gguf file or model folder, or a hub id
    model_cache: Path | None = None  # where known models are fetched (None: the default)
    prompts: tuple[str, ...] = ()  # the user's prompts instead of the built-in questions
    temperature: float = 0.0  # 0: greedy (and verified); else seeded sampling
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    threads: int = 0  # torch threads with --model (0: half the usable cores, 1..8)
    disaggregate: bool = False  # prefill and decode in two processes, KV blocks moved between
    offload: bool = False  # the host-tier workload (blocktable.offload_demo)


MODEL_DEFAULTS = {"block_size": 16, "num_blocks": 64, "token_budget": 64, "max_new_tokens": 48}
"""The demo's sizes with ``--model`` (real prompts are tens to hundreds of tokens)."""


def longest_request_blocks(opts: DemoOptions) -> int:
    """Blocks the workload's longest request needs at its end (one request alone must fit)."""
    from blocktable.engine.workload import make_workload

    workload = make_workload(opts.num_requests, seed=opts.seed, block_size=opts.block_size,
                             max_new_tokens=opts.max_new_tokens)
    longest = max(len(w.prompt_token_ids) for w in workload) + opts.max_new_tokens - 1
    return math.ceil(longest / (opts.block_size * opts.dcp))  # an allocator block: all ranks


def run_demo(opts: DemoOptions, console: Console | None = None) -> int:
    """Run the demo; return the exit code (0: every request verified, 1: a mismatch, 2: a
    dependency of the demo is missing).

    Raises
    ------
    DemoUsageError
        ``opts.picture_step`` is past the run's last step (checked when the engine finishes,
        before verification and drawing).
    """
    try:
        import matplotlib  # noqa: F401 - checked here, used by the picture
        import transformers
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
    except ImportError as exc:
        print(f"blocktable demo needs {exc.name}: pip install 'blocktable[demo]'")
        return 2
    console = console or Console()
    if opts.disaggregate:  # the tiny model or a real one, each process loading its own
        from blocktable.transfer.transfer_demo import run_disaggregated_demo

        return run_disaggregated_demo(opts, console)
    if opts.model is not None and opts.dcp > 1:  # each process loads the model
        from blocktable.dcp_demo import run_dcp_demo

        return run_dcp_demo(opts, console)
    if opts.model is not None:
        from blocktable.model_demo import run_model_demo

        return run_model_demo(opts, console)
    if opts.dcp > 1:
        from blocktable.dcp_demo import run_dcp_demo

        return run_dcp_demo(opts, console)
    if opts.offload:
        from blocktable.offload_demo import run_offload_demo

        return run_offload_demo(opts, console)

    from blocktable.engine import EngineConfig, LLMEngine, make_workload, run_workload, tiny_llama
    from blocktable.engine.verify import LOGITS_RTOL, verify_requests
    from blocktable.picture import draw_snapshot, pick_step, take_snapshot

    say = (lambda *a: None) if opts.quiet else console.print
    transformers.logging.set_verbosity_error()
    model = tiny_llama(seed=opts.seed, device=opts.device)
    workload = make_workload(opts.num_requests, seed=opts.seed, block_size=opts.block_size,
                             vocab_size=model.config.vocab_size,
                             max_new_tokens=opts.max_new_tokens)
    max_model_len = max(len(w.prompt_token_ids) for w in workload) + opts.max_new_tokens
    engine = LLMEngine(model, EngineConfig(
        block_size=opts.block_size, num_blocks=opts.num_blocks, max_num_reqs=opts.num_requests,
        token_budget=opts.token_budget, max_model_len=max_model_len,
    ))
    say(f"[bold]blocktable demo[/]: {_plural(opts.num_requests, 'request')} on a tiny Llama "
        f"({model.config.num_hidden_layers} layers, {model.config.num_attention_heads} heads, "
        f"{model.config.num_key_value_heads} KV heads) on {opts.device}; "
        f"{opts.num_blocks} blocks of {opts.block_size} tokens, {opts.token_budget} tokens/step")

    snapshots = []
    first_hits: dict[str, int] = {}  # request -> prompt tokens the prefix cache served first
    peak_blocks_used = 0
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, disable=opts.quiet, transient=False)

    def hook(eng: LLMEngine, batch: object) -> None:
        for s in batch.scheduled:  # type: ignore[attr-defined]
            # A request's first scheduling is its first admission: the count is that hit.
            first_hits.setdefault(s.request.req_id, s.request.num_cached_tokens)
        snapshots.append(take_snapshot(eng, batch))  # type: ignore[arg-type]

    t_start = time.perf_counter()
    with progress:
        task = progress.add_task("generating", total=opts.num_requests)

        def on_step(result: StepResult) -> None:
            nonlocal peak_blocks_used
            peak_blocks_used = max(peak_blocks_used, result.num_blocks_used)
            note = f" [red]preempted {', '.join(result.preempted)}[/]" if result.preempted else ""
            progress.update(task, advance=len(result.finished),
                            description=f"step {result.step:3d}: "
                                        f"{_plural(result.num_reqs, 'request')}, "
                                        f"{result.num_tokens:3d} tokens{note}")

        results = run_workload(engine, workload, on_step=on_step, hook=hook)
        t_engine = time.perf_counter() - t_start
        if opts.picture_step is not None and opts.picture_step >= len(results):
            raise DemoUsageError(
                f"--picture-step {opts.picture_step} is past the last step: this run took "
                f"{len(results)} steps (0..{len(results) - 1})"
            )
        vtask = progress.add_task("verifying against transformers.generate",
                                  total=opts.num_requests)
        checks: list[Verification] = []
        for req in engine.requests.values():
            checks += verify_requests(model, [req])
            progress.advance(vtask)
    t_verify = time.perf_counter() - t_start - t_engine

    engine.manager.check_integrity()
    engine.table.check_integrity()
    by_step = {s.step: s for s in snapshots}
    if opts.picture_step is None:
        snap = pick_step(snapshots)
    elif opts.picture_step in by_step:
        snap = by_step[opts.picture_step]
    else:  # a step without a batch (nothing scheduled): draw the nearest one that had one
        snap = min(snapshots, key=lambda s: abs(s.step - opts.picture_step))  # type: ignore[operator]
        say(f"[yellow]--picture-step {opts.picture_step}: nothing ran in that step; drawing "
            f"step {snap.step}[/]")
    picture = draw_snapshot(snap, opts.out)

    num_ok = sum(c.ok for c in checks)
    if not opts.quiet:
        for part in request_table(engine, checks, first_hits):
            console.print(part)
        console.print(_summary_table(engine, results, checks, peak_blocks_used, t_engine,
                                     t_verify, LOGITS_RTOL))
    console.print(
        f"{'[green]OK[/]' if num_ok == len(checks) else '[red]FAILED[/]'}: {num_ok}/"
        f"{_plural(len(checks), 'request')} {'matches' if len(checks) == 1 else 'match'} "
        "transformers.generate; picture of step "
        f"{snap.step} -> {picture}"
    )
    return 0 if num_ok == len(checks) else 1


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# column header, its meaning (printed under the table)
REQUEST_COLUMNS = (
    ("req", "request id"),
    ("prompt", "prompt tokens"),
    ("new", "generated tokens"),
    ("arrived", "step it arrived"),
    ("ran", "step it first ran"),
    ("done", "step it finished"),
    ("hits", "prompt tokens served by the prefix cache at its first admission"),
    ("chunks", ("steps that computed part of its tokens without reaching their end "
                "(chunked prefill, or the recompute after a preemption)")),
    ("preempt", "times it lost its blocks and was recomputed"),
    ("ok", "tokens and logits match transformers.generate"),
)


def request_table(engine: LLMEngine, checks: list[Verification],
                  first_hits: dict[str, int]) -> list[object]:
    """The per-request table and the legend lines under it (rich renderables)."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title="requests", title_justify="left")
    for header, _ in REQUEST_COLUMNS:
        # whole headers at 80 columns: short names, never wrapped or cut
        t.add_column(header, justify="right", no_wrap=True, min_width=max(3, len(header)))
    ok = {c.req_id: c for c in checks}
    for req in engine.requests.values():
        c = ok[req.req_id]
        numbers = (len(req.prompt_token_ids), len(req.output_token_ids), req.arrival_step,
                   req.first_step, req.finish_step, first_hits.get(req.req_id, 0),
                   req.num_prefill_chunks, req.num_preemptions)
        t.add_row(req.req_id, *map(str, numbers), "[green]yes[/]" if c.ok else "[red]NO[/]")
    legend = Text("\n".join(f"{h}: {m}" for h, m in REQUEST_COLUMNS), style="dim")
    return [t, legend]


def _summary_table(engine: LLMEngine, results: list[StepResult], checks: list[Verification],
                   peak_blocks_used: int,
                   t_engine: float, t_verify: float, logits_rtol: float) -> Table:
    import numpy as np
    from rich.table import Table

    manager, config, scheduler = engine.manager, engine.config, engine.scheduler
    requests = list(engine.requests.values())
    busy = [r.table_time_s * 1e6 for r in results if r.num_reqs]
    busy = busy[1:] or busy  # the first step pays one-time set-up costs
    max_diff = max((c.max_logits_diff for c in checks), default=0.0)
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    num_generated = sum(len(r.output_token_ids) for r in requests)
    num_chunks = sum(r.num_prefill_chunks for r in requests)
    num_ok = sum(c.ok for c in checks)
    hits = f"{scheduler.num_hit_tokens}/{scheduler.num_lookup_tokens}"
    table_time = (f"mean {np.mean(busy):.1f} µs, p50 {np.median(busy):.1f} µs "
                  "(host: the step's update, its pinned writes and the replay that commits "
                  "and maps slots, or numpy on the CPU; first step left out)"
                  if getattr(engine, "captured_step", None) is not None else
                  f"mean {np.mean(busy):.1f} µs, p50 {np.median(busy):.1f} µs "
                  "(host: apply + commit + slot mapping; first step left out)")
    verdict = (f"{num_ok}/{len(checks)} match; max |Δlogits| {max_diff:.2e} "
               f"(bound {logits_rtol:g} x max(1, |logits|))")
    rows = [
        ("requests", f"{len(requests)} ({sum(r.is_finished for r in requests)} finished)"),
        ("tokens", f"{num_prompt} prompt, {num_generated} generated"),
        ("steps", f"{len(results)} ({sum(r.num_tokens for r in results)} tokens computed)"),
        ("KV pool", f"{config.num_blocks} blocks x {config.block_size} tokens (block 0 null)"),
        ("blocks used (peak)", f"{peak_blocks_used} of {config.num_blocks - 1}"),
        ("blocks at the end",
         f"{manager.num_free_blocks()} free, {manager.num_cached_blocks()} of them cached"),
        ("prefix cache", (f"{scheduler.prefix_hit_rate:.1%} of admitted tokens hit ({hits}; "
                          "re-admissions after a preemption count again)")),
        ("preemptions", str(manager.num_preemptions)),
        ("prefill chunks", f"{num_chunks} (token budget {config.token_budget}/step)"),
        ("block-table time / step", table_time),
        ("verification", verdict),
        ("wall time", f"engine {t_engine:.1f} s, reference {t_verify:.1f} s"),
    ]
    t = Table(title="summary", title_justify="left", show_header=False)
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    for k, v in rows:
        t.add_row(k, v)
    return t
