"""Defects found by a review: each test here failed before its fix."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from table_model import assert_unchanged, snapshot

from blocktable import (
    BlockTable,
    GroupSpec,
    MultiGroupBlockTable,
    RowBlocks,
    RowEntries,
    SlotMappingError,
    StepUpdate,
    _triton,
)

# ---- the cached launcher: keyed by device; fast path only on verified Triton versions ----


class _FakeCompiled:
    """A compiled kernel loaded on one device: launching it with another device's stream fails
    (as ``invalid resource handle`` does on a GPU)."""

    def __init__(self, device: int, launches: list) -> None:
        self.device = device
        self.function = f"function@{device}"
        self.packed_metadata = ()
        self.launches = launches

    def run(self, gx, gy, gz, stream, function, *rest):
        assert stream == f"stream@{self.device}" and function == self.function
        self.launches.append(("fast", self.device))


class _FakeKernel:
    def __init__(self, state: dict) -> None:
        self.state = state
        self.compiled: list[int] = []
        self.launches: list = []

    def __getitem__(self, grid):
        def call(*args, num_warps):
            device = self.state["current"]  # Triton compiles and launches on the current device
            self.compiled.append(device)
            self.launches.append(("ordinary", device))
            return _FakeCompiled(device, self.launches)

        return call


@pytest.fixture
def fake_devices(monkeypatch):
    """Two fake CUDA devices: a tensor's device is its ``fake_device`` attribute."""
    state = {"current": 0}

    @contextlib.contextmanager
    def guard(device):
        before, state["current"] = state["current"], device
        try:
            yield
        finally:
            state["current"] = before

    monkeypatch.setattr(_triton, "_device_index", lambda t: t.fake_device, raising=False)
    monkeypatch.setattr(_triton, "_current_device", lambda: state["current"], raising=False)
    monkeypatch.setattr(_triton, "_device_guard", guard, raising=False)
    monkeypatch.setattr(_triton, "_current_stream", lambda d: f"stream@{d}")
    return state


def _on(device: int) -> torch.Tensor:
    t = torch.zeros(1)
    t.fake_device = device
    return t


def test_launcher_compiled_cache_is_keyed_by_device(fake_devices):
    kernel = _FakeKernel(fake_devices)
    launch = _triton.Launcher(kernel, dynamic=(1,))
    launch._interpret = False
    launch.fast = True
    for device in (0, 0, 1, 1, 0, 1):
        launch((1,), _on(device), 7, 16)
    # one compile per device; every launch on the tensors' device, which was made current
    assert kernel.compiled == [0, 1]
    assert kernel.launches == [("ordinary", 0), ("fast", 0), ("ordinary", 1), ("fast", 1),
                               ("fast", 0), ("fast", 1)]
    assert fake_devices["current"] == 0


def test_launcher_compiled_cache_is_keyed_by_tensor_dtype(fake_devices):
    """A kernel compiled for float32 tensors must never run on float16 ones (the KV write of
    a float16 cache after a float32 one wrote garbage on CUDA before dtypes were keyed)."""
    kernel = _FakeKernel(fake_devices)
    launch = _triton.Launcher(kernel)
    launch._interpret = False
    launch.fast = True
    for dtype in (torch.float32, torch.float32, torch.float16, torch.float16, torch.float32):
        t = torch.zeros(1, dtype=dtype)
        t.fake_device = 0
        launch((1,), t, 16)
    assert kernel.launches == [("ordinary", 0), ("fast", 0), ("ordinary", 0), ("fast", 0),
                               ("fast", 0)]


class _Descriptor:
    """A host-side tensor descriptor's fields that a compilation depends on, and one it
    does not (``shape``: encoded at every launch)."""

    def __init__(self, base, block_shape, layout, shape):
        self.base, self.block_shape, self.layout, self.shape = base, block_shape, layout, shape

    __hash__ = None  # unhashable, like Triton's dataclass descriptors


