"""Tables on two GPUs of one process, used in turn; each result equals a CPU twin's.

Run on a machine with two GPUs: ``python3 -m pytest -q tests/test_multi_gpu.py``. Skipped
elsewhere (CI cannot see these defects: under the Triton interpreter the fast launch path never
runs). The tests never set the current device: the library must launch every kernel on its
tensors' device whichever device is current.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktable import (
    GroupSpec,
    MultiGroupBlockTable,
    RowBlocks,
    StepUpdate,
    paged_attention_reference,
    paged_decode_attention,
    write_kv_cache,
)

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two = pytest.mark.skipif(NUM_GPUS < 2, reason="needs two CUDA devices")
needs_one = pytest.mark.skipif(NUM_GPUS < 1, reason="needs a CUDA device")

SPECS = [GroupSpec(16, num_blocks=64), GroupSpec(32, 16, num_blocks=64)]
NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 2, 4, 64


class Twin:
    """A table on a GPU and the same table on the CPU (torch backend), driven together."""

    def __init__(self, device: str, seed: int) -> None:
        self.device = torch.device(device)
        self.gpu = MultiGroupBlockTable(SPECS, 4, 512, 64, device)
        self.cpu = MultiGroupBlockTable(SPECS, 4, 512, 64, "cpu")
        gen = torch.Generator().manual_seed(seed)
        shape = (64, 16, NUM_KV_HEADS, HEAD_DIM)
        self.k_cpu, self.v_cpu = torch.zeros(shape), torch.zeros(shape)
        self.k_gpu, self.v_gpu = self.k_cpu.to(device), self.v_cpu.to(device)
        self.gen = gen

    def both(self, op: str, *args: object) -> None:
        for bt in (self.gpu, self.cpu):
            getattr(bt, op)(*args)

    def commit(self) -> None:
        self.both("commit")
        torch.cuda.synchronize(self.device)
        assert self.gpu.device_equals_host()

    def slots(self, qsl: list[int], pos: list[int], rows: list[int] | None) -> list[torch.Tensor]:
        """Slot mappings of both tables (must be equal); returns the GPU's."""
        got = []
        for bt in (self.gpu, self.cpu):
            dev = bt.device
            row_of_batch = None if rows is None else torch.tensor(rows, dtype=torch.int32,
                                                                  device=dev)
            got.append(bt.compute_slot_mapping(
                torch.tensor(qsl, dtype=torch.int32, device=dev),
                torch.tensor(pos, dtype=torch.int64, device=dev),
                row_of_batch=row_of_batch,
                query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
            ))
        for g in (0, 1):
            assert torch.equal(got[0][g].cpu(), got[1][g]), f"group {g} on {self.device}"
        return got[0]

    def write_and_attend(self, slots: torch.Tensor, num_tokens: int, seq_lens: list[int]) -> None:
        """KV write by group 0's slots, then decode attention through group 0's table."""
        key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=self.gen)
        value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=self.gen)
        write_kv_cache(key.to(self.device), value.to(self.device), self.k_gpu, self.v_gpu, slots)
        write_kv_cache(key, value, self.k_cpu, self.v_cpu, slots.cpu())
        assert torch.equal(self.k_gpu.cpu(), self.k_cpu)
        assert torch.equal(self.v_gpu.cpu(), self.v_cpu)
        n = len(seq_lens)
        query = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=self.gen)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        out = paged_decode_attention(query.to(self.device), self.k_gpu, self.v_gpu,
                                     self.gpu.device_view(0, n), seq.to(self.device))
        assert out.device == self.device
        ref = paged_attention_reference(
            query.double(), self.k_cpu.double(), self.v_cpu.double(), self.cpu.device_view(0, n),
            seq, torch.arange(n + 1, dtype=torch.int32),
        )
        err = float((out.double().cpu() - ref).norm() / ref.norm())
        assert err < 1e-2, f"decode attention on {self.device}: relative error {err}"


def step_one(t: Twin, base: int) -> None:
    """Two requests arrive: rows added, committed, prefill slots, KV write, decode."""
    t.both("add_row", ([base + 3, base + 7, base + 9], [base + 2, base + 5]), 0)
    t.both("add_row", ([base + 11], [base + 4]), 1)
    t.commit()
    qsl = [0, 41, 51]
    pos = list(range(41)) + list(range(10))
    slots = t.slots(qsl, pos, None)
    t.write_and_attend(slots[0], len(pos), [41, 10])


