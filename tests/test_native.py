"""The compiled step loops (``blocktable._native``) against pure-Python models of what they do,
on fresh random inputs, refusals included (nothing written), and the build itself."""

from __future__ import annotations

import itertools
import os
import shutil
import sysconfig

import numpy as np
import pytest

import blocktable._native_loader as loader

native = loader.NATIVE
needs_native = pytest.mark.skipif(native is None, reason="blocktable._native is not built here")


def test_the_install_built_the_extension_where_a_compiler_is():
    """Where a C compiler and Python's headers are at hand the install must have built the
    extension (an optional build fails quietly: this is where it would show)."""
    if os.environ.get("BLOCKTABLE_NATIVE", "1") == "0":
        pytest.skip("BLOCKTABLE_NATIVE=0")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    include = sysconfig.get_paths()["include"]
    if shutil.which(cc) is None or not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip("no C compiler or no Python headers here")
    assert native is not None, "a compiler is here, but blocktable._native was not built"


# ------------------------------------------------------------------ models
def model_stage_appends(host, rows, ids, width, k, table_offset, counts_offset, num_rows,
                        id_bound):
    """(code, pairs) of stage_appends; host is written only on success."""
    n = len(rows)
    if len(ids) != n:
        return -4, None
    index, value, counts_i, counts_v = [], [], [], []
    for row, block in zip(rows.tolist(), ids.tolist()):
        if not 0 <= row < num_rows:
            return -3, None
        if not 0 <= block < id_bound:
            return -2, None
        filled = int(host[counts_offset + row])
        if not 0 <= filled <= width - k:
            return -1, None
        for j in range(k):
            index.append(table_offset + row * width + filled + j)
            value.append(0 if block == 0 else block * k + j)
        counts_i.append(counts_offset + row)
        counts_v.append(filled + k)
    index += counts_i
    value += counts_v
    for i, v in zip(index, value):
        host[i] = v
    return len(index), index + value


