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
from collections.abc import Sequence

import numpy as np

from blocktable._fastnp import count_nonzero
from blocktable.allocator.pool import BlockPool
from blocktable.block_hashing import ChainPowers, token_chain_keys

_U64 = np.uint64


class PromptPlan:
    """One prompt's tokens, keys and cache hit, found without side effects.

    A plain class with slots (a dataclass with default factories costs more per prompt).
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
        # per group, once found (read only: plans without a hit share these lists); the
        # empty tuples until then are shared too
        self.hit_slots: Sequence[np.ndarray] = ()  # record slots
        self.num_skipped: Sequence[int] = ()  # null entries first
        self.last_slots: Sequence[int] = ()  # record of block n/bs-1


def prompt_keys(plans: Sequence[PromptPlan], powers: dict[int, ChainPowers]) -> None:
    """Fill ``plan.keys``/``plan.states`` for every block size of ``powers`` (one entry per
    distinct block size of the groups), one pass per size (the plans' token ids concatenated
    once and keyed in one call; each plan's keys and states are views of that pass's arrays)."""
    seeds = np.array([p.seed for p in plans], dtype=_U64)
    for bs, bs_powers in powers.items():
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
        keys, states = token_chain_keys(
            blocks.reshape(-1, bs), np.array(counts, dtype=np.int64), seeds, bs_powers
        )
        if len(plans) == 1:  # (its keys are the whole pass)
            plans[0].keys[bs], plans[0].states[bs] = keys, states
            continue
        for plan, start, count in zip(plans, starts, counts):
            stop = start + count
            plan.keys[bs] = keys[start:stop]
            plan.states[bs] = states[start:stop]


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


def find_hits(
    plans: Sequence[PromptPlan],
    pools: Sequence[BlockPool],
    block_sizes: Sequence[int],
    windows: Sequence[int | None],
    align_tokens: int,
) -> None:
    """Fill every plan's hit (``num_cached_tokens``, per-group slots); changes no pool.

    Per group, each prompt's blocks worth looking up are bounded first (by the hit the
    groups before allow, and by the first key not filed: keys ``0, 16, 64, 256, ...`` are
    probed one by one, so a prompt reads at most about four times its hit's keys), then the
    bounded blocks of all prompts are looked up and verified in one pass. A block verifies
    when its record exists, holds the prompt's tokens and its parent is the content id found
    for the block before (the namespace's root for block 0); a full-attention group serves up
    to its first block that does not verify or is not alive (cached), a sliding-window group
    up to its first block that does not verify, and then only where the blocks its window
    reads are alive.
    """
    num_groups = len(pools)
    has_window = any(w is not None for w in windows)
    caps = [len(p.tokens) - 1 for p in plans]  # the longest hit still possible, in tokens
    found: list[tuple[dict[int, int], np.ndarray, np.ndarray]] = []  # starts, slots, alive
    for pool, bs, window in zip(pools, block_sizes, windows):
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
        bounds = [*starts.values(), end]
        if len(live) == 1:
            keys = plans[live[0]].keys[bs][:end]
            tokens = plans[live[0]].tokens[: end * bs]
            token_bytes = leader_tokens.get(live[0])  # (read already when it has followers)
        else:
            token_bytes = None
            parts = list(zip(live, bounds, bounds[1:]))
            keys = np.concatenate([plans[i].keys[bs][: stop - start] for i, start, stop in parts])
            tokens = np.concatenate(
                [plans[i].tokens[: (stop - start) * bs] for i, start, stop in parts]
            )
        slots = index.find(keys)  # (-1 where absent: reads the last record, bad anyway)
        parents = index.parent[slots]
        bad = np.empty(end, dtype=bool)
        np.not_equal(parents[1:], index.cid[slots[:-1]], out=bad[1:])
        for i, start in starts.items():
            bad[start] = parents.item(start) != plans[i].root
        alive = index.findable(slots)  # (on the device, or on the host)
        # (take: numpy's row-wise fancy indexing costs three times as much)
        stored = index.tokens.take(slots, axis=0)
        # Counts first: in the common case (every block verifies) no flags are merged; equal
        # bytes are told by one compare. (0-d operands: cheaper than Python ints in ufuncs.)
        if (
            count_nonzero(bad)
            or (window is None and count_nonzero(alive) < end)
            or count_nonzero(slots < _ZERO)
            or stored.tobytes() != (tokens.tobytes() if token_bytes is None else token_bytes)
        ):
            bad |= slots < _ZERO
            if window is None:
                bad |= alive == _ZERO32
            bad |= _rows_differ(stored, tokens.reshape(-1, bs))
            at = bad.nonzero()[0].tolist()
            for i, start, stop in zip(live, bounds, bounds[1:]):
                j = bisect_left(at, start)
                if j < len(at) and at[j] < stop:
                    caps[i] = min(caps[i], (at[j] - start) * bs)
        for i, leader in followers.items():  # (same blocks looked up: the same cap)
            caps[i] = caps[leader]
            starts[i] = starts[leader]
        found.append((starts, slots, alive))
    # the lists of a prompt without a hit, shared by all such prompts (read only)
    no_slots, zeros, no_last = [_NO_SLOTS] * num_groups, [0] * num_groups, [-1] * num_groups
    # a hit is where it starts in every group's slots, and its length
    hits: dict[tuple[object, int], tuple[list[np.ndarray], list[int], list[int]]] = {}
    for i, plan in enumerate(plans):
        n = caps[i] // align_tokens * align_tokens
        if n and has_window:
            n = _servable(n, i, found, block_sizes, windows, align_tokens)
        plan.num_cached_tokens = n
        if not n:
            plan.hit_slots, plan.num_skipped, plan.last_slots = no_slots, zeros, no_last
            continue
        where = found[0][0][i] if num_groups == 1 else tuple(f[0][i] for f in found)
        found_hit = hits.get((where, n))
        if found_hit is None:  # (plans with one hit share its lists: the admission sees it)
            found_hit = hits[where, n] = ([], [], [])
            for (group_starts, group_slots, _), bs, window in zip(found, block_sizes, windows):
                start = group_starts[i]  # (a hit was looked up in every group)
                seg = group_slots[start : start + n // bs]
                skip = 0 if window is None else max(0, (n - window + 1) // bs)
                found_hit[0].append(seg[skip:])
                found_hit[1].append(skip)
                found_hit[2].append(seg.item(-1))
        plan.hit_slots, plan.num_skipped, plan.last_slots = found_hit


def _servable(
    cap: int,
    i: int,
    found: list[tuple[dict[int, int], np.ndarray, np.ndarray]],
    block_sizes: Sequence[int],
    windows: Sequence[int | None],
    align_tokens: int,
) -> int:
    """The largest multiple of ``align_tokens`` up to ``cap`` at which every sliding-window
    group's window reads only live blocks of prompt ``i`` (its blocks up to ``cap`` verify;
    0 if none)."""
    candidates = align_tokens * np.arange(cap // align_tokens, 0, -1, dtype=np.int64)
    servable = np.ones(len(candidates), dtype=bool)
    for (starts, _, alive), bs, window in zip(found, block_sizes, windows):
        if window is not None:
            start = starts[i]
            dead = alive[start : start + cap // bs] == 0
            dead_before = np.concatenate(([0], np.cumsum(dead)))  # dead blocks before each
            hi = candidates // bs
            lo = np.maximum(0, (candidates - window + 1) // bs)
            servable &= dead_before[hi] == dead_before[lo]
    return int(candidates[servable.argmax()]) if servable.any() else 0


_ZERO, _ZERO32 = np.zeros((), dtype=np.int64), np.zeros((), dtype=np.int32)  # 0-d operands
_NO_SLOTS = np.zeros(0, dtype=np.int64)  # the hit slots of a group serving no block
_NO_SLOTS.flags.writeable = False
