"""``blocktable demo --disaggregate``: prefill in one process, decode in another.

Two ranks are spawned (gloo on the CPU; NCCL with ``--device cuda``, one GPU each). Rank 0
prefills every request of the demo's workload and samples its first token; rank 1 admits it
into its own allocator (prefix hits included), receives only the blocks it lacks and decodes.
The parent prints each request's transfer, then checks every request's tokens against the
single-process engine and ``transformers.generate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from blocktable.demo import DemoOptions

JOB_TIMEOUT_S = 600.0  # a dead rank ends the job at once; this only bounds a stuck one


def run_disaggregated_demo(opts: DemoOptions, console: Console) -> int:
    """Run it; return the exit code (0: every request matches, 1: a mismatch or a request
    that was refused, 3: a process failed, died or stalled)."""
    import transformers
    from rich.markup import escape

    from blocktable.context_parallel.launch import RankFailedError, run_ranks
    from blocktable.engine import EngineConfig, LLMEngine, make_workload, run_workload, tiny_llama
    from blocktable.engine.verify import reference_generate
    from blocktable.transfer.session import Session, run_side

    transformers.logging.set_verbosity_error()
    say = (lambda *a: None) if opts.quiet else (lambda s: console.print(s, soft_wrap=True))
    model = tiny_llama(seed=opts.seed, device=opts.device)  # the references run there too
    workload = make_workload(opts.num_requests, seed=opts.seed, block_size=opts.block_size,
                             vocab_size=model.config.vocab_size,
                             max_new_tokens=max(2, opts.max_new_tokens))
    max_model_len = max(len(w.prompt_token_ids) for w in workload) + opts.max_new_tokens
    config = EngineConfig(block_size=opts.block_size, num_blocks=opts.num_blocks,
                          max_num_reqs=opts.num_requests, token_budget=opts.token_budget,
                          max_model_len=max_model_len)
    session = Session(prefill=config, decode=config, workload=tuple(workload),
                      model_seed=opts.seed, device=opts.device)
    backend = "nccl" if opts.device == "cuda" else "gloo"
    say(f"[bold]blocktable demo --disaggregate[/]: {len(workload)} requests; prefill on rank 0, "
        f"decode on rank 1 ({backend} on {opts.device}); each side {opts.num_blocks} blocks of "
        f"{opts.block_size} tokens")
    try:
        _, decode = run_ranks(run_side, 2, args=(session,), device=opts.device,
                              timeout_s=JOB_TIMEOUT_S, pg_timeout_s=60.0)
    except (RankFailedError, TimeoutError) as err:
        console.print(f"[red]FAILED[/]: {escape(getattr(err, 'summary', str(err)))}",
                      soft_wrap=True)
        return 3
    print_transfers(decode, say)

    single = LLMEngine(model, config)
    run_workload(single, workload)
    single_tokens = {r.req_id: r.output_token_ids for r in single.requests.values()}
    num_ok = 0
    for w in workload:
        got = decode["tokens"].get(w.req_id)
        ref, _ = reference_generate(model, list(w.prompt_token_ids), w.max_new_tokens)
        ok = got == single_tokens[w.req_id] == ref
        num_ok += ok
        if not ok:
            console.print(f"[red]{w.req_id}[/]: disaggregated {got}, single engine "
                          f"{single_tokens[w.req_id]}, transformers {ref}")
    console.print(f"{'[green]OK[/]' if num_ok == len(workload) else '[red]FAILED[/]'}: "
                  f"{num_ok}/{len(workload)} requests decoded after a transfer match the "
                  "single engine and transformers.generate", soft_wrap=True)
    return 0 if num_ok == len(workload) else 1


def print_transfers(decode: dict[str, Any], say: Any) -> None:
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
    for req_id in decode["refused"]:
        say(f"{req_id}: refused by the decode side (it can never fit there)")
    for req_id in decode["recomputed"]:
        say(f"{req_id}: transfer failed; recomputed on the decode side")
    rate = f", {total_bytes / total_s / 2**20:.1f} MiB/s" if total_s > 0 else ""
    say(f"total: transferred {_blocks(total_blocks)} ({total_bytes} bytes) in "
        f"{total_s * 1e3:.2f} ms{rate}; {decode['num_waits']} offers waited for free blocks")


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"
