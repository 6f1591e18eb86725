"""CapturedStep gives exactly what apply + commit + compute_slot_mapping give, step after step,
and rejects bad input before any write."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktable import (
    GroupSpec,
    MultiGroupBlockTable,
    RowBlocks,
    RowEntries,
    StepUpdate,
    _compiled_loader,
)
from blocktable.step import CapturedStep

pytestmark = pytest.mark.usefixtures("compiled_mode")  # compiled, then numpy

ROWS, TOKENS, NUM_BLOCKS = 6, 16, 200
SPECS = [GroupSpec(4, max_num_blocks=6, num_blocks=NUM_BLOCKS),
         GroupSpec(8, kernel_block_size=4, max_num_blocks=3, num_blocks=NUM_BLOCKS)]

# every test here runs with the compiled step loops and with their numpy twins


def make_table(device: str, backend: str, specs: list[GroupSpec] = SPECS) -> MultiGroupBlockTable:
    return MultiGroupBlockTable(specs, ROWS, None, TOKENS, device, backend=backend)


class Model:
    """Manager blocks per row and group, to draw valid random updates and batches."""

    def __init__(self, bt: MultiGroupBlockTable, rng: np.random.Generator) -> None:
        self.rng = rng
        self.groups = len(bt.specs)
        self.cap = [bt[g].width // bt[g].k for g in range(self.groups)]
        self.count = np.zeros((self.groups, ROWS), dtype=np.int64)
        self.block_size = [s.block_size for s in bt.specs]

    def ids(self, n: int) -> np.ndarray:
        return self.rng.integers(1, NUM_BLOCKS, n).astype(np.int32)

    def decode(self) -> StepUpdate:
        rng = self.rng
        appended = []
        for g in range(self.groups):
            free = np.nonzero(self.count[g] < self.cap[g])[0]
            rows = rng.permutation(free)[: rng.integers(0, len(free) + 1)].astype(np.int32)
            if g and rng.random() < 0.3:
                rows = rows[:0]
            self.count[g, rows] += 1
            appended.append(RowBlocks(rows, np.ones(len(rows), np.int32), self.ids(len(rows))))
        return StepUpdate.make(self.groups, appended=appended)

    def decode_with_clears(self) -> StepUpdate:
        """Rows of finished requests cleared (one maybe listed twice), others gain a block."""
        rng = self.rng
        cleared = rng.choice(ROWS, rng.integers(1, 3), replace=False).astype(np.int32)
        if rng.random() < 0.3:
            cleared = np.concatenate([cleared, cleared[:1]])
        self.count[:, cleared] = 0
        update = self.decode()
        keep = [~np.isin(a.rows, cleared) for a in update.appended]
        for g, (a, k) in enumerate(zip(update.appended, keep)):
            self.count[g, a.rows[~k]] -= 1  # not appended after all
        appended = [RowBlocks(a.rows[k], a.num_manager_blocks[k], a.block_ids[k])
                    for a, k in zip(update.appended, keep)]
        return StepUpdate.make(self.groups, cleared_rows=cleared, appended=appended)

    def general(self) -> StepUpdate:
        rng = self.rng
        cleared = rng.choice(ROWS, rng.integers(0, 3), replace=True).astype(np.int32)
        self.count[:, cleared] = 0
        added, appended, nulled = [], [], []
        for g in range(self.groups):
            rows = rng.choice(ROWS, rng.integers(0, 3), replace=False).astype(np.int32)
            num = rng.integers(0, self.cap[g] + 1, len(rows)).astype(np.int32)
            self.count[g, rows] = num
            added.append(RowBlocks(rows, num, self.ids(int(num.sum()))))
            rows = rng.choice(ROWS, rng.integers(0, 3), replace=False).astype(np.int32)
            num = np.minimum(rng.integers(0, 3, len(rows)), self.cap[g] - self.count[g, rows])
            self.count[g, rows] += num
            appended.append(RowBlocks(rows, num.astype(np.int32), self.ids(int(num.sum()))))
            full = np.nonzero(self.count[g])[0]
            rows = rng.choice(full, min(len(full), 2), replace=False).astype(np.int32)
            blocks = (rng.random(len(rows)) * self.count[g, rows]).astype(np.int32)
            nulled.append(RowEntries(rows, blocks))
        return StepUpdate.make(self.groups, cleared_rows=cleared, added=added,
                               appended=appended, nulled=nulled)

    def batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        rng = self.rng
        rows = rng.permutation(ROWS)[: rng.integers(0, ROWS + 1)].astype(np.int32)
        num_new = rng.integers(1, 4, len(rows))
        while num_new.sum() > TOKENS:
            num_new[np.argmax(num_new)] -= 1
        qsl = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
        most = self.count[0, rows] * self.block_size[0] + 2  # a few past the blocks: PAD
        positions = np.concatenate(
            [rng.integers(0, m, n) for m, n in zip(most, num_new)] + [np.zeros(0)]
        ).astype(np.int64)
        seq_lens = rng.integers(1, 100, len(rows)).astype(np.int32)
        return qsl, positions, rows, seq_lens


def reference_step(ref: MultiGroupBlockTable, update: StepUpdate, qsl: np.ndarray,
                   positions: np.ndarray, rows: np.ndarray | None) -> None:
    ref.apply(update)
    ref.commit()
    ref.compute_slot_mapping(
        torch.from_numpy(qsl), torch.from_numpy(positions),
        row_of_batch=None if rows is None else torch.from_numpy(rows),
    )


def check_same(bt: MultiGroupBlockTable, ref: MultiGroupBlockTable, out, qsl, positions, rows,
               seq_lens) -> None:
    np.testing.assert_array_equal(bt.storage.host, ref.storage.host)
    np.testing.assert_array_equal(bt.storage.device_tensor.cpu().numpy(), ref.storage.host)
    np.testing.assert_array_equal(bt.slot_buffers.cpu().numpy(), ref.slot_buffers.numpy())
    assert (bt.slot_buffers.cpu().numpy()[:, len(positions) :] == -1).all()  # the tail: PAD
    for g, slots in enumerate(out.slot_mappings):
        assert slots is not None and slots.data_ptr() == bt.slot_mapping(g).data_ptr()
    np.testing.assert_array_equal(out.query_start_loc.cpu().numpy(), qsl)
    np.testing.assert_array_equal(out.positions.cpu().numpy(), positions)
    want_rows = np.arange(len(qsl) - 1) if rows is None else rows
    np.testing.assert_array_equal(out.row_of_batch.cpu().numpy(), want_rows)
    np.testing.assert_array_equal(out.seq_lens.cpu().numpy(), seq_lens)
    bt.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("max_pairs", [None, 6])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_steps_match_apply_commit_slot_mapping(backend, max_pairs, seed, triton_device):
    """Random decode and general steps, condensed and indexed batches, small and ample pair
    capacity (too small: the table's own commit moves the changes): table, device table and
    slot mapping equal the three-call path's, exactly."""
    device = "cpu" if backend == "torch" else triton_device
    bt, ref = make_table(device, backend), make_table("cpu", "torch")
    step = CapturedStep(bt, max_pairs=max_pairs)
    model = Model(bt, np.random.default_rng(seed))
    for i in range(14):
        update = model.decode() if i % 3 else model.general()
        qsl, positions, rows, seq_lens = model.batch()
        indexed = i % 4 != 1
        if not indexed:
            rows = np.arange(len(rows), dtype=np.int32)
        out = step.run(update, qsl, positions, rows if indexed else None, seq_lens)
        reference_step(ref, update, qsl, positions, rows if indexed else None)
        if device == "cuda":
            torch.cuda.synchronize()
        check_same(bt, ref, out, qsl, positions, rows, seq_lens)


def staged_run(step: CapturedStep, update: StepUpdate, qsl: np.ndarray, positions: np.ndarray,
               rows: np.ndarray, seq_lens: np.ndarray):
    """The batch written into the step's staging views, then ``run_staged``."""
    batch = step.batch_views()
    n, t = len(qsl) - 1, len(positions)
    batch.query_start_loc[: n + 1] = qsl
    batch.positions[:t] = positions
    batch.row_of_batch[:n] = rows
    batch.seq_lens[:n] = seq_lens
    return step.run_staged(update, n, t)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("specs", ["two groups", "block 6"])
def test_staged_and_decode_batches_match_apply_commit_slot_mapping(backend, specs,
                                                                    triton_device):
    """Batches written into ``batch_views`` (``run_staged``) or passed to ``run``; decode
    batches (one token per request: no token search); a negative position (the general
    mapping); a kernel block size that is not a power of two: all equal the three calls."""
    device = "cpu" if backend == "torch" else triton_device
    spec_list = SPECS if specs == "two groups" else [
        GroupSpec(6, max_num_blocks=6, num_blocks=NUM_BLOCKS)]
    bt, ref = make_table(device, backend, spec_list), make_table("cpu", "torch", spec_list)
    step = CapturedStep(bt)
    # the CPU backend's one host call; the kernels on CUDA (a graph), or eagerly under Triton's
    # interpreter
    compiled = _compiled_loader.COMPILED is not None
    assert step.launch_kind == {"cpu": "host" if backend == "torch" else "eager",
                                "cuda": "driver" if compiled else "replay"}[device]
    model = Model(bt, np.random.default_rng(5))
    for i in range(16):
        update = (model.decode, model.decode_with_clears, model.general)[i % 3]()
        qsl, positions, rows, seq_lens = model.batch()
        if i % 2:  # a decode batch
            most = model.count[0, rows] * model.block_size[0] + 2
            positions = np.array([model.rng.integers(0, m) for m in most], np.int64)
            qsl = np.arange(len(rows) + 1, dtype=np.int32)
        if i % 5 == 4 and len(positions):
            positions[0] = -3
        if i % 4 < 2:
            out = staged_run(step, update, qsl, positions, rows, seq_lens)
        else:
            out = step.run(update, qsl, positions, rows, seq_lens)
        reference_step(ref, update, qsl, positions, rows)
        if device == "cuda":
            torch.cuda.synchronize()
        check_same(bt, ref, out, qsl, positions, rows, seq_lens)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs Triton on CPU tensors, under the "
                    "interpreter that tests use only without CUDA; the real CUDA step is tested here")