def test_launcher_keys_descriptors_by_dtype_block_and_layout(fake_devices):
    """Descriptors of another dtype, block shape or layout get their own compilation; one over
    another tensor or shape reuses it (the launcher re-encodes address and shape)."""
    kernel = _FakeKernel(fake_devices)
    launch = _triton.Launcher(kernel)
    launch._interpret = False
    launch.fast = True
    half = torch.zeros(4, dtype=torch.float16)
    half.fake_device = 0
    calls = [
        _Descriptor(half, [64, 128], "swizzle128", [100, 128]),
        _Descriptor(torch.zeros(8, dtype=torch.float16), [64, 128], "swizzle128", [900, 128]),
        _Descriptor(half, [32, 128], "swizzle128", [100, 128]),
        _Descriptor(half.bfloat16(), [64, 128], "swizzle128", [100, 128]),
        _Descriptor(half, [64, 128], "swizzle64", [100, 128]),
        _Descriptor(half, [32, 128], "swizzle128", [5, 128]),
    ]
    for desc in calls:
        launch((1,), half, desc, 16)
    assert [kind for kind, _ in kernel.launches] == [
        "ordinary", "fast", "ordinary", "ordinary", "ordinary", "fast"]


def test_launcher_public_path_launches_on_the_tensors_device(fake_devices):
    kernel = _FakeKernel(fake_devices)
    launch = _triton.Launcher(kernel, fast=False)
    launch._interpret = False
    for device in (1, 0, 1):
        launch((1,), _on(device), 16)
    assert kernel.launches == [("ordinary", 1), ("ordinary", 0), ("ordinary", 1)]



def test_bound_launch_skips_the_key_but_keeps_the_device(fake_devices):
    """``Launcher.bind`` gives nothing before the first compile, then launches the compiled
    kernel directly, making its device current when another one is."""
    kernel = _FakeKernel(fake_devices)
    launch = _triton.Launcher(kernel, dynamic=(1,))
    launch._interpret = False
    launch.fast = True
    args = (_on(1), 7, 16)
    assert launch.bind(args) is None
    launch((1,), *args)
    bound = launch.bind(args)
    assert bound is not None
    bound((2, 1, 1), _on(1), 9, 16)  # device 0 is current: through the guard
    fake_devices["current"] = 1
    bound((2, 1, 1), _on(1), 9, 16)
    assert kernel.compiled == [1]
    assert kernel.launches == [("ordinary", 1), ("fast", 1), ("fast", 1)]
    launch.fast = False
    assert launch.bind(args) is None

def test_fast_launch_only_on_verified_triton_versions():
    assert _triton.fast_launch_enabled((3, 6), "") and _triton.fast_launch_enabled((3, 9), "")
    assert not _triton.fast_launch_enabled((3, 0), "")
    assert not _triton.fast_launch_enabled((3, 10), "")
    installed = _triton.triton_version() in _triton.FAST_LAUNCH_TRITON_VERSIONS
    assert _triton.fast_launch_enabled(None, "") == installed
    assert not _triton.fast_launch_enabled((3, 6), "0")
    assert _triton.fast_launch_enabled((3, 10), "1")
    with pytest.raises(ValueError, match="BLOCKTABLE_TRITON_FAST_LAUNCH must be 0, 1"):
        _triton.fast_launch_enabled((3, 6), "yes")
    assert _triton.parse_version("3.6.0+git9a3b") == (3, 6)
    assert _triton.parse_version("nightly") is None


def test_fast_launch_env_var(monkeypatch):
    monkeypatch.setenv("BLOCKTABLE_TRITON_FAST_LAUNCH", "0")
    assert not _triton.Launcher(object()).fast
    monkeypatch.setenv("BLOCKTABLE_TRITON_FAST_LAUNCH", "1")
    assert _triton.Launcher(object()).fast


def test_public_launch_path_gives_identical_slots(triton_device):
    from blocktable.slot_mapping import fused_kernel

    def slots():
        bt = MultiGroupBlockTable([GroupSpec(4), GroupSpec(8, 4)], 4, 64, 16,
                                  triton_device, backend="triton")
        bt.add_row(([3, 5], [2]), 0)
        bt.add_row(([7], [4, 6]), 2)
        bt.commit()
        qsl = torch.tensor([0, 3, 5], dtype=torch.int32, device=triton_device)
        pos = torch.tensor([0, 4, 6, 2, 9], device=triton_device)
        rob = torch.tensor([0, 2], dtype=torch.int32, device=triton_device)
        return [s.cpu().clone() for s in bt.compute_slot_mapping(qsl, pos, row_of_batch=rob)]

    launcher = fused_kernel._launch
    fast = launcher.fast
    try:
        launcher.fast = True
        a = slots()
        b = slots()  # second time: the cached kernel (on CUDA)
        launcher.fast = False
        c = slots()
    finally:
        launcher.fast = fast
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert a[0][:5].tolist() == [12, 20, 22, 30, -1]


