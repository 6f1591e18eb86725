"""``PagedAttention``: the Triton paged attention as an object that plans once and owns its
scratch.

As with FlashInfer's wrappers, :meth:`PagedAttention.plan` does the host work of a step once
(checks, launch shapes, the split-KV workspace) and returns an :class:`AttentionPlan` whose
:meth:`~AttentionPlan.run` each layer calls. Calling the object plans and runs in one go,
reusing the plan of any earlier call whose inputs had the same metadata (shapes, strides,
dtypes, devices, options). The workspace belongs to the object: two objects on one device
never share a buffer, so each may run on its own stream or in its own CUDA graph.
"""

from __future__ import annotations

import torch

from blocktable._checks import check_non_negative, check_positive, check_tensor
from blocktable.attention._inputs import (
    TRITON_DTYPES,
    check_outputs,
    check_paged_inputs,
    check_seq_lens_host,
    check_sliding_window,
    check_triton_common,
    inputs_look_valid,
    resolve_scale,
    with_lse,
)
from blocktable.attention.cp_layout import CPLayout
from blocktable.attention.decode_plan import DecodePlan, DecodeWorkspace, tensor_strides
from blocktable.attention.kernel_config import (
    DecodeSchedule,
    KernelConfig,
    decode_rows,
    default_config,
)
from blocktable.attention.prefill_launch import launch_prefill
from blocktable.config import CPConfig


