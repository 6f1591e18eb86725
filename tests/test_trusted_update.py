"""Updates from the allocator's journal are marked ``trusted``: the table skips the checks the
producer promised (rows listed once, counts that sum to the ids) and keeps the rest (rows and
ids in range, appends within the row's width). The captured step and the three calls (apply,
commit, compute_slot_mapping) give the same table, device table and slots on random workloads,
and every update without the mark keeps every check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import examples
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import blocktable._compiled_loader as loader
from blocktable import GroupSpec, MultiGroupBlockTable, RowBlocks, StepUpdate
from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.step import CapturedStep

ROWS, BLOCK, NUM_BLOCKS, MAX_LEN, TOKENS = 6, 4, 40, 32, 24


def make_table(groups: int = 1) -> MultiGroupBlockTable:
    specs = [GroupSpec(BLOCK, num_blocks=NUM_BLOCKS)]
    if groups == 2:
        specs.append(GroupSpec(8, kernel_block_size=4, num_blocks=NUM_BLOCKS))
    return MultiGroupBlockTable(specs, ROWS, MAX_LEN, TOKENS)


def make_manager(groups: int = 1, rows: int = ROWS) -> KVCacheManager:
    specs = [AllocatorGroupSpec(BLOCK, NUM_BLOCKS)]
    if groups == 2:
        specs.append(AllocatorGroupSpec(8, NUM_BLOCKS))
    return KVCacheManager(specs, rows, max_model_len=MAX_LEN)


class Driver:
    """A random workload on a manager: admissions (some with shared prefixes), decode steps,
    finished and preempted requests; ``step()`` returns the journal's update."""

    def __init__(self, mgr: KVCacheManager, rng: np.random.Generator) -> None:
        self.mgr, self.rng = mgr, rng
        self.running: list[int] = []
        self.next_id = 0

    def step(self, decode_only: bool) -> StepUpdate:
        mgr, rng = self.mgr, self.rng
        if not decode_only:
            for req in list(self.running):
                u = rng.random()
                if u < 0.15:
                    mgr.free(req)
                    self.running.remove(req)
                elif u < 0.22:
                    mgr.preempt(req)
                    mgr.free(req)
                    self.running.remove(req)
            for _ in range(rng.integers(0, 3)):
                prompt = [1, 2, 3, 4, 5] + rng.integers(0, 9, rng.integers(1, 12)).tolist()
                if mgr.num_free_rows and mgr.can_admit(prompt):
                    mgr.add_request(self.next_id, prompt)
                    mgr.allocate(self.next_id, len(prompt) - mgr.num_computed_tokens(
                        self.next_id))
                    self.running.append(self.next_id)
                    self.next_id += 1
        for req in list(self.running):
            done = mgr.num_tokens(req) - mgr.num_computed_tokens(req)
            if done:
                mgr.mark_computed(req, done)
            # a decode token, or (a chunk of prefill) several blocks' worth
            num = 1 if decode_only or rng.random() < 0.6 else int(rng.integers(2, 10))
            if mgr.num_tokens(req) + num > MAX_LEN or not mgr.can_allocate(req, num):
                mgr.free(req)  # finished (or no room: finished early)
                self.running.remove(req)
                continue
            mgr.append_token_ids(req, rng.integers(0, 9, num).tolist())
            mgr.allocate(req, num)
        return mgr.take_step_update()

    def batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A decode batch of the running requests (one token each, at its last position)."""
        rows = np.array([self.mgr.row_of(r) for r in self.running], np.int32)
        positions = np.array([self.mgr.num_tokens(r) - 1 for r in self.running], np.int64)
        return np.arange(len(rows) + 1, dtype=np.int32), positions, rows


def untrusted(update: StepUpdate) -> StepUpdate:
    return dataclasses.replace(update, trusted=False)


def same(a: MultiGroupBlockTable, b: MultiGroupBlockTable) -> None:
    np.testing.assert_array_equal(a.storage.host, b.storage.host)
    np.testing.assert_array_equal(a.storage.device_tensor.numpy(), b.storage.device_tensor.numpy())
    np.testing.assert_array_equal(a.slot_buffers.numpy(), b.slot_buffers.numpy())


@pytest.mark.usefixtures("compiled_mode")  # compiled, then numpy
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trusted_steps_equal_checked_steps_and_three_calls(groups, seed):
    """Random workloads: the journal's updates through the captured step (decode steps,
    admissions, rows of finished requests reused in the same step, rows gaining several blocks)
    give the table, device table and slots of the same updates without the trusted mark, and
    of apply + commit + slot mapping."""
    mgr = make_manager(groups)
    trusted_bt, checked_bt, ref = make_table(groups), make_table(groups), make_table(groups)
    trusted, checked = CapturedStep(trusted_bt), CapturedStep(checked_bt)
    driver = Driver(mgr, np.random.default_rng(seed))
    decode_steps = admissions = reused_rows = multi_block = 0
    for i in range(40):
        update = driver.step(decode_only=i % 3 != 0)
        assert update.trusted
        qsl, positions, rows = driver.batch()
        reused_rows += int(trusted_bt[0].num_kernel_blocks[update.added[0].rows].any())
        out = trusted.run(update, qsl, positions, rows)
        assert out.num_pairs >= 0
        decode_steps += not len(update.added[0].rows)
        admissions += bool(len(update.added[0].rows))
        multi_block += bool((update.appended[0].num_manager_blocks > 1).any())
        checked.run(untrusted(update), qsl, positions, rows)
        ref.apply(update)
        ref.commit()
        ref.compute_slot_mapping(torch.from_numpy(qsl), torch.from_numpy(positions),
                                 row_of_batch=torch.from_numpy(rows))
        same(trusted_bt, checked_bt)
        same(trusted_bt, ref)
        trusted_bt.check_integrity()
    assert decode_steps >= 20 and admissions >= 5 and reused_rows >= 1 and multi_block >= 2


@pytest.mark.parametrize("groups", [1, 2])
def test_trusted_steps_on_the_device_path_equal_three_calls(groups, triton_device):
    """The same through the triton backend (the CUDA graph's kernels; under the interpreter
    without a GPU): table, device table and slots equal the three-call path's."""
    mgr = make_manager(groups)
    specs = make_table(groups).specs
    bt = MultiGroupBlockTable(specs, ROWS, MAX_LEN, TOKENS, triton_device, backend="triton")
    ref = make_table(groups)
    step = CapturedStep(bt)
    driver = Driver(mgr, np.random.default_rng(7))
    for i in range(12):
        update = driver.step(decode_only=i % 3 != 0)
        qsl, positions, rows = driver.batch()
        step.run(update, qsl, positions, rows)
        ref.apply(update)
        ref.commit()
        ref.compute_slot_mapping(torch.from_numpy(qsl), torch.from_numpy(positions),
                                 row_of_batch=torch.from_numpy(rows))
        if triton_device == "cuda":
            torch.cuda.synchronize()
        np.testing.assert_array_equal(bt.storage.host, ref.storage.host)
        np.testing.assert_array_equal(bt.storage.device_tensor.cpu().numpy(), ref.storage.host)
        np.testing.assert_array_equal(bt.slot_buffers.cpu().numpy(), ref.slot_buffers.numpy())


