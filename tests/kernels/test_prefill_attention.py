"""prefill_attention and its reference against dense causal attention over gathered K/V."""

from __future__ import annotations

import pytest
import torch

from kernels.prefill_attention import prefill_attention, prefill_attention_ref

HEADS = [(4, 4), (8, 2), (16, 2)]  # GQA ratios 1, 4 and 8
# (context_len, chunk_len): a fresh prompt, chunks after cached prefixes (odd offsets,
# block-aligned and not), a one-token chunk, a chunk spanning several blocks.
MIXED = [(37, 37), (16, 3), (100, 20), (5, 5), (64, 1), (50, 33)]


def _run_case(impl, paged_kv, dense_attention, seqs, heads, head_dim, block_size):
    num_heads, num_kv_heads = heads
    context_lens = [c for c, _ in seqs]
    query_lens = [q for _, q in seqs]
    cache = paged_kv(
        context_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size
    )
    gen = torch.Generator().manual_seed(2)
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    out = impl(q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, scale)
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    for seq, (context_len, query_len) in enumerate(seqs):
        rows = slice(int(cu[seq]), int(cu[seq + 1]))
        expected = dense_attention(
            q[rows], cache.keys[seq], cache.values[seq], context_len - query_len, scale
        )
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS)
def test_ref_matches_dense_attention(paged_kv, dense_attention, heads, head_dim, block_size):
    _run_case(prefill_attention_ref, paged_kv, dense_attention, MIXED, heads, head_dim, block_size)


@pytest.mark.parametrize("seq", [(1, 1), (33, 33), (70, 7), (48, 16)])
def test_ref_single_sequence(paged_kv, dense_attention, seq):
    _run_case(prefill_attention_ref, paged_kv, dense_attention, [seq], (8, 1), 64, 16)


def test_ref_sequence_with_empty_chunk(paged_kv, dense_attention):
    _run_case(prefill_attention_ref, paged_kv, dense_attention, [(9, 4), (20, 0)], (4, 4), 64, 16)


def test_ref_long_chunk_beside_short_ones(paged_kv, dense_attention):
    seqs = [(300, 200), (3, 1), (17, 17), (129, 1)]
    _run_case(prefill_attention_ref, paged_kv, dense_attention, seqs, (8, 2), 64, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ref_half_precision_softmax_in_float32(paged_kv, dense_attention, dtype):
    seqs = [(40, 40), (50, 9)]
    cache = paged_kv([c for c, _ in seqs], num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    q = torch.randn((49, 8, 64), generator=torch.Generator().manual_seed(6)).to(dtype)
    cu = torch.tensor([0, 40, 49], dtype=torch.int32)
    out = prefill_attention_ref(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, 0.125
    )
    assert out.dtype == dtype
    for seq, (context_len, query_len) in enumerate(seqs):
        rows = slice(int(cu[seq]), int(cu[seq + 1]))
        expected = dense_attention(
            q[rows], cache.keys[seq], cache.values[seq], context_len - query_len, 0.125
        )
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-2, rtol=2e-2)


def _valid_args(paged_kv):
    cache = paged_kv([20, 9], num_kv_heads=2, head_dim=64, block_size=16)
    q = torch.randn((12, 4, 64))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    return [q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, 0.125]


@pytest.mark.parametrize(
    ("index", "bad", "error"),
    [
        (0, lambda a: a.to(torch.bfloat16), TypeError),
        (0, lambda a: a[:, :3], ValueError),  # 3 query heads over 2 KV heads
        (0, lambda a: a[:11], ValueError),  # cu_seqlens_q ends past q
        (4, lambda a: a[:2], ValueError),  # cu_seqlens_q too short
        (4, lambda a: torch.tensor([0, 7, 5], dtype=torch.int32), ValueError),  # not rising
        (4, lambda a: torch.tensor([0, 1, 12], dtype=torch.int32), ValueError),  # chunk > ctx
        (5, lambda a: a + 1000, ValueError),  # longer than the block table
        (5, lambda a: a.float(), TypeError),
        (3, lambda a: a[:, :0], ValueError),  # no room for the context
    ],
)
def test_ref_rejects_bad_input(paged_kv, index, bad, error):
    args = _valid_args(paged_kv)
    args[index] = bad(args[index])
    with pytest.raises(error):
        prefill_attention_ref(*args)


def _compare_with_ref(target, paged_kv, seqs, heads, head_dim, block_size):
    num_heads, num_kv_heads = heads
    context_lens = [c for c, _ in seqs]
    query_lens = [q for _, q in seqs]
    cache = paged_kv(
        context_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=target.dtype,
        device=target.device,
    )
    gen = torch.Generator().manual_seed(4)
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen).to(target.dtype)
    q = q.to(target.device)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(target.device)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens)
    out = prefill_attention(*args, head_dim**-0.5)
    expected = prefill_attention_ref(*args, head_dim**-0.5)
    assert out.dtype == q.dtype
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)


# Few heads keep the interpreter quick; every GQA ratio, head dim and block size appears.
@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size"),
    [((2, 2), 64, 16), ((4, 1), 128, 32), ((8, 1), 64, 32), ((4, 1), 64, 16)],
)
def test_triton_matches_ref(target, paged_kv, heads, head_dim, block_size):
    _compare_with_ref(target, paged_kv, MIXED, heads, head_dim, block_size)


@pytest.mark.parametrize(
    "seqs",
    [
        [(1, 1)],  # a one-token prompt
        [(200, 70)],  # one long chunk after a cached prefix, three query tiles
        [(9, 4), (20, 0), (33, 33)],  # a sequence with nothing to compute
    ],
)
def test_triton_single_and_edge_sequences(target, paged_kv, seqs):
    _compare_with_ref(target, paged_kv, seqs, (2, 1), 64, 16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_large_batch_on_cuda(paged_kv, dtype):
    cuda = type("Target", (), {"device": "cuda", "dtype": dtype, "atol": 2e-2, "rtol": 2e-2})
    seqs = [(2048, 2048), (4000, 512), (77, 13), (1000, 999), *[(300, 64)] * 12]
    _compare_with_ref(cuda, paged_kv, seqs, (32, 8), 128, 16)


@pytest.mark.parametrize(
    ("index", "bad", "error"),
    [
        (0, lambda a: a.to(torch.bfloat16), TypeError),
        (0, lambda a: a[:, :3], ValueError),
        (4, lambda a: a[:2], ValueError),
        (5, lambda a: a.float(), TypeError),
        (0, lambda a: a.transpose(1, 2).contiguous().transpose(1, 2), ValueError),  # strided
    ],
)
def test_triton_rejects_bad_input(paged_kv, index, bad, error):
    pytest.importorskip("triton")
    args = _valid_args(paged_kv)
    args[index] = bad(args[index])
    with pytest.raises(error):
        prefill_attention(*args)