def test_cuda_branch_on_the_cpu_replays_once_a_step_and_equals_three_calls():
    """The step built for CUDA (two staging buffers, a graph of kernels each that posts to a
    pinned mailbox, a payload), run on the CPU behind a fake ``torch.cuda``: the same results
    as the three calls, and the graph's replay is the only ``torch.cuda`` call of a step (the
    wait for a staging buffer reads the mailbox)."""
    from fake_graph import fake_cuda

    calls: list[str] = []
    bt, ref = make_table("cpu", "triton"), make_table("cpu", "torch")
    with fake_cuda(on_call=calls.append):
        bt.device = torch.device("cuda", 0)
        try:
            step = CapturedStep(bt, payload_words=3)
        finally:
            bt.device = torch.device("cpu")
        assert not any(c.startswith("Event") for c in calls)  # no events: the mailbox
        assert step.launch_kind == "replay"  # no CUDA driver loaded here: torch's replay
        model = Model(bt, np.random.default_rng(7))
        for i in range(10):
            update = (model.decode, model.decode_with_clears, model.general)[i % 3]()
            qsl, positions, rows, seq_lens = model.batch()
            calls.clear()
            batch = step.batch_views()
            batch.payload[:] = (i, i + 1, i + 2)
            n, t = len(qsl) - 1, len(positions)
            batch.query_start_loc[: n + 1] = qsl
            batch.positions[:t] = positions
            batch.row_of_batch[:n] = rows
            batch.seq_lens[:n] = seq_lens
            out = step.run_staged(update, n, t)
            assert calls == ["CUDAGraph.replay"]
            reference_step(ref, update, qsl, positions, rows)
            check_same(bt, ref, out, qsl, positions, rows, seq_lens)
            assert step.device_payload.tolist() == [i, i + 1, i + 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs Triton on CPU tensors, under the "
                    "interpreter that tests use only without CUDA")
