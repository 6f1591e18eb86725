"""KV-cache write: scatter one step's keys and values into the paged cache by slot mapping.

Token ``t`` goes to ``block = slot // block_size``, ``offset = slot % block_size`` of the cache,
where ``slot = slot_mapping[t]``. ``PAD_SLOT_ID`` entries are skipped. This is vLLM's
``reshape_and_cache_flash`` for the ``[num_blocks, block_size, num_kv_heads, head_dim]`` layout.
"""

from __future__ import annotations

import torch

from blocktable._checks import check_tensor
from blocktable._triton import HAS_TRITON, Launcher, next_power_of_2, resolve_backend, tl, triton

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_POINTERS = ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr", "slot_mapping_ptr")

if HAS_TRITON:

    def _write_kv(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        num_slots,
        block_size,
        num_kv_heads,
        head_dim,
        key_stride_t,
        key_stride_h,
        key_stride_d,
        value_stride_t,
        value_stride_h,
        value_stride_d,
        k_cache_stride_b,
        k_cache_stride_s,
        k_cache_stride_h,
        k_cache_stride_d,
        v_cache_stride_b,
        v_cache_stride_s,
        v_cache_stride_h,
        v_cache_stride_d,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per token, copying all of its heads.
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        # PAD_SLOT_ID and any slot outside the cache are masked out: never a write outside it.
        in_cache = (slot >= 0) & (slot < num_slots)
        slot = tl.where(in_cache, slot, 0)
        block = slot // block_size
        offset = slot % block_size

        # A skipped token copies no head. (A bound, not `& in_cache`: tensor & scalar-bool breaks
        # the interpreter.)
        heads_to_copy = tl.where(in_cache, num_kv_heads, 0)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < heads_to_copy) & (d < head_dim)

        k = tl.load(key_ptr + token * key_stride_t + h * key_stride_h + d * key_stride_d, mask=mask)
        v = tl.load(
            value_ptr + token * value_stride_t + h * value_stride_h + d * value_stride_d, mask=mask
        )
        k_dst = k_cache_stride_b * block + k_cache_stride_s * offset
        v_dst = v_cache_stride_b * block + v_cache_stride_s * offset
        tl.store(k_cache_ptr + k_dst + h * k_cache_stride_h + d * k_cache_stride_d, k, mask=mask)
        tl.store(v_cache_ptr + v_dst + h * v_cache_stride_h + d * v_cache_stride_d, v, mask=mask)

    # Through the cached launcher, which does not key on pointer alignment: one build for
    # pointers that are all 16-byte aligned (vector loads), one that assumes nothing.
    _write_kv_kernel = triton.jit(_write_kv)
    _launch_aligned = Launcher(_write_kv_kernel)
    _launch_any = Launcher(triton.jit(do_not_specialize_on_alignment=list(_POINTERS))(_write_kv))


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check: bool | None = None,
    backend: str = "auto",
) -> None:
    """Write each token's key and value into its slot of the paged KV cache, in place.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_dim]`` on the cache's device, the cache's dtype
        (float32, float16 or bfloat16); any strides (e.g. slices of a fused QKV output).
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_dim]``, same shape and dtype, any strides
        (e.g. ``kv_cache[0]`` and ``kv_cache[1]`` of one ``[2, num_blocks, ...]`` tensor).
        Written in place.
    slot_mapping : torch.Tensor
        int64 ``[>= num_tokens]`` on the cache's device. Only the first ``num_tokens`` entries
        are read, so a persistent ``[max_num_batched_tokens]`` buffer can be passed whole.
        Entries equal to ``PAD_SLOT_ID`` (-1) are skipped. Slots must be unique; where two
        tokens share a slot, which one lands is unspecified.
    check : bool, optional
        Raise ``IndexError`` when a slot lies outside ``[-1, num_blocks * block_size)``, before
        anything is written. This reads ``slot_mapping`` on the host, which synchronizes a CUDA
        device and cannot be captured in a CUDA graph. ``None`` (default) checks CPU tensors
        only. Unchecked, out-of-range slots are skipped like ``PAD_SLOT_ID``: never a write
        outside the cache.
    backend : {"auto", "triton", "torch"}
        ``"auto"``: the Triton kernel for CUDA tensors, a torch scatter for CPU tensors.
        ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1``. Both give bit-identical
        caches.

    Examples
    --------
    >>> import torch
    >>> from blocktable.kv_write import write_kv_cache
    >>> k_cache = torch.zeros(4, 16, 2, 8)
    >>> v_cache = torch.zeros(4, 16, 2, 8)
    >>> key = torch.ones(3, 2, 8)
    >>> slot_mapping = torch.tensor([16, 17, -1])  # block 1, offsets 0 and 1; one pad token
    >>> write_kv_cache(key, 2 * key, k_cache, v_cache, slot_mapping)
    >>> k_cache[1, :3, 0, 0].tolist(), v_cache[1, 1, 0, 0].item()
    ([1.0, 1.0, 0.0], 2.0)
    """
    check_tensor("k_cache", k_cache, ndim=4)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if k_cache.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"k_cache must have dtype float32, float16 or bfloat16, got {k_cache.dtype}"
        )
    device = k_cache.device
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, shape=k_cache.shape, device=device)
    check_tensor(
        "key", key, dtype=k_cache.dtype, shape=(None, num_kv_heads, head_dim), device=device
    )
    num_tokens = key.shape[0]
    check_tensor("value", value, dtype=k_cache.dtype, shape=key.shape, device=device)
    check_tensor("slot_mapping", slot_mapping, dtype=torch.int64, ndim=1, device=device)
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping must have at least num_tokens={num_tokens} entries, "
            f"got {slot_mapping.shape[0]}"
        )
    backend = resolve_backend(backend, device)
    num_slots = num_blocks * block_size
    slots = slot_mapping[:num_tokens]
    if check if check is not None else not slots.is_cuda:
        _check_slots(slots, num_slots)
    if num_tokens == 0:
        return
    if backend == "triton":
        _write_kv_cache_triton(key, value, k_cache, v_cache, slots, num_slots)
    else:
        _write_kv_cache_torch(key, value, k_cache, v_cache, slots, num_slots)


def _check_slots(slots: torch.Tensor, num_slots: int) -> None:
    bad = ((slots < -1) | (slots >= num_slots)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise IndexError(
            f"slot_mapping[{i}]={int(slots[i])} is out of range [-1, {num_slots}) "
            f"(num_blocks * block_size = {num_slots})"
        )


def _write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_slots: int,
) -> None:
    tokens = ((slots >= 0) & (slots < num_slots)).nonzero().squeeze(1)
    written = slots[tokens]
    block_size = k_cache.shape[1]
    blocks, offsets = written // block_size, written % block_size
    # Advanced indexing on (block, offset) works for any cache strides.
    k_cache[blocks, offsets] = key[tokens]
    v_cache[blocks, offsets] = value[tokens]


def _write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_slots: int,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    aligned = all(t.data_ptr() % 16 == 0 for t in (key, value, k_cache, v_cache, slots))
    (_launch_aligned if aligned else _launch_any)(
        (num_tokens,),
        key,
        value,
        k_cache,
        v_cache,
        slots,
        num_slots,
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        next_power_of_2(num_kv_heads),
        next_power_of_2(head_dim),
    )
