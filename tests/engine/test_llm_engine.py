"""LLMEngine: stop conditions, streaming deltas, validation, stats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, FinishReason, SamplingParams
from engine.config import EngineConfig
from engine.errors import ContextLengthExceededError, InvalidRequestError, UnsupportedModelError
from engine.llm_engine import LLMEngine
from engine.models import write_random_checkpoint

PROMPT = [17, 240, 33, 501, 12, 9]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", device="cpu", max_num_seqs=8, max_model_len=256)


def _run_streaming(engine: LLMEngine, request_id: str, prompt, params):
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_max_tokens_finishes_with_length(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert out.num_output_tokens == 5
    assert out.finish_reason is FinishReason.LENGTH
    assert out.finished
    assert out.num_prompt_tokens == len(PROMPT)


def test_stop_token_id_ends_the_output_at_its_first_occurrence(llm: LLM) -> None:
    full = llm.generate([PROMPT], GREEDY)[0].token_ids
    stop_token = full[3]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_token,))
    out = llm.generate([PROMPT], params)[0]
    assert out.token_ids == full[: full.index(stop_token) + 1]
    assert out.finish_reason is FinishReason.STOP
    # Its text ends before the stop token, as vLLM's does (and as a stop string's).
    before = SamplingParams(max_tokens=full.index(stop_token), temperature=0.0)
    assert out.text == llm.generate([PROMPT], before)[0].text


def test_stop_string_is_cut_from_the_text(llm: LLM) -> None:
    full = llm.generate([PROMPT], GREEDY)[0]
    middle = len(full.text) // 2
    stop = full.text[middle : middle + 2]
    assert "\ufffd" not in stop
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text


def test_streamed_deltas_join_to_the_final_text(llm: LLM) -> None:
    outputs = _run_streaming(llm.engine, "stream", PROMPT, GREEDY)
    assert len(outputs) == 24
    assert all(len(o.new_token_ids) == 1 for o in outputs)
    assert [t for o in outputs for t in o.new_token_ids] == outputs[-1].token_ids
    assert "".join(o.text_delta for o in outputs) == outputs[-1].text
    assert [o.finished for o in outputs] == [False] * 23 + [True]
    assert outputs[-1].text == llm.generate([PROMPT], GREEDY)[0].text
    # Each output's cumulative fields are those of its own step, read after the end.
    for i, output in enumerate(outputs):
        assert output.token_ids == outputs[-1].token_ids[: i + 1]
        assert output.num_output_tokens == i + 1
        assert output.text == "".join(o.text_delta for o in outputs[: i + 1])


def test_an_aborted_request_reports_what_it_generated(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("cut", PROMPT, GREEDY)
    steps = [o for _ in range(6) for o in engine.step() if o.request_id == "cut"]
    assert len(steps) >= 2
    aborted = engine.abort_request("cut")
    assert aborted is not None
    assert aborted.finish_reason is FinishReason.ABORT
    assert aborted.token_ids == [t for o in steps for t in o.new_token_ids]
    assert aborted.text == "".join(o.text_delta for o in steps)
    assert aborted.new_token_ids == []
    assert engine.abort_request("cut") is None


def test_eos_from_generation_config_and_ignore_eos(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, num_layers=1, hidden_size=64, num_heads=2, seed=3)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    full = LLM(str(tmp_path), device="cpu").generate([PROMPT], greedy)[0].token_ids
    eos = full[4]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, eos]}))
    llm = LLM(str(tmp_path), device="cpu")
    stopped = llm.generate([PROMPT], greedy)[0]
    assert stopped.token_ids == full[: full.index(eos) + 1]
    assert stopped.finish_reason is FinishReason.STOP
    ignoring = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = llm.generate([PROMPT], ignoring)[0]
    assert out.token_ids == full
    assert out.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -0.5},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
    ],
)
def test_bad_sampling_values_are_typed_errors(bad: dict) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**bad)
    assert info.value.param == next(iter(bad))


def test_bad_requests_are_refused_while_others_keep_running(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("good", PROMPT, GREEDY)
    engine.step()
    with pytest.raises(InvalidRequestError, match="at least one token"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(ContextLengthExceededError) as info:
        engine.add_request("long", [5] * 250, SamplingParams(max_tokens=10))
    assert info.value.max_model_len == 256
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("vocab", [5, 902], GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request("negative", [5, -1], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", PROMPT, GREEDY)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["good"]
    assert outputs[-1].token_ids == llm.generate([PROMPT], GREEDY)[0].token_ids


def test_llm_generate_validates_every_prompt_before_running(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.generate("fine", GREEDY)[0].finish_reason is not None


def test_unsupported_architecture_is_a_typed_error(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, num_layers=1, hidden_size=64, num_heads=2)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        LLM(str(tmp_path), device="cpu")
    assert "LlamaForCausalLM" in str(info.value)
    assert info.value.architecture == "GPT2LMHeadModel"


def test_bad_engine_config_is_a_typed_error() -> None:
    with pytest.raises(InvalidRequestError):
        EngineConfig(block_size=0)
    with pytest.raises(InvalidRequestError):
        EngineConfig(device="tpu")


def test_stats_after_a_batch(llm: LLM) -> None:
    llm.generate([PROMPT, [7] * 40, [8] * 3], SamplingParams(max_tokens=16, temperature=0.0))
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.kv_cache_usage == 0.0
    assert stats.num_steps > 0
    assert stats.decode_tokens_per_s > 0
    assert stats.prefill_tokens_per_s > 0
    assert stats.step_token_budget == EngineConfig().max_num_batched_tokens


def test_chat_renders_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hello!"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(messages)
    assert out.num_output_tokens >= 1


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=24, seed=99)])
def test_a_resumed_request_continues_where_it_left_off(llm: LLM, params) -> None:
    full = llm.generate([PROMPT], params)[0].token_ids
    outputs = []
    llm.engine.add_request("resumed", PROMPT, params, resumed_token_ids=full[:9])
    while llm.engine.has_unfinished():
        outputs += llm.engine.step()
    assert outputs[-1].token_ids == full
    assert [t for o in outputs for t in o.new_token_ids] == full[9:]
    with pytest.raises(InvalidRequestError, match="resumed"):
        llm.engine.add_request("too-many", PROMPT, params, resumed_token_ids=full)


def test_a_resume_after_held_back_text_sends_it(llm: LLM) -> None:
    # A lease can move right after a token whose text was held back (half of a
    # multi-byte character): the resumed run must send it, not treat it as sent.
    original = _run_streaming(llm.engine, "original", PROMPT, GREEDY)
    full = original[-1].token_ids
    held = [k for k in range(1, len(full)) if original[k - 1].text_delta == ""]
    assert held, "no held-back text in this output; pick another prompt"
    for k in held:
        sent = "".join(o.text_delta for o in original[:k])
        llm.engine.add_request(f"resumed-{k}", PROMPT, GREEDY, resumed_token_ids=full[:k])
        outputs = []
        while llm.engine.has_unfinished():
            outputs += llm.engine.step()
        assert sent + "".join(o.text_delta for o in outputs) == original[-1].text


def test_decode_rate_is_measured_when_every_step_mixes_in_prefill() -> None:
    # One long decode runs next to a stream of chunked prefills, so no step after the
    # first is a pure decode. Counting a step only for its dominant phase never sampled
    # the decode rate; the cost-model split samples it on every step.
    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            max_num_seqs=2,
            max_num_batched_tokens=64,
            max_prefill_chunk_tokens=64,
            max_model_len=512,
            enable_prefix_caching=False,
        )
    )
    engine.add_request("decoder", PROMPT, SamplingParams(max_tokens=32, ignore_eos=True))
    rates = []
    num_prompts = 0
    decoding = True
    while decoding:
        if engine.stats().num_waiting == 0:
            prompt = [(7 * num_prompts + i) % 500 + 3 for i in range(90 + 17 * (num_prompts % 5))]
            engine.add_request(f"p{num_prompts}", prompt, SamplingParams(max_tokens=1))
            num_prompts += 1
        outputs = engine.step()
        decoding = not any(o.request_id == "decoder" and o.finished for o in outputs)
        rates.append(engine.stats().decode_tokens_per_s)
    assert engine.cost_model.is_ready
    assert rates[-1] > 0
    # Sampled on most steps, not stuck at a first value. (A step whose measured time the
    # fit gives wholly to its prompt tokens is skipped; on a loaded machine the noisy fit
    # does that now and then, so "most", not "every".)
    later = rates[10:]
    assert len(later) >= 20
    assert len(set(later)) > len(later) // 2
