"""Greedy parity with transformers: same checkpoint, fp32, CPU, token for token.

Our engine runs all prompts batched together (mixed decode + prefill steps, paged KV);
transformers runs each prompt alone with its own `generate`, so the two share nothing
but the weights.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.models import write_random_checkpoint

NUM_NEW_TOKENS = 10
# Each test loads two models and generates with both: seconds, not milliseconds.
pytestmark = pytest.mark.slow

EOS_ID = 3  # the built-in tokenizer's <|im_end|>, written into every test checkpoint
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0)


def _prompts(vocab_size: int, seed: int, shared_prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = shared_prefix or []
    lengths = [1, 2, 3, 5, 7, 9, 13, 16, 17, 21, 29, 33, 40, 47, 55, 64]
    rng.shuffle(lengths)
    # Ids above the special tokens: a prompt holding eos would end early in both engines.
    return [prefix + [rng.randrange(4, vocab_size) for _ in range(n)] for n in lengths]


def _hf_greedy(model: transformers.PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate over the batch, left-padded as it expects."""
    longest = max(map(len, prompts))
    pad_id = 1
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        generated = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad_id,
        )
    outputs = []
    for row in generated[:, longest:].tolist():
        # A finished row is padded to the batch's length: cut after its eos.
        outputs.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
    return outputs


class _Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32
        ).eval()
        self.vocab_size = self.hf.config.vocab_size
        self._expected: dict[tuple[tuple[int, ...], ...], list[list[int]]] = {}

    def expected(self, prompts: list[list[int]]) -> list[list[int]]:
        key = tuple(map(tuple, prompts))
        if key not in self._expected:
            self._expected[key] = _hf_greedy(self.hf, prompts)
        return self._expected[key]


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    write_random_checkpoint(
        path, architecture=request.param, num_layers=2, hidden_size=128, num_heads=4, seed=1
    )
    return _Checkpoint(path)


def test_greedy_batch_matches_transformers(checkpoint: _Checkpoint) -> None:
    prompts = _prompts(checkpoint.vocab_size, seed=0)
    llm = LLM(str(checkpoint.path), device="cpu")
    outputs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [o.token_ids for o in outputs] == checkpoint.expected(prompts)


def test_tiny_prefill_chunks_match_transformers(checkpoint: _Checkpoint) -> None:
    prompts = _prompts(checkpoint.vocab_size, seed=0)
    llm = LLM(
        str(checkpoint.path),
        device="cpu",
        block_size=4,
        max_prefill_chunk_tokens=7,
        max_num_batched_tokens=40,
        max_num_seqs=16,
    )
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == checkpoint.expected(prompts)


def test_prefix_cache_hits_match_transformers(checkpoint: _Checkpoint) -> None:
    rng = random.Random(2)
    shared = [rng.randrange(4, checkpoint.vocab_size) for _ in range(37)]
    prompts = _prompts(checkpoint.vocab_size, seed=2, shared_prefix=shared)
    llm = LLM(str(checkpoint.path), device="cpu", block_size=8)
    warm = llm.generate(prompts[:2], GREEDY)
    outputs = llm.generate(prompts, GREEDY)
    # Every prompt of the second batch reuses the 4 full blocks of the shared prefix.
    assert all(o.num_cached_tokens >= 32 for o in outputs)
    assert [o.token_ids for o in warm + outputs] == checkpoint.expected(prompts[:2] + prompts)


def test_preemption_under_a_tiny_kv_budget_matches_transformers(checkpoint: _Checkpoint) -> None:
    prompts = _prompts(checkpoint.vocab_size, seed=0)
    block_size = 4
    bytes_per_block = 2 * 2 * 2 * 32 * 4 * block_size  # K+V, layers, kv heads, head_dim, fp32
    llm = LLM(
        str(checkpoint.path),
        device="cpu",
        block_size=block_size,
        kv_cache_bytes=30 * bytes_per_block,
        max_num_seqs=16,
        enable_prefix_caching=False,
    )
    assert llm.engine.stats().num_total_blocks == 30
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == checkpoint.expected(prompts)
    assert llm.engine.stats().num_free_blocks == 30


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_matches_transformers(checkpoint: _Checkpoint, penalty: float) -> None:
    # transformers' RepetitionPenaltyLogitsProcessor scales every id of the prompt and
    # the output so far, as vLLM's does. Each prompt runs alone there: left padding
    # would put the pad id among the penalised ones.
    rng = random.Random(6)
    # Prompts that repeat ids, so that presence is a set and not a count.
    prompts = [[rng.randrange(4, 40) for _ in range(n)] for n in (3, 9, 24, 40)]
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, repetition_penalty=penalty)
    outputs = LLM(str(checkpoint.path), device="cpu").generate(prompts, params)
    expected = []
    for prompt in prompts:
        with torch.inference_mode():
            generated = checkpoint.hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                repetition_penalty=penalty,
                pad_token_id=1,
            )
        expected.append(generated[0, len(prompt) :].tolist())
    assert [o.token_ids for o in outputs] == expected
    # The penalty changed what greedy decoding picks.
    assert expected != checkpoint.expected(prompts)


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "Qwen3ForCausalLM"])
def test_other_architectures_match_transformers(architecture: str, tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, architecture=architecture, num_layers=2, seed=4)
    checkpoint = _Checkpoint(tmp_path)
    prompts = _prompts(checkpoint.vocab_size, seed=4)[:3]
    outputs = LLM(str(tmp_path), device="cpu").generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == checkpoint.expected(prompts)


def test_llama3_rope_scaling_and_tied_embeddings_match_transformers(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    write_random_checkpoint(
        tmp_path, num_layers=2, rope_scaling=rope, tie_word_embeddings=True, seed=5
    )
    checkpoint = _Checkpoint(tmp_path)
    prompts = _prompts(checkpoint.vocab_size, seed=5)[:4]
    outputs = LLM(str(tmp_path), device="cpu").generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == checkpoint.expected(prompts)
