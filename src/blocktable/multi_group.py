"""The block tables of every KV cache group, their commit and their one-launch slot mapping."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple
from typing import Any

import numpy as np
import torch

from blocktable import _compiled_loader as _loader
from blocktable._checks import as_index_array, check_count, check_index, check_positive
from blocktable._triton import resolve_backend
from blocktable.batch import apply_group_update, check_group_update, write_group_update
from blocktable.commit import FULL, CommitStats, Committer
from blocktable.config import (
    CPConfig,
    GroupKind,
    GroupSpec,
    check_cp_for_group,
    check_update_block_sizes,
    effective_cp,
    row_width,
)
from blocktable.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from blocktable.slot_mapping import SlotGroupParams, compute_slots, pack_params
from blocktable.slot_mapping.inputs import check_slot_inputs, report_unmapped_tokens
from blocktable.slot_mapping.torch_impl import slot_mapping_numpy
from blocktable.storage import TableStorage
from blocktable.table import GroupTable
from blocktable.update import StepUpdate
from blocktable.views import AttentionViews

_ID_LIST_TYPES = {list, tuple, np.ndarray, torch.Tensor, type(None)}  # per group: ids or None
_REFUSED = -2  # GroupWriter.apply_and_stage: the update was refused (nothing written)


class MultiGroupBlockTable(AttentionViews):
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
        Context parallelism: this rank's place in the CP group (build it from a process group
        with :meth:`CPConfig.from_process_group`). ``None`` means no context parallelism
        (world 1, rank 0), even when a default process group is initialized: a tensor-parallel
        job maps every token on every rank.
    backend : {"auto", "triton", "torch"}
        Kernels for commit and slot mapping; ``auto`` is Triton on CUDA, torch on the CPU.
    commit_staging_entries : int or None
        Staging capacity of the incremental commit (see :class:`blocktable.commit.Committer`).
    debug : bool
        Validate device inputs with host copies and report tokens whose position is negative
        or lies past their row's blocks (synchronizes every step).

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
        # Only when asked: a tensor-parallel job's default process group must not shard the KV.
        if cp is not None and not isinstance(cp, CPConfig):
            raise TypeError(f"cp must be a CPConfig or None, got {type(cp).__name__}")
        self.cp = cp if cp is not None else CPConfig()
        for spec in self.specs:
            check_cp_for_group(spec, self.cp)
        # the block sizes an allocator for this table stamps on its updates (checked in full,
        # with a message, only when an update's differ)
        self._update_block_sizes = tuple(
            spec.block_size * effective_cp(spec, self.cp).world_size for spec in self.specs)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r} but torch sees no CUDA device "
                "(torch.cuda.is_available() is False): use device='cpu', whose backend gives "
                "the same results, or a CUDA build of torch on a machine with a GPU"
            )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = resolve_backend(backend, self.device)
        if self.device.type != "cpu" and self.backend != "triton":
            raise ValueError(
                f"a table on {self.device.type} needs backend='triton' (its slot mapping and "
                "commit are Triton kernels); CUDA builds of torch bring triton: pip install "
                "triton. On the CPU, backend='torch' runs the same math with numpy"
            )
        self.debug = debug
        widths = []
        for spec in self.specs:
            if not spec.has_table:
                widths.append(0)
                continue
            if spec.max_num_blocks is None and max_model_len is None:
                raise ValueError("max_model_len is required unless every group sets max_num_blocks")
            widths.append(row_width(spec, max_model_len or 0, self.cp))
        if commit_staging_entries is not None:
            check_positive("commit_staging_entries", commit_staging_entries)
        self.storage = TableStorage(widths, self.max_num_reqs, self.device,
                                    journal_capacity=commit_staging_entries)
        self.tables: list[GroupTable | None] = [
            GroupTable(self, g) if spec.has_table else None
            for g, spec in enumerate(self.specs)
        ]
        self._table_groups = [g for g, spec in enumerate(self.specs) if spec.has_table]
        self.committer = Committer(self.storage, self.backend)
        # a one-group table's writer, draining into the committer's stager (None: two calls)
        writer = self.tables[0].writer if len(self.tables) == 1 and self.tables[0] else None
        stager, self._staging_writer = self.committer.compiled_stager, None
        if writer is not None and stager is not None:
            writer.bind_stager(stager)
            self._staging_writer = writer
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
        # the CPU backend's compiled slot mapping, bound to its buffers (None: numpy, or CUDA)
        compiled = _loader.COMPILED
        self._compiled_slots = (
            compiled.SlotMapper(self.storage.device_np, self._slots.numpy(),
                                [astuple(p) for p in self.slot_params], self.max_num_reqs)
            if compiled is not None and self.storage.device_np is not None else None)
        self._gathered: dict[int, torch.Tensor] = {}  # group -> indexed-mode view buffer
        self._state_out: dict[tuple[int, int], torch.Tensor] = {}  # (group, spec) -> buffer

    def _params(self, g: int) -> SlotGroupParams:
        spec, st = self.specs[g], self.storage
        cp = effective_cp(spec, self.cp)
        return SlotGroupParams(
            table_offset=int(st.table_offsets[g]),
            width=st.widths[g],
            counts_offset=st.counts_offset + g * self.max_num_reqs,
            kernel_block_size=spec.kernel_block_size,
            manager_block_size=spec.block_size,
            cp_world_size=cp.world_size,
            cp_rank=cp.rank,
            cp_interleave=cp.interleave,
        )

    def _live_tables(self) -> list[GroupTable]:
        return [t for t in self.tables if t is not None]

    # ---- row operations, fanned out to every group ---------------------------------------
    def _per_group(
        self, op: str, name: str, block_ids: Sequence[object]
    ) -> list[np.ndarray | None]:
        """One kernel-id array per group (None for encoder-only), every group checked."""
        n = self.num_groups
        got = None
        if (type(block_ids) is tuple or type(block_ids) is list) and len(block_ids) == n and (
            set(map(type, block_ids)) <= _ID_LIST_TYPES
        ):
            pass  # (the common case: one list or array per group)
        elif isinstance(block_ids, (np.ndarray, torch.Tensor)):
            got = f"an array of shape {list(block_ids.shape)}"
        elif not hasattr(block_ids, "__len__") or isinstance(block_ids, (str, bytes)):
            got = repr(block_ids)
        elif any(isinstance(ids, (int, np.integer)) for ids in block_ids):
            got = f"a flat list of {len(block_ids)} ids"
        elif len(block_ids) != n:
            got = f"{len(block_ids)} entries"
        if got is not None:
            lists = ", ".join(["[3, 5]"] + ["[4]"] * (n - 1)) + ("," if n == 1 else "")
            raise ValueError(
                f"{name} must hold one id list per group: the table has {n} group"
                f"{'s' if n > 1 else ''}, e.g. {op}(({lists}), 1); got {got}"
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
        ids = self._per_group("add_row", "block_ids", block_ids)
        for table, k_ids in zip(self.tables, ids):
            if table is not None and k_ids is not None:
                table.check_fits(row, len(k_ids), "add_row")
        self.storage.before_host_write()
        for g, k_ids in enumerate(ids):
            if k_ids is not None:
                self.storage.write_add(g, row, k_ids)

    def append_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        """Append ``block_ids[g]`` to row ``row_idx`` of each group ``g`` (empty lists: no-op)."""
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        ids = self._per_group("append_row", "block_ids", block_ids)
        for table, k_ids in zip(self.tables, ids):
            if table is not None and k_ids is not None:
                table.check_fits(
                    row, int(table.num_kernel_blocks[row]) + len(k_ids), "append_row"
                )
        self.storage.before_host_write()
        for g, k_ids in enumerate(ids):
            if k_ids is not None and len(k_ids):
                self.storage.write_append(g, row, k_ids)

    def clear_row(self, row_idx: int) -> None:
        """Empty row ``row_idx`` in every group: its filled entries become the null block and
        its count 0 (a finished or preempted request in condensed mode)."""
        row = check_index("row_idx", row_idx, self.max_num_reqs)
        self.storage.before_host_write()
        for g in self._table_groups:
            self.storage.write_clear_row(g, row)

    def move_row(self, src: int, tgt: int) -> None:
        """Move row ``src`` to row ``tgt`` in every group (batch condense).

        ``tgt`` gets ``src``'s entries and count, replacing what it held; ``src`` is left empty
        (null entries, count 0), so a stale row can never be read as a live request. vLLM
        v0.25.1 left ``src`` intact. ``src == tgt`` is a no-op.
        """
        s = check_index("src", src, self.max_num_reqs)
        t = check_index("tgt", tgt, self.max_num_reqs)
        if s != t:
            self.storage.before_host_write()
            for g in self._table_groups:
                self.storage.write_move(g, s, t)

    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange rows ``src`` and ``tgt`` (entries and counts) in every group (batch reorder).
        ``src == tgt`` is a no-op."""
        s = check_index("src", src, self.max_num_reqs)
        t = check_index("tgt", tgt, self.max_num_reqs)
        if s != t:
            self.storage.before_host_write()
            for g in self._table_groups:
                self.storage.write_swap(g, s, t)

    def clear(self) -> None:
        """Empty every row of every group: entries become the null block, counts 0 (vLLM
        v0.25.1's ``clear`` kept the counts). The device copy follows at the next
        :meth:`commit`."""
        self.storage.before_host_write()
        for g in self._table_groups:
            self.storage.write_clear(g)

    def apply(self, update: StepUpdate) -> None:
        """Apply a whole step's changes (see :class:`~blocktable.update.StepUpdate`), all groups.

        Everything is validated first; a rejected update changes nothing. An update stamped
        with the allocator's block sizes must match ``block_size * cp world`` of every group.
        """
        if not isinstance(update, StepUpdate):
            raise TypeError(f"update must be a StepUpdate, got {type(update).__name__}")
        sizes = update.allocator_block_sizes
        if sizes is not None and not (type(sizes) is tuple and sizes == self._update_block_sizes):
            check_update_block_sizes(self.specs, self.cp, update)
        n = len(self.specs)
        if not len(update.added) == len(update.appended) == len(update.nulled) == n:
            for name in ("added", "appended", "nulled"):
                if len(getattr(update, name)) != n:
                    raise ValueError(
                        f"update.{name} must hold one entry per group ({n}), got "
                        f"{len(getattr(update, name))}"
                    )
        if n == 1 and self.tables[0] is not None:  # one group: check and write in one call
            if self.storage.host_read_event is not None:
                self.storage.before_host_write()
            apply_group_update(self.tables[0], update.cleared_rows, update.added[0],
                               update.appended[0], update.nulled[0], update.trusted)
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
                    update.nulled[g], update.trusted,
                ))
            )
        self.storage.before_host_write()
        for table, plan in plans:
            write_group_update(table, plan)

    def apply_and_stage(self, update: StepUpdate, staging: np.ndarray, max_pairs: int) -> int:
        """:meth:`apply`, then ``committer.stage(staging, max_pairs)`` (``staging``: int32
        ``[>= 1 + 2 * max_pairs]`` on cpu, filled with the number of pairs, the flat indices,
        the values); returns the number of pairs, or :data:`~blocktable.commit.FULL` (the
        update written, its changes left for :meth:`commit`). One compiled call, every check
        before its first write, for a one-group table where the compiled part is built."""
        writer, storage = self._staging_writer, self.storage
        if writer is not None and type(update) is StepUpdate and storage.host_read_event is None:
            # (an allocator stamps the same tuple every step: `is` before `==`)
            sizes = update.allocator_block_sizes
            if sizes is None or sizes is self._update_block_sizes or \
                    sizes == self._update_block_sizes:
                n = writer.apply_and_stage(update, staging, max_pairs)
                if n != _REFUSED:  # (refused: nothing written; apply converts or names it)
                    storage.changed = n == FULL
                    return n
        self.apply(update)  # raises for a refused update (the writer wrote nothing)
        return self.committer.stage(staging, max_pairs)

    # ---- host -> device ------------------------------------------------------------------
    def commit(self, num_reqs: int | None = None) -> CommitStats:
        """Copy every change since the last commit to the device (asynchronous on CUDA).

        ``num_reqs`` is accepted for vLLM compatibility and checked; the incremental commit
        moves exactly what changed, in whichever rows.
        """
        if num_reqs is not None:
            check_count("num_reqs", num_reqs, self.max_num_reqs, "max_num_reqs")
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
        row_of_batch_cpu: np.ndarray | torch.Tensor | None = None,
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
            ``None``: request ``r`` is row ``r`` (condensed mode). A row outside
            ``[0, max_num_reqs)`` that no check caught reads as an empty row (``PAD_SLOT_ID``).
        query_start_loc_cpu : torch.Tensor or None
            Host copy of ``query_start_loc``; when given, its contents are checked on the host
            (free). Without it, CUDA inputs are checked only in debug mode.
        row_of_batch_cpu : np.ndarray or torch.Tensor or None
            Host copy of ``row_of_batch``; when given, its rows are checked on the host (free).
            Without it, rows on CUDA are checked only in debug mode.

        Returns
        -------
        list of torch.Tensor or None
            Per group: int64 ``[max_num_batched_tokens]`` (the persistent buffer, tail set to
            ``PAD_SLOT_ID``), or ``None`` for groups without slots.
        """
        check_slot_inputs(
            query_start_loc, positions, row_of_batch, query_start_loc_cpu, device=self.device,
            max_num_reqs=self.max_num_reqs, max_num_tokens=self.max_num_batched_tokens,
            check_device_values=self.debug, row_of_batch_cpu=row_of_batch_cpu,
        )
        self.require_committed("compute_slot_mapping")
        if self.device.type == "cpu" and self.backend == "torch":
            rows = None if row_of_batch is None else row_of_batch.numpy()
            self.map_slots_on_host(query_start_loc.numpy(), positions.numpy(), rows)
        else:
            self.launch_slot_mapping_unchecked(query_start_loc, positions, row_of_batch)
        if self.debug:
            report_unmapped_tokens(
                self.storage.device_tensor.cpu().numpy(), self.slot_params, self._slot_groups,
                self.max_num_reqs, query_start_loc, positions, row_of_batch,
            )
        return list(self._slot_views)

    def map_slots_on_host(self, query_start_loc: np.ndarray, positions: np.ndarray,
                          row_of_batch: np.ndarray | None) -> None:
        """The CPU backend's slot mapping of a batch (numpy arrays: int32 ``[num_reqs + 1]``,
        int64 ``[num_tokens]``, int32 ``[num_reqs]`` or ``None``) into :attr:`slot_buffers`:
        the compiled loops where the install built them and the batch is well formed and
        contiguous, else numpy; the same slots either way. Inputs are not checked here
        (:meth:`compute_slot_mapping` and the captured step check them)."""
        mapper = self._compiled_slots
        if (mapper is not None and query_start_loc.flags.c_contiguous
                and positions.flags.c_contiguous
                and (row_of_batch is None or row_of_batch.flags.c_contiguous)
                and mapper.map(query_start_loc, positions, row_of_batch) == 0):
            return
        slot_mapping_numpy(self.storage.device_tensor.numpy(), self.slot_params,
                           query_start_loc, positions, row_of_batch, self._slots.numpy(),
                           self.max_num_reqs)
        if mapper is not None:
            mapper.mark_written()

    @property
    def slot_buffers(self) -> torch.Tensor:
        """int64 ``[num_slot_groups, max_num_batched_tokens]`` on the device: every persistent
        slot buffer, one row per token-slot group (rows of :meth:`slot_mapping`)."""
        return self._slots

    @property
    def host_slot_mapper(self) -> Any:
        """The CPU backend's compiled slot mapping bound to :attr:`slot_buffers` (a
        ``blocktable._compiled.SlotMapper``), or ``None`` where the install did not build it
        or the table lives on an accelerator. The one compiled writer of the slot buffers:
        it pads only the tail its previous map filled, so every other write of them calls
        its ``mark_written``."""
        return self._compiled_slots

    def launch_slot_mapping_unchecked(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        row_of_batch: torch.Tensor | None,
    ) -> None:
        """:meth:`compute_slot_mapping`'s launch alone: no input check, no debug report.

        For callers that validated the step on the host and hand the kernel padded inputs
        (:class:`blocktable.step.CapturedStep`: ``query_start_loc`` padded with
        ``num_tokens``, so that padding requests own no token). Never reads outside the table.
        """
        compute_slots(
            self.backend, self.storage.device_tensor, self.slot_params, self._packed_params,
            query_start_loc, positions, row_of_batch, self._slots,
            max_num_reqs=self.max_num_reqs, pow2=self._pow2, has_cp=self._has_cp,
        )
        if self._compiled_slots is not None:  # (the kernels wrote the buffers on the CPU)
            self._compiled_slots.mark_written()

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
