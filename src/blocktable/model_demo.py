"""``blocktable demo --model NAME``: real chat prompts through a real model on blocktable.

Several questions share one system prompt and arrive a step apart (the later ones find its
blocks in the prefix cache), a long prompt is prefilled in chunks, one request stops at its
own stop token (the first full stop), and a follow-up turn is added once the first answer is
done, reusing that conversation's KV blocks. Every greedy request is then checked token for
token (and logit for logit) against ``transformers``' ``generate`` on its prompt alone with the
same stop tokens and ``max_new_tokens``; the speed is put beside ``generate`` over the same
prompts in one padded batch, at the same thread count. With ``--dcp N`` the same requests run
on the context-parallel engine over N processes (:mod:`blocktable.dcp_demo`).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from blocktable.demo import DemoOptions
    from blocktable.engine import Request, Verification
    from blocktable.engine.sampling import SamplingParams
    from blocktable.hf_loader import LoadedModel

MAX_MODEL_LEN = 2048  # tokens per request (prompt + answer) in the demo's engine

SYSTEM_PROMPT = (
    "You are a helpful assistant running on blocktable, a paged key-value cache for language "
    "model inference. Answer every question correctly, in one short sentence, without "
    "repeating the question."
)
QUESTIONS = (
    "What is the capital of France?",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Name three primary colors.",
)
FOLLOW_UP = "And what is the capital of Italy?"
SENTENCE_QUESTION = "Describe the Moon in a few sentences."
LONG_PROMPT = (
    "Summarize this text in one sentence.\n\n"
    "A paged key-value cache stores the attention keys and values of every request in fixed-"
    "size blocks taken from one shared pool, the way an operating system stores a process's "
    "memory in pages. Each request owns a row of the block table, which lists the blocks that "
    "hold its tokens in order; the slot mapping turns a token's position into the block and "
    "offset where its key and value are written. Because blocks are allocated on demand, a "
    "request only holds memory for the tokens it has, and the pool can serve many more "
    "requests at once than a cache reserved for the longest possible sequence. Requests that "
    "start with the same system prompt can share its full blocks: a prefix cache finds them "
    "by hashing the tokens, so the shared part is computed once. When the pool runs short, the "
    "scheduler preempts the newest request, gives its blocks back and recomputes it later. "
    "Long prompts are prefilled in chunks so that one request never takes a whole step."
)


def default_num_threads() -> int:
    """Torch threads for the demo: half the cores this process may use, 1 to 8.

    A decode step multiplies a few tokens by small matrices; past a few threads their
    synchronization costs more than it saves, and a machine shared with other work stalls
    when every core is asked for.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


@dataclass(frozen=True)
class ChatRequest:
    """One request of the demo: its prompt, stop tokens, arrival step and what it shows."""

    req_id: str
    prompt_token_ids: list[int]
    stop_token_ids: frozenset[int]
    arrival_step: int
    shows: str  # what the request demonstrates, for the table


def own_seed(sampling: SamplingParams, index: int) -> SamplingParams:
    """``sampling`` for the ``index``-th request: seeds ``seed``, ``seed + 1``, ... (requests
    with one seed would draw the same random numbers)."""
    import dataclasses

    return dataclasses.replace(sampling, seed=sampling.seed + index)


def build_requests(tokenizer: Any, model_stops: frozenset[int],
                   prompts: tuple[str, ...]) -> list[ChatRequest]:
    """The demo's requests (the follow-up turn is added during the run)."""
    from blocktable.engine.chat import encode_chat

    def chat(question: str) -> list[int]:
        return encode_chat(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT},
                                       {"role": "user", "content": question}])

    if prompts:  # the user's own: one request each, a step apart
        return [ChatRequest(f"p{i}", chat(p), model_stops, i, "your prompt")
                for i, p in enumerate(prompts)]
    reqs = [ChatRequest(f"q{i}", chat(q), model_stops, i,
                        "computes the system prompt" if i == 0 else "system prompt hit")
            for i, q in enumerate(QUESTIONS)]
    period = tokenizer.convert_tokens_to_ids(".")
    if isinstance(period, int) and period != tokenizer.unk_token_id:
        reqs.append(ChatRequest("stop", chat(SENTENCE_QUESTION), model_stops | {period},
                                len(reqs), "own stop token '.'"))
    reqs.append(ChatRequest("long", chat(LONG_PROMPT), model_stops, 2, "chunked prefill"))
    return reqs


class RequestRefused(ValueError):
    """The engine refused a request of the run (it cannot fit the pool); raised between two
    steps, so the engine is left consistent."""


