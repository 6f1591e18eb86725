"""Incremental commit: only changes travel; the device equals the host after every commit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktable import BlockTable, GroupSpec, MultiGroupBlockTable, RowBlocks, StepUpdate


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_step_moves_only_new_ids(backend, triton_device):
    device = "cpu" if backend == "torch" else triton_device
    bt = MultiGroupBlockTable([GroupSpec(16)], 64, 16 * 512, 64, device, backend=backend)
    rng = np.random.default_rng(0)
    for r in range(64):
        bt.add_row((rng.integers(1, 10**6, 100).tolist(),), r)
    first = bt.commit()
    assert first.full_copy  # 6400 ids + counts outgrow the 1024-entry staging: row spans
    assert bt.device_equals_host()
    rows = rng.choice(64, 8, replace=False)
    bt.apply(StepUpdate.make(1, appended=[RowBlocks.from_lists(rows, [[7]] * 8)]))
    stats = bt.commit()
    assert (stats.num_entries, stats.bytes_h2d, stats.full_copy) == (16, 128, False)
    assert bt.device_equals_host()
    assert bt.commit().num_entries == 0  # nothing changed, nothing moves


def test_decode_1024_steady_state_bytes():
    """A decode step of 1024 rows x 8192 wide where 64 rows gain a block moves far under 64 KiB."""
    bt = BlockTable(16, 1024, max_model_len=131072, max_num_batched_tokens=8192)
    assert bt.width == 8192
    rng = np.random.default_rng(1)
    rows = rng.choice(1024, 64, replace=False)
    bt.owner.apply(StepUpdate.make(1, appended=[RowBlocks.from_lists(rows, [[5]] * 64)]))
    stats = bt.owner.commit()
    assert stats.bytes_h2d == 64 * 2 * 8 <= 64 * 1024
    # staging (two pinned buffers of idx+value) stays within 15% of the table's bytes
    table_bytes = 1024 * 8192 * 4
    assert bt.owner.committer._staging_host.numel() * 4 <= 0.15 * table_bytes


@pytest.mark.parametrize("staging", [1, 4, 64])
def test_random_ops_keep_device_equal(staging, triton_device):
    """Random row ops with tiny to ample staging: scatter and span paths both stay exact."""
    rng = np.random.default_rng(staging)
    bts = [
        MultiGroupBlockTable([GroupSpec(4, max_num_blocks=6), GroupSpec(8, 4, max_num_blocks=3)],
                             6, None, 8, dev, backend=be, commit_staging_entries=staging)
        for dev, be in (("cpu", "torch"), (triton_device, "triton"))
    ]
    for _ in range(60):
        op = rng.integers(0, 5)
        row, other = (int(x) for x in rng.integers(0, 6, 2))
        for bt in bts:
            if op == 0:
                bt.add_row((list(range(1, 1 + row % 6)), [9] * (other % 3)), row)
            elif op == 1 and bt[0].num_kernel_blocks[row] < 5 and bt[1].num_kernel_blocks[row] < 6:
                bt.append_row(([3], [4]), row)
            elif op == 2:
                bt.move_row(row, other)
            elif op == 3:
                bt.swap_row(row, other)
            else:
                bt.clear_row(row)
            if rng.random() < 0.4:
                bt.commit()
                assert bt.device_equals_host()
    for bt in bts:
        bt.commit()
        assert bt.device_equals_host()
    np.testing.assert_array_equal(bts[0].storage.host, bts[1].storage.host)


def test_single_group_blocktable_api():
    bt = BlockTable(block_size=32, max_num_reqs=3, max_model_len=256,
                    max_num_batched_tokens=16, kernel_block_size=16)
    bt.add_row([2, 3], 0)
    bt.append_row([], 0)  # no-op
    bt.append_row([4], 0)
    bt.move_row(0, 2)
    assert bt.row(2).tolist() == [4, 5, 6, 7, 8, 9] and bt.row(0).tolist() == []
    bt.commit()
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    # condensed mode: batch entry 0 is row 0, which is now empty -> PAD
    assert bt.compute_slot_mapping(qsl, torch.tensor([0, 70]))[:2].tolist() == [-1, -1]
    bt.swap_row(2, 0)
    bt.commit()
    assert bt.compute_slot_mapping(qsl, torch.tensor([0, 70]))[:2].tolist() == [64, 8 * 16 + 6]
    assert bt.get_device_tensor(1).shape == (1, bt.width)


def test_single_group_apply_matches_multi_group_path():
    """A one-group table applies updates in one compiled call; it must agree with the
    check-all-then-write path, rejections included."""
    rng = np.random.default_rng(7)
    # block 128: explicit widths stay as given (a row of 4 blocks already spans 128 tokens)
    spec = GroupSpec(128, kernel_block_size=64, max_num_blocks=4, num_blocks=30)
    one = MultiGroupBlockTable([spec], 6, None, 8)
    two = MultiGroupBlockTable([spec, GroupSpec(128, max_num_blocks=2)], 6, None, 8)
    accepted = rejected = 0
    for _ in range(300):
        rows = rng.choice(6, int(rng.integers(0, 4)), replace=False)
        nums = rng.integers(0, 3, len(rows))
        ids = rng.integers(-1 if rng.random() < 0.1 else 0, 31, int(nums.sum()))
        part = RowBlocks(rows.astype(np.int32), nums.astype(np.int32), ids.astype(np.int32))
        cleared = rng.choice(6, int(rng.integers(0, 2))).astype(np.int32)
        kind = rng.integers(0, 2)
        upd1 = StepUpdate.make(1, cleared_rows=cleared, **{("added", "appended")[kind]: [part]})
        upd2 = StepUpdate.make(2, cleared_rows=cleared,
                               **{("added", "appended")[kind]: [part, RowBlocks()]})
        errors = []
        for bt, upd in ((one, upd1), (two, upd2)):
            before = bt.storage.host.copy()
            try:
                bt.apply(upd)
                errors.append(None)
            except (ValueError, IndexError) as e:
                errors.append(type(e))
                np.testing.assert_array_equal(bt.storage.host, before)
        assert errors[0] == errors[1]
        accepted += errors[0] is None
        rejected += errors[0] is not None
        np.testing.assert_array_equal(one[0].block_table_np, two[0].block_table_np)
        np.testing.assert_array_equal(one[0].num_kernel_blocks, two[0].num_kernel_blocks)
        if rng.random() < 0.3:
            for bt in (one, two):
                bt.commit()
                assert bt.device_equals_host()
    assert accepted > 50 and rejected > 20


def test_device_addresses_are_fixed(device):
    """CUDA graphs capture addresses: no operation may reallocate a device buffer."""
    bt = MultiGroupBlockTable([GroupSpec(16), GroupSpec(32, 16)], 4, 512, 16, device,
                              commit_staging_entries=4)
    views = [bt.device_view(g, 4).data_ptr() for g in range(2)] + [
        bt.slot_mapping(g).data_ptr() for g in range(2)]
    assert bt.storage.pinned == torch.cuda.is_available()
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for r in range(4):
        bt.add_row((list(range(1, 9)), list(range(1, 5))), r)  # beyond staging: span copies
        bt.commit()
        bt.append_row(([20], []), r)
        bt.commit()
        bt.compute_slot_mapping(qsl, torch.tensor([3], device=device))
    bt.clear()
    bt.commit()
    assert [bt.device_view(g, 4).data_ptr() for g in range(2)] + [
        bt.slot_mapping(g).data_ptr() for g in range(2)] == views
    assert bt.device_equals_host()
