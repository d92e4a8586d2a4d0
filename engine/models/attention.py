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
    # Row ranges of the decodes (sorted by context length) attended in separate calls:
    # the kernels pad every row to its call's longest context, so grouping similar
    # lengths cuts the padded work of a batch of mixed lengths.
    decode_groups: tuple[tuple[int, int], ...] = ()


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
    parts = [
        ops.decode_attention(
            query[start:end],
            k_cache,
            v_cache,
            meta.decode_block_tables[start:end],
            meta.decode_context_lens[start:end],
            scale,
        )
        for start, end in meta.decode_groups or ((0, num_decode),)
        if end > start
    ]
    if num_decode < query.shape[0]:
        parts.append(
            ops.prefill_attention(
                query[num_decode:],
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                meta.cu_seqlens_q,
                meta.prefill_context_lens,
                scale,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
