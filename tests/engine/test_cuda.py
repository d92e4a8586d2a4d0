"""The engine on CUDA (Triton kernels through the registry); skipped without a GPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models import write_random_checkpoint

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[5 + i] * (3 + 7 * i) for i in range(12)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_fp32_cuda_matches_cpu_greedy(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, num_layers=2, hidden_size=128, num_heads=4, seed=7)
    cpu = LLM(str(tmp_path), device="cpu").generate(PROMPTS, GREEDY)
    cuda = LLM(str(tmp_path), device="cuda", dtype="float32", max_prefill_chunk_tokens=16)
    outputs = cuda.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in cpu]


def test_bf16_cuda_serves_tiny_random() -> None:
    llm = LLM("tiny-random", device="cuda")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True, seed=1))
    assert all(o.num_output_tokens == 20 for o in outputs)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_vllms_samplers_on_cuda_match_cpu(tmp_path: Path) -> None:
    # The prompt masks, output counts and min_tokens bans live on the logits' device.
    write_random_checkpoint(tmp_path, num_layers=2, hidden_size=128, num_heads=4, seed=7)
    eos = 3  # the built-in tokenizer's <|im_end|>, in every written checkpoint
    params = [
        replace(GREEDY, repetition_penalty=1.5),
        replace(GREEDY, min_tokens=6, logit_bias={eos: 100.0}),  # eos as the 7th token
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, min_p=1.0),  # greedy in effect
    ] * 4
    cpu = LLM(str(tmp_path), device="cpu").generate(PROMPTS, params)
    cuda = LLM(str(tmp_path), device="cuda", dtype="float32", max_prefill_chunk_tokens=16)
    outputs = cuda.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in cpu]
    assert all(o.token_ids[6:] == [eos] for o in outputs[1::3])