def _decode_update(rows: list[int], ids: list[int]) -> StepUpdate:
    r = np.array(rows, np.int32)
    return StepUpdate.make(1, appended=[RowBlocks(r, np.ones(len(r), np.int32),
                                                  np.array(ids, np.int32))])


def test_bad_user_update_is_still_rejected_before_any_write():
    """Repeated rows, rows and ids out of range, counts that do not match the ids: refused
    with nothing written, in a table that has run the allocator's updates before."""
    mgr = make_manager()
    bt = make_table()
    step = CapturedStep(bt)
    driver = Driver(mgr, np.random.default_rng(4))
    for _ in range(4):
        step.run(driver.step(decode_only=False), *driver.batch())
    qsl, positions = np.zeros(1, np.int32), np.zeros(0, np.int64)
    before = bt.storage.host.copy(), bt.storage.device_tensor.numpy().copy()
    free = [r for r in range(ROWS) if bt[0].num_kernel_blocks[r] < bt[0].width][:2]
    bad = [
        (_decode_update([free[0], free[0]], [3, 4]), ValueError),
        (_decode_update([ROWS], [3]), IndexError),
        (_decode_update([-1], [3]), IndexError),
        (_decode_update([free[0]], [NUM_BLOCKS]), ValueError),
        (_decode_update([free[0]], [-2]), ValueError),
        (StepUpdate.make(1, appended=[RowBlocks(np.array(free, np.int32), np.ones(2, np.int32),
                                                np.array([3, 4, 5], np.int32))]), ValueError),
    ]
    for update, error in bad:
        with pytest.raises(error):
            step.run(update, qsl, positions)
        np.testing.assert_array_equal(bt.storage.host, before[0])
        np.testing.assert_array_equal(bt.storage.device_tensor.numpy(), before[1])


