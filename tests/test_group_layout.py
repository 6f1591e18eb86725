"""Allocator and table agree under context parallelism: one layout builds both specs, and a
table refuses a step update from an allocator of another block size, changing nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktable import GroupSpec, MultiGroupBlockTable
from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.config import CPConfig, check_update_block_sizes
from blocktable.group_layout import GroupLayout, build_specs
from blocktable.update import RowBlocks, StepUpdate


@pytest.mark.parametrize(("world", "kernel"), [(1, None), (2, None), (4, 8), (3, 4)])
def test_layout_builds_both_specs(world: int, kernel: int | None) -> None:
    layout = GroupLayout(block_size=16, num_blocks=100, kernel_block_size=kernel)
    cp = CPConfig(world, world - 1, 4)
    (alloc,), (spec,) = build_specs([layout], cp)
    assert alloc == AllocatorGroupSpec(16 * world, 100)
    assert spec == GroupSpec(16, kernel, num_blocks=100)
    # An unsharded group keeps the table's block size on the allocator side.
    unsharded = GroupLayout(16, 100, cp_sharded=False)
    assert unsharded.allocator_spec(cp).block_size == 16


def test_layout_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="kernel_block_size=6 must divide block_size=16"):
        GroupLayout(16, 10, kernel_block_size=6)
    with pytest.raises(ValueError, match="block_size"):
        GroupLayout(0, 10)


def _engine_pair(
    allocator_block_size: int, table_block_size: int, cp: CPConfig
) -> tuple[KVCacheManager, MultiGroupBlockTable]:
    manager = KVCacheManager([AllocatorGroupSpec(allocator_block_size, 32)], 4)
    table = MultiGroupBlockTable([GroupSpec(table_block_size)], 4, 256, 16, cp=cp)
    return manager, table


@pytest.mark.parametrize(
    ("allocator_bs", "table_bs", "cp"),
    [(16, 16, CPConfig(2, 0)),  # forgot to multiply by the CP world
     (32, 32, CPConfig(2, 1)),  # multiplied the table's block too
     (32, 16, CPConfig(1, 0))],  # allocator built for CP, table without it
)
def test_block_size_mismatch_is_refused_and_changes_nothing(
    allocator_bs: int, table_bs: int, cp: CPConfig
) -> None:
    manager, table = _engine_pair(allocator_bs, table_bs, cp)
    table.add_row(([5, 6],), 3)  # state the rejected update must leave as it is
    table.commit()
    before = table.storage.host_tensor.clone()
    manager.add_request("a", list(range(40)))
    manager.allocate("a", 40)
    update = manager.take_step_update()
    assert update.allocator_block_sizes == (allocator_bs,)
    world = cp.world_size
    with pytest.raises(ValueError) as err:
        table.apply(update)
    msg = str(err.value)
    assert f"block_size={allocator_bs}" in msg and f"block_size={table_bs}" in msg
    assert f"cp world_size={world}" in msg and f"{table_bs} x {world} = {table_bs * world}" in msg
    assert torch.equal(table.storage.host_tensor, before)
    table.commit()
    assert table.device_equals_host()
    table.check_integrity()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_matching_sizes_apply(world: int) -> None:
    layout = GroupLayout(block_size=4, num_blocks=32)
    cp = CPConfig(world, 0)
    manager = KVCacheManager([layout.allocator_spec(cp)], 4)
    table = MultiGroupBlockTable([layout.table_spec()], 4, 256, 16, cp=cp)
    manager.add_request("a", list(range(20)))
    ids = manager.allocate("a", 20)[0]
    assert len(ids) == -(-20 // (4 * world))  # one allocator block per 4 * world tokens
    table.apply(manager.take_step_update())
    row = manager.row_of("a")
    assert table[0].block_table_np[row, : len(ids)].tolist() == ids


def test_unstamped_update_is_not_checked_and_lengths_must_match() -> None:
    table = MultiGroupBlockTable([GroupSpec(4)], 4, 64, 8, cp=CPConfig(2, 0))
    plain = StepUpdate.make(1, added=[RowBlocks.from_lists([0], [[3]])])
    assert plain.allocator_block_sizes is None
    table.apply(plain)
    assert table[0].block_table_np[0, 0] == 3
    stamped = StepUpdate.make(1)
    wrong_len = StepUpdate(stamped.cleared_rows, stamped.added, stamped.appended, stamped.nulled,
                           allocator_block_sizes=(8, 8))
    with pytest.raises(ValueError, match="2 entries, the table has 1 groups"):
        check_update_block_sizes(table.specs, table.cp, wrong_len)
    assert np.array_equal(table[0].block_table_np[0, :1], [3])


def test_cp_needs_an_explicit_config() -> None:
    with pytest.raises(TypeError, match="cp must be a CPConfig or None"):
        MultiGroupBlockTable([GroupSpec(4)], 4, 64, 8, cp=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ProcessGroup"):
        CPConfig.from_process_group("world")
