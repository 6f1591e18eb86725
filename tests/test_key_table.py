"""The prefix index's key table: the compiled open-addressing table and the dict twin go
through the same random operations as a plain dict and agree with it after every one."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from blocktable.key_table import DictKeyTable

compiled = pytest.importorskip("blocktable._compiled", reason="the compiled part is not built")

U64, I64 = np.uint64, np.int64


def tables() -> list[object]:
    # multiplier 1 and small keys: every key starts at position 0, one long run of probes,
    # so removals shift entries back across it
    return [DictKeyTable(), compiled.KeyTable(), compiled.KeyTable(0, 1)]


def agree(table: object, model: dict[int, int], universe: np.ndarray) -> None:
    assert len(table) == len(model)
    keys, values = table.items()
    assert dict(zip(keys, values)) == model and len(keys) == len(model)
    out = np.empty(len(universe), I64)
    table.find(universe, out)
    assert out.tolist() == [model.get(k, -1) for k in universe.tolist()]
    assert [table.get(k) for k in universe[:20].tolist()] == [
        model.get(k, -1) for k in universe[:20].tolist()]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("small_keys", [False, True])
def test_tables_agree_with_a_dict(seed: int, small_keys: bool) -> None:
    rng = np.random.default_rng(seed)
    high = 300 if small_keys else 2**64
    universe = np.unique(rng.integers(0, high, 250, dtype=U64))
    for table in tables():
        model: dict[int, int] = {}
        for _ in range(300):
            op = int(rng.integers(0, 6))
            absent = [k for k in rng.permutation(universe).tolist() if k not in model]
            if op <= 1 and absent:  # a batch of new keys, sometimes with a filed or repeated one
                new = absent[: int(rng.integers(1, 60))]
                bad = int(rng.integers(0, 4)) if op == 0 else 0
                if bad == 1 and model:
                    new.insert(int(rng.integers(0, len(new) + 1)), next(iter(model)))
                elif bad == 2:
                    new.append(new[0])
                values = rng.integers(0, 10**6, len(new))
                ok = table.insert_absent(np.array(new, U64), values.astype(I64))
                assert ok == (len(set(new)) == len(new) and not set(new) & model.keys())
                if ok:
                    model.update(zip(new, values.tolist()))
            elif op == 2 and absent:
                value = int(rng.integers(0, 10**6))
                table.insert(absent[0], value)
                model[absent[0]] = value
                with pytest.raises(KeyError):
                    table.insert(absent[0], value)
            elif op == 3 and model:  # remove some, sometimes with a missing or repeated one
                held = list(model)
                gone = [held[i] for i in rng.permutation(len(held))[: rng.integers(1, 40)]]
                bad = int(rng.integers(0, 4))
                if bad == 1 and absent:
                    gone.append(absent[0])
                elif bad == 2:
                    gone.insert(0, gone[-1])
                if len(set(gone)) < len(gone) or not set(gone) <= model.keys():
                    with pytest.raises(KeyError):
                        table.remove(np.array(gone, U64))
                else:
                    table.remove(np.array(gone, U64))
                    for k in gone:
                        del model[k]
            elif op == 4 and rng.random() < 0.1:
                table.clear()
                model.clear()
            agree(table, model, universe)
        for clone in (pickle.loads(pickle.dumps(table)), copy.deepcopy(table)):
            agree(clone, model, universe)


def test_growth_keeps_every_key() -> None:
    rng = np.random.default_rng(7)
    keys = np.unique(rng.integers(0, 2**64, 20_000, dtype=U64))
    for table in (compiled.KeyTable(), compiled.KeyTable(0, 1)):
        for part in np.array_split(keys, 37):
            assert table.insert_absent(part, np.arange(len(part), dtype=I64))
        assert len(table) == len(keys)
        out = np.empty(len(keys), I64)
        table.find(keys, out)
        assert (out >= 0).all()
