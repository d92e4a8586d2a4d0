"""Model runner: KV cache sizing from a byte budget."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ContextLengthExceededError, ModelLoadError
from engine.model_runner import ModelRunner, _decode_groups, kv_cache_budget_bytes, num_kv_blocks
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


def test_a_cache_no_larger_than_the_watermark_is_a_load_error() -> None:
    # The scheduler keeps 2 blocks free: an engine of 2 blocks would start and never
    # take a request, so every request sent to it would wait for ever.
    bytes_per_block = 2 * 4 * 2 * 32 * 4 * 16
    with pytest.raises(ModelLoadError, match="at least 3"):
        LLM("tiny-random", device="cpu", kv_cache_bytes=2 * bytes_per_block)
    assert LLM("tiny-random", device="cpu", kv_cache_bytes=3 * bytes_per_block).engine


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


def test_decode_groups_cover_every_row_once() -> None:
    for num_decodes in (0, 1, 7, 8, 9, 16, 33):
        groups = _decode_groups(num_decodes)
        rows = [r for start, end in groups for r in range(start, end)]
        assert rows == list(range(num_decodes))
    assert len(_decode_groups(7)) == 1  # too few decodes to be worth extra calls
    assert len(_decode_groups(16)) > 1


def test_batched_greedy_tokens_equal_each_request_alone() -> None:
    # Ten decodes of mixed context lengths share a step, so the runner sorts and groups
    # them; each request must still get the tokens it gets when it runs alone.
    prompts = [[5 + i] * n for i, n in enumerate([3, 40, 17, 90, 1, 33, 64, 8, 120, 25])]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM("tiny-random", device="cpu", max_num_seqs=16, enable_prefix_caching=False)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert batched == alone