# ---- block ids: one bound, checked by every entry point before any write ----------------


def _two_groups(num_blocks: int | None = None) -> MultiGroupBlockTable:
    bt = MultiGroupBlockTable(
        [GroupSpec(16, num_blocks=num_blocks), GroupSpec(32, 16, num_blocks=num_blocks)],
        max_num_reqs=4, max_model_len=256, max_num_batched_tokens=32,
    )
    bt.add_row(([1, 2], [3]), 0)
    bt.commit()
    bt.append_row(([6], [7]), 0)  # an uncommitted change must survive rejected calls too
    return bt


def _rejected(bt, exc, match, fn, *args):
    before = snapshot(bt)
    with pytest.raises(exc, match=match):
        fn(*args)
    assert_unchanged(before, bt)


def test_block_id_bound_without_num_blocks():
    # kernel ids id*k + k - 1 must fit int32: ids < 2**31 // k
    assert GroupSpec(16).block_id_bound == 2**31
    assert GroupSpec(32, 16).block_id_bound == 2**30
    assert GroupSpec(64, 16, num_blocks=1000).block_id_bound == 1000
    with pytest.raises(ValueError, match=r"num_blocks=1073741825 .* 1073741824"):
        GroupSpec(32, 16, num_blocks=2**30 + 1)
    bt = _two_groups()
    bt.add_row(([2**31 - 1], [2**30 - 1]), 1)  # the largest ids
    assert bt[0].row(1).tolist() == [2**31 - 1]
    assert bt[1].row(1).tolist() == [2**31 - 2, 2**31 - 1]


@pytest.mark.parametrize("num_blocks", [None, 100])
def test_batched_update_does_not_wrap_block_ids(num_blocks):
    bt = _two_groups(num_blocks)
    bound = num_blocks or 2**31
    for bad in (2**32 + 5, 2**31, -1):
        if num_blocks is None and bad == 2**31:
            bad = 2**31 + 7
        upd = StepUpdate.make(2, added=[RowBlocks.from_lists([1], [[bad]]), RowBlocks()])
        _rejected(bt, ValueError, rf"added\[0\].block_ids holds block id {bad}, outside "
                  rf"\[0, {bound}\)", bt.apply, upd)
        upd = StepUpdate.make(2, appended=[RowBlocks(), RowBlocks.from_lists([0], [[3, bad]])])
        _rejected(bt, ValueError, r"appended\[1\].block_ids holds block id", bt.apply, upd)
        upd = StepUpdate.make(2, added=[RowBlocks(np.array([1]), np.array([1]), np.array([bad])),
                                        RowBlocks()])
        _rejected(bt, ValueError, rf"added\[0\].block_ids holds block id {bad}", bt.apply, upd)
        _rejected(bt, ValueError, rf"block_ids\[0\] holds block id {bad}, outside \[0, {bound}\)",
                  bt.add_row, ([bad], [1]), 1)
        _rejected(bt, ValueError, rf"block_ids holds block id {bad}", bt[0].append_row, [bad], 1)


def test_one_group_batched_update_does_not_wrap():
    bt = BlockTable(16, 4, max_model_len=256, max_num_batched_tokens=32)
    upd = StepUpdate.make(1, added=[RowBlocks.from_lists([1], [[2**32 + 5]])])
    _rejected(bt.owner, ValueError, r"added\[0\].block_ids holds block id 4294967301, outside "
              r"\[0, 2147483648\)", bt.owner.apply, upd)
    assert bt.row(1).tolist() == []


def test_batched_update_does_not_wrap_rows_or_floats():
    bt = _two_groups()
    upd = StepUpdate.make(2, added=[RowBlocks.from_lists([2**32 + 1], [[5]]), RowBlocks()])
    _rejected(bt, IndexError, r"added\[0\].rows holds row 4294967297, outside \[0, 4\)",
              bt.apply, upd)
    upd = StepUpdate.make(2, cleared_rows=[2**32])
    _rejected(bt, IndexError, r"update.cleared_rows holds row 4294967296", bt.apply, upd)
    upd = StepUpdate.make(2, added=[RowBlocks.from_lists([1], [[1.5]]), RowBlocks()])
    _rejected(bt, TypeError, r"added\[0\].block_ids must hold integers", bt.apply, upd)
    upd = StepUpdate.make(2, nulled=[RowEntries(np.array([0]), np.array([2**32])), RowEntries()])
    _rejected(bt, IndexError, r"nulled\[0\].block_indices", bt.apply, upd)


