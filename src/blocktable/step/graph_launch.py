"""Launch a captured CUDA graph through the CUDA driver: one foreign call per step, no torch
call.

``torch.cuda.CUDAGraph.replay`` goes through pybind, a GIL release, a device guard and the
runtime API; between engine steps, with the caches cold, that costs the host several times
what the driver's ``cuGraphLaunch`` costs alone (measured in the engine loop:
``benchmarks/bench_engine_loop.py`` on CUDA). :func:`graph_launcher` returns a call that
launches the graph's executable (``CUDAGraph.raw_cuda_graph_exec``) on its device's current
stream through ``ctypes``, and replays through torch instead wherever that is not possible:
no driver library, a torch without the exec handle, or, at the call, another CUDA context
current on the thread (torch's replay makes the graph's device current first).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from blocktable._triton import raw_stream_getter

_DRIVER_NAMES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")
_driver: ctypes.CDLL | None | bool = None  # None: not looked up yet; False: not found


def _cuda_driver() -> ctypes.CDLL | None:
    """The CUDA driver library with ``cuGraphLaunch`` and ``cuCtxGetCurrent`` typed, or None."""
    global _driver
    if _driver is None:
        _driver = False
        for name in _DRIVER_NAMES:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cuGraphLaunch.restype = ctypes.c_int
            lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            lib.cuCtxGetCurrent.restype = ctypes.c_int
            _driver = lib
            break
    return _driver or None


def _exec_handle(graph: torch.cuda.CUDAGraph) -> int | None:
    """The graph's ``CUgraphExec`` as an int, or None where this torch does not give it."""
    get = getattr(graph, "raw_cuda_graph_exec", None)
    if get is None:
        return None
    try:
        handle = get()
    except (RuntimeError, TypeError):
        return None
    if isinstance(handle, int):
        return handle or None
    pointer = ctypes.pythonapi.PyCapsule_GetPointer  # a capsule in some torch versions
    pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    try:
        return pointer(handle, None) or None
    except (ValueError, TypeError):
        return None


def graph_launcher(graph: torch.cuda.CUDAGraph, device_index: int) -> Callable[[], None]:
    """A call launching ``graph`` (captured on CUDA device ``device_index``, which must be
    current now) on that device's current stream: through the driver where possible, else
    ``graph.replay``.

    Raises
    ------
    RuntimeError
        At a call, when the driver refuses the launch (naming its ``CUresult``).
    """
    driver = _cuda_driver()
    handle = _exec_handle(graph)
    if driver is None or handle is None:
        return graph.replay
    context = ctypes.c_void_p()
    if driver.cuCtxGetCurrent(ctypes.byref(context)) != 0 or not context.value:
        return graph.replay
    captured = context.value
    launch, get_context = driver.cuGraphLaunch, driver.cuCtxGetCurrent
    raw_stream = raw_stream_getter()
    current = ctypes.c_void_p()
    current_ref = ctypes.byref(current)
    replay = graph.replay

    def launch_graph() -> None:
        if get_context(current_ref) != 0 or current.value != captured:
            replay()  # another device's context is current: torch switches to ours
            return
        err = launch(handle, raw_stream(device_index))
        if err != 0:
            raise RuntimeError(f"cuGraphLaunch failed (CUresult {err})")

    return launch_graph
