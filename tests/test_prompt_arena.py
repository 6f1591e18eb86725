"""The prefill side's prompt arena against a dict of lists: any order of adds, drops and
offers gives every request's prompt then its first token, its max_new_tokens and its stop
tokens, and a view handed out earlier keeps its values whatever comes after (compaction,
emptying, new prompts)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from conftest import examples
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blocktable.transfer.prompt_arena import PromptArena


def _first_token(req_id: int) -> int:
    """The first token a request is offered with (the same every time, as the contract asks)."""
    return 1000 + req_id


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.arena = PromptArena(min_capacity=4)  # small: compactions happen
        self.kept: dict[int, list[int]] = {}
        self.max_new: dict[int, int] = {}
        self.stops: dict[int, list[int]] = {}
        self.next_id = 0
        self.handed: list[tuple[np.ndarray, list[int]]] = []  # outputs and their values then

    @rule(prompt=st.lists(st.integers(-2**40, 2**40), min_size=1, max_size=9),
          max_new=st.integers(0, 2**40), stops=st.lists(st.integers(0, 9), max_size=3))
    def add(self, prompt: list[int], max_new: int, stops: list[int]) -> None:
        self.arena.add(self.next_id, prompt, max_new, stops)
        self.kept[self.next_id] = prompt
        self.max_new[self.next_id] = max_new
        self.stops[self.next_id] = sorted(set(stops))
        self.next_id += 1

    @precondition(lambda self: self.kept)
    @rule(data=st.data())
    def add_again_is_refused(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.kept)))
        with pytest.raises(KeyError, match="kept already"):
            self.arena.add(req_id, [1, 2])

    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.integers(0, self.next_id + 2), max_size=6))
        self.arena.drop(ids)
        for req_id in ids:
            self.kept.pop(req_id, None)

    @precondition(lambda self: self.kept)
    @rule(data=st.data(), in_order=st.booleans())
    def offer(self, data: st.DataObject, in_order: bool) -> None:
        ids = sorted(self.kept)
        if not in_order:  # any subset in any order
            ids = data.draw(st.permutations(ids))[:data.draw(st.integers(1, len(ids)))]
        tokens, starts, max_new, stop_ids, stop_starts = self.arena.offer_arrays(
            ids, [_first_token(r) for r in ids])
        want = [t for r in ids for t in [*self.kept[r], _first_token(r)]]
        assert tokens.dtype == np.int64 and tokens.tolist() == want
        assert max_new.dtype == np.int64 and max_new.tolist() == [self.max_new[r] for r in ids]
        lengths = [len(self.kept[r]) + 1 for r in ids]
        assert starts.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
        if not any(self.stops[r] for r in ids):
            assert stop_starts is None and stop_ids.size == 0
        else:
            assert stop_starts is not None
            got = [stop_ids[a:b].tolist() for a, b in pairwise(stop_starts)]
            assert got == [self.stops[r] for r in ids]
        self.handed.append((tokens, want))

    @invariant()
    def earlier_offers_keep_their_values(self) -> None:
        for tokens, want in self.handed:
            assert tokens.tolist() == want

    @invariant()
    def counts(self) -> None:
        assert len(self.arena) == len(self.kept)
        assert self.arena.num_tokens == sum(len(p) + 1 for p in self.kept.values())
        assert all(r in self.arena for r in self.kept)


TestPromptArena = ArenaMachine.TestCase
TestPromptArena.settings = settings(max_examples=examples(60), stateful_step_count=30, deadline=None)


def test_prompts_added_together_are_offered_as_one_view() -> None:
    arena = PromptArena()
    for req_id in range(3):
        arena.add(req_id, [req_id] * 4)
    tokens, starts, *_ = arena.offer_arrays([0, 1, 2], [7, 8, 9])
    again, *_ = arena.offer_arrays([0, 1, 2], [7, 8, 9])
    assert np.shares_memory(tokens, again)  # no copy per round
    assert tokens.tolist() == [0, 0, 0, 0, 7, 1, 1, 1, 1, 8, 2, 2, 2, 2, 9]
    assert starts.tolist() == [0, 5, 10, 15]
    assert arena.offer_arrays([], [])[1].tolist() == [0]


def test_bad_capacity_and_unknown_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="min_capacity must be >= 1"):
        PromptArena(0)
    arena = PromptArena()
    arena.add("a", [1])
    with pytest.raises(KeyError):
        arena.offer_arrays(["b"], [3])
    assert arena.offer_arrays(["a"], [3])[0].tolist() == [1, 3]
