"""Paged attention for decode: one query token per sequence over its cached keys.

Sequence s has `context_lens[s]` tokens in the cache (its new token included, at
position context_lens[s] - 1), in the blocks listed by `block_tables[s]`; entries past
the last used block are padding and never read. Grouped-query attention: query head h
reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import math

import torch

from kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_gqa,
    check_kv_cache,
    check_same_device,
    check_same_dtype,
    check_tensor,
)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES)
    num_seqs = q.shape[0]
    check_dim("q", q, 2, head_dim, "the cache's head_dim")
    check_gqa(q.shape[1], num_kv_heads)
    check_dim("block_tables", block_tables, 0, num_seqs, "num_seqs")
    check_dim("context_lens", context_lens, 0, num_seqs, "num_seqs")
    check_same_dtype(q=q, k_cache=k_cache)
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens
    )


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch `decode_attention`; returns out shaped like q.

    q: `[num_seqs, num_heads, head_dim]`; caches: `[num_blocks, block_size, num_kv_heads,
    head_dim]`; block_tables: `[num_seqs, max_blocks_per_seq]` int; context_lens:
    `[num_seqs]` int, each in [1, max_blocks_per_seq * block_size] (ValueError otherwise).
    Gathers every sequence's keys up to the longest context, masks the tail, and runs
    softmax(q k^T * scale) v in float32.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    lens = context_lens.long()
    capacity = block_tables.shape[1] * block_size
    if int(lens.min()) < 1 or int(lens.max()) > capacity:
        raise ValueError(
            f"context_lens must lie in [1, {capacity}] (max_blocks_per_seq * block_size)"
        )
    num_used_blocks = math.ceil(int(lens.max()) / block_size)
    block_starts = torch.arange(num_used_blocks, device=q.device) * block_size
    # Padding entries may hold anything (-1, stale ids): point them at block 0, then mask.
    is_used = block_starts[None, :] < lens[:, None]
    tables = torch.where(is_used, block_tables[:, :num_used_blocks].long(), 0)
    if int(tables.max()) >= num_blocks or int(tables.min()) < 0:
        raise ValueError(f"block_tables holds a block id outside [0, {num_blocks})")
    max_len = num_used_blocks * block_size
    keys = k_cache[tables].reshape(num_seqs, max_len, num_kv_heads, head_dim).float()
    values = v_cache[tables].reshape(num_seqs, max_len, num_kv_heads, head_dim).float()
    group = num_heads // num_kv_heads
    queries = q.float().reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,stkd->skgt", queries, keys) * scale
    is_past_end = torch.arange(max_len, device=q.device)[None, :] >= lens[:, None]
    scores.masked_fill_(is_past_end[:, None, None, :], float("-inf"))
    out = torch.einsum("skgt,stkd->skgd", scores.softmax(dim=-1), values)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
