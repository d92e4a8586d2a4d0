"""Paged attention over a mixed batch: decode tokens first, then prefill chunks.

The runner flattens one step into a single token axis. The first `num_decode_tokens`
tokens are one-token decodes (one per sequence); the rest are prefill chunks described
by `cu_seqlens_q`. Every token's K/V is written to its slot before attention reads the
cache, so a prefill chunk attends to its cached prefix and to itself in one kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.registry import resolve


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # [num_decodes], including the new token
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks]
    cu_seqlens_q: torch.Tensor  # [num_prefills + 1] offsets into the prefill tokens
    prefill_context_lens: torch.Tensor  # [num_prefills], including the chunk


@dataclass(frozen=True)
class AttentionOps:
    """The kernels one device uses, resolved once when the model is built."""

    write_kv: Callable[..., None]
    decode_attention: Callable[..., torch.Tensor]
    prefill_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def for_device(cls, device_type: str) -> AttentionOps:
        return cls(
            write_kv=resolve("write_kv", device_type),
            decode_attention=resolve("decode_attention", device_type),
            prefill_attention=resolve("prefill_attention", device_type),
            rms_norm=resolve("rms_norm", device_type),
            rotary_embedding=resolve("rotary_embedding", device_type),
        )


def paged_attention(
    ops: AttentionOps,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query `[T, H, D]`, key/value `[T, KVH, D]` -> `[T, H, D]`."""
    ops.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    num_decode = meta.num_decode_tokens
    if num_decode == query.shape[0]:
        return ops.decode_attention(
            query, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )
    prefill = ops.prefill_attention(
        query[num_decode:],
        k_cache,
        v_cache,
        meta.prefill_block_tables,
        meta.cu_seqlens_q,
        meta.prefill_context_lens,
        scale,
    )
    if num_decode == 0:
        return prefill
    decode = ops.decode_attention(
        query[:num_decode],
        k_cache,
        v_cache,
        meta.decode_block_tables,
        meta.decode_context_lens,
        scale,
    )
    return torch.cat([decode, prefill], dim=0)
