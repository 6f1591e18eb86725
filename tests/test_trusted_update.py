"""Updates built by the allocator's journal carry facts the captured step trusts: the trusted
path equals the fully checked path exactly, the facts cannot be made false afterwards, and
every update without them (a user's, or a copy of a trusted one) keeps every check."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import blocktable._native_loader as loader
from blocktable import GroupSpec, MultiGroupBlockTable, RowBlocks, StepUpdate
from blocktable._native_loader import native_module
from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.slot_mapping.torch_impl import slot_mapping_numpy
from blocktable.step import CapturedStep, runner
from blocktable.step.numpy_slots import CheckedSlots
from blocktable.update import PackedStepUpdate

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
    return dataclasses.replace(update)


def count_general_staging(monkeypatch: pytest.MonkeyPatch) -> list[MultiGroupBlockTable]:
    """Record each table the captured step's general staging path (``stage_general``, taken
    when neither the decode stager nor its compiled lanes take an update) is called with."""
    calls: list[MultiGroupBlockTable] = []
    general = runner.stage_general

    def recorded(table, *args):
        calls.append(table)
        return general(table, *args)

    monkeypatch.setattr(runner, "stage_general", recorded)
    return calls


def same(a: MultiGroupBlockTable, b: MultiGroupBlockTable) -> None:
    np.testing.assert_array_equal(a.storage.host, b.storage.host)
    np.testing.assert_array_equal(a.storage.device_tensor.numpy(), b.storage.device_tensor.numpy())
    np.testing.assert_array_equal(a.slot_buffers.numpy(), b.slot_buffers.numpy())


@pytest.mark.usefixtures("native_mode")  # compiled loops, then numpy twins
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trusted_steps_equal_checked_steps_and_three_calls(groups, seed, monkeypatch):
    """Random workloads: the journal's updates through the captured step (trusted: decode steps,
    admissions, rows of finished requests reused in the same step, rows gaining several blocks)
    give the table, device table and slots of the same updates stripped of their facts
    (checked: admissions take the general path), and of apply + commit + slot mapping."""
    mgr = make_manager(groups)
    trusted_bt, checked_bt, ref = make_table(groups), make_table(groups), make_table(groups)
    trusted, checked = CapturedStep(trusted_bt), CapturedStep(checked_bt)
    driver = Driver(mgr, np.random.default_rng(seed))
    general = count_general_staging(monkeypatch)
    stage, stager_calls = trusted._stager.stage, []
    trusted._stager.stage = lambda *args: stager_calls.append(args) or stage(*args)
    # one group, compiled: the step stages packed and decode updates itself (the stager's
    # lanes inlined) once the block sizes are checked (the first step, through the stager)
    inlined = groups == 1 and loader.NATIVE is not None
    decode_steps = admissions = reused_rows = multi_block = packed = 0
    for i in range(40):
        update = driver.step(decode_only=i % 3 != 0)
        assert update.facts is not None
        packed += type(update) is PackedStepUpdate and not update.__dict__.keys() & {"added"}
        lane = type(update) is PackedStepUpdate or update.facts.appends_only
        num_stager_calls = len(stager_calls)
        qsl, positions, rows = driver.batch()
        reused_rows += int(trusted_bt[0].num_kernel_blocks[update.added[0].rows].any())
        before = general.count(trusted_bt)
        out = trusted.run(update, qsl, positions, rows)
        # the decode stager (or its lanes inlined in the step) took every step, admissions too
        assert general.count(trusted_bt) == before
        assert out.num_pairs >= 0
        assert (len(stager_calls) == num_stager_calls) == (inlined and lane and i > 0)
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
        assert out.num_pairs >= 0
        trusted_bt.check_integrity()
    assert decode_steps >= 20 and admissions >= 5 and reused_rows >= 1 and multi_block >= 2
    # one group, compiled: admissions come packed, staged from their one buffer
    assert (packed >= 5) == (groups == 1 and loader.NATIVE is not None)


@pytest.mark.usefixtures("native_mode")  # compiled loops, then numpy twins
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


@pytest.mark.usefixtures("native_mode")  # compiled loops, then numpy twins
@pytest.mark.parametrize("groups", [1, 2])
def test_journal_arrays_are_read_only_and_copies_lose_the_facts(groups):
    mgr = make_manager(groups)
    driver = Driver(mgr, np.random.default_rng(3))
    update = driver.step(decode_only=False)
    while not (len(update.added[0].rows) and len(update.appended[0].rows)):
        update = driver.step(decode_only=False)
    arrays = [update.cleared_rows, *(getattr(p, f) for p in (*update.added, *update.appended)
                                     for f in ("rows", "num_manager_blocks", "block_ids"))]
    for a in arrays:
        if len(a):  # (empty parts share one empty array: nothing to write)
            assert not a.flags.writeable
            with pytest.raises(ValueError):
                a[0] = 5
            with pytest.raises(ValueError):
                a.flags.writeable = True
            base = a.base
            while isinstance(base, np.ndarray):
                with pytest.raises(ValueError):
                    base.flags.writeable = True
                base = base.base
    assert update.facts is not None
    for other in (dataclasses.replace(update), copy.copy(update), copy.deepcopy(update),
                  pickle.loads(pickle.dumps(update))):
        assert other.facts is None
        np.testing.assert_array_equal(other.cleared_rows, update.cleared_rows)
        for part in ("added", "appended"):
            for f in ("rows", "num_manager_blocks", "block_ids"):
                np.testing.assert_array_equal(getattr(getattr(other, part)[0], f),
                                              getattr(getattr(update, part)[0], f))


@pytest.mark.usefixtures("native_mode")  # compiled loops, then numpy twins
def test_the_journals_constructors_make_what_the_dataclasses_make():
    """The journal builds its updates without the frozen dataclasses' ``__init__``: every field
    is set, and the objects equal (and repr as) those the plain constructors make."""
    from blocktable.update import AllocatorFacts, RowEntries, trusted_row_blocks, trusted_update

    rows, num, ids = (np.array(v, np.int32) for v in ([1, 3], [1, 2], [5, 6, 7]))
    part = trusted_row_blocks(rows, num, ids)
    assert set(vars(part)) == {f.name for f in dataclasses.fields(RowBlocks)}
    assert repr(part) == repr(RowBlocks(rows, num, ids))
    facts = AllocatorFacts(4, (9,), (False,), (-1,))
    update = trusted_update(rows[:1], (RowBlocks(),), (part,), (RowEntries(),), (4,), facts)
    plain = StepUpdate(rows[:1], (RowBlocks(),), (part,), (RowEntries(),), (4,))
    assert set(vars(update)) == {f.name for f in dataclasses.fields(StepUpdate)}
    assert update == plain and repr(update) == repr(plain) and update.facts is facts
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.cleared_rows = rows  # type: ignore[misc]


def _decode_update(rows: list[int], ids: list[int]) -> StepUpdate:
    r = np.array(rows, np.int32)
    return StepUpdate.make(1, appended=[RowBlocks(r, np.ones(len(r), np.int32),
                                                  np.array(ids, np.int32))])


@pytest.mark.usefixtures("native_mode")  # compiled loops, then numpy twins
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


@pytest.mark.usefixtures("native_mode")  # compiled loops, then numpy twins
def test_table_side_bounds_are_checked_on_trusted_updates(monkeypatch):
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
    assert update.facts is not None and update.facts.one_block_each == (True,)
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
    assert update.facts is not None and update.facts.one_block_each == (False,)
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
    general = count_general_staging(monkeypatch)
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
        assert update.facts.one_block_each == (True,)
        assert update.facts.ids_at_most[0] >= num_table_blocks  # the pool's bound
        assert (int(update.appended[0].block_ids.max()) < num_table_blocks) == (lap == 0)
        before = bt.storage.host.copy()
        if lap == 0:
            out = step.run(update, np.zeros(1, np.int32), np.zeros(0, np.int64))
            assert out.num_pairs == 2 * rows  # the decode path: one id and one count per row
            assert general.count(bt) == 0
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


def _random_slots_case(rng: np.random.Generator, decode: bool, odd: bool):
    if odd:  # kernel block sizes that are not powers of two
        bt = MultiGroupBlockTable([GroupSpec(6, num_blocks=NUM_BLOCKS),
                                   GroupSpec(12, kernel_block_size=6, num_blocks=NUM_BLOCKS)],
                                  ROWS, MAX_LEN, TOKENS)
    else:
        bt = make_table(groups=2)
    counts = []
    for g in range(2):
        cap = bt[g].width // bt[g].k
        num = rng.integers(0, cap + 1, ROWS)
        counts.append(num)
        rows = np.arange(ROWS, dtype=np.int32)
        ids = rng.integers(0, NUM_BLOCKS, int(num.sum())).astype(np.int32)  # some null
        added = [RowBlocks(rows, num.astype(np.int32), ids) if h == g else RowBlocks()
                 for h in range(2)]
        bt.apply(StepUpdate.make(2, added=added))
    bt.commit()
    num_reqs = int(rng.integers(1, ROWS + 1))
    rows = rng.permutation(ROWS)[:num_reqs].astype(np.int32)
    num_new = np.ones(num_reqs, np.int64) if decode else rng.integers(1, 4, num_reqs)
    qsl = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int32)
    span = bt[0].width * bt.specs[0].kernel_block_size
    positions = rng.integers(0, span, int(num_new.sum())).astype(np.int64)
    if rng.random() < 0.3:  # past the row's width, or negative: the general function
        positions[rng.integers(0, len(positions))] = rng.choice([span, span + 7, -1, -9])
    return bt, qsl, positions, rows


@pytest.mark.usefixtures("native_mode")  # compiled loops, then numpy twins
@pytest.mark.parametrize("odd", [False, True])
@pytest.mark.parametrize("decode", [True, False])
def test_checked_slots_equal_the_general_numpy_function(decode, odd):
    """The CPU slot mapping of a checked batch reads the null block past each row's count
    instead of comparing with the count: equal to the general function on random tables
    (null entries inside rows, positions past counts, past widths and negative; kernel block
    sizes that are powers of two and that are not)."""
    rng = np.random.default_rng(5)
    for _ in range(60):
        bt, qsl, positions, rows = _random_slots_case(rng, decode, odd)
        flat = bt.storage.device_tensor.numpy()
        want = np.full((2, TOKENS), 99, np.int64)
        got = want.copy()
        slot_mapping_numpy(flat, bt.slot_params, qsl, positions, rows, want, ROWS)
        CheckedSlots(flat, bt.slot_params, ROWS, TOKENS, native_module()).map(
            qsl, positions, rows, got[:, : len(positions)], decode)
        np.testing.assert_array_equal(got[:, : len(positions)], want[:, : len(positions)])


class TrustedStepMachine(RuleBasedStateMachine):
    """Hypothesis drives an allocator (admissions with shared prefixes, decode and prefill
    chunks, finishes, preemptions; a sliding-window group in the two-group model) and direct
    writes to the tables behind its back, and every step's update goes through the captured
    step as given (trusted), stripped of its facts (checked) and through apply + commit + slot
    mapping: all three stay equal, and refuse the same updates with nothing written."""

    GROUPS = 1
    NUMPY = False  # True: the captured steps use the numpy twins of the compiled loops

    @initialize()
    def setup(self) -> None:
        specs = [AllocatorGroupSpec(BLOCK, NUM_BLOCKS)]
        table_specs = [GroupSpec(BLOCK, num_blocks=NUM_BLOCKS)]
        if self.GROUPS == 2:
            specs.append(AllocatorGroupSpec(8, NUM_BLOCKS, sliding_window=8))
            table_specs.append(GroupSpec(8, kernel_block_size=4, num_blocks=NUM_BLOCKS))
        self.mgr = KVCacheManager(specs, ROWS, max_model_len=MAX_LEN)
        self.tables = [MultiGroupBlockTable(table_specs, ROWS, MAX_LEN, TOKENS)
                       for _ in range(3)]
        saved = loader.NATIVE
        if self.NUMPY:  # the numpy twins of the compiled loops
            loader.NATIVE = None
        try:
            self.trusted = CapturedStep(self.tables[0])
            self.checked = CapturedStep(self.tables[1])
        finally:
            loader.NATIVE = saved
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
        """The user writes the tables directly (the allocator does not know): the facts say
        nothing about the table, so a row this fills refuses the allocator's next append."""
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
        assert update.facts is not None
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
                    lambda: self.checked.run(dataclasses.replace(update), qsl, positions, rows),
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


_SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestTrustedSteps = TrustedStepMachine.TestCase
TestTrustedSteps.settings = _SETTINGS
TestTwoGroupTrustedSteps = TwoGroupTrustedStepMachine.TestCase
TestTwoGroupTrustedSteps.settings = _SETTINGS


class NumpyTrustedStepMachine(TrustedStepMachine):
    NUMPY = True


class NumpyTwoGroupTrustedStepMachine(TwoGroupTrustedStepMachine):
    NUMPY = True


TestNumpyTrustedSteps = NumpyTrustedStepMachine.TestCase
TestNumpyTrustedSteps.settings = _SETTINGS
TestNumpyTwoGroupTrustedSteps = NumpyTwoGroupTrustedStepMachine.TestCase
TestNumpyTwoGroupTrustedSteps.settings = _SETTINGS
