"""The engine's measured stop hazard: how often a request able to stop early stops, per
generated token, which workers publish so admission can tell when slots free."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.stop_hazard import HALF_LIFE_TOKENS, MIN_TOKENS, StopHazard, expected_tokens_left

PROMPT = [17, 240, 33, 501, 12, 9]


def test_stops_per_token_weighted_towards_recent_requests() -> None:
    hazard = StopHazard()
    hazard.record(MIN_TOKENS - 1, 10)
    assert hazard.per_token == 0.0  # too little seen to say
    hazard.record(1, 0)
    assert hazard.per_token == pytest.approx(10 / MIN_TOKENS)
    # Long after, only what came since counts: the old stops have decayed away.
    for _ in range(20):
        hazard.record(HALF_LIFE_TOKENS, 0)
    assert hazard.per_token < 1e-6
    hazard.record(0, 0)  # a step of nothing that may stop changes nothing


def test_expected_tokens_left_of_a_request_that_may_stop_early() -> None:
    assert expected_tokens_left(1_500, 0.0) == 1_500  # unmeasured: all it may
    assert expected_tokens_left(1_500, 1 / 200) == pytest.approx(200 * (1 - (1 - 1 / 200) ** 1_500))
    assert expected_tokens_left(3, 1 / 200) == pytest.approx(2.985, abs=1e-3)  # the bound binds
    assert expected_tokens_left(0, 0.1) == 0.0
    assert expected_tokens_left(10, 1.0) == 1.0


def test_the_engine_measures_early_stops_and_ignores_requests_that_cannot_stop() -> None:
    llm = LLM("tiny-random", device="cpu", max_num_seqs=8, max_model_len=256)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = llm.generate([PROMPT], greedy)[0].token_ids
    # Requests that can only end at max_tokens teach nothing about stopping.
    llm.generate([PROMPT] * 10, greedy)
    assert llm.engine.stats().stop_hazard == 0.0
    # A stop token first made as token stop_at + 1: each request stops there.
    stop_at = next(i for i in range(3, 40) if full[i] not in full[:i])
    stopping = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(full[stop_at],))
    llm.generate([PROMPT] * (2 * MIN_TOKENS // (stop_at + 1) + 1), stopping)
    assert llm.engine.stats().stop_hazard == pytest.approx(1 / (stop_at + 1), rel=0.05)
