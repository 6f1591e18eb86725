# A CUDA graph captured, owned and launched here through the CUDA driver (included by
# _compiled.pyx).
#
# Why: after a model's forward pass the CPU caches are cold, and torch's replay (pybind, a GIL
# release, a device guard, the runtime API, a driver-version query) costs the host more than
# the rest of the captured step. One compiled call to the driver's cuGraphLaunch does the same
# launch. No CUDA headers and no link to the driver: its entry points are looked up in the
# driver library the process has already loaded (torch loads it before any graph exists).
#
# Memory safety by construction: the graph is captured here from the caller's work and kept in
# a C-level attribute no Python code can reach, so nothing can reset it while its executable
# is cached; the stream is torch's current stream of the graph's device, asked at each launch;
# a launch while another CUDA context is current replays through torch instead.

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
    """A CUDA graph of ``work``'s kernels, captured and owned here, launched by one call to the
    CUDA driver's ``cuGraphLaunch`` on the device's current stream: what
    ``torch.cuda.CUDAGraph.replay`` does, for less host time.

    The graph never leaves this object (no Python code can reach it, so none can reset it
    while its executable is cached), the stream is torch's current stream of the device at
    each launch, and a launch while another CUDA context is current on the calling thread
    replays through torch (which makes the device current first).

    Parameters
    ----------
    work : callable
        Called once, with no argument, under capture: it issues the graph's kernels. It must
        have run once before (uncaptured) so that nothing it does is a first-use setup.
    device_index : int
        The CUDA device to capture on; it must be the current device.

    Raises
    ------
    TypeError
        ``work`` is not callable.
    ValueError
        ``device_index`` is not the current CUDA device.
    RuntimeError
        No CUDA driver is loaded or no CUDA context is current (raised before anything is
        captured), or this torch hands out no executable of a captured graph: launch a
        ``torch.cuda.CUDAGraph`` instead.
    """

    cdef _cu_graph_launch_t _launch
    cdef _cu_ctx_get_current_t _get_context
    cdef void *_context
    cdef void *_exec
    cdef object _graph  # the torch graph: held here only, never handed out
    cdef object _stream_of  # torch's current raw stream of a device index
    cdef object _device_index

    def __init__(self, work, device_index):
        import torch

        from blocktable._triton import raw_stream_getter

        _bound_once(self._graph is not None, "GraphLaunch")
        if not callable(work):
            raise TypeError(f"work must be callable, got {type(work).__name__}")
        if not (type(device_index) is int and torch.cuda.is_available()
                and device_index == torch.cuda.current_device()):
            raise ValueError(f"device_index must be the current CUDA device, got "
                             f"{device_index!r}")
        launch = bt_loaded_cuda_symbol(b"cuGraphLaunch")
        get_context = bt_loaded_cuda_symbol(b"cuCtxGetCurrent")
        if launch == NULL or get_context == NULL:
            raise RuntimeError("no loaded CUDA driver with cuGraphLaunch and cuCtxGetCurrent")
        cdef void *context = NULL
        if (<_cu_ctx_get_current_t>get_context)(&context) != 0 or context == NULL:
            raise RuntimeError("no CUDA context is current")
        graph = torch.cuda.CUDAGraph()
        if not hasattr(graph, "raw_cuda_graph_exec"):
            raise RuntimeError("this torch hands out no executable of a captured graph")
        with torch.cuda.graph(graph):
            work()
        cdef void *graph_exec = _graph_exec(graph)
        self._launch = <_cu_graph_launch_t>launch
        self._get_context = <_cu_ctx_get_current_t>get_context
        self._context = context
        self._exec = graph_exec
        self._stream_of = raw_stream_getter()
        self._device_index = device_index
        self._graph = graph

    def launch(self):
        """Launch the graph on the device's current stream (asynchronous), by the driver, or
        by torch's replay where another CUDA context is current on this thread.

        Raises
        ------
        RuntimeError
            The driver refused the launch (naming its ``CUresult``).
        ValueError
            ``__init__`` never completed.
        """
        _check_bound(self._graph is not None, "GraphLaunch")
        cdef void *current = NULL
        if self._get_context(&current) != 0 or current != self._context:
            import torch

            with torch.cuda.device(self._device_index):
                self._graph.replay()
            return
        cdef uintptr_t stream = self._stream_of(self._device_index)
        cdef int err = self._launch(self._exec, <void *>stream)
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
