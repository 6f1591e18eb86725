"""Calls one engine step makes on the CUDA code path, counted on the CPU: a diagnostic, not a
timing.

On a GPU host every torch call (an operator, a tensor constructor, ``.copy_``, ``.item()``, a
graph replay, an event or stream call) costs several microseconds and every Python frame a
fraction of one, so an engine step's block-table host time follows the *number* of those
calls more than anything else. This script counts them, deterministically, without a GPU:

- the engine (``blocktable.engine.LLMEngine``, a tiny random Llama, CPU tensors) runs the
  captured step built for ``device="cuda"`` behind ``tests/fake_graph.py``'s ``fake_cuda``
  (events, streams, pinned and device tensor constructors; CUDA graphs are its
  ``FakeGraph``, whose kernels run under Triton's interpreter), so the step takes its CUDA
  branch: two staging buffers, graph replays, the mailbox;
- around each piece of the step it counts, per step:

  ``torch``   calls caught by a ``TorchFunctionMode`` (operators, tensor methods and
              constructors, ``.copy_``, slicing, ``.numpy()``...);
  ``cuda``    ``torch.cuda`` calls reaching the fake (``CUDAGraph.replay``, ``Event.record``,
              ``Event.synchronize``, ``current_stream``...; an ``Event.record()`` without a
              stream counts torch's own ``current_stream()`` lookup too, as torch makes it);
  ``py``      Python frames entered (``sys.setprofile`` 'call' events; the fake's own frames
              and the replayed device work are left out, and so are torch's Python wrappers
              of the ``cuda`` calls: one frame each, about a dozen for ``current_stream``);
  ``c``       calls of builtin C functions and methods from Python (builtins, numpy's and
              torch's C methods): 'c_call' events. The compiled loops (Cython functions)
              and numpy's indexing are not seen: per step the block-table work makes three
              compiled calls, the batch check, the group's update and the commit's pairs.

The pieces: ``take_step_update`` (the allocator's journal), ``run_staged`` (update, staging,
launch: with the first, the engine's ``table_time_s``), and, as the engine's input time
counts them, ``batch_views`` (waits until a staging buffer is free) and ``fill_staged`` (the
engine's own inputs). Workloads are those of ``bench_engine_loop.py``: ``demo`` (every step
but each run's first) and ``decode-N`` (decode-only steps, but the first).

    PYTHONPATH=src python benchmarks/count_step_ops.py
    PYTHONPATH=/work/wt/base/src python benchmarks/count_step_ops.py   # another checkout

Counts are per step: median (mean) over the workload's steps. The real CUDA path differs from
this one only below the fake (torch's C++ and the driver); a checkout whose step launches its
graphs through the CUDA driver itself (not ``CUDAGraph.replay``) is counted as replaying.
The run checks that the device table equals the host table at the end and that the step's
generated tokens equal those of the engine's CPU path, and exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the graphs' kernels, on CPU tensors

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import fake_graph
from fake_graph import fake_cuda

import blocktable
from blocktable.demo import DemoOptions
from blocktable.engine import EngineConfig, LLMEngine, make_workload, run_workload, tiny_llama
from blocktable.engine.batch_inputs import BatchInputBuffers
from blocktable.engine.engine import StepResult
from blocktable.step import CapturedStep

KINDS = ("torch", "cuda", "py", "c")
PIECES = ("take_step_update", "run_staged", "batch_views", "fill_staged")
CUDA0 = torch.device("cuda", 0)  # (a torch.device, made without CUDA)
_NOT_COUNTED = {__file__, fake_graph.__file__}  # the frames of this script and of the fake


class Tally:
    """Per-step counts by piece and kind; what is counted now (``kind``: 'torch' or 'frames')."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.active = 0  # inside a counted piece (pieces may nest: run calls run_staged)
        self.paused = 0  # inside the fake's replay: device work, not counted
        self.piece = ""
        self.step: dict[tuple[str, str], int] = defaultdict(int)
        self.steps: list[dict[tuple[str, str], int]] = []
        self.cuda_names: dict[str, int] = defaultdict(int)  # over all kept steps

    def add(self, what: str, n: int = 1) -> None:
        if self.active and not self.paused:
            self.step[(self.piece, what)] += n

    def cuda(self, name: str) -> None:
        if self.active and not self.paused:
            self.step[(self.piece, "cuda")] += 1
            self.step[("names", name)] += 1

    def end_step(self, keep: bool) -> None:
        if keep:
            self.steps.append(dict(self.step))
        self.step.clear()


TALLY: Tally | None = None


def _cuda(name: str) -> None:
    if TALLY is not None:
        TALLY.cuda(name)


