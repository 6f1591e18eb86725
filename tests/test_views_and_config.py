"""Row widths, device views, padding, encoder-only placeholders, state indices, indexed gather."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktable import CPConfig, GroupSpec, MultiGroupBlockTable, row_width


@pytest.mark.parametrize(
    ("block_size", "kernel", "max_model_len", "world", "want"),
    [
        (16, None, 131072, 1, 8192),  # 128K context at block 16: width 8192
        (16, None, 100, 1, 8),  # 7 blocks -> multiple of 8 blocks (128 tokens)
        (32, 16, 100, 1, 8),  # 4 manager blocks aligned to 4, x2 kernel blocks
        (1, None, 130, 1, 256),  # 130 -> multiple of 128
        (256, None, 1000, 1, 4),  # a block over 128 tokens: no extra alignment
        (16, None, 1000, 2, 32),  # CP halves the tokens per rank: 32 blocks -> 32
        (64, None, 1000, 4, 4),  # 4 -> multiple of 2
    ],
)
def test_row_width(block_size, kernel, max_model_len, world, want):
    spec = GroupSpec(block_size, kernel)
    assert row_width(spec, max_model_len, CPConfig(world, 0)) == want


def test_explicit_max_num_blocks_overrides():
    # 5 manager blocks of 32 tokens, aligned to 128 tokens: 8, i.e. 16 kernel blocks
    assert row_width(GroupSpec(32, 16, max_num_blocks=5), 10**6, CPConfig()) == 16


def test_cp_from_dcp_pcp():
    cp = CPConfig.from_dcp_pcp(dcp_world_size=4, dcp_rank=3, pcp_world_size=2, pcp_rank=1,
                               interleave=8)
    assert (cp.world_size, cp.rank, cp.interleave) == (8, 7, 8)
    with pytest.raises(TypeError, match="ProcessGroup"):
        CPConfig.from_process_group(None)  # never the default group implicitly


def test_unsharded_group_ignores_cp():
    bt = MultiGroupBlockTable([GroupSpec(16), GroupSpec(16, cp_sharded=False)], 2, 1024, 8,
                              cp=CPConfig(2, 1, 1))
    assert bt[0].width == 32 and bt[1].width == 64
    assert bt.slot_params[1].cp_world_size == 1


def test_encoder_only_placeholder_and_device_view(device):
    bt = MultiGroupBlockTable([GroupSpec(16), GroupSpec(16, kind="encoder_only")], 4, 256, 8,
                              device)
    bt.add_row(([3, 4], []), 0)
    bt.commit()
    enc = bt.device_view(1, 1, 3)
    assert enc.shape == (3, 1) and not enc.any()
    view = bt.device_view(0, 1, 3).cpu()
    assert view[0, :2].tolist() == [3, 4] and not view[1:].any()
    with pytest.raises(ValueError, match="encoder-only"):
        bt[1]


def test_gather_view_indexed(device):
    rng = np.random.default_rng(0)
    bt = MultiGroupBlockTable([GroupSpec(16), GroupSpec(32, 16)], 6, 256, 8, device)
    for r in range(6):
        bt.add_row((rng.integers(1, 50, r).tolist(), rng.integers(1, 50, r // 2).tolist()), r)
    bt.commit()
    rows = torch.tensor([4, 0, 5], dtype=torch.int32, device=device)
    for g in range(2):
        got = bt.gather_view(g, rows, 5).cpu().numpy()
        host = bt[g].block_table_np
        np.testing.assert_array_equal(got[:3], host[[4, 0, 5]])
        assert not got[3:].any()


def test_gather_view_triton_matches(triton_device):
    bt = MultiGroupBlockTable([GroupSpec(16)], 5, 2048, 8, triton_device, backend="triton")
    for r in range(5):
        bt.add_row((list(range(1 + r, 1 + r + 3 * r)),), r)
    bt.commit()
    rows = torch.tensor([3, 1], dtype=torch.int32, device=triton_device)
    bt.gather_view(0, torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=triton_device), 4)
    got = bt.gather_view(0, rows, 4).cpu().numpy()  # stale rows 2..3 must become null
    np.testing.assert_array_equal(got[:2], bt[0].block_table_np[[3, 1]])
    assert not got[2:].any()


def state_reference(table, counts, seq_lens, block_size, num_cols, padded, rows):
    out = np.zeros((padded, num_cols), np.int32)
    for i, s in enumerate(seq_lens):
        r = rows[i]
        first = max(0, (int(s) - 1) // block_size)
        for c in range(num_cols):
            j = first + c
            out[i, c] = table[r, j] if j < counts[r] else 0
    return out


@pytest.mark.parametrize("num_spec", [0, 2])
@pytest.mark.parametrize("indexed", [False, True])
def test_state_indices(device, num_spec, indexed):
    rng = np.random.default_rng(num_spec)
    bt = MultiGroupBlockTable([GroupSpec(16), GroupSpec(8, kind="state")], 5, 256, 8, device)
    for r in range(5):
        bt.add_row(([1], rng.integers(1, 90, int(rng.integers(0, 8))).tolist()), r)
    bt.commit()
    seq_lens = np.array([0, 1, 8, 9, 40], np.int32)[: 4 if indexed else 5]
    rows = np.array([4, 2, 0, 3], np.int32) if indexed else np.arange(5)
    got = bt.state_indices(
        1, torch.from_numpy(seq_lens).to(device), 5, num_speculative_blocks=num_spec,
        row_of_batch=torch.from_numpy(rows).to(device) if indexed else None).cpu().numpy()
    want = state_reference(bt[1].block_table_np, bt[1].num_kernel_blocks, seq_lens, 8,
                           1 + num_spec, 5, rows)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("indexed", [False, True])
def test_build_metadata_shares_common_fields(indexed):
    specs = [GroupSpec(16), GroupSpec(16), GroupSpec(32, 16), GroupSpec(16, kind="encoder_only")]
    bt = MultiGroupBlockTable(specs, 4, 256, 16)
    bt.add_row(([1, 2], [3, 4], [5], []), 2)
    bt.add_row(([6], [7], [8], []), 0)
    bt.commit()
    rows = torch.tensor([2, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    pos = torch.tensor([20, 3])
    if not indexed:
        bt.swap_row(0, 2)  # condensed: batch entry i is row i
        bt.move_row(2, 1)
        bt.commit()
    slots = bt.compute_slot_mapping(qsl, pos, row_of_batch=rows if indexed else None)
    metas = bt.build_metadata(qsl, slots, num_tokens=2, num_reqs_padded=3,
                              row_of_batch=rows if indexed else None)
    assert [m.group for m in metas] == [0, 1, 2, 3]
    assert all(m.query_start_loc is metas[0].query_start_loc for m in metas)
    first = [2, 0] if indexed else [0, 1]
    for g, m in enumerate(metas[:3]):
        want = bt[g].block_table_np[first]
        np.testing.assert_array_equal(m.block_table_tensor[:2].numpy(), want)
        assert not m.block_table_tensor[2].any()
        assert m.slot_mapping is slots[g]
        np.testing.assert_array_equal(m.num_kernel_blocks_cpu, bt[g].num_kernel_blocks[first])
    assert metas[3].block_table_tensor.shape == (3, 1) and metas[3].slot_mapping is None
    assert metas[1].slot_mapping[0] == 4 * 16 + 4  # group 1, row 2: position 20 -> block 4
