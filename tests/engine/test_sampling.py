"""Sampling: greedy, temperature, top-k/top-p support, per-request seeds."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling import sample


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", device="cpu", max_num_seqs=16)


def _logits(num_rows: int = 4, vocab_size: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed))


def test_temperature_zero_is_argmax() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, params, [0] * 4) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 2
    tokens = sample(logits, params, [0] * 4, torch.Generator().manual_seed(0))
    assert tokens[0] == logits[0].argmax().item()
    assert tokens[2] == logits[2].argmax().item()


def test_tiny_temperatures_are_greedy_in_a_mixed_batch() -> None:
    logits = _logits() * 30  # the scale of a real model's logits
    tiny = [SamplingParams(temperature=1e-39), SamplingParams(temperature=1e-30, seed=3)]
    params = [*tiny, SamplingParams(temperature=1e-39, top_p=0.9), SamplingParams()]
    tokens = sample(logits, params, [0] * 4, torch.Generator().manual_seed(0))
    assert tokens[:3] == logits[:3].argmax(-1).tolist()


def test_top_k_restricts_the_support() -> None:
    logits = _logits(1, 64).repeat(400, 1)
    params = [SamplingParams(temperature=5.0, top_k=3)] * 400
    tokens = set(sample(logits, params, [0] * 400, torch.Generator().manual_seed(1)))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert tokens <= allowed
    assert len(tokens) > 1  # a high temperature does sample among them


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(400, 1)
    params = [SamplingParams(top_p=0.75)] * 400
    tokens = set(sample(logits, params, [0] * 400, torch.Generator().manual_seed(2)))
    assert tokens == {0, 1}  # 0.5 + 0.3 reaches 0.75; 2 and 3 never appear


def test_seeded_sampling_does_not_depend_on_batch_company() -> None:
    logits = _logits(3, 128)
    alone = sample(logits[1:2], [SamplingParams(seed=7)], [5])
    crowd = [SamplingParams(), SamplingParams(seed=7), SamplingParams(temperature=0.5)]
    together = sample(logits, crowd, [0, 5, 9], torch.Generator().manual_seed(3))
    assert together[1] == alone[0]
    # The seed and the position key the draw: another position may pick another token.
    draws = {sample(logits[1:2], [SamplingParams(seed=7)], [p])[0] for p in range(40)}
    assert len(draws) > 1


def test_seeded_generation_reproduces_through_the_engine(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    alone = llm.generate([[10, 11, 12]], seeded)[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.0)
    batch = llm.generate([[20, 21], [10, 11, 12], [30] * 9], [others, seeded, others])
    assert batch[1].token_ids == alone
    different_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=4321)
    assert llm.generate([[10, 11, 12]], different_seed)[0].token_ids != alone


def test_greedy_through_the_engine_is_deterministic(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first = llm.generate([[40, 41, 42]], greedy)[0].token_ids
    second = llm.generate([[5] * 30, [40, 41, 42]], greedy)[1].token_ids
    assert first == second


@pytest.mark.parametrize("temperature", [1e-30, 1e-39])
def test_tiny_temperature_through_the_engine_is_greedy(llm: LLM, temperature: float) -> None:
    """Below float32's smallest normal number, logits / temperature overflowed to inf:
    every step sampled token 0."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    tiny = SamplingParams(max_tokens=8, temperature=temperature)
    expected = llm.generate([[40, 41, 42]], greedy)[0].token_ids
    assert llm.generate([[40, 41, 42]], tiny)[0].token_ids == expected
