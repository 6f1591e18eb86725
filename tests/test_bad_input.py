"""Every bad input: a clear exception naming the argument, and nothing changed."""

from __future__ import annotations

import pytest
import torch
from table_model import assert_unchanged, snapshot

from blocktable import CPConfig, GroupSpec, MultiGroupBlockTable, RowBlocks, StepUpdate

pytestmark = pytest.mark.usefixtures("compiled_mode")  # compiled, then numpy


@pytest.fixture
def bt():
    table = MultiGroupBlockTable(
        [GroupSpec(16, num_blocks=100), GroupSpec(32, kernel_block_size=16, num_blocks=100)],
        max_num_reqs=4, max_model_len=256, max_num_batched_tokens=32,
    )
    table.add_row(([1, 2], [3]), 0)
    table.add_row(([4], [5]), 1)
    table.commit()
    table.append_row(([6], [7]), 0)  # an uncommitted change must survive rejected calls too
    return table


def rejected(bt, exc, match, fn, *args, **kwargs):
    before = snapshot(bt)
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)
    assert_unchanged(before, bt)


def test_append_past_row_width(bt):
    width0 = bt[0].width  # 16 manager blocks of 16 tokens for 256 tokens
    rejected(bt, ValueError, "row width", bt.append_row, (list(range(1, width0)), []), 0)
    rejected(bt, ValueError, "row width", bt[1].append_row, list(range(1, 9)), 0)


def test_block_id_out_of_range(bt):
    rejected(bt, ValueError, r"block_ids\[0\] holds block id -1", bt.add_row, ([-1], [1]), 2)
    rejected(bt, ValueError, r"block_ids\[1\] holds block id 100, outside \[0, 100\)",
             bt.append_row, ([1], [100]), 2)
    rejected(bt, TypeError, "must hold integers", bt.add_row, ([1.5], [1]), 2)


def test_row_index_out_of_range(bt):
    rejected(bt, IndexError, r"row_idx=4 is out of range \[0, 4\)", bt.add_row, ([1], [1]), 4)
    rejected(bt, IndexError, r"row_idx=-1", bt.clear_row, -1)
    rejected(bt, IndexError, r"tgt=9", bt.move_row, 0, 9)
    rejected(bt, IndexError, r"src=7", bt.swap_row, 7, 0)
    rejected(bt, TypeError, "row_idx must be an int", bt.append_row, ([1], [1]), 1.0)


def test_batched_update_rejected_whole(bt):
    upd = StepUpdate.make(2, cleared_rows=[1],
                          added=[RowBlocks.from_lists([2], [[9]]), RowBlocks.from_lists([2], [[8]])],
                          appended=[RowBlocks.from_lists([3], [[1]]),
                                    RowBlocks.from_lists([3], [[200]])])  # bad id in group 1
    rejected(bt, ValueError, r"appended\[1\].block_ids holds block id 200", bt.apply, upd)
    upd = StepUpdate.make(2, cleared_rows=[5])
    rejected(bt, IndexError, r"cleared_rows holds row 5", bt.apply, upd)
    upd = StepUpdate.make(2, appended=[RowBlocks.from_lists([0, 0], [[1], [2]]), RowBlocks()])
    rejected(bt, ValueError, "lists a row twice", bt.apply, upd)
    upd = StepUpdate.make(2, added=[RowBlocks(rows=torch.tensor([1]).numpy().astype("int32"),
                                              num_manager_blocks=torch.tensor([2]).numpy(),
                                              block_ids=torch.tensor([3]).numpy()), RowBlocks()])
    rejected(bt, ValueError, "num_manager_blocks sums to 2", bt.apply, upd)


def test_num_reqs_over_max(bt):
    rejected(bt, IndexError, "num_reqs=5", bt.commit, 5)
    rejected(bt, IndexError, "num_reqs=5", bt.device_view, 0, 5)
    qsl = torch.zeros(6, dtype=torch.int32)
    rejected(bt, ValueError, "more than max_num_reqs=4", bt.compute_slot_mapping, qsl,
             torch.zeros(0, dtype=torch.int64))


def test_too_many_tokens(bt):
    qsl = torch.tensor([0, 33], dtype=torch.int32)
    rejected(bt, ValueError, "33 tokens, more than max_num_batched_tokens=32",
             bt.compute_slot_mapping, qsl, torch.arange(33))


