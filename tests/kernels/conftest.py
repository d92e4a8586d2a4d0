"""Fixtures for the kernel tests: paged KV caches built from known dense K/V.

Without a GPU the Triton kernels run under Triton's interpreter, which must be switched on
before triton is imported; tests/conftest.py does it, before any test module imports the
kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

_NEEDS_CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Padding entries of a block table may hold anything; these must never be read.
_PADDING_BLOCK_IDS = (-1, 1 << 30)


@dataclass(frozen=True)
class PagedKV:
    """A paged cache holding `keys[s]`, `values[s]` (`[len_s, num_kv_heads, head_dim]`)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32, padded with junk ids
    context_lens: torch.Tensor  # int32
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def build_paged_kv(
    context_lens: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    num_spare_blocks: int = 3,
) -> PagedKV:
    """Scatter random dense K/V per sequence into shuffled blocks of a fresh cache.

    Unused blocks and the unused tail of each last block hold large junk values, so a
    kernel that reads past a context or through a padding entry gets a wrong answer.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 1e4).to(dtype)
    v_cache = torch.full(shape, -1e4).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq, default=0) + 2
    tables = torch.empty((len(context_lens), width), dtype=torch.int32)
    keys, values = [], []
    for seq, length in enumerate(context_lens):
        key = torch.randn((length, num_kv_heads, head_dim), generator=gen).to(dtype)
        value = torch.randn((length, num_kv_heads, head_dim), generator=gen).to(dtype)
        keys.append(key.to(device))
        values.append(value.to(device))
        for i in range(width):
            tables[seq, i] = _PADDING_BLOCK_IDS[(seq + i) % 2]
        for i in range(blocks_per_seq[seq]):
            block = order.pop()
            tables[seq, i] = block
            rows = slice(i * block_size, min((i + 1) * block_size, length))
            k_cache[block, : rows.stop - rows.start] = key[rows]
            v_cache[block, : rows.stop - rows.start] = value[rows]
    return PagedKV(
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
    )


def naive_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_position: int, scale: float
) -> torch.Tensor:
    """Dense causal attention in float64 for one sequence: q[i] sits at first_position + i.

    q: `[L, num_heads, head_dim]`; keys/values: `[context_len, num_kv_heads, head_dim]`.
    """
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [T, H, D]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,thd->hqt", q.double(), k) * scale
    query_pos = torch.arange(q.shape[0])[:, None] + first_position
    key_pos = torch.arange(keys.shape[0])[None, :]
    scores = scores.masked_fill((key_pos > query_pos).to(scores.device), float("-inf"))
    return torch.einsum("hqt,thd->qhd", scores.softmax(dim=-1), v)


@pytest.fixture
def paged_kv() -> Callable[..., PagedKV]:
    """The `build_paged_kv` factory."""
    return build_paged_kv


@pytest.fixture
def dense_attention() -> Callable[..., torch.Tensor]:
    """The `naive_attention` oracle."""
    return naive_attention


@dataclass(frozen=True)
class Target:
    """Where a Triton kernel runs in a test, in which dtype, and how close it must be."""

    device: str
    dtype: torch.dtype
    atol: float
    rtol: float


@pytest.fixture(
    params=[
        # Interpreted on the CPU: numpy has no bf16, and fp32 keeps the comparison tight.
        pytest.param(Target("cpu", torch.float32, 2e-5, 2e-5), id="interpreter-fp32"),
        pytest.param(Target("cuda", torch.float16, 2e-3, 2e-3), id="cuda-fp16", marks=_NEEDS_CUDA),
        pytest.param(Target("cuda", torch.bfloat16, 2e-2, 2e-2), id="cuda-bf16", marks=_NEEDS_CUDA),
    ]
)
def target(request: pytest.FixtureRequest) -> Target:
    """Each place the Triton kernels are tested: the CPU interpreter, and CUDA fp16/bf16."""
    pytest.importorskip("triton")
    return request.param
