"""FlashInfer CSR export: device writers and host functions against a plain numpy loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_graph import graph_for

from blocktable.flashinfer import (
    flashinfer_indptr_host,
    flashinfer_page_table_host,
    write_flashinfer_page_table,
)

POISON = -7


def csr_reference(table: np.ndarray, seq_lens: np.ndarray, page_size: int):
    """The definition, one request at a time."""
    indptr, indices, last = [0], [], []
    for r, seq_len in enumerate(seq_lens):
        num_pages = (int(seq_len) + page_size - 1) // page_size
        indices.extend(int(b) for b in table[r, :num_pages])
        indptr.append(indptr[-1] + num_pages)
        last.append(int(seq_len) - (num_pages - 1) * page_size if num_pages else 0)
    return tuple(np.array(a, dtype=np.int32) for a in (indptr, indices, last))


def random_case(num_reqs: int, width: int, page_size: int, seed: int):
    """Random ids, seq lens over [0, width * page_size] including 0 and full pages, and a
    table with extra (padded) rows whose row stride is not its width."""
    rng = np.random.default_rng(seed)
    wide = rng.integers(1, 1000, size=(num_reqs + 2, width + 3), dtype=np.int32)
    table = wide[:, :width]
    seq = rng.integers(0, width * page_size + 1, size=num_reqs)
    seq[: min(num_reqs, 3)] = [0, page_size, width * page_size][: min(num_reqs, 3)]
    return wide, table, seq.astype(np.int32)


def run_device(wide, seq, page_size, width, device, capacity, backend, seq_lens_cpu=None):
    num_reqs = len(seq)
    block_table = torch.from_numpy(wide).to(device)[:, :width]
    assert not block_table.is_contiguous()
    kv_indptr = torch.full((num_reqs + 1,), POISON, dtype=torch.int32, device=device)
    kv_indices = torch.full((capacity,), POISON, dtype=torch.int32, device=device)
    kv_last_page_len = torch.full((num_reqs,), POISON, dtype=torch.int32, device=device)
    write_flashinfer_page_table(
        block_table,
        torch.from_numpy(seq).to(device),
        page_size,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        seq_lens_cpu=seq_lens_cpu,
        backend=backend,
    )
    return kv_indptr.cpu().numpy(), kv_indices.cpu().numpy(), kv_last_page_len.cpu().numpy()


def assert_matches(got, expected) -> None:
    indptr, indices, last = got
    exp_indptr, exp_indices, exp_last = expected
    np.testing.assert_array_equal(indptr, exp_indptr)
    np.testing.assert_array_equal(last, exp_last)
    np.testing.assert_array_equal(indices[: exp_indptr[-1]], exp_indices)
    assert (indices[exp_indptr[-1] :] == POISON).all()  # the rest of the buffer is untouched


CASES = [(1, 4, 16, 0), (5, 3, 16, 1), (9, 7, 32, 2), (33, 5, 1, 3), (3, 40, 64, 4)]


@pytest.mark.parametrize("num_reqs,width,page_size,seed", CASES)
def test_torch_path_matches_reference(device: str, num_reqs, width, page_size, seed) -> None:
    wide, table, seq = random_case(num_reqs, width, page_size, seed)
    got = run_device(wide, seq, page_size, width, device, num_reqs * width + 5, "torch")
    assert_matches(got, csr_reference(table, seq, page_size))


@pytest.mark.parametrize("num_reqs,width,page_size,seed", CASES)
def test_triton_matches_reference(triton_device: str, num_reqs, width, page_size, seed) -> None:
    wide, table, seq = random_case(num_reqs, width, page_size, seed)
    got = run_device(wide, seq, page_size, width, triton_device, num_reqs * width, "triton")
    assert_matches(got, csr_reference(table, seq, page_size))


@pytest.mark.parametrize("num_reqs,width,page_size,seed", CASES)
def test_host_functions_match_reference(num_reqs, width, page_size, seed) -> None:
    _, table, seq = random_case(num_reqs, width, page_size, seed)
    expected = csr_reference(table, seq, page_size)
    got = flashinfer_page_table_host(table, seq, page_size)
    for g, e in zip(got, expected):
        assert g.dtype == np.int32
        np.testing.assert_array_equal(g, e)
    kv_indptr, kv_last_page_len = flashinfer_indptr_host(torch.from_numpy(seq), page_size)
    np.testing.assert_array_equal(kv_indptr, expected[0])
    np.testing.assert_array_equal(kv_last_page_len, expected[2])


def test_flashinfer_semantics_by_hand() -> None:
    kv_indptr, kv_last_page_len = flashinfer_indptr_host([0, 1, 16, 17, 32], 16)
    assert kv_indptr.tolist() == [0, 0, 1, 2, 4, 6]
    assert kv_last_page_len.tolist() == [0, 1, 16, 1, 16]
    kv_indptr, kv_last_page_len = flashinfer_indptr_host([], 16)
    assert kv_indptr.tolist() == [0] and kv_last_page_len.tolist() == []


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_capacity_from_host_seq_lens(triton_device: str, backend: str) -> None:
    wide, table, seq = random_case(6, 5, 16, 7)
    expected = csr_reference(table, seq, 16)
    total = int(expected[0][-1])
    got = run_device(wide, seq, 16, 5, triton_device, total, backend, seq_lens_cpu=seq)
    assert_matches(got, expected)
    with pytest.raises(
        ValueError,
        match=f"kv_indices holds {total - 1} entries, less than the {total} pages of seq_lens_cpu",
    ):
        run_device(wide, seq, 16, 5, triton_device, total - 1, backend, seq_lens_cpu=seq)
    with pytest.raises(
        ValueError,
        match="kv_indices holds 29 entries, less than num_reqs \\* width = 30: pass seq_lens_cpu",
    ):
        run_device(wide, seq, 16, 5, triton_device, 29, backend)


def test_device_seq_len_past_the_row_is_clamped(triton_device: str) -> None:
    """Unchecked device input never reads past the row: the row is taken whole."""
    wide, table, seq = random_case(3, 4, 16, 8)
    seq[1] = 4 * 16 + 20
    clamped = csr_reference(table, np.minimum(seq, 4 * 16), 16)
    for backend in ("torch", "triton"):
        got = run_device(wide, seq, 16, 4, triton_device, 12, backend)
        assert_matches(got, clamped)


def test_empty_batch(device: str) -> None:
    kv_indptr = torch.full((1,), POISON, dtype=torch.int32, device=device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    write_flashinfer_page_table(
        torch.zeros(0, 4, dtype=torch.int32, device=device), empty, 16, kv_indptr, empty, empty
    )
    assert kv_indptr.tolist() == [0]


def test_bad_inputs_name_the_argument() -> None:
    table = torch.ones(3, 4, dtype=torch.int32)
    seq = torch.tensor([3, 20, 0], dtype=torch.int32)
    i32 = torch.int32
    ok = {
        "kv_indptr": torch.empty(4, dtype=i32),
        "kv_indices": torch.empty(12, dtype=i32),
        "kv_last_page_len": torch.empty(3, dtype=i32),
    }

    def call(block_table=table, seq_lens=seq, page_size=16, **kw):
        args = {**ok, **kw}
        write_flashinfer_page_table(
            block_table,
            seq_lens,
            page_size,
            args.pop("kv_indptr"),
            args.pop("kv_indices"),
            args.pop("kv_last_page_len"),
            **args,
        )

    call()
    with pytest.raises(TypeError, match="block_table must have dtype torch.int32"):
        call(block_table=table.long())
    with pytest.raises(ValueError, match="block_table must have at least num_reqs=3 rows"):
        call(block_table=table[:2])
    with pytest.raises(TypeError, match="seq_lens must have dtype torch.int32"):
        call(seq_lens=seq.long())
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        call(page_size=0)
    with pytest.raises(TypeError, match="kv_indptr must have dtype torch.int32"):
        call(kv_indptr=torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"kv_indptr must have shape \[4\]"):
        call(kv_indptr=torch.empty(3, dtype=i32))
    with pytest.raises(ValueError, match=r"kv_last_page_len must have shape \[3\]"):
        call(kv_last_page_len=torch.empty(4, dtype=i32))
    with pytest.raises(ValueError, match="kv_indices must be contiguous"):
        call(kv_indices=torch.empty(24, dtype=i32)[::2])
    with pytest.raises(ValueError, match="kv_indices must be on device meta"):
        call(
            block_table=table.to("meta"),
            seq_lens=seq.to("meta"),
            kv_indptr=ok["kv_indptr"].to("meta"),
        )
    with pytest.raises(ValueError, match=r"seq_lens_cpu must have shape \[3\]"):
        call(seq_lens_cpu=[3, 20])
    with pytest.raises(
        ValueError,
        match=r"seq_lens_cpu\[1\]=65 exceeds the row's width \* "
        "page_size = 64",
    ):
        call(seq_lens_cpu=[3, 65, 0])
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=-1 must be >= 0"):
        flashinfer_indptr_host([-1, 3], 16)
    with pytest.raises(TypeError, match="seq_lens must hold integers"):
        flashinfer_indptr_host([1.5], 16)
    with pytest.raises(ValueError, match="block_table must be a 2-D integer array"):
        flashinfer_page_table_host(np.zeros(4, dtype=np.int32), [1], 16)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=65 exceeds the row's width"):
        flashinfer_page_table_host(table.numpy(), [65], 16)


def test_graph_replay_sees_new_seq_lens(triton_device: str) -> None:
    """Captured once (a CUDA graph, or its CPU stand-in under Triton's interpreter), replayed
    after new sequence lengths were written into the same buffer."""
    _, table, seq = random_case(7, 6, 16, 9)
    block_table = torch.from_numpy(table).to(triton_device)
    seq_lens = torch.from_numpy(seq).to(triton_device)
    kv_indptr = torch.empty(8, dtype=torch.int32, device=triton_device)
    kv_indices = torch.full((42,), POISON, dtype=torch.int32, device=triton_device)
    kv_last_page_len = torch.empty(7, dtype=torch.int32, device=triton_device)
    args = (block_table, seq_lens, 16, kv_indptr, kv_indices, kv_last_page_len)
    write_flashinfer_page_table(*args, backend="triton")  # compile outside the capture
    graph = graph_for(triton_device)
    with graph.capture():
        write_flashinfer_page_table(*args, backend="triton")
    new_seq = np.random.default_rng(10).integers(0, 6 * 16 + 1, size=7).astype(np.int32)
    seq_lens.copy_(torch.from_numpy(new_seq))
    kv_indices.fill_(POISON)
    graph.replay()
    got = (kv_indptr.cpu().numpy(), kv_indices.cpu().numpy(), kv_last_page_len.cpu().numpy())
    assert_matches(got, csr_reference(table, new_seq, 16))