def test_a_device_that_never_finishes_raises_instead_of_hanging(monkeypatch):
    """A staging buffer whose device work never posts (a stuck device): the step that would
    refill it raises after the wait's deadline, naming the buffer."""
    from fake_graph import fake_cuda

    from blocktable.step import runner

    monkeypatch.setattr(runner, "_DEVICE_WAIT_S", 0.05)
    bt = make_table("cpu", "triton")
    with fake_cuda():
        bt.device = torch.device("cuda", 0)
        try:
            step = CapturedStep(bt)
        finally:
            bt.device = torch.device("cpu")
        step._launches = [lambda: None, lambda: None]  # launched, never run: no post
        for _ in range(2):
            step.batch_views()
            step.run_staged(StepUpdate.empty(bt.num_groups), 0, 0)
        with pytest.raises(RuntimeError, match="did not finish.*staging buffer 0"):
            step.batch_views()


def test_run_staged_rejects_bad_use_before_any_write(device):
    backend = "torch" if device == "cpu" else "triton"
    bt = make_table(device, backend)
    step = CapturedStep(bt)
    update = StepUpdate.make(2, appended=[RowBlocks.from_lists([0], [[3]]), RowBlocks()])
    with pytest.raises(RuntimeError, match="batch_views"):
        step.run_staged(update, 1, 1)
    batch = step.batch_views()
    batch.query_start_loc[:2] = (0, 1)
    batch.positions[0] = 0
    batch.row_of_batch[0] = ROWS
    before = _snapshot(bt)
    with pytest.raises(IndexError, match="outside"):
        step.run_staged(update, 1, 1)
    batch.row_of_batch[0] = 0
    for num_reqs, num_tokens, match in ((ROWS + 1, 1, "num_reqs"), (1, TOKENS + 1, "num_tokens"),
                                        (1, 2, "end at num_tokens"), (1.0, 1, "num_reqs")):
        with pytest.raises(ValueError, match=match):
            step.run_staged(update, num_reqs, num_tokens)  # type: ignore[arg-type]
    batch.query_start_loc[:3] = (0, 2, 1)
    with pytest.raises(ValueError, match="never decrease"):
        step.run_staged(update, 2, 1)
    with pytest.raises(TypeError, match="StepUpdate"):
        step.run_staged(None, 1, 1)  # type: ignore[arg-type]
    for a, b in zip(before, _snapshot(bt)):
        np.testing.assert_array_equal(a, b)
    batch.query_start_loc[:2] = (0, 1)
    out = step.run_staged(update, 1, 1)
    assert out.slot_mappings[0][0].item() == 3 * 4
    with pytest.raises(RuntimeError, match="batch_views"):
        step.run_staged(update, 1, 1)  # the views were used


