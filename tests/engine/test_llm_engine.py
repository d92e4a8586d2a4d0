"""LLMEngine: stop conditions, streaming deltas, validation, stats."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
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


# ---------------------------------------------------------------- min_tokens

EOS = 3  # the built-in tokenizer's <|im_end|>
LETTER_A = 36  # a token whose text is "A", also in sequence ("AAAA")


def test_min_tokens_keeps_a_forced_eos_out_until_enough_tokens(llm: LLM) -> None:
    assert llm.tokenizer.eos_token_ids == {EOS}
    forced = SamplingParams(max_tokens=24, temperature=0.0, logit_bias={EOS: 100.0})
    assert llm.generate([PROMPT], forced)[0].token_ids == [EOS]
    for params in (replace(forced, min_tokens=5), replace(forced, temperature=1.5, min_tokens=5)):
        out = llm.generate([PROMPT], params)[0]
        assert len(out.token_ids) == 6
        assert EOS not in out.token_ids[:5]
        assert out.token_ids[5] == EOS
        assert out.finish_reason is FinishReason.STOP
    # min_tokens = max_tokens: eos never gets a turn.
    out = llm.generate([PROMPT], replace(forced, max_tokens=7, min_tokens=7))[0]
    assert (len(out.token_ids), EOS in out.token_ids) == (7, False)
    assert out.finish_reason is FinishReason.LENGTH
    # With ignore_eos, eos ends nothing and min_tokens does not ban it.
    ignoring = replace(forced, max_tokens=8, min_tokens=5, ignore_eos=True)
    assert llm.generate([PROMPT], ignoring)[0].token_ids == [EOS] * 8


def test_min_tokens_keeps_a_stop_token_out_until_enough_tokens(llm: LLM) -> None:
    stop_token = llm.generate([PROMPT], GREEDY)[0].token_ids[3]
    forced = SamplingParams(
        max_tokens=24,
        temperature=0.0,
        logit_bias={stop_token: 100.0},
        stop_token_ids=(stop_token,),
    )
    assert llm.generate([PROMPT], forced)[0].token_ids == [stop_token]
    out = llm.generate([PROMPT], replace(forced, min_tokens=4))[0]
    assert len(out.token_ids) == 5
    assert stop_token not in out.token_ids[:4]
    assert out.token_ids[4] == stop_token
    assert out.finish_reason is FinishReason.STOP
    # The text ends before the stop token, as without min_tokens.
    four = llm.generate([PROMPT], replace(forced, max_tokens=4, min_tokens=4))[0]
    assert four.token_ids == out.token_ids[:4]
    assert out.text == four.text


def test_min_tokens_makes_earlier_stop_strings_ordinary_text(llm: LLM) -> None:
    forced = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={LETTER_A: 100.0})
    assert llm.generate([PROMPT], forced)[0].text == "A" * 10
    for stop, min_tokens, text in [
        ("A", 0, ""),  # completed by the first token
        ("A", 5, "AAAA"),  # by the fifth, the min_tokens-th: it stops
        ("AA", 5, "AAA"),  # begun before the fifth token, completed by it
        ("AAAA", 1, ""),
    ]:
        params = replace(forced, stop=(stop,), min_tokens=min_tokens)
        outputs = _run_streaming(llm.engine, "a", PROMPT, params)
        assert outputs[-1].finish_reason is FinishReason.STOP
        assert len(outputs) == max(min_tokens, len(stop))
        assert "".join(o.text_delta for o in outputs) == outputs[-1].text == text


def _stop_string_around(text: str, num_chars_before: int) -> str:
    """A short piece of `text` found both in its first `num_chars_before` characters and
    ending after them."""
    for length in (1, 2, 3):
        for start in range(num_chars_before - length + 1):
            piece = text[start : start + length]
            later = text.find(piece, num_chars_before - length + 1)
            if "\ufffd" not in piece and later >= 0 and text.find(piece) < later:
                return piece
    raise AssertionError("no piece repeats across min_tokens; pick another prompt")


def test_a_stop_string_in_the_models_text_counts_from_min_tokens_on(llm: LLM) -> None:
    plain = _run_streaming(llm.engine, "plain", PROMPT, GREEDY)
    full = plain[-1].text
    min_tokens = 8
    # The text the tokens before the min_tokens-th released (a stop string must end
    # after it), and a stop string that occurs in it and again later.
    before = len("".join(o.text_delta for o in plain[: min_tokens - 1]))
    stop = _stop_string_around(full, before)
    cut = full.find(stop, before - len(stop) + 1)
    assert full.find(stop) < cut
    # The token whose text completes the first stop string that counts.
    released = itertools.accumulate(len(o.text_delta) for o in plain)
    num_tokens = next(n for n, chars in enumerate(released, 1) if chars >= cut + len(stop))
    params = replace(GREEDY, stop=(stop,), min_tokens=min_tokens)
    outputs = _run_streaming(llm.engine, "min", PROMPT, params)
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert outputs[-1].token_ids == plain[-1].token_ids[:num_tokens]
    assert "".join(o.text_delta for o in outputs) == outputs[-1].text == full[:cut]
    # Without min_tokens the first occurrence stops it.
    early = llm.generate([PROMPT], replace(params, min_tokens=0))[0]
    assert early.text == full[: full.find(stop)]


@pytest.mark.parametrize("value", [-1, 25, True, 2.0])
def test_bad_min_tokens_are_refused(value) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(max_tokens=24, min_tokens=value)
    assert refused.value.param == "min_tokens"


# ---------------------------------------------------------------- interruptions


def _vllm_samplers() -> list[SamplingParams]:
    """Seeded requests with min_p, a repetition penalty and min_tokens, each with eos
    forced where the min_tokens ban ends, and one greedy."""
    sampled = SamplingParams(
        max_tokens=40,
        temperature=1.3,
        seed=21,
        min_p=0.1,
        repetition_penalty=1.6,
        presence_penalty=0.3,
        min_tokens=30,
        logit_bias={EOS: 6.0},
    )
    greedy = SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.8, min_tokens=12)
    return [sampled, replace(sampled, seed=22, min_p=0.0), greedy]


def _resume(llm: LLM, request_id: str, params: SamplingParams, sent: list[int]) -> list:
    """The outputs of PROMPT's request resumed after `sent` tokens, run to its end."""
    llm.engine.add_request(request_id, PROMPT, params, resumed_token_ids=sent)
    outputs = []
    while llm.engine.has_unfinished():
        outputs += llm.engine.step()
    return outputs