def _add(engine: Any, req_id: str, prompt_token_ids: list[int], max_new_tokens: int,
         stops: frozenset[int], sampling: SamplingParams) -> None:
    try:
        engine.add_request(req_id, prompt_token_ids, max_new_tokens, stop_token_ids=stops,
                           sampling=sampling)
    except ValueError as exc:
        raise RequestRefused(str(exc)) from exc


@dataclass(frozen=True)
class ChatPlan:
    """What a run asks of the engine: its requests, their stop tokens, sampling and sizes."""

    requests: list[ChatRequest]
    stops: frozenset[int]  # the model's end-of-turn / EOS tokens
    sampling: SamplingParams
    max_new_tokens: int
    max_model_len: int

    @property
    def follows_up(self) -> bool:
        """Whether q0's next turn is added once q0 is done (the built-in questions only)."""
        return any(r.req_id == "q0" for r in self.requests)

    @property
    def num_requests(self) -> int:
        """Requests over the whole run, the follow-up turn included."""
        return len(self.requests) + self.follows_up


@dataclass
class ChatReport:
    """What a run produced, for the tables and the verdict (pickles: it crosses from the
    driver rank of a ``--dcp`` run to the parent)."""

    header: str  # the model, its sizes and the engine's
    requests: list[Request]
    answers: dict[str, str]  # req_id -> the answer as text (stop tokens left out)
    first_hits: dict[str, int]  # req_id -> prompt tokens served by the prefix cache
    shows: dict[str, str]  # req_id -> what the request demonstrates
    snapshots: list[Any]  # picture.TableSnapshot of every step
    num_steps: int
    num_hit_tokens: int
    num_lookup_tokens: int
    engine_time_s: float
    hf_num_tokens: int  # generated by transformers.generate over the same prompts
    hf_time_s: float
    checks: list[Verification]


def plan_chat(opts: DemoOptions, model: Any, tokenizer: Any, label: str) -> ChatPlan | str:
    """The demo's requests for ``model``; a one-line error when they cannot run (no chat
    template, a prompt longer than ``max_model_len``)."""
    from blocktable.engine.chat import model_stop_token_ids
    from blocktable.engine.sampling import SamplingParams

    stops = model_stop_token_ids(model, tokenizer)
    try:
        requests = build_requests(tokenizer, stops, opts.prompts)
    except ValueError as exc:  # no chat template
        return f"{label}: {exc}"
    max_model_len = min(MAX_MODEL_LEN, int(model.config.max_position_embeddings))
    for r in requests:
        need = len(r.prompt_token_ids) + opts.max_new_tokens - 1
        if need > max_model_len:
            return (f"request {r.req_id}'s prompt has {len(r.prompt_token_ids)} tokens; with "
                    f"--max-new-tokens {opts.max_new_tokens} it needs {need} > max_model_len "
                    f"{max_model_len}")
    sampling = SamplingParams(opts.temperature, opts.top_k, opts.top_p, opts.seed)
    return ChatPlan(requests, stops, sampling, opts.max_new_tokens, max_model_len)