# ---- row_of_batch out of range: masked on the device, checked from a host copy ----------


def _indexed_table() -> MultiGroupBlockTable:
    bt = MultiGroupBlockTable([GroupSpec(4), GroupSpec(8, kind="state")], 4, 64, 16)
    bt.add_row(([3, 5], [2, 6]), 0)
    bt.add_row(([7], [4]), 2)
    bt.commit()
    return bt


def test_torch_gathers_treat_rows_out_of_range_as_empty():
    from blocktable.gather import gather_rows
    from blocktable.state_indices import gather_state_indices

    bt = _indexed_table()
    rows = torch.tensor([2, 4, -1, 0], dtype=torch.int32)  # 4 and -1 are outside [0, 4)
    out = torch.full((5, bt[0].width), 99, dtype=torch.int32)
    gather_rows("torch", bt.storage.device_table(0), rows, out)
    assert out[:, 0].tolist() == [7, 0, 0, 3, 0] and not out[1:3].any() and not out[4].any()
    state = torch.full((5, 2), 99, dtype=torch.int32)
    seq_lens = torch.tensor([1, 1, 9, 9], dtype=torch.int32)
    gather_state_indices(bt.storage.device_table(1), bt.storage.device_counts(1), seq_lens, 8,
                         rows, state)
    assert state.tolist() == [[4, 0], [0, 0], [0, 0], [6, 0], [0, 0]]


def test_torch_slot_mapping_masks_rows_out_of_range():
    """The torch slot mapping (used on CUDA with ``backend="torch"``, where the rows' values are
    not read on the host) never indexes with an out-of-range row: its tokens get PAD."""
    from blocktable.slot_mapping import compute_slots, pack_params

    bt = _indexed_table()
    qsl = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    pos = torch.tensor([0, 5, 1, 2, 3])
    for bad_row in (9, -1):
        rows = torch.tensor([0, bad_row, 2], dtype=torch.int32)
        out = torch.zeros(1, 16, dtype=torch.int64)
        packed = pack_params(bt.slot_params, bt.device)
        compute_slots("torch", bt.storage.device_tensor, bt.slot_params, packed, qsl, pos, rows,
                      out, max_num_reqs=bt.max_num_reqs)
        assert out[0, :6].tolist() == [12, 21, -1, 30, 31, -1]


def test_row_of_batch_checked_from_host_copy():
    bt = _indexed_table()
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    pos = torch.tensor([0, 1])
    rows = torch.tensor([0, 2], dtype=torch.int32)
    seq_lens = torch.tensor([1, 1], dtype=torch.int32)
    bad = np.array([0, 4], np.int32)
    with pytest.raises(IndexError, match=r"row_of_batch_cpu holds row 4, outside \[0, 4\)"):
        bt.compute_slot_mapping(qsl, pos, row_of_batch=rows, row_of_batch_cpu=bad)
    with pytest.raises(IndexError, match=r"row_of_batch_cpu holds row 4, outside \[0, 4\)"):
        bt.gather_view(0, rows, row_of_batch_cpu=bad)
    with pytest.raises(IndexError, match=r"row_of_batch_cpu holds row -1, outside \[0, 4\)"):
        bt.state_indices(1, seq_lens, row_of_batch=rows, row_of_batch_cpu=np.array([-1, 0]))
    with pytest.raises(ValueError, match=r"row_of_batch_cpu must have shape \[2\], got \[3\]"):
        bt.gather_view(0, rows, row_of_batch_cpu=np.array([0, 1, 2]))
    # a CPU row_of_batch is its own host copy
    with pytest.raises(IndexError, match=r"row_of_batch holds row 7, outside \[0, 4\)"):
        bt.state_indices(1, seq_lens, row_of_batch=torch.tensor([0, 7], dtype=torch.int32))
    with pytest.raises(IndexError, match=r"row_of_batch holds row 7, outside \[0, 4\)"):
        bt.compute_slot_mapping(qsl, pos, row_of_batch=torch.tensor([7, 0], dtype=torch.int32))