def test_row_ops_between_steps_travel_with_the_next_step(triton_device):
    """Row operations made directly on the table before a step are committed by that step."""
    bt, ref = make_table(triton_device, "triton"), make_table("cpu", "torch")
    step = CapturedStep(bt)
    for t in (bt, ref):
        t.add_row(([5, 6], [7]), 2)
        t.move_row(2, 4)
    model = Model(bt, np.random.default_rng(3))
    model.count[:, 4] = (2, 1)
    update = model.decode()
    qsl, positions, rows, seq_lens = model.batch()
    out = step.run(update, qsl, positions, rows, seq_lens)
    reference_step(ref, update, qsl, positions, rows)
    if triton_device == "cuda":
        torch.cuda.synchronize()
    check_same(bt, ref, out, qsl, positions, rows, seq_lens)


def test_decode_step_leaves_nothing_to_commit():
    """A decode step stages its pairs (ids and counts): nothing is left for commit()."""
    bt = MultiGroupBlockTable([GroupSpec(16)], 8, 16 * 64, 8)
    step = CapturedStep(bt)
    rows = np.array([3, 1], np.int32)
    update = StepUpdate.make(1, appended=[RowBlocks(rows, np.ones(2, np.int32),
                                                    np.array([9, 4], np.int32))])
    out = step.run(update, np.array([0, 1, 2], np.int32), np.array([0, 5], np.int64), rows)
    assert out.num_pairs == 4
    assert not bt.storage.changed and bt.commit().num_entries == 0
    assert out.slot_mappings[0][:3].tolist() == [9 * 16, 4 * 16 + 5, -1]


