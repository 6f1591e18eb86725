"""KV transfer between a prefill and a decode process, beside one contiguous tensor's send.

Two figures:

1. **Bandwidth.** Two spawned ranks (gloo on the CPU, NCCL with ``--device cuda``), ``--runs``
   times. Rank 0 holds a KV cache of ``--num-layers`` layers, rank 1 another; per repeat, rank 0
   gathers a prompt's blocks (shuffled ids, as an allocator hands them out) of every layer into
   its reusable staging buffer, piece by piece (``--piece-mib``; a huge piece is one gather and
   one send), sending each piece while gathering the next, as the prefill side does
   (:class:`blocktable.transfer.buffers.StagingBuffer`,
   :class:`blocktable.transfer.TorchDistributedTransport`); rank 1 receives piece by piece and
   scatters each into its own shuffled blocks. Alternated with it, the same bytes as one
   contiguous tensor, plain send/recv. Timed on rank 1 from a barrier to the end of its last
   scatter; the moved rows are compared across the ranks at the end (a mismatch exits 1).
2. **Host bookkeeping of one round of ``--num-requests`` requests** (in this process, thread
   time): both workers' own per-round methods, messages through the wire format, the KV left
   out. What the transfer adds is the round's time outside the engine's own calls made in it
   (allocator, row look-ups, ``Request`` objects), timed in the same round; for reference,
   also alternated with admitting the same requests into an engine without a transfer.
3. **A round's two messages through the transport** (in the bandwidth's two processes,
   thread time per side): an offer of ``--num-requests`` prompts of ``--prompt-tokens``
   tokens and its plan, sent and received with ``send_message`` / ``recv_message``: the host
   cost of the wire itself, which figure 2 leaves out.

    PYTHONPATH=src python benchmarks/bench_transfer.py                  # CPU, gloo
    PYTHONPATH=src python benchmarks/bench_transfer.py --device cuda    # NCCL, two GPUs

An 8,192-token prompt of Llama-8B-sized layers (8 KV heads, head dim 128, bfloat16, 128 KiB per
token over 32 layers): all 32 layers on CUDA (1 GiB), 8 of them by default on the CPU (256 MiB)
to fit a shared machine's memory and time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from run_info import run_info

from blocktable.context_parallel.launch import run_ranks
from blocktable.transfer.buffers import StagingBuffer, chunk_view
from blocktable.transfer.transport import TorchDistributedTransport


def _cache(args: argparse.Namespace, device: torch.device, num_blocks: int, seed: int
           ) -> torch.Tensor:
    # random bits, not randn: no float32 temporary twice the cache's size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (args.num_layers, 2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
    return bits.view(getattr(torch, args.dtype)).to(device) if args.dtype in (
        "bfloat16", "float16") else bits.to(device).to(getattr(torch, args.dtype))


def _row_sums(kv: torch.Tensor, rows: np.ndarray, block_size: int) -> torch.Tensor:
    """One checksum per moved row over every layer, K and V (compared across the ranks)."""
    view = chunk_view(kv, block_size)
    index = torch.from_numpy(rows).to(kv.device)
    return view.index_select(1, index).view(torch.int16).to(torch.float64).sum(dim=(0, 2))


def bandwidth_job(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    num_prompt_blocks = -(-args.num_tokens // args.block_size)
    num_blocks = num_prompt_blocks + 1
    kv = _cache(args, device, num_blocks, seed=rank)
    rng = np.random.default_rng(rank)
    rows = rng.permutation(np.arange(1, num_blocks))[:num_prompt_blocks]  # whole blocks
    transport = TorchDistributedTransport(1 - rank, "decode" if rank == 0 else "prefill",
                                          device, timeout_s=120.0)
    view = chunk_view(kv, args.block_size)
    flat = torch.zeros(view.shape[0], num_prompt_blocks, view.shape[2], dtype=kv.dtype,
                       device=device)  # the plain tensor (rank 0 sends it, rank 1 lands it)
    # the workers' own path: a staging buffer per side, reused, sent piece by piece
    kinds = {"plain": None, **{f"pieces of {mib:g} MiB": StagingBuffer(int(mib * 2**20))
                               for mib in args.piece_mib}}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(args.warmup + args.repeats):
        for kind, staging in kinds.items():
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            if staging is None and rank == 0:
                transport.send_tensor(flat)
            elif staging is None:
                transport.recv_tensor(flat)
            elif rank == 0:
                transport.send_tensors(staging.gather(kv, rows, args.block_size))
            else:
                staging.scatter(kv, rows, args.block_size, staging.rows_per_piece(view),
                                transport.recv_tensors)
            sync()
            if i >= args.warmup:
                times[kind].append(time.perf_counter() - t0)
    message_s = _message_round_times(transport, rank, args)
    # the moved rows arrived intact: rank 0's rows (its order) equal rank 1's (its order)
    sums = _row_sums(kv, rows, args.block_size)
    theirs = torch.empty_like(sums)
    if rank == 0:
        transport.send_tensor(sums)
        intact = True
    else:
        transport.recv_tensor(theirs)
        intact = bool(torch.equal(theirs, sums))
    return {"bytes": flat.numel() * flat.element_size(), "times_s": times, "intact": intact,
            "message_s": message_s}


def _message_round_times(transport: TorchDistributedTransport, rank: int,
                         args: argparse.Namespace) -> list[float]:
    """Thread time of each round's offer and plan on this side (rank 0 sends the offer and
    receives the plan, rank 1 the other way), over ``args.repeats`` rounds after a warm-up."""
    import torch.distributed as dist

    from blocktable.transfer.messages import OfferBatch, PlanBatch

    n, tokens = args.num_requests, args.prompt_tokens + 1
    rng = np.random.default_rng(0)
    offer = OfferBatch(tuple(f"req{i}" for i in range(n)),
                       rng.integers(0, 50_000, n * tokens), np.arange(n + 1) * tokens,
                       np.full(n, 4))
    plan = PlanBatch(np.zeros(n, np.int8), np.zeros(n, np.int64), {}, n)
    out = []
    for i in range(args.warmup + 3 * args.repeats):
        dist.barrier()
        t0 = time.thread_time()
        if rank == 0:
            transport.send_message(offer)
            got = transport.recv_message()
            ok = got.num_acked == n
        else:
            got = transport.recv_message()
            transport.send_message(plan)
            ok = got.req_ids == offer.req_ids
        elapsed = time.thread_time() - t0
        if not ok:
            raise AssertionError("a message came back different")
        if i >= args.warmup:
            out.append(elapsed)
    return out


def _prefilled(pw: Any, ids: list[str], prompts: list[np.ndarray], first: int) -> None:
    """Put requests on the prefill side as if their prompt had just run: admitted,
    allocated, in the table, first token sampled (no forward: only the host state matters)."""
    from blocktable.engine import RequestStatus

    engine = pw.engine
    for req_id, prompt in zip(ids, prompts):
        pw.submit(req_id, prompt, 4)
    manager = engine.manager
    hits = manager.add_requests(ids, prompts)
    manager.allocate_many(ids, [len(p) - h for p, h in zip(prompts, hits)])
    engine.table.apply(manager.take_step_update())
    engine.scheduler.waiting.clear()
    for req_id in ids:
        req = engine.requests[req_id]
        req.status, req.output_token_ids = RequestStatus.RUNNING, [first]
        engine.scheduler.running.append(req)


def _admission_only(pw: Any, dw: Any, ids: list[str], arrived: list[np.ndarray]) -> None:
    """What admitting the same requests costs an engine without a transfer: the decode side's
    allocator calls and Request objects (their prompt lists made from the token ids as they
    arrive, ``arrived``: int64 arrays, each prompt then its first token), the prefill side's
    row look-up (one batched call, as in the round) and its free."""
    from blocktable.engine import Request, RequestStatus

    manager, engine = dw.engine.manager, dw.engine
    pw.engine.manager.rows_of(ids)
    hits = manager.add_requests(ids, arrived)
    num_new = [len(t) - 1 - h for t, h in zip(arrived, hits)]
    manager.allocate_many(ids, num_new)
    manager.mark_computed_many(ids, num_new)
    for req_id, tokens, hit in zip(ids, arrived, hits):
        req = Request(req_id, tokens[:-1].tolist(), 4, engine.step_index,
                      status=RequestStatus.RUNNING, output_token_ids=[int(tokens[-1])],
                      num_cached_tokens=hit)
        engine.requests[req_id] = req
        engine.scheduler.running.append(req)
    pw.engine.manager.free_many(ids)


class _EngineClock:
    """Thread time spent inside the engine's own calls (allocator, row look-ups, ``Request``
    objects) during a transfer round: every one of them is a batched call, so the clock runs
    a few times per round. What a wrapped call costs outside its own reading (entering the
    wrapper, reading the clock) would count as the transfer's: :meth:`own_cost_s` measures it
    on a no-op, to be taken off per call."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def wrap(self, obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - t0
                self.calls += 1

        setattr(obj, name, timed)

    def own_cost_s(self, num_calls: int = 20_000) -> float:
        """Seconds a wrapped call adds outside its reading: over ``num_calls`` calls of a
        wrapped no-op, their whole time less what the clock read inside them and the loop's
        own time."""

        class NoOp:
            def call(self) -> None:
                return None

        probe, clock = NoOp(), _EngineClock()
        clock.wrap(probe, "call")
        call = probe.call
        t0 = time.thread_time()
        for _ in range(num_calls):
            pass
        t1 = time.thread_time()
        for _ in range(num_calls):
            call()
        whole = time.thread_time() - t1 - (t1 - t0)
        return max(0.0, (whole - clock.seconds) / num_calls)


