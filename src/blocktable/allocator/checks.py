"""Argument checks of the batched allocator calls: everything is checked before any write."""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any, NoReturn

import numpy as np

from blocktable._checks import check_count
from blocktable.allocator.request import RequestState, check_req_id


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


def running_requests(
    requests: Mapping[Any, RequestState], preempted: set[Any], req_ids: list
) -> list[RequestState]:
    """The running requests of ``req_ids`` (distinct); ``KeyError`` naming an unknown one."""
    try:
        out = [requests[req_id] for req_id in req_ids]
    except (KeyError, TypeError):
        _raise_not_running(requests, preempted, req_ids)
    if len(set(req_ids)) != len(out):
        raise ValueError(f"req_ids holds a request twice: {_first_repeat(req_ids)!r}")
    return out


def _raise_not_running(
    requests: Mapping[Any, RequestState], preempted: set[Any], req_ids: list
) -> NoReturn:
    """Raise the error naming the first of ``req_ids`` that is not running."""
    for req_id in req_ids:
        if requests.get(req_id) is None:
            check_req_id("req_ids entries", req_id)
            if req_id in preempted:
                raise KeyError(f"request {req_id!r} is preempted (add_request it again)")
            raise KeyError(f"unknown request {req_id!r} (never added, or already freed)")
    raise AssertionError("every request is running")  # pragma: no cover


def distinct_new_ids(requests: Mapping[Any, RequestState], req_ids: list) -> None:
    """New request ids: valid, not running, no repeats."""
    for req_id in req_ids:
        check_req_id("req_id", req_id)
        if req_id in requests:
            raise ValueError(f"request {req_id!r} is already running")
    if len(set(req_ids)) != len(req_ids):
        raise ValueError(f"req_ids holds a request twice: {_first_repeat(req_ids)!r}")


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


def _first_repeat(values: list) -> object:
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
