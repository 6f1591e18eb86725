"""What the ranks of a DCP engine exchange and check: the step plan, per-rank stats, the group.

The driver (rank 0) sends one :class:`StepPlan` per step; every rank reports its
:class:`RankStats`; :func:`check_cp_group` refuses a ``CPConfig`` that disagrees with the
process group it is used with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from blocktable.config import CPConfig
from blocktable.update import StepUpdate


@dataclass(frozen=True)
class StepPlan:
    """Everything a rank needs to run one step, decided by the driver (all arrays on the host).

    Attributes
    ----------
    step : int
        The step number; every rank checks it against its own count.
    update : StepUpdate or None
        The table changes of this step (``None`` in the stop plan).
    input_ids : np.ndarray
        int64 ``[num_tokens]``, the step's tokens, request after request.
    starts : np.ndarray
        int64 ``[num_reqs]``, tokens of each request already in the KV cache.
    num_new_tokens : np.ndarray
        int64 ``[num_reqs]``, tokens each request computes this step.
    rows : np.ndarray
        int32 ``[num_reqs]``, each request's table row (the allocator's).
    stop : bool
        The driver is done: followers leave :meth:`DistributedEngine.serve`.
    """

    step: int
    update: StepUpdate | None
    input_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    num_new_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    stop: bool = False


@dataclass
class RankStats:
    """What one rank held and did (measured on that rank)."""

    rank: int
    world_size: int
    num_steps: int = 0
    kv_tokens_written: int = 0  # tokens whose K/V this rank wrote (non-PAD slots), all steps
    peak_kv_tokens: int = 0  # most keys this rank held for (and attended in) one step's batch
    num_empty_queries: int = 0  # query tokens for which this rank held no visible key
    kv_cache_bytes: int = 0  # this rank's KV cache (all layers, K and V)


def check_cp_group(cp: CPConfig, group: Any) -> None:
    """Raise unless ``group`` is a process group whose world size and rank are ``cp``'s.

    Raises
    ------
    TypeError
        ``cp`` is not a ``CPConfig`` or ``group`` not a ``torch.distributed.ProcessGroup``.
    ValueError
        This process's world size or rank in ``group`` differs from ``cp.world_size`` /
        ``cp.rank`` (the table would map this rank's tokens as another rank's).
    """
    import torch.distributed as dist

    if not isinstance(cp, CPConfig):
        raise TypeError(f"cp must be a CPConfig, got {type(cp).__name__}")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of group")
    if (world, rank) != (cp.world_size, cp.rank):
        raise ValueError(
            f"cp=CPConfig(world_size={cp.world_size}, rank={cp.rank}) disagrees with the "
            f"process group: world_size={world}, rank={rank}"
        )
