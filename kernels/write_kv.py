"""Write the new tokens' keys and values into the paged KV cache, by slot.

The cache of one layer is a pair `[num_blocks, block_size, num_kv_heads, head_dim]`;
token t goes to slot `slot_mapping[t] = block_id * block_size + offset`. A slot of -1
skips the token (padding, or a token whose K/V are already cached).
"""

from __future__ import annotations

import torch

from kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_kv_cache,
    check_last_dim_contiguous,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from kernels._triton import jit, launchable, next_power_of_2, require_triton, tl


@jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    head_dim,
    num_elements,  # num_kv_heads * head_dim: one token's row in the cache
    BLOCK: tl.constexpr,
):
    # One program per token: copy its [num_kv_heads, head_dim] key and value rows into
    # the contiguous cache slot (a slot's K/V are one row of num_elements values).
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    # -1 skips the token; the comparison is made per lane so the mask is one vector.
    mask = (offsets < num_elements) & ((offsets * 0 + slot) >= 0)
    head = offsets // head_dim
    dim = offsets % head_dim
    key = tl.load(key_ptr + token * key_stride_t + head * key_stride_h + dim, mask=mask)
    value = tl.load(value_ptr + token * value_stride_t + head * value_stride_h + dim, mask=mask)
    tl.store(k_cache_ptr + slot * num_elements + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * num_elements + offsets, value, mask=mask)


def _check(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES)
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have one shape, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_dim("key", key, 0, slot_mapping.shape[0], "len(slot_mapping)")
    check_dim("key", key, 1, num_kv_heads, "the cache's num_kv_heads")
    check_dim("key", key, 2, head_dim, "the cache's head_dim")
    check_same_dtype(key=key, value=value, k_cache=k_cache)
    check_same_device(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton `write_kv`: copy key[t], value[t] to slot slot_mapping[t] in place.

    Same contract as `write_kv_ref`, except that slots are not range-checked on the host
    (that would stall the GPU): the caller guarantees -1 <= slot < num_blocks * block_size.
    key and value may be views (e.g. slices of a fused QKV projection) as long as each
    head's head_dim values are contiguous.
    """
    require_triton("write_kv")
    _check(key, value, k_cache, v_cache, slot_mapping)
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("value", value)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_elements = num_kv_heads * head_dim
    kernel = launchable(_write_kv_kernel, key.device)
    kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        head_dim,
        num_elements,
        BLOCK=next_power_of_2(num_elements),
    )


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch `write_kv`: copy key[t], value[t] to slot slot_mapping[t] in place.

    key, value: `[num_tokens, num_kv_heads, head_dim]`; slot_mapping: `[num_tokens]` int,
    -1 to skip a token. Raises ValueError for a slot outside the cache.
    """
    _check(key, value, k_cache, v_cache, slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    if slot_mapping.numel() and (
        int(slot_mapping.min()) < -1 or int(slot_mapping.max()) >= num_slots
    ):
        raise ValueError(f"slot_mapping holds a slot outside [-1, {num_slots})")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(num_slots, num_kv_heads, head_dim).index_copy_(0, slots, key[keep])
    v_cache.view(num_slots, num_kv_heads, head_dim).index_copy_(0, slots, value[keep])
