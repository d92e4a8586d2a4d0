"""Paged attention for prefill and chunked prefill, with prefix-cache hits.

Each sequence brings a chunk of L new query tokens (concatenated across sequences, split
by `cu_seqlens_q`). Its cache already holds `context_lens[s]` tokens, the chunk's own K/V
included, so query i of the chunk sits at position context_lens[s] - L + i and attends
causally to keys [0, that position]. A fresh prompt is the case L == context_len.
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
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=INDEX_DTYPES)
    num_seqs = context_lens.shape[0]
    check_dim("q", q, 2, head_dim, "the cache's head_dim")
    check_gqa(q.shape[1], num_kv_heads)
    check_dim("block_tables", block_tables, 0, num_seqs, "num_seqs")
    check_dim("cu_seqlens_q", cu_seqlens_q, 0, num_seqs + 1, "num_seqs + 1")
    check_same_dtype(q=q, k_cache=k_cache)
    check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        context_lens=context_lens,
    )


def _check_values(
    q: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> None:
    """Value checks that need the host to read the metadata (the reference does them)."""
    cu = cu_seqlens_q.long()
    query_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != q.shape[0] or bool((query_lens < 0).any()):
        raise ValueError(
            f"cu_seqlens_q must rise from 0 to q.shape[0] ({q.shape[0]}), got {cu.tolist()}"
        )
    if bool((query_lens > context_lens.long()).any()):
        raise ValueError("each sequence's query chunk must be at most its context_len")
    capacity = block_tables.shape[1] * block_size
    if bool((context_lens.long() > capacity).any()):
        raise ValueError(
            f"context_lens must be at most max_blocks_per_seq * block_size ({capacity})"
        )


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch `prefill_attention`; returns out shaped like q.

    q: `[total_q_tokens, num_heads, head_dim]`; caches: `[num_blocks, block_size,
    num_kv_heads, head_dim]`; block_tables: `[num_seqs, max_blocks_per_seq]` int;
    cu_seqlens_q: `[num_seqs + 1]` int; context_lens: `[num_seqs]` int, counting the
    chunk. One sequence at a time: gather its keys, causal mask, softmax in float32.
    """
    _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    _check_values(q, block_tables, cu_seqlens_q, context_lens, block_size)
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        if start == end:
            continue
        blocks = block_tables[seq, : math.ceil(context_len / block_size)].long()
        if int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks:
            raise ValueError(f"block_tables holds a block id outside [0, {num_blocks})")
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len].float()
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len].float()
        queries = q[start:end].float().reshape(end - start, num_kv_heads, group, head_dim)
        scores = torch.einsum("qkgd,tkd->kgqt", queries, keys) * scale
        positions = torch.arange(context_len - (end - start), context_len, device=q.device)
        is_future = torch.arange(context_len, device=q.device)[None, :] > positions[:, None]
        scores.masked_fill_(is_future, float("-inf"))
        chunk = torch.einsum("kgqt,tkd->qkgd", scores.softmax(dim=-1), values)
        out[start:end] = chunk.reshape(end - start, num_heads, head_dim).to(q.dtype)
    return out
