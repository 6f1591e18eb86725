"""A plain-Python model of the block table: lists of manager ids per row, per group.

The model knows nothing of numpy views, dirty ranges or kernels; tests compare the real table
to it after every operation.
"""

from __future__ import annotations

import numpy as np

from blocktable import NULL_BLOCK_ID, GroupSpec


class TableModel:
    def __init__(self, specs: list[GroupSpec], max_num_reqs: int, widths: list[int]) -> None:
        self.specs = specs
        self.max_num_reqs = max_num_reqs
        self.widths = widths  # kernel blocks
        self.rows: list[list[list[int]]] = [
            [[] for _ in range(max_num_reqs)] for _ in specs
        ]  # manager ids

    def k(self, g: int) -> int:
        return self.specs[g].blocks_per_manager_block

    def kernel_row(self, g: int, r: int) -> list[int]:
        k = self.k(g)
        out: list[int] = []
        for b in self.rows[g][r]:
            out.extend([NULL_BLOCK_ID] * k if b == NULL_BLOCK_ID else [b * k + i for i in range(k)])
        return out

    def fits(self, g: int, num_manager_blocks: int) -> bool:
        return num_manager_blocks * self.k(g) <= self.widths[g]

    def dense(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """int32 [max_num_reqs, width] kernel table and int32 counts."""
        table = np.zeros((self.max_num_reqs, self.widths[g]), dtype=np.int32)
        counts = np.zeros(self.max_num_reqs, dtype=np.int32)
        for r in range(self.max_num_reqs):
            row = self.kernel_row(g, r)
            table[r, : len(row)] = row
            counts[r] = len(row)
        return table, counts

    # operations, mirroring the table's semantics
    def add(self, g: int, r: int, ids: list[int]) -> None:
        self.rows[g][r] = list(ids)

    def append(self, g: int, r: int, ids: list[int]) -> None:
        self.rows[g][r] = self.rows[g][r] + list(ids)

    def clear_row(self, r: int) -> None:
        for g in range(len(self.specs)):
            self.rows[g][r] = []

    def move(self, src: int, dst: int) -> None:
        if src == dst:
            return
        for g in range(len(self.specs)):
            self.rows[g][dst] = self.rows[g][src]
            self.rows[g][src] = []

    def swap(self, a: int, b: int) -> None:
        for g in range(len(self.specs)):
            self.rows[g][a], self.rows[g][b] = self.rows[g][b], self.rows[g][a]

    def clear(self) -> None:
        for g in range(len(self.specs)):
            self.rows[g] = [[] for _ in range(self.max_num_reqs)]

    def null(self, g: int, r: int, j: int) -> None:
        self.rows[g][r][j] = NULL_BLOCK_ID


def assert_table_matches(bt, model: TableModel, *, device_too: bool = False) -> None:  # type: ignore[no-untyped-def]
    for g, table in enumerate(bt.tables):
        if table is None:
            continue
        want_table, want_counts = model.dense(g)
        np.testing.assert_array_equal(table.num_kernel_blocks, want_counts, err_msg=f"group {g}")
        np.testing.assert_array_equal(table.block_table_np, want_table, err_msg=f"group {g}")
    bt.check_integrity()
    if device_too:
        assert bt.device_equals_host(), "device copy differs from the host table after commit"


def snapshot(bt) -> tuple:  # type: ignore[no-untyped-def]
    """Every piece of state a rejected call must leave as it was."""
    st = bt.storage
    return (
        st.host.copy(),
        st.device_tensor.cpu().numpy().copy(),
        st.dirty_rows.copy(),
        st.journal[: max(0, int(st.journal_len[0]))].copy(),
        st.journal_len.copy(),
    )


def assert_unchanged(before: tuple, bt) -> None:  # type: ignore[no-untyped-def]
    after = snapshot(bt)
    for name, a, b in zip(("host", "device", "dirty_rows", "journal", "overflow"), before, after):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} changed by a rejected call")
