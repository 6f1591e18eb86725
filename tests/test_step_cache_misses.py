"""The cache-miss count of the block-table step (``benchmarks/step_cache_misses.py``), without
valgrind: its workload collects exactly the decode steps after the first, through the C call
callgrind toggles at, and its reader takes the totals of a callgrind output file."""

from __future__ import annotations

import json
import operator
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_cache_misses as scm


def test_the_workload_collects_every_decode_step_but_the_first(monkeypatch, capsys) -> None:
    calls: list[str] = []
    real_call = operator.call

    def counting_call(fn, *args, **kwargs):
        calls.append(getattr(fn, "__name__", "?"))
        return real_call(fn, *args, **kwargs)

    monkeypatch.setattr(scm.operator, "call", counting_call)
    scm.child(steps=4)
    collected = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert collected == {"decode_steps_collected": 3}
    assert calls == ["take_step_update", "run_staged"] * 3


def test_totals_of_a_callgrind_file(tmp_path) -> None:
    out = tmp_path / "callgrind.out"
    out.write_text("version: 1\nevents: Ir Dr ILmr DLmr DLmw\nfn=(1) f\n3 10 4 1\n"
                   "totals: 1000 400 12 7 3\n")
    assert scm._totals(str(out)) == (["Ir", "Dr", "ILmr", "DLmr", "DLmw"], [1000, 400, 12, 7, 3])
    out.write_text("events: Ir ILmr\nsummary: 9\n")  # trailing zero events may be left out
    assert scm._totals(str(out)) == (["Ir", "ILmr"], [9, 0])
    out.write_text("events: Ir\n")
    with pytest.raises(RuntimeError, match="no events or totals"):
        scm._totals(str(out))
