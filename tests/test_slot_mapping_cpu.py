"""The CPU slot mapping (numpy on the tensors' memory) against the reference, exactly, on fresh
random inputs, including inputs the public call would reject (it must never crash or read
outside the table), and its output buffer's fixed address."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktable import PAD_SLOT_ID, CPConfig, GroupSpec, MultiGroupBlockTable, RowBlocks, StepUpdate
from blocktable.slot_mapping import slot_mapping_reference, slot_mapping_torch

pytestmark = pytest.mark.usefixtures("compiled_mode")  # compiled, then numpy

MAX_REQS, MAX_TOKENS = 8, 128
SPECS = [
    [GroupSpec(16)],
    [GroupSpec(16), GroupSpec(32, 16), GroupSpec(12, 4)],  # pow2 and not, kernel blocks
]


def random_table(specs, rng, cp=None):
    bt = MultiGroupBlockTable(specs, MAX_REQS, 2048, MAX_TOKENS, "cpu", cp=cp)
    rows = np.arange(MAX_REQS, dtype=np.int32)
    added = []
    for t in bt.tables:
        num = rng.integers(0, t.width // t.k + 1, MAX_REQS).astype(np.int32)
        ids = rng.integers(0, 5000, int(num.sum())).astype(np.int32)  # nulls included
        added.append(RowBlocks(rows, num, ids))
    bt.apply(StepUpdate.make(len(specs), added=added))
    bt.commit()
    return bt


def reference(bt, qsl, pos, rows):
    out = []
    for p, t in zip(bt.slot_params, bt.tables):
        keep = None if rows is None else (rows >= 0) & (rows < MAX_REQS)
        r = None if rows is None else np.where(keep, rows, 0)
        want = slot_mapping_reference(
            t.block_table_np, t.num_kernel_blocks, qsl, pos, max_num_tokens=MAX_TOKENS,
            kernel_block_size=p.kernel_block_size, manager_block_size=p.manager_block_size,
            cp_world_size=p.cp_world_size, cp_rank=p.cp_rank, cp_interleave=p.cp_interleave,
            row_of_batch=r,
        )
        if rows is not None:  # an out-of-range row is an empty row: all of its tokens PAD
            for i in np.flatnonzero(~keep):
                want[qsl[i] : qsl[i + 1]] = PAD_SLOT_ID
        out.append(want)
    return np.stack(out)


def random_batch(rng, indexed, bad_rows=False):
    num_reqs = int(rng.integers(0, MAX_REQS + 1))
    q_lens = rng.integers(0, 24, num_reqs) * (rng.random(num_reqs) < 0.7) + (
        rng.random(num_reqs) < 0.5)
    while q_lens.sum() > MAX_TOKENS:
        q_lens = q_lens // 2
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = rng.integers(-3, 1400, int(qsl[-1])).astype(np.int64)  # negatives and past rows
    rows = None
    if indexed:
        rows = rng.permutation(MAX_REQS)[:num_reqs].astype(np.int32)
        if bad_rows and num_reqs:
            rows[rng.integers(0, num_reqs)] = rng.choice([-1, MAX_REQS, 2**31 - 1])
    return qsl, pos, rows


@pytest.mark.parametrize("specs", SPECS, ids=["one group", "three groups"])
@pytest.mark.parametrize("world", [1, 2])
def test_random_batches_match_reference(specs, world):
    rng = np.random.default_rng(world + len(specs))
    for rank in range(world):
        cp = CPConfig(world, rank, interleave=int(rng.choice([1, 4]))) if world > 1 else None
        bt = random_table(specs, rng, cp)
        for trial in range(40):
            qsl, pos, rows = random_batch(rng, indexed=trial % 2 == 1)
            got = bt.compute_slot_mapping(
                torch.from_numpy(qsl), torch.from_numpy(pos),
                row_of_batch=None if rows is None else torch.from_numpy(rows),
            )
            want = reference(bt, qsl, pos, rows)
            for g in range(len(specs)):
                np.testing.assert_array_equal(got[g].numpy(), want[g])


def test_rows_outside_the_table_are_empty_rows():
    """Called directly (no host-side check in front), a bad ``row_of_batch`` entry never
    crashes and never reads outside the table: its tokens are PAD."""
    rng = np.random.default_rng(5)
    bt = random_table(SPECS[1], rng)
    for _ in range(40):
        qsl, pos, rows = random_batch(rng, indexed=True, bad_rows=True)
        out = torch.zeros(len(bt.slot_params), MAX_TOKENS, dtype=torch.int64)
        slot_mapping_torch(bt.storage.device_tensor, bt.slot_params, torch.from_numpy(qsl),
                           torch.from_numpy(pos), torch.from_numpy(rows), out,
                           max_num_reqs=MAX_REQS)
        np.testing.assert_array_equal(out.numpy(), reference(bt, qsl, pos, rows))


def test_malformed_query_start_loc_never_reads_outside():
    """A ``query_start_loc`` that does not cover the tokens: uncovered tokens are PAD."""
    rng = np.random.default_rng(6)
    bt = random_table(SPECS[0], rng)
    pos = torch.arange(10, dtype=torch.int64)
    for qsl in ([2, 5, 7], [0, 4], [3, 3], [0, 12]):
        q = np.array(qsl, np.int32)
        out = torch.zeros(1, MAX_TOKENS, dtype=torch.int64)
        slot_mapping_torch(bt.storage.device_tensor, bt.slot_params, torch.from_numpy(q), pos,
                           None, out, max_num_reqs=MAX_REQS)
        t = bt.tables[0]
        want = np.full(MAX_TOKENS, PAD_SLOT_ID, np.int64)
        for r in range(len(q) - 1):
            for tok in range(q[r], min(q[r + 1], 10)):
                want[tok] = slot_mapping_reference(
                    t.block_table_np, t.num_kernel_blocks, np.array([0, 1], np.int32),
                    pos.numpy()[tok : tok + 1], max_num_tokens=1, kernel_block_size=16,
                    manager_block_size=16, row_of_batch=np.array([r], np.int32))[0]
        np.testing.assert_array_equal(out.numpy()[0], want)


def test_buffers_keep_their_address_across_steps():
    """The slot buffers, the device table and the CPU commit write in place, step after step."""
    rng = np.random.default_rng(7)
    bt = random_table(SPECS[1], rng)
    ptrs = [bt.storage.device_tensor.data_ptr()] + [
        s.data_ptr() for s in bt.compute_slot_mapping(
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3]))
    ]
    for step in range(5):
        bt.apply(StepUpdate.make(3, appended=[RowBlocks.from_lists([step], [[9]])] * 3))
        bt.commit()
        qsl, pos, _ = random_batch(rng, indexed=False)
        slots = bt.compute_slot_mapping(torch.from_numpy(qsl), torch.from_numpy(pos))
        assert [bt.storage.device_tensor.data_ptr()] + [s.data_ptr() for s in slots] == ptrs


def test_more_requests_than_rows_condensed():
    """Condensed mode, called directly with more requests than rows: the extra ones are PAD."""
    rng = np.random.default_rng(8)
    bt = random_table(SPECS[0], rng)
    qsl = np.arange(MAX_REQS + 3, dtype=np.int32)
    pos = rng.integers(0, 300, MAX_REQS + 2).astype(np.int64)
    out = torch.zeros(1, MAX_TOKENS, dtype=torch.int64)
    slot_mapping_torch(bt.storage.device_tensor, bt.slot_params, torch.from_numpy(qsl),
                       torch.from_numpy(pos), None, out, max_num_reqs=MAX_REQS)
    rows = np.arange(MAX_REQS + 2, dtype=np.int32)  # rows 8 and 9 lie outside the table
    np.testing.assert_array_equal(out.numpy(), reference(bt, qsl, pos, rows))
