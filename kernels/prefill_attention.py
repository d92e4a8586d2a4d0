"""Paged attention for prefill and chunked prefill, with prefix-cache hits.

Each sequence brings a chunk of L new query tokens (concatenated across sequences, split
by `cu_seqlens_q`). Its cache already holds `context_lens[s]` tokens, the chunk's own K/V
included, so query i of the chunk sits at position context_lens[s] - L + i and attends
causally to keys [0, that position]. A fresh prompt is the case L == context_len.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_gqa,
    check_kv_cache,
    check_last_dim_contiguous,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from kernels._triton import jit, launchable, next_power_of_2, require_triton, tl

_QUERY_TILE = 32  # query tokens per program
_KEY_TILE = 64  # keys per inner step (spans several 16/32-token pages)
_LOG2_E = 1.4426950408889634


@jit
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,  # softmax scale * log2(e): exp2 is the fast exponential
    q_stride_t,
    q_stride_h,
    block_tables_stride,
    cache_stride_block,
    cache_stride_token,
    cache_stride_head,
    num_seqs,
    num_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQS_PAD: tl.constexpr,
):
    # Program (t, head) takes the t-th BLOCK_M-query tile of the whole batch. Tiles are
    # numbered sequence by sequence; the launcher cannot know how many each sequence has
    # without reading cu_seqlens_q back from the GPU, so every program finds its own
    # (sequence, tile) from a prefix sum of tiles per sequence, and spare programs exit.
    tile_id = tl.program_id(0)
    head = tl.program_id(1)
    seq_ids = tl.arange(0, SEQS_PAD)
    seq_mask = seq_ids < num_seqs
    starts = tl.load(cu_seqlens_q_ptr + seq_ids, mask=seq_mask, other=0)
    ends = tl.load(cu_seqlens_q_ptr + seq_ids + 1, mask=seq_mask, other=0)
    tiles_per_seq = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tiles_through = tl.cumsum(tiles_per_seq, axis=0)
    seq = tl.sum((tiles_through <= tile_id).to(tl.int32), axis=0)
    if seq < num_seqs:
        first_tile = tl.sum(tl.where(seq_ids == seq, tiles_through - tiles_per_seq, 0), axis=0)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        context_len = tl.load(context_lens_ptr + seq)
        rows = (tile_id - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        # Rows past the chunk pose as its last query, so no row is fully masked (NaN).
        positions = tl.where(row_mask, context_len - q_len + rows, context_len - 1)
        dims = tl.arange(0, HEAD_DIM)
        token_offsets = (q_start + rows).to(tl.int64) * q_stride_t + head * q_stride_h
        q = tl.load(
            q_ptr + token_offsets[:, None] + dims[None, :], mask=row_mask[:, None], other=0.0
        )
        kv_head = head // GROUP
        table = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
        max_logit = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        denominator = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        # Keys past this tile's last query are masked for every row: stop before them.
        kv_end = tl.minimum(tl.max(positions, axis=0) + 1, context_len)
        for kv_start in range(0, kv_end, BLOCK_N):
            tokens = kv_start + tl.arange(0, BLOCK_N)
            token_mask = tokens < kv_end
            blocks = tl.load(table + tokens // BLOCK_SIZE, mask=token_mask, other=0)
            offsets = (
                blocks.to(tl.int64) * cache_stride_block
                + (tokens % BLOCK_SIZE) * cache_stride_token
                + kv_head * cache_stride_head
            )
            kv_offsets = offsets[:, None] + dims[None, :]
            k = tl.load(k_cache_ptr + kv_offsets, mask=token_mask[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_offsets, mask=token_mask[:, None], other=0.0)
            logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            is_visible = (tokens[None, :] <= positions[:, None]) & token_mask[None, :]
            logits = tl.where(is_visible, logits, float("-inf"))
            new_max = tl.maximum(max_logit, tl.max(logits, axis=1))
            rescale = tl.exp2(max_logit - new_max)
            probs = tl.exp2(logits - new_max[:, None])
            denominator = denominator * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
            max_logit = new_max
        acc = acc / denominator[:, None]
        out_offsets = (q_start + rows).to(tl.int64) * num_heads * HEAD_DIM + head * HEAD_DIM
        tl.store(
            out_ptr + out_offsets[:, None] + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None],
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


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton `prefill_attention`; returns out shaped like q.

    Same contract as `prefill_attention_ref`, except that the metadata values are not
    checked on the host (that would stall the GPU): the caller guarantees cu_seqlens_q
    rises from 0 to q.shape[0], each chunk fits in its context, and the used part of each
    block table holds valid ids. head_dim and block_size must be powers of two >= 16.
    """
    require_triton("prefill_attention")
    _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("block_tables", block_tables)
    total_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    for name, size in (("head_dim", head_dim), ("block_size", block_size)):
        if size < 16 or next_power_of_2(size) != size:
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    out = torch.empty((total_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = context_lens.shape[0]
    if total_tokens == 0 or num_seqs == 0:
        return out
    # Each sequence wastes at most one partial tile, which bounds the tiles without a sync.
    max_tiles = -(-total_tokens // _QUERY_TILE) + num_seqs
    launchable(_prefill_attention_kernel, q.device)[(max_tiles, num_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        float(scale) * _LOG2_E,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_seqs,
        num_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=_QUERY_TILE,
        BLOCK_N=_KEY_TILE,
        SEQS_PAD=next_power_of_2(num_seqs),
    )
    return out


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
    chunk. One sequence at a time (a step holds few prefill chunks): gather its keys with
    one block copy, causal mask, one attention call in float32.
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
        num_queries = end - start
        blocks = block_tables[seq, : math.ceil(context_len / block_size)].long()
        min_id, max_id = torch.stack((blocks.min(), blocks.max())).tolist()
        if min_id < 0 or max_id >= num_blocks:
            raise ValueError(f"block_tables holds a block id outside [0, {num_blocks})")
        # [num_kv_heads, context_len, head_dim] views of one contiguous block copy.
        keys = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:context_len]
        values = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:context_len]
        keys, values = keys.transpose(0, 1).float(), values.transpose(0, 1).float()
        # GQA without repeating K/V: query (token i, head g of a group) is row i * group + g
        # of its KV head, so each row's causal limit is its token's position.
        queries = q[start:end].float().view(num_queries, num_kv_heads, group, head_dim)
        queries = queries.transpose(0, 1).reshape(num_kv_heads, num_queries * group, head_dim)
        positions = torch.arange(context_len - num_queries, context_len, device=q.device)
        is_visible = torch.arange(context_len, device=q.device)[None, :] <= positions[:, None]
        is_visible = is_visible.repeat_interleave(group, dim=0)
        chunk = F.scaled_dot_product_attention(
            queries[None], keys[None], values[None], attn_mask=is_visible, scale=scale
        )
        chunk = chunk.view(num_kv_heads, num_queries, group, head_dim).transpose(0, 1)
        out[start:end] = chunk.reshape(num_queries, num_heads, head_dim).to(q.dtype)
    return out
