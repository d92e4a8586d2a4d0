"""rotary_embedding and its reference against Hugging Face's apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kernels.rotary import rotary_embedding, rotary_embedding_ref


def build_cos_sin_cache(max_positions: int, head_dim: int, base: float = 10000.0):
    """cos | sin of position * inv_freq, the way Llama's rotary embedding derives them."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _hf_rotary(positions, query, key, max_positions):
    head_dim = query.shape[-1]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(query.dtype), emb.sin().to(query.dtype)
    # HF takes [batch, heads, seq, dim] and cos/sin [batch, seq, dim].
    q_hf, k_hf = apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos[None], sin[None]
    )
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"),
    [(1, 4, 4, 64), (37, 8, 2, 128), (5, 16, 2, 64)],
)
def test_ref_matches_hf(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn((num_tokens, num_heads, head_dim), generator=gen).to(dtype)
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    cache = build_cos_sin_cache(4096, head_dim)
    q_out, k_out = rotary_embedding_ref(positions, query, key, cache)
    q_hf, k_hf = _hf_rotary(positions, query, key, 4096)
    # Same float32 angles, same cast, same order of operations: bit-for-bit equal.
    assert torch.equal(q_out, q_hf)
    assert torch.equal(k_out, k_hf)
    assert q_out.dtype == k_out.dtype == dtype


def test_ref_returns_new_tensors():
    query, key = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    q_before = query.clone()
    q_out, k_out = rotary_embedding_ref(
        torch.tensor([0, 1, 2]), query, key, build_cos_sin_cache(8, 64)
    )
    assert torch.equal(query, q_before)
    assert q_out.data_ptr() != query.data_ptr()
    # Position 0 is the identity rotation.
    torch.testing.assert_close(q_out[0], query[0])
    torch.testing.assert_close(k_out[0], key[0])


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"positions": torch.tensor([0, 1, 99])}, ValueError),
        ({"positions": torch.tensor([0, -1, 2])}, ValueError),
        ({"positions": torch.tensor([0.0, 1.0, 2.0])}, TypeError),
        ({"positions": torch.tensor([0, 1])}, ValueError),
        ({"key": torch.randn(3, 2, 32)}, ValueError),
        ({"key": torch.randn(3, 2, 64, dtype=torch.float64)}, TypeError),
        ({"cos_sin_cache": build_cos_sin_cache(8, 64).half()}, TypeError),
        ({"cos_sin_cache": build_cos_sin_cache(8, 32)}, ValueError),
    ],
)
def test_ref_rejects_bad_input(kwargs, error):
    args = {
        "positions": torch.tensor([0, 1, 2]),
        "query": torch.randn(3, 4, 64),
        "key": torch.randn(3, 2, 64),
        "cos_sin_cache": build_cos_sin_cache(8, 64),
    }
    args.update(kwargs)
    with pytest.raises(error):
        rotary_embedding_ref(**args)


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"),
    [(1, 4, 4, 64), (37, 8, 2, 128), (5, 16, 2, 64), (9, 6, 3, 64)],
)
def test_triton_matches_ref(target, num_tokens, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(7)
    query = torch.randn((num_tokens, num_heads, head_dim), generator=gen).to(target.dtype)
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(target.dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    args = [positions, query, key, build_cos_sin_cache(4096, head_dim)]
    args = [t.to(target.device) for t in args]
    q_out, k_out = rotary_embedding(*args)
    q_expected, k_expected = rotary_embedding_ref(*args)
    torch.testing.assert_close(q_out, q_expected, atol=target.atol, rtol=target.rtol)
    torch.testing.assert_close(k_out, k_expected, atol=target.atol, rtol=target.rtol)


def test_triton_reads_a_fused_qkv_view(target):
    qkv = torch.randn((7, 4 + 2 + 2, 64)).to(target.dtype).to(target.device)
    query, key = qkv[:, :4], qkv[:, 4:6]
    positions = torch.arange(7, device=target.device) * 3
    cache = build_cos_sin_cache(64, 64).to(target.device)
    q_out, k_out = rotary_embedding(positions, query, key, cache)
    q_expected, k_expected = rotary_embedding_ref(positions, query, key, cache)
    torch.testing.assert_close(q_out, q_expected, atol=target.atol, rtol=target.rtol)
    torch.testing.assert_close(k_out, k_expected, atol=target.atol, rtol=target.rtol)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"positions": torch.tensor([0.0, 1.0, 2.0])}, TypeError),
        ({"key": torch.randn(3, 2, 32)}, ValueError),
        ({"cos_sin_cache": build_cos_sin_cache(8, 64).half()}, TypeError),
        ({"query": torch.randn(3, 4, 48), "key": torch.randn(3, 2, 48)}, ValueError),
    ],
)
def test_triton_rejects_bad_input(kwargs, error):
    pytest.importorskip("triton")
    args = {
        "positions": torch.tensor([0, 1, 2]),
        "query": torch.randn(3, 4, 64),
        "key": torch.randn(3, 2, 64),
        "cos_sin_cache": build_cos_sin_cache(8, 64),
    }
    if "query" in kwargs:
        args["cos_sin_cache"] = build_cos_sin_cache(8, 48)
    args.update(kwargs)
    with pytest.raises(error):
        rotary_embedding(**args)