def test_decode_step_with_cleared_rows_matches_three_calls(triton_device):
    """Rows of finished requests cleared beside one-block appends: the same table and slots
    as the three calls."""
    bt, ref = make_table(triton_device, "triton"), make_table("cpu", "torch")
    step = CapturedStep(bt)
    model = Model(bt, np.random.default_rng(9))
    for t in (bt, ref):
        t.apply(StepUpdate.make(2, added=[RowBlocks.from_lists([0, 1, 3], [[5, 6], [7], [8, 9]]),
                                          RowBlocks.from_lists([1], [[4]])]))
    model.count[0, [0, 1, 3]] = (2, 1, 2)
    model.count[1, 1] = 1
    step.run(StepUpdate.empty(2), np.zeros(1, np.int32), np.zeros(0, np.int64))
    ref.commit()

    for _ in range(6):
        update = model.decode_with_clears()
        qsl, positions, rows, seq_lens = model.batch()
        out = step.run(update, qsl, positions, rows, seq_lens)
        assert out.num_pairs >= len(np.unique(update.cleared_rows)) * 2
        reference_step(ref, update, qsl, positions, rows)
        if triton_device == "cuda":
            torch.cuda.synchronize()
        check_same(bt, ref, out, qsl, positions, rows, seq_lens)


def _snapshot(bt: MultiGroupBlockTable) -> tuple[np.ndarray, np.ndarray]:
    return bt.storage.host.copy(), bt.slot_buffers.cpu().numpy().copy()


BAD_BATCHES = [
    ({"query_start_loc": np.array([0, 1], np.int64)}, TypeError, "query_start_loc"),
    ({"positions": [5]}, TypeError, "positions"),
    ({"query_start_loc": np.zeros(ROWS + 2, np.int32), "positions": np.zeros(0, np.int64),
          "row_of_batch": None}, ValueError, "max_num_reqs"),
    ({"query_start_loc": np.array([0, TOKENS + 1], np.int32),
          "positions": np.zeros(TOKENS + 1, np.int64)}, ValueError, "max_num_tokens"),
    ({"query_start_loc": np.array([0, 2], np.int32)}, ValueError, "end at num_tokens"),
    ({"row_of_batch": np.array([ROWS], np.int32)}, IndexError, "outside"),
    ({"row_of_batch": np.array([0, 1], np.int32)}, ValueError, "row_of_batch"),
    ({"seq_lens": np.array([1], np.int64)}, TypeError, "seq_lens"),
]


