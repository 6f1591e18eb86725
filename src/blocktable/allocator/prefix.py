"""Prefix caching for a batch of prompts: their block keys in one pass, and their cache hits.

A prompt's hit is a *resume point* ``n``: the tokens before it need no compute. ``n`` is a
multiple of every group's block size (their lcm), leaves at least one token to compute, and
every group must be able to serve it:

* a full-attention group serves ``n`` when blocks ``0 .. n/bs - 1`` are cached (alive);
* a sliding-window group (window ``w``) serves ``n`` when the blocks the token at ``n`` attends
  to, ``skip(n) .. n/bs - 1`` with ``skip(n) = max(0, (n - w + 1) // bs)``, are cached, and the
  records of the blocks before them still verify (their content may have been evicted: those
  entries become the null block). Servable points of such a group are not prefix-closed: a
  longer ``n`` may be served when a shorter one is not.

The request's hit is the largest ``n`` that every group serves, so a sliding-window group never
caps a full-attention group's hit below what both can serve.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from blocktable.allocator.hashing import ChainPowers, block_content_hashes, chain_keys
from blocktable.allocator.pool import BlockPool

_U64 = np.uint64


class PromptPlan:
    """One prompt's tokens, keys and cache hit, found without side effects.

    A plain class with slots (a dataclass with default factories costs ~1 us per prompt).
    """

    __slots__ = (
        "hit_slots",
        "keys",
        "last_slots",
        "namespace_bytes",
        "num_cached_tokens",
        "num_skipped",
        "root",
        "seed",
        "states",
        "tokens",
    )

    def __init__(
        self,
        tokens: np.ndarray,
        root: int,
        seed: int,
        namespace_bytes: bytes = b"",
    ) -> None:
        self.tokens = tokens  # int64 [num_tokens]
        self.root = root  # parent content id of block 0
        self.seed = seed  # K_{-1} of the key chain
        self.namespace_bytes = namespace_bytes  # the namespace's encoding
        self.keys: dict[int, np.ndarray] = {}  # block size -> uint64 [full blocks]
        self.states: dict[int, np.ndarray] = {}  # block size -> uint64 [full blocks]
        self.num_cached_tokens = 0
        # per group, once found (read only: plans without a hit share these lists)
        self.hit_slots: list[np.ndarray] = []  # record slots
        self.num_skipped: list[int] = []  # null entries first
        self.last_slots: list[int] = []  # record of block n/bs-1


def prompt_keys(
    plans: Sequence[PromptPlan], block_sizes: Sequence[int], powers: dict[int, ChainPowers]
) -> None:
    """Fill ``plan.keys``/``plan.states`` for every distinct block size, one pass per size
    (the plans' token ids concatenated once, hashed with one product and chained in one scan;
    each plan's keys and states are views of that pass's arrays)."""
    seeds = np.array([p.seed for p in plans], dtype=_U64)
    for bs in sorted(set(block_sizes)):
        counts, starts, parts, end = [], [], [], 0
        for p in plans:
            starts.append(end)
            tokens = p.tokens
            num_tokens = len(tokens)
            count = num_tokens // bs
            counts.append(count)
            end += count
            # (the full blocks: a whole prompt of full blocks is not sliced)
            parts.append(tokens if count * bs == num_tokens else tokens[: count * bs])
        blocks = parts[0] if len(parts) == 1 else np.concatenate(parts)
        hashes = block_content_hashes(blocks.reshape(-1, bs), powers[bs])
        segments = np.array((counts, starts), dtype=np.int64)  # one conversion for both
        keys, states = chain_keys(hashes, segments[0], seeds, powers[bs], segments[1])
        for plan, start, count in zip(plans, starts, counts):
            stop = start + count
            plan.keys[bs] = keys[start:stop]
            plan.states[bs] = states[start:stop]


def _segment_first(fail: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per segment (``lengths`` and ``starts`` into ``fail``, int64), the local index of its
    first True, else its length."""
    at = np.flatnonzero(fail)
    if not len(at):
        return lengths
    # the first True at or after each start (clamped: past the last True it is before it)
    first = at[np.minimum(np.searchsorted(at, starts), len(at) - 1)] - starts
    return np.where(first < 0, lengths, np.minimum(first, lengths))


