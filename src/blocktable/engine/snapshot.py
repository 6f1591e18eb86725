"""What the picture of an engine step shows, taken from the engine: the table's rows and the
pool's blocks at one step (:class:`TableSnapshot`), drawn by :mod:`blocktable.picture`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from blocktable.engine import LLMEngine, SchedulerOutput


@dataclass(frozen=True)
class TableSnapshot:
    """Host-side copy of the table and the pool at one step (what its forward read).

    Attributes
    ----------
    step : int
        Engine step.
    block_size : int
        Tokens per block.
    req_of_row : dict of int to str
        Rows held by running requests, and their ids.
    num_new_tokens_of_row : dict of int to int
        Rows in this step's batch, and how many tokens each computes.
    block_table : np.ndarray
        int32 ``[num_rows, width]``: the host table's first rows (manager = kernel blocks).
    num_kernel_blocks : np.ndarray
        int32 ``[num_rows]``: filled entries per row.
    ref_counts : np.ndarray
        int32 ``[num_blocks]``: requests holding each block.
    cached : np.ndarray
        bool ``[num_blocks]``: block content findable by a prefix lookup.
    """

    step: int
    block_size: int
    req_of_row: dict[int, str]
    num_new_tokens_of_row: dict[int, int]
    block_table: np.ndarray
    num_kernel_blocks: np.ndarray
    ref_counts: np.ndarray
    cached: np.ndarray

    @property
    def num_reqs_in_batch(self) -> int:
        return len(self.num_new_tokens_of_row)


def take_snapshot(engine: LLMEngine, batch: SchedulerOutput) -> TableSnapshot:
    """Copy what the picture needs; call it from a step hook (see :meth:`LLMEngine.step`)."""
    manager, table = engine.manager, engine.table[0]
    req_of_row = {manager.row_of(r.req_id): r.req_id for r in engine.scheduler.running}
    num_rows = max(req_of_row, default=-1) + 1
    pool = manager.pools[0]
    num_blocks = pool.num_blocks
    return TableSnapshot(
        step=engine.step_index,
        block_size=engine.config.block_size,
        req_of_row=req_of_row,
        num_new_tokens_of_row={
            manager.row_of(s.request.req_id): s.num_new_tokens for s in batch.scheduled
        },
        block_table=table.block_table_np[:num_rows].copy(),
        num_kernel_blocks=table.num_kernel_blocks[:num_rows].copy(),
        ref_counts=np.array([pool.ref_count(b) for b in range(num_blocks)], dtype=np.int32),
        cached=np.array([pool.content_id(b) is not None for b in range(num_blocks)]),
    )


def pick_step(snapshots: list[TableSnapshot]) -> TableSnapshot:
    """The snapshot with the most requests in its batch, the one nearest the middle on ties."""
    if not snapshots:
        raise ValueError("no snapshot to pick from")
    middle = snapshots[len(snapshots) // 2].step
    return max(snapshots, key=lambda s: (s.num_reqs_in_batch, -abs(s.step - middle)))
