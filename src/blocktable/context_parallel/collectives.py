"""The four collectives of the attention merge, with the least host work per call."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Collectives:
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
        self._ag_opts = c10d.AllgatherOptions()
        self._rs_opts = c10d.ReduceScatterOptions()
        self._ar_opts = c10d.AllreduceOptions()
        self._a2a_opts = c10d.AllToAllOptions()
        self._rs_opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)  # the default; explicit
        self._ar_opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        for opts in (self._ag_opts, self._rs_opts, self._ar_opts, self._a2a_opts):
            if hasattr(opts, "asyncOp"):  # run on the current stream, as a blocking call does
                opts.asyncOp = False
        self._direct = all(
            hasattr(pg, name)
            for name in ("_allgather_base", "_reduce_scatter_base", "allreduce", "alltoall_base")
        )
        self.reduce_scatter_via_all_reduce = False

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if self._direct:
            _wait(self.group._allgather_base(output, input, self._ag_opts))
        else:
            dist.all_gather_into_tensor(output, input, group=self.group)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if not self.reduce_scatter_via_all_reduce:
            try:
                if self._direct:
                    _wait(self.group._reduce_scatter_base(output, input, self._rs_opts))
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
            _wait(self.group.allreduce([tensor], self._ar_opts))
        else:
            dist.all_reduce(tensor, group=self.group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if self._direct:
            _wait(self.group.alltoall_base(output, input, [], [], self._a2a_opts))
        else:
            dist.all_to_all_single(output, input, group=self.group)


def _wait(work: object) -> None:
    if work is not None:
        work.wait()  # type: ignore[attr-defined]
