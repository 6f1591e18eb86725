"""Where the host time of a CUDA step goes, piece by piece, in the engine loop.

``CapturedStep.run_staged`` is replaced by a copy with a clock read between its pieces (the
argument checks, the compiled batch check, the staging, the qsl padding and token views, the
header writes, the graph replay, the outputs), and ``take_step_update`` is wrapped. The copy is
of ``run_staged`` as it was before ``prepare_batch`` folded the check, the padding and the
header into one call (commit 95d3d83); it is a record of that measurement, to run against that
code. Each piece's median over the steps of the demo and decode-256 workloads (two runs of
each) is printed and written to the JSON path given. CUDA only; each clock read adds about
0.1 µs.

Command: ``PYTHONPATH=src python3 benchmarks/split_captured_step.py out.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import bench_engine_loop

from blocktable.allocator.manager import KVCacheManager
from blocktable.step import runner
from blocktable.step.host import stage_general
from blocktable.step.layout import BATCH_WORDS, NUM_PAIRS, SEQ
from blocktable.update import StepUpdate

clock = time.perf_counter_ns
times_ns: dict[str, list[int]] = {}  # piece -> its time in each step


def record(piece: str, start: int, stop: int) -> None:
    times_ns.setdefault(piece, []).append(stop - start)


_take_step_update = KVCacheManager.take_step_update


def timed_take_step_update(self: KVCacheManager):  # type: ignore[no-untyped-def]
    t0 = clock()
    update = _take_step_update(self)
    record("take_step_update", t0, clock())
    return update


def timed_run_staged(self, update, num_reqs, num_tokens, *, with_seq_lens=True):  # type: ignore[no-untyped-def]
    """run_staged (CUDA, compiled loops, graphs and mailbox) with a clock read per piece."""
    t0 = clock()
    if not isinstance(update, StepUpdate):
        raise TypeError("update")
    if self._lent != self._slot:
        raise RuntimeError("batch_views")
    if not (type(num_reqs) is int and 0 <= num_reqs <= self._max_reqs):
        raise ValueError("num_reqs")
    if not (type(num_tokens) is int and 0 <= num_tokens <= self._max_tokens):
        raise ValueError("num_tokens")
    slot = self._slot
    qsl = self._qsl_by_n[slot][num_reqs]
    rows = self._rows_by_n[slot][num_reqs]
    t1 = clock()
    code = self._native.check_batch(qsl, rows, num_tokens, self._num_rows)
    if code >= 0:
        self._decode = code == 1
    else:
        self._check_values(qsl, num_reqs, num_tokens, rows)
    t2 = clock()
    v = self._views[slot]
    num_pairs = self._stager.stage(update, v.pairs, self._max_pairs)
    if num_pairs < 0:
        num_pairs = stage_general(self.table, update, v.pairs, self._max_pairs)
    t3 = clock()
    self._lent = -1
    padded = num_reqs * self._padding_key + num_tokens
    if self._padded[slot] != padded:
        v.qsl[num_reqs + 1 :] = num_tokens
        self._padded[slot] = padded
    by_t = self._by_t[num_tokens] or self._token_views(num_tokens)
    t4 = clock()
    header = self._header_mv[slot]
    header[NUM_PAIRS] = num_pairs if num_pairs > 0 else 0  # noqa: FURB136 (as run_staged)
    header[BATCH_WORDS] = self._batch_words + 2 * num_tokens
    seq = self._seq = (self._seq + 1) & runner._SEQ_MASK
    header[SEQ] = seq
    t5 = clock()
    self._graphs[slot].replay()
    t6 = clock()
    self._expect[slot] = seq
    self._slot = slot ^ self._slot_flip
    by_n = self._d_by_n[num_reqs]
    out = runner._new_tuple(
        runner.StepOutputs,
        (self._slot_views, by_n[0], by_t.device_positions, by_n[1],
         by_n[2] if with_seq_lens else None, num_pairs),
    )
    t7 = clock()
    for piece, start, stop in (("args", t0, t1), ("check_batch", t1, t2), ("stage", t2, t3),
                               ("pad+views", t3, t4), ("header", t4, t5), ("replay", t5, t6),
                               ("outputs", t6, t7), ("run_staged", t0, t7)):
        record(piece, start, stop)
    return out


def main() -> None:
    KVCacheManager.take_step_update = timed_take_step_update  # type: ignore[method-assign]
    runner.CapturedStep.run_staged = timed_run_staged  # type: ignore[method-assign]
    results: dict[str, list[dict[str, float]]] = {}
    for workload in ("demo", "decode-256", "demo", "decode-256"):
        times_ns.clear()
        if workload == "demo":
            run = bench_engine_loop.demo_workload("cuda", 4, 5, True)
        else:
            run = bench_engine_loop.decode_workload("cuda", 256, 64, True)
        medians = {k: round(statistics.median(v) / 1e3, 2) for k, v in times_ns.items()}
        medians["table_p50_us"] = round(run["table_p50_us"], 1)
        print(workload, medians, flush=True)
        results.setdefault(workload, []).append(medians)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