def test_table_side_bounds_are_checked_on_trusted_updates():
    """The table, not the allocator, knows its width, rows and id bound: a trusted update past
    any of them is refused with nothing written."""
    # a table narrower than the allocator's rows: an append past the row's width
    bt = make_table()
    full = bt[0].width * BLOCK
    mgr = KVCacheManager([AllocatorGroupSpec(BLOCK, NUM_BLOCKS)], ROWS, max_model_len=full + 8)
    step = CapturedStep(bt)
    mgr.add_request("a", list(range(full)))
    mgr.allocate("a", full)
    step.run(mgr.take_step_update(), np.zeros(1, np.int32), np.zeros(0, np.int64))
    before = bt.storage.host.copy()
    mgr.mark_computed("a", full)
    mgr.append_token_ids("a", 1)
    mgr.allocate("a", 1)
    update = mgr.take_step_update()
    assert update.trusted
    with pytest.raises(ValueError):
        step.run(update, np.zeros(1, np.int32), np.zeros(0, np.int64))
    np.testing.assert_array_equal(bt.storage.host, before)

    # several blocks appended past the row's width
    mgr = KVCacheManager([AllocatorGroupSpec(BLOCK, NUM_BLOCKS)], ROWS, max_model_len=full + 8)
    bt = make_table()
    step = CapturedStep(bt)
    mgr.add_request("c", list(range(full - BLOCK)))
    mgr.allocate("c", full - BLOCK)
    step.run(mgr.take_step_update(), np.zeros(1, np.int32), np.zeros(0, np.int64))
    before = bt.storage.host.copy()
    mgr.mark_computed("c", full - BLOCK)
    mgr.append_token_ids("c", [1] * 2 * BLOCK)
    mgr.allocate("c", 2 * BLOCK)
    update = mgr.take_step_update()
    assert update.trusted
    with pytest.raises(ValueError):
        step.run(update, np.zeros(1, np.int32), np.zeros(0, np.int64))
    np.testing.assert_array_equal(bt.storage.host, before)

    # an admitted request longer than the table's rows
    mgr = KVCacheManager([AllocatorGroupSpec(BLOCK, NUM_BLOCKS)], ROWS, max_model_len=full + 8)
    bt = make_table()
    step = CapturedStep(bt)
    mgr.add_request("b", list(range(full + 4)))
    mgr.allocate("b", full + 4)
    with pytest.raises(ValueError):
        step.run(mgr.take_step_update(), np.zeros(1, np.int32), np.zeros(0, np.int64))
    assert not bt.storage.host.any()

    # ids past the table's bound
    mgr = make_manager()
    bt = MultiGroupBlockTable([GroupSpec(BLOCK, num_blocks=3)], ROWS, MAX_LEN, TOKENS)
    step = CapturedStep(bt)
    for r in range(3):
        mgr.add_request(r, [r] * 4)
        mgr.allocate(r, 4)
    with pytest.raises(ValueError):
        step.run(mgr.take_step_update(), np.zeros(1, np.int32), np.zeros(0, np.int64))
    assert not bt.storage.host.any()

    # a pool larger than the table's id bound: a decode batch's ids are read, not the bound
    rows = 12  # a batch of more rows than the journal diffs one by one
    mgr = KVCacheManager([AllocatorGroupSpec(BLOCK, NUM_BLOCKS)], rows, max_model_len=MAX_LEN)
    num_table_blocks = 2 * rows + 1  # holds the admissions' blocks and the first decode batch
    bt = MultiGroupBlockTable([GroupSpec(BLOCK, num_blocks=num_table_blocks)], rows, MAX_LEN,
                              TOKENS)
    step = CapturedStep(bt)
    reqs = list(range(rows))
    for r in reqs:
        mgr.add_request(r, [r] * BLOCK)
        mgr.allocate(r, BLOCK)
        mgr.mark_computed(r, BLOCK)
    step.run(mgr.take_step_update(), np.zeros(1, np.int32), np.zeros(0, np.int64))
    for lap, new_tokens in enumerate((1, BLOCK)):  # ids below the table's bound, then past it
        mgr.append_token_ids_many(reqs, [[1] * new_tokens] * rows)
        mgr.allocate_many(reqs, [new_tokens] * rows)
        update = mgr.take_step_update()
        assert update.trusted
        assert (int(update.appended[0].block_ids.max()) < num_table_blocks) == (lap == 0)
        before = bt.storage.host.copy()
        if lap == 0:
            out = step.run(update, np.zeros(1, np.int32), np.zeros(0, np.int64))
            assert out.num_pairs == 2 * rows  # the decode path: one id and one count per row
            assert (bt[0].num_kernel_blocks == 2).all()
        else:
            with pytest.raises(ValueError):
                step.run(update, np.zeros(1, np.int32), np.zeros(0, np.int64))
            np.testing.assert_array_equal(bt.storage.host, before)
        mgr.mark_computed_many(reqs, [new_tokens] * rows)

    # an allocator with more rows than the table: its rows are checked
    mgr = make_manager(rows=ROWS + 2)
    bt = make_table()
    step = CapturedStep(bt)
    for r in range(ROWS + 1):
        mgr.add_request(r, [r] * 4)
        mgr.allocate(r, 4)
    update = mgr.take_step_update()
    with pytest.raises(IndexError):
        step.run(update, np.zeros(1, np.int32), np.zeros(0, np.int64))
    assert not bt.storage.host.any()


