"""The vectorized batched update and commit staging against a plain-Python model, exactly.

Random step updates (every fast path: decode appends, rows of equal and unequal lengths,
padded and flat writes, kernel-block expansion) and random bad updates, on one-group tables
(the single-call path) and two-group tables (check all, then write).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from blocktable import GroupSpec, MultiGroupBlockTable, RowBlocks, RowEntries, StepUpdate

pytestmark = pytest.mark.usefixtures("compiled_mode")  # compiled, then numpy


def expand(ids: list[int], k: int) -> list[int]:
    return [0 if b == 0 else b * k + q for b in ids for q in range(k)]


class Model:
    """Rows of kernel ids per group, and what the next commit must move."""

    def __init__(self, bt: MultiGroupBlockTable) -> None:
        self.bt = bt
        self.rows = [[[] for _ in range(bt.max_num_reqs)] for _ in bt.specs]
        self.pending = 0
        self.dirty: set[tuple[int, int]] = set()

    def apply(self, upd: StepUpdate) -> None:
        for g, t in enumerate(self.bt.tables):
            k, rows = t.k, self.rows[g]
            for r in dict.fromkeys(int(r) for r in upd.cleared_rows):
                self.pending += len(rows[r])
                rows[r] = []
                self.dirty.add((g, r))
            a = upd.added[g]
            pos = 0
            for r, n in zip(a.rows.tolist(), a.num_manager_blocks.tolist()):
                new = expand(a.block_ids[pos : pos + n].tolist(), k)
                pos += n
                self.pending += max(len(new), len(rows[r]))
                rows[r] = new
                self.dirty.add((g, r))
            p = upd.appended[g]
            pos = 0
            for r, n in zip(p.rows.tolist(), p.num_manager_blocks.tolist()):
                rows[r] = rows[r] + expand(p.block_ids[pos : pos + n].tolist(), k)
                pos += n
                self.pending += n * k
                self.dirty.add((g, r))
            e = upd.nulled[g]
            for r, j in zip(e.rows.tolist(), e.block_indices.tolist()):
                rows[r][j * k : (j + 1) * k] = [0] * k
                self.pending += k
                self.dirty.add((g, r))

    def check(self) -> None:
        for g, t in enumerate(self.bt.tables):
            want = np.zeros_like(t.block_table_np)
            for r, ids in enumerate(self.rows[g]):
                want[r, : len(ids)] = ids
            np.testing.assert_array_equal(t.block_table_np, want)
            np.testing.assert_array_equal(
                t.num_kernel_blocks, [len(ids) for ids in self.rows[g]]
            )


def random_update(bt: MultiGroupBlockTable, model: Model, rng: np.random.Generator,
                  shape: str) -> StepUpdate:
    """A valid update of the given ``shape`` for the table's current state."""
    R = bt.max_num_reqs
    cleared = rng.integers(0, R, rng.integers(0, 3)) if shape == "mixed" else []
    added, appended, nulled = [], [], []
    after = [[len(r) for r in g_rows] for g_rows in model.rows]
    for g, t in enumerate(bt.tables):
        cap = t.width // t.k
        for r in cleared:
            after[g][r] = 0
        if shape == "decode":
            rows = rng.permutation(R)[: rng.integers(1, R + 1)]
            rows = np.array([r for r in rows if after[g][r] // t.k < cap], dtype=np.int32)
            added.append(RowBlocks())
            num = np.ones(len(rows), np.int32)
            ids = rng.integers(0, 1000, len(rows)).astype(np.int32)
            appended.append(RowBlocks(rows, num, ids))
            nulled.append(RowEntries())
            continue
        a_rows = rng.permutation(R)[: rng.integers(0, R + 1)].astype(np.int32)
        if shape == "equal":
            n = int(rng.integers(0, cap + 1))
            a_num = np.full(len(a_rows), n, np.int32)
        elif shape == "skewed":  # one long row, many short: the flat write path
            a_num = np.zeros(len(a_rows), np.int32)
            if len(a_rows):
                a_num[0] = cap
        else:
            a_num = rng.integers(0, cap + 1, len(a_rows)).astype(np.int32)
        for r, n in zip(a_rows, a_num):
            after[g][r] = n * t.k
        added.append(RowBlocks(a_rows, a_num,
                               rng.integers(0, 1000, int(a_num.sum())).astype(np.int32)))
        p_rows = rng.permutation(R)[: rng.integers(0, R + 1)].astype(np.int32)
        p_num = np.array([rng.integers(0, cap - after[g][r] // t.k + 1) for r in p_rows],
                         np.int32)
        for r, n in zip(p_rows, p_num):
            after[g][r] += n * t.k
        appended.append(RowBlocks(p_rows, p_num,
                                  rng.integers(0, 1000, int(p_num.sum())).astype(np.int32)))
        full = [r for r in range(R) if after[g][r]]
        n_rows = rng.choice(full, rng.integers(0, 4)).astype(np.int32) if full else np.zeros(
            0, np.int32)
        n_idx = np.array([rng.integers(0, after[g][r] // t.k) for r in n_rows], np.int32)
        nulled.append(RowEntries(n_rows, n_idx))
    return StepUpdate.make(bt.num_groups, cleared_rows=np.asarray(cleared, np.int32),
                           added=added, appended=appended, nulled=nulled)


def corrupt(upd: StepUpdate, bt: MultiGroupBlockTable, rng: np.random.Generator) -> StepUpdate:
    """The update with one error put in: one more appended entry, or a bad nulled entry."""
    g = int(rng.integers(0, bt.num_groups))
    R, t = bt.max_num_reqs, bt.tables[g]
    kind = rng.choice(["row", "twice", "id", "width", "negative", "null"])
    if kind == "null":
        nulled = list(upd.nulled)
        nulled[g] = RowEntries(np.array([0], np.int32), np.array([t.width], np.int32))
        return StepUpdate(upd.cleared_rows, upd.added, upd.appended, tuple(nulled))
    app = upd.appended[g]
    rows, num, ids = app.rows, app.num_manager_blocks, app.block_ids
    free = [r for r in range(R) if r not in set(rows.tolist())]
    if not free:  # drop the last entry to free its row
        rows, num, ids = rows[:-1], num[:-1], ids[: len(ids) - int(num[-1])]
        free = [int(app.rows[-1])]
    extra_row, extra_ids = free[0], [1]
    if kind == "row":
        extra_row = int(rng.choice([-1, R, R + 5]))
    elif kind == "twice" and len(rows):
        extra_row = int(rows[0])
    elif kind == "id":
        extra_ids = [-3]
    elif kind == "width":
        extra_ids = [1] * (t.width // t.k + 1)
    extra_num = -1 if kind == "negative" else len(extra_ids)
    if kind == "negative":
        extra_ids = []
    appended = list(upd.appended)
    appended[g] = RowBlocks(np.append(rows, extra_row).astype(np.int32),
                            np.append(num, extra_num).astype(np.int32),
                            np.append(ids, extra_ids).astype(np.int32))
    return StepUpdate(upd.cleared_rows, upd.added, tuple(appended), upd.nulled)


TABLES = {
    "one group": lambda: [GroupSpec(16, max_num_blocks=40)],
    "one group, kernel blocks": lambda: [GroupSpec(32, 8, max_num_blocks=48)],
    "two groups": lambda: [GroupSpec(16, max_num_blocks=24), GroupSpec(32, 16, max_num_blocks=30)],
}


@pytest.mark.parametrize("name", list(TABLES))
def test_random_updates_match_model(name: str) -> None:
    rng = np.random.default_rng(len(name))
    bt = MultiGroupBlockTable(TABLES[name](), 12, None, 64, "cpu",
                              commit_staging_entries=4096)
    model = Model(bt)
    for step in range(150):
        shape = ["decode", "decode", "equal", "skewed", "mixed"][step % 5]
        upd = random_update(bt, model, rng, shape)
        if rng.random() < 0.3:
            bad = corrupt(upd, bt, rng)
            before = (bt.storage.host.copy(), bt.storage.dirty_rows.copy(),
                      bt.storage.journal_len.copy())
            with pytest.raises((ValueError, IndexError)):
                bt.apply(bad)
            np.testing.assert_array_equal(bt.storage.host, before[0])
            np.testing.assert_array_equal(bt.storage.dirty_rows, before[1])
            np.testing.assert_array_equal(bt.storage.journal_len, before[2])
        bt.apply(upd)
        model.apply(upd)
        model.check()
        if rng.random() < 0.5:
            stats = bt.commit()
            expected = model.pending + len(model.dirty)
            assert stats.full_copy == (expected > 4096)  # the journal's capacity
            if not stats.full_copy:
                assert stats.num_entries == expected
            assert bt.device_equals_host()
            model.pending, model.dirty = 0, set()
        bt.check_integrity()


@pytest.mark.parametrize("skewed", [False, True])
def test_large_batched_add_matches_per_row(skewed: bool) -> None:
    """Hundreds of rows in one apply equal the same rows written one add_row at a time (rows
    of random lengths: the padded write; one long row among short ones: the flat write)."""
    rng = np.random.default_rng(3)
    a = MultiGroupBlockTable([GroupSpec(16)], 256, 16 * 1024, 64, "cpu")
    b = MultiGroupBlockTable([GroupSpec(16)], 256, 16 * 1024, 64, "cpu")
    for bt in (a, b):  # old contents longer than the new: their tails must become null
        bt.apply(StepUpdate.make(1, added=[RowBlocks(np.arange(256, dtype=np.int32),
                                                     np.full(256, 3, np.int32),
                                                     np.full(768, 5, np.int32))]))
    num = rng.integers(0, 600, 256).astype(np.int32)
    if skewed:
        num = rng.integers(0, 2, 256).astype(np.int32)
        num[7] = 1024
    ids = rng.integers(1, 10**6, int(num.sum())).astype(np.int32)
    a.apply(StepUpdate.make(1, added=[RowBlocks(np.arange(256, dtype=np.int32), num, ids)]))
    starts = np.concatenate([[0], np.cumsum(num)])
    for r in range(256):
        b.add_row((ids[starts[r] : starts[r + 1]],), r)
    np.testing.assert_array_equal(a.storage.host, b.storage.host)


def test_import_needs_no_compiler() -> None:
    """``import blocktable`` and a first step load no JIT compiler (numba)."""
    code = (
        "import sys, numpy as np, blocktable as b\n"
        "t = b.MultiGroupBlockTable([b.GroupSpec(16)], 4, 256, 8, 'cpu')\n"
        "t.apply(b.StepUpdate.make(1, appended=[b.RowBlocks.from_lists([0], [[3]])]))\n"
        "t.commit()\n"
        "assert 'numba' not in sys.modules, 'numba was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("seed", range(4))
def test_runs_and_sums_match_python_on_both_sides_of_the_few_threshold(seed: int) -> None:
    """``runs_into`` (a Python loop for a few short runs, the vectorized ``runs`` past them)
    and ``small_sum`` equal a plain-Python model, for sizes around the switch."""
    from blocktable._host_loops import runs, runs_into, small_sum

    rng = np.random.default_rng(seed)
    for _ in range(200):
        n = int(rng.integers(0, 40))
        starts = rng.integers(0, 10_000, n).astype(np.int32)
        lengths = rng.integers(0, int(rng.choice([2, 9, 40])), n).astype(np.int32)
        expected = [s + j for s, k in zip(starts.tolist(), lengths.tolist()) for j in range(k)]
        out = np.full(len(expected) + 2, -7, dtype=np.int32)
        runs_into(out[1:-1], starts, lengths)
        assert out.tolist() == [-7, *expected, -7]
        assert runs(starts, lengths, len(expected)).tolist() == expected
        assert small_sum(lengths) == sum(lengths.tolist())
        assert type(small_sum(lengths)) is int
