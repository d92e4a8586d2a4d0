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
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
)
from kernels._triton import jit, launchable, next_power_of_2, require_triton, tl


@jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    src_stride_t,
    src_stride_h,
    token,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    src = src_ptr + token * src_stride_t + heads * src_stride_h + dims
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    # [x1, x2] * cos + [-x2, x1] * sin, the rotate_half form.
    dst = dst_ptr + token * num_heads * 2 * HALF + heads * 2 * HALF + dims
    tl.store(dst, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)


@jit
def _rotary_embedding_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cos_sin_ptr,
    query_out_ptr,
    key_out_ptr,
    query_stride_t,
    query_stride_h,
    key_stride_t,
    key_stride_h,
    cos_sin_stride,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
):
    # One program per token: look up its cos/sin row once, rotate every q and k head.
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    # Round cos/sin to the activation dtype first, as HF does before multiplying.
    act = query_out_ptr.dtype.element_ty
    cos = tl.load(cos_sin_ptr + position * cos_sin_stride + dims).to(act).to(tl.float32)
    sin = tl.load(cos_sin_ptr + position * cos_sin_stride + HALF + dims).to(act).to(tl.float32)
    _rotate_heads(
        query_ptr, query_out_ptr, query_stride_t, query_stride_h, token, num_heads,
        cos, sin, HALF, BLOCK_H,
    )  # fmt: skip
    _rotate_heads(
        key_ptr, key_out_ptr, key_stride_t, key_stride_h, token, num_kv_heads,
        cos, sin, HALF, BLOCK_KV_H,
    )  # fmt: skip


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


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rotary_embedding`, same contract as `rotary_embedding_ref`.

    Returns new contiguous (query, key). Positions are not range-checked on the host
    (that would stall the GPU): the caller guarantees 0 <= position < max_positions.
    head_dim / 2 must be a power of two (64 and 128 head dims are). query and key may be
    views with unit stride in head_dim.
    """
    require_triton("rotary_embedding")
    _check(positions, query, key, cos_sin_cache)
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    half = head_dim // 2
    if next_power_of_2(half) != half:
        raise ValueError(f"head_dim / 2 must be a power of two, got head_dim {head_dim}")
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    kernel = launchable(_rotary_embedding_kernel, query.device)
    kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query_out,
        key_out,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        key.shape[1],
        HALF=half,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_KV_H=next_power_of_2(key.shape[1]),
    )
    return query_out, key_out


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
