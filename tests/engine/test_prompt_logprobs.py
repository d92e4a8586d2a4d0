"""Prompt log-probabilities (what `echo` with `logprobs` reports): token k + 1 of the
prompt scored from the tokens before it, on the real engine (tiny-random, CPU).

The reference is the engine's ordinary decode path: a request for prompt[:k + 1] whose
one output token is forced to prompt[k + 1] by logit_bias reports that token's
log-probability under the model (logprobs are taken before bias), which must equal
what prefill computed for position k, whatever the chunking.
"""

from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams, TokenLogprob

# 36 tokens in chunks of 7: five chunks, then one of a single token (run with decodes).
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(36)]


def _engine(**overrides) -> LLMEngine:
    config = {
        "model": "tiny-random",
        "device": "cpu",
        "max_model_len": 256,
        "max_num_batched_tokens": 64,
        "max_prefill_chunk_tokens": 7,
        **overrides,
    }
    return LLMEngine(EngineConfig(**config))


def _run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list] = {request_id: [] for request_id in prompts}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


@pytest.fixture(scope="module")
def scored() -> tuple[TokenLogprob, ...]:
    outputs = _run(_engine(), {"a": PROMPT}, SamplingParams(max_tokens=2, prompt_logprobs=3))
    first, *rest = outputs["a"]
    assert all(o.prompt_logprobs is None for o in rest)  # sent once, with the first token
    return first.prompt_logprobs


def test_every_prompt_token_after_the_first_is_scored(scored) -> None:
    assert [lp.token_id for lp in scored] == PROMPT[1:]
    for lp in scored:
        assert lp.logprob <= 0.0
        assert len(lp.top) == 3
        values = [value for _, value in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.logprob <= values[0] + 1e-6
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5


@pytest.mark.parametrize("k", [0, 5, 6, 13, 27, 34])  # first, chunk edges, the 1-token chunk
def test_a_prompt_logprob_is_the_forced_tokens_logprob(scored, k: int) -> None:
    engine = _engine()
    forced = SamplingParams(
        max_tokens=1, temperature=0.0, logprobs=0, logit_bias={PROMPT[k + 1]: 100.0}
    )
    (output,) = _run(engine, {"ref": PROMPT[: k + 1]}, forced)["ref"]
    (reference,) = output.new_logprobs
    assert reference.token_id == PROMPT[k + 1]
    assert scored[k].logprob == pytest.approx(reference.logprob, abs=1e-4)


def test_a_cached_prefix_is_computed_again_for_its_logprobs(scored) -> None:
    engine = _engine(enable_prefix_caching=True)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    _run(engine, {"warm": PROMPT}, SamplingParams(max_tokens=1))  # leaves the prefix cached
    first = _run(engine, {"again": PROMPT}, params)["again"][0]
    assert [lp.token_id for lp in first.prompt_logprobs] == PROMPT[1:]
    for got, want in zip(first.prompt_logprobs, scored, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_preempted_requests_score_their_prompts_once(scored) -> None:
    # A cache of a few blocks for many long requests: prefills are preempted and redone.
    engine = _engine(kv_cache_bytes=320 * 1024, max_num_seqs=8)  # 160 tokens
    prompts = {f"r{i}": PROMPT for i in range(6)}
    outputs = _run(engine, prompts, SamplingParams(max_tokens=24, prompt_logprobs=0))
    assert engine.stats().num_preemptions > 0, "make the cache smaller"
    for request_id in prompts:
        with_scores = [o for o in outputs[request_id] if o.prompt_logprobs is not None]
        assert len(with_scores) == 1
        got = with_scores[0].prompt_logprobs
        assert [lp.token_id for lp in got] == PROMPT[1:]
        for lp, want in zip(got, scored, strict=True):
            assert lp.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_a_one_token_prompt_has_no_scores() -> None:
    outputs = _run(_engine(), {"one": [42]}, SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert outputs["one"][0].prompt_logprobs == ()


@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_bad_prompt_logprobs_are_refused(value) -> None:
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(prompt_logprobs=value)
    assert refused.value.param == "prompt_logprobs"


def test_long_chunks_are_scored_in_blocks_alike() -> None:
    # 300 tokens: chunks of 256 hold more positions than one block of logits.
    prompt = [(13 * i + 7) % 500 + 5 for i in range(300)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    wide = _engine(max_num_batched_tokens=256, max_prefill_chunk_tokens=256, max_model_len=512)
    narrow = _engine(max_model_len=512)
    got = _run(wide, {"w": prompt}, params)["w"][0].prompt_logprobs
    want = _run(narrow, {"n": prompt}, params)["n"][0].prompt_logprobs
    assert [lp.token_id for lp in got] == prompt[1:]
    for a, b in zip(got, want, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
