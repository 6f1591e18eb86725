"""Argument checks shared by every layer (tensors, indices, per-request lists of batched calls);
every error names the argument and the bound."""

from __future__ import annotations

from collections.abc import Sequence, Sized

import numpy as np
import torch


def check_tensor(
    name: str,
    value: object,
    *,
    dtype: torch.dtype | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check that ``value`` is a tensor with the given properties; raise naming ``name``.

    ``shape`` entries that are ``None`` match any size. ``device`` compares the device type and,
    when the expected device has an index, the index too. Returns the tensor unchanged.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtype is not None and value.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {value.dtype}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if shape is not None and (
        value.dim() != len(shape)
        or any(want is not None and got != want for got, want in zip(value.shape, shape))
    ):
            want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want_s}, got {list(value.shape)}")
    if device is not None:
        want_dev = torch.device(device)
        if value.device.type != want_dev.type or (
            want_dev.index is not None and value.device.index != want_dev.index
        ):
            raise ValueError(f"{name} must be on device {want_dev}, got {value.device}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return value


def check_index(name: str, value: object, bound: int) -> int:
    """Check ``0 <= value < bound`` for a Python or numpy integer; return it as ``int``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < bound:
        raise IndexError(f"{name}={int(value)} is out of range [0, {bound})")
    return int(value)


def check_count(
    name: str, value: object, bound: int | None = None, bound_name: str | None = None
) -> int:
    """Check a count: an int ``>= 0`` (``ValueError``) and, with ``bound``, ``<= bound``
    (``IndexError`` naming ``bound_name``; the bound itself is allowed). Return it as ``int``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {int(value)}")
    if bound is not None and value > bound:
        raise IndexError(
            f"{name}={int(value)} is out of range [0, {bound_name or 'bound'}={bound}]"
        )
    return int(value)


def block_id_error(name: str, block_id: int, bound: int, declared: bool) -> ValueError:
    """The error for a block id outside ``[0, bound)`` (``declared``: the bound is the group's
    ``num_blocks``); every entry point that takes ids words it this way."""
    return ValueError(
        f"{name} holds block id {int(block_id)}, outside [0, {bound})"
        + (" (num_blocks)" if declared else "")
    )


def check_block_ids(name: str, ids: np.ndarray, bound: int, declared: bool) -> None:
    """Raise :func:`block_id_error` unless every id of the 1-D integer array is in ``[0, bound)``."""
    # one reduction: read as unsigned, a negative id is larger than any bound
    if len(ids) and int(ids.astype(np.uint64).max()) >= bound:
        lo, hi = int(ids.min()), int(ids.max())
        raise block_id_error(name, lo if lo < 0 else hi, bound, declared)


def check_row_of_batch(
    row_of_batch: object,
    row_of_batch_cpu: object,
    *,
    num_reqs: int,
    max_num_reqs: int,
    device: torch.device,
    debug: bool,
) -> np.ndarray | None:
    """Check indexed mode's row vector; return its rows on the host when known without a sync.

    ``row_of_batch`` must be an int32 ``[num_reqs]`` tensor on ``device``. Its values must lie in
    ``[0, max_num_reqs)``; they are checked (``IndexError`` naming the bound) from
    ``row_of_batch_cpu`` (a host copy: array or CPU tensor, ``[num_reqs]``) when given, from the
    tensor itself when it is on the CPU, and in ``debug`` mode from a synchronizing copy, which
    must equal ``row_of_batch_cpu``. Otherwise nothing is read: device code treats a row outside
    the range as an empty row (null blocks, ``PAD_SLOT_ID`` slots).

    Returns
    -------
    np.ndarray or None
        int64 ``[num_reqs]`` rows (checked), or ``None`` when no host copy was at hand.
    """
    if not (isinstance(row_of_batch, torch.Tensor) and row_of_batch.dtype == torch.int32
            and row_of_batch.shape == (num_reqs,) and row_of_batch.device == device):
        check_tensor("row_of_batch", row_of_batch, dtype=torch.int32, shape=[num_reqs],
                     device=device)
    assert isinstance(row_of_batch, torch.Tensor)
    host = None
    if row_of_batch_cpu is not None:
        host = as_index_array("row_of_batch_cpu", row_of_batch_cpu)
        if len(host) != num_reqs:
            raise ValueError(f"row_of_batch_cpu must have shape [{num_reqs}], got [{len(host)}]")
        _check_rows("row_of_batch_cpu", host, max_num_reqs)
    if row_of_batch.device.type == "cpu" or debug:
        rows = row_of_batch.cpu().numpy().astype(np.int64)
        if host is not None and not np.array_equal(rows, host):
            i = int(np.argmax(rows != host))
            raise ValueError(
                f"row_of_batch_cpu[{i}]={int(host[i])} differs from row_of_batch[{i}]="
                f"{int(rows[i])}"
            )
        _check_rows("row_of_batch", rows, max_num_reqs)
        host = rows
    return host


def _check_rows(name: str, rows: np.ndarray, bound: int) -> None:
    if len(rows):
        lo, hi = int(rows.min()), int(rows.max())
        if lo < 0 or hi >= bound:
            raise IndexError(f"{name} holds row {lo if lo < 0 else hi}, outside [0, {bound})")


def check_int_at_least(name: str, value: object, low: int) -> int:
    """Check that ``value`` is an int >= ``low``; return it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {int(value)}")
    return int(value)


def check_positive(name: str, value: object) -> int:
    """Check that ``value`` is an int >= 1; return it."""
    return check_int_at_least(name, value, 1)


def check_non_negative(name: str, value: object) -> int:
    """Check that ``value`` is an int >= 0; return it."""
    return check_int_at_least(name, value, 0)


def as_index_array(name: str, value: object) -> np.ndarray:
    """Convert a sequence or array of integers to a 1-D ``int64`` numpy array, or raise.

    Accepts lists, tuples, numpy integer arrays and CPU integer tensors. Floats and bools are
    rejected, so ``1.5`` never becomes block 1.
    """
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        return value.astype(np.int64, copy=False)  # the hot path: already an index array
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        arr = value.detach().cpu().numpy()
    else:
        arr = np.asarray(value)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {list(arr.shape)}")
    return arr.astype(np.int64, copy=False)


# ---- per-request arguments of batched calls
def as_list(name: str, value: object) -> list:
    """A list, tuple or 1-D array as a list; ``TypeError`` naming ``name`` otherwise."""
    if isinstance(value, list):
        return value
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return value.tolist()
    raise TypeError(f"{name} must be a list, tuple or 1-D array, got {type(value).__name__}")


def check_same_length(name: str, value: Sized, num_reqs: int) -> None:
    if len(value) != num_reqs:
        raise ValueError(f"{name} has {len(value)} entries but req_ids has {num_reqs}")


def token_counts(name: str, value: object, num_reqs: int) -> list[int]:
    """Per-request token counts (ints >= 0), as a list of ``num_reqs`` ints."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a 1-D integer array, got {value.dtype} {value.shape}")
        check_same_length(name, value, num_reqs)
        if len(value) and value.min() < 0:
            raise ValueError(f"{name} must be >= 0, got {int(value.min())}")
        return value.tolist()
    counts = as_list(name, value)
    check_same_length(name, counts, num_reqs)
    if set(map(type, counts)) <= {int} and min(counts, default=0) >= 0:
        return counts  # plain ints (the common case): read only
    for count in counts:
        if type(count) is not int or count < 0:
            check_count(f"{name} entries", count)
    return [int(c) for c in counts]


def first_repeat(values: list) -> object:
    seen = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    return None


def check_model_len(max_model_len: int | None, who: str, what: str, num_tokens: int) -> None:
    """``ValueError`` naming ``who`` and ``what`` when ``num_tokens`` exceeds the limit."""
    if max_model_len is not None and num_tokens > max_model_len:
        raise ValueError(
            f"{who}: {what} of {num_tokens} tokens exceeds max_model_len={max_model_len}"
        )