def test_slot_inputs_dtype_device_shape(bt):
    pos = torch.arange(3)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    rejected(bt, TypeError, "query_start_loc must have dtype torch.int32",
             bt.compute_slot_mapping, qsl.long(), pos)
    rejected(bt, TypeError, "positions must have dtype torch.int64",
             bt.compute_slot_mapping, qsl, pos.int())
    rejected(bt, ValueError, "positions must be 1-D", bt.compute_slot_mapping, qsl,
             pos.view(1, 3))
    rejected(bt, ValueError, "query_start_loc must be 1-D", bt.compute_slot_mapping,
             qsl.view(1, 2), pos)
    rejected(bt, TypeError, "query_start_loc must be a torch.Tensor", bt.compute_slot_mapping,
             [0, 3], pos)
    if torch.cuda.is_available():
        rejected(bt, ValueError, "positions must be on device cpu", bt.compute_slot_mapping,
                 qsl, pos.cuda())
    rejected(bt, ValueError, "end at num_tokens=3", bt.compute_slot_mapping,
             torch.tensor([0, 2], dtype=torch.int32), pos)
    rejected(bt, ValueError, "decreasing", bt.compute_slot_mapping,
             torch.tensor([0, 2, 1, 3], dtype=torch.int32), pos)
    rejected(bt, ValueError, "row_of_batch must have shape", bt.compute_slot_mapping, qsl, pos,
             row_of_batch=torch.zeros(2, dtype=torch.int32))
    rejected(bt, IndexError, "row_of_batch holds row 4, outside", bt.compute_slot_mapping, qsl,
             pos, row_of_batch=torch.tensor([4], dtype=torch.int32))


def test_slot_inputs_checked_against_host_mirror(bt):
    """On CUDA the host mirror of query_start_loc is what makes the check free."""
    pos = torch.arange(3)
    rejected(bt, ValueError, "end at num_tokens=3", bt.compute_slot_mapping,
             torch.tensor([0, 3], dtype=torch.int32), pos,
             query_start_loc_cpu=torch.tensor([0, 2], dtype=torch.int32))


def test_construction_errors():
    with pytest.raises(ValueError, match="kernel_block_size=12 must divide block_size=32"):
        GroupSpec(32, kernel_block_size=12)
    with pytest.raises(ValueError, match=r"cp rank=2 is out of range \[0, world_size=2\)"):
        CPConfig(2, 2)
    with pytest.raises(ValueError, match="dcp_rank=4"):
        CPConfig.from_dcp_pcp(dcp_world_size=4, dcp_rank=4)
    with pytest.raises(ValueError, match="cp interleave=48 must divide block_size=32"):
        MultiGroupBlockTable([GroupSpec(32)], 2, 256, 8, cp=CPConfig(2, 0, 48))
    with pytest.raises(ValueError, match="max_model_len is required"):
        MultiGroupBlockTable([GroupSpec(16)], 2)
    with pytest.raises(ValueError, match="max_num_reqs must be >= 1"):
        MultiGroupBlockTable([GroupSpec(16)], 0, 256)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        GroupSpec(0)
    with pytest.raises(ValueError, match="backend must be one of"):
        MultiGroupBlockTable([GroupSpec(16)], 2, 256, backend="cuda")


def test_pad_rows_must_be_empty(bt):
    with pytest.raises(ValueError, match="pad row 1 .* is not an empty committed row"):
        bt.device_view(0, 1, 3)
    bt.commit()
    view = bt.device_view(0, 2, 4)
    assert view.shape == (4, bt[0].width) and not view[2:].any()


def test_commit_after_rejected_batch_moves_nothing_extra(bt):
    upd = StepUpdate.make(2, cleared_rows=[0, 1],
                          added=[RowBlocks.from_lists([2], [[9] * 99]), RowBlocks()])
    rejected(bt, ValueError, "row width", bt.apply, upd)
    stats = bt.commit()  # only the append made in the fixture: 1 id + 2 kernel ids + 2 counts
    assert stats.num_entries == 5 and not stats.full_copy
    assert bt.device_equals_host()
    assert bt.commit().num_entries == 0


def test_reading_the_device_table_before_commit_names_commit():
    """Rows changed on the host and not committed: every call that reads the device table
    raises an error that names commit(), instead of reading stale rows; after commit() the
    same calls work."""
    bt = MultiGroupBlockTable([GroupSpec(block_size=4)], 2, 32, max_num_batched_tokens=8)
    bt.add_row(([7, 9],), 0)
    qsl, pos = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3, 4, 5])
    calls = [
        lambda: bt.compute_slot_mapping(qsl, pos),
        lambda: bt.device_view(0, 1),
        lambda: bt.gather_view(0, torch.tensor([0], dtype=torch.int32)),
        lambda: bt.build_metadata(qsl, [None], num_tokens=3),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"commit\(\)"):
            call()
    bt.commit()
    assert bt.compute_slot_mapping(qsl, pos)[0][:4].tolist() == [31, 36, 37, -1]
    for call in calls[1:]:
        call()
