"""A CUDA graph's contract, checked on the CPU under Triton's interpreter.

A CUDA graph records the device work of a region once and replays it later: the same kernels
with the same arguments (tensor addresses, and scalars as they were at capture), reading what
the buffers hold at replay. Code is capturable when its device work depends on the data only
through tensors, never through host values read during the capture, and when it never waits for
the device.

:class:`FakeGraph` holds CPU code to the same contract. Inside ``with graph.capture():`` every
torch operation and every Triton launch runs once and is recorded with its arguments;
:meth:`FakeGraph.replay` runs the record again on the same tensors. An operation that would make
the host wait for the device (``.item()``, ``bool(t)``, ``nonzero``, ``tolist``...) raises inside
the capture, as it does in a CUDA capture, and an operation whose output shape differs at replay
raises too. So a test that captures, changes the inputs in place and replays finds host values
baked into a step on a machine without a GPU. :func:`graph_for` gives a real CUDA graph on CUDA and
this one on the CPU, behind the same two calls; :func:`no_host_sync` is the sync check alone.

:func:`fake_cuda` goes one step further: ``torch.cuda`` as far as an object built for
``device="cuda"`` uses it (events, streams, graphs as :class:`FakeGraph`, pinned and device
tensor constructors that make CPU tensors), so code that takes its CUDA branch runs on the CPU
and every ``torch.cuda`` call it makes can be seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_aten = torch.ops.aten
# operations that copy device data to the host (or size their output by it): on CUDA each one
# synchronizes, and a CUDA capture fails on it
_SYNCING = frozenset({
    _aten._local_scalar_dense.default, _aten.item.default, _aten.is_nonzero.default,
    _aten.equal.default, _aten.nonzero.default, _aten.masked_select.default,
    _aten._unique2.default, _aten.unique_consecutive.default, _aten.unique_dim.default,
})
# indexing by a boolean mask sizes its output by the mask's count (a nonzero inside)
_MASK_INDEXING = frozenset({
    _aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
    _aten._index_put_impl_.default,
})


def _syncs(func: Any, args: tuple) -> bool:
    if func in _SYNCING:
        return True
    return func in _MASK_INDEXING and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


class HostSyncError(RuntimeError):
    """An operation that makes the host wait for the device, where none may run."""


class _Guard(TorchDispatchMode):
    """Raises on syncing operations; with a ``record`` list, also records every operation."""

    def __init__(self, record: list | None = None) -> None:
        super().__init__()
        self.record = record
        self.paused = 0  # inside a Triton launch: the interpreter's own copies are not ours

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if _syncs(func, args):
            raise HostSyncError(f"{func} reads device data on the host (a sync on CUDA)")
        out = func(*args, **kwargs)
        if self.record is not None:
            self.record.append(("torch", func, args, kwargs, out))
        return out


@contextlib.contextmanager
def _triton_launches(guard: _Guard, record: list | None) -> Iterator[None]:
    """Route every interpreted Triton launch past ``guard`` (and into ``record``), and refuse
    ``Tensor.tolist`` (a copy to the host that bypasses torch's dispatcher)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run
    tolist = torch.Tensor.tolist

    def refuse_tolist(t: torch.Tensor) -> Any:
        if guard.paused:
            return tolist(t)
        raise HostSyncError("Tensor.tolist reads device data on the host (a sync on CUDA)")

    def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        guard.paused += 1
        try:
            result = original(fn, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            guard.paused -= 1
        if record is not None and not warmup:
            record.append(("triton", fn, args, kwargs, grid))
        return result

    InterpretedFunction.run = run  # type: ignore[method-assign]
    torch.Tensor.tolist = refuse_tolist  # type: ignore[method-assign]
    try:
        yield
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise :class:`HostSyncError` on any operation in the block that would make the host wait
    for the device on CUDA (the CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``;
    it cannot tell host tensors from device ones, so the block must hold only device work)."""
    guard = _Guard()
    with guard, _triton_launches(guard, None):
        yield


class FakeGraph:
    """Record a region's torch operations and Triton launches once; replay them on demand."""

    def __init__(self) -> None:
        self._record: list[tuple] = []
        self._captured = False

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        if self._captured:
            raise RuntimeError("a graph is captured once")
        guard = _Guard(self._record)
        with guard, _triton_launches(guard, self._record):
            yield
        self._captured = True

    def replay(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        if not self._captured:
            raise RuntimeError("replay before capture")
        for kind, fn, args, kwargs, extra in self._record:
            if kind == "triton":
                InterpretedFunction.run(fn, *args, grid=extra, warmup=False, **kwargs)
                continue
            new = fn(*args, **kwargs)
            # an output made at capture keeps its buffer, as in a graph's memory pool: later
            # operations were recorded reading it
            for old, now in zip(tree_flatten(extra)[0], tree_flatten(new)[0]):
                if not isinstance(old, torch.Tensor) or old is now:
                    continue
                if old.shape != now.shape or old.dtype != now.dtype:
                    raise RuntimeError(f"{fn} made a {tuple(now.shape)} {now.dtype} output at "
                                       f"replay, {tuple(old.shape)} {old.dtype} at capture")
                if old.untyped_storage().data_ptr() != now.untyped_storage().data_ptr():
                    old.copy_(now)

    @property
    def num_ops(self) -> int:
        """Operations recorded (torch operations and Triton launches)."""
        return len(self._record)


class _CudaGraph:
    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.graph(self.graph)

    def replay(self) -> None:
        self.graph.replay()
        torch.cuda.synchronize()


def graph_for(device: str) -> FakeGraph | _CudaGraph:
    """A CUDA graph on ``"cuda"``, a :class:`FakeGraph` on ``"cpu"``; both offer ``capture()``
    and ``replay()``."""
    return _CudaGraph() if device == "cuda" else FakeGraph()


def sync_check_for(device: str) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What makes a region fail on a host sync: CUDA's sync debug mode, or :func:`no_host_sync`."""
    if device != "cuda":
        return no_host_sync

    @contextlib.contextmanager
    def cuda_sync_error() -> Iterator[None]:
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return cuda_sync_error


# ---------------------------------------------------------------- a fake torch.cuda
_on_call: Callable[[str], None] = lambda name: None
_replaying: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


class _Stream:
    cuda_stream = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        _on_call("Stream.wait_stream")

    def wait_event(self, event: object) -> None:
        _on_call("Stream.wait_event")

    def synchronize(self) -> None:
        _on_call("Stream.synchronize")


def _current_stream(device: object = None) -> _Stream:
    _on_call("current_stream")
    return _Stream()


class _Event:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        if stream is None:  # torch's Event.record looks the current stream up itself
            _current_stream()
        _on_call("Event.record")

    def synchronize(self) -> None:
        _on_call("Event.synchronize")

    def query(self) -> bool:
        _on_call("Event.query")
        return True

    def wait(self, stream: object = None) -> None:
        if stream is None:
            _current_stream()
        _on_call("Event.wait")


class _Graph:
    """``torch.cuda.CUDAGraph`` over a :class:`FakeGraph`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.fake = FakeGraph()

    def replay(self) -> None:
        _on_call("CUDAGraph.replay")
        with _replaying():
            self.fake.replay()


def _on_cpu(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def constructor(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            kwargs["device"] = "cpu"
        return make(*args, **kwargs)

    return constructor


@contextlib.contextmanager
def fake_cuda(
    on_call: Callable[[str], None] | None = None,
    replaying: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> Iterator[None]:
    """``torch.cuda`` on the CPU, as far as a captured step and an engine's buffers use it.

    Events and streams do nothing, graphs are :class:`FakeGraph` (``torch.cuda.graph``
    captures into one), ``torch.zeros``/``full``/``empty``/``ones`` drop ``pin_memory`` and
    make CPU tensors for a CUDA device. ``on_call(name)`` sees every call (``"CUDAGraph.replay"``,
    ``"Event.record"``...; an ``Event.record()`` without a stream is preceded by the
    ``"current_stream"`` lookup torch makes for it); ``replaying()`` is entered around each
    replay's work. Build the object with its device's type ``"cuda"`` inside the block (e.g. a
    CPU table whose ``device`` attribute says ``cuda`` while the step is made)."""
    global _on_call, _replaying
    patches = {
        (torch.cuda, "Event"): _Event, (torch.cuda, "Stream"): _Stream,
        (torch.cuda, "CUDAGraph"): _Graph,
        (torch.cuda, "graph"): lambda graph, **kwargs: graph.fake.capture(),
        (torch.cuda, "current_stream"): _current_stream,
        (torch.cuda, "stream"): lambda stream: contextlib.nullcontext(),
        (torch.cuda, "device"): lambda device: contextlib.nullcontext(),
        (torch.cuda, "synchronize"): lambda device=None: _on_call("synchronize"),
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "is_available"): lambda: True,
        **{(torch, name): _on_cpu(getattr(torch, name))
           for name in ("zeros", "full", "empty", "ones")},
    }
    saved = {key: getattr(*key) for key in patches}
    hooks = (_on_call, _replaying)
    _on_call = on_call or (lambda name: None)
    _replaying = replaying or contextlib.nullcontext
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
        _on_call, _replaying = hooks