class _Counter(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if TALLY is not None:
            TALLY.add("torch")
        return func(*args, **(kwargs or {}))


def _profile(frame, event, arg) -> None:
    t = TALLY
    if t is None or t.paused:
        return
    if event == "call":
        code = frame.f_code
        if code.co_filename not in _NOT_COUNTED:
            t.add("py")
            t.add("frame " + code.co_qualname)
    elif event == "c_call":
        t.add("c")


class counted:
    """Count what runs inside the block as ``piece`` (a class: its frames are not counted)."""

    def __init__(self, piece: str) -> None:
        self.piece = piece
        self.mode: _Counter | None = None
        self.outer = False

    def __enter__(self) -> None:
        t = TALLY
        self.outer = t is not None and not t.active
        if not self.outer:
            return
        t.active, t.piece = 1, self.piece
        if t.kind == "torch":
            self.mode = _Counter()
            self.mode.__enter__()
        else:
            sys.setprofile(_profile)

    def __exit__(self, *exc: object) -> None:
        t = TALLY
        if not self.outer or t is None:
            return
        if self.mode is not None:
            self.mode.__exit__(*exc)
        else:
            sys.setprofile(None)
            t.step[(self.piece, "c")] -= 1  # the sys.setprofile(None) call itself
        t.active = 0


def wrap(owner: object, attr: str, piece: str) -> None:
    fn = getattr(owner, attr)

    def counted_call(*args, **kwargs):
        with counted(piece):
            return fn(*args, **kwargs)

    setattr(owner, attr, counted_call)


class _uncounted:
    """The replayed graph's work: device work, not counted (a class: its frames are not
    counted either)."""

    def __enter__(self) -> None:
        self.profile = sys.getprofile()
        if TALLY is not None:
            TALLY.paused += 1
        sys.setprofile(None)

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self.profile)
        if TALLY is not None:
            TALLY.paused -= 1


# ---------------------------------------------------------------- the engine
def as_cuda_engine(engine: LLMEngine) -> None:
    """Give ``engine`` (CPU tensors, captured step) the captured step and input buffers built
    for CUDA: the table's kernels (Triton, interpreted) in graphs, two staging buffers, the
    mailbox."""
    table = engine.table
    table.backend = "triton"  # the CUDA path's kernels
    table.device = CUDA0
    # the engine's own step's options (its payload, where this checkout has one)
    payload = getattr(engine.captured_step.layout, "payload_words", 0)
    try:
        engine.captured_step = CapturedStep(table, **({"payload_words": payload} if payload
                                                      else {}))
        engine._inputs = BatchInputBuffers(engine.config.max_num_reqs, engine.config.token_budget,
                                           CUDA0)
    finally:
        table.device = torch.device("cpu")
    step = engine.captured_step
    assert step.launch_kind == "replay", "the step did not take its CUDA branch"
    wrap(engine.manager, "take_step_update", "take_step_update")
    for attr in ("run", "run_staged", "batch_views"):
        wrap(step, attr, "batch_views" if attr == "batch_views" else "run_staged")
    wrap(engine._inputs, "fill_staged", "fill_staged")


def demo_runs(repeats: int, cuda: bool, tally: Tally | None) -> list[list[int]]:
    """The demo's workload ``repeats`` times; the tokens each request generated."""
    opts = DemoOptions(device="cpu")
    model = tiny_llama(seed=opts.seed, device="cpu")
    workload = make_workload(opts.num_requests, seed=opts.seed, block_size=opts.block_size,
                             vocab_size=model.config.vocab_size,
                             max_new_tokens=opts.max_new_tokens)
    max_model_len = max(len(w.prompt_token_ids) for w in workload) + opts.max_new_tokens
    outputs = []
    for _ in range(repeats):
        engine = LLMEngine(model, EngineConfig(
            block_size=opts.block_size, num_blocks=opts.num_blocks,
            max_num_reqs=opts.num_requests, token_budget=opts.token_budget,
            max_model_len=max_model_len, record_logits=False))
        if cuda:
            as_cuda_engine(engine)
        run_workload(engine, workload, on_step=None if tally is None else _after_first(tally))
        outputs += [engine.requests[w.req_id].output_token_ids for w in workload]
        if cuda and not engine.table.device_equals_host():
            raise SystemExit("FAILED: the device table differs from the host table")
    return outputs


def _after_first(tally: Tally) -> Callable:
    """Keep every step with requests but the run's first (its one-time set-up)."""
    seen = [False]

    def on_step(result: StepResult) -> None:
        tally.end_step(result.num_reqs > 0 and seen[0])
        seen[0] = seen[0] or result.num_reqs > 0

    return on_step


