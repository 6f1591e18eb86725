"""Stateful property test of the allocator against a plain-Python model.

Hypothesis drives random arrivals (with shared prefixes and namespaces), steps (chunked
prefill, decode, lookahead allocation, running out of blocks), forks, preemptions and resumes,
finishes, prefix-cache resets, bad calls and step boundaries, through the per-request calls and
the batched ones (``add_requests``, ``allocate_many``, ``mark_computed_many``, ``free_many``)
mixed. The model keeps:

* a simulated KV cache: every slot of every block holds the identity of the exact prefix
  (namespace, tokens[:p+1]) whose K/V a forward wrote there, so a block shared by mistake, a
  stale prefix hit or a copy-on-write gone wrong shows up as a slot holding the wrong prefix;
* each request's tokens, computed count and namespace, and the preempted requests;
* a numpy block table (rows x manager blocks, counts) that only ever changes by replaying
  ``take_step_update()`` results, compared with ``block_ids`` at every step boundary;
* per group, the set of block contents (prefix identities) ever computed, from which it
  predicts every prefix hit exactly: the longest ``n`` (a multiple of every block size, at
  least one token left) such that in every group the blocks the token at ``n`` attends to
  hold cached contents of this prompt and the blocks before them were computed once. Which
  blocks are cached now is read from the pools (LRU state); the rule is the model's own.

Beside the real allocator runs :class:`~allocator_reference.ReferenceAllocator`, a plain-Python
allocator with the same policy, called with every operation that succeeds: every block id
handed out, every hit, every fork copy and the order of the free queues must be the same.

After every rule: ``check_integrity()``, the KV check, the sliding-window null entries and the
comparison with the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from allocator_reference import ReferenceAllocator
from conftest import examples
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)
from test_allocator_snapshot import full_state

from blocktable.allocator import (
    AllocatorGroupSpec,
    KVCacheManager,
    OutOfBlocksError,
    OutOfRowsError,
    rowstate,
)
from blocktable.constants import NULL_BLOCK_ID
from blocktable.update import StepUpdate

MAX_REQS = 4
MAX_MODEL_LEN = 40
VOCAB = 3  # few distinct tokens: many shared prefixes
_rng = np.random.default_rng(1234)
BASES = [_rng.integers(0, VOCAB, MAX_MODEL_LEN).tolist() for _ in range(3)]


def _collide(data: bytes) -> bytes:
    return b"same"  # every block hash collides


CONFIGS = {
    "one group": {"groups": [AllocatorGroupSpec(4, 24)]},
    "two sizes + window": {
        "groups": [AllocatorGroupSpec(2, 48), AllocatorGroupSpec(4, 24, sliding_window=6)]
    },
    "same size + window": {
        "groups": [AllocatorGroupSpec(4, 20), AllocatorGroupSpec(4, 20, sliding_window=5)]
    },
    "no caching": {"groups": [AllocatorGroupSpec(4, 20)], "enable_prefix_caching": False},
    "colliding hash": {"groups": [AllocatorGroupSpec(2, 40)], "hash_fn": _collide},
    "tiny pool": {"groups": [AllocatorGroupSpec(3, 6)]},
    "pressure": {"groups": [AllocatorGroupSpec(2, 14)]},
}


@dataclass
class ModelReq:
    tokens: list[int]
    namespace: object
    computed: int = 0
    blocks: tuple[list[int], ...] = field(default_factory=tuple)


class AllocatorMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")

    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager | None = None

    @initialize(name=st.sampled_from(sorted(CONFIGS)))
    def setup(self, name: str) -> None:
        cfg = CONFIGS[name]
        self.mgr = KVCacheManager(
            max_num_reqs=MAX_REQS,
            max_model_len=MAX_MODEL_LEN,
            **cfg,  # type: ignore[arg-type]
        )
        self.specs = self.mgr.groups
        self.ref = ReferenceAllocator(
            list(self.specs), MAX_REQS, cfg.get("enable_prefix_caching", True)  # type: ignore[arg-type]
        )
        self.align = math.lcm(*(s.block_size for s in self.specs))
        self.caching = self.mgr.enable_prefix_caching
        self.live: dict[int, ModelReq] = {}
        self.pending: dict[int, int] = {}  # scheduled, not yet computed: request -> tokens
        self.preempted: dict[int, ModelReq] = {}
        self.next_id = 0
        self.intern: dict[tuple[object, int], int] = {}
        # kv[g][block] = prefix identity per slot (None: never written)
        self.kv: list[list[list[int | None]]] = [
            [[None] * s.block_size for _ in range(s.num_blocks)] for s in self.specs
        ]
        self.computed_once: list[set[int]] = [set() for _ in self.specs]  # content identities
        self.width = [-(-MAX_MODEL_LEN // s.block_size) + 1 for s in self.specs]
        self.table = [np.zeros((MAX_REQS, w), dtype=np.int32) for w in self.width]
        self.counts = [np.zeros(MAX_REQS, dtype=np.int32) for _ in self.specs]

    # ------------------------------------------------------------------ model helpers
    def ident(self, namespace: object, tokens: list[int], pos: int) -> int:
        node: object = ("root", namespace)
        for t in tokens[: pos + 1]:
            key = (node, t)
            if key not in self.intern:
                self.intern[key] = len(self.intern) + 1
            node = self.intern[key]
        assert isinstance(node, int)
        return node

    def skipped(self, g: int, computed: int) -> int:
        window = self.specs[g].sliding_window
        return 0 if window is None else max(0, (computed - window + 1) // self.specs[g].block_size)

    def snapshot(self) -> object:
        assert self.mgr is not None
        return full_state(self.mgr)

    def cached_contents(self, g: int) -> set[int]:
        """Prefix identities the pool of group ``g`` holds findable now (from the model's KV)."""
        assert self.mgr is not None
        pool, bs = self.mgr.pools[g], self.specs[g].block_size
        held = np.flatnonzero(pool.record >= 0).tolist()
        return {self.kv[g][b][bs - 1] for b in held}  # type: ignore[misc]

    def expected_hit(self, tokens: list[int], namespace: object) -> int:
        """The exact hit, by the model's rule (see the module docstring)."""
        if not self.caching:
            return 0
        per_group = []
        for g, spec in enumerate(self.specs):
            bs = spec.block_size
            ids = [
                self.ident(namespace, tokens, (j + 1) * bs - 1) for j in range(len(tokens) // bs)
            ]
            per_group.append((ids, self.cached_contents(g), self.computed_once[g]))
        for n in range((len(tokens) - 1) // self.align * self.align, 0, -self.align):
            ok = True
            for (ids, cached, once), spec in zip(per_group, self.specs):
                hi = n // spec.block_size
                if spec.sliding_window is None:
                    lo = 0
                else:
                    lo = max(0, (n - spec.sliding_window + 1) // spec.block_size)
                if not all(i in once for i in ids[:lo]) or not all(i in cached for i in ids[lo:hi]):
                    ok = False
                    break
            if ok:
                return n
        return 0

    def admit(self, req_id: int, tokens: list[int], namespace: object) -> None:
        self.admit_many([(req_id, tokens, namespace)], batched=False)

    def admit_many(self, arrivals: list[tuple[int, list[int], object]], batched: bool) -> None:
        mgr = self.mgr
        assert mgr is not None
        if mgr.num_free_rows < len(arrivals):
            before = self.snapshot()
            with pytest.raises(OutOfRowsError):
                if batched:
                    mgr.add_requests(*map(list, zip(*arrivals)))
                else:
                    mgr.add_request(*arrivals[0][:2], cache_namespace=arrivals[0][2])
            assert self.snapshot() == before
            return
        want = [self.expected_hit(tokens, ns) for _, tokens, ns in arrivals]
        for (_, tokens, ns), hit in zip(arrivals, want):
            assert mgr.lookup_prefix(tokens, cache_namespace=ns) == hit
            assert self.ref.lookup_prefix(tokens, ns) == hit
            assert mgr.can_admit(tokens, cache_namespace=ns) == self.ref.can_admit(tokens, None, ns)
        if batched:
            got = mgr.add_requests(*map(list, zip(*arrivals)))
        else:
            got = [mgr.add_request(arrivals[0][0], arrivals[0][1], cache_namespace=arrivals[0][2])]
        event(f"admit: hit={any(got)}, window={any(s.sliding_window for s in self.specs)}")
        assert got == want
        assert self.ref.add_requests(*map(list, zip(*arrivals))) == got
        for (req_id, tokens, ns), cached in zip(arrivals, got):
            self.live[req_id] = ModelReq(list(tokens), ns, cached)
            assert mgr.num_computed_tokens(req_id) == cached

    # ------------------------------------------------------------------ rules
    @rule(
        target=reqs,
        base=st.integers(0, len(BASES) - 1),
        cut=st.integers(0, 30),
        tail=st.lists(st.integers(0, VOCAB - 1), max_size=6),
        namespace=st.sampled_from([None, None, "lora-1"]),
    )
    def arrive(self, base: int, cut: int, tail: list[int], namespace: object) -> int:
        tokens = (BASES[base][:cut] + tail)[:MAX_MODEL_LEN] or [0]
        req_id = self.next_id
        self.next_id += 1
        self.admit(req_id, tokens, namespace)
        return req_id

    @rule(
        target=reqs,
        prompts=st.lists(
            st.tuples(
                st.integers(0, len(BASES) - 1),
                st.integers(0, 30),
                st.lists(st.integers(0, VOCAB - 1), max_size=6),
                st.sampled_from([None, None, "lora-1"]),
            ),
            min_size=1,
            max_size=3,
        ),
    )
    def arrive_many(self, prompts: list[tuple[int, int, list[int], object]]) -> object:
        arrivals = []
        for base, cut, tail, namespace in prompts:
            arrivals.append(
                (self.next_id, (BASES[base][:cut] + tail)[:MAX_MODEL_LEN] or [0], namespace)
            )
            self.next_id += 1
        self.admit_many(arrivals, batched=True)
        return multiple(*(req_id for req_id, _, _ in arrivals))

    @rule(data=st.data())
    def finish_many(self, data: st.DataObject) -> None:
        """free_many of some running and preempted requests."""
        mgr = self.mgr
        assert mgr is not None
        known = sorted(self.live) + sorted(self.preempted)
        if not known:
            return
        chosen = data.draw(st.lists(st.sampled_from(known), unique=True, max_size=3))
        mgr.free_many(chosen)
        self.ref.free_many(chosen)
        for req_id in chosen:
            self.pending.pop(req_id, None)
            self.live.pop(req_id, None)
            self.preempted.pop(req_id, None)

    @rule()
    def reset_prefix_cache(self) -> None:
        mgr = self.mgr
        assert mgr is not None
        in_use = any(int(pool.ref_counts.max()) > 0 for pool in mgr.pools)
        before = self.snapshot()
        done = mgr.reset_prefix_cache()
        assert done == (not in_use) == self.ref.reset_prefix_cache()
        event(f"reset_prefix_cache: done={done}")
        if not done:
            assert self.snapshot() == before
            return
        self.computed_once = [set() for _ in self.specs]
        assert all(pool.num_cached_blocks == 0 for pool in mgr.pools)

    @rule(data=st.data())
    def bad_batched_calls(self, data: st.DataObject) -> None:
        """Unknown or repeated ids and lengths that disagree change nothing."""
        mgr = self.mgr
        assert mgr is not None
        live = sorted(self.live)
        before = self.snapshot()
        unknown = self.next_id + 1000
        with pytest.raises(KeyError, match="unknown request"):
            mgr.allocate_many([*live, unknown], [1] * (len(live) + 1))
        with pytest.raises(KeyError, match="unknown request"):
            mgr.mark_computed_many([*live, unknown], [0] * (len(live) + 1))
        with pytest.raises(KeyError, match="unknown request"):
            mgr.free_many([*live, unknown])
        if live:
            r = data.draw(st.sampled_from(live))
            with pytest.raises(ValueError, match="twice"):
                mgr.allocate_many([r, r], [1, 1])
            with pytest.raises(ValueError, match="twice"):
                mgr.free_many([*live, r])
            with pytest.raises(ValueError, match="has 2 entries but req_ids has 1"):
                mgr.allocate_many([r], [1, 2])
            with pytest.raises(ValueError, match="already running"):
                mgr.add_requests([unknown, r], [[1], [2]])
            with pytest.raises(ValueError, match="twice"):
                mgr.add_requests([unknown, unknown], [[1], [2]])
            with pytest.raises(ValueError, match="cannot mark"):
                mgr.mark_computed_many(live, [MAX_MODEL_LEN + 1] * len(live))
        assert self.snapshot() == before

    @rule(data=st.data())
    def rows_of(self, data: st.DataObject) -> None:
        """The batched row look-up equals the per-request one and the reference, for any
        subset in any order (with per-request calls still recorded); a request that is not
        running or a repeat raises naming it and changes nothing."""
        mgr = self.mgr
        assert mgr is not None
        order = data.draw(st.permutations(sorted(self.live)))
        ids = order[: data.draw(st.integers(0, len(order)))]
        got = mgr.rows_of(ids if data.draw(st.booleans()) else tuple(ids))
        assert got.dtype == np.int32 and got.shape == (len(ids),)
        assert got.tolist() == [self.ref.reqs[r].row for r in ids]
        assert got.tolist() == [mgr.row_of(r) for r in ids]
        before = self.snapshot()
        gone = data.draw(st.sampled_from([*self.preempted, self.next_id + 1000]))
        with pytest.raises(KeyError, match=repr(gone)):
            mgr.rows_of([*ids, gone])
        if ids:
            with pytest.raises(ValueError, match="twice"):
                mgr.rows_of([*ids, ids[0]])
        with pytest.raises(TypeError, match="req_ids must be a list"):
            mgr.rows_of(set(ids))  # type: ignore[arg-type]
        assert self.snapshot() == before

    @rule(
        params=st.lists(
            st.tuples(st.integers(1, 12), st.integers(0, 3), st.integers(0, VOCAB - 1)),
            min_size=MAX_REQS,
            max_size=MAX_REQS,
        ),
        reverse=st.booleans(),
    )
    def schedule(self, params: list[tuple[int, int, int]], reverse: bool) -> None:
        """Scheduler pass: each running request without a pending chunk gets blocks for one."""
        waiting = [r for r in sorted(self.live, reverse=reverse) if r not in self.pending]
        for req_id, (chunk, lookahead, token) in zip(waiting, params):
            self.schedule_one(req_id, chunk, lookahead, token)

    def schedule_one(self, req_id: int, chunk: int, lookahead: int, token: int) -> None:
        mgr = self.mgr
        assert mgr is not None
        model = self.live[req_id]
        if model.computed == len(model.tokens):
            if len(model.tokens) == MAX_MODEL_LEN:
                with pytest.raises(ValueError, match="max_model_len"):
                    mgr.append_token_ids(req_id, token)
                return
            mgr.append_token_ids(req_id, token)  # the token sampled last step
            self.ref.append_token_ids_many([req_id], [[token]])
            model.tokens.append(token)
        n = min(chunk, len(model.tokens) - model.computed)
        want = n + lookahead
        if model.computed + want > MAX_MODEL_LEN:
            with pytest.raises(ValueError, match="max_model_len"):
                mgr.allocate(req_id, want)
            want = n
        before_ids = mgr.block_ids(req_id)
        owned_elsewhere = {
            (g, b)
            for r in self.live
            if r != req_id
            for g, ids in enumerate(mgr.block_ids(r))
            for b in ids
        }
        if not mgr.can_allocate(req_id, want):
            event("schedule: out of blocks")
            before = self.snapshot()
            with pytest.raises(OutOfBlocksError):
                mgr.allocate(req_id, want)
            assert self.snapshot() == before
            return
        cached_before = [p.num_cached_blocks for p in mgr.pools]
        new = mgr.allocate(req_id, want)
        assert [ids for [ids] in self.ref.allocate_many([req_id], [want])] == list(new)
        evicted = max(b - p.num_cached_blocks for b, p in zip(cached_before, mgr.pools))
        event(f"schedule: evicted {min(evicted, 2)}+ blocks")
        after_ids = mgr.block_ids(req_id)
        for g, ids in enumerate(new):
            assert after_ids[g] == before_ids[g] + ids
            assert NULL_BLOCK_ID not in ids
            assert not {(g, b) for b in ids} & owned_elsewhere
            assert len(after_ids[g]) * self.specs[g].block_size >= model.computed + want
        self.pending[req_id] = n

    @rule(
        params=st.lists(
            st.tuples(st.integers(1, 12), st.integers(0, 3), st.integers(0, VOCAB - 1)),
            min_size=MAX_REQS,
            max_size=MAX_REQS,
        ),
    )
    def engine_step(self, params: list[tuple[int, int, int]]) -> None:
        """A whole step with the batched calls: allocate_many, forward, mark_computed_many."""
        self.schedule_batched(params)
        self.forward(batched=True)
        self.end_step()

    @rule(
        params=st.lists(
            st.tuples(st.integers(1, 12), st.integers(0, 3), st.integers(0, VOCAB - 1)),
            min_size=MAX_REQS,
            max_size=MAX_REQS,
        ),
    )
    def schedule_batched(self, params: list[tuple[int, int, int]]) -> None:
        """One allocate_many for every running request without a pending chunk."""
        mgr = self.mgr
        assert mgr is not None
        req_ids, wants, chunks = [], [], []
        for req_id, (chunk, lookahead, token) in zip(sorted(self.live), params):
            if req_id in self.pending:
                continue
            model = self.live[req_id]
            if model.computed == len(model.tokens):
                if len(model.tokens) == MAX_MODEL_LEN:
                    continue
                mgr.append_token_ids_many([req_id], [[token]])
                self.ref.append_token_ids_many([req_id], [[token]])
                model.tokens.append(token)
            n = min(chunk, len(model.tokens) - model.computed)
            want = n + lookahead if model.computed + n + lookahead <= MAX_MODEL_LEN else n
            req_ids.append(req_id)
            wants.append(want)
            chunks.append(n)
        if not req_ids:
            return
        needs = [
            sum(
                max(0, -(-(self.live[r].computed + w) // s.block_size) - len(mgr.block_ids(r)[g]))
                for r, w in zip(req_ids, wants)
            )
            for g, s in enumerate(self.specs)
        ]
        fits = all(need <= pool.num_free_blocks for need, pool in zip(needs, mgr.pools))
        assert mgr.can_allocate_many(req_ids, wants) == fits
        if not fits:
            event("schedule_batched: out of blocks")
            before = self.snapshot()
            with pytest.raises(OutOfBlocksError):
                mgr.allocate_many(req_ids, wants)
            assert self.snapshot() == before
            return
        before_ids = {r: mgr.block_ids(r) for r in req_ids}
        new = mgr.allocate_many(req_ids, wants)
        ref_new = self.ref.allocate_many(req_ids, wants)
        for g, blocks in enumerate(new):
            assert blocks.block_ids.tolist() == [b for ids in ref_new[g] for b in ids]
            start = 0
            for row, num in zip(blocks.rows.tolist(), blocks.num_manager_blocks.tolist()):
                [r] = [r for r in req_ids if mgr.row_of(r) == row]
                got = blocks.block_ids[start : start + num].tolist()
                assert mgr.block_ids(r)[g] == before_ids[r][g] + got
                start += num
        for r, n in zip(req_ids, chunks):
            self.pending[r] = n

    @rule(batched=st.booleans())
    def forward(self, batched: bool = False) -> None:
        """The model runs the pending chunks: each token's K/V lands in its slot."""
        mgr = self.mgr
        assert mgr is not None
        for req_id, n in self.pending.items():
            model = self.live[req_id]
            ids = mgr.block_ids(req_id)
            for g, spec in enumerate(self.specs):
                for p in range(model.computed, model.computed + n):
                    block = ids[g][p // spec.block_size]
                    self.kv[g][block][p % spec.block_size] = self.ident(
                        model.namespace, model.tokens, p
                    )
            if not batched:
                mgr.mark_computed(req_id, n)
                self.ref.mark_computed_many([req_id], [n])
        if batched and self.pending:
            mgr.mark_computed_many(list(self.pending), list(self.pending.values()))
            self.ref.mark_computed_many(list(self.pending), list(self.pending.values()))
        for req_id, n in self.pending.items():
            model = self.live[req_id]
            model.computed += n
            for g, spec in enumerate(self.specs):
                bs = spec.block_size
                for j in range(model.computed // bs):
                    self.computed_once[g].add(
                        self.ident(model.namespace, model.tokens, (j + 1) * bs - 1)
                    )
        self.pending.clear()

    @precondition(lambda self: self.mgr is not None and self.mgr.num_free_rows > 0)
    @rule(target=reqs, parent=reqs)
    def fork(self, parent: int) -> int:
        mgr = self.mgr
        assert mgr is not None
        model = self.live.get(parent)
        child = self.next_id
        self.next_id += 1
        if model is None:
            with pytest.raises(KeyError):
                mgr.fork(parent, child)
            return child
        partial = [model.computed % s.block_size != 0 for s in self.specs]
        if any(p and pool.num_free_blocks == 0 for p, pool in zip(partial, mgr.pools)):
            before = self.snapshot()
            with pytest.raises(OutOfBlocksError):
                mgr.fork(parent, child)
            assert self.snapshot() == before
            return child
        copies = mgr.fork(parent, child)
        assert list(copies) == self.ref.fork(parent, child)
        event(f"fork: copies={sum(map(len, copies))}")
        for g, (spec, group_copies) in enumerate(zip(self.specs, copies)):
            assert len(group_copies) == int(partial[g])
            parent_ids, child_ids = mgr.block_ids(parent)[g], mgr.block_ids(child)[g]
            num_full = model.computed // spec.block_size
            assert child_ids[:num_full] == parent_ids[:num_full]
            for src, dst in group_copies:
                assert (src, dst) == (parent_ids[num_full], child_ids[num_full])
                self.kv[g][dst] = list(self.kv[g][src])
        self.live[child] = ModelReq(list(model.tokens), model.namespace, model.computed)
        return child

    @rule(req_id=consumes(reqs))
    def finish(self, req_id: int) -> None:
        mgr = self.mgr
        assert mgr is not None
        if req_id in self.live or req_id in self.preempted:
            mgr.free(req_id)
            self.ref.free_many([req_id])
            self.pending.pop(req_id, None)
            self.live.pop(req_id, None)
            self.preempted.pop(req_id, None)
        before = self.snapshot()
        with pytest.raises(KeyError, match=repr(req_id)):
            mgr.free(req_id)  # twice, or never known
        assert self.snapshot() == before

    @rule(req_id=reqs)
    def preempt(self, req_id: int) -> None:
        mgr = self.mgr
        assert mgr is not None
        if req_id not in self.live:
            return
        mgr.preempt(req_id)
        self.ref.free_many([req_id])
        self.pending.pop(req_id, None)
        self.preempted[req_id] = self.live.pop(req_id)
        assert mgr.is_preempted(req_id)
        with pytest.raises(KeyError, match="preempted"):
            mgr.allocate(req_id, 1)

    @rule(req_id=reqs)
    def resume(self, req_id: int) -> None:
        model = self.preempted.get(req_id)
        if model is None:
            return
        tokens = model.tokens[: max(model.computed, 1)]  # all tokens computed so far
        self.admit(req_id, tokens, model.namespace)
        if req_id in self.live:
            del self.preempted[req_id]

    @rule()
    def end_step(self) -> None:
        mgr = self.mgr
        assert mgr is not None
        update = mgr.take_step_update()
        event(
            f"update: cleared={len(update.cleared_rows) > 0}, nulled={any(map(len, update.nulled))}"
        )
        self.replay(update)
        rows = {mgr.row_of(r) for r in self.live}
        for r in self.live:
            row = mgr.row_of(r)
            for g, ids in enumerate(mgr.block_ids(r)):
                assert self.counts[g][row] == len(ids)
                assert self.table[g][row, : len(ids)].tolist() == ids
        for g in range(len(self.specs)):
            for row in set(range(MAX_REQS)) - rows:
                assert self.counts[g][row] == 0
        again = mgr.take_step_update()  # nothing changed since
        assert len(again.cleared_rows) == 0
        assert all(len(a) == 0 for a in (*again.added, *again.appended))
        assert all(len(a) == 0 for a in again.nulled)

    def replay(self, update: StepUpdate) -> None:
        """Apply an update to the model table in the documented order."""
        assert update.num_groups == len(self.specs)
        for g in range(len(self.specs)):
            table, counts = self.table[g], self.counts[g]
            for row in update.cleared_rows.tolist():
                table[row] = NULL_BLOCK_ID
                counts[row] = 0
            added, appended, nulled = update.added[g], update.appended[g], update.nulled[g]
            assert len(set(added.rows.tolist())) == len(added)
            assert not set(added.rows.tolist()) & set(update.cleared_rows.tolist())
            start = 0
            for row, num in zip(added.rows.tolist(), added.num_manager_blocks.tolist()):
                table[row] = NULL_BLOCK_ID
                table[row, :num] = added.block_ids[start : start + num]
                counts[row] = num
                start += num
            assert start == len(added.block_ids)
            assert len(set(appended.rows.tolist())) == len(appended)
            start = 0
            for row, num in zip(appended.rows.tolist(), appended.num_manager_blocks.tolist()):
                assert num > 0
                table[row, counts[row] : counts[row] + num] = appended.block_ids[
                    start : start + num
                ]
                counts[row] += num
                start += num
            assert start == len(appended.block_ids)
            for row, idx in zip(nulled.rows.tolist(), nulled.block_indices.tolist()):
                assert idx < counts[row]
                table[row, idx] = NULL_BLOCK_ID
            for arr in (added.rows, added.num_manager_blocks, added.block_ids, appended.block_ids):
                assert arr.dtype == np.int32

    # ------------------------------------------------------------------ invariants
    @invariant()
    def integrity(self) -> None:
        if self.mgr is not None:
            self.mgr.check_integrity()

    @invariant()
    def same_as_the_reference(self) -> None:
        mgr = self.mgr
        if mgr is None:
            return
        assert set(self.ref.reqs) == set(self.live)
        for req_id in self.live:
            assert mgr.block_ids(req_id) == self.ref.block_ids(req_id), req_id
            assert mgr.row_of(req_id) == self.ref.reqs[req_id].row
        for g, pool in enumerate(mgr.pools):
            assert pool.eviction_order() == self.ref.eviction_order(g)
            assert pool.num_cached_blocks == self.ref.num_cached_blocks(g)

    @invariant()
    def kv_holds_each_requests_own_prefix(self) -> None:
        mgr = self.mgr
        if mgr is None:
            return
        assert mgr.num_requests == len(self.live)
        for req_id, model in self.live.items():
            assert mgr.num_computed_tokens(req_id) == model.computed
            assert mgr.num_tokens(req_id) == len(model.tokens)
            for g, (spec, ids) in enumerate(zip(self.specs, mgr.block_ids(req_id))):
                skip = self.skipped(g, model.computed)
                assert ids[:skip] == [NULL_BLOCK_ID] * skip
                assert NULL_BLOCK_ID not in ids[skip:]
                for p in range(skip * spec.block_size, model.computed):
                    got = self.kv[g][ids[p // spec.block_size]][p % spec.block_size]
                    assert got == self.ident(model.namespace, model.tokens, p), (req_id, g, p)


# 120 runs of 70 steps in CI (each run starts from fresh random seeds, so CI runs add up);
# BLOCKTABLE_TEST_EXAMPLES_SCALE (tests/conftest.py) runs more.
AllocatorMachine.TestCase.settings = settings(
    max_examples=examples(120),
    stateful_step_count=70,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAllocatorStateful = AllocatorMachine.TestCase


class AllVectorizedMachine(AllocatorMachine):
    """The same machine with row gathers always vectorized (the row count below which they
    slice each row set to 0) and a tiny token arena (rows start 2 ids wide and hold at most 8;
    longer sequences move to buffers of their own), so the paths a large engine or a long
    context takes are checked on these small pools too."""

    def __init__(self) -> None:
        super().__init__()
        self._saved = (
            rowstate._FEW_ROWS,
            rowstate._MIN_TOKEN_WIDTH,
            rowstate.TOKEN_ROW_CAP,
        )
        rowstate._FEW_ROWS = 0
        rowstate._MIN_TOKEN_WIDTH, rowstate.TOKEN_ROW_CAP = 2, 8

    def teardown(self) -> None:
        (
            rowstate._FEW_ROWS,
            rowstate._MIN_TOKEN_WIDTH,
            rowstate.TOKEN_ROW_CAP,
        ) = self._saved
        super().teardown()


AllVectorizedMachine.TestCase.settings = settings(
    max_examples=examples(40),
    stateful_step_count=70,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAllocatorStatefulVectorized = AllVectorizedMachine.TestCase
