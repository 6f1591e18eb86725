"""KV write by slot mapping: torch and Triton paths against a numpy loop, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blocktable.constants import PAD_SLOT_ID
from blocktable.kv_write import write_kv_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def write_reference(cache: np.ndarray, values: np.ndarray, slots: np.ndarray) -> None:
    """The definition: token t goes to cache[slot // block_size, slot % block_size]."""
    block_size = cache.shape[1]
    for t, slot in enumerate(slots):
        if slot != PAD_SLOT_ID:
            cache[slot // block_size, slot % block_size] = values[t]


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bit patterns, so NaN payloads and -0.0 compare exactly."""
    int_dtype = {4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.contiguous().view(int_dtype).cpu().numpy()


def random_slots(
    num_tokens: int, num_slots: int, num_pad: int, gen: torch.Generator
) -> torch.Tensor:
    """Unique slots with ``num_pad`` of them replaced by PAD_SLOT_ID at random tokens."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_pad]] = PAD_SLOT_ID
    return slots


def make_case(dtype: torch.dtype, device: str, num_tokens: int = 37, seed: int = 0):
    """Strided inputs on purpose: key/value slice a fused QKV tensor, the caches are views of
    one ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` (HND) tensor."""
    num_blocks, block_size, num_kv_heads, head_dim = 9, 16, 2, 64
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    kv_hnd = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    kv_cache = kv_hnd.to(dtype).transpose(2, 3)  # [2, num_blocks, block_size, heads, head_dim]
    slots = random_slots(num_tokens, num_blocks * block_size, num_pad=5, gen=gen)
    # A persistent buffer longer than the step; its tail holds live-looking slots to ignore.
    slot_mapping = torch.cat([slots, torch.arange(8)])
    return (key.to(device), value.to(device), kv_cache.to(device), slot_mapping.to(device))


def check_against_reference(key, value, kv_cache, slot_mapping, before) -> None:
    expected = before.clone().cpu()
    slots = slot_mapping[: key.shape[0]].cpu().numpy()
    k_ref, v_ref = expected[0].numpy(), expected[1].numpy()
    write_reference(k_ref, key.cpu().numpy(), slots)
    write_reference(v_ref, value.cpu().numpy(), slots)
    np.testing.assert_array_equal(bits(kv_cache), bits(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_path_matches_reference(device: str, dtype: torch.dtype) -> None:
    key, value, kv_cache, slot_mapping = make_case(dtype, device)
    before = kv_cache.clone()
    write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping, backend="torch")
    check_against_reference(
        key.float(), value.float(), kv_cache.float(), slot_mapping, before.float()
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_torch_bit_for_bit(triton_device: str, dtype: torch.dtype) -> None:
    key, value, kv_cache, slot_mapping = make_case(dtype, triton_device, seed=1)
    by_torch = kv_cache.clone()
    write_kv_cache(key, value, by_torch[0], by_torch[1], slot_mapping, backend="torch")
    write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping, backend="triton")
    np.testing.assert_array_equal(bits(kv_cache), bits(by_torch))


def test_triton_matches_reference_contiguous(triton_device: str) -> None:
    num_tokens, num_blocks, block_size, heads, head_dim = 20, 5, 32, 3, 80  # odd sizes: masks
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(num_tokens, heads, head_dim, generator=gen).to(triton_device)
    value = torch.randn(num_tokens, heads, head_dim, generator=gen).to(triton_device)
    k_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen)
    kv_cache = torch.stack([k_cache, v_cache]).to(triton_device)
    slot_mapping = random_slots(num_tokens, num_blocks * block_size, 4, gen).to(triton_device)
    before = kv_cache.clone()
    write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping, backend="triton")
    check_against_reference(key, value, kv_cache, slot_mapping, before)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_of_range_slots_raise_when_checked_and_never_write_outside(
    triton_device: str, backend: str
) -> None:
    key, value, kv_cache, slot_mapping = make_case(torch.float32, triton_device, num_tokens=6)
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    slot_mapping[2] = num_slots  # one past the end
    slot_mapping[4] = -5
    with pytest.raises(IndexError, match=rf"slot_mapping\[2\]={num_slots} is out of range"):
        write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping, check=True)
    # Unchecked: the bad tokens are skipped; kv_cache[1] right after kv_cache[0] stays intact
    # apart from the good tokens' values.
    before = kv_cache.clone()
    write_kv_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping, check=False, backend=backend)
    skipped = slot_mapping.clone()
    skipped[[2, 4]] = PAD_SLOT_ID
    check_against_reference(key, value, kv_cache, skipped, before)


