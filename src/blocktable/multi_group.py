"""The block tables of every KV cache group, their commit and their one-launch slot mapping."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from blocktable._checks import as_index_array, check_index, check_positive, check_tensor
from blocktable._triton import resolve_backend
from blocktable.batch import apply_group_update, check_group_update, write_group_update
from blocktable.commit import CommitStats, Committer
from blocktable.config import (
    CPConfig,
    GroupKind,
    GroupSpec,
    check_cp_for_group,
    effective_cp,
    row_width,
)
from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from blocktable.metadata import AttentionMetadata
from blocktable.slot_mapping import SlotGroupParams, SlotMappingError, compute_slots, pack_params
from blocktable.storage import TableStorage
from blocktable.table import BlockTable
from blocktable.update import StepUpdate


class MultiGroupBlockTable:
    """One block table per KV cache group, one commit and one slot-mapping launch for all.

    Parameters
    ----------
    groups : sequence of GroupSpec
        One spec per KV cache group, in the engine's group order.
    max_num_reqs : int
        Rows per table (the most requests in flight).
    max_model_len : int or None
        Longest sequence in tokens; sets each row's width (unless a spec gives
        ``max_num_blocks``).
    max_num_batched_tokens : int
        Size of each slot-mapping buffer: the most tokens in one step.
    device : str or torch.device
        Where the device copy and slot mappings live; ``"cpu"`` runs the CPU backend.
    cp : CPConfig or None
        Context parallelism; ``None`` reads an initialized process group, else world 1 rank 0.
    backend : {"auto", "triton", "torch"}
        Kernels for commit and slot mapping; ``auto`` is Triton on CUDA, torch on the CPU.
    commit_staging_entries : int or None
        Staging capacity of the incremental commit (see :class:`blocktable.commit.Committer`).
    debug : bool
        Validate device inputs with host copies and report tokens whose position lies past
        their row's blocks (synchronizes every step).

    Examples
    --------
    >>> import torch
    >>> from blocktable import GroupSpec, MultiGroupBlockTable
    >>> bt = MultiGroupBlockTable([GroupSpec(block_size=4)], max_num_reqs=2, max_model_len=32,
    ...                           max_num_batched_tokens=8)
    >>> bt.add_row(([7, 9],), 0)
    >>> bt.commit()  # only the changed entries travel: 2 ids + 1 count
    CommitStats(num_entries=3, bytes_h2d=24, full_copy=False)
    >>> qsl = torch.tensor([0, 3], dtype=torch.int32)
    >>> pos = torch.tensor([3, 4, 5], dtype=torch.int64)
    >>> bt.compute_slot_mapping(qsl, pos)[0][:4].tolist()
    [31, 36, 37, -1]
    """

    def __init__(
        self,
        groups: Sequence[GroupSpec],
        max_num_reqs: int,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 8192,
        device: str | torch.device = "cpu",
        *,
        cp: CPConfig | None = None,
        backend: str = "auto",
        commit_staging_entries: int | None = None,
        debug: bool = False,
    ) -> None:
        self.specs: tuple[GroupSpec, ...] = tuple(groups)
        if not self.specs:
            raise ValueError("groups must hold at least one GroupSpec")
        for i, spec in enumerate(self.specs):
            if not isinstance(spec, GroupSpec):
                raise TypeError(f"groups[{i}] must be a GroupSpec, got {type(spec).__name__}")
        self.max_num_reqs = check_positive("max_num_reqs", max_num_reqs)
        self.max_num_batched_tokens = check_positive(
            "max_num_batched_tokens", max_num_batched_tokens
        )
        self.cp = cp if cp is not None else CPConfig.from_process_group()
        for spec in self.specs:
            check_cp_for_group(spec, self.cp)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = resolve_backend(backend, self.device)
        self.debug = debug
        widths = []
        for spec in self.specs:
            if not spec.has_table:
                widths.append(0)
                continue
            if spec.max_num_blocks is None and max_model_len is None:
                raise ValueError("max_model_len is required unless every group sets max_num_blocks")
            widths.append(row_width(spec, max_model_len or 0, self.cp))
        self.storage = TableStorage(widths, self.max_num_reqs, self.device)
        self.tables: list[BlockTable | None] = [
            BlockTable._for_group(self, g) if spec.has_table else None
            for g, spec in enumerate(self.specs)
        ]
        self.committer = Committer(self.storage, self.backend, commit_staging_entries)
        self._slot_groups = [g for g, s in enumerate(self.specs) if s.has_slots]
        self._slot_index = {g: i for i, g in enumerate(self._slot_groups)}
        self.slot_params = [self._params(g) for g in self._slot_groups]
        self._packed_params = pack_params(self.slot_params, self.device)
        self._pow2 = all(p.powers_of_two for p in self.slot_params)
        self._has_cp = any(p.cp_world_size > 1 for p in self.slot_params)
        # on device, int64 [num_slot_groups, max_num_batched_tokens]: persistent slot buffers
        self._slots = torch.full(
            (len(self._slot_groups), self.max_num_batched_tokens),
            PAD_SLOT_ID,
            dtype=torch.int64,
            device=self.device,
        )
        self._slot_views: list[torch.Tensor | None] = [
            self._slots[self._slot_index[g]] if g in self._slot_index else None
            for g in range(self.num_groups)
        ]
        # on device, int32 [max_num_reqs, 1]: the encoder-only placeholder
        self._encoder_placeholder = torch.zeros(
            self.max_num_reqs, 1, dtype=torch.int32, device=self.device
        )
        self._gathered: dict[int, torch.Tensor] = {}  # group -> indexed-mode view buffer
        self._state_out: dict[tuple[int, int], torch.Tensor] = {}  # (group, spec) -> buffer

    def _params(self, g: int) -> SlotGroupParams:
        spec, st = self.specs[g], self.storage
        cp = effective_cp(spec, self.cp)
        return SlotGroupParams(
            table_offset=int(st.table_offsets[g]),
            width=st.widths[g],
            counts_offset=st.counts_offset + g * self.max_num_reqs,
            kernel_block_size=spec.kernel_size,
            manager_block_size=spec.block_size,
            cp_world_size=cp.world_size,
            cp_rank=cp.rank,
            cp_interleave=cp.interleave,
        )

    # ---- shape -------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.specs)

    def __getitem__(self, group: int) -> BlockTable:
        table = self.tables[check_index("group", group, self.num_groups)]
        if table is None:
            raise ValueError(f"group {group} is encoder-only and has no table")
        return table

    def _live_tables(self) -> list[BlockTable]:
        return [t for t in self.tables if t is not None]

    # ---- row operations, fanned out to every group ---------------------------------------
    def _per_group(self, name: str, block_ids: Sequence[object]) -> list[np.ndarray | None]:
        """One kernel-id array per group (None for encoder-only), every group checked."""
        if isinstance(block_ids, (np.ndarray, torch.Tensor)) or len(block_ids) != self.num_groups:
            raise ValueError(
                f"{name} must hold one id list per group ({self.num_groups}), got "
                f"{len(block_ids) if hasattr(block_ids, '__len__') else block_ids!r}"
            )
        out: list[np.ndarray | None] = []
        for g, (table, ids) in enumerate(zip(self.tables, block_ids)):
            if table is None:
                if ids is not None and len(as_index_array(f"{name}[{g}]", ids)):
                    raise ValueError(f"{name}[{g}] must be empty: group {g} is encoder-only")
                out.append(None)
            else:
                out.append(table.kernel_ids(ids, f"{name}[{g}]"))
        return out

    def add_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        """Replace row ``row_idx`` in every group; ``block_ids[g]`` are group ``g``'s manager ids."""
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        ids = self._per_group("block_ids", block_ids)
        for table, k_ids in zip(self.tables, ids):
            if table is not None and k_ids is not None:
                table._check_fits(row, len(k_ids), "add_row")
        self.storage.before_host_write()
        for table, k_ids in zip(self.tables, ids):
            if table is not None and k_ids is not None:
                table._write_add(row, k_ids)

    def append_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        """Append ``block_ids[g]`` to row ``row_idx`` of each group ``g`` (empty lists: no-op)."""
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        ids = self._per_group("block_ids", block_ids)
        for table, k_ids in zip(self.tables, ids):
            if table is not None and k_ids is not None:
                table._check_fits(
                    row, int(table.num_blocks_per_row[row]) + len(k_ids), "append_row"
                )
        self.storage.before_host_write()
        for table, k_ids in zip(self.tables, ids):
            if table is not None and k_ids is not None and len(k_ids):
                table._write_append(row, k_ids)

    def clear_row(self, row_idx: int) -> None:
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        self.storage.before_host_write()
        for table in self._live_tables():
            table._write_clear_row(row)

    def move_row(self, src: int, tgt: int) -> None:
        s = check_index("src", src, self.max_num_reqs)
        t = check_index("tgt", tgt, self.max_num_reqs)
        if s != t:
            self.storage.before_host_write()
            for table in self._live_tables():
                table._write_move(s, t)

    def swap_row(self, src: int, tgt: int) -> None:
        s = check_index("src", src, self.max_num_reqs)
        t = check_index("tgt", tgt, self.max_num_reqs)
        if s != t:
            self.storage.before_host_write()
            for table in self._live_tables():
                table._write_swap(s, t)

    def clear(self) -> None:
        self.storage.before_host_write()
        for table in self._live_tables():
            table._write_clear()

    def apply(self, update: StepUpdate) -> None:
        """Apply a whole step's changes (see :class:`~blocktable.update.StepUpdate`), all groups.

        Everything is validated first; a rejected update changes nothing.
        """
        if not isinstance(update, StepUpdate):
            raise TypeError(f"update must be a StepUpdate, got {type(update).__name__}")
        for name in ("added", "appended", "nulled"):
            if len(getattr(update, name)) != self.num_groups:
                raise ValueError(
                    f"update.{name} must hold one entry per group ({self.num_groups}), got "
                    f"{len(getattr(update, name))}"
                )
        live = self._live_tables()
        if len(live) == 1 and self.num_groups == 1:
            self.storage.before_host_write()
            apply_group_update(live[0], update.cleared_rows, update.added[0],
                               update.appended[0], update.nulled[0])
            return
        plans = []
        for g, table in enumerate(self.tables):
            if table is None:
                if len(update.added[g]) or len(update.appended[g]) or len(update.nulled[g]):
                    raise ValueError(f"update for group {g} must be empty: it is encoder-only")
                continue
            plans.append(
                (table, check_group_update(
                    table, update.cleared_rows, update.added[g], update.appended[g],
                    update.nulled[g],
                ))
            )
        self.storage.before_host_write()
        for table, plan in plans:
            write_group_update(table, plan)

    # ---- host -> device ------------------------------------------------------------------
    def commit(self, num_reqs: int | None = None) -> CommitStats:
        """Copy every change since the last commit to the device (asynchronous on CUDA).

        ``num_reqs`` is accepted for vLLM compatibility and checked; the incremental commit
        moves exactly what changed, in whichever rows.
        """
        if num_reqs is not None:
            check_index("num_reqs", num_reqs, self.max_num_reqs + 1)
        return self.committer.commit()

    # ---- slot mapping ----------------------------------------------------------------------
    def slot_mapping(self, group: int) -> torch.Tensor:
        """Persistent int64 ``[max_num_batched_tokens]`` slot buffer of ``group`` (device)."""
        check_index("group", group, self.num_groups)
        if group not in self._slot_index:
            raise ValueError(f"group {group} ({self.specs[group].kind.value}) has no slot mapping")
        return self._slots[self._slot_index[group]]

    def compute_slot_mapping(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        *,
        row_of_batch: torch.Tensor | None = None,
        query_start_loc_cpu: torch.Tensor | None = None,
    ) -> list[torch.Tensor | None]:
        """Slots of this step's tokens for every token-slot group, in one launch.

        Parameters
        ----------
        query_start_loc : torch.Tensor
            int32 ``[num_reqs + 1]`` on the table's device; request ``r``'s tokens are
            ``[qsl[r], qsl[r+1])``, ``qsl[0] == 0``, ``qsl[-1] == num_tokens``.
        positions : torch.Tensor
            int64 ``[num_tokens]`` on the table's device; ``num_tokens <= max_num_batched_tokens``.
        row_of_batch : torch.Tensor or None
            int32 ``[num_reqs]`` on the device: table row of each request (indexed mode).
            ``None``: request ``r`` is row ``r`` (condensed mode).
        query_start_loc_cpu : torch.Tensor or None
            Host copy of ``query_start_loc``; when given, its contents are checked on the host
            (free). Without it, CUDA inputs are checked only in debug mode.

        Returns
        -------
        list of torch.Tensor or None
            Per group: int64 ``[max_num_batched_tokens]`` (the persistent buffer, tail set to
            ``PAD_SLOT_ID``), or ``None`` for groups without slots.
        """
        self._check_slot_inputs(query_start_loc, positions, row_of_batch, query_start_loc_cpu)
        compute_slots(
            self.backend,
            self.storage.device_tensor,
            self.slot_params,
            self._packed_params,
            query_start_loc,
            positions,
            row_of_batch,
            self._slots,
            max_num_reqs=self.max_num_reqs,
            pow2=self._pow2,
            has_cp=self._has_cp,
        )
        if self.debug:
            self._debug_report(query_start_loc, positions, row_of_batch)
        return list(self._slot_views)

    def _check_slot_inputs(
        self,
        qsl: torch.Tensor,
        positions: torch.Tensor,
        row_of_batch: torch.Tensor | None,
        qsl_cpu: torch.Tensor | None,
    ) -> tuple[int, int]:
        dev = self.device
        # The common case in one cheap test; the helper then names what is wrong.
        if not (isinstance(qsl, torch.Tensor) and qsl.dtype == torch.int32 and qsl.dim() == 1
                and qsl.device == dev):
            check_tensor("query_start_loc", qsl, dtype=torch.int32, ndim=1, device=dev)
        if not (isinstance(positions, torch.Tensor) and positions.dtype == torch.int64
                and positions.dim() == 1 and positions.device == dev):
            check_tensor("positions", positions, dtype=torch.int64, ndim=1, device=dev)
        num_reqs = qsl.numel() - 1
        num_tokens = positions.numel()
        if num_reqs < 0:
            raise ValueError("query_start_loc must have num_reqs + 1 >= 1 entries, got 0")
        if num_reqs > self.max_num_reqs:
            raise ValueError(
                f"query_start_loc describes {num_reqs} requests, more than max_num_reqs="
                f"{self.max_num_reqs}"
            )
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"positions holds {num_tokens} tokens, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        host_qsl = None
        if qsl_cpu is not None:
            if not (isinstance(qsl_cpu, torch.Tensor) and qsl_cpu.dtype == torch.int32
                    and qsl_cpu.shape == qsl.shape and qsl_cpu.device.type == "cpu"):
                check_tensor("query_start_loc_cpu", qsl_cpu, dtype=torch.int32,
                             shape=[num_reqs + 1], device="cpu")
            host_qsl = qsl_cpu
        elif qsl.device.type == "cpu" or self.debug:
            host_qsl = qsl.cpu()
        if host_qsl is not None:
            q = host_qsl.numpy()
            decreasing = bool((q[1:] < q[:-1]).any())
            if int(q[0]) != 0 or int(q[-1]) != num_tokens or decreasing:
                raise ValueError(
                    "query_start_loc must start at 0, never decrease and end at num_tokens="
                    f"{num_tokens} (positions.numel()), got first {int(q[0])}, last {int(q[-1])}"
                    + (", decreasing" if decreasing else "")
                )
        if row_of_batch is not None:
            check_tensor("row_of_batch", row_of_batch, dtype=torch.int32, shape=[num_reqs],
                         device=dev)
            if row_of_batch.device.type == "cpu" or self.debug:
                rows = row_of_batch.cpu().numpy()
                if len(rows) and (rows.min() < 0 or rows.max() >= self.max_num_reqs):
                    raise IndexError(
                        f"row_of_batch holds a row outside [0, {self.max_num_reqs})"
                    )
        return num_reqs, num_tokens

    def _debug_report(
        self, qsl: torch.Tensor, positions: torch.Tensor, row_of_batch: torch.Tensor | None
    ) -> None:
        """Raise SlotMappingError for tokens this rank owns whose block is missing."""
        from blocktable.slot_mapping.reference import slot_of_position

        q = qsl.cpu().numpy()
        pos = positions.cpu().numpy()
        rows = None if row_of_batch is None else row_of_batch.cpu().numpy()
        host_flat = self.storage.device_tensor.cpu().numpy()
        problems = []
        for g, p in zip(self._slot_groups, self.slot_params):
            table = host_flat[p.table_offset : p.table_offset + self.max_num_reqs * p.width]
            table = table.reshape(self.max_num_reqs, p.width)
            counts = host_flat[p.counts_offset : p.counts_offset + self.max_num_reqs]
            for r in range(len(q) - 1):
                row = r if rows is None else int(rows[r])
                for t in range(int(q[r]), int(q[r + 1])):
                    full_row = np.full(p.width + 1, 1, dtype=np.int64)
                    owned = slot_of_position(
                        int(pos[t]), full_row, p.width + 1,
                        kernel_block_size=p.kernel_block_size,
                        manager_block_size=p.manager_block_size,
                        cp_world_size=p.cp_world_size, cp_rank=p.cp_rank,
                        cp_interleave=p.cp_interleave,
                    ) != PAD_SLOT_ID
                    got = slot_of_position(
                        int(pos[t]), table[row], int(counts[row]),
                        kernel_block_size=p.kernel_block_size,
                        manager_block_size=p.manager_block_size,
                        cp_world_size=p.cp_world_size, cp_rank=p.cp_rank,
                        cp_interleave=p.cp_interleave,
                    )
                    if owned and got == PAD_SLOT_ID:
                        problems.append((g, t, r, row, int(pos[t])))
        if problems:
            shown = ", ".join(
                f"group {g} token {t} (request {r}, row {row}, position {p})"
                for g, t, r, row, p in problems[:8]
            )
            raise SlotMappingError(
                f"{len(problems)} token(s) lie past their row's blocks (mapped to PAD_SLOT_ID): "
                f"{shown}" + (" ..." if len(problems) > 8 else "")
            )

    # ---- views handed to attention ---------------------------------------------------------
    def device_view(self, group: int, num_reqs: int, num_reqs_padded: int | None = None) -> torch.Tensor:
        """int32 ``[num_reqs_padded, width]`` committed device table of ``group`` (condensed mode).

        Rows ``[num_reqs, num_reqs_padded)`` hold ``NULL_BLOCK_ID``; they must be empty rows of
        the table (a ``ValueError`` says so otherwise). Encoder-only groups get a zero
        ``[num_reqs_padded, 1]`` placeholder.
        """
        check_index("group", group, self.num_groups)
        num_reqs = check_index("num_reqs", num_reqs, self.max_num_reqs + 1)
        padded = num_reqs if num_reqs_padded is None else num_reqs_padded
        if isinstance(padded, bool) or not isinstance(padded, int) or not (
            num_reqs <= padded <= self.max_num_reqs
        ):
            raise ValueError(
                f"num_reqs_padded={padded} must be an int in [num_reqs={num_reqs}, "
                f"max_num_reqs={self.max_num_reqs}]"
            )
        if not self.specs[group].has_table:
            return self._encoder_placeholder[:padded]
        if padded > num_reqs:
            counts = self.storage.host_counts(group)[num_reqs:padded]
            dirty = self.storage.dirty_rows[group, num_reqs:padded]
            if counts.any() or dirty.any():
                row = num_reqs + int(np.argmax(counts.astype(bool) | dirty))
                raise ValueError(
                    f"pad row {row} in [num_reqs={num_reqs}, num_reqs_padded={padded}) of group "
                    f"{group} is not an empty committed row; clear it (clear_row) and commit"
                )
        return self.storage.device_table(group)[:padded]

    def gather_view(
        self, group: int, row_of_batch: torch.Tensor, num_reqs_padded: int | None = None
    ) -> torch.Tensor:
        """int32 ``[num_reqs_padded, width]`` table of ``group`` in batch order (indexed mode).

        Row ``i < num_reqs`` is table row ``row_of_batch[i]``; pad rows hold ``NULL_BLOCK_ID``.
        Written on the device into a persistent buffer (allocated on first use; fixed address).
        """
        from blocktable.gather import gather_rows

        check_index("group", group, self.num_groups)
        num_reqs = row_of_batch.numel() if isinstance(row_of_batch, torch.Tensor) else -1
        check_tensor("row_of_batch", row_of_batch, dtype=torch.int32, ndim=1, device=self.device)
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"row_of_batch has {num_reqs} rows, more than max_num_reqs")
        padded = num_reqs if num_reqs_padded is None else num_reqs_padded
        if not num_reqs <= padded <= self.max_num_reqs:
            raise ValueError(
                f"num_reqs_padded={padded} must be in [num_reqs={num_reqs}, "
                f"max_num_reqs={self.max_num_reqs}]"
            )
        if not self.specs[group].has_table:
            return self._encoder_placeholder[:padded]
        if row_of_batch.device.type == "cpu" or self.debug:
            rows = row_of_batch.cpu().numpy()
            if len(rows) and (rows.min() < 0 or rows.max() >= self.max_num_reqs):
                raise IndexError(f"row_of_batch holds a row outside [0, {self.max_num_reqs})")
        out = self._gathered.get(group)
        if out is None:
            out = torch.zeros_like(self.storage.device_table(group))
            self._gathered[group] = out
        gather_rows(self.backend, self.storage.device_table(group), row_of_batch, out[:padded])
        return out[:padded]

    def state_indices(
        self,
        group: int,
        seq_lens: torch.Tensor,
        num_reqs_padded: int | None = None,
        *,
        num_speculative_blocks: int = 0,
        row_of_batch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int32 ``[num_reqs_padded, 1 + num_speculative_blocks]`` state blocks per request.

        For a state (Mamba-like) group: the block holding each request's last token,
        ``(seq_len - 1) // block_size`` clamped at 0, then the ``num_speculative_blocks`` blocks
        after it; ``NULL_BLOCK_ID`` past the row's entries and in pad rows. Written on the device
        into a persistent buffer (fixed address per ``num_speculative_blocks``).
        """
        from blocktable.state_indices import gather_state_indices

        table = self[group]
        num_reqs = check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1,
                                device=self.device).numel()
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"seq_lens has {num_reqs} entries, more than max_num_reqs")
        padded = num_reqs if num_reqs_padded is None else num_reqs_padded
        if not num_reqs <= padded <= self.max_num_reqs:
            raise ValueError(
                f"num_reqs_padded={padded} must be in [num_reqs={num_reqs}, "
                f"max_num_reqs={self.max_num_reqs}]"
            )
        if num_speculative_blocks < 0:
            raise ValueError(f"num_speculative_blocks must be >= 0, got {num_speculative_blocks}")
        if row_of_batch is not None:
            check_tensor("row_of_batch", row_of_batch, dtype=torch.int32, shape=[num_reqs],
                         device=self.device)
        key = (group, num_speculative_blocks)
        out = self._state_out.get(key)
        if out is None:
            out = torch.zeros(self.max_num_reqs, 1 + num_speculative_blocks, dtype=torch.int32,
                              device=self.device)
            self._state_out[key] = out
        gather_state_indices(
            self.storage.device_table(group), self.storage.device_counts(group), seq_lens,
            table.spec.kernel_size, row_of_batch, out[:padded],
        )
        return out[:padded]

    def build_metadata(
        self,
        query_start_loc: torch.Tensor,
        slot_mappings: list[torch.Tensor | None],
        *,
        num_tokens: int,
        num_reqs_padded: int | None = None,
        query_start_loc_cpu: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        seq_lens_cpu: torch.Tensor | None = None,
        row_of_batch: torch.Tensor | None = None,
        row_of_batch_cpu: np.ndarray | None = None,
    ) -> list[AttentionMetadata]:
        """Per group, what attention reads this step (see :class:`AttentionMetadata`).

        The fields every group shares are built once; each group then swaps in its own view
        (``device_view`` in condensed mode, ``gather_view`` with ``row_of_batch``) and slots.
        ``row_of_batch_cpu`` (host rows) gives the host counts without a device copy in
        indexed mode.
        """
        num_reqs = query_start_loc.numel() - 1
        padded = num_reqs if num_reqs_padded is None else num_reqs_padded
        if row_of_batch is not None and row_of_batch_cpu is None:
            row_of_batch_cpu = row_of_batch.cpu().numpy()
        rows = np.arange(num_reqs) if row_of_batch_cpu is None else np.asarray(row_of_batch_cpu)
        out: list[AttentionMetadata] = []
        common: AttentionMetadata | None = None
        for g in range(self.num_groups):
            if row_of_batch is None:
                view = self.device_view(g, num_reqs, padded)
            else:
                view = self.gather_view(g, row_of_batch, padded)
            table = self.tables[g]
            counts = (np.zeros(num_reqs, np.int32) if table is None
                      else table.num_blocks_per_row[rows].copy())
            if common is None:
                common = AttentionMetadata(
                    g, num_reqs, padded, num_tokens, query_start_loc, query_start_loc_cpu,
                    seq_lens, seq_lens_cpu, view, slot_mappings[g], counts,
                )
                out.append(common)
            else:
                out.append(common.for_group(g, view, slot_mappings[g], counts))
        return out

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if an invariant of any group's host table does not hold."""
        for table in self._live_tables():
            table.check_integrity()

    def device_equals_host(self) -> bool:
        """True when the device copy equals the host buffer (synchronizes; for tests)."""
        return bool(
            torch.equal(self.storage.device_tensor.cpu(), self.storage.host_tensor)
        )


__all__ = ["NULL_BLOCK_ID", "GroupKind", "MultiGroupBlockTable"]