def decode_run(num_reqs: int, decode_steps: int, cuda: bool,
               tally: Tally | None) -> list[list[int]]:
    """``bench_engine_loop.py``'s decode workload: ``num_reqs`` requests admitted together."""
    model = tiny_llama(seed=0, device="cpu")
    rng = random.Random(0)
    max_len = 64 + decode_steps + 1
    engine = LLMEngine(model, EngineConfig(
        block_size=16, num_blocks=num_reqs * -(-max_len // 16) + 1, max_num_reqs=num_reqs,
        token_budget=num_reqs * 64, max_model_len=max_len, enable_prefix_caching=False,
        record_logits=False))
    if cuda:
        as_cuda_engine(engine)
    for i in range(num_reqs):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(16, 63))]
        engine.add_request(f"r{i}", prompt, decode_steps + 1)
    first = True
    while engine.has_unfinished():
        r = engine.step()
        decode = r.num_reqs == num_reqs and r.num_tokens == num_reqs
        if tally is not None:
            tally.end_step(decode and not first)
        first = first and not decode
    if cuda and not engine.table.device_equals_host():
        raise SystemExit("FAILED: the device table differs from the host table")
    return [engine.requests[f"r{i}"].output_token_ids for i in range(num_reqs)]


def count(run: Callable[[bool, Tally | None], list[list[int]]]) -> dict:
    """Run the workload on the CPU path (the reference tokens), then twice on the fake CUDA
    path (torch calls, then frames); per piece and kind, median and mean per step."""
    global TALLY
    reference = run(False, None)
    tallies = {}
    for kind in ("torch", "frames"):
        TALLY = tallies[kind] = Tally(kind)
        try:
            with fake_cuda(on_call=_cuda, replaying=_uncounted):
                tokens = run(True, TALLY)
        finally:
            TALLY = None
        if tokens != reference:
            raise SystemExit("FAILED: the fake CUDA path generated other tokens than the CPU path")
    steps = [len(t.steps) for t in tallies.values()]
    if steps[0] != steps[1]:
        raise SystemExit(f"FAILED: the two passes kept {steps} steps")
    out: dict = {"steps": steps[0]}
    merged = [{**a, **b} for a, b in zip(tallies["torch"].steps, tallies["frames"].steps)]
    for piece in (*PIECES, "table", "inputs"):
        parts = {"table": ("take_step_update", "run_staged"),
                 "inputs": ("batch_views", "fill_staged")}.get(piece, (piece,))
        out[piece] = {}
        for kind in KINDS:
            values = [sum(st.get((p, kind), 0) for p in parts) for st in merged]
            out[piece][kind] = (statistics.median(values), statistics.mean(values))
    names: dict[str, float] = defaultdict(float)
    for st in tallies["torch"].steps:
        for (group, name), n in st.items():
            if group == "names":
                names[name] += n / len(tallies["torch"].steps)
    out["cuda_calls"] = dict(sorted(names.items()))
    frames: dict[tuple[str, str], float] = defaultdict(float)
    for st in tallies["frames"].steps:
        for (piece, name), n in st.items():
            if name.startswith("frame "):
                frames[(piece, name[6:])] += n / len(tallies["frames"].steps)
    out["frames"] = dict(sorted(frames.items()))
    return out


def checkout() -> str:
    src = Path(blocktable.__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "src"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(src)
    return f"{src} @ {rev}{'+dirty' if dirty else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="runs of the demo workload")
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=17,
                    help="decode steps (block size 16: 16 steps see every row gain a block)")
    ap.add_argument("--frames", action="store_true",
                    help="also list the Python functions each piece enters (mean per step)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    np.random.seed(0)
    results = {
        "demo": count(lambda cuda, t: demo_runs(args.repeats, cuda, t)),
        f"decode-{args.num_reqs}": count(
            lambda cuda, t: decode_run(args.num_reqs, args.decode_steps, cuda, t)),
    }
    print(f"calls per engine step on the CUDA code path (fake torch.cuda on the CPU; not a "
          f"timing)\ncheckout {checkout()}, torch {torch.__version__}")
    print("median (mean) per step; torch = TorchFunctionMode calls, cuda = torch.cuda calls, "
          "py = Python frames, c = C-function calls")
    for name, res in results.items():
        print(f"\n{name} ({res['steps']} steps)")
        print(f"  {'piece':<18}" + "".join(f"{k:>16}" for k in KINDS))
        for piece in (*PIECES, "table", "inputs"):
            label = {"table": "= table time", "inputs": "= inputs time"}.get(piece, piece)
            cells = "".join(f"{f'{m:g} ({a:.1f})':>16}" for m, a in
                            (res[piece][k] for k in KINDS))
            print(f"  {label:<18}{cells}")
        calls = ", ".join(f"{n} {v:.2f}" for n, v in res["cuda_calls"].items())
        print(f"  torch.cuda calls per step (mean): {calls or 'none'}")
        if args.frames:
            for (piece, fn), n in res["frames"].items():
                print(f"    {piece:<18}{n:6.2f}  {fn}")
    print("\ntable time = take_step_update + run_staged (the engine's table_time_s); inputs = "
          "batch_views + fill_staged")


if __name__ == "__main__":
    main()
