"""The allocator drives the real table: every slot the table produces for a live request lies in
a block that request owns, shared prefix blocks are never written, and no two requests' written
slots collide."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktable import GroupSpec, MultiGroupBlockTable
from blocktable.allocator import AllocatorGroupSpec, KVCacheManager

MAX_REQS = 6


@pytest.mark.parametrize("seed", range(4))
def test_slots_lie_in_owned_unshared_blocks(seed):
    rng = np.random.default_rng(seed)
    groups = [(8, 4, None), (4, 4, 12)]  # (manager block, kernel block, sliding window)
    mgr = KVCacheManager(
        [AllocatorGroupSpec(bs, 60, sliding_window=w) for bs, _, w in groups], MAX_REQS
    )
    table = MultiGroupBlockTable(
        [GroupSpec(bs, kbs, num_blocks=60) for bs, kbs, _ in groups], MAX_REQS, 256, 64
    )
    prefixes = [rng.integers(0, 50, 16).tolist() for _ in range(2)]
    live: dict[int, list[int]] = {}  # request -> its tokens (prompt + generated)
    next_id, checked = 0, 0
    for _step in range(120):
        # arrivals: half reuse a shared 16-token prefix (two full blocks of both groups)
        while len(live) < MAX_REQS and rng.random() < 0.5:
            prompt = prefixes[int(rng.integers(0, 2))] + rng.integers(0, 50, int(rng.integers(1, 20))).tolist()
            if rng.random() < 0.5:
                prompt = rng.integers(0, 50, int(rng.integers(1, 30))).tolist()
            mgr.add_request(next_id, prompt)
            live[next_id] = prompt
            next_id += 1
        # schedule: each live request computes a chunk of its not-yet-computed tokens
        batch = []
        for req in list(live):
            todo = len(live[req]) - mgr.num_computed_tokens(req)
            n = min(todo, int(rng.integers(1, 9)))
            if n and mgr.can_allocate(req, n):
                mgr.allocate(req, n)
                batch.append((req, n))
        table.apply(mgr.take_step_update())
        table.commit()
        if batch:
            starts = [mgr.num_computed_tokens(r) for r, _ in batch]
            qsl = np.concatenate([[0], np.cumsum([n for _, n in batch])]).astype(np.int32)
            pos = np.concatenate([np.arange(s, s + n) for s, (_, n) in zip(starts, batch)])
            rows = torch.tensor([mgr.row_of(r) for r, _ in batch], dtype=torch.int32)
            slots = table.compute_slot_mapping(torch.from_numpy(qsl), torch.from_numpy(pos),
                                               row_of_batch=rows)
            for g, (_bs, kbs, _w) in enumerate(groups):
                k = groups[g][0] // kbs
                written = slots[g][: len(pos)].numpy()
                assert (written >= 0).all(), "a token being computed got no slot"
                assert len(np.unique(written)) == len(written), "two tokens share a slot"
                for i, (req, _n) in enumerate(batch):
                    owned = set(mgr.block_ids(req)[g])
                    for slot in written[qsl[i] : qsl[i + 1]]:
                        block = int(slot) // kbs // k  # manager block of this kernel slot
                        assert block in owned, f"request {req} writes block {block} it does not own"
                        assert mgr.pools[g].ref_count(block) == 1, "a shared block is written"
                        checked += 1
            for req, n in batch:
                mgr.mark_computed(req, n)
        # generation, finishes and preemptions
        for req in list(live):
            if mgr.num_computed_tokens(req) == len(live[req]):
                if rng.random() < 0.25:
                    mgr.free(req)
                    del live[req]
                else:
                    token = int(rng.integers(0, 50))
                    live[req].append(token)
                    mgr.append_token_ids(req, [token])
            elif rng.random() < 0.05:
                mgr.preempt(req)
                mgr.add_request(req, live[req])  # resume at once, through the prefix cache
        table.apply(mgr.take_step_update())
        mgr.check_integrity()
        table.check_integrity()
        for req in live:  # the table holds exactly the allocator's blocks, as kernel blocks
            for g, (bs, kbs, _w) in enumerate(groups):
                k = bs // kbs
                want = [0 if b == 0 else b * k + q for b in mgr.block_ids(req)[g] for q in range(k)]
                assert table[g].row(mgr.row_of(req)).tolist() == want
    assert checked > 300
