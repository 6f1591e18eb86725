"""Slot mapping: Triton kernel and torch path bit-identical to the plain-Python reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TRITON_DEVICE
from fake_graph import graph_for

from blocktable import PAD_SLOT_ID, CPConfig, GroupSpec, MultiGroupBlockTable
from blocktable.slot_mapping import slot_mapping_reference

MAX_TOKENS = 96


def build_pair(specs, cp, max_num_reqs=6, max_model_len=1024, **kw):
    """The same table on the CPU (torch backend) and where Triton runs (triton backend)."""
    cpu = MultiGroupBlockTable(
        specs, max_num_reqs, max_model_len, MAX_TOKENS, "cpu", cp=cp, backend="torch", **kw
    )
    tri = MultiGroupBlockTable(
        specs, max_num_reqs, max_model_len, MAX_TOKENS, TRITON_DEVICE, cp=cp, backend="triton", **kw
    )
    return cpu, tri


def fill_random(tables, rng, *, num_blocks=5000, max_manager_blocks=None):
    """Random distinct ids in every row of every group, the same in each table."""
    first = tables[0]
    for r in range(first.max_num_reqs):
        per_group = []
        for g, t in enumerate(first.tables):
            cap = (
                t.width // t.k
                if max_manager_blocks is None
                else min(max_manager_blocks, t.width // t.k)
            )
            n = int(rng.integers(0, cap + 1))
            per_group.append(rng.choice(np.arange(1, num_blocks), size=n, replace=False).tolist())
        for bt in tables:
            bt.add_row(tuple(per_group), r)
    for bt in tables:
        bt.commit()


def random_batch(bt, rng, *, indexed: bool, overshoot: bool = False):
    """A prefill + decode mix of requests over the table's rows, with some empty requests."""
    num_reqs = int(rng.integers(0, bt.max_num_reqs + 1)) if rng.random() < 0.2 else bt.max_num_reqs
    rows = rng.permutation(bt.max_num_reqs)[:num_reqs] if indexed else np.arange(num_reqs)
    qsl, pos = [0], []
    budget = MAX_TOKENS - int(rng.integers(0, 8))  # leave a padded tail most of the time
    overshoot_req = int(rng.integers(0, num_reqs)) if overshoot and num_reqs else -1
    for i, r in enumerate(rows):
        # tokens this row covers (every group must cover them: use the smallest)
        covered = min(
            (int(t.num_kernel_blocks[r]) // t.k) * t.spec.block_size * p.cp_world_size
            for t, p in zip(bt.tables, bt.slot_params)
        )
        kind = rng.choice(3, p=[0.15, 0.45, 0.4])  # empty, decode, prefill chunk
        q_len = (
            0
            if kind == 0 or covered == 0
            else (1 if kind == 1 else int(rng.integers(1, covered + 1)))
        )
        q_len = min(q_len, budget - qsl[-1])
        seq_len = int(rng.integers(q_len, covered + 1)) if covered >= q_len else q_len
        p = list(range(seq_len - q_len, seq_len))
        if i == overshoot_req and p:
            p[-1] = covered + int(rng.integers(0, 40))  # past the row's blocks: must be PAD
        pos.extend(p)
        qsl.append(qsl[-1] + len(p))
    return (np.array(qsl, np.int32), np.array(pos, np.int64), rows.astype(np.int32))


def reference_for(bt, qsl, pos, rows, indexed):
    out = []
    for t, p in zip(bt.tables, bt.slot_params):
        out.append(
            slot_mapping_reference(
                t.block_table_np,
                t.num_kernel_blocks,
                qsl,
                pos,
                max_num_tokens=MAX_TOKENS,
                kernel_block_size=p.kernel_block_size,
                manager_block_size=p.manager_block_size,
                cp_world_size=p.cp_world_size,
                cp_rank=p.cp_rank,
                cp_interleave=p.cp_interleave,
                row_of_batch=rows if indexed else None,
            )
        )
    return out


def check_batch(tables, qsl, pos, rows, indexed):
    want = reference_for(tables[0], qsl, pos, rows, indexed)
    for bt in tables:
        dev = bt.device
        got = bt.compute_slot_mapping(
            torch.from_numpy(qsl).to(dev),
            torch.from_numpy(pos).to(dev),
            row_of_batch=torch.from_numpy(rows).to(dev) if indexed else None,
            query_start_loc_cpu=torch.from_numpy(qsl),
        )
        for g, (w, s) in enumerate(zip(want, got)):
            np.testing.assert_array_equal(s.cpu().numpy(), w, err_msg=f"{bt.backend} group {g}")
    return sum(int((w != PAD_SLOT_ID).sum()) for w in want)


def _kernel_sizes(bs):
    return sorted({bs, max(1, bs // 2), max(1, bs // 4)})


CASES = [
    (bs, kbs, world, inter)
    for bs in (1, 16, 32, 64, 128)
    for kbs in _kernel_sizes(bs)
    for world in (1, 2, 4)
    for inter in sorted({1, kbs, bs})
    if world > 1 or inter == 1
] + [
    # sizes that are not powers of two take the kernel's division path
    (24, 8, 3, 8), (24, 12, 1, 1), (48, 16, 3, 16), (12, 12, 2, 4), (40, 40, 3, 1), (6, 3, 1, 1),
]


@pytest.mark.parametrize(("block_size", "kernel_block_size", "world", "interleave"), CASES)
def test_matches_reference_every_rank(block_size, kernel_block_size, world, interleave):
    rng = np.random.default_rng([block_size, kernel_block_size, world, interleave])
    num_slots = 0
    for rank in range(world):
        spec = GroupSpec(block_size, kernel_block_size)
        tables = build_pair(
            [spec],
            CPConfig(world, rank, interleave),
            max_model_len=max(256, 4 * block_size * world),
        )
        fill_random(tables, rng, max_manager_blocks=12)
        for indexed in (False, True, False, True):
            qsl, pos, rows = random_batch(
                tables[0], rng, indexed=indexed, overshoot=bool(rng.integers(0, 2))
            )
            num_slots += check_batch(tables, qsl, pos, rows, indexed)
    assert num_slots > 0, "every token was padding: the case tested nothing"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_several_groups_one_launch(world):
    """Three token-slot groups with different sizes plus a state group, all ranks."""
    rng = np.random.default_rng(world)
    specs = [GroupSpec(16), GroupSpec(32, 16), GroupSpec(64, 64), GroupSpec(16, kind="state")]
    for rank in range(world):
        tables = build_pair(specs, CPConfig(world, rank, 16), max_num_reqs=8)
        fill_random(tables, rng, max_manager_blocks=6)
        for indexed in (False, True):
            for _ in range(3):
                qsl, pos, rows = random_batch(tables[0], rng, indexed=indexed)
                check_batch(tables, qsl, pos, rows, indexed)  # groups 0..2 against the reference
                for bt in tables:  # the state group has no slots
                    assert bt.compute_slot_mapping(
                        torch.from_numpy(qsl).to(bt.device), torch.from_numpy(pos).to(bt.device),
                        row_of_batch=torch.from_numpy(rows).to(bt.device) if indexed else None,
                    )[3] is None


def test_interleave_larger_than_kernel_block_regression():
    """vLLM v0.25.1 mapped positions 16 and 32 to one slot here (CP ownership in kernel-block units)."""
    spec = GroupSpec(block_size=32, kernel_block_size=16)
    slots = {}
    for rank in range(2):
        bt = MultiGroupBlockTable([spec], 1, 1024, 64, cp=CPConfig(2, rank, 32))
        bt.add_row(([9, 11],), 0)
        bt.commit()
        pos = torch.arange(0, 64, dtype=torch.int64)
        qsl = torch.tensor([0, 64], dtype=torch.int32)
        slots[rank] = bt.compute_slot_mapping(qsl, pos)[0][:64].numpy()
    # position p belongs to rank (p // 32) % 2; each owned position gets its own slot
    for rank in range(2):
        owned = (np.arange(64) // 32) % 2 == rank
        assert (slots[rank][~owned] == PAD_SLOT_ID).all()
        assert len(set(slots[rank][owned].tolist())) == 32
    # rank 0, position 16: local offset 16 -> kernel block 1 of manager block 9 (= 19), offset 0
    assert slots[0][16] == 19 * 16 and slots[1][32] == 18 * 16


def test_positions_past_filled_blocks_are_pad():
    bt = MultiGroupBlockTable([GroupSpec(16)], 2, 256, 16)
    bt.add_row(([3],), 0)
    bt.commit()
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    pos = torch.tensor([15, 16, -1, 300], dtype=torch.int64)
    got = bt.compute_slot_mapping(qsl, pos)[0]
    assert got[:4].tolist() == [3 * 16 + 15, PAD_SLOT_ID, PAD_SLOT_ID, PAD_SLOT_ID]


def test_null_entries_are_pad_not_block_zero():
    """A sliding-window null entry inside the filled range never yields a slot of block 0."""
    bt = MultiGroupBlockTable([GroupSpec(32, 16)], 1, 256, 8)
    bt.add_row(([0, 5],), 0)
    bt.commit()
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    got = bt.compute_slot_mapping(qsl, torch.tensor([0, 20, 40], dtype=torch.int64))[0]
    assert got[:3].tolist() == [PAD_SLOT_ID, PAD_SLOT_ID, 10 * 16 + 8]


def test_tail_is_repadded_every_call(triton_device):
    """A shorter step after a longer one must not leave stale slots in the tail."""
    bt = MultiGroupBlockTable([GroupSpec(16)], 2, 256, 32, triton_device, backend="triton")
    bt.add_row(([4, 6],), 0)
    bt.commit()
    qsl = torch.tensor([0, 20], dtype=torch.int32, device=triton_device)
    bt.compute_slot_mapping(qsl, torch.arange(20, device=triton_device))
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=triton_device)
    got = bt.compute_slot_mapping(qsl, torch.arange(3, device=triton_device))[0].cpu()
    assert got[:3].tolist() == [64, 65, 66]
    assert (got[3:] == PAD_SLOT_ID).all()


def test_no_requests_pads_everything(device):
    bt = MultiGroupBlockTable([GroupSpec(16)], 2, 256, 16, device)
    bt.slot_mapping(0).fill_(123)
    got = bt.compute_slot_mapping(
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.zeros(0, dtype=torch.int64, device=device),
    )[0]
    assert (got.cpu() == PAD_SLOT_ID).all()


def test_debug_mode_reports_tokens_past_their_blocks(device):
    from blocktable import SlotMappingError

    bt = MultiGroupBlockTable([GroupSpec(16)], 2, 256, 16, device, cp=CPConfig(2, 0, 16),
                              debug=True)
    bt.add_row(([3, 0],), 0)  # block 1 nulled (sliding window); positions 0..63 on two ranks
    bt.commit()
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=device)

    def call(*positions):
        return bt.compute_slot_mapping(qsl, torch.tensor(positions, device=device))

    assert call(0, 1, 16)[0][:3].tolist() == [48, 49, PAD_SLOT_ID]  # 16: rank 1's, fine
    with pytest.raises(SlotMappingError, match=r"1 token\(s\).*token 2 \(request 0, row 0, "
                                               r"position 64\)"):
        call(0, 1, 64)  # rank 0's offset 32..47 of manager block 2: never allocated
    with pytest.raises(SlotMappingError, match="position 33"):
        call(0, 33, 17)  # rank 0's token in the nulled block


def test_graph_replay_and_no_recompile(triton_device):
    """Captured once (a CUDA graph, or its CPU stand-in under Triton's interpreter), replayed
    with new batch contents: exact slots, padded tail; on CUDA, one compile."""
    from blocktable.slot_mapping import fused_kernel

    dev = triton_device
    rng = np.random.default_rng(3)
    bt = MultiGroupBlockTable([GroupSpec(16), GroupSpec(32, 16)], 8, 1024, MAX_TOKENS, dev,
                              backend="triton")
    fill_random([bt], rng, max_manager_blocks=8)
    num_reqs, num_tokens = 8, 48  # the graph's (padded) sizes; engines pad to these
    qsl = torch.full((num_reqs + 1,), num_tokens, dtype=torch.int32, device=dev)
    qsl[0] = 0  # a well-formed batch: the CPU checks it on the host
    pos = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
    bt.compute_slot_mapping(qsl, pos)  # compile before capture
    compiled_before = len(fused_kernel._launch._compiled)
    graph = graph_for(dev)
    with graph.capture():
        slots = bt.compute_slot_mapping(qsl, pos)
    for _ in range(5):
        # a new batch in the same buffers: requests' token counts vary, padding fills the rest
        lens = rng.multinomial(num_tokens, np.ones(num_reqs) / num_reqs)
        q = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        p = np.concatenate([rng.integers(0, 100, n) for n in lens]).astype(np.int64)
        qsl.copy_(torch.from_numpy(q))
        pos.copy_(torch.from_numpy(p))
        graph.replay()
        want = reference_for(bt, q, p, None, False)
        for g in range(2):
            np.testing.assert_array_equal(slots[g].cpu().numpy(), want[g])
    for n in (1, 17, 40):  # eager calls with other token and request counts
        q = np.array([0, n], np.int32)
        bt.compute_slot_mapping(torch.from_numpy(q).to(dev), torch.arange(n, device=dev))
    assert len(fused_kernel._launch._compiled) == compiled_before  # (empty under the interpreter)
