"""A context-parallel (DCP) decode side: each rank receives only the chunks it owns, mapped by
the table's own CP slot formula; checked token by token against the slot reference, and
across spawned processes against the prefill side's cache."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from spawn import run_ranks

from blocktable import CPConfig, GroupLayout, KVCacheManager
from blocktable.constants import PAD_SLOT_ID
from blocktable.engine import EngineConfig, LLMEngine, tiny_llama
from blocktable.slot_mapping.reference import slot_of_position
from blocktable.transfer import TorchDistributedTransport
from blocktable.transfer.dcp_transfer import dcp_rank_receive, prefill_to_dcp
from blocktable.transfer.kv_handshake import handshake
from blocktable.transfer.kv_layout import KVCacheLayout
from blocktable.transfer.plan import dcp_chunk_rows_many


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(1, 1), (2, 1), (2, 2), (2, 4), (3, 2), (4, 1)]),
       st.sampled_from([(4, 1), (4, 2), (8, 2), (8, 4)]),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), max_size=4),
       st.integers(0, 2**31 - 1))
@example((2, 2), (4, 2), [(0, 16), (1, 5)], 0)
def test_dcp_chunks_land_where_the_table_puts_each_token(
        world_interleave: tuple[int, int], sizes: tuple[int, int],
        reqs: list[tuple[int, int]], seed: int) -> None:
    """Every token of every request: exactly one rank holds it, at the slot the table's CP
    slot formula (the reference, with kernel blocks of either size) gives that rank."""
    world, interleave = world_interleave
    block_size, kernel_block_size = sizes
    if block_size % interleave:
        return
    chunk = np.gcd(interleave, kernel_block_size)
    virtual = block_size * world
    rng = np.random.default_rng(seed)
    # the hit (first tokens) is whole chunks; the blocks cover exactly first + num tokens
    firsts = [f * chunk * 3 for f, _ in reqs]
    nums = [n for _, n in reqs]
    ids_per_req = [rng.permutation(np.arange(1, 60))[: -(-(f + n) // virtual)]
                   for f, n in zip(firsts, nums)]
    counts = np.array([ids.size for ids in ids_per_req], dtype=np.int64)
    starts = np.cumsum(counts) - counts
    flat = np.concatenate(ids_per_req) if reqs else np.zeros(0, np.int64)
    owners, rows, row_starts = dcp_chunk_rows_many(
        flat, starts, counts, block_size, world, interleave, chunk, np.array(firsts, np.int64),
        np.array(nums, np.int64))
    assert owners.size == rows.size == row_starts[-1]
    per_manager = block_size // kernel_block_size
    for i, (ids, first, num) in enumerate(zip(ids_per_req, firsts, nums)):
        kernel_ids = (ids[:, None] * per_manager + np.arange(per_manager)).ravel()
        for p in range(first, first + num):
            j = row_starts[i] + (p - first) // chunk
            slots = [slot_of_position(p, kernel_ids, kernel_ids.size,
                                      kernel_block_size=kernel_block_size,
                                      manager_block_size=block_size, cp_world_size=world,
                                      cp_rank=r, cp_interleave=interleave)
                     for r in range(world)]
            held = [r for r, s in enumerate(slots) if s != PAD_SLOT_ID]
            assert held == [owners[j]]
            assert rows[j] * chunk + (p - first) % chunk == slots[held[0]]


def test_dcp_chunk_rows_refuse_bad_sizes() -> None:
    one = np.zeros(1, np.int64)
    args: dict[str, Any] = {"block_ids": np.array([3]), "block_starts": one,
                            "block_counts": np.ones(1, np.int64), "first_tokens": one,
                            "num_tokens": np.array([4])}
    with pytest.raises(ValueError, match=r"chunk_tokens \(3\) must divide interleave \(2\)"):
        dcp_chunk_rows_many(block_size=4, world_size=2, interleave=2, chunk_tokens=3, **args)
    with pytest.raises(ValueError, match=r"interleave the block size \(4\)"):
        dcp_chunk_rows_many(block_size=4, world_size=2, interleave=8, chunk_tokens=2, **args)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        dcp_chunk_rows_many(block_size=4, world_size=0, interleave=2, chunk_tokens=2, **args)
    with pytest.raises(ValueError, match="holds 1 blocks of 8 tokens; tokens up to 9 need 2"):
        dcp_chunk_rows_many(block_size=4, world_size=2, interleave=2, chunk_tokens=2,
                            **{**args, "num_tokens": np.array([9])})


# ------------------------------------------------------------------ spawned: 1 prefill + N DCP
PROMPTS = [list(range(3, 16)), list(range(40, 60)), [7, 1, 9, 200, 5, 5, 31]]
PREFILL_BLOCK = 4
DCP_NUM_BLOCKS = 24


def dcp_job(rank: int, world: int, interleave: int, dcp_block_size: int, out_dir: str,
            dying_dcp_rank: int = -1) -> dict[str, Any]:
    """Rank 0 prefills and sends; ranks ``1..world-1`` are DCP ranks ``0..world-2`` (DCP rank
    0 the driver, with the group's allocator). Each saves its cache for the parent.
    ``dying_dcp_rank`` exits right after its handshake; a survivor that raises writes what it
    saw (error, time) and whether its allocator checked out."""
    try:
        return _dcp_side(rank, world, interleave, dcp_block_size, out_dir, dying_dcp_rank)
    except Exception as exc:
        Path(out_dir, f"survivor{rank}.json").write_text(json.dumps({
            "error": f"{type(exc).__name__}: {exc}", "raised_at": time.time()}))
        raise


def _dcp_side(rank: int, world: int, interleave: int, dcp_block_size: int, out_dir: str,
              dying_dcp_rank: int) -> dict[str, Any]:
    num_dcp = world - 1
    model = tiny_llama()
    if rank == 0:
        engine = LLMEngine(model, EngineConfig(block_size=PREFILL_BLOCK, num_blocks=32,
                                               max_num_reqs=4, token_budget=64,
                                               max_model_len=64))
        to_ranks = [TorchDistributedTransport(r, "decode", "cpu", 20.0) for r in range(1, world)]
        try:
            report = prefill_to_dcp(engine, to_ranks, PROMPTS)
        finally:  # on a lost rank too: the blocks must be free
            engine.manager.check_integrity()
            assert engine.manager.num_requests == 0
        torch.save(engine.model.kv_cache, f"{out_dir}/prefill.pt")
        return report
    dcp_rank = rank - 1
    shape = list(model.model.layers[0].self_attn.k_proj.weight.shape)  # [kv_heads * head_dim, _]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    kv = torch.zeros(model.config.num_hidden_layers, 2, DCP_NUM_BLOCKS, dcp_block_size,
                     shape[0] // head_dim, head_dim)
    to_prefill = TorchDistributedTransport(0, "prefill", "cpu", 20.0)
    to_ranks: list[Any] = [None] * num_dcp
    manager = None
    if dcp_rank == 0:
        to_ranks = [None] + [TorchDistributedTransport(r + 1, "decode", "cpu", 20.0)
                             for r in range(1, num_dcp)]
        cp = CPConfig(num_dcp, 0, interleave)
        manager = KVCacheManager([GroupLayout(block_size=dcp_block_size,
                                              num_blocks=DCP_NUM_BLOCKS).allocator_spec(cp)],
                                 max_num_reqs=4)
    else:
        to_ranks[0] = TorchDistributedTransport(1, "decode driver", "cpu", 20.0)
    if dcp_rank == dying_dcp_rank:
        handshake(to_prefill, KVCacheLayout.of_cache(kv, dcp_block_size), "decode", "prefill")
        Path(out_dir, "died_at").write_text(str(time.time()))
        os._exit(17)
    try:
        plan, num_bytes = dcp_rank_receive(dcp_rank, kv, dcp_block_size, to_prefill, to_ranks,
                                           manager, interleave)
    except Exception:
        if manager is not None:  # what the round allocated is freed
            manager.check_integrity()
            assert manager.num_requests == 0
        raise
    if manager is not None:
        manager.check_integrity()
    torch.save(kv, f"{out_dir}/dcp{dcp_rank}.pt")
    return {"block_ids": plan.block_ids.tolist(), "block_starts": plan.block_starts.tolist(),
            "bytes": num_bytes, "chunk_tokens": plan.chunk_tokens}


@pytest.mark.parametrize(("num_dcp", "interleave", "dcp_block_size"), [(2, 2, 4), (3, 1, 2)])
def test_each_dcp_rank_holds_exactly_its_tokens_of_the_prefill(
        tmp_path: Any, num_dcp: int, interleave: int, dcp_block_size: int) -> None:
    """Every prompt token's K and V (every layer) sit on the one DCP rank the table's CP slot
    formula names, at its slot there; each rank received only its own chunks (their bytes sum
    to the whole once); the prefill side freed its blocks only after every rank confirmed."""
    results = run_ranks(dcp_job, 1 + num_dcp, tmp_path,
                        args=(interleave, dcp_block_size, str(tmp_path)), timeout_s=120.0)
    prefill, decode = results[0], results[1:]
    src = torch.load(tmp_path / "prefill.pt")
    caches = [torch.load(tmp_path / f"dcp{r}.pt") for r in range(num_dcp)]
    starts = decode[0]["block_starts"]
    chunk = decode[0]["chunk_tokens"]
    written = [torch.zeros(c.shape[2] * c.shape[3], dtype=torch.bool) for c in caches]
    total_chunks = 0
    for i, prompt in enumerate(PROMPTS):
        ids = np.array(decode[0]["block_ids"][starts[i]:starts[i + 1]])
        assert all(d["block_ids"] == decode[0]["block_ids"] for d in decode)  # same ids
        total_chunks += -(-len(prompt) // chunk)
        for p in range(-(-len(prompt) // chunk) * chunk):  # a last partial chunk moves whole
            slots = [slot_of_position(p, ids, ids.size, kernel_block_size=dcp_block_size,
                                      manager_block_size=dcp_block_size, cp_world_size=num_dcp,
                                      cp_rank=r, cp_interleave=interleave)
                     for r in range(num_dcp)]
            [owner] = [r for r, s in enumerate(slots) if s != PAD_SLOT_ID]
            written[owner][slots[owner]] = True
            if p >= len(prompt):
                continue
            block = prefill["block_ids"][i][p // PREFILL_BLOCK]
            want = src[:, :, block, p % PREFILL_BLOCK]
            slot = slots[owner]
            got = caches[owner][:, :, slot // dcp_block_size, slot % dcp_block_size]
            assert torch.equal(got, want), (i, p, owner)
            assert want.abs().sum() > 0  # a real prefill wrote it
    # no rank holds anything outside the chunks it owns
    for r, cache in enumerate(caches):
        touched = cache.flatten(2, 3).abs().sum(dim=(0, 1, 3, 4)) > 0
        assert not (touched & ~written[r]).any(), r
    # each chunk went to one rank once: the bytes add up to every moved chunk exactly
    row_bytes = src[:, :, 0, :chunk].numel() * src.element_size()
    assert [d["bytes"] for d in decode] == prefill["bytes_per_rank"]
    assert sum(prefill["bytes_per_rank"]) == total_chunks * row_bytes
    assert all(b > 0 for b in prefill["bytes_per_rank"])


def test_a_dcp_rank_that_dies_is_named_within_seconds(tmp_path: Path) -> None:
    """DCP rank 1 dies after its handshake: the driver, sending it the plan, raises naming it
    within seconds and frees its allocation; the prefill side then loses the driver, raises
    naming it and frees its blocks (both allocators are checked in the children). No hang."""
    with pytest.raises(AssertionError) as info:
        run_ranks(dcp_job, 3, tmp_path, args=(2, 4, str(tmp_path), 1), timeout_s=120.0)
    assert "rank 2: died (exit code 17)" in str(info.value)
    died_at = float((tmp_path / "died_at").read_text())
    driver = json.loads((tmp_path / "survivor1.json").read_text())
    assert driver["error"].startswith("PeerLostError: lost the decode side (rank 2)"), driver
    prefill = json.loads((tmp_path / "survivor0.json").read_text())
    assert prefill["error"].startswith("PeerLostError: lost the decode side (rank "), prefill
    assert max(driver["raised_at"], prefill["raised_at"]) - died_at < 5.0
