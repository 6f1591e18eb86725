"""``paged_attention``: one entry point for every step (prefill, chunks, decode, mixed batches).

The Triton backend calls the device's default :class:`~blocktable.attention.planner.PagedAttention`
(one launch for the long queries, one for the short ones, whose split keys are merged by the
last split to finish); a call whose inputs have the shapes, strides, dtypes, devices and
options of an earlier checked call skips the checks and reuses that call's plan. The
torch backend computes :func:`~blocktable.attention.reference.paged_attention_reference`
(float64, slow, synchronizes: CPU engines and tests).
"""

from __future__ import annotations

import torch

from blocktable._checks import check_tensor
from blocktable._triton import HAS_TRITON, resolve_backend
from blocktable.attention.planner import PagedAttention, call_key
from blocktable.attention.reference import paged_attention_reference
from blocktable.config import CPConfig


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
    split-KV workspace belongs to the device's default :class:`PagedAttention`, see
    :func:`default_planner`), so a call can be captured in a CUDA graph; new lengths and
    request counts never recompile. The checks run once per new combination of the inputs'
    metadata (shapes, strides, dtypes, devices, options): a decode step that repeats it
    costs one kernel launch and a dictionary lookup on the host. For a workspace of your own
    (another stream, another graph) or a tuned :class:`KernelConfig`, call a
    :class:`PagedAttention` instead.

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
    if backend == "torch":
        return _with_reference(
            query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale,
            sliding_window, row_of_batch, cp, cp_block_size, out, lse_out,
            return_lse or lse_out is not None,
        )
    planner = _DEFAULT_PLANNERS.get(query.device) or default_planner(query.device)
    if seq_lens_cpu is None:  # the per-step path: a plan of this metadata is kept
        plan = planner.lookup(call_key(
            query, k_cache, v_cache, block_table, seq_lens, query_start_loc, row_of_batch, out,
            lse_out, scale, sliding_window, cp, cp_block_size, max_query_len, min_query_len,
            num_kv_splits, return_lse or lse_out is not None,
        ))
        if plan is not None:
            return plan.launch(query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                               row_of_batch, out, lse_out)
    return planner(
        query, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=scale,
        sliding_window=sliding_window, row_of_batch=row_of_batch, cp=cp,
        cp_block_size=cp_block_size, out=out, lse_out=lse_out, return_lse=return_lse,
        max_query_len=max_query_len, min_query_len=min_query_len, seq_lens_cpu=seq_lens_cpu,
        num_kv_splits=num_kv_splits,
    )


# The planner of the functional calls, one per device. Engines that run attention on several
# streams of a device, or want their scratch freed with them, make their own PagedAttention.
_DEFAULT_PLANNERS: dict[torch.device, PagedAttention] = {}


def default_planner(device: torch.device) -> PagedAttention:
    """The :class:`PagedAttention` that :func:`paged_attention` and
    :func:`~blocktable.attention.paged_decode_attention` use on ``device``."""
    planner = _DEFAULT_PLANNERS.get(device)
    if planner is None:
        planner = _DEFAULT_PLANNERS[device] = PagedAttention(device)
    return planner


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
