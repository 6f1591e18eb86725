"""The decode schedule follows the shape rule of
:func:`blocktable.attention.kernel_config.decode_schedule` (no device value read), a caller's
configuration keeps its stages, and the public call under the chosen schedule (combine
kernel, block ids per block) matches the float64 reference. CPU only (the interpreter for the
call).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_attention_triton import TOLERANCE, make_case, reference, rel_err

from blocktable.attention import decode_plan as decode_plan_mod
from blocktable.attention import paged_decode_attention, triton_decode
from blocktable.attention.cp_layout import CPLayout
from blocktable.attention.decode_plan import DecodePlan, DecodeWorkspace, tensor_strides
from blocktable.attention.kernel_config import (
    DECODE_LONG_SPLIT_KEYS,
    FUSED_COMBINE_MAX_PROGRAMS,
    KernelConfig,
    decode_schedule,
    default_config,
)

# default_config(128, 4) off the interpreter: decode tiles of 64 keys, 4 warps, 2 stages
BASE = KernelConfig(128, 64, 8, 3, 64, 4, 2)
H200_SMS = 132


def expected(splits: int, num_reqs: int, num_kv_heads: int, width: int,
             block_size: int) -> tuple[bool, bool, int]:
    """``(fused, per_block_ids, stages)`` by the rule, written out independently."""
    if splits == 1:
        return False, False, BASE.decode_num_stages
    fused = num_reqs * num_kv_heads <= 16
    pow2 = block_size & (block_size - 1) == 0
    long_splits = width * block_size / splits >= 2048
    per_block = pow2 and 64 % block_size == 0 and not long_splits
    stages = 3 if fused and long_splits else BASE.decode_num_stages
    return fused, per_block, stages


@pytest.mark.parametrize(
    ("num_reqs", "seq_len", "splits", "fused", "ids", "stages"),
    [
        (1, 8192, 32, True, 2, 2),  # fused, ids 2, 256 keys a split: 2 stages
        (1, 131072, 32, True, 0, 3),  # 4096 keys a split: ids 0, 3 stages; 32 splits at most
        (8, 32768, 8, False, 0, 2),  # 64 (request, KV head) pairs: wide combine, 2 stages
        (2, 8192, 16, True, 2, 2),  # 16 splits fill the wave (256 programs): not 32
        (2, 32768, 16, True, 0, 3),  # the same, fused with long splits
        (4, 8192, 8, False, 2, 2),  # 8 splits of 1024 keys fill the wave: not 16
        (4, 32768, 16, False, 0, 2),  # 8 would fill it, but long unfused splits: 16
        (3, 8192, 16, False, 2, 2),  # 8 splits (192 programs) fall short of the wave: 16
        (64, 4096, 1, False, 0, 2),  # unsplit: ids 0, the default's stages
    ],
)
def test_h200_cases_follow_the_rule(monkeypatch, num_reqs: int, seq_len: int, splits: int,
                                    fused: bool, ids: int, stages: int) -> None:
    """The benchmarked shapes (8 KV heads, page 16) with 132 multiprocessors."""
    monkeypatch.setattr(triton_decode, "num_sms", lambda device: H200_SMS)
    width = seq_len // 16
    got_splits = triton_decode.default_num_kv_splits(num_reqs, 8, width, torch.device("cuda"), 16)
    assert got_splits == splits
    schedule = decode_schedule(BASE, got_splits, num_reqs, 8, width, 16)
    assert schedule.fused_combine == fused
    assert (schedule.per_block_ids, schedule.num_stages) == (ids == 2, stages)
    given = decode_schedule(BASE, got_splits, num_reqs, 8, width, 16, choose_stages=False)
    assert given.num_stages == BASE.decode_num_stages  # a given configuration's stages


def expected_splits(num_reqs: int, num_kv_heads: int, width: int, block_size: int) -> int:
    """The split rule written out independently: the power of two nearest above the wanted
    count (two programs per multiprocessor) within [1, 32] and at least 256 keys a split,
    or the one below (at least 2) when it fills 90% of that and is fused or short."""
    programs = num_reqs * num_kv_heads
    wanted = math.ceil(2 * H200_SMS / programs)
    keys = width * block_size
    candidates = [s for s in (1, 2, 4, 8, 16, 32) if s == 1 or keys // s >= 256]
    above = [s for s in candidates if s >= wanted]
    splits = above[0] if above else candidates[-1]
    below = splits // 2
    if (splits >= wanted and below >= 2 and below * programs >= 0.9 * 2 * H200_SMS
            and (programs <= 16 or keys / below < 2048)):
        return below
    return splits


def test_the_rule_over_a_grid_of_shapes(monkeypatch) -> None:
    monkeypatch.setattr(triton_decode, "num_sms", lambda device: H200_SMS)
    assert (FUSED_COMBINE_MAX_PROGRAMS, DECODE_LONG_SPLIT_KEYS) == (16, 2048)
    for num_reqs in (1, 2, 3, 4, 5, 8, 16, 256):
        for num_kv_heads in (1, 2, 4, 8):
            for width in (1, 7, 64, 512, 8192):
                for block_size in (1, 4, 6, 16, 32, 128):
                    splits = triton_decode.default_num_kv_splits(
                        num_reqs, num_kv_heads, width, torch.device("cuda"), block_size)
                    assert splits <= 32 and splits & (splits - 1) == 0
                    assert splits == expected_splits(num_reqs, num_kv_heads, width, block_size)
                    for s in {splits, 1, 4, 32}:
                        c = decode_schedule(BASE, s, num_reqs, num_kv_heads, width, block_size)
                        got = (c.fused_combine, c.per_block_ids, c.num_stages)
                        assert got == expected(s, num_reqs, num_kv_heads, width, block_size)


def _plan(num_reqs: int, config: KernelConfig | None, splits: int) -> DecodePlan:
    args = make_case([(9, 1)] * num_reqs, 4, 2, 2, 16, torch.float32, "cpu")
    query, k_cache, v_cache, table, seq_lens, _ = args
    out = torch.empty_like(query)
    strides = tensor_strides(out, None, query, k_cache, v_cache, table)
    plan = DecodePlan.build(DecodeWorkspace(query.device), out, None, query, k_cache, table,
                            seq_lens, None, None, 0.25, None, CPLayout(), strides,
                            decode_only=True, config=config, num_kv_splits=splits)
    assert plan is not None
    return plan


def test_plans_use_the_rule_only_without_a_configuration(monkeypatch) -> None:
    """2 KV heads: 8 requests fuse the combine, 9 launch the combine kernel, with or without
    a given configuration (which keeps its stages); and the rule's inputs are shapes."""
    seen = []
    real = decode_plan_mod.decode_schedule

    def spy(*args, **kwargs):
        seen.append((*args[1:], kwargs["choose_stages"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_plan_mod, "decode_schedule", spy)
    small, large = _plan(8, None, 4), _plan(9, None, 4)
    assert small.combine_grid is None and small.counters is not None
    assert large.combine_grid == (9, 2, 1) and large.counters is None
    width = 4  # make_case: ceil(9 / 4) blocks + 1
    assert seen == [(4, 8, 2, width, 4, True), (4, 9, 2, width, 4, True)]
    given = dataclasses.replace(default_config(16, 2, 4), decode_block_n=32)
    kept = _plan(9, given, 4)
    assert kept.combine_grid == (9, 2, 1) and kept.counters is None
    assert seen[-1] == (4, 9, 2, width, 4, False)  # a given configuration keeps its stages
    unsplit = _plan(9, None, 1)
    assert unsplit.combine_grid is None and unsplit.counters is None


@pytest.mark.parametrize("num_reqs", [3, 9])
def test_default_choices_match_the_reference(triton_device: str, num_reqs: int) -> None:
    """Split decode under the default configuration: 3 requests x 2 KV heads fuse the
    combine, 9 launch the combine kernel; blocks of 4 keys: ids per block; lengths 1 to 23."""
    reqs = [(1 + 5 * r % 23, 1) for r in range(num_reqs)]
    query, k_cache, v_cache, table, seq_lens, qsl = make_case(
        reqs, 4, 2, 2, 16, torch.float32, triton_device, seed=num_reqs)
    out = paged_decode_attention(query, k_cache, v_cache, table, seq_lens, num_kv_splits=4,
                                 backend="triton")
    ref, _ = reference(query, k_cache, v_cache, table, seq_lens, qsl)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
