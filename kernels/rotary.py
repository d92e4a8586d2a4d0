"""Rotary position embedding, NeoX / Hugging Face "rotate_half" layout.

The model builds `cos_sin_cache` `[max_positions, head_dim]` (float32, cos in the first
head_dim/2 columns and sin in the last, any rope scaling already applied); the op looks up
each token's row by position and rotates query and key.
"""

from __future__ import annotations

import torch

from kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_same_device,
    check_tensor,
)


def _check(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,))
    num_tokens, _, head_dim = query.shape
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    check_dim("key", key, 0, num_tokens, "query's num_tokens")
    check_dim("key", key, 2, head_dim, "query's head_dim")
    check_dim("positions", positions, 0, num_tokens, "query's num_tokens")
    check_dim("cos_sin_cache", cos_sin_cache, 1, head_dim, "head_dim")
    if key.dtype != query.dtype:
        raise TypeError(f"key must have query's dtype {query.dtype}, got {key.dtype}")
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `rotary_embedding`: returns new (query, key) tensors.

    positions: `[T]` int; query: `[T, num_heads, head_dim]`; key: `[T, num_kv_heads,
    head_dim]`. Bit-for-bit the arithmetic of Hugging Face's apply_rotary_pos_emb (cos and
    sin cast to the activation dtype, then q * cos + rotate_half(q) * sin). Raises
    ValueError for a position outside the cache.
    """
    _check(positions, query, key, cos_sin_cache)
    if positions.numel() and (
        int(positions.min()) < 0 or int(positions.max()) >= cos_sin_cache.shape[0]
    ):
        raise ValueError(f"positions must lie in [0, {cos_sin_cache.shape[0]})")
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(query.dtype)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(query.dtype)
    return (
        (query * cos) + (_rotate_half(query) * sin),
        (key * cos) + (_rotate_half(key) * sin),
    )
