"""The block-table part of an engine step, one path on every backend.

A step is, in order:

1. check the batch (``query_start_loc`` well formed, rows inside the table);
2. apply the step's :class:`~blocktable.update.StepUpdate` to the host table, the truth
   (:meth:`MultiGroupBlockTable.apply`: every check first, so a bad update changes nothing);
3. stage the changed entries as ``(flat index, value)`` pairs into a staging buffer
   (:meth:`Committer.stage`, the pairs :meth:`MultiGroupBlockTable.commit` would move);
4. the device work: scatter the pairs into the device table and map every group's slots,
   padded to the buffer's end.

Only step 4 differs by backend. On CUDA it is one CUDA graph per staging buffer, captured once,
of kernels only: the scatter reads the pinned staging buffer in place (the pair count, the
pairs, and the batch words it copies to the device), the slot-mapping kernel maps the copied
batch, and a one-thread kernel posts the step to a pinned *mailbox*. Launch shapes come from the
capacities, so one graph serves every batch: ``query_start_loc`` is padded with
``num_tokens``, so padding requests own no token. The graph is launched by one compiled call
to the CUDA driver (``GraphLaunch`` in the compiled part, where the install built it; else
torch's replay): in the engine loop, with the caches cold, a torch replay costs the host more
than the rest of the step.
Two staging buffers alternate; a buffer is refilled once the mailbox shows the post of the
replay that last read it. On the CPU backend
the launch is one call on the calling thread that reads the staging buffer as the graph does:
the pairs into the CPU "device" table, then the host slot mapping (compiled where the install
built it, else numpy). With ``backend="triton"`` on CPU tensors
(under ``TRITON_INTERPRET=1``) the graph's kernels launch eagerly: the tests' way to run the
CUDA path's kernels without a GPU.

A caller that builds its batch with numpy anyway (an engine) writes it straight into the
staging buffer: :meth:`CapturedStep.batch_views` hands out its views, and
:meth:`CapturedStep.run_staged` checks what was written and runs the step. Its own per-step
inputs (an engine's token ids) may travel in the same buffer, as a *payload*: then one copy
brings everything a step sends to the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from blocktable import _compiled_loader as _loader
from blocktable._checks import check_positive
from blocktable._triton import HAS_TRITON, Launcher, tl, triton
from blocktable.commit import FULL, launch_staged_scatter
from blocktable.multi_group import MultiGroupBlockTable
from blocktable.step.layout import NUM_PAIRS, StagingViews, StepLayout
from blocktable.update import StepUpdate

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_U32 = np.dtype(np.uint32)
_POST_MASK = (1 << 30) - 1  # the mailbox counts modulo 2**30 (never overflows an int32)
_DEVICE_WAIT_S = 60.0  # a device this late is stuck: raise rather than hang

if HAS_TRITON:

    @triton.jit
    def _post_kernel(mailbox_ptr, SLOT, MASK: tl.constexpr):
        # stream order: runs once the step's kernels, the last reader of the staging buffer
        # SLOT, are done
        count = tl.load(mailbox_ptr + SLOT)
        tl.store(mailbox_ptr + SLOT, (count + 1) & MASK)

    _post_launch = Launcher(_post_kernel)


class StagedBatch(NamedTuple):
    """numpy views (on cpu, pinned with CUDA) of the staging buffer the next
    :meth:`CapturedStep.run_staged` sends, at full capacity: write the batch's first
    ``num_reqs + 1`` / ``num_tokens`` / ``num_reqs`` entries (and the payload, where the step
    has one), then call ``run_staged``."""

    query_start_loc: np.ndarray  # int32 [max_num_reqs + 1]
    positions: np.ndarray  # int64 [max_num_tokens]
    row_of_batch: np.ndarray  # int32 [max_num_reqs]
    seq_lens: np.ndarray  # int32 [max_num_reqs]
    payload: np.ndarray  # int32 [payload_words]: the caller's own inputs (not checked)


class StepOutputs(NamedTuple):
    """This step's device tensors (valid until the next step's device work, in stream order)."""

    slot_mappings: tuple[torch.Tensor | None, ...]  # per group: int64 [max_num_batched_tokens]
    query_start_loc: torch.Tensor  # on device, int32 [num_reqs + 1]
    positions: torch.Tensor  # on device, int64 [num_tokens]
    row_of_batch: torch.Tensor  # on device, int32 [num_reqs]
    seq_lens: torch.Tensor | None  # on device, int32 [num_reqs]; None if not given
    num_pairs: int  # table entries the step moved (-1: too many; the table's commit moved them)


# StepOutputs from a tuple of its fields in one C call (a NamedTuple's own __new__ is Python)
_step_outputs = partial(tuple.__new__, StepOutputs)


class CapturedStep:
    """The block-table part of an engine step: update, commit and slot mapping in one call.

    Parameters
    ----------
    table : MultiGroupBlockTable
        The table (all its groups). Not in debug mode (debug synchronizes every step).
    max_num_reqs : int or None
        Most requests in a step's batch; default and upper bound ``table.max_num_reqs``.
    max_num_tokens : int or None
        Most tokens in a step; default and upper bound ``table.max_num_batched_tokens``.
    max_pairs : int or None
        Most changed table entries (ids and counts) one step stages; a step that changes more
        is still correct: the table's own commit moves it, before the step's device work.
        Default ``max(1024, 4 * max_num_reqs)``.
    use_graph : bool
        On CUDA, capture and replay (default); ``False`` launches the same kernels eagerly
        (the same kernels, the post included).
    payload_words : int
        int32 words of the caller's own per-step inputs that travel with the batch: written
        into ``batch_views().payload``, on the device in :attr:`device_payload` once the
        step's device work ran (default 0).

    Attributes
    ----------
    launch_kind : str
        How each step's device work is issued: ``"driver"`` (the CUDA graph launched by one
        compiled call to the CUDA driver), ``"replay"`` (torch's replay of the graph, where
        the compiled part is not built), ``"eager"`` (the kernels one by one: ``use_graph``
        off, or Triton's interpreter) or ``"host"`` (the CPU backend's one call).

    Examples
    --------
    >>> import numpy as np
    >>> from blocktable import GroupSpec, MultiGroupBlockTable, RowBlocks, StepUpdate
    >>> from blocktable.step import CapturedStep
    >>> bt = MultiGroupBlockTable([GroupSpec(block_size=4)], 2, 32, max_num_batched_tokens=8)
    >>> step = CapturedStep(bt)
    >>> up = StepUpdate.make(1, added=[RowBlocks.from_lists([0], [[7, 9]])])
    >>> out = step.run(up, np.array([0, 3], np.int32), np.array([3, 4, 5], np.int64))
    >>> out.slot_mappings[0][:4].tolist()
    [31, 36, 37, -1]
    """

    def __init__(
        self,
        table: MultiGroupBlockTable,
        *,
        max_num_reqs: int | None = None,
        max_num_tokens: int | None = None,
        max_pairs: int | None = None,
        use_graph: bool = True,
        payload_words: int = 0,
    ) -> None:
        if not isinstance(table, MultiGroupBlockTable):
            raise TypeError(f"table must be a MultiGroupBlockTable, got {type(table).__name__}")
        if table.debug:
            raise ValueError("a captured step needs a table without debug=True (debug mode "
                             "copies device tensors to the host every step)")
        R = _capacity("max_num_reqs", max_num_reqs, table.max_num_reqs)
        T = _capacity("max_num_tokens", max_num_tokens, table.max_num_batched_tokens)
        P = check_positive("max_pairs", max_pairs) if max_pairs is not None else max(1024, 4 * R)
        self.table = table
        if not (type(payload_words) is int and payload_words >= 0):
            raise ValueError(f"payload_words must be an int >= 0, got {payload_words!r}")
        self.layout = L = StepLayout(P, R, T, payload_words)
        self.device = table.device
        cuda = self.device.type == "cuda"
        # "kernels": the device work is the graph's kernels (CUDA, or eagerly under Triton's
        # interpreter); "numpy": the CPU backend
        self.mode = "kernels" if table.backend == "triton" else "numpy"
        num_slots = 2 if cuda else 1
        # on cpu (pinned with CUDA), int32 [num_slots, num_words]: the staging buffers
        self._host = torch.zeros(num_slots, L.num_words, dtype=torch.int32, pin_memory=cuda)
        self._views = [StagingViews(self._host[s].numpy(), L) for s in range(num_slots)]
        # int32 [num_words] where the device work reads the batch: on the device, the batch
        # words the scatter kernel copies there (kernels), or the one staging buffer (numpy)
        self._dev = (torch.zeros(L.num_words, dtype=torch.int32, device=self.device)
                     if self.mode == "kernels" else self._host[0])
        # on CUDA, a pinned int32 [num_slots]: per staging buffer, the count of device works
        # that finished reading it (mod 2**30), posted by the device; and the count launched
        self._mailbox: torch.Tensor | None = None
        self._launched = [0] * num_slots
        if cuda:
            self._mailbox = torch.zeros(num_slots, dtype=torch.int32, pin_memory=True)
            self._mailbox_np = self._mailbox.numpy()
        self._padded = [(-1, -1)] * num_slots  # (num_reqs, num_tokens) its qsl is padded for
        self._slot = 0
        self._lent = -1  # the slot whose views batch_views() handed out
        self._arange = np.arange(R, dtype=np.int32)
        # per slot, what batch_views() hands out (the same views every step)
        self._staged = [StagedBatch(v.qsl, v.positions, v.rows, v.seq_lens, v.payload)
                        for v in self._views]
        # per slot, the compiled batch check bound to its staging buffer, where built (else
        # numpy)
        compiled = _loader.COMPILED
        self._checks = (None if compiled is None else
                        [compiled.BatchChecker(v.qsl, v.rows, table.max_num_reqs).check
                         for v in self._views])
        d = self._dev
        self._d_qsl = d[L.qsl : L.rows]
        self._d_rows = d[L.rows : L.seq_lens]
        self._d_seq_lens = d[L.seq_lens : L.seq_lens + R]
        self._d_positions = d[L.positions : L.payload].view(torch.int64)
        # on device, int32 [payload_words]: the payload of the last step's device work
        self.device_payload = d[L.payload : L.num_words]
        self._views_by_n: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # per slot, by num_reqs: its numpy qsl[: num_reqs + 1] and rows[:num_reqs]
        self._batch_by_n: list[dict[int, tuple[np.ndarray, np.ndarray]]] = [
            {} for _ in range(num_slots)]
        self._positions_by_t: dict[int, torch.Tensor] = {}
        self._slot_views = tuple(
            table.slot_mapping(g) if spec.has_slots else None
            for g, spec in enumerate(table.specs)
        )
        self.launch_kind = "host"  # (see the class docstring; set by the branches below)
        # per slot, the call that issues its device work
        self._launches: list[Callable[[], None]] = []
        if cuda:
            with torch.cuda.device(self.device):  # capture on the table's device
                self._launches = self._capture(use_graph)
        elif self.mode == "kernels":
            self.launch_kind = "eager"
            self._launches = [partial(self._device_work, 0)]
        else:
            self._launches = [self._host_launch(s) for s in range(num_slots)]

    # ---------------------------------------------------------------- one step
    def run(
        self,
        update: StepUpdate,
        query_start_loc: np.ndarray,
        positions: np.ndarray,
        row_of_batch: np.ndarray | None = None,
        seq_lens: np.ndarray | None = None,
    ) -> StepOutputs:
        """Apply ``update`` to the table and issue the step's device work (asynchronous).

        Parameters
        ----------
        update : StepUpdate
            The step's row changes (``StepUpdate.empty`` for none).
        query_start_loc : np.ndarray
            int32 ``[num_reqs + 1]`` on cpu: starts at 0, never decreases, ends at
            ``num_tokens``; ``num_reqs <= max_num_reqs``.
        positions : np.ndarray
            int64 ``[num_tokens]`` on cpu, ``num_tokens <= max_num_tokens``.
        row_of_batch : np.ndarray or None
            int32 ``[num_reqs]`` on cpu: each request's table row, in ``[0, table rows)``.
            ``None``: request ``r`` reads row ``r`` (condensed mode).
        seq_lens : np.ndarray or None
            int32 ``[num_reqs]`` on cpu, handed through to the device for attention.

        Returns
        -------
        StepOutputs
            The slot mappings (the table's persistent buffers) and the batch on the device.

        Raises
        ------
        TypeError, ValueError, IndexError
            Before any write, for inputs of the wrong type, shape or dtype, a batch past the
            capacities, a malformed ``query_start_loc``, rows out of range, or a bad update.
        """
        num_reqs, num_tokens = self._check_arrays(query_start_loc, positions, row_of_batch,
                                                  seq_lens)
        v = self.batch_views()
        v.query_start_loc[: num_reqs + 1] = query_start_loc
        v.row_of_batch[:num_reqs] = (self._arange[:num_reqs] if row_of_batch is None
                                     else row_of_batch)
        if seq_lens is not None:
            v.seq_lens[:num_reqs] = seq_lens
        v.positions[:num_tokens] = positions
        try:
            return self.run_staged(update, num_reqs, num_tokens,
                                   with_seq_lens=seq_lens is not None)
        finally:
            self._lent = -1

    def batch_views(self) -> StagedBatch:
        """The staging buffer the next :meth:`run_staged` sends, for the caller to write the
        batch into directly (no copy of the batch per step).

        Blocks until the device has read that buffer's previous contents (on CUDA two
        buffers alternate; the views stay valid until ``run_staged``).
        """
        slot = self._slot
        if self._mailbox is not None:  # a replay may still read this staging buffer
            self._wait_for_device(slot)
        self._lent = slot
        return self._staged[slot]

    def run_staged(self, update: StepUpdate, num_reqs: int, num_tokens: int, *,
                   with_seq_lens: bool = True) -> StepOutputs:
        """:meth:`run` for a batch already written into :meth:`batch_views`: its first
        ``num_reqs + 1`` query start locations, ``num_tokens`` positions and ``num_reqs`` rows
        (and ``seq_lens`` when ``with_seq_lens``).

        Raises
        ------
        RuntimeError
            No :meth:`batch_views` since the last step.
        TypeError, ValueError, IndexError
            Before any write to the table, as :meth:`run` does.
        """
        if not isinstance(update, StepUpdate):
            raise TypeError(f"update must be a StepUpdate, got {type(update).__name__}")
        slot = self._slot
        if self._lent != slot:
            raise RuntimeError("run_staged needs batch_views() first (once per step)")
        L = self.layout
        if not (type(num_reqs) is int and type(num_tokens) is int
                and 0 <= num_reqs <= L.max_num_reqs and 0 <= num_tokens <= L.max_num_tokens):
            _check_counts(num_reqs, num_tokens, L)  # names the bad one
        table = self.table
        checks = self._checks
        if checks is None or checks[slot](num_reqs, num_tokens) < 0:
            qsl, rows = self._batch(slot, num_reqs)
            _check_batch_values(qsl, rows, num_tokens, table.max_num_reqs)  # names the error
        v = self._views[slot]
        # checks everything before its first write; stages the pairs and their number
        num_pairs = table.apply_and_stage(update, v.header_pairs, L.max_pairs)
        self._lent = -1
        if num_pairs == FULL:
            table.commit()  # copies row spans, on the current stream before the device work
            v.header[NUM_PAIRS] = 0
        padded = self._padded[slot]
        if padded[0] != num_reqs or padded[1] != num_tokens:
            v.qsl[num_reqs + 1 :] = num_tokens  # padding requests own no token
            self._padded[slot] = (num_reqs, num_tokens)
        self._launches[slot]()
        if self._mailbox is not None:  # (the device work posts to the mailbox when done)
            self._launched[slot] = (self._launched[slot] + 1) & _POST_MASK
            self._slot = slot ^ 1
        # views by size, made once: slicing tensors every step costs more than the rest of
        # the step's host work with the caches cold
        by_n = self._views_by_n.get(num_reqs)
        if by_n is None:
            by_n = self._views_by_n[num_reqs] = (
                self._d_qsl[: num_reqs + 1], self._d_rows[:num_reqs],
                self._d_seq_lens[:num_reqs])
        by_t = self._positions_by_t.get(num_tokens)
        if by_t is None:
            by_t = self._positions_by_t[num_tokens] = self._d_positions[:num_tokens]
        return _step_outputs((self._slot_views, by_n[0], by_t, by_n[1],
                              by_n[2] if with_seq_lens else None, num_pairs))

    def _batch(self, slot: int, num_reqs: int) -> tuple[np.ndarray, np.ndarray]:
        """Staging ``slot``'s numpy ``query_start_loc[: num_reqs + 1]`` and
        ``row_of_batch[:num_reqs]`` (made once per size)."""
        batch = self._batch_by_n[slot].get(num_reqs)
        if batch is None:
            v = self._views[slot]
            batch = self._batch_by_n[slot][num_reqs] = (v.qsl[: num_reqs + 1], v.rows[:num_reqs])
        return batch

    # ---------------------------------------------------------------- checks
    def _check_arrays(self, qsl: object, positions: object, rows: object,
                      seq_lens: object) -> tuple[int, int]:
        """``(num_reqs, num_tokens)`` of numpy arrays of the right dtypes and shapes within
        the capacities, or raise (:meth:`run_staged` checks their values)."""
        L = self.layout
        _check_array("query_start_loc", qsl, _I32)
        _check_array("positions", positions, _I64)
        assert isinstance(qsl, np.ndarray) and isinstance(positions, np.ndarray)
        num_reqs = len(qsl) - 1
        num_tokens = len(positions)
        if num_reqs < 0 or num_reqs > L.max_num_reqs:
            raise ValueError(f"query_start_loc has {num_reqs + 1} entries; it must have "
                             f"num_reqs + 1 with 0 <= num_reqs <= max_num_reqs={L.max_num_reqs}")
        if num_tokens > L.max_num_tokens:
            raise ValueError(f"positions holds {num_tokens} tokens, more than "
                             f"max_num_tokens={L.max_num_tokens}")
        for name, arr in (("row_of_batch", rows), ("seq_lens", seq_lens)):
            if arr is not None:
                _check_array(name, arr, _I32)
                assert isinstance(arr, np.ndarray)
                if len(arr) != num_reqs:
                    raise ValueError(f"{name} has {len(arr)} entries, query_start_loc "
                                     f"describes {num_reqs} requests")
        return num_reqs, num_tokens

    # ---------------------------------------------------------------- device work
    def _device_work(self, slot: int) -> None:
        """Scatter staging ``slot``'s pairs into the device table and copy its batch to the
        device (one kernel reading the staging buffer where it lies), map the slots (padded)
        and, on CUDA, post to the mailbox: what each CUDA graph holds."""
        L = self.layout
        launch_staged_scatter(self.table.storage.device_tensor, self._host[slot], self._dev,
                              L.max_pairs, L.qsl)
        if self.table.slot_params:
            self.table.launch_slot_mapping_unchecked(self._d_qsl, self._d_positions,
                                                     self._d_rows)
        if self._mailbox is not None:
            _post_launch((1,), self._mailbox, slot, _POST_MASK, num_warps=1)

    def _wait_for_device(self, slot: int) -> None:
        """Block until the mailbox shows that every launched device work of staging ``slot``
        has read it (the replay before last: usually long done)."""
        mailbox, want = self._mailbox_np, self._launched[slot]
        if mailbox[slot] == want:
            return
        deadline = time.monotonic() + _DEVICE_WAIT_S
        while mailbox[slot] != want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the device did not finish a step's work within "
                                   f"{_DEVICE_WAIT_S} s (staging buffer {slot})")
            time.sleep(0)  # let other threads run

    def _host_launch(self, slot: int) -> Callable[[], None]:
        """The CPU backend's device work of staging ``slot``, as a graph replay does it: the
        staged pairs into the CPU "device" table, then the slots of the padded batch. One
        compiled call where the install built it, else numpy with the same results."""
        table, v = self.table, self._views[slot]
        device_np = table.storage.device_np
        assert device_np is not None
        header_pairs = v.buffer[: self.layout.qsl]
        compiled = _loader.COMPILED
        if compiled is not None:
            # the table's own mapper: one compiled writer of the slot buffers knows their tail
            mapper = table.host_slot_mapper
            assert mapper is not None
            return compiled.HostLaunch(header_pairs, v.qsl, v.rows, v.positions, device_np,
                                       mapper).launch

        def launch() -> None:
            n = int(v.header[NUM_PAIRS])
            device_np.put(v.pairs[:n], v.pairs[n : 2 * n])
            if table.slot_params:
                table.map_slots_on_host(v.qsl, v.positions[: v.qsl[-1]], v.rows)

        return launch

    def _capture(self, use_graph: bool) -> list[Callable[[], None]]:
        """Warm up (compiles the kernels) on a side stream, then capture one graph per
        staging buffer; returns the calls launching them (or, without ``use_graph``, the
        kernels themselves)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for s in range(len(self._views)):
                self._device_work(s)  # the staging buffers are zero: no pairs, no tokens
        current.wait_stream(side)
        slots = range(len(self._views))
        if use_graph:
            index = torch.cuda.current_device()  # (the table's: see __init__)
            launches = []
            for s in slots:
                self.launch_kind, launch = _graph_launch(partial(self._device_work, s), index)
                launches.append(launch)
        else:
            self.launch_kind = "eager"
            launches = [partial(self._device_work, s) for s in slots]
        torch.cuda.synchronize(self.device)
        assert self._mailbox is not None
        self._launched = [int(n) for n in self._mailbox_np]  # the warm-up's posts
        return launches