def bookkeeping(args: argparse.Namespace) -> dict[str, Any]:
    """Host time of one round of ``args.num_requests`` offers on both sides (one thread, the
    workers' own methods, messages encoded and decoded as the torch.distributed transport
    does, each side encoding into its own reused buffer; the KV's gather, send and scatter are
    not in it, their host set-up (the rows' check and conversion, the pieces) included, nor is
    the receiver's landing of a message's bytes; the prefill side's row look-up counts as the
    engine's, though only a transfer needs it).

    What the transfer adds is measured two ways. Paired: the round's time minus the time spent
    inside the engine's own calls during that same round (:class:`_EngineClock`: allocator
    calls on both sides, the prefill side's row look-up, the decode side's ``Request``
    objects), and minus the clock's own cost for each call it timed (measured on a no-op, so
    what the paired figure keeps is the transfer's code only). Unpaired: the round's time minus admitting the same requests into an engine
    without a transfer (:func:`_admission_only`), run alternately; the difference of two
    independent ~2 ms figures, so its spread is wider than the target it is compared with."""
    from blocktable.engine import EngineConfig, LLMEngine, tiny_llama
    from blocktable.transfer import DecodeWorker, PrefillWorker, local_pair
    from blocktable.transfer.messages import OfferBatch, PlanBatch
    from blocktable.transfer.wire_format import MessageWriter, decode_message

    writers = {"prefill": MessageWriter(), "decode": MessageWriter()}  # one per transport

    def wire(obj: Any, sender: str) -> Any:
        """Both ends of send_message / recv_message (the sender's transport encodes into its
        own writer); the wire's own copy of the body and of the large arrays (the offer's
        token ids, their own send) into the receiver's memory is left out (it is the
        transport's data movement, timed with the transport's own cost in figure 3)."""
        return decode_message(*writers[sender].encode(obj))

    n, tokens, bs = args.num_requests, args.prompt_tokens, args.block_size
    num_blocks = n * -(-(tokens + 4) // bs) + 1
    model = tiny_llama()
    config = EngineConfig(block_size=bs, num_blocks=num_blocks, max_num_reqs=n,
                          max_model_len=tokens + 4, token_budget=n * tokens)
    pw = PrefillWorker(LLMEngine(model, config), local_pair()[0])
    dw = DecodeWorker(LLMEngine(model, config), local_pair()[1])
    pw.remote, dw.remote = dw.layout, pw.layout
    clock = _EngineClock()
    for manager in (pw.engine.manager, dw.engine.manager):
        for name in ("add_requests", "allocate_many", "mark_computed_many", "free_many",
                     "lookup_prefix", "can_admit", "add_request", "allocate", "rows_of"):
            clock.wrap(manager, name)
    clock.wrap(dw, "_add_running")
    per_call_s = statistics.median(clock.own_cost_s() for _ in range(5))
    rng = np.random.default_rng(0)
    rounds: list[float] = []
    engine_calls: list[float] = []
    admissions: list[float] = []
    checked = True
    for rep in range(args.bookkeeping_warmup + args.bookkeeping_repeats):
        for kind in ("round", "admission"):
            ids = [f"{kind}{rep}.{i}" for i in range(n)]
            prompts = [rng.integers(0, 256, tokens).tolist() for _ in range(n)]  # no hits
            _prefilled(pw, ids, prompts, first=7)
            arrived = [np.array(p + [7], dtype=np.int64) for p in prompts]
            clock.seconds, clock.calls = 0.0, 0
            t0 = time.thread_time()
            if kind == "admission":
                _admission_only(pw, dw, ids, arrived)
            else:
                pw._collect_prefilled()
                offers: OfferBatch = wire(pw._offer_batch(), "prefill")
                plans: PlanBatch = wire(dw._plan_batch(offers), "decode")
                pw._acknowledged(plans.num_acked)
                src_rows = pw._read_plans(plans)
                num_sent = len(pw._unacked)
                status = pw._data_status(True, 1)  # then the KV: bandwidth
                assert dw._plan is not None
                dw._start_decoding(dw._plan)
                pw._acknowledged(num_sent)  # as the next round's plan does
                dw._plan = None
            elapsed = time.thread_time() - t0
            if kind == "round":
                checked = checked and bool(status[0]) and n == num_sent and (
                    src_rows.size == n * -(-tokens // bs))  # every prompt token mapped
            else:
                for req_id in ids:  # (the prefill side's own bookkeeping, untimed here)
                    pw.engine.requests.pop(req_id)
                    pw.engine.scheduler.running.clear()
            checked = checked and dw.engine.manager.num_requests == n
            if rep >= args.bookkeeping_warmup:
                if kind == "round":
                    rounds.append(elapsed)
                    engine_calls.append(clock.seconds + clock.calls * per_call_s)
                else:
                    admissions.append(elapsed)
            dw.engine.manager.free_many(ids)
            for req_id in ids:
                del dw.engine.requests[req_id]
                pw.engine.requests.pop(req_id, None)
            dw.engine.scheduler.running.clear()
            pw.prompts.drop(ids)  # (submitted by the admission kind, never collected)
    for manager in (pw.engine.manager, dw.engine.manager):
        manager.check_integrity()
        checked = checked and manager.num_requests == 0
    return {
        "checked": checked,
        f"host time of one transfer round of {n} requests ({tokens}-token prompts), both "
        "sides": rounds,
        "of which the engine's own calls (allocator, row look-ups, Request objects) and the "
        "clock's own cost per call": engine_calls,
        "what the transfer adds (messages, mapping, plans), paired: the rest of the round": [
            r - e for r, e in zip(rounds, engine_calls)],
        "admitting the same requests without a transfer (allocator calls, Request objects)":
            admissions,
        "what the transfer adds, unpaired: round minus admission": [
            r - a for r, a in zip(rounds, admissions)],
        "the clock's own cost per wrapped call (median of 5 calibrations on a no-op)":
            [per_call_s],
    }


def _spread(xs: list[float], scale: float, fmt: str) -> str:
    return (f"{statistics.median(xs) * scale:{fmt}} [{min(xs) * scale:{fmt}}–"
            f"{max(xs) * scale:{fmt}}]")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--num-tokens", type=int, default=8192, help="prompt tokens moved")
    p.add_argument("--num-layers", type=int, default=None,
                   help="default 32 on cuda, 8 on cpu (Llama-8B's layers, fewer of them)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--piece-mib", type=float, nargs="+", default=[1e6, 16.0],
                   help="send-buffer piece sizes to measure (1e6: one piece)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per run")
    p.add_argument("--runs", type=int, default=3, help="process pairs spawned one after another")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--bookkeeping-repeats", type=int, default=30)
    p.add_argument("--bookkeeping-warmup", type=int, default=3)
    p.add_argument("--skip", choices=["bandwidth", "bookkeeping"], default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.num_layers is None:
        args.num_layers = 32 if args.device == "cuda" else 8
    torch.set_num_threads(1)
    out: dict[str, Any] = {**run_info(),
                           "args": {k: v for k, v in vars(args).items() if k != "json"}}
    ok = True
    table: list[tuple[str, str, str]] = []
    if args.skip != "bookkeeping":
        book = out["bookkeeping"] = bookkeeping(args)
        ok = ok and book.pop("checked")
        for name, xs in book.items():
            table.append((name, _spread(xs, 1e6, ".0f") + " µs", ""))
    if args.skip != "bandwidth":
        bw: dict[str, Any] = {}
        for _ in range(args.runs):  # fresh processes each run; the repeats of all runs pooled
            ranks = run_ranks(bandwidth_job, 2, args=(args,), device=args.device,
                              timeout_s=600.0, pg_timeout_s=120.0,
                              num_threads=args.num_threads)
            got = ranks[1]
            if not bw:
                bw = got
                bw["message_s"] = {"prefill": ranks[0]["message_s"], "decode": got["message_s"]}
            else:
                bw["intact"] = bw["intact"] and got["intact"]
                for kind, xs in got["times_s"].items():
                    bw["times_s"][kind] += xs
                bw["message_s"]["prefill"] += ranks[0]["message_s"]
                bw["message_s"]["decode"] += got["message_s"]
        out["bandwidth"] = bw
        ok = ok and bw["intact"]
        gib = bw["bytes"] / 2**30
        backend = "nccl" if args.device == "cuda" else "gloo"
        plain = bw["times_s"]["plain"]
        for kind, xs in bw["times_s"].items():
            what = (f"one contiguous tensor, send + recv ({backend})" if kind == "plain" else
                    f"transfer, {kind}: gather + send + recv + scatter ({backend})")
            ratio = "" if kind == "plain" else ", vs contiguous " + _spread(
                [a / b for a, b in zip(plain, xs)], 100, ".0f") + " %"
            table.append((what, _spread(xs, 1e3, ".1f") + " ms",
                          _spread([gib / x for x in xs], 1, ".2f") + " GiB/s" + ratio))
        for side, xs in bw["message_s"].items():
            what = "sends the offer, receives the plan" if side == "prefill" else (
                "receives the offer, sends the plan")
            name = (f"a round's messages through {backend}, {side} side ({what}; "
                    f"{args.num_requests} requests)")
            table.append((name, _spread(xs, 1e6, ".0f") + " µs", ""))
        print(f"{args.num_tokens} tokens x {args.num_layers} layers x {args.kv_heads} KV heads "
              f"x {args.head_dim} ({args.dtype}, block {args.block_size}) = "
              f"{bw['bytes'] / 2**20:.0f} MiB; {args.device}, {args.num_threads} thread(s) per "
              f"rank; median [min–max] of {args.runs} runs x {args.repeats} repeats, the kinds "
              "alternated")
    width = max(len(r[0]) for r in table)
    print(f"| {'what':<{width}} | time | rate |\n|{'-' * (width + 2)}|---|---|")
    for name, t, rate in table:
        print(f"| {name:<{width}} | {t} | {rate} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if not ok:
        print("FAILED: the moved KV differs from the source, or the bookkeeping's plans differ",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