def run_chat(engine: Any, model: Any, tokenizer: Any, plan: ChatPlan, header: str,
             say: Any = lambda *a: None, *, snapshot_block_size: int | None = None
             ) -> ChatReport:
    """Run ``plan`` on ``engine`` (an :class:`~blocktable.engine.LLMEngine`, or a
    :class:`~blocktable.engine.distributed.DistributedEngine` on its driver rank), then time
    ``transformers.generate`` on the same prompts and verify every greedy request.

    ``snapshot_block_size``: the tokens one allocator block stands for in the pictures
    (default the engine's block size; a ``--dcp`` run's allocator blocks span every rank).

    Raises
    ------
    RequestRefused
        The engine refused a request (too long for its pool).
    """
    import dataclasses

    from blocktable.engine.chat import follow_up
    from blocktable.engine.verify import timed_generate_batched, verify_requests
    from blocktable.picture import take_snapshot

    stops, sampling, max_new = plan.stops, plan.sampling, plan.max_new_tokens
    snapshots = []
    first_hits: dict[str, int] = {}
    shows = {r.req_id: r.shows for r in plan.requests}
    followed = not plan.follows_up

    def hook(eng: Any, batch: Any) -> None:
        for s in batch.scheduled:
            first_hits.setdefault(s.request.req_id, s.request.num_cached_tokens)
        shot = take_snapshot(eng, batch)
        if snapshot_block_size is not None:
            shot = dataclasses.replace(shot, block_size=snapshot_block_size)
        snapshots.append(shot)

    pending = sorted(plan.requests, key=lambda r: r.arrival_step)
    say(f"generating: {len(plan.requests)} requests arriving a step apart"
        f"{'' if followed else ', then a follow-up turn of q0'} ...")
    t_start = time.perf_counter()
    while pending or engine.has_unfinished() or not followed:
        while pending and pending[0].arrival_step <= engine.step_index:
            r = pending.pop(0)
            _add(engine, r.req_id, r.prompt_token_ids, max_new, r.stop_token_ids,
                 own_seed(sampling, len(engine.requests)))
        first = engine.requests.get("q0")
        if not followed and first is not None and first.is_finished:
            ids, reused = follow_up(
                tokenizer, [{"role": "system", "content": SYSTEM_PROMPT},
                            {"role": "user", "content": QUESTIONS[0]}],
                first.output_token_ids, FOLLOW_UP, stops)
            _add(engine, "turn2", ids, max_new, stops, own_seed(sampling, len(engine.requests)))
            shows["turn2"] = ("q0's next turn: reuses its KV" if reused else
                              "q0's next turn (answer re-tokenized)")
            followed = True
        engine.step(hook)
    t_engine = time.perf_counter() - t_start
    reqs = list(engine.requests.values())

    say("timing transformers.generate on the same prompts (one padded batch) ...")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)
    hf_tokens, t_hf = timed_generate_batched(model, [r.prompt_token_ids for r in reqs],
                                             max_new, stops, pad_token_id=pad)
    checks: list[Verification] = []
    if sampling.greedy:
        say("verifying every request against transformers.generate (one prompt at a time) ...")
        checks = verify_requests(model, reqs)
    answers = {r.req_id: tokenizer.decode([x for x in r.output_token_ids if x not in stops],
                                          skip_special_tokens=True).strip() for r in reqs}
    scheduler = engine.scheduler
    return ChatReport(
        header, reqs, answers, first_hits, shows, snapshots, engine.step_index,
        scheduler.num_hit_tokens, scheduler.num_lookup_tokens, t_engine,
        sum(len(t) for t in hf_tokens), t_hf, checks)


def describe_model(label: str, model: Any, load_time_s: float, where: str) -> str:
    """One line: the model's name, class, sizes and dtype, and its load time."""
    cfg = model.config
    return (f"{label} ({type(model).__name__}, {cfg.num_hidden_layers} layers, "
            f"{cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV heads, "
            f"{model.dtype}) loaded in {load_time_s:.1f} s {where}")


def run_model_demo(opts: DemoOptions, console: Console,
                   loaded: LoadedModel | None = None) -> int:
    """Run the real-model demo; return the exit code (0 all match, 1 a mismatch, 2 bad input
    or a model that cannot be fetched or loaded). ``loaded``: a model already loaded (then
    ``opts.model`` is only its name). One process: ``demo --model M --dcp N`` runs
    :func:`blocktable.dcp_demo.run_dcp_demo` instead (each process loads the model)."""
    import torch

    from blocktable.engine import EngineConfig, LLMEngine
    from blocktable.hf_loader import ModelLoadError, load_model, resolve_model

    if opts.dcp != 1:
        raise ValueError(f"run_model_demo runs one process (dcp=1), got dcp={opts.dcp}")
    say = (lambda *a: None) if opts.quiet else console.print
    threads = opts.threads or default_num_threads()
    torch.set_num_threads(threads)
    assert opts.model is not None
    t0 = time.perf_counter()
    if loaded is None:
        try:
            source = resolve_model(opts.model, opts.model_cache, say=lambda s: say(s))
            say(f"loading {source.label} ...")
            t0 = time.perf_counter()
            loaded = load_model(source, device=opts.device)
        except ModelLoadError as exc:
            print(f"blocktable demo: error: {exc}", file=sys.stderr)
            return 2
    t_load = time.perf_counter() - t0
    model, tokenizer, label = loaded.model, loaded.tokenizer, loaded.label
    plan = plan_chat(opts, model, tokenizer, label)
    if isinstance(plan, str):
        print(f"blocktable demo: error: {plan}", file=sys.stderr)
        return 2
    engine = LLMEngine(model, EngineConfig(
        block_size=opts.block_size, num_blocks=opts.num_blocks,
        max_num_reqs=plan.num_requests, token_budget=opts.token_budget,
        max_model_len=plan.max_model_len, record_logits=plan.sampling.greedy,
    ))
    header = (f"[bold]blocktable demo[/]: "
              f"{describe_model(label, model, t_load, f'on {opts.device}')}, {threads} torch "
              f"thread{'s' if threads > 1 else ''}; {opts.num_blocks} blocks of "
              f"{opts.block_size} tokens, {opts.token_budget} tokens/step; "
              f"{'greedy' if plan.sampling.greedy else f'sampling {plan.sampling}'}")
    say(header)
    try:
        report = run_chat(engine, model, tokenizer, plan, header, say)
    except RequestRefused as exc:  # a request that cannot fit the pool
        print(f"blocktable demo: error: {exc}", file=sys.stderr)
        return 2
    engine.manager.check_integrity()
    engine.table.check_integrity()
    return print_report(console, report, opts, plan.sampling.greedy)