class PagedAttention:
    """Causal paged attention on one device through the Triton kernels, with its own
    split-KV workspace and plans.

    Parameters
    ----------
    device : torch.device or str
        The device of every tensor it is given (``"cuda"``: the current CUDA device; CPU
        tensors need ``TRITON_INTERPRET=1``).
    config : KernelConfig, optional
        Tile sizes, warps, stages and splits; default :func:`default_config` by head size,
        with the decode stages chosen from shapes.
    max_plans : int
        Plans kept for reuse by :meth:`__call__` (the oldest goes first).

    Examples
    --------
    >>> import torch
    >>> from blocktable.attention import PagedAttention
    >>> device = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU: TRITON_INTERPRET=1
    >>> k_cache, v_cache = torch.randn(2, 4, 16, 1, 64, device=device)
    >>> block_table = torch.tensor([[1, 3], [2, 0]], dtype=torch.int32, device=device)
    >>> seq_lens = torch.tensor([20, 5], dtype=torch.int32, device=device)
    >>> query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    >>> query = torch.randn(2, 4, 64, device=device)  # one new token per request
    >>> attention = PagedAttention(device)
    >>> plan = attention.plan(query, k_cache, v_cache, block_table, seq_lens,
    ...                       query_start_loc, max_query_len=1)
    >>> plan.run(query, k_cache, v_cache, block_table, seq_lens, query_start_loc).shape
    torch.Size([2, 4, 64])
    """

    def __init__(
        self,
        device: torch.device | str,
        config: KernelConfig | None = None,
        *,
        max_plans: int = 256,
    ) -> None:
        if config is not None and not isinstance(config, KernelConfig):
            raise TypeError(f"config must be a KernelConfig or None, got {type(config).__name__}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # tensors name their index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.max_plans = check_positive("max_plans", max_plans)
        self.workspace = DecodeWorkspace(self.device)
        self._plans: dict[tuple, AttentionPlan] = {}  # by the inputs' metadata, oldest first

    def plan(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        row_of_batch: torch.Tensor | None = None,
        cp: CPConfig | None = None,
        cp_block_size: int | None = None,
        out: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
        return_lse: bool = False,
        max_query_len: int | None = None,
        min_query_len: int | None = None,
        seq_lens_cpu: object | None = None,
        num_kv_splits: int | None = None,
    ) -> AttentionPlan:
        """Check the inputs and work out their launches; arguments as in
        :func:`~blocktable.attention.paged_attention` (the tensors are read for their
        metadata only, and ``seq_lens_cpu`` for its values). Nothing is launched."""
        want_lse = return_lse or lse_out is not None
        if not inputs_look_valid(
            query, k_cache, v_cache, block_table, seq_lens, query_start_loc, row_of_batch, out,
            lse_out,
        ):  # the slow checks say what is wrong
            check_paged_inputs(query, k_cache, v_cache, block_table, seq_lens, TRITON_DTYPES)
            check_tensor(
                "query_start_loc", query_start_loc, dtype=torch.int32,
                shape=(seq_lens.shape[0] + 1,), device=query.device,
            )
            if row_of_batch is not None:
                check_tensor(
                    "row_of_batch", row_of_batch, dtype=torch.int32, shape=(seq_lens.shape[0],),
                    device=query.device,
                )
        if query.device != self.device:
            raise ValueError(f"query must be on {self.device} (the planner's), got {query.device}")
        num_reqs = seq_lens.shape[0]
        layout = check_triton_common(query, k_cache, cp, cp_block_size, num_kv_splits)
        out_checked, lse_checked = check_outputs(query, out, lse_out, want_lse)
        window = check_sliding_window(sliding_window)
        if seq_lens_cpu is not None:
            check_seq_lens_host(seq_lens_cpu, num_reqs, layout,
                                block_table.shape[1] * k_cache.shape[1])
        # Every query length is at most num_tokens: with few tokens the decode kernel serves all.
        bound = query.shape[0]
        if max_query_len is not None:
            if type(max_query_len) is not int or max_query_len < 1:
                check_positive("max_query_len", max_query_len)
            bound = min(bound, int(max_query_len))
        if min_query_len is not None:
            if type(min_query_len) is not int or min_query_len < 0:
                check_non_negative("min_query_len", min_query_len)
            if max_query_len is not None and min_query_len > max_query_len:
                raise ValueError(
                    f"min_query_len ({min_query_len}) must be <= max_query_len ({max_query_len})"
                )
        decode_rows_per_req = decode_rows(query.shape[1] // k_cache.shape[2])[2]
        decode_only = bound <= decode_rows_per_req
        prefill_only = not decode_only and (min_query_len or 0) > decode_rows_per_req
        plan = AttentionPlan(
            self, resolve_scale(scale, query.shape[2]), window, layout, num_kv_splits,
            decode_only, prefill_only, want_lse,
            call_key(query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                      row_of_batch, out, lse_out),
        )
        if decode_only:
            plan.decode = DecodePlan.build(
                self.workspace, out_checked, lse_checked, query, k_cache, block_table, seq_lens,
                query_start_loc, row_of_batch, plan.scale, window, layout,
                tensor_strides(out_checked, lse_checked, query, k_cache, v_cache, block_table),
                decode_only=True, config=self.config, num_kv_splits=num_kv_splits,
            )
        return plan

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        row_of_batch: torch.Tensor | None = None,
        cp: CPConfig | None = None,
        cp_block_size: int | None = None,
        out: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
        return_lse: bool = False,
        max_query_len: int | None = None,
        min_query_len: int | None = None,
        seq_lens_cpu: object | None = None,
        num_kv_splits: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Plan (or reuse the plan of an earlier call with the same metadata) and run; as
        :func:`~blocktable.attention.paged_attention` with ``backend="triton"``."""
        key = None
        if seq_lens_cpu is None:  # (host values are checked on every call)
            key = call_key(
                query, k_cache, v_cache, block_table, seq_lens, query_start_loc, row_of_batch,
                out, lse_out, scale, sliding_window, cp, cp_block_size, max_query_len,
                min_query_len, num_kv_splits, return_lse or lse_out is not None,
            )
            plan = self.lookup(key)
            if plan is not None:  # inputs with this metadata passed every check before
                return plan.launch(query, k_cache, v_cache, block_table, seq_lens,
                                   query_start_loc, row_of_batch, out, lse_out)
        plan = self.plan(
            query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=scale,
            sliding_window=sliding_window, row_of_batch=row_of_batch, cp=cp,
            cp_block_size=cp_block_size, out=out, lse_out=lse_out, return_lse=return_lse,
            max_query_len=max_query_len, min_query_len=min_query_len, seq_lens_cpu=seq_lens_cpu,
            num_kv_splits=num_kv_splits,
        )
        if key is not None:
            try:
                hash(key)
            except TypeError:  # an option that cannot be hashed: the plan is not kept
                key = None
        if key is not None:
            if len(self._plans) >= self.max_plans:
                self._plans.pop(next(iter(self._plans)), None)
            self._plans[key] = plan
        return plan.launch(query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                           row_of_batch, out, lse_out)

    def lookup(self, key: tuple | None) -> AttentionPlan | None:
        """The kept plan of a :func:`call_key` (``None`` when there is none)."""
        try:
            return self._plans.get(key) if key is not None else None
        except TypeError:  # an option that cannot be hashed
            return None

    def launch(
        self,
        out: torch.Tensor,
        lse_out: torch.Tensor | None,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        row_of_batch: torch.Tensor | None,
        scale: float,
        sliding_window: int | None,
        cp: CPLayout,
        *,
        decode_only: bool,
        prefill_only: bool = False,
        num_kv_splits: int | None = None,
        schedule: DecodeSchedule | None = None,
    ) -> None:
        """Launch the kernels on checked inputs, planning afresh (nothing kept but the
        workspace). ``schedule`` replaces the decode rule's (benchmarks and tests compare
        schedules).

        ``query_start_loc`` ``None`` means one query per request (token ``r`` of request
        ``r``). ``decode_only``: every request has at most ``decode_rows(group)[2]`` query
        tokens, so the prefill kernel is not launched. ``prefill_only``: the decode kernel is
        not launched and the prefill kernel serves every request (ignored with
        ``decode_only``).
        """
        num_tokens, num_heads, head_dim = query.shape
        if num_tokens == 0:
            return
        config = self.config or default_config(
            head_dim, num_heads // k_cache.shape[2], query.element_size()
        )
        pointers = k_cache.data_ptr() | v_cache.data_ptr() | query.data_ptr() | out.data_ptr()
        aligned = pointers % 16 == 0  # else the compilation that assumes nothing
        strides = tensor_strides(out, lse_out, query, k_cache, v_cache, block_table)
        prefill_only = prefill_only and not decode_only
        plan = None if prefill_only else DecodePlan.build(
            self.workspace, out, lse_out, query, k_cache, block_table, seq_lens,
            query_start_loc, row_of_batch, scale, sliding_window, cp, strides,
            decode_only=decode_only, config=self.config, num_kv_splits=num_kv_splits,
            schedule=schedule,
        )
        if plan is not None:
            plan.run(out, lse_out, query, k_cache, v_cache, block_table, seq_lens,
                     query_start_loc, row_of_batch, aligned, bind=False)
        if decode_only:
            return
        assert query_start_loc is not None  # a mixed step names its query ranges
        num_reqs = seq_lens.shape[0]
        short = 0 if prefill_only or num_reqs == 0 else decode_rows(num_heads // k_cache.shape[2])[2]
        launch_prefill(
            out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
            row_of_batch, scale, sliding_window, cp, strides, config, short_query_len=short,
            aligned=aligned,
        )


class AttentionPlan:
    """One planned step of a :class:`PagedAttention`: the options its inputs were checked
    with and, for a decode step, the launch plan. Runs on any tensors with the metadata of
    the planned ones (the values may change: new lengths never re-plan)."""

    def __init__(
        self,
        owner: PagedAttention,
        scale: float,
        window: int | None,
        layout: CPLayout,
        num_kv_splits: int | None,
        decode_only: bool,
        prefill_only: bool,
        want_lse: bool,
        key: tuple | None,
    ) -> None:
        self.owner = owner
        self.scale = scale
        self.window = window
        self.layout = layout
        self.num_kv_splits = num_kv_splits
        self.decode_only = decode_only
        self.prefill_only = prefill_only  # the prefill kernel takes every request
        self.want_lse = want_lse
        self.key = key  # the planned inputs' metadata
        self.decode: DecodePlan | None = None  # decode_only: None when nothing is launched

    def run(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        row_of_batch: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of one layer: the output (and the LSE when planned with it).

        Raises
        ------
        ValueError
            When an input's metadata (shape, stride, dtype, device; ``out`` and ``lse_out``
            given or not) differs from the planned one's.
        """
        key = call_key(query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                        row_of_batch, out, lse_out)
        if key is None or key != self.key:
            raise ValueError(
                "the inputs' shapes, strides, dtypes or devices (or which of out, lse_out and "
                "row_of_batch are given) differ from the planned ones: plan this step again"
            )
        return self.launch(query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                           row_of_batch, out, lse_out)

    def launch(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        row_of_batch: torch.Tensor | None,
        out: torch.Tensor | None,
        lse_out: torch.Tensor | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run` without the metadata check (the caller looked the plan up by it)."""
        if out is None:
            out = torch.empty_like(query)
        if self.want_lse and lse_out is None:
            lse_out = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        if not self.decode_only:
            self.owner.launch(
                out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                row_of_batch, self.scale, self.window, self.layout, decode_only=False,
                prefill_only=self.prefill_only, num_kv_splits=self.num_kv_splits,
            )
        elif self.decode is not None:
            pointers = query.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | out.data_ptr()
            self.decode.run(
                out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                row_of_batch, pointers % 16 == 0,
            )
        return with_lse(out, lse_out)


def call_key(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    row_of_batch: torch.Tensor | None,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    *options: object,
) -> tuple | None:
    """Everything the checks and the launch read from the inputs except data: shapes,
    strides, dtypes, devices and the options (with their types: ``True`` is not ``1``).
    ``None`` for inputs that are not tensors."""
    try:
        key = (
            query.shape, query.stride(), query.dtype, query.device,
            k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
            block_table.shape, block_table.stride(), block_table.dtype, block_table.device,
            seq_lens.shape, seq_lens.dtype, seq_lens.device,
            query_start_loc.shape, query_start_loc.dtype, query_start_loc.device,
            None if row_of_batch is None
            else (row_of_batch.shape, row_of_batch.dtype, row_of_batch.device),
            None if out is None else (out.shape, out.stride(), out.dtype, out.device),
            None if lse_out is None
            else (lse_out.shape, lse_out.stride(), lse_out.dtype, lse_out.device),
            options, tuple(map(type, options)),
        )
    except (AttributeError, TypeError):
        return None
    return key
