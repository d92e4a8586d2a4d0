"""Paged attention for decode: one query token per sequence over its cached keys.

Sequence s has `context_lens[s]` tokens in the cache (its new token included, at
position context_lens[s] - 1), in the blocks listed by `block_tables[s]`; entries past
the last used block are padding and never read. Grouped-query attention: query head h
reads KV head h // (num_heads // num_kv_heads).
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

# Tokens of one sequence that one program reduces before the partial results are merged
# (flash-decoding). Long contexts give many partitions, so even a batch of one keeps
# every SM busy; short ones take a single partition and skip the merge.
_PARTITION_TOKENS = 512
# Cap on partitions per sequence: longer contexts get proportionally longer partitions,
# which bounds the scratch buffers and the merge.
_MAX_PARTITIONS = 64
_TILE_TOKENS = 64  # keys loaded per inner step (spans several 16/32-token pages)
_LOG2_E = 1.4426950408889634


@jit
def _decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,  # [num_seqs, num_heads, head_dim], written when there is one partition
    partial_out_ptr,  # [num_seqs, num_heads, num_partitions, head_dim] float32
    partial_lse_ptr,  # [num_seqs, num_heads, num_partitions] float32, log2 domain
    scale_log2,  # softmax scale * log2(e): exp2 is the fast exponential
    q_stride_s,
    q_stride_h,
    block_tables_stride,
    cache_stride_block,
    cache_stride_token,
    cache_stride_head,
    num_heads,
    partition_tokens,
    num_partitions,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a dot-friendly power of two (>= 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    IS_SINGLE_PARTITION: tl.constexpr,
):
    # One program per (sequence, KV head, partition): it loads each key and value once
    # for all GROUP query heads that share them (GQA), over one slice of the context.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = partition * partition_tokens
    if start < context_len:
        end = tl.minimum(start + partition_tokens, context_len)
        rows = tl.arange(0, GROUP_PAD)
        row_mask = rows < GROUP
        heads = kv_head * GROUP + rows
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + seq * q_stride_s + heads[:, None] * q_stride_h + dims[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )
        max_logit = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        denominator = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        table = block_tables_ptr + seq * block_tables_stride
        for tile_start in range(start, end, TILE):
            tokens = tile_start + tl.arange(0, TILE)
            token_mask = tokens < end
            # Only table entries of live tokens are read: padding entries may be junk.
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
            logits = tl.where(token_mask[None, :], logits, float("-inf"))
            new_max = tl.maximum(max_logit, tl.max(logits, axis=1))
            rescale = tl.exp2(max_logit - new_max)
            probs = tl.exp2(logits - new_max[:, None])
            denominator = denominator * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
            max_logit = new_max
        acc = acc / denominator[:, None]
        if IS_SINGLE_PARTITION:
            out = out_ptr + seq * num_heads * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        else:
            slot = (seq * num_heads + heads) * num_partitions + partition
            tl.store(
                partial_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :],
                acc,
                mask=row_mask[:, None],
            )
            tl.store(partial_lse_ptr + slot, max_logit + tl.log2(denominator), mask=row_mask)


@jit
def _decode_attention_merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    context_lens_ptr,
    out_ptr,
    num_heads,
    partition_tokens,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    PARTITIONS_PAD: tl.constexpr,
):
    # One program per (sequence, query head): weight each partition's normalised output
    # by its share of the softmax mass, exp2(lse_p - max lse).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_live = tl.cdiv(context_len, partition_tokens)
    parts = tl.arange(0, PARTITIONS_PAD)
    part_mask = parts < num_live
    base = (seq * num_heads + head) * num_partitions
    lse = tl.load(partial_lse_ptr + base + parts, mask=part_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    weights = weights / tl.sum(weights, axis=0)
    dims = tl.arange(0, HEAD_DIM)
    partial = tl.load(
        partial_out_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :],
        mask=part_mask[:, None],
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], axis=0)
    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


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


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton `decode_attention` (split-K / flash-decoding); returns out shaped like q.

    Same contract as `decode_attention_ref`, except that context lengths and block ids
    are not checked on the host (that would stall the GPU): the caller guarantees
    1 <= context_lens[s] <= max_blocks_per_seq * block_size and valid ids in the used
    part of each table. head_dim and block_size must be powers of two (64/128, 16/32).
    """
    require_triton("decode_attention")
    _check(q, k_cache, v_cache, block_tables, context_lens)
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("block_tables", block_tables)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    for name, size in (("head_dim", head_dim), ("block_size", block_size)):
        if size < 16 or next_power_of_2(size) != size:
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    # The widest table bounds every context, so the grid needs no device-to-host sync.
    capacity = block_tables.shape[1] * block_size
    partition_tokens = max(_PARTITION_TOKENS, -(-capacity // _MAX_PARTITIONS))
    partition_tokens = -(-partition_tokens // _TILE_TOKENS) * _TILE_TOKENS
    num_partitions = max(1, -(-capacity // partition_tokens))
    is_single = num_partitions == 1
    if is_single:
        partial_out = partial_lse = out  # unused by the kernel
    else:
        partial_out = torch.empty(
            (num_seqs, num_heads, num_partitions, head_dim), dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            (num_seqs, num_heads, num_partitions), dtype=torch.float32, device=q.device
        )
    launchable(_decode_attention_kernel, q.device)[(num_seqs, num_kv_heads, num_partitions)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        partial_out,
        partial_lse,
        float(scale) * _LOG2_E,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_heads,
        partition_tokens,
        num_partitions,
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=_TILE_TOKENS,
        IS_SINGLE_PARTITION=is_single,
    )
    if not is_single:
        launchable(_decode_attention_merge_kernel, q.device)[(num_seqs, num_heads)](
            partial_out,
            partial_lse,
            context_lens,
            out,
            num_heads,
            partition_tokens,
            num_partitions,
            HEAD_DIM=head_dim,
            PARTITIONS_PAD=next_power_of_2(num_partitions),
        )
    return out


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
    Gathers every sequence's keys up to the longest context in one copy, masks the tail,
    and runs softmax(q k^T * scale) v in float32 as one batched attention call.
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    lens = context_lens.long()
    capacity = block_tables.shape[1] * block_size
    min_len, max_len = (int(x) for x in torch.stack((lens.min(), lens.max())).tolist())
    if min_len < 1 or max_len > capacity:
        raise ValueError(
            f"context_lens must lie in [1, {capacity}] (max_blocks_per_seq * block_size)"
        )
    num_used_blocks = math.ceil(max_len / block_size)
    block_starts = torch.arange(num_used_blocks, device=q.device) * block_size
    # Padding entries may hold anything (-1, stale ids): point them at block 0, then mask.
    is_used = block_starts[None, :] < lens[:, None]
    tables = torch.where(is_used, block_tables[:, :num_used_blocks].long(), 0).reshape(-1)
    min_id, max_id = torch.stack((tables.min(), tables.max())).tolist()
    if min_id < 0 or max_id >= num_blocks:
        raise ValueError(f"block_tables holds a block id outside [0, {num_blocks})")
    padded_len = num_used_blocks * block_size
    # index_select copies whole blocks (contiguous rows); the transposes below are views,
    # so the gathered keys and values are copied once and never re-laid out.
    shape = (num_seqs, padded_len, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, tables).view(shape).transpose(1, 2).float()
    values = v_cache.index_select(0, tables).view(shape).transpose(1, 2).float()
    # GQA without repeating K/V: the query heads sharing a KV head become that head's
    # query rows, [num_seqs, num_kv_heads, group, head_dim].
    group = num_heads // num_kv_heads
    queries = q.float().reshape(num_seqs, num_kv_heads, group, head_dim)
    is_live = torch.arange(padded_len, device=q.device)[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=is_live[:, None, None, :], scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