def _rows_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row of two int64 ``[n, bs]`` arrays, whether they differ (bool ``[n]``); for 8 or
    16 columns the rows of flags are read as uint64 words (a reduction along short rows costs
    more than the comparison)."""
    differ = a != b
    if differ.shape[1] == 8:
        return differ.view(np.uint64)[:, 0] != 0
    if differ.shape[1] == 16:
        words = differ.view(np.uint64)
        return (words[:, 0] | words[:, 1]) != 0
    return differ.any(axis=1)


def _key_bound(keys: np.ndarray, num_blocks: int, get_one: Callable[[int], int]) -> int:
    """Blocks of a prompt worth looking up: ``num_blocks``, or fewer when a key is not filed.

    A block can be served (or verified) only when its key is filed, so the first absent key
    found bounds the prompt's hit. Keys ``0, 16, 64, 256, ...`` are probed one by one (a
    scalar probe costs less than a numpy call), so the batched lookup reads at most about
    four times the hit's keys (or 16) instead of the whole prompt's: a batched lookup of a few
    hundred keys costs about what one of a few dozen does, a probe more than a key looked up.
    """
    probe = 0
    while probe < num_blocks:
        if get_one(keys.item(probe)) < 0:
            return probe
        probe = 4 * probe if probe else 16
    return num_blocks


def find_hits(
    plans: Sequence[PromptPlan],
    pools: Sequence[BlockPool],
    block_sizes: Sequence[int],
    windows: Sequence[int | None],
    align_tokens: int,
) -> None:
    """Fill every plan's hit (``num_cached_tokens``, per-group slots); changes no pool."""
    limits = [len(p.tokens) - 1 for p in plans]  # at least one token to compute
    if windows.count(None) == len(windows):  # no sliding window
        _find_full_hits(plans, pools, block_sizes, limits, align_tokens)
        return
    per_group = []
    for pool, bs in zip(pools, block_sizes):
        usable = np.array(
            [
                _key_bound(p.keys[bs], lim // bs, pool.index.find_one)
                for p, lim in zip(plans, limits)
            ],
            dtype=np.int64,
        )
        keys = np.concatenate([p.keys[bs][:u] for p, u in zip(plans, usable.tolist())])
        slots = pool.index.find(keys)
        tokens = np.concatenate(
            [p.tokens[: u * bs] for p, u in zip(plans, usable.tolist())]
        ).reshape(-1, bs)
        index = pool.index
        safe = np.maximum(slots, 0)
        cids = index.cid[safe]
        starts = np.cumsum(usable) - usable
        expected_parent = np.empty_like(cids)
        expected_parent[1:] = cids[:-1]
        nonempty = usable > 0
        expected_parent[starts[nonempty]] = [p.root for p, ne in zip(plans, nonempty) if ne]
        ok = (slots >= 0) & (index.parent[safe] == expected_parent)
        ok &= ~_rows_differ(index.tokens.take(safe, axis=0), tokens)
        alive = index.holder[safe] != 0
        verified = _segment_first(~ok, usable, starts)
        cached = _segment_first(~(ok & alive), usable, starts)
        per_group.append((slots, starts, verified, cached, alive))
    for i, plan in enumerate(plans):
        cap = limits[i]
        for (_, _, _, cached, _), bs, window in zip(per_group, block_sizes, windows):
            if window is None:
                cap = min(cap, int(cached[i]) * bs)
        best = cap // align_tokens
        candidates = align_tokens * np.arange(best, -1, -1, dtype=np.int64)
        servable = np.ones(len(candidates), dtype=bool)
        for (slots, starts, verified, _, alive), bs, window in zip(per_group, block_sizes, windows):
            if window is None:
                continue
            v = int(verified[i])
            seg_alive = alive[starts[i] : starts[i] + v]
            dead_before = np.concatenate(([0], np.cumsum(~seg_alive)))
            hi = candidates // bs
            lo = np.maximum(0, (candidates - window + 1) // bs)
            inside = hi <= v
            hi_c, lo_c = np.minimum(hi, v), np.minimum(lo, v)
            servable &= inside & (dead_before[hi_c] == dead_before[lo_c])
        n = int(candidates[np.argmax(servable)]) if servable.any() else 0
        _take_hit(plan, n, per_group, i, block_sizes, windows)


_ZERO, _ZERO32 = np.zeros((), dtype=np.int64), np.zeros((), dtype=np.int32)  # 0-d operands
_NO_SLOTS = np.zeros(0, dtype=np.int64)  # the hit slots of a group serving no block
_NO_SLOTS.flags.writeable = False


def _find_full_hits(
    plans: Sequence[PromptPlan],
    pools: Sequence[BlockPool],
    block_sizes: Sequence[int],
    limits: list[int],
    align_tokens: int,
) -> None:
    """:func:`find_hits` without sliding windows: the hit is the longest prefix of cached
    blocks every group serves. Per group, each prompt's blocks worth looking up are bounded
    first (:func:`_key_bound`, and by the hit the groups before allow), then the bounded
    blocks of all prompts are looked up and verified in one pass (few array operations: each
    costs more than its work here)."""
    num_groups = len(pools)
    caps = list(limits)  # per prompt: the longest hit still possible, in tokens
    found: list[tuple[dict[int, int], np.ndarray]] = []  # per group: starts, slots
    for pool, bs in zip(pools, block_sizes):
        index = pool.index
        get_one = index.find_one
        probed: dict[int, int] = {}  # key -> slot: prompts sharing a prefix probe it once
        starts: dict[int, int] = {}  # prompt -> where its blocks start in `slots`
        end = 0  # the looked-up blocks of all prompts
        # A prompt whose looked-up blocks hold the same token ids (and namespace) as an
        # earlier prompt's follows it: its keys, slots and verification are the leader's, so
        # it is not looked up or verified again (a shared system prompt is looked up once).
        leaders: dict[tuple[int, int, int], int] = {}  # (blocks, last key, root) -> prompt
        leader_tokens: dict[int, bytes] = {}  # leader -> its looked-up token ids, once read
        followers: dict[int, int] = {}  # prompt -> its leader
        for i, plan in enumerate(plans):
            num_blocks = caps[i] // bs
            # (_key_bound, inline: a call per prompt costs as much as a probe)
            keys = plan.keys[bs]
            probe = 0
            while probe < num_blocks:
                key = keys.item(probe)
                slot = probed.get(key)
                if slot is None:
                    slot = probed[key] = get_one(key)
                if slot < 0:
                    break
                probe = 4 * probe if probe else 16
            usable = min(probe, num_blocks)
            caps[i] = usable * bs
            if usable:
                signature = (usable, keys.item(usable - 1), plan.root)
                leader = leaders.get(signature)
                if leader is not None:  # (bytes compare: cheapest here; the leader's read once)
                    same = leader_tokens.get(leader)
                    if same is None:
                        same = leader_tokens[leader] = plans[leader].tokens[: usable * bs].tobytes()
                    if plan.tokens[: usable * bs].tobytes() == same:
                        followers[i] = leader
                        continue
                leaders[signature] = i
                starts[i] = end
                end += usable
        if not starts:
            break  # no prompt can hit
        live = list(starts)
        if len(live) == 1:
            plan = plans[live[0]]
            keys = plan.keys[bs][:end]
            tokens = plan.tokens[: end * bs]
            token_bytes = leader_tokens.get(live[0])  # (read already when it has followers)
        else:
            token_bytes = None
            bounds = [*starts.values(), end]
            keys = np.concatenate(
                [
                    plans[i].keys[bs][: stop - start]
                    for i, start, stop in zip(live, bounds, bounds[1:])
                ]
            )
            tokens = np.concatenate(
                [
                    plans[i].tokens[: (stop - start) * bs]
                    for i, start, stop in zip(live, bounds, bounds[1:])
                ]
            )
        slots = index.find(keys)  # (-1 where absent: reads the last record, bad anyway)
        # block j verifies when its record exists, is alive, holds the prompt's tokens and
        # its parent is the content id found for block j - 1 (the namespace's root for 0)
        parents = index.parent[slots]
        bad = np.empty(end, dtype=bool)
        np.not_equal(parents[1:], index.cid[slots[:-1]], out=bad[1:])
        for i, start in starts.items():
            bad[start] = parents.item(start) != plans[i].root
        alive = index.holder[slots]
        # (take: numpy's row-wise fancy indexing costs three times as much)
        stored = index.tokens.take(slots, axis=0)
        # Counts first: in the common case (every block verifies) no flags are merged; equal
        # bytes are told by one compare. (0-d operands: cheaper than Python ints in ufuncs.)
        if (
            np.count_nonzero(bad)
            or np.count_nonzero(alive) < end
            or np.count_nonzero(slots < _ZERO)
            or stored.tobytes() != (tokens.tobytes() if token_bytes is None else token_bytes)
        ):
            bad |= slots < _ZERO
            bad |= alive == _ZERO32
            bad |= _rows_differ(stored, tokens.reshape(-1, bs))
            at = bad.nonzero()[0].tolist()
            bounds = [*starts.values(), end]
            for i, start, stop in zip(live, bounds, bounds[1:]):
                j = bisect_left(at, start)
                if j < len(at) and at[j] < stop:
                    caps[i] = min(caps[i], (at[j] - start) * bs)
        for i, leader in followers.items():  # (same blocks looked up: the same cap)
            caps[i] = caps[leader]
            starts[i] = starts[leader]
        found.append((starts, slots))
    # the lists of a prompt without a hit, shared by all such prompts (read only)
    no_slots, zeros, no_last = [_NO_SLOTS] * num_groups, [0] * num_groups, [-1] * num_groups
    # a hit is where it starts in every group's slots, and its length
    hits: dict[tuple[object, int], tuple[list[np.ndarray], list[int]]] = {}
    for i, plan in enumerate(plans):
        n = caps[i] // align_tokens * align_tokens
        plan.num_cached_tokens = n
        plan.num_skipped = zeros
        if not n:
            plan.hit_slots, plan.last_slots = no_slots, no_last
            continue
        where = (
            found[0][0][i]
            if num_groups == 1
            else tuple(group_starts[i] for group_starts, _ in found)  # (looked up in each)
        )
        found_hit = hits.get((where, n))
        if found_hit is None:  # (plans with one hit share its lists: the admission sees it)
            hit_slots, last_slots = [], []
            for (group_starts, group_slots), bs in zip(found, block_sizes):
                start = group_starts[i]  # (a hit was looked up in every group)
                seg = group_slots[start : start + n // bs]
                hit_slots.append(seg)
                last_slots.append(seg.item(-1))
            found_hit = hits[where, n] = (hit_slots, last_slots)
        plan.hit_slots, plan.last_slots = found_hit


def _take_hit(
    plan: PromptPlan,
    n: int,
    per_group: Sequence[tuple[Any, ...]],
    i: int,
    block_sizes: Sequence[int],
    windows: Sequence[int | None],
) -> None:
    plan.num_cached_tokens = n
    plan.hit_slots, plan.num_skipped, plan.last_slots = [], [], []
    for (slots, starts, _, _, _), bs, window in zip(per_group, block_sizes, windows):
        hi = n // bs
        lo = 0 if window is None else max(0, (n - window + 1) // bs)
        seg = slots[int(starts[i]) : int(starts[i]) + hi]
        plan.hit_slots.append(seg[lo:])
        plan.num_skipped.append(lo)
        plan.last_slots.append(int(seg[-1]) if hi else -1)
