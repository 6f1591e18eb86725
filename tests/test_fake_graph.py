"""The CPU stand-in for a CUDA graph fails where a CUDA graph would: a host value read during the
capture stays baked into the replay, and a host sync inside the capture raises."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_graph import FakeGraph, HostSyncError, no_host_sync

from blocktable._triton import interpreting
from blocktable.flashinfer import write_flashinfer_page_table


def test_replay_reads_the_buffers_again_through_intermediates() -> None:
    x, out = torch.arange(6.0), torch.zeros(6)
    graph = FakeGraph()
    with graph.capture():
        out.copy_((x * 2).flip(0) + 1)  # two fresh intermediates, then a write into out
    assert graph.num_ops >= 3
    x.copy_(torch.tensor([5.0, -1, 0, 2, 7, 3]))
    graph.replay()
    assert torch.equal(out, (x * 2).flip(0) + 1)


def test_a_host_value_read_during_capture_stays_baked() -> None:
    x, out = torch.tensor([3, 1, 2]), torch.zeros(1, dtype=torch.int64)
    graph = FakeGraph()
    with graph.capture():
        out.fill_(int(x.numpy().max()))  # host read: not part of the record
    x.copy_(torch.tensor([9, 9, 9]))
    graph.replay()
    assert out.item() == 3  # what a CUDA graph would replay too: the test that uses it fails


@pytest.mark.parametrize("sync", [
    lambda t: t.sum().item(),
    lambda t: bool(t.any()),
    lambda t: t[t > 1],
    lambda t: t.nonzero(),
    lambda t: t.tolist(),
])
def test_a_host_sync_raises_inside_capture_and_no_host_sync(sync) -> None:
    t = torch.tensor([0, 1, 2, 3])
    with pytest.raises(HostSyncError), FakeGraph().capture():
        sync(t)
    with pytest.raises(HostSyncError), no_host_sync():
        sync(t)
    sync(t)  # outside, as usual


@pytest.mark.skipif(not interpreting(), reason="Triton's interpreter is off (a CUDA machine)")
def test_triton_launches_replay_and_a_syncing_backend_is_caught() -> None:
    table = torch.tensor([[5, 6, 0], [7, 8, 9]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 16], dtype=torch.int32)
    indptr, indices, last = (torch.zeros(n, dtype=torch.int32) for n in (3, 6, 2))
    args = (table, seq_lens, 16, indptr, indices, last)
    graph = FakeGraph()
    with graph.capture():
        write_flashinfer_page_table(*args, backend="triton")
    seq_lens.copy_(torch.tensor([33, 1], dtype=torch.int32))
    graph.replay()
    assert indptr.tolist() == [0, 3, 4] and last.tolist() == [1, 1]
    assert indices[:4].tolist() == [5, 6, 0, 7]
    # the torch backend masks by value (documented to synchronize on CUDA): refused
    with pytest.raises(HostSyncError), FakeGraph().capture():
        write_flashinfer_page_table(*args, backend="torch")
    np.testing.assert_array_equal(seq_lens.numpy(), [33, 1])
