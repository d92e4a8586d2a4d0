"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

A plain nn.Module: forward takes the flattened tokens of one mixed step plus attention
metadata. q/k/v and gate/up projections are fused into one matmul each at load time,
which halves the number of small GEMMs a CPU step pays for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch import ModelArch
from engine.models.attention import AttentionMetadata, AttentionOps, paged_attention


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, ops: AttentionOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.eps = arch.rms_norm_eps
        self.scale = arch.head_dim**-0.5
        q_size = arch.num_heads * arch.head_dim
        kv_size = arch.num_kv_heads * arch.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.input_norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.qkv_proj = nn.Linear(arch.hidden_size, q_size + 2 * kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(q_size, arch.hidden_size, bias=False)
        self.q_norm = nn.Parameter(torch.ones(arch.head_dim)) if arch.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(arch.head_dim)) if arch.qk_norm else None
        self.post_attention_norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.gate_up_proj = nn.Linear(
            arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias
        )
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        hidden, residual = ops.rms_norm(hidden, self.input_norm, self.eps, residual)
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.rms_norm(q, self.q_norm, self.eps)[0]
            k = ops.rms_norm(k, self.k_norm, self.eps)[0]
        q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        attn = paged_attention(ops, q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        hidden = self.o_proj(attn.reshape(num_tokens, self.q_size))
        hidden, residual = ops.rms_norm(hidden, self.post_attention_norm, self.eps, residual)
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up), residual


class DecoderLM(nn.Module):
    """Embedding, N decoder layers, final norm and LM head."""

    def __init__(self, arch: ModelArch, ops: AttentionOps, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.ops = ops
        # Built uninitialised (the weights are loaded over it): nn.Embedding's own
        # normal_ init, on the meta device build_model uses, imports torch._dynamo, and
        # with it Triton, which on a machine without a GPU then prints a page of
        # nanobind leak warnings at every exit (kernels/_triton.py).
        self.embed_tokens = nn.Embedding(
            arch.vocab_size,
            arch.hidden_size,
            _weight=torch.empty(arch.vocab_size, arch.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(arch, ops) for _ in range(arch.num_layers))
        self.norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.lm_head = (
            None
            if arch.tie_word_embeddings
            else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        )
        # The rotary table, fp32 whatever the weights' dtype (the rotary kernels expect
        # it): computed by build_model on the model's device, not here on the meta
        # device, where the ops would import torch._dynamo (see embed_tokens).
        self.register_buffer("cos_sin", torch.empty(max_positions, arch.head_dim), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, self.cos_sin, meta)
        return self.ops.rms_norm(hidden, self.norm, self.arch.rms_norm_eps, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
