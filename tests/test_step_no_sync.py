"""A whole block-table step issues no hidden host-device synchronization (on CUDA, and on the CPU
through the CUDA path's kernels under Triton's interpreter), and its output buffers keep their
addresses step after step (every device)."""

from __future__ import annotations

import numpy as np
import torch
from fake_graph import sync_check_for

from blocktable import GroupSpec, MultiGroupBlockTable, RowBlocks, StepUpdate
from blocktable.flashinfer import flashinfer_page_table_host, write_flashinfer_page_table
from blocktable.kv_write import write_kv_cache

NUM_REQS, MAX_REQS, BLOCK, NUM_BLOCKS = 6, 8, 16, 64


class Step:
    """Inputs of a few decode steps, built before the timed/checked region."""

    def __init__(self, device: str, rng: np.random.Generator, backend: str = "auto") -> None:
        self.device = device
        self.backend = backend
        self.bt = MultiGroupBlockTable([GroupSpec(BLOCK, num_blocks=NUM_BLOCKS)], MAX_REQS,
                                       BLOCK * 16, 64, device, backend=backend)
        rows = np.arange(NUM_REQS, dtype=np.int32)
        ids = rng.permutation(np.arange(1, NUM_BLOCKS))[: NUM_REQS * 3].astype(np.int32)
        self.bt.apply(StepUpdate.make(1, added=[RowBlocks(rows, np.full(NUM_REQS, 2, np.int32),
                                                          ids[: 2 * NUM_REQS])]))
        self.spare = ids[2 * NUM_REQS :]
        self.seq_lens_np = rng.integers(1, 2 * BLOCK + 1, NUM_REQS).astype(np.int32)
        self.row_of_batch_np = rng.permutation(NUM_REQS).astype(np.int32)
        pin = device == "cuda"
        qsl = torch.arange(NUM_REQS + 1, dtype=torch.int32)
        self.qsl_cpu = qsl.pin_memory() if pin else qsl
        self.qsl = qsl.to(device)
        seq = self.seq_lens_np[self.row_of_batch_np]
        self.positions = torch.from_numpy(seq.astype(np.int64) - 1).to(device)
        self.seq_lens_cpu = torch.from_numpy(seq)
        self.seq_lens = self.seq_lens_cpu.to(device)
        self.row_of_batch = torch.from_numpy(self.row_of_batch_np).to(device)
        self.kv_indptr = torch.zeros(NUM_REQS + 1, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(NUM_REQS * 16, dtype=torch.int32, device=device)
        self.kv_last = torch.zeros(NUM_REQS, dtype=torch.int32, device=device)
        self.k_cache = torch.zeros(NUM_BLOCKS, BLOCK, 2, 8, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.key = torch.randn(NUM_REQS, 2, 8, device=device)
        self.updates = [
            StepUpdate.make(1, appended=[RowBlocks.from_lists([r], [[int(self.spare[r])]])])
            for r in range(NUM_REQS)
        ]

    def run(self, i: int) -> list[int]:
        """One step; returns the data pointers of everything it wrote."""
        bt = self.bt
        bt.apply(self.updates[i])
        bt.commit()
        slots = bt.compute_slot_mapping(self.qsl, self.positions, row_of_batch=self.row_of_batch,
                                        query_start_loc_cpu=self.qsl_cpu)[0]
        view = bt.gather_view(0, self.row_of_batch)
        write_flashinfer_page_table(view, self.seq_lens, BLOCK, self.kv_indptr, self.kv_indices,
                                    self.kv_last, seq_lens_cpu=self.seq_lens_cpu,
                                    backend=self.backend)
        # check=False is CUDA's default; on CPU tensors the slots are checked on the host
        write_kv_cache(self.key, self.key, self.k_cache, self.v_cache, slots, check=False,
                       backend=self.backend)
        return [t.data_ptr() for t in (bt.storage.device_tensor, slots, view, self.kv_indices,
                                       self.k_cache)]

    def check(self) -> None:
        table = self.bt[0].block_table_np[self.row_of_batch_np]
        want = flashinfer_page_table_host(table, self.seq_lens_np[self.row_of_batch_np], BLOCK)
        got = (self.kv_indptr, self.kv_indices[: int(want[0][-1])], self.kv_last)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.cpu().numpy(), w)
        assert self.bt.device_equals_host()


def test_step_never_synchronizes(triton_device):
    """The Triton path's step, checked by CUDA's sync debug mode, or on the CPU by refusing
    every operation that would synchronize on CUDA."""
    step = Step(triton_device, np.random.default_rng(0), backend="triton")
    step.run(0)  # first calls compile the kernels
    if triton_device == "cuda":
        torch.cuda.synchronize()
    with sync_check_for(triton_device)():
        for i in range(1, NUM_REQS):
            step.run(i)
    if triton_device == "cuda":
        torch.cuda.synchronize()
    step.check()


def test_step_outputs_keep_their_addresses(triton_device):
    step = Step(triton_device, np.random.default_rng(1))
    first = step.run(0)
    for i in range(1, NUM_REQS):
        assert step.run(i) == first
    step.check()
