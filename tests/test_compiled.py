# ruff: noqa: B023  (each lambda is called at once, inside its loop iteration)
"""The compiled step loops (``blocktable._compiled``): equal to their numpy twins on random
inputs, and memory-safe on hostile ones.

Every compiled function and method is called with arrays of the wrong kind but the same item
size (float32 for int32, uint32, float64 and uint64 for int64), object arrays, byte-swapped,
strided, read-only outputs, 0-d and 2-D arrays, outputs that alias an input, and negative and
huge sizes, offsets, rows and ids. Each must raise ``TypeError`` or ``ValueError`` (or return
its documented refusal) and leave every array exactly as it was.
"""

from __future__ import annotations

from dataclasses import astuple

import numpy as np
import pytest

from blocktable import _compiled_loader
from blocktable import _host_loops as loops
from blocktable.block_hashing import (
    ChainPowers,
    block_content_hashes,
    chain_keys,
    fast_block_keys,
    namespace_seed,
    token_chain_keys,
)
from blocktable.slot_mapping.torch_impl import slot_mapping_numpy
from blocktable.update import RowBlocks, RowEntries, StepUpdate

compiled = pytest.importorskip("blocktable._compiled", reason="the compiled part is not built")

I32, I64 = np.int32, np.int64


def hostile_variants(arr: np.ndarray) -> list[tuple[str, object]]:
    """Arrays that a typed memoryview of ``arr``'s dtype must refuse."""
    out: list[tuple[str, object]] = []
    # (uint8 flag arrays also take bool, whose bytes are 0 or 1 as well)
    same_size = {np.dtype(I32): (np.float32, np.uint32), np.dtype(I64): (np.float64, np.uint64),
                 np.dtype(np.uint64): (np.float64, np.int64),
                 np.dtype(np.uint8): (np.int8,)}.get(arr.dtype, ())
    for dt in same_size:
        out.append((f"as {np.dtype(dt).name}", arr.view(dt)))
    out.append(("object", np.array(list(arr.ravel()) or [0], dtype=object)))
    if arr.dtype.itemsize > 1:
        out.append(("byte-swapped", arr.astype(arr.dtype.newbyteorder())))
    if arr.ndim == 1 and len(arr) > 1:
        out.append(("strided", np.repeat(arr, 2)[::2]))
    out.append(("0-d", np.array(arr.ravel()[0] if arr.size else 0, dtype=arr.dtype)))
    if arr.ndim == 1:
        out.append(("2-D", arr.reshape(1, -1)))
    out.append(("list", arr.tolist()))
    out.append(("None", None))
    return out


def read_only(arr: np.ndarray) -> np.ndarray:
    out = arr.copy()
    out.flags.writeable = False
    return out


