"""Request-id checks of the batched allocator calls (the generic ones are in
:mod:`blocktable._checks`): everything is checked before any write."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from blocktable._checks import first_repeat
from blocktable.allocator.request import RequestState, check_req_id


def running_requests(
    requests: Mapping[Any, RequestState], preempted: set[Any], req_ids: list
) -> list[RequestState]:
    """The running requests of ``req_ids`` (distinct); ``KeyError`` naming an unknown one."""
    try:
        out = [requests[req_id] for req_id in req_ids]
    except (KeyError, TypeError):
        _raise_not_running(requests, preempted, req_ids)
    if len(set(req_ids)) != len(out):
        raise ValueError(f"req_ids holds a request twice: {first_repeat(req_ids)!r}")
    return out


def _raise_not_running(
    requests: Mapping[Any, RequestState], preempted: set[Any], req_ids: list
) -> NoReturn:
    """Raise the error naming the first of ``req_ids`` that is not running."""
    for req_id in req_ids:
        check_req_id("req_ids entries", req_id)  # (first: an unhashable one is named)
        if requests.get(req_id) is None:
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
    if len(req_ids) > 1 and len(set(req_ids)) != len(req_ids):
        raise ValueError(f"req_ids holds a request twice: {first_repeat(req_ids)!r}")


def raise_not_computable(req: RequestState, num_computed: int,
                         block_sizes: Sequence[int]) -> NoReturn:
    """Raise ``ValueError``: ``req`` lacks token ids or blocks for ``num_computed`` tokens."""
    if num_computed > req.num_tokens:
        raise ValueError(
            f"request {req.req_id!r}: cannot mark {num_computed} tokens computed, only "
            f"{req.num_tokens} token ids are known (append_token_ids first)"
        )
    for g, (row_len, bs) in enumerate(zip(req.row_len.tolist(), block_sizes)):
        if num_computed > row_len * bs:
            raise ValueError(
                f"request {req.req_id!r}: cannot mark {num_computed} tokens computed, "
                f"group {g} has blocks for {row_len * bs} (allocate first)"
            )
    raise AssertionError(f"request {req.req_id!r} has tokens and blocks for {num_computed}")
