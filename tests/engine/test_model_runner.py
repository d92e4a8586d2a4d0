"""Model runner: KV cache sizing from a byte budget."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ContextLengthExceededError, ModelLoadError
from engine.model_runner import ModelRunner, kv_cache_budget_bytes, num_kv_blocks
from engine.models import load_model


def test_num_blocks_follows_the_budget() -> None:
    arch = load_model("tiny-random", device="cpu").arch
    # K and V x 4 layers x 2 KV heads x head_dim 32 x 4 bytes x 16 slots
    bytes_per_block = 2 * 4 * 2 * 32 * 4 * 16
    assert num_kv_blocks(arch, 16, torch.float32, 10 * bytes_per_block) == 10
    assert num_kv_blocks(arch, 16, torch.float32, 10 * bytes_per_block - 1) == 9
    assert num_kv_blocks(arch, 16, torch.bfloat16, 10 * bytes_per_block) == 20


def test_cpu_budget_is_what_the_batch_needs_up_to_a_cap() -> None:
    cpu = torch.device("cpu")
    assert kv_cache_budget_bytes(cpu, 1234, 0.9, needed_bytes=10) == 1234
    assert kv_cache_budget_bytes(cpu, None, 0.9, needed_bytes=10_000) == 10_000
    assert kv_cache_budget_bytes(cpu, None, 0.9, needed_bytes=2**40) < 2**40


def test_a_budget_below_one_block_is_a_load_error() -> None:
    loaded = load_model("tiny-random", device="cpu")
    with pytest.raises(ModelLoadError):
        ModelRunner(loaded, block_size=16, num_blocks=0)


def test_the_context_window_shrinks_to_the_kv_cache() -> None:
    bytes_per_block = 2 * 4 * 2 * 32 * 4 * 16
    llm = LLM("tiny-random", device="cpu", kv_cache_bytes=8 * bytes_per_block, max_num_seqs=4)
    stats = llm.engine.stats()
    assert stats.num_total_blocks == 8
    assert llm.engine.max_model_len == 8 * 16
    with pytest.raises(ContextLengthExceededError):
        llm.generate([[5] * 120], SamplingParams(max_tokens=10))
    out = llm.generate([[5] * 100], SamplingParams(max_tokens=28, ignore_eos=True))[0]
    assert out.num_output_tokens == 28
