"""Stateful property test: random sequences of every row op, batched update, commit and slot
mapping, against the plain-Python model. Rejected calls must leave every buffer unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TRITON_DEVICE, examples
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from table_model import TableModel, assert_table_matches, assert_unchanged, snapshot

from blocktable import GroupSpec, MultiGroupBlockTable, RowBlocks, RowEntries, StepUpdate
from blocktable.slot_mapping import slot_mapping_reference

NUM_BLOCKS = 40
R = 5
MAX_TOKENS = 48
# Block sizes of 128 tokens and more keep the explicit widths as given (widths are aligned to
# 128 tokens), so rows fill up and the width checks are exercised.
SPECS = [
    GroupSpec(128, max_num_blocks=5, num_blocks=NUM_BLOCKS),
    GroupSpec(256, kernel_block_size=128, max_num_blocks=3, num_blocks=NUM_BLOCKS),
    GroupSpec(4, kind="encoder_only"),
    GroupSpec(128, kind="state", max_num_blocks=4, num_blocks=NUM_BLOCKS),
]
MAX_POSITION = 960  # past every row's last block
TABLE_GROUPS = [0, 1, 3]
STEPS = [0]  # invariant checks run, for a look at how much a run covered

rows_st = st.integers(0, R - 1)
ids_st = st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=6)
bad_ids_st = st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=3).flatmap(
    lambda ok: st.sampled_from([-1, NUM_BLOCKS, NUM_BLOCKS + 7]).map(lambda bad: ok + [bad])
)


class TableMachine(RuleBasedStateMachine):
    device = "cpu"
    backend = "torch"

    def __init__(self) -> None:
        super().__init__()
        self.bt = MultiGroupBlockTable(
            SPECS, R, None, MAX_TOKENS, self.device, backend=self.backend, commit_staging_entries=10
        )
        widths = [self.bt.storage.widths[g] for g in range(len(SPECS))]
        self.model = TableModel(SPECS, R, widths)
        self.committed = True

    def _ids(self, data: st.DataObject) -> tuple[list[int], ...]:
        return tuple([] if g == 2 else data.draw(ids_st) for g in range(len(SPECS)))

    def _expect_rejected(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        before = snapshot(self.bt)
        with pytest.raises((ValueError, IndexError, TypeError)):
            fn(*args)
        assert_unchanged(before, self.bt)

    @rule(row=rows_st, data=st.data())
    def add_row(self, row: int, data: st.DataObject) -> None:
        ids = self._ids(data)
        if all(self.model.fits(g, len(ids[g])) for g in TABLE_GROUPS):
            self.bt.add_row(ids, row)
            for g in TABLE_GROUPS:
                self.model.add(g, row, ids[g])
            self.committed = False
        else:
            self._expect_rejected(self.bt.add_row, ids, row)

    @rule(row=rows_st, data=st.data())
    def append_row(self, row: int, data: st.DataObject) -> None:
        ids = self._ids(data)
        if all(
            self.model.fits(g, len(self.model.rows[g][row]) + len(ids[g])) for g in TABLE_GROUPS
        ):
            self.bt.append_row(ids, row)
            for g in TABLE_GROUPS:
                self.model.append(g, row, ids[g])
            self.committed = False
        else:
            self._expect_rejected(self.bt.append_row, ids, row)

    @rule(row=rows_st)
    def clear_row(self, row: int) -> None:
        self.bt.clear_row(row)
        self.model.clear_row(row)
        self.committed = False

    @rule(src=rows_st, dst=rows_st)
    def move_row(self, src: int, dst: int) -> None:
        self.bt.move_row(src, dst)
        self.model.move(src, dst)
        self.committed = False

    @rule(a=rows_st, b=rows_st)
    def swap_row(self, a: int, b: int) -> None:
        self.bt.swap_row(a, b)
        self.model.swap(a, b)
        self.committed = False

    @rule()
    def clear(self) -> None:
        self.bt.clear()
        self.model.clear()
        self.committed = False

    @rule(data=st.data())
    def apply_batch(self, data: st.DataObject) -> None:
        cleared = data.draw(st.lists(rows_st, max_size=3))
        added_rows = data.draw(st.lists(rows_st, max_size=3, unique=True))
        app_rows = data.draw(st.lists(rows_st, max_size=3, unique=True))
        added, appended, nulled = [], [], []
        model = [[list(r) for r in g_rows] for g_rows in self.model.rows]
        ok = True
        for g in range(len(SPECS)):
            if g == 2:
                added.append(RowBlocks())
                appended.append(RowBlocks())
                nulled.append(RowEntries())
                continue
            for r in cleared:
                model[g][r] = []
            a_ids = [data.draw(ids_st) for _ in added_rows]
            p_ids = [data.draw(ids_st) for _ in app_rows]
            for r, ids in zip(added_rows, a_ids):
                model[g][r] = list(ids)
            for r, ids in zip(app_rows, p_ids):
                model[g][r] = model[g][r] + list(ids)
            ok &= all(self.model.fits(g, len(model[g][r])) for r in range(R))
            n_rows, n_idx = [], []
            for r in data.draw(st.lists(rows_st, max_size=2)):
                if model[g][r]:
                    j = data.draw(st.integers(0, len(model[g][r]) - 1))
                    n_rows.append(r)
                    n_idx.append(j)
                    model[g][r][j] = 0
            added.append(RowBlocks.from_lists(added_rows, a_ids))
            appended.append(RowBlocks.from_lists(app_rows, p_ids))
            nulled.append(RowEntries(np.array(n_rows, np.int32), np.array(n_idx, np.int32)))
        update = StepUpdate.make(
            len(SPECS), cleared_rows=cleared, added=added, appended=appended, nulled=nulled
        )
        if ok:
            self.bt.apply(update)
            self.model.rows = model
            self.committed = False
        else:
            self._expect_rejected(self.bt.apply, update)

    @rule(data=st.data())
    def rejected_calls(self, data: st.DataObject) -> None:
        row = data.draw(rows_st)
        bad = data.draw(bad_ids_st)
        good = ([1], [2], [], [3])
        choice = data.draw(st.integers(0, 5))
        if choice == 0:
            self._expect_rejected(self.bt.add_row, (bad, [1], [], [2]), row)
        elif choice == 1:
            self._expect_rejected(self.bt.append_row, ([1], [2], [], bad), row)
        elif choice == 2:
            self._expect_rejected(self.bt.add_row, good, R + data.draw(st.integers(0, 3)))
        elif choice == 3:
            self._expect_rejected(self.bt.move_row, row, -1)
        elif choice == 4:
            self._expect_rejected(self.bt.append_row, ([1], [2]), row)  # groups missing
        else:
            upd = StepUpdate.make(
                len(SPECS),
                cleared_rows=[row],
                appended=[
                    RowBlocks.from_lists([row], [bad]),
                    RowBlocks(),
                    RowBlocks(),
                    RowBlocks(),
                ],
            )
            self._expect_rejected(self.bt.apply, upd)

    @rule()
    def commit(self) -> None:
        self.bt.commit()
        self.committed = True
        assert_table_matches(self.bt, self.model, device_too=True)

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def slot_mapping(self, data: st.DataObject) -> None:
        num_reqs = data.draw(st.integers(0, R))
        rows = data.draw(st.permutations(range(R)))[:num_reqs]
        indexed = data.draw(st.booleans())
        if not indexed:
            rows = list(range(num_reqs))
        qsl, pos = [0], []
        for r in rows:
            n = data.draw(st.integers(0, 6))
            top = data.draw(st.integers(n, MAX_POSITION))
            pos.extend(range(top - n, top))
            qsl.append(len(pos))
        qsl_np, pos_np = np.array(qsl, np.int32), np.array(pos, np.int64)
        rows_np = np.array(rows, np.int32)
        dev = self.bt.device
        got = self.bt.compute_slot_mapping(
            torch.from_numpy(qsl_np).to(dev),
            torch.from_numpy(pos_np).to(dev),
            row_of_batch=torch.from_numpy(rows_np).to(dev) if indexed else None,
            query_start_loc_cpu=torch.from_numpy(qsl_np),
        )
        for g in (0, 1):
            table, counts = self.model.dense(g)
            p = self.bt.slot_params[g]
            want = slot_mapping_reference(
                table,
                counts,
                qsl_np,
                pos_np,
                max_num_tokens=MAX_TOKENS,
                kernel_block_size=p.kernel_block_size,
                manager_block_size=p.manager_block_size,
                row_of_batch=rows_np if indexed else None,
            )
            np.testing.assert_array_equal(got[g].cpu().numpy(), want)
        assert got[2] is None and got[3] is None

    @invariant()
    def host_matches_model(self) -> None:
        STEPS[0] += 1
        assert_table_matches(self.bt, self.model)


TableMachine.TestCase.settings = settings(
    max_examples=examples(150),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTableTorch = TableMachine.TestCase


class TritonTableMachine(TableMachine):
    device = TRITON_DEVICE
    backend = "triton"


TritonTableMachine.TestCase.settings = settings(
    max_examples=examples(40),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTableTriton = TritonTableMachine.TestCase
