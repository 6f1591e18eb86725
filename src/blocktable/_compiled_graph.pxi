# The captured step's launch of its CUDA graph through the CUDA driver: one compiled call per
# step, where torch's replay (pybind, a GIL release, a device guard, the runtime API) and a
# foreign call through ctypes each cost the host more than the rest of the step, caches cold.
# No CUDA headers and no link to the driver: the two entry points are looked up in the driver
# library the process has already loaded (torch loads it before any graph exists).

cdef extern from *:
    """
    #if defined(__unix__) || defined(__APPLE__)
    #include <dlfcn.h>
    /* an entry point of the CUDA driver that is already loaded (never loads it), or NULL */
    static void *bt_loaded_cuda_symbol(const char *name) {
        void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
        if (lib == NULL) lib = dlopen("libcuda.so", RTLD_LAZY | RTLD_NOLOAD);
        return lib == NULL ? NULL : dlsym(lib, name);
    }
    #else
    static void *bt_loaded_cuda_symbol(const char *name) { (void)name; return NULL; }
    #endif
    """
    void *bt_loaded_cuda_symbol(const char *name) nogil

from cpython.pycapsule cimport PyCapsule_CheckExact, PyCapsule_GetName, PyCapsule_GetPointer

ctypedef int (*_cu_graph_launch_t)(void *graph_exec, void *stream) noexcept nogil
ctypedef int (*_cu_ctx_get_current_t)(void **context) noexcept nogil


cdef class GraphLaunch:
    """Launch a captured ``torch.cuda.CUDAGraph`` by the CUDA driver's ``cuGraphLaunch``, on
    its device's current stream: what ``graph.replay()`` does, for less host time.

    Nothing the caller passes reaches the driver unchecked: the graph must be a
    ``torch.cuda.CUDAGraph`` (its executable handle is asked of torch at each launch, so a
    graph reset since raises rather than launching a freed executable), the device the
    current one, the stream torch's current stream of that device at each launch, and a
    launch while another CUDA context is current on the thread replays through torch (which
    makes the graph's device current first).

    Parameters
    ----------
    graph : torch.cuda.CUDAGraph
        A captured graph.
    device_index : int
        The CUDA device the graph was captured on; it must be the current device now.

    Raises
    ------
    TypeError
        ``graph`` is not a ``torch.cuda.CUDAGraph``.
    ValueError
        ``device_index`` is not the current CUDA device.
    RuntimeError
        No CUDA driver is loaded, the graph has no executable (not captured, or this torch
        does not hand it out), or no CUDA context is current: replay through torch instead.
    """

    cdef _cu_graph_launch_t _launch
    cdef _cu_ctx_get_current_t _get_context
    cdef void *_context
    cdef object _graph
    cdef object _replay
    cdef object _stream_of  # torch's current raw stream of a device index
    cdef object _device_index

    def __init__(self, graph, device_index):
        import torch

        from blocktable._triton import raw_stream_getter

        if not isinstance(graph, torch.cuda.CUDAGraph):
            raise TypeError(f"graph must be a torch.cuda.CUDAGraph, got {type(graph).__name__}")
        if not (type(device_index) is int and torch.cuda.is_available()
                and device_index == torch.cuda.current_device()):
            raise ValueError(f"device_index must be the current CUDA device, got "
                             f"{device_index!r}")
        launch = bt_loaded_cuda_symbol(b"cuGraphLaunch")
        get_context = bt_loaded_cuda_symbol(b"cuCtxGetCurrent")
        if launch == NULL or get_context == NULL:
            raise RuntimeError("no loaded CUDA driver with cuGraphLaunch and cuCtxGetCurrent")
        _graph_exec(graph)  # (raises now for a graph without one)
        self._launch = <_cu_graph_launch_t>launch
        self._get_context = <_cu_ctx_get_current_t>get_context
        cdef void *context = NULL
        if self._get_context(&context) != 0 or context == NULL:
            raise RuntimeError("no CUDA context is current")
        self._context = context
        self._graph = graph
        self._replay = graph.replay
        self._stream_of = raw_stream_getter()
        self._device_index = device_index

    def launch(self):
        """Launch the graph on the device's current stream (asynchronous), by the driver, or
        by torch's replay where another CUDA context is current on this thread.

        Raises
        ------
        RuntimeError
            The graph has no executable any more (``reset()``), or the driver refused the
            launch (naming its ``CUresult``).
        """
        cdef void *current = NULL
        cdef uintptr_t stream = self._stream_of(self._device_index)
        if self._get_context(&current) != 0 or current != self._context:
            self._replay()
            return
        cdef void *graph_exec = _graph_exec(self._graph)
        cdef int err = self._launch(graph_exec, <void *>stream)
        if err != 0:
            raise RuntimeError(f"cuGraphLaunch failed (CUresult {err})")


cdef void *_graph_exec(object graph) except NULL:
    """The ``CUgraphExec`` of a captured torch graph (an int or a capsule, by torch version)."""
    try:
        handle = graph.raw_cuda_graph_exec()
    except (AttributeError, RuntimeError) as exc:
        raise RuntimeError(f"the graph has no executable to launch: {exc}") from None
    cdef void *pointer = NULL
    if PyCapsule_CheckExact(handle):
        pointer = PyCapsule_GetPointer(handle, PyCapsule_GetName(handle))
    elif type(handle) is int and handle > 0:
        pointer = <void *><uintptr_t>handle
    if pointer == NULL:
        raise RuntimeError(f"the graph has no executable to launch (got {handle!r})")
    return pointer
