"""What ``benchmarks/vs_vllm.py`` runs on each side and how it checks that both agree.

The allocators: vLLM's ``KVCacheManager`` driven as its scheduler drives it, and blocktable's,
per request or batched; one scheduling step on either; the checks (any disagreement raises
:class:`CheckFailed`, and the benchmark exits non-zero); the slot formula both sides are held
to; the statistics of a row of results.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from allocator_workload import StepEvents

from blocktable.allocator import AllocatorGroupSpec, KVCacheManager

PHASES = ("free", "append", "admit", "allocate", "step_output", "mark_computed")


class CheckFailed(Exception):
    """Both sides disagree: the run is invalid."""


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


# ---------------------------------------------------------------------------------- sides
class VllmAllocator:
    """vLLM's KVCacheManager driven as its scheduler drives it, one call per request."""

    name = "vllm"

    def __init__(self, v: types.SimpleNamespace, block_size: int, num_blocks: int,
                 max_model_len: int) -> None:
        ki = v.kv_cache_interface
        spec = ki.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64,
                                    dtype=torch.float16)
        config = ki.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[ki.KVCacheGroupSpec(["layer.0"], spec)])
        self.mgr = v.kv_cache_manager.KVCacheManager(
            config, max_model_len=max_model_len, scheduler_block_size=block_size,
            hash_block_size=block_size)
        hash_fn = v.hashing.get_hash_fn_by_name("sha256")  # vLLM's default algorithm
        v.kv_cache_utils.init_none_hash(hash_fn)
        self.hasher = v.kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
        self.request_cls = v.request.Request
        # what the engine's sampling parameters carry that the allocator path reads
        self.params = types.SimpleNamespace(max_tokens=1 << 40, extra_args=None,
                                            skip_reading_prefix_cache=None,
                                            structured_outputs=None)
        self.block_size = block_size
        self.requests: dict[int, Any] = {}
        self.pending: dict[int, tuple[Any, int]] = {}  # admitted: (cached blocks, hit tokens)
        self.hits: dict[int, int] = {}  # allocated this step after admission: hit tokens

    def free(self, req_ids: list[int]) -> None:
        for req_id in req_ids:
            self.mgr.free(self.requests.pop(req_id))

    def append(self, req_ids: list[int], tokens: list[list[int]]) -> None:
        for req_id, toks in zip(req_ids, tokens):
            self.requests[req_id].append_output_token_ids(toks)

    def admit(self, req_ids: list[int], prompts: list[list[int]]) -> list[int]:
        hits = []
        for req_id, prompt in zip(req_ids, prompts):
            req = self.request_cls(str(req_id), prompt, self.params, None,
                                   block_hasher=self.hasher)
            blocks, num_hit, _ = self.mgr.get_computed_blocks(req)
            self.requests[req_id] = req
            self.pending[req_id] = (blocks, num_hit)
            hits.append(num_hit)
        return hits

    def allocate(self, req_ids: list[int], num_new: list[int]) -> Any:
        out = []
        for req_id, n in zip(req_ids, num_new):
            req = self.requests[req_id]
            blocks, num_hit = self.pending.pop(req_id, (None, 0))
            if blocks is not None:
                self.hits[req_id] = num_hit
            new = self.mgr.allocate_slots(req, n, num_hit, blocks)
            if new is None:
                raise CheckFailed(f"vLLM: no blocks for request {req_id}")
            out.append((req_id, new))
        return out

    def step_output(self, allocated: Any) -> Any:
        # the scheduler's output: every scheduled request's block ids
        return [blocks.get_block_ids() for _, blocks in allocated]

    def mark_computed(self, req_ids: list[int], num_new: list[int]) -> None:
        pass  # vLLM cached the blocks inside allocate_slots

    def after_step(self, req_ids: list[int], num_new: list[int]) -> None:
        # the scheduler's bookkeeping, not timed: an admitted request starts at its hits
        for req_id, n in zip(req_ids, num_new):
            req = self.requests[req_id]
            req.num_computed_tokens = self.hits.pop(req_id, req.num_computed_tokens) + n

    def block_ids(self, req_id: int) -> list[int]:
        return list(self.mgr.get_block_ids(str(req_id))[0])

    def num_free_blocks(self) -> int:
        return self.mgr.block_pool.get_num_free_blocks()


