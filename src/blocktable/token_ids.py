"""Token ids as the library accepts them (Python ints, lists, arrays, tensors), as int64 arrays.

Python lists are converted by the compiled part (:mod:`blocktable._compiled`) where the
install built it, else with ``struct`` (the reference the tests compare it with).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from blocktable import _compiled_loader as _loader
from blocktable._checks import as_index_array
from blocktable._fastnp import count_nonzero

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
"""Token ids as the manager accepts them: a list/tuple of ints, an int array or tensor."""

_EMPTY_TOKENS = np.zeros(0, dtype=np.int64)


def token_array(name: str, value: object) -> np.ndarray:
    """Token ids as an int64 array (1-D, on cpu); ``TypeError`` naming ``name`` if not integers.

    Accepts one int, lists and tuples of ints (bools count as 0 and 1, objects with
    ``__index__`` such as numpy integers as their value), 1-D integer numpy arrays and CPU
    integer tensors. An int64 array is returned as is, not copied: callers copy what they keep.
    """
    kind = type(value)
    if (kind is list or kind is tuple) and _loader.COMPILED is not None:
        try:  # one compiled loop over the items, naming the first bad one
            return _loader.COMPILED.int64_from_ints(value, name)  # type: ignore[no-any-return]
        except OverflowError as exc:  # (one error type for every bad token id)
            raise TypeError(str(exc)) from None
    if isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 1:
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        value = (int(value),)
    elif isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 0:
        value = value.reshape(1)
    if isinstance(value, (list, tuple)):
        return int64_from_ints_python(value, name)
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return as_index_array(name, value).astype(np.int64, copy=False)
    raise TypeError(
        f"{name} must be an int, list, tuple, numpy array or tensor of ints, "
        f"got {type(value).__name__}"
    )


def int64_from_ints_python(values: Sequence[int], name: str) -> np.ndarray:
    """A list or tuple of token ids as int64 ``[len(values)]`` with ``struct``: the reference
    of the compiled ``int64_from_ints`` and the path without it (one C loop, faster than
    ``np.array``); ``TypeError`` naming ``name`` for an item that is not an int64 integer."""
    if not values:
        return _EMPTY_TOKENS
    try:
        return np.frombuffer(struct.pack(f"={len(values)}q", *values), dtype=np.int64)
    except struct.error as exc:
        raise TypeError(f"{name} must hold int64 token ids: {exc}") from None


def token_rows(values: list) -> np.ndarray | None:
    """Lists or tuples of token ids all of one length ``k`` (or ints: ``k = 1``), as one int64
    ``[len(values), k]`` array; None for anything else (other kinds or lengths, or an id that
    does not convert: the caller converts them one by one, naming the one at fault)."""
    if not values:
        return None
    compiled = _loader.COMPILED
    if compiled is not None:
        try:
            packed = compiled.int64_from_int_lists(values, "token_ids")
        except (TypeError, OverflowError):
            return None
        if packed is None:
            return None
        flat, offsets = packed
        k = int(offsets[1])
        if int(offsets[-1]) != k * len(values) or count_nonzero(offsets[1:] - offsets[:-1] != k):
            return None
        return flat.reshape(len(values), k)  # type: ignore[no-any-return]
    first = values[0]
    if type(first) is int:
        if not all(type(value) is int for value in values):
            return None
        flat_ids, k = values, 1
    elif type(first) is list or type(first) is tuple:
        k = len(first)
        for value in values:
            if type(value) is not list and type(value) is not tuple or len(value) != k:
                return None
        flat_ids = [token for value in values for token in value]
    else:
        return None
    try:
        return int64_from_ints_python(flat_ids, "token_ids").reshape(len(values), k)
    except TypeError:
        return None