@pytest.mark.parametrize("bad, error, match", BAD_BATCHES)
def test_bad_batch_is_rejected_before_any_write(bad, error, match):
    bt = make_table("cpu", "torch")
    step = CapturedStep(bt)
    before = _snapshot(bt)
    update = StepUpdate.make(2, appended=[RowBlocks.from_lists([0], [[3]]), RowBlocks()])
    args = {"update": update, "query_start_loc": np.array([0, 1], np.int32),
                "positions": np.array([0], np.int64), "row_of_batch": np.array([0], np.int32)}
    args.update(bad)
    with pytest.raises(error, match=match):
        step.run(**args)
    after = _snapshot(bt)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("update, error", [
    (StepUpdate.make(2, appended=[RowBlocks.from_lists([0, 0], [[3], [4]]), RowBlocks()]),
     ValueError),  # a row twice
    (StepUpdate.make(2, appended=[RowBlocks.from_lists([0], [[NUM_BLOCKS]]), RowBlocks()]),
     ValueError),  # an id past the pool
    (StepUpdate.make(2, appended=[RowBlocks.from_lists([ROWS], [[3]]), RowBlocks()]),
     IndexError),
    (StepUpdate.make(2, appended=[RowBlocks.from_lists([0], [[3] * 99]), RowBlocks()]),
     ValueError),  # past the row width
    (StepUpdate.make(2, appended=[RowBlocks.from_lists([-1], [[3]]), RowBlocks()]),
     IndexError),  # a negative row on the decode path
    (StepUpdate.make(2, appended=[RowBlocks.from_lists([1, 0], [[3], [-2]]), RowBlocks()]),
     ValueError),  # a negative id on the decode path
    (StepUpdate.make(2, appended=[RowBlocks.from_lists([1, 2, 1], [[3], [4], [5]]),
                                  RowBlocks()]), ValueError),  # a row twice among others
    (StepUpdate.make(2, cleared_rows=[-1],
                     appended=[RowBlocks.from_lists([0], [[3]]), RowBlocks()]), IndexError),
    (StepUpdate.make(2, cleared_rows=[1, ROWS],
                     appended=[RowBlocks.from_lists([0], [[3]]), RowBlocks()]), IndexError),
])
def test_bad_update_is_rejected_before_any_write(update, error, triton_device):
    bt = make_table(triton_device, "triton")
    step = CapturedStep(bt)
    qsl, positions = np.array([0, 1], np.int32), np.array([0], np.int64)
    step.run(StepUpdate.make(2, added=[RowBlocks.from_lists([0], [[1]]), RowBlocks()]), qsl,
             positions)
    before = bt.storage.host.copy()
    with pytest.raises(error):
        step.run(update, qsl, positions)
    np.testing.assert_array_equal(bt.storage.host, before)
    out = step.run(StepUpdate.empty(2), qsl, positions)  # the next good step is exact
    if triton_device == "cuda":
        torch.cuda.synchronize()
    assert out.slot_mappings[0][:2].tolist() == [4, -1]
    assert bt.device_equals_host()


def test_decode_append_to_a_full_row_is_rejected_before_any_write():
    bt = make_table("cpu", "torch")
    step = CapturedStep(bt)
    cap = bt[0].width // bt[0].k
    qsl, positions = np.array([0], np.int32), np.array([], np.int64)
    step.run(StepUpdate.make(2, added=[RowBlocks.from_lists([0, 1], [[1] * cap, [2]]),
                                       RowBlocks()]), qsl, positions)
    before = bt.storage.host.copy()
    full = StepUpdate.make(2, appended=[RowBlocks.from_lists([1, 0], [[3], [4]]), RowBlocks()])
    with pytest.raises(ValueError):
        step.run(full, qsl, positions)
    np.testing.assert_array_equal(bt.storage.host, before)
    step.run(StepUpdate.make(2, appended=[RowBlocks.from_lists([1], [[3]]), RowBlocks()]), qsl,
             positions)
    assert bt[0].num_kernel_blocks[1] == 2 * bt[0].k and bt.device_equals_host()


def test_bad_construction():
    bt = make_table("cpu", "torch")
    with pytest.raises(ValueError, match="max_num_reqs"):
        CapturedStep(bt, max_num_reqs=ROWS + 1)
    with pytest.raises(ValueError, match="max_num_tokens"):
        CapturedStep(bt, max_num_tokens=TOKENS + 1)
    with pytest.raises(ValueError, match="debug"):
        CapturedStep(MultiGroupBlockTable(SPECS, ROWS, None, TOKENS, debug=True))
    with pytest.raises(TypeError, match="MultiGroupBlockTable"):
        CapturedStep(bt[0])  # type: ignore[arg-type]


def run_steps_and_check(step: CapturedStep, bt: MultiGroupBlockTable, ref: MultiGroupBlockTable,
                        model: Model, num_steps: int, general_every: int) -> None:
    """``num_steps`` steps back to back on CUDA (a general update every ``general_every``-th,
    decode updates between), the same on ``ref`` by the three calls; then compare."""
    for i in range(num_steps):
        update = model.decode() if i % general_every else model.general()
        qsl, positions, rows, seq_lens = model.batch()
        out = step.run(update, qsl, positions, rows, seq_lens)
        reference_step(ref, update, qsl, positions, rows)
    torch.cuda.synchronize()
    check_same(bt, ref, out, qsl, positions, rows, seq_lens)


