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
    check_same_device,
    check_same_dtype,
    check_tensor,
)


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
