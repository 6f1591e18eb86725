"""vLLM's constructors (``blocktable.compat``) build tables of vLLM's widths; our own
``BlockTable`` refuses vLLM's positional form instead of misreading it."""

from __future__ import annotations

import enum
import math
import random

import numpy as np
import pytest
import torch

import blocktable
from blocktable import CPConfig, GroupKind, MultiGroupBlockTable, compat


def _aligned(num_blocks: int, block_size: int) -> int:
    """Reference: round up so the row spans a multiple of 128 tokens."""
    step = 128 // math.gcd(128, block_size)
    return -(-num_blocks // step) * step


@pytest.mark.parametrize("block_size,kernel_block_size", [(16, 16), (32, 16), (64, 16), (24, 8)])
def test_block_table_width_is_max_num_blocks_per_req(block_size: int, kernel_block_size: int):
    bt = compat.BlockTable(block_size, 4, 16, 64, False, "cpu", kernel_block_size, 1)
    k = block_size // kernel_block_size
    assert isinstance(bt, blocktable.BlockTable)
    assert bt.width == 16 * k
    assert bt.block_table_np.shape == (4, 16 * k)


def test_block_table_slots_follow_vllm_formula() -> None:
    bt = compat.BlockTable(32, 2, 4, 8, False, "cpu", 16, 1)
    bt.add_row([3, 5], 1)
    bt.commit()
    assert bt.row(1).tolist() == [6, 7, 10, 11]  # kernel ids: manager block b -> 2b, 2b+1
    qsl = torch.tensor([0, 0, 3], dtype=torch.int32)
    pos = torch.tensor([0, 17, 40])
    slots = bt.compute_slot_mapping(qsl, pos, row_of_batch=torch.tensor([0, 1], dtype=torch.int32))
    table = bt.row(1)
    want = [int(table[p // 16]) * 16 + p % 16 for p in (0, 17, 40)]
    assert slots[:3].tolist() == want
    assert (slots[3:] == blocktable.PAD_SLOT_ID).all()


def test_native_block_table_refuses_vllm_positional_form() -> None:
    # docs/porting_from_vllm.md quotes this message for vLLM's eight positional arguments
    with pytest.raises(TypeError, match="takes 3 positional arguments but 9 were given"):
        blocktable.BlockTable(16, 4, 16, 64, False, "cpu", 16, 1)
    with pytest.raises(TypeError, match="positional argument"):
        blocktable.BlockTable(16, 4, 16, 64)
    bt = blocktable.BlockTable(16, 4, max_model_len=256, max_num_batched_tokens=64)
    assert bt.width == 16  # 256 tokens in blocks of 16


def test_multi_group_v0_25_widths_match_reference() -> None:
    rng = random.Random(0)
    sizes = [1, 2, 4, 8, 16, 24, 32, 64, 128, 256]
    for _ in range(40):
        groups = rng.randint(1, 3)
        block_sizes = [rng.choice(sizes) for _ in range(groups)]
        kernel = [rng.choice([d for d in sizes if bs % d == 0]) for bs in block_sizes]
        max_model_len = rng.randint(1, 5000)
        num_spec = rng.choice([0, 0, 3, 200])
        world = rng.choice([1, 2, 4])
        cp = CPConfig(world, world - 1) if world > 1 else None
        bt = compat.MultiGroupBlockTable(4, max_model_len, 64, False, "cpu", block_sizes, kernel,
                                         num_spec, 1, cp=cp)
        assert isinstance(bt, MultiGroupBlockTable)
        for table, bs, kbs in zip(bt.tables, block_sizes, kernel):
            n = max(-(-max_model_len // (bs * world)), 1 + num_spec)
            assert table is not None and table.width == _aligned(n, bs) * (bs // kbs)
        assert bt.cp == CPConfig(world, world - 1, 1) if world > 1 else bt.cp.world_size == 1


def test_multi_group_v0_33_widths_and_state_groups() -> None:
    class SlotMappingMode(enum.Enum):  # the shape of vLLM's enum
        TOKEN_TO_KV_SLOT = "token_to_kv_slot"
        NONE = "none"

    bt = compat.MultiGroupBlockTableV033(
        4, 64, False, "cpu", [16, 32, 16], [16, 16, 16], [10, 10, 8], 1,
        [SlotMappingMode.TOKEN_TO_KV_SLOT, "token_to_kv_slot", SlotMappingMode.NONE],
    )
    # rows span a multiple of 128 tokens: 10 blocks of 16 -> 16, 10 of 32 -> 12 (x2 kernel)
    assert [t.width for t in bt.tables if t is not None] == [16, 12 * 2, 8]
    assert [s.kind for s in bt.specs] == [GroupKind.ATTENTION, GroupKind.ATTENTION,
                                         GroupKind.STATE]
    default = compat.MultiGroupBlockTableV033(2, 8, False, "cpu", [16], [16], [3])
    assert default.tables[0] is not None and default.tables[0].width == 8


def test_cp_only_when_asked_and_interleave_from_vllm_argument() -> None:
    bt = compat.BlockTable(16, 2, 8, 8, False, "cpu", 16, 4)
    assert bt.owner.cp == CPConfig(1, 0, 4)
    bt = compat.BlockTable(16, 2, 8, 8, False, "cpu", 16, 4, cp=CPConfig(2, 1))
    assert bt.owner.cp == CPConfig(2, 1, 4)
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size"):
        compat.BlockTable(16, 2, 8, 8, False, "cpu", 16, 4, cp=CPConfig(2, 1, 8))


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda: compat.BlockTable(16, 2, 8, 8, "no", "cpu", 16, 1), TypeError),
        (lambda: compat.BlockTable(16, 2, 0, 8, False, "cpu", 16, 1), ValueError),
        (lambda: compat.BlockTable(16, 2, 8, 8, False, "cpu", 16, 1, "paged"), ValueError),
        (lambda: compat.BlockTable(16, 2, 8, 8, False, "cpu", 5, 1), ValueError),
        (lambda: compat.MultiGroupBlockTable(2, 64, 8, False, "cpu", [16, 16], [16]), ValueError),
        (lambda: compat.MultiGroupBlockTable(2, 64, 8, False, "cpu", [16], [16], -1), ValueError),
        (lambda: compat.MultiGroupBlockTableV033(2, 8, False, "cpu", [16], [16], [4, 4]),
         ValueError),
    ],
)
def test_bad_arguments_are_named(call, error) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_says_so_in_our_words() -> None:
    with pytest.raises(ValueError, match=r"torch sees no CUDA device"):
        MultiGroupBlockTable([blocktable.GroupSpec(16)], 2, 64, device="cuda")


def test_public_surface_for_porters() -> None:
    from blocktable import OutOfRowsError  # raised by KVCacheManager.add_request

    assert issubclass(OutOfRowsError, Exception)
    for name in ("move_row", "swap_row", "clear_row", "clear"):
        assert getattr(MultiGroupBlockTable, name).__doc__, name
    assert "kernel" in (blocktable.BlockTable.row.__doc__ or "")
    bt = compat.BlockTable(32, 2, 4, 8, False, "cpu", 16, 1)
    bt.add_row([3], 0)
    bt.owner.move_row(0, 1)  # vLLM v0.25.1 kept row 0; here it is emptied
    assert bt.row(0).tolist() == [] and bt.row(1).tolist() == [6, 7]
    assert np.all(bt.block_table_np[0] == blocktable.NULL_BLOCK_ID)


def test_a_default_process_group_does_not_turn_cp_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    # as in a tensor-parallel job of 2 ranks: an initialized default group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    bt = MultiGroupBlockTable([blocktable.GroupSpec(16)], 2, 256, 8)
    assert bt.cp == CPConfig(1, 0, 1)
    assert bt.tables[0] is not None and bt.tables[0].width == 16  # the whole 256 tokens
    with pytest.raises(TypeError):  # a group is read only when the caller names it
        CPConfig.from_process_group(None)  # type: ignore[arg-type]
