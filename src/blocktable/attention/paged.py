"""``paged_attention``: one entry point for every step (prefill, chunks, decode, mixed batches).

The Triton backend runs the kernels of :mod:`blocktable.attention.launch` (one launch for the
long queries, one for the short ones, whose split keys are merged by the last split to
finish); a call whose inputs have the shapes, strides, dtypes, devices and options of an
earlier checked call skips the checks and reuses that call's launch plan. The
torch backend computes :func:`~blocktable.attention.reference.paged_attention_reference`
(float64, slow, synchronizes: CPU engines and tests).
"""

from __future__ import annotations

import numpy as np
import torch

from blocktable._checks import (
    as_index_array,
    check_non_negative,
    check_positive,
    check_tensor,
)
from blocktable._triton import HAS_TRITON, resolve_backend
from blocktable.attention._inputs import check_paged_inputs, check_sliding_window, resolve_scale
from blocktable.attention.cp_layout import local_seq_len
from blocktable.attention.launch import (
    CPLayout,
    DecodePlan,
    decode_rows,
    launch_paged_attention,
)
from blocktable.attention.reference import _cp_layout, paged_attention_reference
from blocktable.config import CPConfig

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
NO_CP = CPLayout()


def paged_attention(
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
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal paged attention of a varlen batch, reading K/V through the block table.

    Same contract as :func:`~blocktable.attention.reference.paged_attention_reference`
    (shapes, ``row_of_batch``, context parallelism, log-sum-exp), plus caller-owned outputs.
    On the Triton path nothing is read on the host and nothing is allocated per call (the
    split-KV workspace is cached per device and shape), so a call can be captured in a CUDA
    graph; new lengths and request counts never recompile. The checks run once per new
    combination of the inputs' metadata (shapes, strides, dtypes, devices, options): a
    decode step that repeats it costs one kernel launch and a dictionary lookup on the host.

    Parameters
    ----------
    query, k_cache, v_cache, block_table, seq_lens, query_start_loc
        As in :func:`~blocktable.attention.reference.paged_attention_reference`; on the Triton
        path float32, float16 or bfloat16, ``head_dim <= 256``, any kernel block size and any
        strides. A ``seq_len`` beyond the row is clamped to the row on the device and a block
        id outside ``[0, num_blocks)`` is never dereferenced (its keys read as zeros): never
        a read outside the table or the cache.
    scale, sliding_window, row_of_batch, cp, cp_block_size
        As in the reference.
    out : torch.Tensor, optional
        ``[num_tokens, num_heads, head_dim]``, the query's dtype and device, written in place
        (pad tokens get zeros).
    lse_out : torch.Tensor, optional
        float32 ``[num_tokens, num_heads]`` on the query's device, written in place (implies
        ``return_lse``): natural log, ``-inf`` where no key is visible and for pad tokens.
    max_query_len : int, optional
        An upper bound on every request's query length, known on the host (e.g. 1 for a decode
        step). With a small bound only the decode kernel runs; without it both kernels run
        and each takes the requests it serves best. A wrong bound gives wrong results.
    min_query_len : int, optional
        A lower bound on every request's query length, known on the host (e.g. a step of
        prompt chunks only). Above the decode kernel's query tokens per request (16 over the
        GQA group size rounded up to a power of two, at least 1: 4 for a group of 4) only
        the prefill kernel runs, and it takes every
        request: one launch less per step. The result does not depend on the bound (a shorter
        request is served by the prefill kernel, exactly); it must not exceed
        ``max_query_len``.
    seq_lens_cpu : array-like, optional
        Host copy of ``seq_lens``: when given, a ``seq_len`` whose keys on this rank exceed the
        row (``width * block_size``) is a ``ValueError`` before the launch.
    num_kv_splits : int, optional
        Programs sharing each short request's keys; default from shapes only.
    backend : {"auto", "triton", "torch"}
        ``"auto"``: Triton on CUDA, the float64 reference on the CPU. ``"triton"`` on CPU
        tensors needs ``TRITON_INTERPRET=1``.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        The output (and the LSE when ``return_lse`` or ``lse_out`` is given).

    Examples
    --------
    >>> import torch
    >>> from blocktable.attention import paged_attention
    >>> k_cache, v_cache = torch.randn(2, 4, 16, 1, 8)
    >>> block_table = torch.tensor([[2, 3]], dtype=torch.int32)   # 20 tokens: block 2 then 3
    >>> seq_lens = torch.tensor([20], dtype=torch.int32)
    >>> query_start_loc = torch.tensor([0, 4], dtype=torch.int32)  # the last 4 are new
    >>> out, lse = paged_attention(torch.randn(4, 2, 8), k_cache, v_cache, block_table,
    ...                            seq_lens, query_start_loc, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([4, 2, 8]), torch.Size([4, 2]))
    """
    if not (backend == "auto" and HAS_TRITON and query.is_cuda):  # (the per-step case: fast)
        backend = resolve_backend(backend, query.device)
    want_lse = return_lse or lse_out is not None
    if backend == "torch":
        return _with_reference(
            query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
            sliding_window, row_of_batch, cp, cp_block_size, out, lse_out, want_lse,
        )
    key = None
    if seq_lens_cpu is None:  # (host values are checked on every call)
        key = _call_key(
            query, k_cache, v_cache, block_table, seq_lens, query_start_loc, row_of_batch, out,
            lse_out, scale, sliding_window, cp, cp_block_size, max_query_len, min_query_len,
            num_kv_splits, want_lse,
        )
        try:
            call = _CALLS.get(key) if key is not None else None
        except TypeError:  # an option that cannot be hashed
            call = key = None
        if call is not None:  # inputs with this metadata passed every check before
            if out is None:
                out = torch.empty_like(query)
            if want_lse and lse_out is None:
                lse_out = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
            call.run(
                out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                row_of_batch,
            )
            return with_lse(out, lse_out)
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
    num_reqs = seq_lens.shape[0]
    layout = check_triton_common(query, k_cache, cp, cp_block_size, num_kv_splits)
    out, lse_out = check_outputs(query, out, lse_out, want_lse)
    window = check_sliding_window(sliding_window)
    if seq_lens_cpu is not None:
        check_seq_lens_host(seq_lens_cpu, num_reqs, layout, block_table.shape[1] * k_cache.shape[1])
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
    call = CheckedCall(
        resolve_scale(scale, query.shape[2]), window, layout, num_kv_splits, decode_only,
        prefill_only,
    )
    if decode_only:
        call.plan = DecodePlan.build(
            out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
            row_of_batch, call.scale, window, layout, decode_only=True,
            num_kv_splits=num_kv_splits,
        )
    if key is not None:
        if len(_CALLS) >= MAX_CACHED_CALLS:  # the oldest goes
            _CALLS.pop(next(iter(_CALLS)), None)
        _CALLS[key] = call
    call.run(
        out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        row_of_batch,
    )
    return with_lse(out, lse_out)


class CheckedCall:
    """What a checked call worked out from its inputs' metadata: options and, for a decode
    step, the launch plan. Reused by every later call whose inputs have the same metadata."""

    def __init__(
        self,
        scale: float,
        window: int | None,
        layout: CPLayout,
        num_kv_splits: int | None,
        decode_only: bool,
        prefill_only: bool = False,
    ) -> None:
        self.scale = scale
        self.window = window
        self.layout = layout
        self.num_kv_splits = num_kv_splits
        self.decode_only = decode_only
        self.prefill_only = prefill_only  # the prefill kernel takes every request
        self.plan: DecodePlan | None = None  # decode_only: None when nothing is launched

    def run(
        self,
        out: torch.Tensor,
        lse_out: torch.Tensor | None,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        row_of_batch: torch.Tensor | None,
    ) -> None:
        if not self.decode_only:
            launch_paged_attention(
                out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                row_of_batch, self.scale, self.window, self.layout, decode_only=False,
                prefill_only=self.prefill_only, num_kv_splits=self.num_kv_splits,
            )
        elif self.plan is not None:
            pointers = query.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | out.data_ptr()
            self.plan.run(
                out, lse_out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                row_of_batch, pointers % 16 == 0,
            )


# Checked calls by their inputs' metadata (devices included), oldest first.
_CALLS: dict[tuple, CheckedCall] = {}
MAX_CACHED_CALLS = 256


def _call_key(
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


def with_lse(
    out: torch.Tensor, lse_out: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return out if lse_out is None else (out, lse_out)


def inputs_look_valid(
    query: object,
    k_cache: object,
    v_cache: object,
    block_table: object,
    seq_lens: object,
    query_start_loc: object,
    row_of_batch: object,
    out: object,
    lse_out: object,
) -> bool:
    """A fast yes to the checks of the Triton path (a no is explained by the slow checks)."""
    try:
        dtype = k_cache.dtype  # type: ignore[attr-defined]
        dev = k_cache.device  # type: ignore[attr-defined]
        kshape = k_cache.shape  # type: ignore[attr-defined]
        qshape = query.shape  # type: ignore[attr-defined]
        num_reqs = seq_lens.shape[0]  # type: ignore[attr-defined]
        i32 = torch.int32
        ok = (
            dtype in TRITON_DTYPES
            and len(kshape) == 4
            and v_cache.dtype is dtype  # type: ignore[attr-defined]
            and v_cache.shape == kshape  # type: ignore[attr-defined]
            and query.dtype is dtype  # type: ignore[attr-defined]
            and len(qshape) == 3
            and qshape[2] == kshape[3]
            and qshape[1] > 0
            and qshape[1] % kshape[2] == 0
            and seq_lens.dtype is i32  # type: ignore[attr-defined]
            and seq_lens.dim() == 1  # type: ignore[attr-defined]
            and block_table.dtype is i32  # type: ignore[attr-defined]
            and block_table.dim() == 2  # type: ignore[attr-defined]
            and block_table.shape[0] >= num_reqs  # type: ignore[attr-defined]
            and (
                query_start_loc is None
                or (query_start_loc.dtype is i32  # type: ignore[attr-defined]
                    and query_start_loc.shape == (num_reqs + 1,))  # type: ignore[attr-defined]
            )
            and (
                row_of_batch is None
                or (row_of_batch.dtype is i32  # type: ignore[attr-defined]
                    and row_of_batch.shape == (num_reqs,))  # type: ignore[attr-defined]
            )
        )
        if not ok:
            return False
        tensors = [v_cache, query, seq_lens, block_table]
        if query_start_loc is not None:
            tensors.append(query_start_loc)
        if row_of_batch is not None:
            tensors.append(row_of_batch)
        if out is not None:
            tensors.append(out)
        if lse_out is not None:
            tensors.append(lse_out)
        return all(t.device == dev for t in tensors)  # type: ignore[attr-defined]
    except AttributeError:
        return False


def check_triton_common(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    cp: CPConfig | None,
    cp_block_size: int | None,
    num_kv_splits: int | None,
) -> CPLayout:
    """Checks of the Triton path beyond :func:`check_paged_inputs`; the CP layout."""
    if query.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM}, got {query.shape[2]}")
    if num_kv_splits is not None:
        check_positive("num_kv_splits", num_kv_splits)
    if cp is None and cp_block_size is None:
        return NO_CP
    layout = _cp_layout(cp, cp_block_size, k_cache.shape[1])
    return CPLayout(
        layout["world_size"], layout["rank"], layout["interleave"], layout["manager_block_size"]
    )


def check_outputs(
    query: torch.Tensor, out: torch.Tensor | None, lse_out: torch.Tensor | None, want_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The caller's output buffers (checked), or new ones."""
    if out is None:
        out = torch.empty_like(query)
    elif not (out.dtype is query.dtype and out.shape == query.shape
              and out.device == query.device):
        check_tensor("out", out, dtype=query.dtype, shape=query.shape, device=query.device)
    if lse_out is not None:
        check_tensor(
            "lse_out", lse_out, dtype=torch.float32, shape=query.shape[:2], device=query.device
        )
    elif want_lse:
        lse_out = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    return out, lse_out


