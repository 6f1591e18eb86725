"""Merge the partial attention of a context-parallel group: collectives on persistent buffers.

Each rank of the group holds its shard of every request's KV and computes, per query token and
head, a partial output and its log-sum-exp; :class:`AttentionMerger` turns them into the exact
attention output with one of three collective patterns (see the class). Every call works on
views of buffers allocated once for ``max_num_tokens``; on CUDA it makes no host sync and no
allocation, runs its math as one Triton launch (two for the all-to-all pattern: a pack and a
merge), and can be captured in a CUDA graph with its collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from blocktable._checks import check_positive, check_tensor
from blocktable.config import CPConfig
from blocktable.context_parallel.correction import A2ALayout, MergeKernels

PATTERNS = ("all_gather_reduce_scatter", "all_reduce", "all_to_all")
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

    Every rank must call :meth:`merge` in the same order with the same ``num_tokens``. A rank
    that dies or never calls leaves the others blocked in a collective until the process
    group's timeout (``timeout=`` of ``init_process_group``; with NCCL, only when its watchdog
    aborts on timeout, the default): choose it to suit. The merger adds no timeout of its own.

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
    ) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
        if dtype not in OUT_DTYPES:
            raise TypeError(f"dtype must be one of {OUT_DTYPES}, got {dtype}")
        self.max_num_tokens = check_positive("max_num_tokens", max_num_tokens)
        self.num_heads = check_positive("num_heads", num_heads)
        self.head_dim = check_positive("head_dim", head_dim)
        self.dtype, self.pattern = dtype, pattern
        self.device = _resolve_device(device)
        self._comm = _Collectives(group)
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
        self._alloc()

    @property
    def head_slice(self) -> slice:
        """The heads of the result of :meth:`merge` without ``gather_heads``."""
        start = self.rank * self.heads_per_rank if self.head_sliced else 0
        return slice(start, start + self.heads_per_rank)

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

    def merge(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        gather_heads: bool = False,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Merge this rank's partial attention with the other ranks'.

        Parameters
        ----------
        out : torch.Tensor
            ``[num_tokens, num_heads, head_dim]``, the merger's dtype and device, unit stride in
            the last dim; ``num_tokens <= max_num_tokens``. Zeros (or anything finite) in rows
            whose ``lse`` is ``-inf``.
        lse : torch.Tensor
            float32 ``[num_tokens, num_heads]``, natural log; ``-inf`` where this rank holds no
            visible key of the query.
        gather_heads : bool
            Return every head on every rank (an extra all-gather for the head-sliced patterns).
        return_lse : bool
            Also return the merged LSE of the returned heads (the all-to-all pattern with
            ``gather_heads`` pays one more small all-gather for it).

        Returns
        -------
        torch.Tensor or (torch.Tensor, torch.Tensor)
            The merged output, ``out``'s dtype, ``[num_tokens, heads, head_dim]`` with
            ``heads`` the head slice's length (``num_heads`` with ``gather_heads`` or the
            all-reduce pattern); with ``return_lse`` also the float32 merged LSE
            ``[num_tokens, heads]`` (``-inf`` where no rank sees a key). Both are views of the
            merger's buffers, valid until its next call.
        """
        num_tokens = self._check(out, lse)
        if num_tokens == 0:  # every rank passes the same num_tokens: all skip the collectives
            empty = out[:, : self.heads_per_rank if self.head_sliced and not gather_heads
                        else self.num_heads]
            return (empty, lse[:, : empty.shape[1]]) if return_lse else empty
        if self.pattern == "all_to_all":
            res, res_lse = self._all_to_all(out, lse, num_tokens, gather_heads, return_lse)
        else:
            res, res_lse = self._corrected(out, lse, num_tokens, gather_heads, return_lse)
        return (res, res_lse) if return_lse else res

    def _corrected(
        self, out: torch.Tensor, lse: torch.Tensor, num_tokens: int, gather: bool, want_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, d, w, r = num_tokens, self.num_heads, self.head_dim, self.world_size, self.rank
        if not lse.is_contiguous():
            lse = self._lse_stage[: t * h].view(t, h).copy_(lse)
        self._comm.all_gather(self._lse_all[: w * t * h], lse.view(-1))
        hpg = self.heads_per_rank
        self._kernels.correct(out, self._lse_all, self._send, self._lse_out if want_lse else None,
                              rank=r, world_size=w, heads_per_group=hpg)
        merged_lse = self._lse_out[: t * h].view(t, h)
        if not self.head_sliced:
            self._comm.all_reduce(self._send[: t * h * d])
            return self._send[: t * h * d].view(t, h, d), merged_lse
        n = t * hpg * d
        mine = self._slices[r * n: (r + 1) * n]
        self._comm.reduce_scatter(mine, self._send[: w * n])
        if not gather:
            return mine.view(t, hpg, d), merged_lse[:, self.head_slice]
        return self._gather_slices(t), merged_lse

    def _all_to_all(
        self, out: torch.Tensor, lse: torch.Tensor, num_tokens: int, gather: bool, want_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, d, w, r = num_tokens, self.num_heads, self.head_dim, self.world_size, self.rank
        hpr, layout = self.heads_per_rank, self._layout
        self._kernels.pack(out, lse, self._send, self._send_f32, layout)
        numel = layout.numel(t)
        self._comm.all_to_all(self._recv[:numel], self._send[:numel])
        self._kernels.merge(self._recv, self._recv_f32, self._slices,
                            self._lse_out if want_lse else None, layout, num_tokens=t, dst_slot=r)
        n = t * hpr
        merged_lse = self._lse_out[r * n: (r + 1) * n].view(t, hpr)
        if not gather:
            return self._slices[r * n * d: (r + 1) * n * d].view(t, hpr, d), merged_lse
        res = self._gather_slices(t)
        if want_lse:
            self._comm.all_gather(self._lse_out[: w * n], self._lse_out[r * n: (r + 1) * n])
            full = self._lse_full[: t * h].view(t, w, hpr)
            full.copy_(self._lse_out[: w * n].view(w, t, hpr).transpose(0, 1))
            merged_lse = full.view(t, h)
        return res, merged_lse

    def _gather_slices(self, t: int) -> torch.Tensor:
        """All-gather every rank's head slice (in place) and lay them out ``[T, H, D]``."""
        w, r, hpr, d = self.world_size, self.rank, self.heads_per_rank, self.head_dim
        n = t * hpr * d
        self._comm.all_gather(self._slices[: w * n], self._slices[r * n: (r + 1) * n])
        if t == 1:  # [world, 1, hpr, D] is already [1, H, D]
            return self._slices[: w * n].view(1, self.num_heads, d)
        full = self._send[: w * n].view(t, w, hpr, d)  # the send buffer is free again
        full.copy_(self._slices[: w * n].view(w, t, hpr, d).transpose(0, 1))
        return full.view(t, self.num_heads, d)

    def _check(self, out: object, lse: object) -> int:
        """Cheap checks of both inputs (no sync); return ``num_tokens``."""
        if not (
            isinstance(out, torch.Tensor) and out.dtype == self.dtype and out.dim() == 3
            and out.shape[1:] == self._shape_tail and out.device == self.device
        ):
            check_tensor("out", out, dtype=self.dtype, shape=[None, *self._shape_tail],
                         device=self.device)
        num_tokens = out.shape[0]  # type: ignore[union-attr]
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"out has num_tokens={num_tokens} > max_num_tokens={self.max_num_tokens}"
            )
        if out.stride(2) != 1 and self.head_dim > 1:  # type: ignore[union-attr]
            raise ValueError("out must have unit stride in its last (head_dim) dimension")
        if not (
            isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.dim() == 2
            and lse.shape[0] == num_tokens and lse.shape[1] == self.num_heads
            and lse.device == self.device
        ):
            check_tensor("lse", lse, dtype=torch.float32, shape=[num_tokens, self.num_heads],
                         device=self.device)
        return int(num_tokens)


class _Collectives:
    """The four collectives of the merge on one process group, with the least host work.

    Calls the group's own methods with options built once (the ``torch.distributed``
    functions add checks and warnings per call); falls back to those functions where a torch
    version lacks a method. A gloo build without reduce-scatter gets all-reduce then a slice.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("group: torch.distributed has no initialized process group")
        pg = dist.group.WORLD if group is None else group
        if pg is None:
            raise ValueError("group=None needs an initialized default process group")
        self.group: dist.ProcessGroup = pg  # type: ignore[assignment]
        self.world_size = dist.get_world_size(pg)
        self.rank = dist.get_rank(pg)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the process group")
        c10d = dist.distributed_c10d
        self._opts = {
            "ag": c10d.AllgatherOptions(),
            "rs": c10d.ReduceScatterOptions(),
            "ar": c10d.AllreduceOptions(),
            "a2a": c10d.AllToAllOptions(),
        }
        self._opts["rs"].reduceOp = dist.ReduceOp.SUM
        self._opts["ar"].reduceOp = dist.ReduceOp.SUM
        for opts in self._opts.values():
            if hasattr(opts, "asyncOp"):  # run on the current stream, as a blocking call does
                opts.asyncOp = False
        self._direct = all(
            hasattr(pg, name)
            for name in ("_allgather_base", "_reduce_scatter_base", "allreduce", "alltoall_base")
        )
        self.reduce_scatter_via_all_reduce = False

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if self._direct:
            _wait(self.group._allgather_base(output, input, self._opts["ag"]))
        else:
            dist.all_gather_into_tensor(output, input, group=self.group)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if not self.reduce_scatter_via_all_reduce:
            try:
                if self._direct:
                    _wait(self.group._reduce_scatter_base(output, input, self._opts["rs"]))
                else:
                    dist.reduce_scatter_tensor(output, input, group=self.group)
                return
            except (RuntimeError, NotImplementedError) as err:
                if "support" not in str(err).lower():
                    raise
                self.reduce_scatter_via_all_reduce = True  # same on every rank of the group
        self.all_reduce(input)
        output.copy_(input.view(self.world_size, -1)[self.rank])

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if self._direct:
            _wait(self.group.allreduce([tensor], self._opts["ar"]))
        else:
            dist.all_reduce(tensor, group=self.group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if self._direct:
            _wait(self.group.alltoall_base(output, input, [], [], self._opts["a2a"]))
        else:
            dist.all_to_all_single(output, input, group=self.group)


def _wait(work: object) -> None:
    if work is not None:
        work.wait()  # type: ignore[attr-defined]


def _resolve_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
