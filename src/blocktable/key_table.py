"""The prefix index's map from block keys (uint64) to record slots (int64 >= 0).

Two implementations with one interface: :class:`DictKeyTable`, a Python ``dict`` (the readable
one, and the one used where the install did not build the compiled part), and the compiled
``KeyTable`` of :mod:`blocktable._compiled` (open addressing over two arrays: a step files,
looks up and removes about a thousand keys, and a dict's lookups of fresh keys each miss the
cache in a loop of their own). The tests run both through the same random operations.
``benchmarks/bench_prefix_index.py`` compares them at the allocator step.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from blocktable import _compiled_loader


class DictKeyTable:
    """A map from uint64 keys to int64 values >= 0, over a ``dict`` of Python ints.

    Every call checks its arguments before it changes anything, and a call that raises or
    returns False leaves the map as it was (the interface of the compiled ``KeyTable``).
    """

    def __init__(self, capacity: int = 0) -> None:
        self._d: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: int, default: int = -1) -> int:
        """The value of ``key``, else ``default``."""
        return self._d.get(key, default)

    def find(self, keys: np.ndarray, out: np.ndarray) -> None:
        """``out[i]`` = the value of ``keys[i]`` (uint64 ``[n]``), -1 where absent (``out``:
        int64 ``[n]``)."""
        if len(out) != len(keys):
            raise ValueError(f"out has {len(out)} entries, keys {len(keys)}")
        out[:] = np.fromiter(map(self._d.get, keys.tolist(), repeat(-1)), np.int64, len(keys))

    def insert_absent(self, keys: np.ndarray, values: np.ndarray) -> bool:
        """File ``keys`` (uint64 ``[n]``) with ``values`` (int64 ``[n]``, >= 0) and return True
        when no key is filed yet and none repeats; else change nothing and return False."""
        if len(values) != len(keys):
            raise ValueError(f"values has {len(values)} entries, keys {len(keys)}")
        if len(values) and int(values.min()) < 0:
            raise ValueError("values must be >= 0")
        d, new = self._d, keys.tolist()
        if not d.keys().isdisjoint(new):
            return False
        size = len(d)
        d.update(zip(new, values.tolist()))
        if len(d) != size + len(new):  # a key given twice: undo (none was filed before)
            for key in set(new):
                del d[key]
            return False
        return True

    def insert(self, key: int, value: int) -> None:
        """File ``key`` (not filed yet) with ``value`` (>= 0)."""
        if value < 0:
            raise ValueError(f"value must be >= 0, got {value}")
        if key in self._d:
            raise KeyError(f"key {key} is filed already")
        self._d[key] = value

    def remove(self, keys: np.ndarray) -> None:
        """Remove ``keys`` (uint64 ``[n]``, each filed, distinct)."""
        new = keys.tolist()
        seen: set[int] = set()
        for i, key in enumerate(new):
            if key not in self._d or key in seen:
                what = "not filed" if key not in self._d else "repeated"
                raise KeyError(f"keys[{i}] ({key}) is {what}")
            seen.add(key)
        list(map(self._d.__delitem__, new))

    def clear(self) -> None:
        """Remove every key."""
        self._d.clear()

    def items(self) -> tuple[list[int], list[int]]:
        """Every key and its value, as two lists in the same order."""
        return list(self._d), list(self._d.values())


def new_key_table(capacity: int = 0) -> object:
    """The compiled ``KeyTable`` where the install built it, else a :class:`DictKeyTable`."""
    compiled = _compiled_loader.COMPILED
    return DictKeyTable(capacity) if compiled is None else compiled.KeyTable(capacity)