def check_seq_lens_host(
    seq_lens_cpu: object, num_reqs: int, layout: CPLayout, row_capacity: int
) -> None:
    """Raise when a host-side ``seq_len`` puts more keys on this rank than its row holds."""
    seq = as_index_array("seq_lens_cpu", seq_lens_cpu)
    if seq.shape[0] != num_reqs:
        raise ValueError(f"seq_lens_cpu must have shape [{num_reqs}], got {list(seq.shape)}")
    local = np.asarray(
        local_seq_len(
            seq, world_size=layout.world_size, rank=layout.rank, interleave=layout.interleave,
            manager_block_size=layout.block_size,
        )
    )
    if seq.size and (seq.min() < 0 or local.max() > row_capacity):
        i = int(np.argmax((seq < 0) | (local > row_capacity)))
        raise ValueError(
            f"seq_lens_cpu[{i}]={int(seq[i])} must be >= 0 and put at most width * block_size="
            f"{row_capacity} keys on this rank"
        )


def _with_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None,
    sliding_window: int | None,
    row_of_batch: torch.Tensor | None,
    cp: CPConfig | None,
    cp_block_size: int | None,
    out: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    want_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if out is not None:
        check_tensor("out", out, dtype=query.dtype, shape=query.shape, device=query.device)
    if lse_out is not None:
        check_tensor(
            "lse_out", lse_out, dtype=torch.float32, shape=query.shape[:2], device=query.device
        )
    result, lse = paged_attention_reference(
        query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=scale,
        sliding_window=sliding_window, row_of_batch=row_of_batch, cp=cp,
        cp_block_size=cp_block_size, return_lse=True,
    )
    if out is not None:
        out.copy_(result)
        result = out
    if lse_out is not None:
        lse_out.copy_(lse)
        lse = lse_out
    return (result, lse) if want_lse else result