def snapshot(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [a.copy() for a in arrays]


def unchanged(before: list[np.ndarray], after: list[np.ndarray]) -> None:
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


# ---- a small table: 4 rows x width 6, k = 2 ---------------------------------------------
ROWS, WIDTH, K, MAX_ID = 4, 6, 2, 50


class Group:
    """A group's arrays as a table binds them, and the writer over them."""

    def __init__(self, capacity: int = 64) -> None:
        self.table = np.zeros(ROWS * WIDTH, I32)
        self.counts = np.zeros(ROWS, I32)
        self.scratch = np.zeros(ROWS, I64)
        self.seen = np.zeros(ROWS, np.uint8)
        self.dirty = np.zeros(ROWS, np.uint8)
        self.journal = np.zeros((capacity, 2), I64)
        self.journal_len = np.zeros(2, I64)

    def arrays(self) -> list[np.ndarray]:
        return [self.table, self.counts, self.scratch, self.seen, self.dirty, self.journal,
                self.journal_len]

    def visible(self) -> list[np.ndarray]:
        """The arrays a refused call must leave as they were (all but the work space)."""
        return [a for a in self.arrays() if a is not self.scratch]

    def writer(self):
        return compiled.GroupWriter(self.table, self.counts, WIDTH, K, MAX_ID, 0, self.scratch,
                                    self.seen, self.dirty, self.journal, self.journal_len)

    def numpy_apply(self, parts: list[np.ndarray]) -> tuple:
        return loops.check_and_write_group_update(
            self.table, self.counts, WIDTH, K, MAX_ID, 0, *parts, self.scratch,
            self.seen.view(bool), self.dirty.view(bool), self.journal, self.journal_len)


def random_parts(rng: np.random.Generator, counts: np.ndarray, valid: bool) -> list[np.ndarray]:
    """An update's nine arrays for one group: usually valid, sometimes not (when ``valid`` is
    False: a repeated row, a row or id out of range, a wrong count, a null past the row)."""
    rows = rng.permutation(ROWS).astype(I32)
    n_add, n_app = int(rng.integers(0, 3)), int(rng.integers(0, 3))
    add_rows = rows[:n_add]
    app_rows = rows[n_add : n_add + n_app]
    add_num = rng.integers(0, WIDTH // K + 1, n_add).astype(I32)
    room = (WIDTH - counts[app_rows]) // K
    app_num = np.array([rng.integers(0, r + 1) for r in room], I32)
    add_ids = rng.integers(0, MAX_ID, int(add_num.sum())).astype(I32)
    app_ids = rng.integers(0, MAX_ID, int(app_num.sum())).astype(I32)
    cleared = rng.choice(ROWS, int(rng.integers(0, 3))).astype(I32)
    null_rows = np.zeros(0, I32)
    null_blocks = np.zeros(0, I32)
    filled = [r for r in range(ROWS) if counts[r] >= K and r not in cleared and r not in add_rows]
    if filled and rng.random() < 0.5:
        r = int(rng.choice(filled))
        null_rows = np.array([r], I32)
        null_blocks = np.array([rng.integers(0, counts[r] // K)], I32)
    parts = [cleared, add_rows, add_num, add_ids, app_rows, app_num, app_ids, null_rows,
             null_blocks]
    if not valid:
        which = int(rng.integers(0, 6))
        if which == 0 and len(add_rows):
            parts[1] = np.concatenate([add_rows, add_rows[:1]])
            parts[2] = np.concatenate([add_num, add_num[:1]])
            parts[3] = np.concatenate([add_ids, add_ids[: int(add_num[0])]])
        elif which == 1:
            parts[0] = np.array([ROWS + int(rng.integers(0, 3))], I32)
        elif which == 2 and len(app_ids):
            parts[6] = app_ids.copy()
            parts[6][0] = MAX_ID + int(rng.integers(0, 5))
        elif which == 3:
            parts[2] = add_num + 1 if n_add else np.zeros(0, I32)
        elif which == 4 and len(app_rows):
            parts[5] = app_num + WIDTH
            parts[6] = rng.integers(0, MAX_ID, int(parts[5].sum())).astype(I32)
        else:
            parts[7] = np.array([int(rng.integers(0, ROWS))], I32)
            parts[8] = np.array([WIDTH], I32)
    return [np.ascontiguousarray(p, I32) for p in parts]


@pytest.mark.parametrize("seed", range(4))
def test_group_writer_equals_the_numpy_update(seed: int) -> None:
    """Random updates, valid and not: the same result tuple, table, counts, dirty rows and
    journal as the numpy twin, step after step."""
    rng = np.random.default_rng(seed)
    a, b = Group(capacity=40), Group(capacity=40)
    writer = a.writer()
    shared_empty = np.zeros(0, I32)  # as the allocator's updates hold their empty parts
    refused = 0
    for step in range(300):
        parts = random_parts(rng, a.counts, valid=rng.random() < 0.7)
        if rng.random() < 0.5:
            parts = [p if len(p) else shared_empty for p in parts]
        got = writer.apply(*parts)
        want = b.numpy_apply([p.copy() for p in parts])
        assert tuple(int(x) for x in got) == tuple(int(x) for x in want), (step, parts)
        refused += got[0] != 0
        for x, y in zip(a.arrays()[:-2], b.arrays()[:-2]):
            if x is not a.scratch:  # (work space: its contents are the implementation's)
                np.testing.assert_array_equal(x, y)
        # the same runs journaled (their order is the implementation's: rows cleared in one
        # update are journaled in listing order here, sorted by numpy)
        assert a.journal_len[0] == b.journal_len[0]
        runs = int(a.journal_len[0])  # (-1: overflowed, the commit copies row spans)
        if runs >= 0:
            assert a.journal_len[1] == b.journal_len[1]
        assert sorted(map(tuple, a.journal[: max(runs, 0)].tolist())) == sorted(
            map(tuple, b.journal[: max(runs, 0)].tolist()))
        if rng.random() < 0.2:  # a commit drains the journal
            for g in (a, b):
                g.journal_len[:] = 0
                g.dirty[:] = 0
    assert 30 < refused < 270


def test_fill_staging_equals_numpy() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        host = rng.integers(0, 1000, 64).astype(I32)
        runs = int(rng.integers(0, 6))
        journal = np.zeros((16, 2), I64)
        starts = rng.integers(0, 40, runs)
        lengths = rng.integers(1, 5, runs)
        journal[:runs, 0], journal[:runs, 1] = starts, lengths
        jlen = np.array([runs, lengths.sum()], I64)
        if rng.random() < 0.1:
            jlen[0] = -1  # an overflowed journal
        dirty = rng.random(8) < 0.3
        capacity = int(rng.integers(0, 24))
        results = []
        for use_compiled in (True, False):
            j, jl, d = journal.copy(), jlen.copy(), dirty.copy()
            staging = np.full(1 + 2 * capacity, 7, I32)
            if use_compiled:
                stager = compiled.PairStager(j, jl, d.view(np.uint8), 48, host)
                n = stager.fill(staging, capacity)
            else:
                n = loops.fill_staging(j, jl, d.reshape(1, -1), 48, host, staging, capacity)
            if n >= 0:
                assert staging[0] == n
            results.append((n, staging.tolist(), jl.tolist(), d.tolist()))
        assert results[0] == results[1]


def slot_case(rng: np.random.Generator, cp_world: int):
    """A flat table of one group (rows of random counts), a batch and the mapper's layout."""
    rows, width, kbs, mbs = 5, 8, 2, 4
    interleave = int(rng.choice([1, 2, 4]))
    counts = rng.integers(0, width + 1, rows).astype(I32)
    table = np.zeros(rows * width, I32)
    for r in range(rows):
        table[r * width : r * width + counts[r]] = rng.integers(0, 30, counts[r])
    flat = np.concatenate([table, counts]).astype(I32)
    layout = (0, width, rows * width, kbs, mbs, cp_world, int(rng.integers(0, cp_world)),
              interleave)
    num_reqs = int(rng.integers(0, 7))
    per_req = rng.integers(0, 4, num_reqs)
    qsl = np.concatenate([[0], np.cumsum(per_req)]).astype(I32)
    positions = rng.integers(-3, width * kbs * cp_world + 5, int(qsl[-1])).astype(I64)
    row_of_batch = None if rng.random() < 0.3 else rng.integers(-1, rows + 1, num_reqs).astype(I32)
    return flat, layout, rows, qsl, positions, row_of_batch


@pytest.mark.parametrize("cp_world", [1, 2, 3])
def test_slot_mapper_equals_numpy(cp_world: int) -> None:
    """Random tables and batches (rows out of range, negative positions, positions past the
    row, context parallelism): the same slots as the numpy function."""
    from blocktable.slot_mapping.params import SlotGroupParams

    rng = np.random.default_rng(cp_world)
    for _ in range(300):
        flat, layout, rows, qsl, positions, row_of_batch = slot_case(rng, cp_world)
        got = np.full((1, 24), 99, I64)
        want = got.copy()
        mapper = compiled.SlotMapper(flat, got, [layout], rows)
        assert mapper.map(qsl, positions, row_of_batch) == 0
        params = [SlotGroupParams(*layout[:5], layout[5], layout[6], layout[7])]
        slot_mapping_numpy(flat, params, qsl, positions, row_of_batch, want, rows)
        np.testing.assert_array_equal(got, want)


def test_slot_mapper_pads_the_tail_of_every_map_in_a_sequence() -> None:
    """One mapper and one buffer over a sequence of batches that grow and shrink (it rewrites
    only the tail its previous map filled), with other writes of the buffer between some of
    them (followed by ``mark_written``): after each map the whole buffer equals the numpy
    function's on a fresh buffer."""
    from blocktable.slot_mapping.params import SlotGroupParams

    rng = np.random.default_rng(7)
    flat, layout, rows, _, _, _ = slot_case(rng, 1)
    params = [SlotGroupParams(*layout[:5], layout[5], layout[6], layout[7])]
    got = np.full((1, 24), 99, I64)
    mapper = compiled.SlotMapper(flat, got, [layout], rows)
    for _ in range(200):
        if rng.random() < 0.1:
            got[0, rng.integers(0, 24, 3)] = 5  # another writer, which says so
            mapper.mark_written()
        num_reqs = int(rng.integers(0, 7))
        qsl = np.concatenate([[0], np.cumsum(rng.integers(0, 5, num_reqs))]).astype(I32)
        positions = rng.integers(0, layout[1] * layout[3], int(qsl[-1])).astype(I64)
        row_of_batch = rng.integers(0, rows, num_reqs).astype(I32)
        want = np.full((1, 24), 99, I64)
        slot_mapping_numpy(flat, params, qsl, positions, row_of_batch, want, rows)
        assert mapper.map(qsl, positions, row_of_batch) == 0
        np.testing.assert_array_equal(got, want)


def test_malformed_batches_are_left_to_numpy_with_nothing_written() -> None:
    flat = np.zeros(5 * 8 + 5, I32)
    out = np.full((1, 8), 5, I64)
    mapper = compiled.SlotMapper(flat, out, [(0, 8, 40, 2, 4, 1, 0, 1)], 5)
    for qsl, pos in ((np.array([1, 2], I32), np.zeros(1, I64)),  # does not start at 0
                     (np.array([0, 2, 1], I32), np.zeros(1, I64)),  # decreases
                     (np.array([0, 2], I32), np.zeros(3, I64))):  # does not end at num_tokens
        assert mapper.map(qsl, pos, None) == -1
        assert (out == 5).all()

def check_batch(qsl: list[int], rows: list[int], num_reqs: int, num_tokens: int) -> int:
    """The bound batch check of a staging buffer holding ``qsl`` and ``rows`` (4 table rows)."""
    return compiled.BatchChecker(np.array(qsl, I32), np.array(rows, I32), 4).check(num_reqs,
                                                                                  num_tokens)


def test_batch_checker_reads_only_the_batch() -> None:
    assert check_batch([0, 2, 1], [0, 0], 2, 1) == -1  # decreases
    assert check_batch([1, 2, 2], [0, 0], 2, 2) == -1  # does not start at 0
    assert check_batch([0, 1, 2], [0, 4], 2, 2) == -1  # a row past the table
    assert check_batch([0, 1, 2], [0, -1], 2, 2) == -1  # a negative row
    assert check_batch([0, 1, 2], [0, 3], 2, 2) == 1  # one token per request
    assert check_batch([0, 2, 2], [3, 0], 2, 2) == 0
    # only the batch's first entries count: past them, anything
    assert check_batch([0, 1, -5], [0, 9], 1, 1) == 1
    assert check_batch([0, 0, 0], [9, 9], 0, 0) == 1  # no request
    assert check_batch([0, 0, 0], [9, 9], 0, 1) == -1  # no request, but a token
    for num_reqs in (-1, 3, 2**40, -2**40):  # outside the capacity: refused, nothing read
        assert check_batch([0, 1, 2], [0, 1], num_reqs, 2) == -1


def test_batch_checker_equals_numpy() -> None:
    """Random batches (decreasing, rows out of range): the compiled check accepts exactly what
    the step's numpy check accepts."""
    from blocktable.step.runner import _check_batch_values

    rng = np.random.default_rng(5)
    for _ in range(300):
        capacity = int(rng.integers(1, 7))
        qsl = np.sort(rng.integers(0, 9, capacity + 1)).astype(I32)
        qsl[0] = 0 if rng.random() < 0.9 else 1
        if rng.random() < 0.2:
            qsl = rng.permutation(qsl)
        rows = rng.integers(-1, 6, capacity).astype(I32)
        num_reqs = int(rng.integers(0, capacity + 1))
        num_tokens = int(qsl[num_reqs]) if rng.random() < 0.9 else int(rng.integers(0, 9))
        code = compiled.BatchChecker(qsl, rows, 5).check(num_reqs, num_tokens)
        try:
            _check_batch_values(qsl[: num_reqs + 1], rows[:num_reqs], num_tokens, 5)
        except (ValueError, IndexError):
            assert code == -1
        else:
            decode = num_tokens == num_reqs and (qsl[: num_reqs + 1] == np.arange(num_reqs + 1)).all()
            assert code == (1 if decode else 0)


# ---- the hostile fuzz --------------------------------------------------------------------
def _refused(call, arrays: list[np.ndarray], *, refusal: int | None = None) -> None:
    """``call`` raises ``TypeError``/``ValueError`` (or returns ``refusal``, its documented
    answer for that input), and ``arrays`` are as they were."""
    before = snapshot(arrays)
    try:
        got = call()
    except (TypeError, ValueError):
        pass
    else:
        assert refusal is not None and got == refusal, f"accepted, returning {got!r}"
    unchanged(before, arrays)


def test_group_writer_takes_one_shared_empty_array_and_checks_every_other() -> None:
    """The empty parts of an update as one shared empty array, taken again and again; every
    other array, an empty one of the wrong kind included, is still taken and checked."""
    g = Group()
    writer = g.writer()
    empty = np.zeros(0, I32)
    empty.flags.writeable = False
    assert writer.apply(*[empty] * 9)[0] == 0
    one = np.array([1], I32)
    append = [empty, empty, empty, empty, one, one, np.array([7], I32), empty, empty]
    assert writer.apply(*append)[0] == 0
    assert g.counts[1] == K and g.table[WIDTH : WIDTH + K].tolist() == [14, 15]
    for label, bad in hostile_variants(np.zeros(0, I32)):
        for i in range(9):
            parts: list[object] = [empty] * 9
            parts[i] = bad
            with pytest.raises(TypeError):
                writer.apply(*parts)
    assert writer.apply(*append)[0] == 0 and g.counts[1] == 2 * K  # still the same writer


def test_group_writer_reads_int32_array_heads_as_they_are_now() -> None:
    """Native int32 numpy arrays are read through their heads (checked against numpy at
    binding), which say what the array is at the call: one whose dtype or shape was reassigned
    in place is refused as any such array is, and so is a misaligned one; a subclass takes the
    buffer protocol, with the same result."""
    assert compiled.array_heads_trusted()
    empty = [np.zeros(0, I32)] * 4

    def append(rows: object, num: object, ids: object) -> tuple:
        g = Group()
        got = g.writer().apply(*empty, rows, num, ids, *empty[:2])
        return got, g.table.tolist(), g.counts.tolist()

    want = append(np.array([1, 3], I32), np.array([1, 2], I32), np.array([7, 8, 9], I32))
    assert want[0][0] == 0
    floats = np.array([1, 3], I32)
    floats.dtype = np.float32  # (the same bytes, another dtype)
    wide = np.array([1, 3, 0, 0], I32)
    wide.shape = (2, 2)
    for bad in (floats, wide):
        g = Group()
        writer = g.writer()
        _refused(lambda: writer.apply(*empty, bad, np.array([1, 2], I32),
                                      np.array([7, 8, 9], I32), *empty[:2]), g.visible())
    raw = bytearray(4 * 3 + 1)
    misaligned = np.frombuffer(raw, I32, 3, 1)
    misaligned[:] = [7, 8, 9]
    assert not misaligned.flags.aligned

    class Sub(np.ndarray):
        pass

    g = Group()
    writer = g.writer()
    _refused(lambda: writer.apply(*empty, np.array([1, 3], I32), np.array([1, 2], I32),
                                  misaligned, *empty[:2]), g.visible())
    assert append(np.array([1, 3], I32).view(Sub), np.array([1, 2], I32),
                  np.array([7, 8, 9], I32)) == want


def test_group_writer_refuses_hostile_bound_arrays() -> None:
    g = Group()
    names = ["table", "counts", "scratch", "seen", "dirty", "journal", "journal_len"]
    for i, name in enumerate(names):
        for label, bad in hostile_variants(getattr(g, name)) + [("read-only",
                                                                 read_only(getattr(g, name)))]:
            args = g.arrays()
            args[i] = bad
            table, counts, scratch, seen, dirty, journal, journal_len = args
            _refused(lambda: compiled.GroupWriter(table, counts, WIDTH, K, MAX_ID, 0, scratch,
                                                  seen, dirty, journal, journal_len),
                     g.visible())
    for width, k, max_id, offset in ((0, 1, 5, 0), (WIDTH, 0, 5, 0), (WIDTH, WIDTH + 1, 5, 0),
                                     (-6, K, 5, 0), (WIDTH, K, -1, 0), (WIDTH, K, 2**40, 0),
                                     (WIDTH, K, 5, -1), (WIDTH, K, 5, 2**40), (2**40, K, 5, 0),
                                     (WIDTH + 1, K, 5, 0)):
        _refused(lambda: compiled.GroupWriter(g.table, g.counts, width, k, max_id, offset,
                                              g.scratch, g.seen, g.dirty, g.journal,
                                              g.journal_len), g.visible())
    # a width that is not a multiple of k (a table sized for it): a nulled block could end
    # past its row
    odd = np.zeros(ROWS * (WIDTH + 1), I32)
    _refused(lambda: compiled.GroupWriter(odd, g.counts, WIDTH + 1, K, MAX_ID, 0, g.scratch,
                                          g.seen, g.dirty, g.journal, g.journal_len),
             g.visible() + [odd])
    # outputs that alias each other: counts inside the table, dirty inside seen
    _refused(lambda: compiled.GroupWriter(g.table, g.table[:ROWS], WIDTH, K, MAX_ID, 0,
                                          g.scratch, g.seen, g.dirty, g.journal, g.journal_len),
             g.visible())
    _refused(lambda: compiled.GroupWriter(g.table, g.counts, WIDTH, K, MAX_ID, 0, g.scratch,
                                          g.seen, g.seen, g.journal, g.journal_len), g.visible())


def test_group_writer_refuses_hostile_updates_with_nothing_written() -> None:
    g = Group()
    writer = g.writer()
    assert writer.apply(np.zeros(0, I32), np.array([1], I32), np.array([2], I32),
                        np.array([5, 6], I32), *[np.zeros(0, I32)] * 5)[0] == 0
    base = [np.zeros(0, I32)] * 9
    for i in range(9):
        for label, bad in hostile_variants(np.array([1, 2], I32)):
            parts = list(base)
            parts[i] = bad
            _refused(lambda: writer.apply(*parts), g.visible())
    # an update array that aliases the writer's own arrays
    for alias in (g.counts, g.table[:2]):
        parts = list(base)
        parts[0] = alias
        _refused(lambda: writer.apply(*parts), g.visible())
    # lengths that disagree
    _refused(lambda: writer.apply(np.zeros(0, I32), np.array([1], I32), np.zeros(0, I32),
                                  *[np.zeros(0, I32)] * 6), g.visible())
    # refusals by value: the result names them, nothing is written
    huge = np.iinfo(I32)
    for parts in ([np.array([huge.max], I32)] + base[1:],
                  [np.array([huge.min], I32)] + base[1:],
                  base[:1] + [np.array([0], I32), np.array([huge.max], I32),
                              np.array([1], I32)] + base[4:],
                  base[:4] + [np.array([0], I32), np.array([1], I32),
                              np.array([huge.min], I32)] + base[7:],
                  base[:7] + [np.array([1], I32), np.array([huge.max], I32)]):
        before = snapshot(g.visible())
        assert writer.apply(*parts)[0] != 0
        unchanged(before, g.visible())
    # a corrupt count in the table is refused before any write
    g.counts[3] = WIDTH + 5
    before = snapshot(g.visible())
    with pytest.raises(ValueError, match="corrupt"):
        writer.apply(*[np.zeros(0, I32)] * 7, np.array([3], I32), np.array([0], I32))
    unchanged(before, g.visible())


def test_slot_mapper_refuses_hostile_arguments() -> None:
    flat = np.zeros(5 * 8 + 5, I32)
    out = np.full((1, 8), 5, I64)
    good = (0, 8, 40, 2, 4, 1, 0, 1)
    for label, bad in hostile_variants(flat):
        _refused(lambda: compiled.SlotMapper(bad, out, [good], 5), [flat, out])
    for label, bad in hostile_variants(out) + [("read-only", read_only(out)),
                                              ("1-D", out[0])]:
        _refused(lambda: compiled.SlotMapper(flat, bad, [good], 5), [flat, out])
    for layout in ((-1, 8, 40, 2, 4, 1, 0, 1), (0, 0, 40, 2, 4, 1, 0, 1),
                   (0, 8, 41, 2, 4, 1, 0, 1), (0, 10, 40, 2, 4, 1, 0, 1),
                   (0, 8, 40, 0, 4, 1, 0, 1), (0, 8, 40, 3, 4, 1, 0, 1),
                   (0, 8, 40, 2, 4, 2, 2, 1), (0, 8, 40, 2, 4, 0, 0, 1),
                   (0, 8, 40, 2, 4, 2, 0, 0), (0, 8, 40, 2, 4, 2, 0, 5),
                   (0, 2**40, 40, 2, 4, 1, 0, 1), (2**62, 8, 40, 2, 4, 1, 0, 1),
                   (0, 8, 40, 2, 4, 1, 0), ("a", 8, 40, 2, 4, 1, 0, 1)):
        with pytest.raises((TypeError, ValueError)):
            compiled.SlotMapper(flat, out, [layout], 5)
    for rows in (-1, 6, 2**40):
        _refused(lambda: compiled.SlotMapper(flat, out, [good], rows), [flat, out])
    _refused(lambda: compiled.SlotMapper(flat, out, [good, good], 5), [flat, out])
    # output overlapping the table
    shared = np.zeros(200, I64)
    _refused(lambda: compiled.SlotMapper(shared.view(I32)[200:245], shared[100:].reshape(1, 100),
                                         [good], 5), [shared])

    mapper = compiled.SlotMapper(flat, out, [good], 5)
    qsl, pos = np.array([0, 2], I32), np.array([1, 2], I64)
    for label, bad in hostile_variants(qsl):
        _refused(lambda: mapper.map(bad, pos, None), [flat, out])
    for label, bad in hostile_variants(pos):
        _refused(lambda: mapper.map(qsl, bad, None), [flat, out])
    for label, bad in hostile_variants(np.array([0], I32)):
        if bad is not None:  # (None: request r reads row r, as documented)
            _refused(lambda: mapper.map(qsl, pos, bad), [flat, out])
    _refused(lambda: mapper.map(qsl, pos, np.array([0, 1], I32)), [flat, out])  # 2 rows, 1 req
    _refused(lambda: mapper.map(np.zeros(0, I32), np.zeros(0, I64), None), [flat, out])
    _refused(lambda: mapper.map(np.array([0, 9], I32), np.zeros(9, I64), None), [flat, out])
    # inputs that alias the output
    _refused(lambda: mapper.map(qsl, out[0, :2], None), [flat, out])
    _refused(lambda: mapper.map(out[0].view(I32)[:2] * 0 + qsl, pos, out[0].view(I32)[:1]),
             [flat, out])
    # huge and negative rows and positions are mapped to PAD, never read
    assert mapper.map(np.array([0, 1, 2, 3], I32), np.array([2**62, -2**62, 3], I64),
                      np.array([2**31 - 1, -2**31, 4], I32)) == 0
    assert out[0].tolist() == [-1] * 8


def test_batch_checker_and_pair_stager_refuse_hostile_arguments() -> None:
    qsl, rows = np.array([0, 1, 2], I32), np.array([0, 1], I32)
    for label, bad in hostile_variants(qsl):
        with pytest.raises(TypeError):
            compiled.BatchChecker(bad, rows, 4)
    for label, bad in hostile_variants(rows):
        with pytest.raises(TypeError):
            compiled.BatchChecker(qsl, bad, 4)
    for bad_qsl, bad_rows, num_rows in ((qsl, rows[:1], 4), (qsl[:2], rows, 4), (qsl, rows, -1)):
        with pytest.raises(ValueError):
            compiled.BatchChecker(bad_qsl, bad_rows, num_rows)
    journal, jlen = np.array([[0, 2], [0, 0]], I64), np.array([1, 2], I64)
    dirty, host = np.array([1, 0], np.uint8), np.arange(10, dtype=I32)
    staging = np.zeros(9, I32)
    arrays = [journal, jlen, dirty, host, staging]

    def args() -> list:
        return [journal, jlen, dirty, 8, host]

    for i in (0, 1, 2, 4):  # the bound arrays
        variants = hostile_variants(args()[i])
        if i in (1, 2):
            variants.append(("read-only", read_only(args()[i])))
        for label, bad in variants:
            a = args()
            a[i] = bad
            _refused(lambda: compiled.PairStager(*a), arrays)
    for counts_offset in (-1, 9, 2**40, -2**40):
        _refused(lambda: compiled.PairStager(journal, jlen, dirty, counts_offset, host), arrays)
    # bound arrays that overlap: dirty inside the host buffer, journal_len inside the journal
    _refused(lambda: compiled.PairStager(journal, jlen, host[:2].view(np.uint8), 8, host), arrays)
    _refused(lambda: compiled.PairStager(journal, journal.reshape(-1)[:2], dirty, 8, host),
             arrays)
    stager = compiled.PairStager(journal, jlen, dirty, 8, host)
    for label, bad in [*hostile_variants(staging), ("read-only", read_only(staging))]:
        _refused(lambda: stager.fill(bad, 4), arrays)
    for capacity in (5, -1, 2**40, 2**62, 2**63 - 1, -2**40):
        _refused(lambda: stager.fill(staging, capacity), arrays)
    _refused(lambda: stager.fill(staging[:8], 4), arrays)  # no room for the header
    _refused(lambda: stager.fill(staging[:0], 0), arrays)
    # staging that aliases a bound array
    _refused(lambda: stager.fill(host[:9], 4), arrays)
    _refused(lambda: stager.fill(jlen.view(I32), 1), arrays)
    for bad_run in ([[-1, 2]], [[9, 2]], [[0, -1]], [[0, 2**40]], [[2**62, 2]]):
        j = np.array(bad_run + [[0, 0]], I64)
        jl = np.array([1, bad_run[0][1]], I64)
        _refused(lambda: compiled.PairStager(j, jl, dirty, 8, host).fill(staging, 4),
                 [*arrays, j, jl], refusal=-1)
    for bad_len in ([3, 2], [1, 3], [1, -1]):  # more runs than the journal; lengths disagree
        jlen[:] = bad_len
        _refused(lambda: stager.fill(staging, 4), arrays)
    jlen[:] = [1, 2]
    assert stager.fill(staging, 4) == 3  # the valid call still works: 2 entries and a count
    assert staging[:7].tolist() == [3, 0, 1, 8, 0, 1, 8]


class StagedGroup(Group):
    """A one-group table as the table binds it: the rows and counts in one host buffer, a
    writer and a pair stager over the same journal, the writer bound to the stager."""

    def __init__(self, capacity: int = 64) -> None:
        super().__init__(capacity)
        self.host = np.zeros(ROWS * WIDTH + ROWS, I32)
        self.table, self.counts = self.host[: ROWS * WIDTH], self.host[ROWS * WIDTH :]

    def arrays(self) -> list[np.ndarray]:
        return [self.host, self.scratch, self.seen, self.dirty, self.journal, self.journal_len]

    def stager(self):
        return compiled.PairStager(self.journal, self.journal_len, self.dirty, ROWS * WIDTH,
                                   self.host)

    def bound_writer(self):
        writer = self.writer()
        writer.bind_stager(self.stager())
        return writer

    def numpy_apply_and_stage(self, parts: list[np.ndarray], staging: np.ndarray,
                              capacity: int) -> int:
        """The two numpy twins, one after the other: the writer's answer."""
        if self.numpy_apply(parts)[0] != 0:
            return -2
        return loops.fill_staging(self.journal, self.journal_len, self.dirty.view(bool),
                                  ROWS * WIDTH, self.host, staging, capacity)


def one_group_update(parts: list[object]) -> StepUpdate:
    """An update of one group holding the nine arrays of ``parts`` (as ``random_parts``)."""
    return StepUpdate(parts[0], (RowBlocks(*parts[1:4]),), (RowBlocks(*parts[4:7]),),
                      (RowEntries(*parts[7:9]),))


@pytest.mark.parametrize("seed", range(3))
def test_apply_and_stage_equals_the_numpy_update_then_fill(seed: int) -> None:
    """Random updates, valid and not, staged into buffers of random capacity: the same answer,
    host table, dirty rows, journal and staging as the numpy update followed by the numpy
    fill."""
    rng = np.random.default_rng(100 + seed)
    a, b = StagedGroup(capacity=40), StagedGroup(capacity=40)
    writer = a.bound_writer()
    stagings = [np.full(1 + 2 * 40, 7, I32), np.full(1 + 2 * 40, 7, I32)]  # as a step's two
    answers = []
    for step in range(300):
        parts = random_parts(rng, a.counts, valid=rng.random() < 0.7)
        capacity = int(rng.choice([0, 3, 12, 40]))
        staging = stagings[step % 2]
        want_staging = staging.copy()
        got = writer.apply_and_stage(one_group_update(parts), staging, capacity)
        want = b.numpy_apply_and_stage([p.copy() for p in parts], want_staging, capacity)
        assert got == want, (step, parts)
        answers.append(got)
        if got >= 0:  # the same pairs (in the journal's order, which is the implementation's)
            assert staging[0] == want_staging[0] == got
            assert sorted(zip(staging[1 : 1 + got], staging[1 + got : 1 + 2 * got])) == \
                sorted(zip(want_staging[1 : 1 + got], want_staging[1 + got : 1 + 2 * got]))
        else:  # nothing staged
            np.testing.assert_array_equal(staging, want_staging)
        for x, y in ((a.host, b.host), (a.dirty, b.dirty)):
            np.testing.assert_array_equal(x, y)
        assert a.journal_len[0] == b.journal_len[0]
        runs = int(a.journal_len[0])  # (-1: overflowed, the commit copies row spans)
        if runs >= 0:
            assert a.journal_len[1] == b.journal_len[1]
        runs = max(runs, 0)
        assert sorted(map(tuple, a.journal[:runs].tolist())) == sorted(
            map(tuple, b.journal[:runs].tolist()))
        if got == -1 and rng.random() < 0.5:  # the table's commit drains what did not fit
            for g in (a, b):
                g.journal_len[:] = 0
                g.dirty[:] = 0
    assert {-2, -1} <= set(answers) and max(answers) > 0


def test_apply_and_stage_refuses_hostile_arguments_with_nothing_written() -> None:
    g = StagedGroup()
    staging = np.zeros(1 + 2 * 16, I32)
    visible = [a for a in g.arrays() if a is not g.scratch] + [staging]
    empty = [np.zeros(0, I32)] * 9
    append = one_group_update([*empty[:4], np.array([1], I32), np.array([1], I32),
                               np.array([7], I32), *empty[7:]])
    _refused(lambda: g.writer().apply_and_stage(append, staging, 16), visible)  # unbound
    other = StagedGroup()  # a stager draining another journal
    with pytest.raises(ValueError):
        g.writer().bind_stager(other.stager())
    with pytest.raises(TypeError):
        g.writer().bind_stager(None)
    writer = g.bound_writer()
    for label, bad in [*hostile_variants(staging), ("read-only", read_only(staging))]:
        _refused(lambda: writer.apply_and_stage(append, bad, 16), visible)
    for capacity in (17, -1, 2**40, 2**62, 2**63 - 1, -2**40):
        _refused(lambda: writer.apply_and_stage(append, staging, capacity), visible)
    _refused(lambda: writer.apply_and_stage(append, staging[:0], 0), visible)
    # staging over the table's own arrays: the host's rows or counts, the journal
    for alias in (g.host[:9], g.counts, g.journal.reshape(-1).view(I32)[:9]):
        _refused(lambda: writer.apply_and_stage(append, alias, 4), visible)
    # update arrays of every hostile kind, over the staging or over the table: refused (-2)
    # or raised, nothing written
    for i in range(9):
        for label, bad in hostile_variants(np.array([1, 2], I32)) + [
                ("staging", staging[1:3]), ("host", g.host[:2]), ("counts", g.counts[:2])]:
            parts: list[object] = list(empty)
            parts[i] = bad
            _refused(lambda: writer.apply_and_stage(one_group_update(parts), staging, 16),
                     visible, refusal=-2)
    # not one group's update: two groups, parts that are not sequences of parts, lengths
    # that disagree, no update at all
    two = StepUpdate(empty[0], (RowBlocks(),) * 2, (RowBlocks(),) * 2, (RowEntries(),) * 2)
    for bad_update in (two, StepUpdate(empty[0], 5, (RowBlocks(),), (RowEntries(),)),
                       StepUpdate(empty[0], (None,), (RowBlocks(),), (RowEntries(),)),
                       one_group_update([empty[0], np.array([1], I32), *empty[2:]]),
                       None, object()):
        _refused(lambda: writer.apply_and_stage(bad_update, staging, 16), visible,
                 refusal=-2)
    # refused by value: -2, nothing written, nothing staged (apply names the error)
    bad_row = one_group_update([np.array([ROWS], I32), *empty[1:]])
    _refused(lambda: writer.apply_and_stage(bad_row, staging, 16), visible, refusal=-2)
    # the valid call after all that: written, then staged with the count in word 0
    assert writer.apply_and_stage(append, staging, 16) == 3
    assert g.counts[1] == K and staging[:7].tolist() == [3, 6, 7, 25, 14, 15, 2]
    assert g.journal_len.tolist() == [0, 0] and not g.dirty.any()
    # more pairs than the capacity: the update is written, nothing staged, the journal kept
    before = staging.copy()
    assert writer.apply_and_stage(append, staging, 2) == -1
    assert g.counts[1] == 2 * K and g.journal_len.tolist() == [1, 2]
    np.testing.assert_array_equal(staging, before)


def journal_args() -> list:
    """A valid journal diff of 4 rows, 2 groups: row 0 cleared, row 1 added, row 2 grew in
    group 0, row 3 unchanged."""
    start_gen = np.array([7, 3, 8, 9], I64)
    holder_gen = np.array([0, 4, 8, 9], I64)
    start_len = np.array([[2, 0, 1, 1], [1, 0, 2, 1]], I64)
    row_len = np.array([[0, 2, 3, 1], [0, 1, 2, 1]], I64)
    arenas = [np.arange(16, dtype=I32).reshape(4, 4), np.arange(8, dtype=I32).reshape(4, 2)]
    return [start_gen, holder_gen, start_len, row_len, arenas]


EMPTY32 = np.zeros(0, I32)
EMPTY32.flags.writeable = False


NO_BLOCKS = RowBlocks(EMPTY32, EMPTY32, EMPTY32)
NO_ENTRIES = (RowEntries(EMPTY32, EMPTY32),) * 2


def journal_diff(start_gen, holder_gen, start_len, row_len, arenas) -> list:
    """A journal diff bound to the arrays, called once: its parts as flat arrays (cleared
    rows, added rows, then per group added counts and ids, grown rows, growth, new ids)."""
    update = compiled.JournalDiff(
        start_gen, holder_gen, start_len, row_len, EMPTY32, RowBlocks, NO_BLOCKS, StepUpdate,
    ).diff(arenas, NO_ENTRIES, (16, 32))
    assert type(update) is StepUpdate and update.trusted
    assert update.nulled is NO_ENTRIES and update.allocator_block_sizes == (16, 32)
    cleared, added, appended = update.cleared_rows, update.added, update.appended
    parts = [cleared, added[0].rows]
    for a, p in zip(added, appended):
        parts += [a.num_manager_blocks, a.block_ids, p.rows, p.num_manager_blocks, p.block_ids]
    return parts


def test_journal_diff_parts_and_the_next_start() -> None:
    args = journal_args()
    parts = journal_diff(*args)
    assert [p.tolist() for p in parts] == [
        [0], [1],
        [2], [4, 5], [2], [2], [9, 10],  # group 0: row 1 added, row 2 grew by 2
        [1], [2], [], [], []]  # group 1: row 1 added, nothing grew
    assert all(p.dtype == I32 and not p.flags.writeable for p in parts)
    assert all(p is EMPTY32 for p in parts[-3:])  # empty parts: the one given
    # the live state is the next start: the same arrays diffed again give nothing
    np.testing.assert_array_equal(args[0], args[1])
    np.testing.assert_array_equal(args[2], args[3])
    again = journal_diff(*args)
    assert all(p is EMPTY32 for p in again)
    update = compiled.JournalDiff(*journal_args()[:4], EMPTY32, RowBlocks, NO_BLOCKS,
                                  StepUpdate).diff(journal_args()[4], NO_ENTRIES, None)
    assert update.appended[1] is NO_BLOCKS and update.allocator_block_sizes is None
    with pytest.raises(ValueError):
        parts[0].flags.writeable = True  # a view of a read-only buffer


def test_journal_diff_grows_its_work_space_and_reads_everything_again() -> None:
    """An update larger than the work space: grown, then the rows read again, same parts."""
    start_gen, holder_gen = np.array([0, 0], I64), np.array([0, 7], I64)
    start_len, row_len = np.zeros((1, 2), I64), np.array([[0, 150]], I64)
    arena = np.arange(2 * 200, dtype=I32).reshape(2, 200)
    bound = compiled.JournalDiff(start_gen, holder_gen, start_len, row_len, EMPTY32,
                                 RowBlocks, NO_BLOCKS, StepUpdate)
    update = bound.diff([arena], NO_ENTRIES[:1], None)
    (added,) = update.added
    assert added.rows.tolist() == [1] and added.num_manager_blocks.tolist() == [150]
    assert added.block_ids.tolist() == arena[1, :150].tolist()
    assert start_gen.tolist() == [0, 7] and start_len.tolist() == [[0, 150]]


def test_journal_diff_moves_the_start_of_a_changed_row_that_yields_nothing() -> None:
    """A free row whose stale lengths changed and a row that shrank: no part, new start."""
    start_gen, holder_gen = np.array([0, 5], I64), np.array([0, 5], I64)
    start_len, row_len = np.array([[1, 3]], I64), np.array([[2, 1]], I64)
    bound = compiled.JournalDiff(start_gen, holder_gen, start_len, row_len, EMPTY32,
                                 RowBlocks, NO_BLOCKS, StepUpdate)
    nulled = NO_ENTRIES[:1]
    update = bound.diff([np.zeros((2, 4), I32)], nulled, None)
    assert update.cleared_rows is EMPTY32 and update.nulled is nulled and update.trusted
    assert update.added == update.appended == (NO_BLOCKS,)
    assert start_len.tolist() == [[2, 1]]


def test_journal_diff_remembers_each_groups_arena_and_checks_a_new_one() -> None:
    start_gen, holder_gen, start_len, row_len, arenas = journal_args()
    starts = [start_gen.copy(), start_len.copy()]

    def diff(arenas):  # from the same start every time
        np.copyto(start_gen, starts[0])
        np.copyto(start_len, starts[1])
        update = bound(arenas, NO_ENTRIES, None)
        return [update.cleared_rows] + [a for b in update.added + update.appended
                                        for a in astuple(b)]

    bound = compiled.JournalDiff(start_gen, holder_gen, start_len, row_len,
                                 EMPTY32, RowBlocks, NO_BLOCKS, StepUpdate).diff
    first = [p.tolist() for p in diff(arenas)]
    assert [p.tolist() for p in diff(arenas)] == first  # the same arenas again
    wider = [np.hstack([a, a + 100]) for a in arenas]  # an arena that grew: taken anew
    assert [p.tolist() for p in diff(wider)] == first
    for bad in ([wider[0][:3], wider[1]], [wider[0].astype(np.uint32), wider[1]],
                [wider[0]], [wider[0], wider[1], wider[1]]):
        np.copyto(start_gen, starts[0])
        np.copyto(start_len, starts[1])
        before = snapshot([start_gen, holder_gen, start_len, row_len, *wider])
        with pytest.raises((TypeError, ValueError)):
            bound(bad, NO_ENTRIES, None)  # a new arena is checked (rows, dtype); one arena per group
        unchanged(before, [start_gen, holder_gen, start_len, row_len, *wider])
    assert [p.tolist() for p in diff(wider)] == first


def test_journal_diff_refuses_hostile_arguments() -> None:
    valid = journal_args()
    before = snapshot([*valid[:4], *valid[4]])

    def check(args: list) -> None:
        with pytest.raises((TypeError, ValueError)):
            journal_diff(*args)
        unchanged(before, [*valid[:4], *valid[4]])

    for i in range(4):
        variants = hostile_variants(valid[i])
        if valid[i].ndim == 2:
            variants.append(("1-D", valid[i].ravel()))
        if i in (0, 2):  # the written starts
            variants.append(("read-only", read_only(valid[i])))
        for label, bad in variants:
            args = journal_args()
            args[i] = bad
            check(args)
    for label, bad in hostile_variants(valid[4][0]) + [("1-D", valid[4][0].ravel())]:
        args = journal_args()
        args[4] = [bad, valid[4][1]]
        check(args)
    for i, short in ((0, np.zeros(3, I64)), (1, np.zeros(5, I64)), (2, np.zeros((1, 4), I64)),
                     (3, np.zeros((2, 3), I64))):
        args = journal_args()
        args[i] = short
        check(args)  # shapes that disagree
    # a written start that overlaps a bound array (the same memory, or part of it)
    shared = np.zeros(12, I64)
    for written, other, (wi, oi) in (
        (shared[:4], shared[:4], (0, 1)),  # start_gen is holder_gen
        (shared[:8].reshape(2, 4), shared[4:12].reshape(2, 4), (2, 3)),  # start_len, row_len
        (shared[:4], shared[2:10].reshape(2, 4), (0, 2)),  # start_gen in start_len
        (shared[:4], shared[3:11].reshape(2, 4), (0, 3)),  # start_gen in row_len
        (shared[2:10].reshape(2, 4), shared[:4], (2, 1)),  # start_len over holder_gen
    ):
        args = journal_args()
        args[wi], args[oi] = written, other
        check(args)
    args = journal_args()
    args[4] = [valid[4][0]]
    check(args)  # fewer arenas than groups
    args = journal_args()
    args[4] = [valid[4][0][:3], valid[4][1]]
    check(args)  # an arena with fewer rows
    for group, row, value in ((0, 1, 5), (1, 2, 3), (0, 1, -1), (0, 2, 2**62)):
        args = journal_args()
        args[3] = valid[3].copy()
        args[3][group, row] = value
        check(args)  # a row longer than its arena, or negative
    args = journal_args()
    args[2] = valid[2].copy()
    args[2][0, 2] = -3
    check(args)  # a row that grew from a negative length
    for label, bad in hostile_variants(EMPTY32) + [("not empty", np.zeros(1, I32))]:
        with pytest.raises((TypeError, ValueError)):
            compiled.JournalDiff(*valid[:4], bad, RowBlocks, NO_BLOCKS, StepUpdate)

    def refused(*args: object) -> StepUpdate:
        raise ValueError("refused")

    shrank = [np.arange(1, 5, dtype=I64), np.arange(1, 5, dtype=I64),  # row 0 shrank: no part
              np.full((2, 4), 2, I64), np.array([[1, 2, 2, 2], [2, 2, 2, 2]], I64), valid[4]]
    for args in (journal_args(), shrank):  # an update with parts, and one without
        before = snapshot([*args[:4], *args[4]])
        bound = compiled.JournalDiff(*args[:4], EMPTY32, RowBlocks, NO_BLOCKS, refused)
        with pytest.raises(ValueError, match="refused"):
            bound.diff(args[4], NO_ENTRIES, None)  # an update that cannot be made
        unchanged(before, [*args[:4], *args[4]])


def test_key_table_refuses_hostile_arguments() -> None:
    table = compiled.KeyTable()
    keys = np.array([3, 2**64 - 1, 2**63], np.uint64)
    assert table.insert_absent(keys, np.array([0, 1, 2], I64))
    before = sorted(zip(*table.items()))

    def refused(call) -> None:
        with pytest.raises((TypeError, ValueError, KeyError, OverflowError)):
            call()
        assert sorted(zip(*table.items())) == before

    new = np.array([5, 6], np.uint64)
    values = np.array([7, 8], I64)
    for label, bad in hostile_variants(new):
        refused(lambda: table.insert_absent(bad, values))
        refused(lambda: table.remove(bad))
        refused(lambda: table.find(bad, np.empty(2, I64)))
    for label, bad in hostile_variants(values):
        refused(lambda: table.insert_absent(new, bad))
    out = np.empty(2, I64)
    for label, bad in hostile_variants(out) + [("read-only", read_only(out))]:
        refused(lambda: table.find(new, bad))
    refused(lambda: table.find(new, new.view(I64)))  # out aliases keys
    refused(lambda: table.find(new, np.empty(3, I64)))  # lengths that disagree
    refused(lambda: table.insert_absent(new, np.array([1], I64)))
    refused(lambda: table.insert_absent(new, np.array([1, -1], I64)))  # negative value
    refused(lambda: table.insert(9, -5))
    refused(lambda: table.insert(3, 1))  # filed already
    refused(lambda: table.insert(-1, 1))  # not a uint64
    refused(lambda: table.insert(2**64, 1))
    refused(lambda: table.get(-1))
    refused(lambda: table.remove(np.array([3, 4], np.uint64)))  # 4 is not filed
    refused(lambda: table.remove(np.array([3, 3], np.uint64)))  # repeated
    refused(lambda: compiled.KeyTable(-1))
    refused(lambda: compiled.KeyTable(2**62))
    assert not table.insert_absent(np.array([9, 3], np.uint64), np.array([1, 1], I64))
    assert not table.insert_absent(np.array([9, 9], np.uint64), np.array([1, 1], I64))
    assert sorted(zip(*table.items())) == before


# ---- the CPU backend's device work of a captured step ------------------------------------
def launch_case(rng: np.random.Generator):
    """A staging buffer's parts (4 pairs at most, 3 requests, 8 tokens), a device table of
    5 rows and a mapper reading it."""
    flat, layout, rows, _, _, _ = slot_case(rng, int(rng.integers(1, 3)))
    P, R, T = 4, 3, 8
    n = int(rng.integers(0, P + 1))
    header_pairs = np.zeros(1 + 2 * P, I32)
    header_pairs[0] = n
    header_pairs[1 : 1 + n] = rng.choice(len(flat), n, replace=False)
    header_pairs[1 + n : 1 + 2 * n] = rng.integers(0, 30, n)
    num_reqs = int(rng.integers(0, R + 1))
    qsl = np.concatenate([[0], np.cumsum(rng.integers(0, 3, num_reqs))]).astype(I32)
    qsl = np.concatenate([qsl, np.full(R - num_reqs, qsl[-1])]).astype(I32)  # padded
    positions = rng.integers(-3, 40, T).astype(I64)
    row_of_batch = rng.integers(-1, rows + 1, R).astype(I32)
    out = np.full((1, 10), 99, I64)
    return flat, layout, rows, header_pairs, qsl, row_of_batch, positions, out


def test_host_launch_equals_numpy_put_and_slot_mapping() -> None:
    """Random staged pairs and padded batches: the pairs put into the table, then the slots
    of the batch, as numpy does them."""
    from blocktable.slot_mapping.params import SlotGroupParams

    rng = np.random.default_rng(11)
    for _ in range(300):
        flat, layout, rows, hp, qsl, row_of_batch, positions, out = launch_case(rng)
        want_flat, want_out = flat.copy(), out.copy()
        mapper = compiled.SlotMapper(flat, out, [layout], rows)
        compiled.HostLaunch(hp, qsl, row_of_batch, positions, flat, mapper).launch()
        n = hp[0]
        want_flat.put(hp[1 : 1 + n], hp[1 + n : 1 + 2 * n])
        params = [SlotGroupParams(*layout[:5], layout[5], layout[6], layout[7])]
        slot_mapping_numpy(want_flat, params, qsl, positions[: qsl[-1]], row_of_batch,
                           want_out, rows)
        np.testing.assert_array_equal(flat, want_flat)
        np.testing.assert_array_equal(out, want_out)


def test_host_launch_refuses_hostile_arguments() -> None:
    rng = np.random.default_rng(12)
    flat, layout, rows, hp, qsl, row_of_batch, positions, out = launch_case(rng)
    mapper = compiled.SlotMapper(flat, out, [layout], rows)
    parts = [hp, qsl, row_of_batch, positions, flat]
    arrays = [*parts, out]

    def make(i: int, bad: object):
        args: list = list(parts)
        args[i] = bad
        return compiled.HostLaunch(*args, mapper)

    for i, arr in enumerate(parts):
        variants = hostile_variants(arr)
        if i == 4:
            variants.append(("read-only", read_only(arr)))
        for label, bad in variants:
            _refused(lambda: make(i, bad), arrays)
    for i, short in ((0, hp[:8]), (0, hp[:0]), (1, qsl[:3]), (2, row_of_batch[:2])):
        _refused(lambda: make(i, short), arrays)  # shapes that disagree
    _refused(lambda: make(3, np.zeros(11, I64)), arrays)  # more tokens than the slot buffers
    # read arrays that alias a written one, and a table that aliases the slot buffers
    _refused(lambda: make(0, flat[: len(hp)]), arrays)
    _refused(lambda: make(1, flat[-4:]), arrays)
    _refused(lambda: make(3, out[0, :8]), arrays)
    _refused(lambda: make(2, out[0].view(I32)[:3]), arrays)
    wide = np.zeros((1, 40), I64)
    aliased = compiled.SlotMapper(flat, wide, [layout], rows)
    _refused(lambda: compiled.HostLaunch(hp, qsl, row_of_batch, positions,
                                         wide[0].view(I32)[: len(flat)], aliased), [*arrays, wide])

    launch = compiled.HostLaunch(*parts, mapper).launch
    good = hp.copy()
    for count in (-1, 5, 2**31 - 1, -2**31):  # the pair count outside [0, max_pairs]
        hp[0] = count
        _refused(launch, arrays)
    hp[:] = good
    hp[0] = 2
    for index in (-1, len(flat), 2**31 - 1, -2**31):  # a pair index outside the table
        hp[2] = index
        _refused(launch, arrays)
    hp[:] = good
    good_qsl = qsl.copy()
    for bad in ([1, 1, 1, 1], [0, 2, 1, 1], [0, 0, 0, 9], [0, 0, 0, -1]):
        qsl[:] = bad  # does not start at 0, decreases, more tokens than positions, negative
        _refused(launch, arrays)
    qsl[:] = good_qsl
    launch()  # the valid call still works


# ---- the fast chained block keys -----------------------------------------------------------
def chain_case(rng: np.random.Generator, bs: int):
    """Segments of random lengths (some empty) over random int64 tokens, random start states."""
    lengths = rng.integers(0, 6, int(rng.integers(0, 7))).astype(I64)
    n = int(lengths.sum())
    tokens = rng.integers(-(2**63), 2**63 - 1, (n, bs), dtype=I64, endpoint=True)
    starts = rng.integers(0, 2**64 - 1, len(lengths), dtype=np.uint64, endpoint=True)
    return tokens, lengths, starts


@pytest.mark.parametrize("bs", [1, 3, 16])
def test_token_chain_keys_equals_numpy_and_python(bs: int, monkeypatch) -> None:
    """Bit for bit the numpy pass (content hashes, then the segmented scan), on any int64
    tokens and start states; and the plain-Python keys of a prompt."""
    powers = ChainPowers(bs)
    rng = np.random.default_rng(bs)
    for _ in range(60):
        tokens, lengths, starts = chain_case(rng, bs)
        want = chain_keys(block_content_hashes(tokens, powers), lengths, starts, powers)
        keys, states = np.empty(len(tokens), np.uint64), np.empty(len(tokens), np.uint64)
        compiled.token_chain_keys(tokens.reshape(-1), lengths, starts, powers.token_powers,
                                  powers.block_base, keys, states)
        np.testing.assert_array_equal(keys, want[0])
        np.testing.assert_array_equal(states, want[1])
        for use in (compiled, None):  # the public function, compiled or not
            monkeypatch.setattr(_compiled_loader, "COMPILED", use)
            got = token_chain_keys(tokens, lengths, starts, powers)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
    prompt = rng.integers(0, 32000, 10 * bs + 1)
    seed = np.array([namespace_seed(b"")], np.uint64)
    keys, _ = token_chain_keys(prompt[: 10 * bs].reshape(-1, bs), np.array([10]), seed, powers)
    assert keys.tolist() == fast_block_keys(prompt.tolist(), bs)[:10]


def test_token_chain_keys_refuses_hostile_arguments() -> None:
    powers = ChainPowers(4)
    tokens = np.arange(12, dtype=I64)
    lengths, starts = np.array([1, 2], I64), np.array([5, 2**64 - 1], np.uint64)
    keys, states = np.zeros(3, np.uint64), np.zeros(3, np.uint64)
    valid = [tokens, lengths, starts, powers.token_powers, powers.block_base, keys, states]
    arrays = [tokens, lengths, starts, powers.token_powers, keys, states]

    def call(args):
        return lambda: compiled.token_chain_keys(*args)

    for i in (0, 1, 2, 3, 5, 6):
        variants = hostile_variants(valid[i])
        if i >= 5:
            variants.append(("read-only", read_only(valid[i])))
        for label, bad in variants:
            args = list(valid)
            args[i] = bad
            _refused(call(args), arrays)
    for bad_base in (-1, 2**64, 1.0, None, "3"):
        _refused(call(valid[:4] + [bad_base] + valid[5:]), arrays)
    out_pair = np.zeros(4, np.uint64)
    for args in (
        [tokens[:11], *valid[1:]],  # not whole blocks
        [tokens[:8], *valid[1:]],  # fewer blocks than keys
        [tokens, np.array([1, 3], I64), *valid[2:]],  # lengths sum past n
        [tokens, np.array([4, -1], I64), *valid[2:]],  # a negative length
        [tokens, np.array([1, 1], I64), *valid[2:]],  # lengths sum short of n
        [tokens, np.array([-(2**63), 2**63 - 1], I64), *valid[2:]],  # sums that overflow
        [tokens, lengths, starts[:1], *valid[3:]],  # a start state per segment
        [tokens, *valid[1:3], np.zeros(0, np.uint64), *valid[4:]],  # no block size
        [*valid[:6], np.zeros(2, np.uint64)],  # states shorter than keys
        [*valid[:5], keys, keys],  # the outputs alias
        [*valid[:5], out_pair[:3], out_pair[1:]],  # the outputs overlap
    ):
        _refused(call(args), arrays + [out_pair])
    # outputs that overlap an input
    shared = np.zeros(15, np.uint64)
    for i, at in ((0, 0), (1, 3), (2, 3), (3, 0)):
        args = list(valid)
        view = shared[at : at + len(valid[i])]
        view[:] = valid[i].view(np.uint64) if valid[i].dtype != np.uint64 else valid[i]
        args[i] = view.view(valid[i].dtype)
        args[5] = shared[at : at + 3] if i != 0 else shared[:3]
        _refused(call(args), arrays + [shared])
    # a read-only input is fine (only read)
    compiled.token_chain_keys(*[read_only(a) if isinstance(a, np.ndarray) else a
                                for a in valid[:5]], keys, states)


def test_bound_objects_refuse_a_second_init_and_unbound_ones_refuse_every_call() -> None:
    """The step's loops read through pointers taken from the first binding's views: a second
    ``__init__`` (valid or not) is refused and leaves the object working, and an object whose
    ``__init__`` never ran, or failed, refuses every call."""
    g = StagedGroup()
    writer, stager = g.writer(), g.stager()
    writer.bind_stager(stager)
    other = StagedGroup()
    with pytest.raises(TypeError, match="bound once"):
        writer.__init__(other.table, other.counts, WIDTH, K, MAX_ID, 0, other.scratch,
                        other.seen, other.dirty, other.journal, other.journal_len)
    with pytest.raises(TypeError, match="bound once"):
        stager.__init__(other.journal, other.journal_len, other.dirty, ROWS * WIDTH,
                        other.host)
    args = journal_args()
    diff = compiled.JournalDiff(*args[:4], EMPTY32, RowBlocks, NO_BLOCKS, StepUpdate)
    with pytest.raises(TypeError, match="bound once"):
        diff.__init__(*journal_args()[:4], EMPTY32, RowBlocks, NO_BLOCKS, StepUpdate)
    # still bound to the first arrays: an update written there, nothing in the other group
    rows, num, ids = (np.array(v, I32) for v in ([1], [2], [3, 4]))
    assert writer.apply(EMPTY32, rows, num, ids, EMPTY32, EMPTY32, EMPTY32, EMPTY32,
                        EMPTY32)[0] == 0
    assert g.counts[1] == 2 * K and not other.counts.any()
    assert diff.diff(args[4], NO_ENTRIES, None).cleared_rows.tolist() == [0]

    staging = np.zeros(1 + 2 * 64, I32)
    empty = [EMPTY32] * 9
    for cls in (compiled.GroupWriter, compiled.PairStager, compiled.JournalDiff):
        unbound = cls.__new__(cls)
        calls = {
            compiled.GroupWriter: [lambda: unbound.apply(*empty),
                                   lambda: unbound.bind_stager(stager),
                                   lambda: unbound.apply_and_stage(None, staging, 64)],
            compiled.PairStager: [lambda: unbound.fill(staging, 64),
                                  lambda: writer.bind_stager(unbound)],
            compiled.JournalDiff: [lambda: unbound.diff(args[4], NO_ENTRIES, None)],
        }[cls]
        for call in calls:
            with pytest.raises((ValueError, TypeError)):
                call()
    # an __init__ that fails part way leaves the object unbound, refusing every call
    failed = compiled.GroupWriter.__new__(compiled.GroupWriter)
    with pytest.raises(ValueError):
        failed.__init__(g.table, g.counts, WIDTH, K, MAX_ID, 0, g.scratch, g.seen, g.dirty,
                        g.journal, np.zeros(3, I64))
    with pytest.raises(ValueError, match="never bound"):
        failed.apply(*empty)


def test_graph_launch_refuses_anything_but_work_on_the_current_device() -> None:
    """The driver's graph launch captures the caller's work itself and keeps the graph where
    no Python code reaches it (so nothing resets a graph whose executable it holds); anything
    but a callable on the current CUDA device raises before any capture or driver call, and
    an object whose ``__init__`` never completed refuses to launch."""
    import torch

    for bad in (None, 0xBEEF, object(), np.zeros(4, I64), "work"):
        with pytest.raises(TypeError, match="work must be callable"):
            compiled.GraphLaunch(bad, 0)
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    for bad_index in (current + 1, -1, 2**70, float(current), "0", None):
        with pytest.raises(ValueError, match="device_index must be the current CUDA device"):
            compiled.GraphLaunch(lambda: None, bad_index)
    unbound = compiled.GraphLaunch.__new__(compiled.GraphLaunch)
    with pytest.raises(ValueError, match="never bound"):
        unbound.launch()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device_index"):  # no CUDA device is current
            compiled.GraphLaunch(lambda: None, 0)
        return
    x = torch.zeros(4, device="cuda")
    x.add_(0)  # (the work's first use, uncaptured)
    launcher = compiled.GraphLaunch(lambda: x.add_(1), current)
    assert not hasattr(launcher, "_graph")  # the graph is out of Python's reach
    torch.cuda.synchronize()
    assert x.tolist() == [0.0] * 4  # captured, not run
    launcher.launch()
    launcher.launch()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4
    with pytest.raises(TypeError, match="bound once"):
        launcher.__init__(lambda: x.add_(5), current)
    launcher.launch()  # still the first graph
    torch.cuda.synchronize()
    assert x.tolist() == [3.0] * 4
