"""decode_attention and its reference against dense attention over gathered K/V."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import decode_attention, decode_attention_ref

# (num_heads, num_kv_heads): GQA ratios 1, 4 and 8.
HEADS = [(4, 4), (8, 2), (16, 2)]
# Odd lengths, exact block multiples, partially filled last blocks, a length-1 context.
MANY_LENS = [1, 37, 16, 64, 5, 100, 33]


def _run_case(impl, paged_kv, dense_attention, lens, heads, head_dim, block_size, **kw):
    num_heads, num_kv_heads = heads
    cache = paged_kv(lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((len(lens), num_heads, head_dim), generator=gen)
    scale = head_dim**-0.5
    out = impl(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale)
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    for seq, length in enumerate(lens):
        expected = dense_attention(
            q[seq : seq + 1], cache.keys[seq], cache.values[seq], length - 1, scale
        )
        torch.testing.assert_close(out[seq : seq + 1].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS)
def test_ref_matches_dense_attention(paged_kv, dense_attention, heads, head_dim, block_size):
    _run_case(
        decode_attention_ref, paged_kv, dense_attention, MANY_LENS, heads, head_dim, block_size
    )


@pytest.mark.parametrize("length", [1, 15, 16, 17, 250])
def test_ref_single_sequence(paged_kv, dense_attention, length):
    _run_case(decode_attention_ref, paged_kv, dense_attention, [length], (8, 1), 64, 16)


def test_ref_empty_batch(paged_kv):
    cache = paged_kv([4], num_kv_heads=2, head_dim=64, block_size=16)
    q = torch.empty((0, 2, 64))
    empty_tables = cache.block_tables[:0]
    out = decode_attention_ref(
        q, cache.k_cache, cache.v_cache, empty_tables, cache.context_lens[:0], 0.125
    )
    assert out.shape == (0, 2, 64)


def test_ref_padding_heavy_batch(paged_kv, dense_attention):
    # One long context beside one-token ones: most of the padded gather is masked out.
    _run_case(decode_attention_ref, paged_kv, dense_attention, [300, 1, 2, 17], (8, 2), 64, 16)


def test_ref_strided_query_matches_contiguous(paged_kv):
    # The model passes q sliced out of a wider projection: a view with a row stride.
    cache = paged_kv([40, 7, 23], num_kv_heads=2, head_dim=64, block_size=16)
    wide = torch.randn((3, 8, 96), generator=torch.Generator().manual_seed(4))
    q = wide[..., :64]
    args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    torch.testing.assert_close(
        decode_attention_ref(q, *args), decode_attention_ref(q.contiguous(), *args), atol=0, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ref_half_precision_softmax_in_float32(paged_kv, dense_attention, dtype):
    lens = [33, 5, 64]
    cache = paged_kv(lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    q = torch.randn((3, 8, 64), generator=torch.Generator().manual_seed(5)).to(dtype)
    out = decode_attention_ref(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125
    )
    assert out.dtype == dtype
    for seq, length in enumerate(lens):
        expected = dense_attention(
            q[seq : seq + 1], cache.keys[seq], cache.values[seq], length - 1, 0.125
        )
        torch.testing.assert_close(out[seq : seq + 1].double(), expected, atol=2e-2, rtol=2e-2)


def _valid_args(paged_kv):
    cache = paged_kv([20, 3], num_kv_heads=2, head_dim=64, block_size=16)
    q = torch.randn((2, 4, 64))
    return [q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125]


@pytest.mark.parametrize(
    ("index", "bad", "error"),
    [
        (0, lambda a: a.to(torch.float16), TypeError),  # q dtype != cache dtype
        (0, lambda a: a[:, :3], ValueError),  # 3 query heads over 2 KV heads
        (0, lambda a: a[..., :32], ValueError),  # head_dim mismatch
        (0, lambda a: a[0], ValueError),  # rank 2
        (3, lambda a: a.float(), TypeError),  # float block table
        (3, lambda a: a[:1], ValueError),  # one table row for two sequences
        (4, lambda a: a.tolist(), TypeError),  # not a tensor
        (4, lambda a: torch.zeros_like(a), ValueError),  # empty context
        (4, lambda a: a + 1000, ValueError),  # longer than the block table
        (2, lambda a: a[:, :8], ValueError),  # v_cache shape != k_cache shape
    ],
)
def test_ref_rejects_bad_input(paged_kv, index, bad, error):
    args = _valid_args(paged_kv)
    args[index] = bad(args[index])
    with pytest.raises(error):
        decode_attention_ref(*args)


def _compare_with_ref(target, paged_kv, lens, heads, head_dim, block_size):
    num_heads, num_kv_heads = heads
    cache = paged_kv(
        lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=target.dtype,
        device=target.device,
    )
    gen = torch.Generator().manual_seed(3)
    q = torch.randn((len(lens), num_heads, head_dim), generator=gen).to(target.dtype)
    q = q.to(target.device)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens)
    out = decode_attention(*args, head_dim**-0.5)
    expected = decode_attention_ref(*args, head_dim**-0.5)
    assert out.dtype == q.dtype
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS)
def test_triton_matches_ref(target, paged_kv, heads, head_dim, block_size):
    _compare_with_ref(target, paged_kv, MANY_LENS, heads, head_dim, block_size)


# Contexts longer than one partition (512 tokens) are split across programs and merged;
# the short sequence beside them leaves most of its partitions empty.
@pytest.mark.parametrize(
    ("lens", "heads", "block_size"),
    [([1500, 3, 513], (8, 2), 16), ([1025], (8, 1), 32), ([700, 512], (4, 4), 16)],
)
def test_triton_split_k_long_contexts(target, paged_kv, lens, heads, block_size):
    _compare_with_ref(target, paged_kv, lens, heads, 64, block_size)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_very_long_context_on_cuda(paged_kv, dtype):
    # Past 64 partitions of 512 the partitions grow instead (40k tokens: 64 x 640).
    cuda = type("Target", (), {"device": "cuda", "dtype": dtype, "atol": 2e-2, "rtol": 2e-2})
    _compare_with_ref(cuda, paged_kv, [40_000, 17, 4096], (32, 8), 128, 16)


@pytest.mark.parametrize(
    ("index", "bad", "error"),
    [
        (0, lambda a: a.to(torch.float16), TypeError),
        (0, lambda a: a[:, :3], ValueError),
        (3, lambda a: a[:1], ValueError),
        (0, lambda a: a.transpose(1, 2).contiguous().transpose(1, 2), ValueError),  # strided
    ],
)
def test_triton_rejects_bad_input(paged_kv, index, bad, error):
    pytest.importorskip("triton")
    args = _valid_args(paged_kv)
    args[index] = bad(args[index])
    with pytest.raises(error):
        decode_attention(*args)


def test_triton_rejects_head_dim_not_power_of_two(paged_kv):
    pytest.importorskip("triton")
    cache = paged_kv([20], num_kv_heads=2, head_dim=96, block_size=16)
    q = torch.randn((1, 4, 96))
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(
            q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.1
        )