def test_debug_mode_compares_row_of_batch_with_its_host_copy():
    bt = MultiGroupBlockTable([GroupSpec(4)], 4, 64, 16, debug=True)
    rows = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"row_of_batch_cpu\[1\]=1 differs from row_of_batch"):
        bt.gather_view(0, rows, row_of_batch_cpu=np.array([0, 1]))


def test_build_metadata_checks_row_of_batch():
    bt = _indexed_table()
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    slots = bt.compute_slot_mapping(qsl, torch.tensor([0, 1]),
                                    row_of_batch=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"row_of_batch must have shape \[2\], got \[3\]"):
        bt.build_metadata(qsl, slots, num_tokens=2,
                          row_of_batch=torch.tensor([0, 2, 1], dtype=torch.int32))
    with pytest.raises(IndexError, match=r"row_of_batch_cpu holds row 5"):
        bt.build_metadata(qsl, slots, num_tokens=2, row_of_batch=torch.tensor([0, 2]).int(),
                          row_of_batch_cpu=np.array([0, 5]))
    metas = bt.build_metadata(qsl, slots, num_tokens=2, row_of_batch=torch.tensor([2, 0]).int(),
                              row_of_batch_cpu=np.array([2, 0], np.int32))
    assert metas[0].num_kernel_blocks_cpu.tolist() == [1, 2]


# ---- debug mode reports negative positions ------------------------------------------------


def test_debug_mode_reports_negative_positions():
    bt = MultiGroupBlockTable([GroupSpec(4), GroupSpec(8, 4)], 2, 64, 16, debug=True)
    bt.add_row(([3], [2]), 0)
    bt.commit()
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(SlotMappingError, match=r"1 token\(s\) have a negative position "
                                               r"\(mapped to PAD_SLOT_ID\): token 0 "
                                               r"\(request 0, row 0, position -5\)"):
        bt.compute_slot_mapping(qsl, torch.tensor([-5]))
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(SlotMappingError, match=r"negative position.*token 1 .*position -1\).*"
                                               r"past their row's blocks.*position 9"):
        bt.compute_slot_mapping(qsl, torch.tensor([1, -1, 9]))
    quiet = MultiGroupBlockTable([GroupSpec(4)], 2, 64, 16)
    quiet.add_row(([3],), 0)
    quiet.commit()
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    assert quiet.compute_slot_mapping(qsl, torch.tensor([-5]))[0][0] == -1  # PAD, silently


# ---- a flat id list for a table of several groups -----------------------------------------


def test_flat_id_list_for_two_groups_names_the_groups():
    bt = _two_groups()
    want = (r"block_ids must hold one id list per group: the table has 2 groups, e\.g\. "
            r"add_row\(\(\[3, 5\], \[4\]\), 1\); got a flat list of 2 ids")
    _rejected(bt, ValueError, want, bt.add_row, [3, 5], 1)
    _rejected(bt, ValueError, want.replace("add_row", "append_row"), bt.append_row, [3, 5], 1)
    _rejected(bt, ValueError, r"the table has 2 groups.*; got an array", bt.add_row,
              np.array([3, 5]), 1)
    _rejected(bt, ValueError, r"the table has 2 groups.*; got 3 entries", bt.add_row,
              ([3], [4], [5]), 1)
    one = MultiGroupBlockTable([GroupSpec(4)], 2, 64, 16)
    with pytest.raises(ValueError, match=r"the table has 1 group, e\.g\. add_row\(\(\[3, 5\],\), "
                                         r"1\); got a flat list of 2 ids"):
        one.add_row([3, 5], 1)


# ---- explicit widths are aligned to 128 tokens too ---------------------------------------


def test_explicit_width_is_aligned_to_128_tokens():
    from blocktable import CPConfig, row_width

    assert row_width(GroupSpec(64, max_num_blocks=1875), 0, CPConfig()) == 1876
    assert row_width(GroupSpec(64, 16, max_num_blocks=1875), 0, CPConfig()) == 1876 * 4
    assert row_width(GroupSpec(128, max_num_blocks=5), 0, CPConfig()) == 5
    assert row_width(GroupSpec(256, max_num_blocks=5), 0, CPConfig()) == 5
    assert row_width(GroupSpec(16, max_num_blocks=8), 0, CPConfig()) == 8
    assert row_width(GroupSpec(16, max_num_blocks=9), 0, CPConfig(2, 0)) == 16
    assert BlockTable(64, 2, max_num_blocks=1875).width == 1876