def model_map_slots(table, positions, qsl, rows, width, block_size, num_rows):
    """The slots of map_slots, or None where it must hand the batch to the general function."""
    out = []
    spans = ([(t, t + 1) for t in range(len(positions))] if qsl is None
             else list(zip(qsl[:-1].tolist(), qsl[1:].tolist())))
    for r, (start, end) in enumerate(spans):
        row = int(rows[r])
        if not 0 <= row < num_rows:
            return None
        for t in range(start, end):
            pos = int(positions[t])
            if not 0 <= pos < width * block_size:
                return None
            block = int(table[row * width + pos // block_size])
            out.append(-1 if block == 0 else block * block_size + pos % block_size)
    return out


def model_check_batch(qsl, rows, num_tokens, num_rows):
    q = qsl.tolist()
    if q[0] != 0 or q[-1] != num_tokens or any(b < a for a, b in itertools.pairwise(q)):
        return -1
    if rows is not None and any(not 0 <= r < num_rows for r in rows.tolist()):
        return -2
    return int(num_tokens == len(q) - 1 and q == list(range(len(q))))


def random_layout(rng, k, max_rows, max_offset, most_value, spare):
    """A flat host buffer with one group's table and counts (counts: whole kernel blocks per
    row, full rows included): (host, num_rows, width, table_offset, counts_offset)."""
    num_rows, width = int(rng.integers(1, max_rows)), k * int(rng.integers(1, 6))
    table_offset = int(rng.integers(0, max_offset))
    counts_offset = table_offset + num_rows * width + int(rng.integers(0, 3))
    host = rng.integers(0, most_value, counts_offset + num_rows + spare).astype(np.int32)
    host[counts_offset : counts_offset + num_rows] = k * rng.integers(
        0, width // k + 1, num_rows)
    return host, num_rows, width, table_offset, counts_offset


# ------------------------------------------------------------------ stage_appends
@needs_native
@pytest.mark.parametrize("k", [1, 2, 4])
def test_stage_appends_equals_the_model(k):
    rng = np.random.default_rng(k)
    for _ in range(300):
        host, num_rows, width, table_offset, counts_offset = random_layout(rng, k, 12, 5, 50, 2)
        n = int(rng.integers(0, num_rows + 1))
        rows = rng.permutation(num_rows)[:n].astype(np.int32)
        id_bound = int(rng.integers(1, 100))
        ids = rng.integers(0, id_bound, n).astype(np.int32)
        if n and rng.random() < 0.15:  # an id or a row outside
            (ids if rng.random() < 0.5 else rows)[rng.integers(n)] = rng.choice(
                [-1, id_bound + 200, 10**6])
        if rng.random() < 0.05:
            ids = ids[:-1] if n else np.zeros(1, np.int32)
        want_host = host.copy()
        code, want_pairs = model_stage_appends(want_host, rows, ids, width, k, table_offset,
                                               counts_offset, num_rows, id_bound)
        pairs = np.full(2 * n * (k + 1) + 3, -7, np.int32)
        # the optional mirror (another buffer, as the CPU backend's device table) gets every
        # write host gets; left out or None, nothing else is written
        mirror, want_mirror, extra = random_mirror(rng, host)
        got = native.stage_appends(host, pairs, rows, ids, width, k, table_offset,
                                   counts_offset, num_rows, id_bound, *extra)
        assert got == code
        np.testing.assert_array_equal(host, want_host)  # refused: host as it was
        if code >= 0:
            assert pairs[: 2 * code].tolist() == want_pairs
            if extra and extra[0] is not None:
                want_mirror[pairs[:code]] = pairs[code : 2 * code]
        np.testing.assert_array_equal(mirror, want_mirror)


def random_mirror(rng, host):
    """(mirror, its expected content before the writes, the extra arguments): a buffer of
    other content as long as host (or longer), passed as the last argument, as None or not
    at all."""
    mirror = rng.integers(-5, 50, len(host) + int(rng.integers(0, 3))).astype(np.int32)
    roll = rng.random()
    extra = (mirror,) if roll < 0.6 else (None,) if roll < 0.8 else ()
    return mirror, mirror.copy(), extra


@needs_native
def test_stage_appends_refuses_short_pairs_and_a_layout_outside_host():
    host = np.zeros(20, np.int32)
    rows, ids = np.array([0, 1], np.int32), np.array([3, 4], np.int32)
    assert native.stage_appends(host, np.zeros(7, np.int32), rows, ids, 4, 1, 0, 16, 4, 9) == -4
    assert not host.any()
    with pytest.raises(ValueError, match="outside host"):
        native.stage_appends(host, np.zeros(8, np.int32), rows, ids, 4, 1, 0, 18, 4, 9)


# ------------------------------------------------------------------ scatter
@needs_native
def test_scatter_equals_put_and_refuses_an_index_outside_with_nothing_written():
    rng = np.random.default_rng(0)
    for _ in range(200):
        flat = rng.integers(-5, 50, int(rng.integers(1, 40))).astype(np.int32)
        n = int(rng.integers(0, 10))
        index = rng.integers(0, len(flat), n)
        bad = n and rng.random() < 0.2
        if bad:
            index[rng.integers(n)] = rng.choice([-1, len(flat), len(flat) + 9])
        pairs = np.concatenate([index, rng.integers(0, 99, n), [123]]).astype(np.int32)
        want = flat.copy()
        if not bad:
            want[index] = pairs[n : 2 * n]  # numpy's put: the last write of an index wins
        assert native.scatter(flat, pairs, n) == (-1 if bad else n)
        np.testing.assert_array_equal(flat, want)
    with pytest.raises(ValueError, match="n must lie"):
        native.scatter(np.zeros(4, np.int32), np.zeros(4, np.int32), 3)


# ------------------------------------------------------------------ check_batch
@needs_native
def test_check_batch_equals_the_model():
    rng = np.random.default_rng(1)
    for _ in range(500):
        num_reqs = int(rng.integers(0, 9))
        decode = rng.random() < 0.5
        counts = np.ones(num_reqs, np.int64) if decode else rng.integers(0, 4, num_reqs)
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        num_tokens = int(qsl[-1])
        roll = rng.random()
        if roll < 0.1:
            qsl[rng.integers(len(qsl))] += rng.choice([-2, -1, 1, 3])  # often malformed
        elif roll < 0.15:
            num_tokens += 1
        num_rows = int(rng.integers(1, 10))
        rows = None if rng.random() < 0.2 else rng.integers(-1, num_rows + 1, num_reqs).astype(
            np.int32)
        want = model_check_batch(qsl, rows, num_tokens, num_rows)
        assert native.check_batch(qsl, rows, num_tokens, num_rows) == want


@needs_native
def test_prepare_batch_checks_pads_and_writes_the_header_or_nothing():
    """prepare_batch on full-capacity views: check_batch's code for the batch's prefix; when
    it is >= 0 the padding past the batch and header fields 1 and 3, else nothing written."""
    rng = np.random.default_rng(11)
    capacity = 9
    for _ in range(500):
        num_reqs = int(rng.integers(0, capacity))
        decode = rng.random() < 0.5
        counts = np.ones(num_reqs, np.int64) if decode else rng.integers(0, 4, num_reqs)
        qsl = np.full(capacity + 1, -5, np.int32)
        qsl[: num_reqs + 1] = np.concatenate([[0], np.cumsum(counts)])
        num_tokens = int(qsl[num_reqs])
        roll = rng.random()
        if roll < 0.1:
            qsl[rng.integers(num_reqs + 1)] += rng.choice([-2, -1, 1, 3])  # often malformed
        elif roll < 0.15:
            num_tokens += 1
        num_rows = int(rng.integers(1, 10))
        rows = rng.integers(-1, num_rows + 1, capacity).astype(np.int32)
        header = rng.integers(0, 99, 4).astype(np.int32)
        want = model_check_batch(qsl[: num_reqs + 1], rows[:num_reqs], num_tokens, num_rows)
        want_qsl, want_header = qsl.copy(), header.copy()
        if want >= 0:
            want_qsl[num_reqs + 1 :] = num_tokens
            want_header[3], want_header[1] = 1234, 77
        assert native.prepare_batch(qsl, rows, num_reqs, num_tokens, num_rows, header, 1234,
                                    77) == want
        np.testing.assert_array_equal(qsl, want_qsl)
        np.testing.assert_array_equal(header, want_header)
    with pytest.raises(ValueError, match="num_reqs outside"):
        native.prepare_batch(qsl, rows, capacity + 1, 0, 1, header, 0, 0)
    with pytest.raises(ValueError, match="header shorter"):
        native.prepare_batch(qsl, rows, 0, 0, 1, header[:3], 0, 0)


# ------------------------------------------------------------------ map_slots
@needs_native
@pytest.mark.parametrize("block_size", [1, 4, 16, 6])
def test_map_slots_equals_the_model(block_size):
    rng = np.random.default_rng(block_size)
    for _ in range(300):
        num_rows, width = int(rng.integers(1, 8)), int(rng.integers(1, 6))
        table = rng.integers(0, 30, num_rows * width + int(rng.integers(0, 3))).astype(np.int32)
        table[rng.random(len(table)) < 0.3] = 0  # null blocks inside rows
        num_reqs = int(rng.integers(1, 7))
        decode = rng.random() < 0.5
        counts = np.ones(num_reqs, np.int64) if decode else rng.integers(0, 4, num_reqs)
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        num_tokens = int(qsl[-1])
        positions = rng.integers(0, width * block_size, num_tokens).astype(np.int64)
        rows = rng.integers(0, num_rows, num_reqs).astype(np.int32)
        if num_tokens and rng.random() < 0.15:  # outside the row, or a row outside the table
            positions[rng.integers(num_tokens)] = rng.choice([-1, width * block_size, 10**9])
        if rng.random() < 0.05:
            rows[rng.integers(num_reqs)] = rng.choice([-1, num_rows])
        by_request = None if decode else qsl
        want = model_map_slots(table, positions, by_request, rows, width, block_size, num_rows)
        out = np.full(num_tokens + 2, 77, np.int64)
        code = native.map_slots(table, positions, by_request, rows, out, width, block_size,
                                num_rows)
        if want is None:
            assert code == -1
        else:
            assert code == 0
            assert out[:num_tokens].tolist() == want
            assert out[num_tokens:].tolist() == [77, 77]  # nothing past the batch


# ------------------------------------------------------------------ bad arguments
@needs_native
def test_wrong_item_sizes_and_read_only_outputs_raise():
    i32, i64 = np.zeros(8, np.int32), np.zeros(8, np.int64)
    with pytest.raises(TypeError, match="positions must be a 1-D array of 8-byte"):
        native.map_slots(i32, i32, None, i32, i64, 2, 4, 4)
    with pytest.raises(TypeError, match="host must be a 1-D array of 4-byte"):
        native.stage_appends(i64, i32, i32[:0], i32[:0], 2, 1, 0, 4, 2, 5)
    frozen = np.zeros(8, np.int32)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        native.scatter(frozen, i32, 0)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        native.scatter(i32, i32)


# ------------------------------------------------------------------ stage_group
def model_stage_group(host, max_pairs, cleared, added, appended, width, k, table_offset,
                      counts_offset, num_rows, id_bound):
    """(code, {index: value}) of stage_group; host is written only on success."""
    writes = {}
    for row in cleared.tolist():
        if not 0 <= row < num_rows:
            return -3, None
        old = int(host[counts_offset + row])
        if not 0 <= old <= width:
            return -4, None
        for e in range(old):
            writes[table_offset + row * width + e] = 0
        writes[counts_offset + row] = 0
    for (rows, num, ids), is_added in ((added, True), (appended, False)):
        if len(num) != len(rows):
            return -4, None
        at = 0
        for row, count in zip(rows.tolist(), num.tolist()):
            if not 0 <= row < num_rows:
                return -3, None
            if count < 0 or at + count > len(ids):
                return -4, None
            mine = ids[at : at + count].tolist()
            at += count
            if any(not 0 <= b < id_bound for b in mine):
                return -2, None
            old = int(host[counts_offset + row])
            if not 0 <= old <= width:
                return -4, None
            start = 0 if is_added else old
            end = start + count * k
            if end > width:
                return -1, None
            base = table_offset + row * width
            for j, block in enumerate(mine):
                for e in range(k):
                    writes[base + start + j * k + e] = 0 if block == 0 else block * k + e
            for e in range(end, old if is_added else end):
                writes[base + e] = 0
            writes[counts_offset + row] = end
        if at != len(ids):
            return -4, None
    if len(writes) > max_pairs:
        return -5, None
    for i, value in writes.items():
        host[i] = value
    return len(writes), writes


def _random_part(rng, rows, id_bound, most):
    num = rng.integers(0, most + 1, len(rows)).astype(np.int32)
    ids = rng.integers(0, id_bound, int(num.sum())).astype(np.int32)
    return rows.astype(np.int32), num, ids


@needs_native
@pytest.mark.parametrize("k", [1, 2, 3])
def test_stage_group_equals_the_model(k):
    """Cleared, added and appended rows of one group (distinct across the parts), refusals of
    every kind with host as it was, and pairs that hold each write once."""
    rng = np.random.default_rng(10 + k)
    for _ in range(400):
        host, num_rows, width, table_offset, counts_offset = random_layout(rng, k, 10, 4, 40, 1)
        order = rng.permutation(num_rows).astype(np.int32)
        cuts = np.sort(rng.integers(0, num_rows + 1, 3))
        cleared = order[: cuts[0]]
        id_bound = int(rng.integers(1, 60))
        most = width // k
        added = _random_part(rng, order[cuts[0] : cuts[1]], id_bound, most)
        appended = _random_part(rng, order[cuts[1] : cuts[2]], id_bound, 2)
        roll = rng.random()
        if roll < 0.08 and len(added[2]):
            added[2][rng.integers(len(added[2]))] = rng.choice([-1, id_bound])
        elif roll < 0.12 and len(appended[0]):
            appended[0][rng.integers(len(appended[0]))] = rng.choice([-1, num_rows])
        elif roll < 0.16:
            appended = (appended[0], appended[1], appended[2][:-1] if len(appended[2]) else
                        np.zeros(1, np.int32))
        max_pairs = int(rng.integers(0, 40))
        want_host = host.copy()
        code, writes = model_stage_group(want_host, max_pairs, cleared, added, appended, width,
                                         k, table_offset, counts_offset, num_rows, id_bound)
        # stage_group takes the parts as arrays, stage_packed as diff_rows packs them
        packed_host = host.copy()
        pairs = np.full(2 * max_pairs + 1, -7, np.int32)
        got = native.stage_group(host, pairs, max_pairs, cleared, *added, *appended, width, k,
                                 table_offset, counts_offset, num_rows, id_bound)
        data, sizes = pack_parts(cleared, added, appended)
        packed_pairs = np.full(2 * max_pairs + 1, -7, np.int32)
        mirror, want_mirror, extra = random_mirror(rng, host)
        got_packed = native.stage_packed(packed_host, packed_pairs, max_pairs, data, sizes,
                                         width, k, table_offset, counts_offset, num_rows,
                                         id_bound, *extra)
        assert got == got_packed == code
        np.testing.assert_array_equal(host, want_host)  # refused: host as it was
        np.testing.assert_array_equal(packed_host, want_host)
        if code >= 0:
            index, value = pairs[:code].tolist(), pairs[code : 2 * code].tolist()
            assert len(set(index)) == code  # each entry once: the device scatter has no order
            assert dict(zip(index, value)) == writes
            np.testing.assert_array_equal(packed_pairs, pairs)
            if extra and extra[0] is not None:
                want_mirror[index] = value
        np.testing.assert_array_equal(mirror, want_mirror)


def pack_parts(cleared, added, appended):
    """The parts as ``diff_rows`` packs them: (int32 bytes, the first six parts' lengths)."""
    parts = [cleared, added[0], added[1], appended[0], appended[1], appended[2], added[2]]
    data = np.concatenate(parts).astype(np.int32).tobytes()
    return data, tuple(len(p) for p in parts[:6])


@needs_native
def test_stage_packed_refuses_sizes_that_do_not_fit_its_data_and_a_short_mirror():
    """Sizes past the data, negative or disagreeing (rows against counts) are -4 with host and
    pairs as they were; data that is not bytes, or sizes not six ints, raise TypeError. In all
    three stage calls, a mirror shorter than host raises ValueError and an argument past the
    mirror TypeError, with nothing written."""
    host, num_rows, width, table_offset, counts_offset = random_layout(
        np.random.default_rng(3), 1, 10, 4, 40, 1)
    rows = np.array([1, 2], np.int32)
    added = (rows, np.array([1, 1], np.int32), np.array([5, 6], np.int32))
    empty = (np.zeros(0, np.int32),) * 3
    data, sizes = pack_parts(np.zeros(0, np.int32), added, empty)
    args = (width, 1, table_offset, counts_offset, num_rows, 60)
    before = host.copy()
    for bad in [(0, 2, 2, 0, 0, 9), (0, -1, 2, 0, 0, 0), (0, 2, 1, 0, 0, 0), (0, 2, 2, 1, 0, 0)]:
        pairs = np.zeros(40, np.int32)
        assert native.stage_packed(host, pairs, 20, data, bad, *args) == -4
        np.testing.assert_array_equal(host, before)
        assert not pairs.any()
    with pytest.raises(TypeError, match="bytes"):
        native.stage_packed(host, np.zeros(40, np.int32), 20, bytearray(data), sizes, *args)
    with pytest.raises(TypeError, match="6 ints"):
        native.stage_packed(host, np.zeros(40, np.int32), 20, data, sizes[:5], *args)
    np.testing.assert_array_equal(host, before)
    for stage, stage_args in (
            (native.stage_packed, (host, np.zeros(40, np.int32), 20, data, sizes, *args)),
            (native.stage_group, (host, np.zeros(40, np.int32), 20, np.zeros(0, np.int32),
                                  *added, *empty, *args)),
            (native.stage_appends, (host, np.zeros(40, np.int32), *added[::2], *args))):
        with pytest.raises(ValueError, match="mirror is shorter"):
            stage(*stage_args, np.zeros(len(host) - 1, np.int32))
        with pytest.raises(TypeError, match="arguments"):
            stage(*stage_args, None, None)
    np.testing.assert_array_equal(host, before)
    assert native.stage_packed(host, np.zeros(40, np.int32), 20, data, sizes, *args) == 4


# ------------------------------------------------------------------ diff_rows
def model_diff_rows(rows, gen, start_gen, row_len, start_len, arena):
    cleared, a_rows, a_counts, a_ids, p_rows, p_counts, p_ids = [], [], [], [], [], [], []
    for row in rows:
        live, n, old = int(gen[row]), int(row_len[row]), int(start_len[row])
        if live == start_gen[row]:
            if live and n > old:
                p_rows.append(row)
                p_counts.append(n - old)
                p_ids += arena[row, old:n].tolist()
        elif live:
            a_rows.append(row)
            a_counts.append(n)
            a_ids += arena[row, :n].tolist()
        else:
            cleared.append(row)
    flat = cleared + a_rows + a_counts + p_rows + p_counts + p_ids + a_ids
    sizes = (len(cleared), len(a_rows), len(a_rows), len(p_rows), len(p_rows), len(p_ids))
    return flat, sizes, all(c == 1 for c in p_counts), max(a_counts, default=-1)


@needs_native
def test_diff_rows_equals_the_model():
    rng = np.random.default_rng(3)
    for _ in range(300):
        num_rows, width = int(rng.integers(1, 12)), int(rng.integers(1, 9))
        gen = rng.integers(0, 4, num_rows).astype(np.int64)  # 0: no holder
        start_gen = np.where(rng.random(num_rows) < 0.5, gen, rng.integers(0, 4, num_rows))
        row_len = rng.integers(0, width + 1, num_rows).astype(np.int64)
        start_len = np.minimum(row_len, rng.integers(0, width + 1, num_rows)).astype(np.int64)
        arena = rng.integers(0, 90, (num_rows, width)).astype(np.int32)
        rows = rng.permutation(num_rows)[: int(rng.integers(0, num_rows + 1))].tolist()
        flat, sizes, one_each, most = model_diff_rows(rows, gen, start_gen, row_len, start_len,
                                                      arena)
        data, got_sizes, got_one_each, got_most = native.diff_rows(
            rows, gen.data, start_gen.data, row_len.data, start_len.data, arena)
        assert np.frombuffer(data, np.int32).tolist() == flat
        assert (got_sizes, got_one_each, got_most) == (sizes, one_each, most)


@needs_native
def test_diff_rows_refuses_rows_outside_and_lengths_past_the_arena():
    gen = np.ones(3, np.int64)
    lens = np.array([1, 2, 9], np.int64)
    arena = np.zeros((3, 4), np.int32)
    with pytest.raises(IndexError, match="row 3 outside"):
        native.diff_rows([0, 3], gen, gen, lens, lens, arena)
    with pytest.raises(ValueError, match="row length outside"):
        native.diff_rows([2], gen, gen, lens, lens, arena)
    with pytest.raises(TypeError, match="arena must be a 2-D"):
        native.diff_rows([0], gen, gen, lens, lens, arena.ravel())


# ------------------------------------------------------------------ release_rows
def model_release_rows(ref_counts, arena, rows, row_len, num_skipped):
    """The freed ids in the order of their last reference; ref_counts written."""
    sequence = [int(arena[row, j]) for row in rows
                for j in range(int(row_len[row]) - 1, int(num_skipped[row]) - 1, -1)]
    for block in sequence:
        ref_counts[block] -= 1
    last = {block: i for i, block in enumerate(sequence)}
    return [block for i, block in enumerate(sequence)
            if ref_counts[block] == 0 and last[block] == i]


def _random_queue(rng, num_blocks):
    """(slots, position, tail) of a queue as release_rows takes it: random contents."""
    slots = rng.integers(0, num_blocks, 80).astype(np.int32)
    position = rng.integers(-1, 80, num_blocks).astype(np.int32)
    return slots, position, int(rng.integers(0, 81))


@needs_native
@pytest.mark.parametrize("mode", ["bytes", "cached", "uncached", "split"])
def test_release_rows_equals_the_model_and_undoes_an_underflow(mode):
    """The freed ids come back as bytes, or land in the given queues (by the record when
    split) past their tails with their positions; an underflow, or too little room past a
    given queue's tail, changes nothing."""
    rng = np.random.default_rng(4)
    for _ in range(300):
        num_rows, width, num_blocks = int(rng.integers(1, 10)), int(rng.integers(1, 8)), 30
        arena = rng.integers(1, num_blocks, (num_rows, width)).astype(np.int32)
        row_len = rng.integers(0, width + 1, num_rows).astype(np.int64)
        num_skipped = np.minimum(row_len, rng.integers(0, 3, num_rows)).astype(np.int64)
        rows = rng.permutation(num_rows)[: int(rng.integers(0, num_rows + 1))].tolist()
        refs = np.zeros(num_blocks, np.int32)
        for row in rows:  # every reference the rows hold, and sometimes one more elsewhere
            np.add.at(refs, arena[row, num_skipped[row] : row_len[row]], 1)
        refs += rng.integers(0, 2, num_blocks).astype(np.int32)
        short = rng.random() < 0.1 and refs.any()
        if short:  # a block with one reference too few: refused, every count as it was
            refs[rng.choice(np.flatnonzero(refs))] -= 1
        record = rng.integers(-1, 2, num_blocks).astype(np.int64)  # -1: holds no record
        queues = {k: _random_queue(rng, num_blocks) for k in ("cached", "uncached")}
        if mode == "bytes":
            extra = ()
        elif mode == "split":
            extra = (record, queues["cached"], queues["uncached"])
        else:
            extra = (None, *(queues[k] if k == mode else None for k in ("cached", "uncached")))
        given = [k for k in ("cached", "uncached") if mode in (k, "split")]
        total = int(sum(row_len[r] - num_skipped[r] for r in rows))
        want_refs = refs.copy()
        try:
            want = model_release_rows(want_refs, arena, rows, row_len, num_skipped)
            underflow = bool((want_refs < 0).any())
        except IndexError:
            underflow = True
        kept = [refs] + [a for k in given for a in (queues[k][0][: queues[k][2]], queues[k][1])]
        before = [a.copy() for a in kept]
        args = (refs, arena, rows, row_len.data, num_skipped.data, *extra)
        if any(queues[k][2] + total > 80 for k in given):  # no room: checked before any write
            assert native.release_rows(*args) is None
        elif underflow:
            with pytest.raises(RuntimeError, match="no reference left"):
                native.release_rows(*args)
        if any(queues[k][2] + total > 80 for k in given) or underflow:
            for now, was in zip(kept, before):
                np.testing.assert_array_equal(now, was)
            continue
        got = native.release_rows(*args)
        np.testing.assert_array_equal(refs, want_refs)
        if mode == "bytes":
            assert np.frombuffer(got, np.int32).tolist() == want
            continue
        split = {
            "cached": [b for b in want if mode == "cached" or (mode == "split" and record[b] >= 0)],
            "uncached": [b for b in want if mode == "uncached" or (mode == "split" and record[b] < 0)],
        }
        assert got == (len(split["cached"]), len(split["uncached"]))
        for k in given:
            slots, position, tail = queues[k]
            want_position = before[1 + 2 * given.index(k) + 1].copy()
            want_position[split[k]] = np.arange(tail, tail + len(split[k]))
            np.testing.assert_array_equal(slots[:tail], before[1 + 2 * given.index(k)])
            assert slots[tail : tail + len(split[k])].tolist() == split[k]
            np.testing.assert_array_equal(position, want_position)


@needs_native
def test_release_rows_refuses_bad_rows_and_ids_with_counts_unchanged():
    refs = np.ones(8, np.int32)
    arena = np.array([[1, 2], [3, 9]], np.int32)
    lens, skipped = np.array([2, 2], np.int64), np.zeros(2, np.int64)
    with pytest.raises(IndexError, match="row 2 outside"):
        native.release_rows(refs, arena, [0, 2], lens, skipped)
    with pytest.raises(ValueError, match="block id outside"):
        native.release_rows(refs, arena, [0, 1], lens, skipped)
    slots, position = np.zeros(8, np.int32), np.full(8, -1, np.int32)
    queue, record = (slots, position, 0), np.zeros(8, np.int64)
    with pytest.raises(ValueError, match="block id outside"):
        native.release_rows(refs, arena, [0, 1], lens, skipped, None, queue, None)
    with pytest.raises(ValueError, match="position shorter"):
        native.release_rows(refs, arena, [0], lens, skipped, None, (slots, position[:7], 0), None)
    with pytest.raises(ValueError, match="record or a position shorter"):
        native.release_rows(refs, arena, [0], lens, skipped, record[:7], queue, queue)
    with pytest.raises(ValueError, match="cached queue's tail is outside"):
        native.release_rows(refs, arena, [0], lens, skipped, None, (slots, position, 9), None)
    with pytest.raises(ValueError, match="both queues with a record, one without"):
        native.release_rows(refs, arena, [0], lens, skipped, record, queue, None)
    with pytest.raises(ValueError, match="both queues with a record, one without"):
        native.release_rows(refs, arena, [0], lens, skipped, None, queue, queue)
    with pytest.raises(TypeError, match="uncached must be None or a tuple"):
        native.release_rows(refs, arena, [0], lens, skipped, None, None, [slots, position, 0])
    with pytest.raises(TypeError, match="optionally record"):
        native.release_rows(refs, arena, [0], lens, skipped, None)
    assert refs.tolist() == [1] * 8
    assert slots.tolist() == [0] * 8 and position.tolist() == [-1] * 8


# ------------------------------------------------------------------ touch_rows
def model_touch_rows(touched, start_gen, gen, stamp, rows, order):
    """The journal's Python loop: first touches written, order appended; whether stale."""
    stale = False
    for row in rows:
        if touched[row] < stamp:
            touched[row], start_gen[row] = stamp, gen[row]
            order.append(row)
        elif touched[row] != stamp:
            stale = True
    return stale


@needs_native
def test_touch_rows_equals_the_model_and_refuses_a_row_outside():
    rng = np.random.default_rng(6)
    for _ in range(200):
        num_rows = int(rng.integers(1, 12))
        touched = rng.integers(0, 5, num_rows).astype(np.int64)
        start_gen = rng.integers(0, 100, num_rows).astype(np.int64)
        gen = rng.integers(0, 100, num_rows).astype(np.int64)
        stamp = int(rng.integers(1, 5))
        rows = rng.permutation(num_rows)[: int(rng.integers(0, num_rows + 1))].tolist()
        order = rng.integers(0, 9, int(rng.integers(0, 3))).tolist()
        want = touched.copy(), start_gen.copy(), list(order)
        want_stale = model_touch_rows(*want[:2], gen, stamp, rows, want[2])
        assert native.touch_rows(touched, start_gen, gen, stamp, rows, order) is want_stale
        np.testing.assert_array_equal(touched, want[0])
        np.testing.assert_array_equal(start_gen, want[1])
        assert order == want[2]
    before = touched.copy(), start_gen.copy(), list(order)
    with pytest.raises(IndexError, match=f"row {num_rows} outside"):
        native.touch_rows(touched, start_gen, gen, 99, [0, num_rows], order)
    with pytest.raises(IndexError, match="row -1 outside"):
        native.touch_rows(touched, start_gen, gen, 99, [-1], order)
    with pytest.raises(TypeError, match="touch_rows takes"):
        native.touch_rows(touched, start_gen, gen, 99, (0,), order)
    np.testing.assert_array_equal(touched, before[0])
    np.testing.assert_array_equal(start_gen, before[1])
    assert order == before[2]


# ------------------------------------------------------------------ keys_insert, keys_get
@needs_native
def test_keys_insert_refuses_with_nothing_changed():
    """Bad values, lengths that differ, a table whose length is not a power of two, a held or
    repeated key, and a table with no room: refused, and every array as it was."""
    entries = np.full(8, -1, np.int64)
    key_of_value, where = np.zeros(4, np.uint64), np.zeros(4, np.int64)
    keys = np.array([3, 11], np.uint64)  # both home at 3
    assert native.keys_insert(entries, key_of_value, where, keys, np.array([0, 1])) == 0
    assert entries[3] == 0 and entries[4] == 1 and where[:2].tolist() == [3, 4]
    before = entries.copy(), key_of_value.copy(), where.copy()
    cases = [
        (ValueError, "value 4 outside", (np.array([5], np.uint64), np.array([4]))),
        (ValueError, "differ in length", (np.array([5], np.uint64), np.array([2, 3]))),
    ]
    for error, match, (k, v) in cases:
        with pytest.raises(error, match=match):
            native.keys_insert(entries, key_of_value, where, k, v)
    with pytest.raises(ValueError, match="power of two"):
        native.keys_insert(entries[:6], key_of_value, where, keys[:1], np.array([2]))
    # held (11), and given twice (5 and 5): -1
    assert native.keys_insert(entries, key_of_value, where, np.array([6, 11], np.uint64),
                              np.array([2, 3])) == -1
    assert native.keys_insert(entries, key_of_value, where, np.array([5, 13, 5], np.uint64),
                              np.array([2, 3, 1])) == -1
    for now, was in zip((entries, key_of_value, where), before):
        np.testing.assert_array_equal(now, was)
    full = np.full(2, -1, np.int64)
    assert native.keys_insert(full, key_of_value, where, np.array([0, 1], np.uint64),
                              np.array([2, 3])) == 0
    with pytest.raises(ValueError, match="no empty position|no room"):
        native.keys_insert(full, key_of_value, where, np.array([2], np.uint64), np.array([0]))
    out = np.empty(3, np.int64)
    native.keys_get(entries, key_of_value, np.array([3, 11, 19], np.uint64), out)
    assert out.tolist() == [0, 1, -1]
    native.keys_get(full, key_of_value, np.array([2], np.uint64), out[:1])  # no empty: stops
    assert out[0] == -1


# ------------------------------------------------------------------ chain_prompts
@needs_native
def test_chain_prompts_equals_the_python_reference_keys():
    """Keys and chain states of several prompts' full blocks, against the plain-Python key
    reference and numpy's chain (block sizes 1 to 64, namespace seeds, any int64 ids)."""
    from blocktable.allocator.hashing import (
        ChainPowers,
        block_content_hashes,
        chain_keys,
        fast_block_keys,
        namespace_seed,
    )

    rng = np.random.default_rng(7)
    for bs in (1, 3, 16, 64):
        powers = ChainPowers(bs)
        for _ in range(10):
            prompts = [rng.integers(-(2**62), 2**62, int(rng.integers(0, 200)))
                       for _ in range(int(rng.integers(1, 5)))]
            seeds = np.array([namespace_seed(b"")] * len(prompts), np.uint64)
            total = sum(len(t) // bs for t in prompts)
            keys, states = np.empty(total, np.uint64), np.empty(total, np.uint64)
            native.chain_prompts(prompts, bs, powers.token_powers, powers.block_base, seeds,
                                 keys, states)
            want = [k for t in prompts for k in fast_block_keys(t.tolist(), bs)]
            assert keys.tolist() == want
            blocks = np.concatenate([t[: len(t) // bs * bs] for t in prompts]).reshape(-1, bs)
            counts = np.array([len(t) // bs for t in prompts])
            _, want_states = chain_keys(block_content_hashes(blocks, powers), counts, seeds,
                                        powers)
            assert states.tolist() == want_states.tolist()
    keys = np.zeros(2, np.uint64)
    with pytest.raises(ValueError, match="must hold the 1 full blocks"):
        native.chain_prompts([np.arange(16)], 16, powers.token_powers[:16], 1, seeds[:1], keys,
                             keys)
    with pytest.raises(ValueError, match="one per prompt"):
        native.chain_prompts([np.arange(16)], 64, powers.token_powers, 1, seeds[:2], keys, keys)
    assert keys.tolist() == [0, 0]


@needs_native
def test_chain_segments_equals_numpy_chain_keys():
    """Segments of blocks back to back (one block each, as a decode step, or several, or
    none), each from its own state: the same keys and states as numpy's hash and chain."""
    from blocktable.allocator.hashing import ChainPowers, block_content_hashes, chain_keys

    rng = np.random.default_rng(10)
    for bs in (1, 5, 16):
        powers = ChainPowers(bs)
        for _ in range(20):
            lengths = rng.integers(0 if rng.random() < 0.5 else 1, 4, int(rng.integers(1, 6)))
            n = int(lengths.sum())
            tokens = rng.integers(-(2**62), 2**62, (n, bs)).astype(np.int64)
            starts = rng.integers(0, 2**63, len(lengths)).astype(np.uint64)
            keys, states = np.empty(n, np.uint64), np.empty(n, np.uint64)
            native.chain_segments(tokens.reshape(-1), bs, powers.token_powers, powers.block_base,
                                  starts, lengths.astype(np.int64), keys, states)
            want_keys, want_states = chain_keys(block_content_hashes(tokens, powers),
                                                lengths.astype(np.int64), starts, powers)
            assert keys.tolist() == want_keys.tolist()
            assert states.tolist() == want_states.tolist()
    one = np.ones(1, np.int64)
    with pytest.raises(ValueError, match="lengths that disagree"):
        native.chain_segments(np.zeros(2 * bs, np.int64), bs, powers.token_powers, 1,
                              starts[:1], one, keys[:1], states[:1])
    with pytest.raises(ValueError, match="lengths that disagree"):
        native.chain_segments(np.zeros(bs, np.int64), bs, powers.token_powers, 1, starts[:1],
                              -one, keys[:0], states[:0])


@needs_native
def test_a_strided_prompt_is_keyed_like_its_copy():
    """A prompt given as a strided view (the compiled pass takes contiguous buffers only)
    gets the same keys, so the same prefix hits, as its contiguous copy."""
    from blocktable.allocator import AllocatorGroupSpec, KVCacheManager

    tokens = np.random.default_rng(8).integers(0, 1000, 256)
    mgr = KVCacheManager([AllocatorGroupSpec(16, 64)], 4)
    mgr.add_request("a", tokens.copy())
    mgr.allocate("a", 256)
    mgr.mark_computed("a", 256)
    strided = np.repeat(tokens, 2)[::2]
    assert not strided.flags.c_contiguous
    assert mgr.add_requests(["b", "c"], [strided, tokens[:200].copy()]) == [240, 192]


# ------------------------------------------------------------------ file_records
@needs_native
def test_file_records_equals_numpy_and_refuses_with_nothing_written():
    rng = np.random.default_rng(9)
    for _ in range(100):
        bs, capacity, num_blocks = int(rng.integers(1, 9)), int(rng.integers(1, 40)), 50
        n = int(rng.integers(0, capacity + 1))
        slots = rng.permutation(capacity)[:n].astype(np.int64)
        block_ids = rng.permutation(num_blocks)[:n].astype(np.int32)
        parent_ids = rng.integers(-5, 100, n).astype(np.int64)
        tokens = rng.integers(-(2**40), 2**40, (n, bs)).astype(np.int64)
        first_cid = int(rng.integers(1, 1000))
        arrays = [rng.integers(-9, 9, capacity).astype(np.int64),  # cid
                  rng.integers(-9, 9, capacity).astype(np.int64),  # parent
                  rng.integers(-9, 9, capacity).astype(np.int32),  # holder
                  rng.integers(-9, 9, (capacity, bs)).astype(np.int64),  # index tokens
                  rng.integers(-9, 9, num_blocks).astype(np.int64)]  # record
        want = [a.copy() for a in arrays]
        want[0][slots] = np.arange(first_cid, first_cid + n)
        want[1][slots] = parent_ids
        want[2][slots] = block_ids
        want[3][slots] = tokens
        want[4][block_ids] = slots
        native.file_records(slots, first_cid, parent_ids, block_ids, tokens.reshape(-1),
                            *arrays)
        for got, expected in zip(arrays, want):
            np.testing.assert_array_equal(got, expected)
    before = [a.copy() for a in arrays]
    one = np.zeros(1, np.int64)
    bad = [
        (np.array([capacity], np.int64), np.zeros(1, np.int32), "slot or block id outside"),
        (one, np.array([num_blocks], np.int32), "slot or block id outside"),
        (one, np.zeros(2, np.int32), "lengths that disagree"),
    ]
    for bad_slots, bad_blocks, match in bad:
        with pytest.raises(ValueError, match=match):
            native.file_records(bad_slots, 1, one, bad_blocks, np.zeros(bs, np.int64), *arrays)
    with pytest.raises(ValueError, match="lengths that disagree"):  # a token row too short
        native.file_records(one, 1, one, np.zeros(1, np.int32), np.zeros(bs + 1, np.int64),
                            *arrays)
    for got, was in zip(arrays, before):
        np.testing.assert_array_equal(got, was)


# ------------------------------------------------------------------ queue_extend
@needs_native
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_queue_extend_writes_slots_and_positions(dtype):
    rng = np.random.default_rng(5)
    for _ in range(100):
        slots = rng.integers(0, 9, 40).astype(np.int32)
        position = rng.integers(-1, 9, 20).astype(np.int32)
        tail = int(rng.integers(0, 30))
        ids = rng.permutation(20)[: int(rng.integers(0, 11))].astype(dtype)
        want_slots, want_position = slots.copy(), position.copy()
        if tail + len(ids) > len(slots):
            with pytest.raises(ValueError, match="no room"):
                native.queue_extend(slots, position, ids, tail)
        else:
            want_slots[tail : tail + len(ids)] = ids
            want_position[ids] = np.arange(tail, tail + len(ids))
            assert native.queue_extend(slots, position, ids, tail) == tail + len(ids)
        np.testing.assert_array_equal(slots, want_slots)
        np.testing.assert_array_equal(position, want_position)
    with pytest.raises(ValueError, match="id 20 outside"):
        native.queue_extend(slots, position, np.array([3, 20]), 0)
    np.testing.assert_array_equal(slots, want_slots)  # nothing written


# ------------------------------------------------------------------ graph_launch
@needs_native
def test_graph_launch_launches_nothing_unless_the_context_given_is_current():
    """graph_launch returns -1 and launches nothing (its exec handle is never read) for a
    context of 0 or one that is not the thread's current one; cuda_context() is -1 where the
    process never loaded the CUDA driver (a CPU build of torch)."""
    import torch

    context = native.cuda_context()
    assert isinstance(context, int) and context >= -1
    if torch.version.cuda is None:
        assert context == -1
    bogus_exec = 0x1234
    assert native.graph_launch(bogus_exec, 0, 0) == -1
    other = context + 16 if context > 0 else 16
    assert native.graph_launch(bogus_exec, 0, other) == -1
    with pytest.raises(TypeError, match="3 arguments"):
        native.graph_launch(bogus_exec, 0)
    with pytest.raises(TypeError):
        native.graph_launch("exec", 0, other)