def test_empty_step_and_all_padding(device: str) -> None:
    key, value, kv_cache, slot_mapping = make_case(torch.float16, device, num_tokens=4)
    before = kv_cache.clone()
    write_kv_cache(key[:0], value[:0], kv_cache[0], kv_cache[1], slot_mapping)
    write_kv_cache(key, value, kv_cache[0], kv_cache[1], torch.full_like(slot_mapping, -1))
    assert torch.equal(kv_cache, before)


def test_bad_inputs_name_the_argument() -> None:
    key, value, kv_cache, slot_mapping = make_case(torch.float16, "cpu", num_tokens=4)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    with pytest.raises(TypeError, match="key must have dtype torch.float16"):
        write_kv_cache(key.float(), value, k_cache, v_cache, slot_mapping)
    with pytest.raises(ValueError, match=r"value must have shape \[4, 2, 64\]"):
        write_kv_cache(key, value[:3], k_cache, v_cache, slot_mapping)
    with pytest.raises(ValueError, match=r"key must have shape \[\*, 2, 64\]"):
        write_kv_cache(key[:, :1], value[:, :1], k_cache, v_cache, slot_mapping)
    with pytest.raises(TypeError, match="slot_mapping must have dtype torch.int64"):
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping.int())
    with pytest.raises(ValueError, match="slot_mapping must have at least num_tokens=4"):
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping[:3])
    with pytest.raises(ValueError, match="k_cache must be 4-D"):
        write_kv_cache(key, value, k_cache[0], v_cache, slot_mapping)
    with pytest.raises(ValueError, match="v_cache must have shape"):
        write_kv_cache(key, value, k_cache, v_cache[:2], slot_mapping)
    with pytest.raises(TypeError, match="k_cache must have dtype float32, float16 or bfloat16"):
        write_kv_cache(
            key.double(), value.double(), k_cache.double(), v_cache.double(), slot_mapping
        )
    with pytest.raises(ValueError, match="backend must be one of"):
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping, backend="cuda")
    with pytest.raises(ValueError, match="slot_mapping must be on device meta"):
        meta = [t.to("meta") for t in (key, value, k_cache, v_cache)]
        write_kv_cache(*meta, slot_mapping)


@pytest.mark.parametrize("aligned", [True, False])
def test_triton_any_pointer_alignment(triton_device: str, aligned: bool) -> None:
    """Keys, values and slots at addresses that are not 16-byte aligned take the build that
    assumes nothing; both builds match the reference (and neither serves the other's calls)."""
    key, value, kv_cache, slot_mapping = make_case(torch.float32, triton_device, seed=3)
    shift = 0 if aligned else 1  # one element: 4 or 8 bytes off the allocation's alignment
    flat = torch.zeros(key.numel() + 4, dtype=key.dtype, device=triton_device)
    key_u = flat[shift : shift + key.numel()].view(key.shape)
    key_u.copy_(key)
    slots_buf = torch.zeros(slot_mapping.numel() + 4, dtype=torch.int64, device=triton_device)
    slots_u = slots_buf[shift : shift + slot_mapping.numel()]
    slots_u.copy_(slot_mapping)
    assert (key_u.data_ptr() % 16 == 0) == aligned
    before = kv_cache.clone()
    write_kv_cache(key_u, value, kv_cache[0], kv_cache[1], slots_u, backend="triton")
    check_against_reference(key_u, value, kv_cache, slots_u, before)