def test_engine_captured_step_equals_three_calls():
    """The engine's captured path and its apply/commit/compute_slot_mapping path see the same
    table and slot mapping at every step and generate the same tokens."""
    from blocktable.engine import EngineConfig, LLMEngine, make_workload, run_workload, tiny_llama

    model = tiny_llama(seed=0)
    workload = make_workload(4, seed=2, block_size=4, max_new_tokens=5)
    max_model_len = max(len(w.prompt_token_ids) for w in workload) + 5
    seen: dict[bool, list] = {}
    for captured in (True, False):
        engine = LLMEngine(model, EngineConfig(
            block_size=4, num_blocks=14, max_num_reqs=4, token_budget=12,
            max_model_len=max_model_len, record_logits=False, captured_step=captured,
        ))
        assert (engine.captured_step is not None) == captured
        snaps: list = []
        run_workload(engine, workload, hook=lambda eng, batch, snaps=snaps: snaps.append((
            eng.table.storage.host.copy(), eng.table.slot_buffers[0, : batch.num_tokens].clone(),
        )))
        assert engine.table.device_equals_host()
        tokens = {k: r.output_token_ids for k, r in engine.requests.items()}
        seen[captured] = [snaps, tokens]
    (snaps_a, tokens_a), (snaps_b, tokens_b) = seen[True], seen[False]
    assert tokens_a == tokens_b and len(snaps_a) == len(snaps_b) > 5
    for (host_a, slots_a), (host_b, slots_b) in zip(snaps_a, snaps_b):
        np.testing.assert_array_equal(host_a, host_b)
        assert torch.equal(slots_a, slots_b)


def test_docstring_example_runs():
    import doctest

    from blocktable.step import runner

    result = doctest.testmod(runner, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_graph", [True, False])
def test_cuda_graph_and_eager_steps_match(use_graph):
    """Graph replays and eager launches give the three-call path's results, many steps back to
    back (both staging buffers reused while in flight)."""
    bt, ref = make_table("cuda", "triton"), make_table("cpu", "torch")
    step = CapturedStep(bt, use_graph=use_graph)
    # with the compiled part built, the graphs launch by the driver, not by torch's replay
    driver = "driver" if _compiled_loader.COMPILED is not None else "replay"
    assert step.launch_kind == (driver if use_graph else "eager")
    run_steps_and_check(step, bt, ref, Model(bt, np.random.default_rng(11)), num_steps=12,
                        general_every=4)


def test_slot_tail_is_pad_after_longer_steps_and_direct_calls(device):
    """A short step after a long one, or after the table's own compute_slot_mapping, leaves
    every slot past its tokens PAD."""
    backend = "torch" if device == "cpu" else "triton"
    bt = make_table(device, backend)
    step = CapturedStep(bt)
    step.run(StepUpdate.make(2, added=[RowBlocks.from_lists([0], [[3, 4, 5]]), RowBlocks()]),
             np.array([0, 10], np.int32), np.arange(10, dtype=np.int64))
    short = (StepUpdate.empty(2), np.array([0, 1], np.int32), np.array([2], np.int64))
    for longer in ("step", "direct", "direct, strided"):
        if longer == "direct":
            bt.compute_slot_mapping(torch.tensor([0, 12], dtype=torch.int32, device=device),
                                    torch.arange(12, device=device))
        if longer == "direct, strided":  # (on the CPU the numpy mapping, not the compiled one)
            bt.compute_slot_mapping(torch.tensor([0, 14], dtype=torch.int32, device=device),
                                    torch.arange(28, device=device)[::2])
        out = step.run(*short)
        got = bt.slot_buffers.cpu().numpy()
        assert out.slot_mappings[0][0].item() == 3 * 4 + 2
        assert (got[:, 1:] == -1).all() and got[1, 0] == -1