@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_resumed_request_with_vllms_samplers_continues_as_uninterrupted(
    llm: LLM, which: int
) -> None:
    # A resumed request's earlier tokens are output tokens (engine.add_request): they
    # are penalised as present, once, and count toward min_tokens, as in one run.
    params = _vllm_samplers()[which]
    original = _run_streaming(llm.engine, "original", PROMPT, params)
    full = original[-1].token_ids
    assert len(full) > 12
    for k in (3, 11, len(full) - 1):
        sent = "".join(o.text_delta for o in original[:k])
        outputs = _resume(llm, f"resumed-{k}", params, full[:k])
        assert outputs[-1].token_ids == full
        assert outputs[-1].finish_reason is original[-1].finish_reason
        assert sent + "".join(o.text_delta for o in outputs) == original[-1].text


def test_a_resume_before_min_tokens_keeps_earlier_stop_strings_as_text(llm: LLM) -> None:
    # "AA" is completed by the second token on, held back ("A") until the sixth: a
    # resumed run that replayed its tokens with the stop check on cut the held text.
    params = SamplingParams(
        max_tokens=10, temperature=0.0, logit_bias={LETTER_A: 100.0}, stop=("AA",), min_tokens=6
    )
    original = _run_streaming(llm.engine, "original", PROMPT, params)
    assert original[-1].text == "AAAA"
    full = original[-1].token_ids
    for k in range(1, 6):
        sent = "".join(o.text_delta for o in original[:k])
        outputs = _resume(llm, f"resumed-{k}", params, full[:k])
        assert outputs[-1].token_ids == full
        assert sent + "".join(o.text_delta for o in outputs) == "AAAA"


def test_preempted_requests_with_vllms_samplers_match_an_uninterrupted_run() -> None:
    def run(**overrides) -> tuple[list[list[int]], int]:
        engine = LLMEngine(
            EngineConfig(
                model="tiny-random",
                device="cpu",
                max_model_len=256,
                max_num_batched_tokens=64,
                max_prefill_chunk_tokens=7,
                enable_prefix_caching=False,
                **overrides,
            )
        )
        prompts = {f"r{i}": [(7 * i + 5 * j) % 500 + 5 for j in range(36)] for i in range(6)}
        samplers = _vllm_samplers()
        for n, (request_id, prompt) in enumerate(prompts.items()):
            engine.add_request(request_id, prompt, replace(samplers[n % 3], seed=n))
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            outputs |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        return [outputs[request_id] for request_id in prompts], engine.stats().num_preemptions

    alone, num_preemptions = run(max_num_seqs=1)
    assert num_preemptions == 0
    squeezed, num_preemptions = run(max_num_seqs=8, kv_cache_bytes=320 * 1024)  # 160 tokens
    assert num_preemptions > 0, "make the cache smaller"
    assert squeezed == alone