class TrustedStepMachine(RuleBasedStateMachine):
    """Hypothesis drives an allocator (admissions with shared prefixes, decode and prefill
    chunks, finishes, preemptions; a sliding-window group in the two-group model) and direct
    writes to the tables behind its back, and every step's update goes through the captured
    step as given (trusted), without the mark (checked) and through apply + commit + slot
    mapping: all three stay equal, and refuse the same updates with nothing written."""

    GROUPS = 1
    COMPILED = True  # False: tables and steps made with numpy doing the compiled loops' work

    @initialize()
    def setup(self) -> None:
        specs = [AllocatorGroupSpec(BLOCK, NUM_BLOCKS)]
        table_specs = [GroupSpec(BLOCK, num_blocks=NUM_BLOCKS)]
        if self.GROUPS == 2:
            specs.append(AllocatorGroupSpec(8, NUM_BLOCKS, sliding_window=8))
            table_specs.append(GroupSpec(8, kernel_block_size=4, num_blocks=NUM_BLOCKS))
        self.mgr = KVCacheManager(specs, ROWS, max_model_len=MAX_LEN)
        saved = loader.COMPILED
        if not self.COMPILED:
            loader.COMPILED = None
        try:
            self.tables = [MultiGroupBlockTable(table_specs, ROWS, MAX_LEN, TOKENS)
                           for _ in range(3)]
            self.trusted = CapturedStep(self.tables[0])
            self.checked = CapturedStep(self.tables[1])
        finally:
            loader.COMPILED = saved
        self.running: list[int] = []
        self.next_id = 0

    @rule(num_tokens=st.integers(1, 14), shared=st.booleans())
    def admit(self, num_tokens: int, shared: bool) -> None:
        prompt = ([1, 2, 3, 4, 5, 6, 7, 8] if shared else [self.next_id % 7]) + [9] * num_tokens
        prompt = prompt[: MAX_LEN - 4]
        mgr = self.mgr
        if not mgr.num_free_rows or not mgr.can_admit(prompt):
            return
        mgr.add_request(self.next_id, prompt)
        mgr.allocate(self.next_id, len(prompt) - mgr.num_computed_tokens(self.next_id))
        self.running.append(self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.running)
    @rule(data=st.data(), num_tokens=st.integers(1, 9))
    def grow(self, data: st.DataObject, num_tokens: int) -> None:
        """A decode token (1) or a prefill chunk (several blocks' worth) for one request."""
        req = data.draw(st.sampled_from(self.running))
        mgr = self.mgr
        done = mgr.num_tokens(req) - mgr.num_computed_tokens(req)
        if done:
            mgr.mark_computed(req, done)
        if mgr.num_tokens(req) + num_tokens > MAX_LEN or not mgr.can_allocate(req, num_tokens):
            return
        mgr.append_token_ids(req, [4] * num_tokens)
        mgr.allocate(req, num_tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def finish(self, data: st.DataObject, preempt: bool) -> None:
        req = data.draw(st.sampled_from(self.running))
        if preempt:
            self.mgr.preempt(req)
        self.mgr.free(req)
        self.running.remove(req)

    @rule(row=st.integers(0, ROWS - 1), num_blocks=st.integers(1, 40))
    def user_append(self, row: int, num_blocks: int) -> None:
        """The user writes the tables directly (the allocator does not know): the trusted mark
        says nothing about the table, so a row this fills refuses the allocator's next append."""
        errors = set()
        for table in self.tables:
            try:
                table.append_row([[7] * num_blocks] + [[]] * (self.GROUPS - 1), row)
            except ValueError:
                errors.add("refused")
            else:
                errors.add("done")
        assert len(errors) == 1

    @rule()
    def step(self) -> None:
        update = self.mgr.take_step_update()
        assert update.trusted
        rows = np.array([self.mgr.row_of(r) for r in self.running], np.int32)
        positions = np.array([self.mgr.num_tokens(r) - 1 for r in self.running], np.int64)
        qsl = np.arange(len(rows) + 1, dtype=np.int32)
        ref = self.tables[2]

        def three_calls() -> None:
            ref.apply(update)
            ref.commit()
            ref.compute_slot_mapping(torch.from_numpy(qsl), torch.from_numpy(positions),
                                     row_of_batch=torch.from_numpy(rows))

        outcomes = []
        for run in (lambda: self.trusted.run(update, qsl, positions, rows),
                    lambda: self.checked.run(untrusted(update), qsl, positions, rows),
                    three_calls):
            try:
                run()
                outcomes.append(None)
            except (ValueError, IndexError) as exc:  # a row the user filled: nothing written
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1] == outcomes[2]
        event("step refused" if outcomes[0] is not None else "step applied")
        if outcomes[0] is not None:
            for table in self.tables:  # the three-call path commits what the user wrote
                table.commit()
        same(self.tables[0], self.tables[1])
        same(self.tables[0], ref)
        self.tables[0].check_integrity()


class TwoGroupTrustedStepMachine(TrustedStepMachine):
    GROUPS = 2


_SETTINGS = settings(max_examples=examples(25), stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestTrustedSteps = TrustedStepMachine.TestCase
TestTrustedSteps.settings = _SETTINGS
TestTwoGroupTrustedSteps = TwoGroupTrustedStepMachine.TestCase
TestTwoGroupTrustedSteps.settings = _SETTINGS


class NumpyTrustedStepMachine(TrustedStepMachine):
    COMPILED = False


TestNumpyTrustedSteps = NumpyTrustedStepMachine.TestCase
TestNumpyTrustedSteps.settings = _SETTINGS