def _graph_launch(work: Callable[[], None],
                  device_index: int) -> tuple[str, Callable[[], None]]:
    """``(kind, launch)``: a call launching a CUDA graph of ``work``'s kernels (captured here,
    on the current device ``device_index``) on that device's current stream. Kind "driver":
    the compiled part's launch through the CUDA driver, where the install built it and the
    driver and torch allow it; else "replay", torch's."""
    compiled = _loader.COMPILED
    if compiled is not None:
        try:
            return "driver", compiled.GraphLaunch(work, device_index).launch
        except RuntimeError:  # no driver loaded, or no executable handed out by this torch
            pass
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return "replay", graph.replay


def _check_batch_values(qsl: np.ndarray, rows: np.ndarray, num_tokens: int,
                        num_rows: int) -> None:
    """Raise unless ``qsl`` (int32 ``[num_reqs + 1]``) starts at 0, never decreases and ends
    at ``num_tokens``, and ``rows`` (int32 ``[num_reqs]``) lie in ``[0, num_rows)``."""
    num_reqs = len(rows)
    if qsl[0] != 0 or qsl[num_reqs] != num_tokens or (
            num_reqs > 1 and (qsl[1:] < qsl[:-1]).any()):
        raise ValueError("query_start_loc must start at 0, never decrease and end at "
                         f"num_tokens={num_tokens} (len(positions)), got first "
                         f"{int(qsl[0])}, last {int(qsl[num_reqs])}")
    # one reduction: a negative row wraps past the bound as uint32
    if num_reqs and rows.view(_U32).max() >= num_rows:
        bad = int(rows[(rows < 0) | (rows >= num_rows)][0])
        raise IndexError(f"row_of_batch holds row {bad}, outside [0, {num_rows})")


def _check_counts(num_reqs: object, num_tokens: object, layout: StepLayout) -> None:
    """Raise unless ``num_reqs`` and ``num_tokens`` are ints within ``layout``'s capacities."""
    for name, value, bound in (("num_reqs", num_reqs, layout.max_num_reqs),
                               ("num_tokens", num_tokens, layout.max_num_tokens)):
        if not (type(value) is int and 0 <= value <= bound):
            raise ValueError(f"{name} must be an int in [0, {bound}], got {value!r}")


def _capacity(name: str, value: int | None, bound: int) -> int:
    if value is None:
        return bound
    check_positive(name, value)
    if value > bound:
        raise ValueError(f"{name}={value} is more than the table's {bound}")
    return int(value)


def _check_array(name: str, value: object, dtype: np.dtype) -> None:
    if not (type(value) is np.ndarray and value.dtype == dtype and value.ndim == 1):
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{name} must be a numpy array, got {type(value).__name__}")
        raise TypeError(f"{name} must be a 1-D {dtype.name} array, got "
                        f"{value.ndim}-D {value.dtype}")


__all__ = ["FULL", "CapturedStep", "StagedBatch", "StepOutputs"]