# ---- names and surfaces -------------------------------------------------------------------


def test_block_table_signature_is_explicit():
    import inspect

    params = inspect.signature(BlockTable.__init__).parameters.values()
    assert not [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    params = inspect.signature(BlockTable.compute_slot_mapping).parameters.values()
    assert not [p for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    bt = BlockTable(32, 2, max_model_len=256, max_num_batched_tokens=16, kernel_block_size=16, num_blocks=50, debug=True)
    assert (bt.width, bt.k, bt.block_id_bound, bt.owner.debug) == (16, 2, 50, True)


def test_no_class_calls_another_objects_private_methods():
    """``obj._method(...)`` only for a method of the calling class itself (``self``, ``cls``,
    another instance of it) or of a library module such as ``torch._C``."""
    import ast
    import pathlib

    import blocktable

    modules = {"torch", "triton", "np", "os", "sys"}
    # torch ProcessGroup's own collectives (cheaper to issue than dist.*, which the
    # collectives module falls back to where they are missing): library methods, not ours.
    process_group_methods = {"_allgather_base", "_reduce_scatter_base"}
    found = []

    def visit(node: ast.AST, own: set[str], path: pathlib.Path) -> None:
        if isinstance(node, ast.ClassDef):
            own = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            base = node.func.value
            while isinstance(base, ast.Attribute):
                base = base.value
            on_self = isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
            if (name.startswith("_") and not name.startswith("__") and name not in own
                    and not on_self and name not in process_group_methods
                    and not (isinstance(base, ast.Name) and base.id in modules)):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
        for child in ast.iter_child_nodes(node):
            visit(child, own, path)

    for path in pathlib.Path(blocktable.__file__).parent.rglob("*.py"):
        visit(ast.parse(path.read_text()), set(), path)
    assert not found, found


def test_one_count_check():
    from blocktable import _checks
    from blocktable.allocator import manager

    assert manager.check_count is _checks.check_count
    assert _checks.check_count("n", 3) == 3
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        _checks.check_count("n", -1, 4, "max_num_reqs")
    with pytest.raises(IndexError, match=r"n=5 is out of range \[0, max_num_reqs=4\]"):
        _checks.check_count("n", 5, 4, "max_num_reqs")
    with pytest.raises(TypeError, match="n must be an int"):
        _checks.check_count("n", 1.0)


def test_kernel_block_size_is_always_an_int():
    assert GroupSpec(32).kernel_block_size == 32
    assert GroupSpec(32, None).kernel_block_size == 32
    assert GroupSpec(32, 16).kernel_block_size == 16
    assert GroupSpec(32) == GroupSpec(32, 32)
    assert not hasattr(GroupSpec(32), "kernel_size")  # one name for one thing


def test_row_blocks_counts_manager_blocks():
    blocks = RowBlocks.from_lists([1, 3], [[3, 4], [5]])
    assert blocks.num_manager_blocks.tolist() == [2, 1]
    assert not hasattr(blocks, "num_blocks")  # num_blocks names the pool size only


def test_update_arrays_strided_or_misaligned_apply_as_contiguous_ones():
    """int32 update arrays that are strided or misaligned give the table a contiguous copy
    would: the compiled writer reads whole aligned arrays, and the table hands it those."""

    def table_after(rows: np.ndarray, ids: np.ndarray) -> list:
        bt = MultiGroupBlockTable([GroupSpec(4)], 4, 64, 16)
        bt.apply(StepUpdate.make(1, appended=[RowBlocks(rows, np.array([1, 2], np.int32),
                                                        ids)]))
        return bt[0].row(1).tolist(), bt[0].row(2).tolist()

    want = table_after(np.array([1, 2], np.int32), np.array([5, 6, 7], np.int32))
    strided = np.array([1, 9, 2, 9], np.int32)[::2]
    raw = bytearray(4 * 3 + 1)
    misaligned = np.frombuffer(raw, np.int32, 3, 1)
    misaligned[:] = [5, 6, 7]
    assert not strided.flags.c_contiguous and not misaligned.flags.aligned
    assert table_after(strided, np.array([5, 6, 7], np.int32)) == want
    assert table_after(np.array([1, 2], np.int32), misaligned) == want