def print_report(console: Console, report: ChatReport, opts: DemoOptions, greedy: bool, *,
                 extra_rows: tuple[tuple[str, str], ...] = (), extra_tables: tuple[Any, ...] = ()
                 ) -> int:
    """Draw the busiest step, print the answers, the counters (and ``extra_rows``), then
    ``extra_tables`` and the verdict; return the exit code (0 every request matches or was
    sampled, 1 a mismatch)."""
    from blocktable.picture import draw_snapshot, pick_step

    picture = draw_snapshot(pick_step(report.snapshots), opts.out)
    if not opts.quiet:
        reqs = report.requests
        num_generated = sum(len(r.output_token_ids) for r in reqs)
        console.print(_answers_table(report))
        rows = [
            ("prefix cache", (f"{report.num_hit_tokens} of {report.num_lookup_tokens} "
                              "admitted prompt tokens were hits")),
            ("steps", (f"{report.num_steps} ({sum(r.num_prefill_chunks for r in reqs)} "
                       "prefill chunks)")),
            ("engine", (f"{num_generated} tokens in {report.engine_time_s:.2f} s = "
                        f"{num_generated / report.engine_time_s:.1f} tok/s (arrivals "
                        "staggered)")),
            ("transformers.generate",
             (f"{report.hf_num_tokens} tokens in {report.hf_time_s:.2f} s = "
              f"{report.hf_num_tokens / report.hf_time_s:.1f} tok/s (one batch, all prompts "
              "at once)")),
            *extra_rows,
        ]
        for k, v in rows:
            console.print(f"[bold]{k}[/]: {v}")
        for table in extra_tables:
            console.print(table)
    return _verdict(console, report.checks, greedy, picture)


def _answers_table(report: ChatReport) -> Any:
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    ok = {c.req_id: c for c in report.checks}
    t = Table(title="requests (hits: prompt tokens served by the prefix cache; end: stop "
                    "token or length)", title_justify="left")
    for header in ("req", "prompt", "hits", "new", "end", "ok", "shows"):
        t.add_column(header, no_wrap=header != "shows",
                     justify="right" if header in ("prompt", "hits", "new") else "left")
    answers = []
    for r in report.requests:
        c = ok.get(r.req_id)
        verdict = "-" if c is None else ("[green]yes[/]" if c.ok else "[red]NO[/]")
        t.add_row(r.req_id, str(len(r.prompt_token_ids)),
                  str(report.first_hits.get(r.req_id, 0)), str(len(r.output_token_ids)),
                  r.finish_reason or "", verdict, report.shows.get(r.req_id, ""))
        answers.append(f"[bold]{r.req_id}[/]: {escape(report.answers[r.req_id])}")
    return Group(t, "[bold]answers[/]", *answers)


def _verdict(console: Console, checks: list[Verification], greedy: bool, picture: Any) -> int:
    if not greedy:
        console.print(f"[yellow]sampled[/]: no token check (transformers' sampling draws "
                      f"differently); picture -> {picture}")
        return 0
    num_ok = sum(c.ok for c in checks)
    if num_ok != len(checks):
        for c in checks:
            if not c.ok:
                console.print(f"[red]MISMATCH[/] {c.req_id}: tokens equal: {c.tokens_match}, "
                              f"max |Δlogits| {c.max_logits_diff:.2e} (bound "
                              f"{c.logits_bound:.2e})")
    max_diff = max((c.max_logits_diff for c in checks), default=0.0)
    console.print(
        f"{'[green]OK[/]' if num_ok == len(checks) else '[red]FAILED[/]'}: {num_ok}/"
        f"{len(checks)} requests match transformers.generate token for token (greedy, same "
        f"stop tokens; max |Δlogits| {max_diff:.1e}); picture -> {picture}")
    return 0 if num_ok == len(checks) else 1
