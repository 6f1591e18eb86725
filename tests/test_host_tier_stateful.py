"""The host tier against a model of KV contents: every block a layer reads holds what was
written for its tokens, whatever was offloaded, restored or evicted on either tier.

A simulated engine keeps one value per device block and per host block. When tokens are
computed it writes, into each block they fill, the identity of the tokens up to the block's end
(the namespace of a prefix's KV); each step it copies the manager's offload pairs, then its
restore pairs, and before the "forward" checks that every block holding a running request's
computed tokens reads the identity of that request's tokens. A restore that read a host block
whose content was replaced, or a hit on a content that is nowhere, fails the check.
"""

from __future__ import annotations

import numpy as np
from conftest import examples
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager

BASES = [[1000 * b + i for i in range(24)] for b in range(4)]  # shared prefixes


class HostTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[tuple[int, ...], int] = {}  # token prefix -> identity (>= 1)
        self.running: dict[int, list[int]] = {}  # req id -> its prompt
        self.next_req = 0
        self.history: list[tuple[int, ...]] = []  # prompts seen

    @initialize(
        block_sizes=st.sampled_from([(2,), (4,), (2, 4)]),
        num_blocks=st.integers(9, 16),
        host_blocks=st.integers(1, 10),
    )
    def setup(self, block_sizes: tuple[int, ...], num_blocks: int, host_blocks: int) -> None:
        self.block_sizes = block_sizes
        specs = [AllocatorGroupSpec(block_size=bs, num_blocks=num_blocks) for bs in block_sizes]
        self.mgr = KVCacheManager(specs, max_num_reqs=2, host_blocks=host_blocks)
        self.device = [np.zeros(num_blocks, dtype=np.int64) for _ in block_sizes]
        self.host = [np.zeros(host_blocks + 1, dtype=np.int64) for _ in block_sizes]

    def ident(self, tokens: list[int], end: int) -> int:
        return self.ids.setdefault(tuple(tokens[:end]), len(self.ids) + 1)

    # ----------------------------------------------------------------- rules
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(2, 16),
          tail=st.lists(st.integers(0, 3), max_size=3))
    def arrive(self, base: int, cut: int, tail: list[int]) -> None:
        self.admit(BASES[base][:cut] + tail)

    @rule(data=st.data())
    def come_back(self, data: st.DataObject) -> None:
        """An earlier prompt returns (after other traffic: its blocks may be on the host)."""
        if self.history:
            self.admit(list(data.draw(st.sampled_from(self.history))))

    def admit(self, prompt: list[int]) -> None:
        self.history.append(tuple(prompt))
        if len(self.running) == 2:  # the oldest request leaves: traffic moves on
            oldest = min(self.running)
            del self.running[oldest]
            self.mgr.free(oldest)
        if not self.mgr.can_admit(prompt):
            return
        looked_up = self.mgr.lookup_prefix(prompt)
        req = self.next_req
        self.next_req += 1
        before = self.mgr.prefix_cache_stats.num_host_hit_tokens
        hit = self.mgr.add_request(req, prompt)
        assert hit == looked_up  # lookup_prefix predicts admission, host hits included
        if self.mgr.prefix_cache_stats.num_host_hit_tokens > before:
            event("a hit restored from the host")
        self.mgr.allocate(req, len(prompt) - hit)  # can_admit said it fits
        self.running[req] = prompt
        self.step(req, hit, len(prompt))

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if self.running:
            req = data.draw(st.sampled_from(sorted(self.running)))
            del self.running[req]
            self.mgr.free(req)
            self.copy_transfers()  # (nothing queued by a free; drained anyway)

    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data: st.DataObject, token: int) -> None:
        """One generated token for a running request (its blocks fill and get cached too)."""
        if not self.running:
            return
        req = data.draw(st.sampled_from(sorted(self.running)))
        if not self.mgr.can_allocate_many([req], [1]):
            return
        n = self.mgr.num_computed_tokens(req)
        self.running[req].append(token)
        self.mgr.append_token_ids(req, [token])
        self.mgr.allocate(req, 1)
        self.step(req, n, n + 1)

    @rule()
    def reset_prefix_cache(self) -> None:
        """Forgets both tiers when nothing is held; a later prompt is computed again."""
        if self.mgr.reset_prefix_cache():
            assert all(self.mgr.lookup_prefix(b[:9]) == 0 for b in BASES)
        self.copy_transfers()

    # ----------------------------------------------------------------- the engine
    def copy_transfers(self) -> None:
        """Offloads first, then restores, each one batched copy (destinations distinct)."""
        for g, t in enumerate(self.mgr.take_transfers()):
            for pairs in (t.offload, t.restore):
                assert pairs.dtype == np.int32 and pairs.shape[1:] == (2,)
                assert len(set(pairs[:, 1].tolist())) == len(pairs)  # one writer per block
            assert (t.offload[:, 0] > 0).all() and (t.restore[:, 1] > 0).all()
            self.host[g][t.offload[:, 1]] = self.device[g][t.offload[:, 0]]
            self.device[g][t.restore[:, 1]] = self.host[g][t.restore[:, 0]]
            if len(t.offload) and len(t.restore) and np.isin(t.restore[:, 1], t.offload[:, 0]).any():
                event("a block offloaded and restored into in one step")

    def step(self, req: int, num_computed: int, num_tokens: int) -> None:
        self.copy_transfers()
        self.check_reads()
        prompt = self.running[req]
        for g, (bs, row) in enumerate(zip(self.block_sizes, self.mgr.block_ids(req))):
            for b in range(num_computed // bs, -(-num_tokens // bs)):
                self.device[g][row[b]] = self.ident(prompt, min((b + 1) * bs, num_tokens))
        self.mgr.mark_computed(req, num_tokens - num_computed)

    def check_reads(self) -> None:
        """Every block holding computed tokens of a running request holds their identity."""
        for req, prompt in self.running.items():
            n = self.mgr.num_computed_tokens(req)
            for g, (bs, row) in enumerate(zip(self.block_sizes, self.mgr.block_ids(req))):
                for b in range(-(-n // bs)):
                    want = self.ident(prompt, min((b + 1) * bs, n))
                    got = int(self.device[g][row[b]])
                    assert got == want, f"request {req} group {g} block {b} (id {row[b]})"

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "mgr"):
            self.mgr.check_integrity()


HostTierMachine.TestCase.settings = settings(max_examples=examples(60), stateful_step_count=50,
                                             deadline=None)
TestHostTier = HostTierMachine.TestCase
