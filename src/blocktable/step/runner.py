"""A whole block-table step from one CUDA graph: the host only fills a pinned buffer.

Per step the host applies the update to its table (the truth) and writes, with numpy, into a
pinned staging buffer: the changed entries as ``(flat index, value)`` pairs, and the batch's
``query_start_loc``, ``row_of_batch``, ``seq_lens`` and positions. Then it replays one CUDA
graph, captured once, of kernels only: the first reads the staging buffer in place (pinned
memory mapped into the device's address space), scatters the pairs into the device table and
brings the batch to a device buffer; then the slot mapping of every group, and a post to the
mailbox (below). Where the device cannot read that memory, the graph copies the staging
buffer to the device first (a copy node, which costs the host more to replay). Where it can,
the step launches its graph by one compiled call to the CUDA driver rather than through
``torch.cuda.CUDAGraph.replay`` (same graph, same stream, less host time). Launch shapes
come from the capacities only, so
one graph serves every batch: ``query_start_loc`` is padded with ``num_tokens``, so padding
requests own no token and every token past ``num_tokens`` maps to ``PAD_SLOT_ID``.

A caller that builds its batch with numpy anyway (an engine) writes it straight into the
staging buffer: :meth:`CapturedStep.batch_views` hands out its views, and
:meth:`CapturedStep.run_staged` checks what was written and runs the step, so the batch is
neither copied on the host nor sent to the device a second time with the model's inputs.

Two staging buffers alternate, each with its own graph. The host refills a buffer only after
the device has read what it held two steps ago: after its last read the graph writes the
step's sequence number into pinned host memory (a *mailbox*), and the host reads it with numpy
(no CUDA call; it spins only when the device runs two steps behind). Where the device cannot
write host memory, an event recorded after each replay is waited on instead.

On the CPU backend the same object does the same work eagerly on one thread (no torch op, so no
intra-op thread pool): with numpy, or in one compiled call per piece (the batch check, the
scatter, each group's slot mapping) where the package's compiled loops are built. With
``backend="triton"`` on CPU tensors (under ``TRITON_INTERPRET=1``) it launches the graph's
kernels eagerly: the tests' way to run the CUDA path's kernels on padded inputs without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from blocktable._checks import check_positive
from blocktable._native_loader import native_module
from blocktable.constants import PAD_SLOT_ID
from blocktable.multi_group import MultiGroupBlockTable
from blocktable.step.host import FULL, DecodeStager, largest, stage_general
from blocktable.step.kernels import launch_direct_scatter, launch_post, launch_staged_scatter
from blocktable.step.layout import BATCH_WORDS, NUM_PAIRS, SEQ, SLOT, StagingViews, StepLayout
from blocktable.step.numpy_slots import CheckedSlots
from blocktable.update import PackedStepUpdate, StepUpdate

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_U32 = np.dtype(np.uint32)
_SEQ_MASK = 0x7FFFFFFF
_WAIT_WARN_S = 60.0


class StagedBatch(NamedTuple):
    """numpy views (on cpu, pinned with CUDA) of the staging buffer the next
    :meth:`CapturedStep.run_staged` sends, at full capacity: write the batch's first
    ``num_reqs + 1`` / ``num_tokens`` / ``num_reqs`` entries, then call ``run_staged``."""

    query_start_loc: np.ndarray  # int32 [max_num_reqs + 1]
    positions: np.ndarray  # int64 [max_num_tokens]
    row_of_batch: np.ndarray  # int32 [max_num_reqs]
    seq_lens: np.ndarray  # int32 [max_num_reqs]


class _TokenViews(NamedTuple):
    """A captured step's views of its first ``t`` tokens, for one ``t``."""

    device_positions: torch.Tensor  # int64 [t]: the device buffer's positions
    # the CPU backend's (else None): int64 [t], its one staging buffer's positions; int64
    # [groups, t], the slot buffers
    positions: np.ndarray | None
    slots: np.ndarray | None
    first_slots: np.ndarray | None  # int64 [t]: the first group's row of slots


