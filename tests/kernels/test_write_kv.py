"""write_kv and its reference against a per-token Python loop."""

from __future__ import annotations

import pytest
import torch

from kernels.write_kv import write_kv, write_kv_ref


def _naive_write(key, value, k_cache, v_cache, slot_mapping):
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[token]
            v_cache[slot // block_size, slot % block_size] = value[token]


def _case(num_tokens, num_kv_heads, head_dim, block_size, num_blocks=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    # Distinct slots in shuffled order, and every third token skipped with -1.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    return key, value, k_cache, v_cache, slots


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_tokens", "num_kv_heads"), [(1, 1), (37, 2), (100, 8)])
def test_ref_matches_loop(num_tokens, num_kv_heads, head_dim, block_size):
    key, value, k_cache, v_cache, slots = _case(num_tokens, num_kv_heads, head_dim, block_size)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    _naive_write(key, value, k_expected, v_expected, slots)
    write_kv_ref(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def test_ref_all_skipped_leaves_cache_alone():
    key, value, k_cache, v_cache, slots = _case(5, 2, 64, 16)
    before = k_cache.clone()
    write_kv_ref(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    assert torch.equal(k_cache, before)


def test_ref_accepts_int32_slots():
    key, value, k_cache, v_cache, slots = _case(9, 2, 64, 16)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    _naive_write(key, value, k_expected, v_expected, slots)
    write_kv_ref(key, value, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


@pytest.mark.parametrize(
    ("index", "bad", "error"),
    [
        (0, lambda a: a.half(), TypeError),  # key dtype != cache dtype
        (1, lambda a: a[:-1], ValueError),  # value shorter than key
        (0, lambda a: a[:, :1], ValueError),  # wrong num_kv_heads
        (4, lambda a: a.float(), TypeError),  # float slots
        (4, lambda a: a[:-1], ValueError),  # one slot short
        (4, lambda a: a + 10_000, ValueError),  # slot past the cache
        (4, lambda a: torch.full_like(a, -2), ValueError),  # negative slot other than -1
        (2, lambda a: a.transpose(1, 2), ValueError),  # non-contiguous cache
    ],
)
def test_ref_rejects_bad_input(index, bad, error):
    args = list(_case(6, 2, 64, 16))
    args[index] = bad(args[index])
    with pytest.raises(error):
        write_kv_ref(*args)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim"), [(1, 1, 64), (37, 2, 128), (100, 8, 64)]
)
def test_triton_matches_ref(target, num_tokens, num_kv_heads, head_dim, block_size):
    case = _case(num_tokens, num_kv_heads, head_dim, block_size)
    key, value, k_cache, v_cache, slots = (t.to(target.device) for t in case)
    key, value = key.to(target.dtype), value.to(target.dtype)
    k_cache, v_cache = k_cache.to(target.dtype), v_cache.to(target.dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_expected, v_expected, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    # A copy: bit-exact in every dtype.
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def test_triton_reads_strided_views(target):
    # The engine slices K and V out of one fused QKV projection: rows are strided.
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn((11, 8 + 2 + 2, 64), generator=gen).to(target.dtype).to(target.device)
    key, value = qkv[:, 8:10], qkv[:, 10:12]
    k_cache = torch.zeros((4, 16, 2, 64), dtype=target.dtype, device=target.device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(3, 14, device=target.device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_expected, v_expected, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


@pytest.mark.parametrize(
    ("index", "bad", "error"),
    [
        (0, lambda a: a.half(), TypeError),
        (1, lambda a: a[:-1], ValueError),
        (4, lambda a: a.float(), TypeError),
        (2, lambda a: a.transpose(1, 2), ValueError),
        (0, lambda a: a.transpose(1, 2).contiguous().transpose(1, 2), ValueError),  # strided
    ],
)
def test_triton_rejects_bad_input(index, bad, error):
    pytest.importorskip("triton")
    args = list(_case(6, 2, 64, 16))
    args[index] = bad(args[index])
    with pytest.raises(error):
        write_kv(*args)