def step_two(t: Twin, base: int) -> None:
    """A batched update (one request grows), indexed mode: slots and gathered views."""
    update = StepUpdate.make(2, appended=[RowBlocks.from_lists([1], [[base + 13]]),
                                          RowBlocks.from_lists([1], [[base + 6]])])
    t.both("apply", update)
    t.commit()
    qsl = [0, 7, 8]
    pos = list(range(10, 17)) + [41]
    t.slots(qsl, pos, [1, 0])
    rows = torch.tensor([1, 0], dtype=torch.int32)
    for g in (0, 1):
        got = t.gpu.gather_view(g, rows.to(t.device), 3)
        assert torch.equal(got.cpu(), t.cpu.gather_view(g, rows, 3))


@needs_two
def test_two_gpus_in_one_process() -> None:
    assert torch.cuda.current_device() == 0
    first = Twin("cuda:0", seed=0)
    step_one(first, 0)
    second = Twin("cuda:1", seed=1)
    step_one(second, 20)  # used to fail in commit: invalid resource handle
    step_two(first, 0)  # back on cuda:0
    step_two(second, 20)
    with torch.cuda.device(1):  # the other device current: kernels still go to the tables'
        first.both("clear_row", 1)
        first.commit()
        first.slots([0, 5], list(range(5)), None)
    with torch.cuda.device(0):
        second.both("move_row", 1, 3)
        second.commit()
        second.slots([0, 3, 4], [0, 1, 2, 9], [3, 0])
    assert torch.cuda.current_device() == 0
    from blocktable import commit
    from blocktable.slot_mapping import fused_kernel

    for launcher in (fused_kernel._launch, commit._scatter_launcher):
        if launcher.fast:  # one compiled kernel per device, never shared
            assert {key[0] for key in launcher._compiled} == {0, 1}


@needs_one
@pytest.mark.parametrize("device", [f"cuda:{i}" for i in range(min(NUM_GPUS, 2))] or ["cuda"])
def test_fast_and_public_launch_paths_agree(device: str) -> None:
    from blocktable import commit
    from blocktable.slot_mapping import fused_kernel

    launchers = (fused_kernel._launch, commit._scatter_launcher)
    saved = [launcher.fast for launcher in launchers]
    results = []
    try:
        for fast in (True, True, False):  # compile, cached kernel, public path
            for launcher in launchers:
                launcher.fast = fast
            t = Twin(device, seed=5)
            step_one(t, 0)
            step_two(t, 0)
            results.append([s.cpu() for s in t.slots([0, 4, 6], [0, 1, 2, 40, 3, 60], [0, 1])])
    finally:
        for launcher, fast in zip(launchers, saved):
            launcher.fast = fast
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@needs_one
def test_rows_out_of_range_on_cuda_read_as_empty_rows() -> None:
    """No host copy of row_of_batch, no debug mode: the torch and Triton paths mask an
    out-of-range row on the device (a device-side assert would poison the context), and
    nothing synchronizes."""
    device = f"cuda:{NUM_GPUS - 1}"
    specs = [GroupSpec(16), GroupSpec(16, kind="state")]
    for backend in ("torch", "triton"):
        bt = MultiGroupBlockTable(specs, 4, 256, 16, device, backend=backend)
        bt.add_row(([3, 5], [2, 6]), 0)
        bt.commit()
        qsl = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
        pos = torch.tensor([0, 17, 1], device=device)
        rows = torch.tensor([0, 9], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([18, 2], dtype=torch.int32, device=device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            slots = bt.compute_slot_mapping(qsl, pos, row_of_batch=rows)
            metas = bt.build_metadata(qsl, slots, num_tokens=3, row_of_batch=rows)
            state = bt.state_indices(1, seq_lens, row_of_batch=rows)
            with_host = bt.build_metadata(qsl, slots, num_tokens=3, row_of_batch=rows,
                                          row_of_batch_cpu=np.array([0, 3], np.int32))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(device)
        assert slots[0][:4].tolist() == [48, 81, -1, -1]
        assert metas[0].num_kernel_blocks_cpu is None
        assert metas[0].block_table_tensor[1].abs().sum().item() == 0
        assert metas[0].block_table_tensor[0, :2].tolist() == [3, 5]
        assert state.tolist() == [[6], [0]]
        assert with_host[0].num_kernel_blocks_cpu.tolist() == [2, 0]