class BlocktableAllocator:
    """blocktable's KVCacheManager, per-request calls or batched calls."""

    def __init__(self, batched: bool, hash_fn: str, block_size: int, num_blocks: int,
                 max_num_reqs: int) -> None:
        self.batched = batched
        self.name = "batched" if batched else "per-request"
        # vLLM counts the null block in num_blocks; blocktable too (block 0 is never handed out)
        self.mgr = KVCacheManager([AllocatorGroupSpec(block_size, num_blocks)], max_num_reqs,
                                  hash_fn=hash_fn)
        self.update: Any = None

    def free(self, req_ids: list[int]) -> None:
        if self.batched:
            self.mgr.free_many(req_ids)
        else:
            for req_id in req_ids:
                self.mgr.free(req_id)

    def append(self, req_ids: list[int], tokens: list[list[int]]) -> None:
        if self.batched:
            self.mgr.append_token_ids_many(req_ids, tokens)
        else:
            for req_id, toks in zip(req_ids, tokens):
                self.mgr.append_token_ids(req_id, toks)

    def admit(self, req_ids: list[int], prompts: list[list[int]]) -> list[int]:
        if self.batched:
            return self.mgr.add_requests(req_ids, prompts)
        return [self.mgr.add_request(r, p) for r, p in zip(req_ids, prompts)]

    def allocate(self, req_ids: list[int], num_new: list[int]) -> Any:
        if self.batched:
            self.mgr.allocate_many(req_ids, num_new)
        else:
            for req_id, n in zip(req_ids, num_new):
                self.mgr.allocate(req_id, n)
        return None

    def step_output(self, allocated: Any) -> Any:
        self.update = self.mgr.take_step_update()
        return self.update

    def mark_computed(self, req_ids: list[int], num_new: list[int]) -> None:
        if self.batched:
            self.mgr.mark_computed_many(req_ids, num_new)
        else:
            for req_id, n in zip(req_ids, num_new):
                self.mgr.mark_computed(req_id, n)
            # per-request marks are recorded and applied by the next call: make that call
            # here, so that their work counts in this phase (and in the 1M-token prompt row)
            self.mgr.num_free_blocks()

    def after_step(self, req_ids: list[int], num_new: list[int]) -> None:
        pass

    def block_ids(self, req_id: int) -> list[int]:
        return list(self.mgr.block_ids(req_id)[0])

    def num_free_blocks(self) -> int:
        return self.mgr.num_free_blocks()


def run_allocator_step(side: Any, events: StepEvents, prompts: list[Any],
                       sampled: list[list[int]], block_size: int, clock: Callable[[], int],
                       ) -> tuple[dict[str, float], list[int], list[int], list[int]]:
    """One scheduling step on one side; phase times in ms, hits, scheduled ids and counts."""
    t = [clock()]
    side.free(events.finished)
    t.append(clock())
    side.append(events.decoding, sampled)
    t.append(clock())
    hits = side.admit(events.new_ids, prompts)
    t.append(clock())
    scheduled = events.new_ids + events.decoding
    num_new = [len(p) - h for p, h in zip(prompts, hits)] + [block_size] * len(events.decoding)
    allocated = side.allocate(scheduled, num_new)
    t.append(clock())
    side.step_output(allocated)
    t.append(clock())
    side.mark_computed(scheduled, num_new)
    t.append(clock())
    side.after_step(scheduled, num_new)
    return {p: (t[i + 1] - t[i]) / 1e6 for i, p in enumerate(PHASES)}, hits, scheduled, num_new


def check_sides(sides: list[Any], req_ids: list[int], what: str) -> None:
    ref = sides[0]
    free = ref.num_free_blocks()
    for side in sides[1:]:
        check(side.num_free_blocks() == free,
              f"{what}: free blocks {ref.name} {free} != {side.name} {side.num_free_blocks()}")
        for req_id in req_ids:
            a, b = ref.block_ids(req_id), side.block_ids(req_id)
            check(a == b, f"{what}: request {req_id}: {ref.name} blocks {a[:8]}... != "
                          f"{side.name} {b[:8]}... (lengths {len(a)}, {len(b)})")


def slot_reference(table_rows: np.ndarray, rows: np.ndarray, qsl: np.ndarray,
                   positions: np.ndarray, block_size: int) -> np.ndarray:
    """slot = block id of the position's block * block_size + offset in the block."""
    req_of_token = np.repeat(np.arange(len(rows)), np.diff(qsl))
    row = rows[req_of_token]
    return table_rows[row, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size)


# ---------------------------------------------------------------------------------- rows
def stats(values: list[float]) -> dict[str, Any]:
    a = np.asarray(values)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "n": int(a.size),
            "values": [round(float(x), 5) for x in a]}


def result_row(name: str, unit: str, ours: list[float], theirs: list[float] | None,
        **extra: Any) -> dict[str, Any]:
    b = stats(ours)
    t = stats(theirs) if theirs else None
    return {"name": name, "unit": unit, "blocktable": b, "vllm": t,
            "ratio": t["median"] / b["median"] if t else None, **extra}