# Views by token count are made when the step is built up to this capacity (about 1 KiB of
# host memory per token), past it at each size's first step.
_EAGER_TOKENS = 16384


class StepOutputs(NamedTuple):
    """This step's device tensors (valid until the next step's device work, in stream order)."""

    slot_mappings: tuple[torch.Tensor | None, ...]  # per group: int64 [max_num_batched_tokens]
    query_start_loc: torch.Tensor  # on device, int32 [num_reqs + 1]
    positions: torch.Tensor  # on device, int64 [num_tokens]
    row_of_batch: torch.Tensor  # on device, int32 [num_reqs]
    seq_lens: torch.Tensor | None  # on device, int32 [num_reqs]; None if not given
    num_pairs: int  # table entries the step's commit moved (-1: the table's own commit did)


_new_tuple = tuple.__new__


class CapturedStep:
    """The block-table part of an engine step, replayed from one CUDA graph.

    Parameters
    ----------
    table : MultiGroupBlockTable
        The table (all its groups). Not in debug mode (debug synchronizes every step).
    max_num_reqs : int or None
        Most requests in a step's batch; default and upper bound ``table.max_num_reqs``.
    max_num_tokens : int or None
        Most tokens in a step; default and upper bound ``table.max_num_batched_tokens``. The
        step makes its views of the batch for every size once (a step never slices), when it
        is built for up to 16384 tokens (about 1 KiB of host memory per token, and tens of
        milliseconds per 10,000 tokens), at each size's first step past that.
    max_pairs : int or None
        Most changed table entries (ids and counts) one step moves through the graph; a step
        that changes more is still correct: the table's own commit moves it, before the graph.
        Default ``max(1024, 4 * max_num_reqs)``.
    use_graph : bool
        On CUDA, capture and replay (default); ``False`` launches the same kernels eagerly.

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

    try_mailbox = True  # False: always wait on events (tests of that path)
    try_in_place = True  # False: always copy the staging buffer first (tests, benchmarks)

    def __init__(
        self,
        table: MultiGroupBlockTable,
        *,
        max_num_reqs: int | None = None,
        max_num_tokens: int | None = None,
        max_pairs: int | None = None,
        use_graph: bool = True,
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
        self.layout = StepLayout(P, R, T)
        self._max_pairs = P
        self.device = table.device
        cuda = self.device.type == "cuda"
        self.mode = "numpy" if table.backend == "torch" else "kernels"
        if cuda and self.mode == "numpy":
            raise ValueError("a captured step on CUDA needs the table's triton backend, got "
                             "backend='torch'")
        self._native = native_module()  # the compiled loops, or None (numpy)
        numpy_mode = self.mode == "numpy"
        # on cpu, int32: the CPU backend's device table (None on CUDA); the stager writes it
        # with the host table, so a step never scatters what the stager staged
        self._flat_np = table.storage.device_tensor.numpy() if numpy_mode else None
        self._stager = DecodeStager(table, self._native, mirror=self._flat_np)
        # the stager's compiled one-group lanes, inlined in run_staged: (stage_appends,
        # stage_packed, the host table, the lanes' table arguments, the most rows a decode
        # lane stages within max_pairs), or None (numpy, several groups)
        stager, native = self._stager, self._native
        args = stager._group_args if stager._one_group else None
        self._lane = None if native is None or args is None else (
            native.stage_appends, native.stage_packed, table.storage.host, args,
            P // (args[1] + 1))
        self._storage = table.storage  # (the lanes' checks read it every step)
        words = self.layout.num_words
        num_slots = 2 if cuda else 1
        # on cpu (pinned with CUDA), int32 [num_slots, num_words]: the staging buffers
        self._host = torch.zeros(num_slots, words, dtype=torch.int32, pin_memory=cuda)
        self._views = [StagingViews(self._host[s].numpy(), self.layout) for s in range(num_slots)]
        for s, v in enumerate(self._views):
            v.header[SLOT] = s  # for the mailbox; never changes
        # on device, int32 [num_words]: the staging copy kernels read (numpy mode: staging 0)
        self._dev = (self._host[0] if self.mode == "numpy"
                     else torch.zeros(words, dtype=torch.int32, device=self.device))
        # on cpu (pinned with CUDA), int32 [2]: each slot's last sequence number the device saw
        self._mailbox_host = torch.full((2,), -1, dtype=torch.int32, pin_memory=cuda)
        self._mailbox_np = self._mailbox_host.numpy()
        # the same memory as memoryviews: a Python int read or written without numpy's scalar
        # machinery (two of them per step on CUDA)
        self._mailbox_mv = self._mailbox_np.data
        self._header_mv = [v.header.data for v in self._views]
        self._mailbox: torch.Tensor = self._mailbox_host
        self._events: list[torch.cuda.Event] | None = None  # when the mailbox cannot be used
        self._expect: list[int | None] = [None] * num_slots  # seq each slot's copy will post
        self._slot = 0
        self._seq = 0
        # per slot, the batch size its qsl padding was written for (num_reqs * key + num_tokens)
        self._padded = [-1] * num_slots
        self._padding_key = T + 1
        self._slot_flip = num_slots - 1  # the next step's slot: slot ^ this
        self._max_reqs, self._max_tokens = R, T  # the batch's bounds (run_staged checks them)
        self._num_rows = table.max_num_reqs
        self._tokens_filled = table.max_num_batched_tokens  # slots past it are PAD (numpy)
        self._calls_seen = -1  # table.slot_mapping_calls when the slots were last ours
        self._batch_words = self.layout.batch_words(0)  # the batch's words, but positions
        self._arange = np.arange(R, dtype=np.int32)
        self._decode_qsl = np.arange(R + 1, dtype=np.int32).tobytes()  # qsl of 1 token each
        self._lent = -1  # the slot whose views batch_views() handed out for run_staged
        self._slots_np = table.slot_buffers.numpy() if numpy_mode else None
        self._slots = (CheckedSlots(self._flat_np, table.slot_params, table.max_num_reqs, T,
                                    self._native)
                       if self._flat_np is not None else None)
        # the CPU backend's one group, compiled: (map_slots, table, width, kernel block size,
        # rows), for the step's one call (else None)
        checked, native = self._slots, self._native
        one = (None if checked is None or native is None or not checked.fast
               else checked.one_group)
        self._one_map = (None if one is None or checked is None or native is None else
                         (native.map_slots, *one, checked.max_num_reqs))
        self._decode = False  # the last checked batch had one token per request
        L = self.layout
        d = self._dev
        self._d_qsl = d[L.qsl : L.rows]
        self._d_rows = d[L.rows : L.seq_lens]
        self._d_seq_lens = d[L.seq_lens : L.seq_lens + R]
        self._d_positions = d[L.positions : L.num_words].view(torch.int64)
        # The batch's views by size, made once (a step indexes them, never slices). By
        # num_reqs n, made here: per staging slot, numpy qsl[:n + 1] and rows[:n]; the device
        # outputs qsl, rows and seq_lens. By num_tokens t (_TokenViews), made here up to
        # _EAGER_TOKENS of capacity, past it at a size's first step.
        self._qsl_by_n = [[v.qsl[: n + 1] for n in range(R + 1)] for v in self._views]
        self._rows_by_n = [[v.rows[:n] for n in range(R + 1)] for v in self._views]
        self._d_by_n = [(self._d_qsl[: n + 1], self._d_rows[:n], self._d_seq_lens[:n])
                        for n in range(R + 1)]
        # CUDA with the compiled loops: per staging slot, prepare_batch and the views it takes
        # (the batch at full capacity, and the header: it writes header[SEQ] and
        # header[BATCH_WORDS], fields 1 and 3)
        prepare = None if numpy_mode or self._native is None else getattr(
            self._native, "prepare_batch", None)
        if (SEQ, BATCH_WORDS) != (1, 3):
            raise AssertionError("prepare_batch writes header fields 1 (SEQ) and 3 (BATCH_WORDS)")
        self._prepare = (None if prepare is None else
                         [(prepare, v.qsl, v.rows, v.header) for v in self._views])
        self._by_t: list[_TokenViews | None] = [None] * (T + 1)
        if T <= _EAGER_TOKENS:
            for t in range(T + 1):
                self._token_views(t)
        self._slot_views = tuple(
            table.slot_mapping(g) if spec.has_slots else None
            for g, spec in enumerate(table.specs)
        )
        self._graphs: list[torch.cuda.CUDAGraph] | None = None
        # CUDA graphs launched through the driver (set by _launch_through_driver): the
        # compiled graph_launch, each graph's exec handle, the capture's context, the raw
        # current-stream getter and the device's index
        self._graph_launch: Callable[[int, int, int], int] | None = None
        self._graph_execs: list[int] = []
        self._context = 0
        self._raw_stream: Callable[[int], int] = _default_stream
        self._device_index = self.device.index or 0
        # the kernels read the pinned staging buffer in place (no copy node); proven on CUDA
        self._in_place = self.mode == "kernels" and self.try_in_place
        if cuda:
            with torch.cuda.device(self.device):  # capture on the table's device
                self._prepare_cuda(use_graph)

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
            The step's row changes (``StepUpdate.empty`` for none). One from the allocator's
            ``take_step_update`` carries facts that settle some checks (its rows, its ids);
            every other update is checked in full.
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
        if not isinstance(update, StepUpdate):
            raise TypeError(f"update must be a StepUpdate, got {type(update).__name__}")
        num_reqs, num_tokens = self._check_batch(query_start_loc, positions, row_of_batch,
                                                 seq_lens)
        v = self._acquire()
        v.qsl[: num_reqs + 1] = query_start_loc
        v.rows[:num_reqs] = self._arange[:num_reqs] if row_of_batch is None else row_of_batch
        if seq_lens is not None:
            v.seq_lens[:num_reqs] = seq_lens
        v.positions[:num_tokens] = positions
        self._lent = self._slot
        try:  # one path for both: run_staged checks the batch's values, then runs the step
            return self.run_staged(update, num_reqs, num_tokens,
                                   with_seq_lens=seq_lens is not None)
        finally:
            self._lent = -1  # (run_staged clears it too, once it has staged)

    def batch_views(self) -> StagedBatch:
        """The staging buffer the next :meth:`run_staged` sends, for the caller to write the
        batch into directly (no copy of the batch per step).

        Blocks, like :meth:`run`, until the device has read that buffer's previous contents
        (on CUDA it alternates between two; the views stay valid until ``run_staged``).
        """
        v = self._acquire()
        self._lent = self._slot
        return StagedBatch(v.qsl, v.positions, v.rows, v.seq_lens)

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
            Before any write to the table, as :meth:`run` does (sizes past the capacities, a
            malformed ``query_start_loc``, rows out of range, a bad update).
        """
        if not isinstance(update, StepUpdate):
            raise TypeError(f"update must be a StepUpdate, got {type(update).__name__}")
        if self._lent != self._slot:
            raise RuntimeError("run_staged needs batch_views() first (once per step)")
        if not (type(num_reqs) is int and 0 <= num_reqs <= self._max_reqs):
            raise ValueError(f"num_reqs must be an int in [0, {self._max_reqs}], "
                             f"got {num_reqs!r}")
        if not (type(num_tokens) is int and 0 <= num_tokens <= self._max_tokens):
            raise ValueError(f"num_tokens must be an int in [0, {self._max_tokens}], "
                             f"got {num_tokens!r}")
        slot = self._slot
        seq = -1
        code = -1
        prepare = self._prepare
        if prepare is not None:  # CUDA, compiled: check, qsl padding and header in one call
            prepare_batch, qsl_full, rows_full, header_np = prepare[slot]
            seq = (self._seq + 1) & _SEQ_MASK
            code = prepare_batch(qsl_full, rows_full, num_reqs, num_tokens, self._num_rows,
                                 header_np, self._batch_words + 2 * num_tokens, seq)
            if code >= 0:
                self._padded[slot] = -1  # (the padding is prepare_batch's now)
            else:
                seq = -1
        if code < 0:
            qsl = self._qsl_by_n[slot][num_reqs]
            rows = self._rows_by_n[slot][num_reqs]
            # (the compiled check inlined: a call costs ~1 us with cold caches)
            native = self._native
            code = -1 if native is None else native.check_batch(qsl, rows, num_tokens,
                                                                 self._num_rows)
            if code < 0:
                self._check_values(qsl, num_reqs, num_tokens, rows)  # raises, or sets _decode
        if code >= 0:
            self._decode = code == 1
        v = self._views[slot]
        P = self._max_pairs
        num_pairs = -1
        lane = self._lane
        facts = update.facts
        if lane is not None and facts is not None:
            # The stager's compiled one-group lanes, inlined for an engine's every step (an
            # update of the allocator's journal, its block sizes checked before, no pending
            # change or device read of the host table): the same checks and calls as
            # DecodeStager.stage, without its Python call. Anything else goes through it.
            storage = self._storage
            if (facts.num_rows <= self._num_rows and not storage.changed
                    and update.allocator_block_sizes == self._stager._sizes_ok
                    and storage.host_read_event is None):
                stage_appends, stage_packed, host, args, max_appends = lane
                if type(update) is PackedStepUpdate:  # admissions and finishes
                    num_pairs = stage_packed(host, v.pairs, P, update.packed_data,
                                             update.packed_sizes, *args)
                elif facts.appends_only:  # the decode lane: rows gaining one block each
                    part = update.appended[0]
                    if len(part.rows) <= max_appends:
                        num_pairs = stage_appends(host, v.pairs, part.rows, part.block_ids,
                                                  *args)
        if num_pairs < 0:  # (a compiled lane's refusal wrote nothing; the paths below name it)
            num_pairs = self._stager.stage(update, v.pairs, P)
            if num_pairs < 0:
                num_pairs = stage_general(self.table, update, v.pairs, P)
                if num_pairs > 0 and self._flat_np is not None:
                    self._scatter_numpy(v.pairs, num_pairs)  # (the stager wrote its own pairs)
        self._lent = -1
        if seq < 0:
            padded = num_reqs * self._padding_key + num_tokens
            if self._flat_np is None and self._padded[slot] != padded:
                v.qsl[num_reqs + 1 :] = num_tokens  # padding requests own no token
                self._padded[slot] = padded
        by_t = self._by_t[num_tokens] or self._token_views(num_tokens)
        if self._flat_np is not None:  # the header is for the device's kernels only
            self._run_numpy(num_reqs, num_tokens, by_t)
        else:
            header = self._header_mv[slot]
            # (-1: the table's own commit moved them; no max(): a builtin call per step)
            header[NUM_PAIRS] = num_pairs if num_pairs > 0 else 0  # noqa: FURB136
            if seq < 0:
                header[BATCH_WORDS] = self._batch_words + 2 * num_tokens
                seq = (self._seq + 1) & _SEQ_MASK
                header[SEQ] = seq
            self._seq = seq
            graphs = self._graphs
            if graphs is not None and self._events is None:  # (_run_device inlined)
                launch = self._graph_launch  # the driver's launch, without torch's wrapper
                if launch is None or launch(self._graph_execs[slot],
                                            self._raw_stream(self._device_index),
                                            self._context) < 0:
                    graphs[slot].replay()
            else:
                self._run_device(slot)
            self._expect[slot] = seq
            self._slot = slot ^ self._slot_flip
        # the outputs: the batch's device views (the named tuple built without its Python
        # __new__, a call that costs about a microsecond with cold caches)
        by_n = self._d_by_n[num_reqs]
        return _new_tuple(StepOutputs, (self._slot_views, by_n[0], by_t.device_positions,
                                        by_n[1], by_n[2] if with_seq_lens else None, num_pairs))

    def _acquire(self) -> StagingViews:
        """The views of the staging buffer this step fills, once the device has read it."""
        slot = self._slot
        if self._expect[slot] is not None:
            self._wait_free(slot)
        return self._views[slot]

    def _token_views(self, num_tokens: int) -> _TokenViews:
        """The views of ``num_tokens`` tokens (made once, then indexed)."""
        slots = self._slots_np  # (the CPU backend's: one staging buffer)
        views = self._by_t[num_tokens] = _TokenViews(
            self._d_positions[:num_tokens],
            None if slots is None else self._views[0].positions[:num_tokens],
            None if slots is None else slots[:, :num_tokens],
            None if slots is None else slots[0, :num_tokens],
        )
        return views

    def _check_batch(self, qsl: np.ndarray, positions: np.ndarray, rows: np.ndarray | None,
                     seq_lens: np.ndarray | None) -> tuple[int, int]:
        """``(num_reqs, num_tokens)`` of arrays of the right dtypes and shapes within the
        capacities, or raise (:meth:`run_staged` checks their values)."""
        L = self.layout
        _check_array("query_start_loc", qsl, _I32)
        _check_array("positions", positions, _I64)
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
                if len(arr) != num_reqs:
                    raise ValueError(f"{name} has {len(arr)} entries, query_start_loc "
                                     f"describes {num_reqs} requests")
        return num_reqs, num_tokens

    def _check_values(self, qsl: np.ndarray, num_reqs: int, num_tokens: int,
                      rows: np.ndarray | None) -> None:
        """Raise unless ``qsl`` (int32 ``[num_reqs + 1]``) starts at 0, never decreases and
        ends at ``num_tokens``, and ``rows`` (int32 ``[num_reqs]``) lie in the table, with
        numpy (the callers try the compiled ``check_batch`` first, where it is built)."""
        # one token per request (a decode batch): well formed by one comparison of bytes
        self._decode = (num_tokens == num_reqs
                        and qsl.tobytes() == self._decode_qsl[: 4 * num_reqs + 4])
        if not self._decode and (qsl[0] != 0 or qsl[num_reqs] != num_tokens or (
            num_reqs > 1 and largest(qsl[1:] < qsl[:-1])  # a decrease anywhere
        )):
            raise ValueError("query_start_loc must start at 0, never decrease and end at "
                             f"num_tokens={num_tokens} (len(positions)), got first "
                             f"{int(qsl[0])}, last {int(qsl[num_reqs])}")
        bound = self.table.max_num_reqs
        if rows is not None and num_reqs and largest(rows.view(_U32)) >= bound:
            bad = int(rows[(rows < 0) | (rows >= bound)][0])
            raise IndexError(f"row_of_batch holds row {bad}, outside [0, {bound})")

    # ---------------------------------------------------------------- device work
    def _run_numpy(self, num_reqs: int, num_tokens: int, by_t: _TokenViews) -> None:
        """The CPU backend (its device table already written with the host's): the slot
        mapping, re-padding only the slots the last step filled (the whole tail after a
        ``compute_slot_mapping`` call)."""
        out, table = self._slots_np, self.table
        assert out is not None
        if not table.slot_params:
            return
        if table.slot_mapping_calls != self._calls_seen:
            self._calls_seen = table.slot_mapping_calls
            self._tokens_filled = out.shape[1]
        if self._tokens_filled > num_tokens:
            out[:, num_tokens : self._tokens_filled] = PAD_SLOT_ID
        self._tokens_filled = num_tokens
        if num_tokens:
            assert self._slots is not None
            assert by_t.positions is not None and by_t.slots is not None
            qsl, rows = self._qsl_by_n[0][num_reqs], self._rows_by_n[0][num_reqs]
            decode = num_tokens == num_reqs and self._decode
            one = self._one_map  # one group, compiled: CheckedSlots.map's call, inlined
            if one is not None and one[0](one[1], by_t.positions, None if decode else qsl, rows,
                                          by_t.first_slots, one[2], one[3], one[4]) >= 0:
                return
            self._slots.map(qsl, by_t.positions, rows, by_t.slots, decode)

    def _scatter_numpy(self, pairs: np.ndarray, num_pairs: int) -> None:
        """The CPU backend's device table gets the ``num_pairs`` pairs staged in ``pairs``
        (int32: indices, then values) by the general path."""
        flat = self._flat_np
        assert flat is not None
        if self._native is None:
            flat.put(pairs[:num_pairs], pairs[num_pairs : 2 * num_pairs])
        elif self._native.scatter(flat, pairs, num_pairs) < 0:  # staged by the step itself
            raise RuntimeError("a staged pair indexes past the table buffer")

    def _device_work(self, slot: int) -> None:
        """Scatter the pairs of staging ``slot`` and bring its batch to the device (reading it
        in place, or copying it whole first), map the slots (padded), post to the mailbox."""
        flat = self.table.storage.device_tensor
        if self._in_place:
            launch_direct_scatter(flat, self._host[slot], self._dev, self.layout)
        else:
            self._dev.copy_(self._host[slot], non_blocking=True)
            launch_staged_scatter(flat, self._dev, self._mailbox, self.layout.max_pairs)
        if self.table.slot_params:
            self.table.launch_slot_mapping_unchecked(self._d_qsl, self._d_positions,
                                                     self._d_rows)
        if self._in_place:  # after every read of the staging buffer
            launch_post(self._dev, self._mailbox)

    def _run_device(self, slot: int) -> None:
        if self._graphs is not None:
            self._graphs[slot].replay()
        else:
            self._device_work(slot)
        if self._events is not None:
            self._events[slot].record()

    def _wait_free(self, slot: int) -> None:
        """Block until the copy that last read staging ``slot`` has finished."""
        if self._events is not None:
            self._events[slot].synchronize()
            return
        expect = self._expect[slot]
        mailbox = self._mailbox_mv
        if mailbox[slot] == expect:
            return
        start = time.perf_counter()
        while mailbox[slot] != expect:  # the device runs two steps behind: wait for it
            if time.perf_counter() - start > _WAIT_WARN_S:
                raise RuntimeError(
                    f"the device did not finish the step copy of {_WAIT_WARN_S:.0f} s ago "
                    "(a failed launch, or a stream that never runs)"
                )
            time.sleep(0)

    # ---------------------------------------------------------------- cuda setup
    def _prepare_cuda(self, use_graph: bool) -> None:
        """Warm up (compiles the kernels, proves what the device can read and write of host
        memory) on a side stream, then capture.

        In order of preference: the kernels read the staging buffer in place and post to the
        mailbox; the buffer is copied first and the scatter posts to the mailbox; the buffer
        is copied first and events are waited on."""
        device = self.device
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            mapped = False
            if self.try_mailbox:
                for in_place in (True, False) if self._in_place else (False,):
                    self._in_place = in_place
                    mapped = self._prove_mapped(side)
                    if mapped:
                        break
            if not mapped:
                self._in_place = False
                self._mailbox = torch.zeros(2, dtype=torch.int32, device=device)
                self._events = [torch.cuda.Event() for _ in self._views]
                for s in range(len(self._views)):
                    self._device_work(s)
                side.synchronize()
        current.wait_stream(side)
        if use_graph:
            graphs = []
            for s in range(len(self._views)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._device_work(s)
                graphs.append(graph)
            self._graphs = graphs
            self._launch_through_driver()
        torch.cuda.synchronize(device)

    def _launch_through_driver(self) -> None:
        """Replay the graphs by a compiled call to the CUDA driver's graph launch, where the
        extension, torch (each graph's exec handle, the raw current stream) and the driver
        allow it. ``torch.cuda.CUDAGraph.replay`` costs the host several microseconds more with
        cold caches (pybind, a GIL release, a device guard, the runtime API). A step whose
        thread has another CUDA context current replays through torch instead."""
        native = self._native
        graphs = self._graphs
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if (native is None or not hasattr(native, "graph_launch") or raw_stream is None
                or graphs is None
                or not all(hasattr(g, "raw_cuda_graph_exec") for g in graphs)):
            return
        launch = native.graph_launch
        context = native.cuda_context()  # (the table's device is current: see __init__)
        try:
            execs = [int(g.raw_cuda_graph_exec()) for g in graphs]
        except RuntimeError:  # (a torch that instantiates graphs at their first replay)
            return
        if context <= 0 or not all(execs):
            return
        self._graph_execs = execs
        self._context = context
        self._raw_stream = raw_stream
        self._graph_launch = launch

    def _prove_mapped(self, stream: torch.cuda.Stream) -> bool:
        """Run a harmless step (no pairs, an empty batch) from each staging buffer on
        ``stream``; True when the device posted each to the mailbox and, reading in place,
        brought each buffer's batch words across intact."""
        words = self._batch_words
        qsl = self.layout.qsl
        self._mailbox_np[:] = -1  # nothing posted yet (an earlier attempt may have)
        for s, v in enumerate(self._views):
            v.header[NUM_PAIRS], v.header[SEQ], v.header[SLOT] = 0, _SEQ_MASK - s, s
            v.header[BATCH_WORDS] = words
            v.buffer[qsl : qsl + words] = np.arange(s, s + words, dtype=np.int32)
        try:
            for s, v in enumerate(self._views):
                self._device_work(s)
                stream.synchronize()
                if self._mailbox_mv[s] != _SEQ_MASK - s:
                    return False
                if self._in_place and not np.array_equal(
                    self._dev[qsl : qsl + words].cpu().numpy(), v.buffer[qsl : qsl + words]
                ):
                    return False
            return True
        except Exception:  # noqa: BLE001 - the device may refuse host memory
            return False
        finally:
            for v in self._views:
                v.buffer[qsl : qsl + words] = 0

    @property
    def reads_in_place(self) -> bool:
        """True when the step's kernels read the pinned staging buffer in place (no copy of it
        to the device first: a graph of kernels only)."""
        return self._in_place

    @property
    def launches_through_driver(self) -> bool:
        """True when each step's graph is launched by one compiled call to the CUDA driver
        (``cuGraphLaunch``) rather than ``torch.cuda.CUDAGraph.replay``: same graph, same
        stream (the current one), less host time."""
        return self._graph_launch is not None

    @property
    def uses_mailbox(self) -> bool:
        """True when the device posts finished copies to pinned host memory (CUDA)."""
        return self.device.type == "cuda" and self._events is None


def _default_stream(device_index: int) -> int:
    """The raw default stream (0): a stand-in where the steps replay through torch."""
    return 0


def _capacity(name: str, value: int | None, bound: int) -> int:
    if value is None:
        return bound
    check_positive(name, value)
    if value > bound:
        raise ValueError(f"{name}={value} is more than the table's {bound}")
    return int(value)


def _check_array(name: str, value: object, dtype: np.dtype) -> None:
    # identity first: numpy's native dtypes are singletons (a cheap test for the common case)
    if not (type(value) is np.ndarray and (value.dtype is dtype or value.dtype == dtype)
            and value.ndim == 1):
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{name} must be a numpy array, got {type(value).__name__}")
        raise TypeError(f"{name} must be a 1-D {dtype.name} array, got "
                        f"{value.ndim}-D {value.dtype}")


__all__ = ["FULL", "CapturedStep", "StagedBatch", "StepOutputs"]
