"""Merge the partial attention of a context-parallel group: collectives on persistent buffers.

Each rank of the group holds its shard of every request's KV and computes, per query token and
head, a partial output and its log-sum-exp; :class:`AttentionMerger` turns them into the exact
attention output with one of three collective patterns (see the class). Every call works on
views of buffers allocated once for ``max_num_tokens``; on CUDA it makes no host sync and no
allocation, runs its math as one Triton launch (two for the all-to-all pattern: a pack and a
merge), and can be captured in a CUDA graph with its collectives.
"""

from __future__ import annotations

import contextlib
from typing import Literal, overload

import torch
import torch.distributed as dist

from blocktable._checks import check_positive, check_tensor
from blocktable.config import CPConfig
from blocktable.context_parallel.agreement import agree
from blocktable.context_parallel.collectives import Collectives
from blocktable.context_parallel.correction import A2ALayout, MergeKernels
from blocktable.context_parallel.p2p import (
    P2PLayout,
    P2PMerge,
    choose_transport,
    default_programs,
    open_symmetric_buffer,
    p2p_unavailable_reason,
)

PATTERNS = ("all_gather_reduce_scatter", "all_reduce", "all_to_all")
TRANSPORTS = ("collectives", "p2p")
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class AttentionMerger:
    """Exact merge of partial attention over the ranks of a process group.

    Patterns (every rank passes its partial ``out`` over all heads and its ``lse``):

    - ``"all_gather_reduce_scatter"``: all-gather the LSEs, scale the partial output by
      ``exp(lse_rank - lse)`` into a head-major buffer, reduce-scatter over heads. Returns this
      rank's head slice ``[T, H // world, D]``. The reduction adds values already rounded to
      the output dtype.
    - ``"all_reduce"``: all-gather the LSEs, scale, all-reduce. Returns all heads.
    - ``"all_to_all"``: one all-to-all that sends each rank its head slice of every partial
      output with the LSE packed beside it, then a local float32 merge. Returns the head slice.

    With ``gather_heads=True`` the head-sliced patterns also all-gather the slices, so every
    rank gets ``[T, H, D]`` (an engine whose model is replicated over the group needs that).

    Transports: ``"collectives"`` (default) issues the pattern's collectives on the group (NCCL
    or gloo). ``"p2p"`` (CUDA, every rank a GPU of one node) allocates a symmetric buffer per
    rank (``torch.distributed._symmetric_memory``, peer-to-peer over NVLink, no multicast) and
    merges with one Triton launch per call: each rank stores its rows straight into the peers'
    buffers, raises a flag, waits for the peers' flags and merges what it received, in float32
    with one rounding (so every pattern computes like ``"all_to_all"``). The patterns keep
    their results (which heads each rank gets); no collective runs per call.

    Every rank of the group constructs its merger at the same point with the same settings:
    construction gathers every rank's settings once (pattern, dtype, heads, head_dim,
    max_num_tokens, transport, device type, library version, world and rank order) and raises
    :class:`~blocktable.context_parallel.agreement.ConfigMismatchError` on every rank when they
    differ. Then every rank must call :meth:`merge` in the same order with the same
    ``num_tokens``, empty batches included (a call with no token still takes part in the
    collectives). With ``check_calls`` (the default on the CPU) each call first all-gathers a
    16-byte header, the caller's ``step`` and ``num_tokens``, and raises
    :class:`CallMismatchError` on every rank when they differ, before any payload moves.

    A rank that dies or never calls leaves the others blocked in a collective until the
    process group's timeout (``timeout=`` of ``init_process_group``; with NCCL, only when its
    watchdog aborts on timeout, the default): choose it to suit. Over the collectives the
    merger adds no timeout of its own; over p2p its kernel traps after ``p2p_timeout_s``.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or None
        The context-parallel group; ``None`` means the default group (which must be
        initialized). World size and rank are read from it.
    max_num_tokens : int
        Most query tokens of one call; buffers are sized for it.
    num_heads, head_dim : int
        Query heads and their size; ``num_heads`` must be a multiple of the world size for the
        head-sliced patterns.
    dtype : torch.dtype
        Of the partial outputs and the result: float32, float16 or bfloat16.
    device : torch.device or str
        Where the tensors live (CUDA with NCCL, CPU with gloo).
    pattern : str
        One of ``"all_gather_reduce_scatter"`` (default), ``"all_reduce"``, ``"all_to_all"``.
    cp : CPConfig, optional
        When given, its world size and rank must equal the group's.
    backend : str
        ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.
    transport : str
        ``"collectives"``, ``"p2p"`` (needs CUDA, Triton, symmetric memory in torch and
        every rank on one node; otherwise a ``ValueError``/``RuntimeError`` says which is
        missing) or ``"auto"``: ``"p2p"`` where every rank of a group of two or more can run
        it, else ``"collectives"`` (decided together, a collective over the group). The
        choice is :attr:`transport` afterwards. Constructing a p2p merger is a collective
        over the group.
    p2p_timeout_s : float or None
        ``"p2p"`` only: how long the kernel waits for a peer before it traps (the CUDA context
        is then lost, so a dead peer ends the process with a CUDA error instead of a hang);
        ``None`` waits forever. Keep it well above the time ranks may drift apart (a first
        call's compilation on a slow rank, for instance): a trap is fatal to the process.
    check_calls : bool or None
        Exchange and compare each call's header (see above). ``None``: on for CPU tensors,
        off on CUDA, where reading the header back is a host sync per call and breaks CUDA
        graph capture (there the engine's per-step plan check and the handshake stand in).

    Examples
    --------
    A group of one rank merges nothing away (with more ranks, every rank runs the same code):

    >>> import tempfile, torch, torch.distributed as dist
    >>> from blocktable.context_parallel import AttentionMerger
    >>> path = tempfile.mktemp()
    >>> dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    >>> merger = AttentionMerger(None, max_num_tokens=8, num_heads=4, head_dim=16,
    ...                          dtype=torch.float32, device="cpu")
    >>> out, lse = torch.randn(3, 4, 16), torch.randn(3, 4)
    >>> merged, merged_lse = merger.merge(out, lse, return_lse=True)
    >>> torch.allclose(merged, out), torch.allclose(merged_lse, lse), merger.head_slice
    (True, True, slice(0, 4, None))
    >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        max_num_tokens: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pattern: str = "all_gather_reduce_scatter",
        cp: CPConfig | None = None,
        backend: str = "auto",
        transport: str = "collectives",
        p2p_timeout_s: float | None = 60.0,
        check_calls: bool | None = None,
    ) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
        if transport not in (*TRANSPORTS, "auto"):
            raise ValueError(
                f"transport must be one of {(*TRANSPORTS, 'auto')}, got {transport!r}"
            )
        if dtype not in OUT_DTYPES:
            raise TypeError(f"dtype must be one of {OUT_DTYPES}, got {dtype}")
        self.max_num_tokens = check_positive("max_num_tokens", max_num_tokens)
        self.num_heads = check_positive("num_heads", num_heads)
        self.head_dim = check_positive("head_dim", head_dim)
        self.dtype, self.pattern = dtype, pattern
        self.device = _resolve_device(device)
        if p2p_timeout_s is not None and not p2p_timeout_s > 0:
            raise ValueError(f"p2p_timeout_s must be > 0 or None, got {p2p_timeout_s}")
        if transport == "p2p":
            reason = p2p_unavailable_reason(self.device)
            if reason is not None:
                raise (ValueError if self.device.type != "cuda" else RuntimeError)(reason)
            if backend == "torch":
                raise ValueError("transport='p2p' runs Triton: backend must be 'auto' or 'triton'")
        self._comm = Collectives(group)
        self.world_size, self.rank = self._comm.world_size, self._comm.rank
        if cp is not None and (cp.world_size, cp.rank) != (self.world_size, self.rank):
            raise ValueError(
                f"cp (world_size={cp.world_size}, rank={cp.rank}) disagrees with the process "
                f"group (world_size={self.world_size}, rank={self.rank})"
            )
        self.head_sliced = pattern != "all_reduce"
        if self.head_sliced and num_heads % self.world_size:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of the group's world_size="
                f"{self.world_size} for pattern {pattern!r} (or use pattern='all_reduce')"
            )
        self.heads_per_rank = num_heads // self.world_size if self.head_sliced else num_heads
        self._kernels = MergeKernels(backend, self.device)
        self._shape_tail = (num_heads, head_dim)
        self._view_cache: dict[int, dict[str, torch.Tensor]] = {}
        self._p2p: P2PMerge | None = None
        self.check_calls = self.device.type == "cpu" if check_calls is None else bool(check_calls)
        self.num_calls = 0
        """Calls of :meth:`merge` so far (the header's step when the caller gives none)."""
        agree(self._comm.group, "AttentionMerger", {
            "pattern": pattern, "dtype": str(dtype), "num_heads": num_heads,
            "head_dim": head_dim, "max_num_tokens": max_num_tokens, "transport": transport,
            "device type": self.device.type, "check_calls": self.check_calls,
        }, device=self.device)
        if self.check_calls:  # [step, num_tokens] of this call; every rank's, gathered
            self._header = torch.zeros(2, dtype=torch.int64, device=self.device)
            self._headers = torch.zeros(2 * self.world_size, dtype=torch.int64,
                                        device=self.device)
        if transport == "auto":  # after every local check: a collective
            transport = choose_transport(self._comm.group, self.device, backend)
        self.transport: str = transport
        if transport == "p2p":
            self._open_p2p(p2p_timeout_s)
        else:
            self._alloc()

    @property
    def head_slice(self) -> slice:
        """The heads of the result of :meth:`merge` without ``gather_heads``."""
        start = self.rank * self.heads_per_rank if self.head_sliced else 0
        return slice(start, start + self.heads_per_rank)

    def _open_p2p(self, timeout_s: float | None) -> None:
        """Allocate and exchange the symmetric buffers (a collective over the group)."""
        programs = default_programs(self.max_num_tokens, self.num_heads, self.head_dim)
        elem = torch.empty((), dtype=self.dtype).element_size()
        layout = P2PLayout(self.world_size, programs, self.max_num_tokens, self.num_heads,
                           self.head_dim, elem)
        buffer = open_symmetric_buffer(self._comm.group, layout.nbytes, self.device)
        self._p2p = P2PMerge(
            rank=self.rank, world_size=self.world_size, max_num_tokens=self.max_num_tokens,
            num_heads=self.num_heads, head_dim=self.head_dim, dtype=self.dtype,
            heads_per_rank=self.num_heads // self.world_size if self.head_sliced else
            self.num_heads, buffer=buffer, programs=programs, timeout_s=timeout_s,
        )
        self._p2p.precompile((False, True) if self.head_sliced else (True,))
        done: list[object] = [None] * self.world_size  # every rank compiled: first calls line up
        cuda = self.device.type == "cuda"
        with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
            dist.all_gather_object(done, True, group=self._comm.group)

    def _alloc(self) -> None:
        t, h, d, w = self.max_num_tokens, self.num_heads, self.head_dim, self.world_size

        def buf(numel: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(numel, dtype=dtype, device=self.device)

        f32 = torch.float32
        self._lse_out = buf(t * h, f32)  # merged LSE [T, H] (all-to-all: [world, T, hpr])
        self._lse_full = buf(t * h, f32) if self.pattern == "all_to_all" else self._lse_out
        if self.pattern == "all_to_all":
            elem = torch.empty((), dtype=self.dtype).element_size()
            self._layout = A2ALayout(w, self.heads_per_rank, d, elem)
            self._send = buf(self._layout.numel(t), self.dtype)
            self._recv = buf(self._layout.numel(t), self.dtype)
            self._send_f32, self._recv_f32 = self._send.view(f32), self._recv.view(f32)
        else:
            self._lse_stage = buf(t * h, f32)  # a non-contiguous lse is copied here
            self._lse_all = buf(w * t * h, f32)  # every rank's LSE [world, T, H]
            self._send = buf(t * h * d, self.dtype)  # corrected output, head-major
        # Head slices of every rank [world, T, hpr, D]; this rank's result is slot `rank`.
        self._slices = buf(t * h * d, self.dtype) if self.head_sliced else self._send

    @overload
    def merge(
        self, out: torch.Tensor, lse: torch.Tensor, *, gather_heads: bool = ...,
        return_lse: Literal[False] = ..., step: int | None = ...,
    ) -> torch.Tensor: ...

    @overload
    def merge(
        self, out: torch.Tensor, lse: torch.Tensor, *, gather_heads: bool = ...,
        return_lse: Literal[True], step: int | None = ...,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def merge(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        gather_heads: bool = False,
        return_lse: bool = False,
        step: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Merge this rank's partial attention with the other ranks'.

        Parameters
        ----------
        out : torch.Tensor
            ``[num_tokens, num_heads, head_dim]``, the merger's dtype and device, unit stride in
            the last dim; ``num_tokens <= max_num_tokens``. Rows whose ``lse`` is ``-inf``
            are never used (zeros by convention; even NaN there cannot leak).
        lse : torch.Tensor
            float32 ``[num_tokens, num_heads]``, natural log; ``-inf`` where this rank holds no
            visible key of the query.
        gather_heads : bool
            Return every head on every rank (an extra all-gather for the head-sliced patterns).
        return_lse : bool
            Also return the merged LSE of the returned heads (the all-to-all pattern with
            ``gather_heads`` pays one more small all-gather for it).
        step : int or None
            The caller's step number, compared between the ranks with ``check_calls`` (a rank
            that skipped a step's calls is caught at its next call); default: the count of
            calls, which catches calls of different sizes only.

        Returns
        -------
        torch.Tensor or (torch.Tensor, torch.Tensor)
            The merged output, ``out``'s dtype, ``[num_tokens, heads, head_dim]`` with
            ``heads`` the head slice's length (``num_heads`` with ``gather_heads`` or the
            all-reduce pattern); with ``return_lse`` also the float32 merged LSE
            ``[num_tokens, heads]`` (``-inf`` where no rank sees a key). Both are views of the
            merger's buffers, valid until its next call.

        Raises
        ------
        CallMismatchError
            With ``check_calls``, on every rank, when the ranks' ``step`` or ``num_tokens``
            differ; no payload has moved.
        """
        num_tokens = self._check(out, lse)
        self.num_calls += 1
        if self.check_calls:
            self._check_call(self.num_calls if step is None else step, num_tokens)
            if num_tokens == 0:  # every rank has none, as the headers show: nothing to merge
                empty = out[:, : self.heads_per_rank if self.head_sliced and not gather_heads
                            else self.num_heads]
                return (empty, lse[:, : empty.shape[1]]) if return_lse else empty
        if self._p2p is not None:
            res, res_lse = self._p2p.run(out, lse, all_heads=gather_heads or not self.head_sliced,
                                         want_lse=return_lse)
            return (res, res_lse) if return_lse else res
        v = self._view_cache.get(num_tokens) or self._views(num_tokens)
        if self.pattern == "all_to_all":
            res, res_lse = self._all_to_all(out, lse, v, gather_heads, return_lse)
        else:
            res, res_lse = self._corrected(out, lse, v, gather_heads, return_lse)
        return (res, res_lse) if return_lse else res

    def _check_call(self, step: int, num_tokens: int) -> None:
        """All-gather ``[step, num_tokens]`` of every rank; raise on every rank if they differ."""
        if self.device.type == "cpu":
            self._header[0], self._header[1] = step, num_tokens
        else:
            self._header.copy_(torch.tensor([step, num_tokens], dtype=torch.int64))
        self._comm.all_gather(self._headers, self._header)
        seen = self._headers.tolist()
        steps, counts = seen[0::2], seen[1::2]
        if steps != [step] * self.world_size or counts != [num_tokens] * self.world_size:
            raise CallMismatchError(self.rank, steps, counts)

    def _corrected(
        self, out: torch.Tensor, lse: torch.Tensor, v: dict[str, torch.Tensor], gather: bool,
        want_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not lse.is_contiguous():
            lse = v["lse_stage"].copy_(lse)
        self._comm.all_gather(v["lse_all"], lse)
        self._kernels.correct(out, self._lse_all, self._send, self._lse_out if want_lse else None,
                              rank=self.rank, world_size=self.world_size,
                              heads_per_group=self.heads_per_rank)
        if not self.head_sliced:
            self._comm.all_reduce(v["send"])
            return v["res"], v["lse"]
        self._comm.reduce_scatter(v["mine"], v["send"])
        if not gather:
            return v["res"], v["lse_mine"]
        return self._gather_slices(v), v["lse"]

    def _all_to_all(
        self, out: torch.Tensor, lse: torch.Tensor, v: dict[str, torch.Tensor], gather: bool,
        want_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = out.shape[0]
        self._kernels.pack(out, lse, self._send, self._send_f32, self._layout)
        self._comm.all_to_all(v["recv"], v["send"])
        self._kernels.merge(self._recv, self._recv_f32, self._slices,
                            self._lse_out if want_lse else None, self._layout,
                            num_tokens=num_tokens, dst_slot=self.rank)
        if not gather:
            return v["res"], v["lse_mine"]
        res = self._gather_slices(v)
        if not want_lse:
            return res, v["lse_mine"]
        self._comm.all_gather(v["lse_slices"], v["lse_mine_flat"])
        v["lse_full_twh"].copy_(v["lse_slices_twh"])
        return res, v["lse"]

    def _gather_slices(self, v: dict[str, torch.Tensor]) -> torch.Tensor:
        """All-gather every rank's head slice (in place) and lay them out ``[T, H, D]``."""
        self._comm.all_gather(v["slices"], v["mine"])
        if "full_twhd" in v:  # [world, T, hpr, D] -> [T, world, hpr, D], unless T = 1
            v["full_twhd"].copy_(v["slices_twhd"])
        return v["full"]

    def _views(self, t: int) -> dict[str, torch.Tensor]:
        """Views of the buffers for ``t`` tokens, built once per size (a view costs host time)."""
        cached = self._view_cache.get(t)
        if cached is not None:
            return cached
        if len(self._view_cache) >= 256:
            self._view_cache.clear()
        h, d, w, r = self.num_heads, self.head_dim, self.world_size, self.rank
        hpr = self.heads_per_rank
        n = t * hpr * d  # elements of one head slice
        v: dict[str, torch.Tensor] = {}
        if self.head_sliced:
            v["mine"], v["slices"] = self._slices[r * n: (r + 1) * n], self._slices[: w * n]
            v["res"] = v["mine"].view(t, hpr, d)
            if t == 1:  # [world, 1, hpr, D] is already [1, H, D]
                v["full"] = v["slices"].view(1, h, d)
            else:  # the send buffer is free again once the slices are reduced or exchanged
                v["full_twhd"] = self._send[: w * n].view(t, w, hpr, d)
                v["slices_twhd"] = v["slices"].view(w, t, hpr, d).transpose(0, 1)
                v["full"] = self._send[: w * n].view(t, h, d)
        if self.pattern == "all_to_all":
            numel = self._layout.numel(t)
            v["send"], v["recv"] = self._send[:numel], self._recv[:numel]
            m = t * hpr
            v["lse_mine_flat"] = self._lse_out[r * m: (r + 1) * m]
            v["lse_mine"] = v["lse_mine_flat"].view(t, hpr)
            v["lse_slices"] = self._lse_out[: w * m]
            v["lse_slices_twh"] = v["lse_slices"].view(w, t, hpr).transpose(0, 1)
            v["lse_full_twh"] = self._lse_full[: t * h].view(t, w, hpr)
            v["lse"] = self._lse_full[: t * h].view(t, h)
        else:
            v["lse_stage"] = self._lse_stage[: t * h].view(t, h)
            v["lse_all"] = self._lse_all[: w * t * h].view(w * t, h)
            v["lse"] = self._lse_out[: t * h].view(t, h)
            v["lse_mine"] = v["lse"][:, self.head_slice]
            v["send"] = self._send[: t * h * d]
            if not self.head_sliced:
                v["res"] = v["send"].view(t, h, d)
        self._view_cache[t] = v
        return v

    def _check(self, out: torch.Tensor, lse: torch.Tensor) -> int:
        """Cheap checks of both inputs (no sync); return ``num_tokens``."""
        if not (
            isinstance(out, torch.Tensor) and out.dtype == self.dtype and out.dim() == 3
            and out.shape[1:] == self._shape_tail and out.device == self.device
        ):
            check_tensor("out", out, dtype=self.dtype, shape=[None, *self._shape_tail],
                         device=self.device)
        num_tokens = out.shape[0]
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"out has num_tokens={num_tokens} > max_num_tokens={self.max_num_tokens}"
            )
        if out.stride(2) != 1 and self.head_dim > 1:
            raise ValueError("out must have unit stride in its last (head_dim) dimension")
        if not (
            isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.dim() == 2
            and lse.shape[0] == num_tokens and lse.shape[1] == self.num_heads
            and lse.device == self.device
        ):
            check_tensor("lse", lse, dtype=torch.float32, shape=[num_tokens, self.num_heads],
                         device=self.device)
        return int(num_tokens)


class CallMismatchError(RuntimeError):
    """The ranks called :meth:`AttentionMerger.merge` out of step (raised on every rank).

    Attributes
    ----------
    steps, num_tokens : list of int
        Each rank's ``step`` and ``num_tokens`` of the call, in rank order.
    """

    def __init__(self, rank: int, steps: list[int], num_tokens: list[int]) -> None:
        self.steps, self.num_tokens = steps, num_tokens
        each = ", ".join(f"rank {r}: step {s}, {t} tokens"
                         for r, (s, t) in enumerate(zip(steps, num_tokens)))
        super().__init__(
            f"AttentionMerger.merge on rank {rank}: the ranks are out of step ({each}); every "
            "rank must call merge() in the same order with the same num_tokens, empty batches "
            "included"
        )


def _resolve_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
