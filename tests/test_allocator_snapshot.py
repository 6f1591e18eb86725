"""A snapshot of *everything* a KVCacheManager holds, for "a rejected call changes nothing".

``full_state(mgr)`` walks the manager's objects (pools, queues, records, index, requests, rows,
journal, counters) and turns every array, list, dict and field into comparable values. The
power tables of the key hash (a cache of constants) and the last batched call's requests and
rows (a cache of lookups, refreshed by any call) are left out. Per-request calls the manager
recorded and has not applied yet are applied first: every later call sees them applied (a
rejected call may apply them), so applying them is no change.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.block_hashing import ChainPowers

_SKIP_FIELDS = {"_powers"}


def _snap(value: object, seen: dict[int, object]) -> object:
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.generic)):
        return value
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple, deque)):
        return (type(value).__name__, tuple(_snap(v, seen) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((_snap(k, seen), _snap(v, seen)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(value))
    if isinstance(value, ChainPowers):
        return "powers"
    if type(value).__name__ in ("KeyTable", "DictKeyTable"):  # the prefix index's key map
        return ("keys", frozenset(zip(*value.items())))
    if id(value) in seen:  # an object referenced twice (a request in rows and journal)
        return ("ref", type(value).__name__, id(value))
    seen[id(value)] = value
    fields: dict[str, object] = {}
    if hasattr(value, "__dict__"):
        fields.update(vars(value))
    for cls in type(value).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(value, name):
                fields[name] = getattr(value, name)
    return (
        type(value).__name__,
        tuple((k, _snap(v, seen)) for k, v in sorted(fields.items()) if k not in _SKIP_FIELDS),
    )


def full_state(mgr: KVCacheManager) -> object:
    """Every value the manager holds (see the module docstring)."""
    mgr._settle()
    return _snap(mgr, {})


def test_full_state_sees_every_kind_of_change() -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(4, 16, sliding_window=6)], 4)
    mgr.add_request("a", list(range(10)))
    mgr.allocate("a", 10)
    mgr.mark_computed("a", 10)
    before = full_state(mgr)
    assert full_state(mgr) == before
    mutations = [
        lambda: mgr.pools[0].ref_counts.__setitem__(3, 7),
        lambda: mgr.pools[0].index.slot_of_key.insert(12345, 0),
        lambda: mgr.prefix_cache.chains.num_hashed[0].__setitem__(mgr.row_of("a"), 0),
        lambda: mgr.prefix_cache.chains.state[4].__setitem__(mgr.row_of("a"), 1),
        lambda: mgr._journal.start_len.fill(3),
        lambda: mgr._row_state.num_computed.__setitem__(mgr.row_of("a"), 1),
        lambda: mgr._row_state.blocks[0].__setitem__((mgr.row_of("a"), 0), 9),
        lambda: setattr(mgr.prefix_cache, "num_hit_tokens", 5),
        lambda: mgr.pools[0].uncached.pop(1),
        lambda: setattr(mgr._requests["a"], "num_tokens", 3),
        lambda: mgr._requests["a"].append_block(0, 9),
    ]
    for mutate in mutations:
        mutate()
        assert full_state(mgr) != before
        before = full_state(mgr)


@pytest.mark.parametrize("block_size", [1, 4])
def test_full_state_is_stable_across_queries(block_size: int) -> None:
    mgr = KVCacheManager([AllocatorGroupSpec(block_size, 32)], 4)
    mgr.add_request("a", list(range(12)))
    mgr.allocate("a", 12)
    mgr.mark_computed("a", 12)
    mgr.free("a")
    before = full_state(mgr)
    mgr.lookup_prefix(list(range(13)))
    mgr.can_admit(list(range(13)))
    mgr.check_integrity()
    assert full_state(mgr) == before
