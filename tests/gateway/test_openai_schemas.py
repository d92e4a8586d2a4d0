"""Request bodies -> typed requests: what is accepted, and the 400 every bad body gets."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequestError
from gateway.openai.schemas import (
    ChatMessage,
    parse_chat_request,
    parse_completion_request,
    parse_json_object,
)


def _body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_completion_defaults_and_fields() -> None:
    req = parse_completion_request(_body(model="m", prompt="hi"))
    assert req.prompt == "hi"
    opts = req.options
    assert (opts.max_tokens, opts.temperature, opts.top_p, opts.stream) == (None, 1.0, 1.0, False)
    assert (opts.stop, opts.service_tier, opts.include_usage) == ((), None, False)

    req = parse_completion_request(
        _body(
            model="m",
            prompt=[1, 2, 3],
            max_tokens=5,
            temperature=0,
            top_p=0.5,
            seed=7,
            stop="\n",
            n=1,
            stream=True,
            stream_options={"include_usage": True},
            user="u1",
            service_tier="batch",
            logprobs=None,
            presence_penalty=0,
        )
    )
    assert req.prompt == (1, 2, 3)
    opts = req.options
    assert (opts.max_tokens, opts.temperature, opts.top_p, opts.seed) == (5, 0.0, 0.5, 7)
    assert (opts.stop, opts.stream, opts.include_usage) == (("\n",), True, True)
    assert (opts.user, opts.service_tier) == ("u1", "batch")
    assert (opts.presence_penalty, opts.frequency_penalty, opts.logit_bias) == (0.0, 0.0, ())


def test_logprobs_top_k_and_max_completion_tokens_are_parsed() -> None:
    text = parse_completion_request(
        _body(model="m", prompt="x", logprobs=3, top_k=-1, max_completion_tokens=7)
    ).options
    assert (text.logprobs, text.top_k, text.max_tokens) == (3, 0, 7)
    assert parse_completion_request(_body(model="m", prompt="x", logprobs=0)).options.logprobs == 0
    assert parse_completion_request(_body(model="m", prompt="x")).options.logprobs is None
    messages = [{"role": "user", "content": "x"}]
    chat = parse_chat_request(
        _body(model="m", messages=messages, logprobs=True, top_logprobs=20, top_k=5)
    ).options
    assert (chat.logprobs, chat.top_k) == (20, 5)
    plain = parse_chat_request(_body(model="m", messages=messages, logprobs=True)).options
    assert plain.logprobs == 0
    off = parse_chat_request(_body(model="m", messages=messages, logprobs=False)).options
    assert off.logprobs is None
    for bad, param in (
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            parse_chat_request(_body(model="m", messages=messages, **bad))
        assert info.value.param == param


def test_replayed_tool_calls_are_refused_not_dropped() -> None:
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
    ]
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(_body(model="m", messages=messages))
    assert info.value.param == "messages[1].tool_calls"
    messages[1]["tool_calls"] = []  # asks for nothing
    assert parse_chat_request(_body(model="m", messages=messages)).messages[1].content == ""


def test_penalties_and_logit_bias_are_parsed() -> None:
    opts = parse_chat_request(
        _body(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            presence_penalty=-2,
            frequency_penalty=1.5,
            logit_bias={"50": -100, "7": 2.5, "0": 0},
        )
    ).options
    assert (opts.presence_penalty, opts.frequency_penalty) == (-2.0, 1.5)
    assert opts.logit_bias == ((0, 0.0), (7, 2.5), (50, -100.0))
    assert (
        parse_completion_request(_body(model="m", prompt="x", logit_bias={})).options.logit_bias
        == ()
    )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [(["one"], "one"), ([[4, 5]], (4, 5)), ("", "")],
)
def test_completion_accepts_a_batch_of_one(prompt: object, expected: object) -> None:
    assert parse_completion_request(_body(model="m", prompt=prompt)).prompt == expected


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (["one", "", "three"], ("one", "", "three")),
        ([[4, 5], [6]], ((4, 5), (6,))),
        (["a"] * 64, ("a",) * 64),
    ],
)
def test_completion_takes_a_list_of_prompts(prompt: object, expected: object) -> None:
    request = parse_completion_request(_body(model="m", prompt=prompt, n=2))
    assert request.prompts == expected
    assert request.prompt == expected[0]


def test_chat_messages_and_max_completion_tokens() -> None:
    req = parse_chat_request(
        _body(
            model="m",
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            max_tokens=50,
            max_completion_tokens=3,
        )
    )
    assert req.messages == (
        ChatMessage("system", "be brief"),
        ChatMessage("user", "a\nb"),  # parts are lines, as vLLM joins them
        ChatMessage("assistant", ""),
    )
    assert req.options.max_tokens == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": 3, "prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": 5}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": ["a", [1, 2]]}, "prompt"),  # mixed forms
        ({"model": "m", "prompt": ["a", 5]}, "prompt"),
        ({"model": "m", "prompt": [[1], []]}, "prompt"),
        ({"model": "m", "prompt": [[1], [2, -3]]}, "prompt"),
        ({"model": "m", "prompt": [[1], [True]]}, "prompt"),
        ({"model": "m", "prompt": [["a"]]}, "prompt"),
        ({"model": "m", "prompt": ["a"] * 65, "n": 2}, "prompt"),  # 130 choices
        ({"model": "m", "prompt": ["a"] * 129}, "prompt"),
        ({"model": "m", "prompt": [1, -2]}, "prompt"),
        ({"model": "m", "prompt": [1, True]}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": -0.1}, "temperature"),
        ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "top_p": 1.5}, "top_p"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "n": 129}, "n"),
        ({"model": "m", "prompt": "x", "n": 1.5}, "n"),
        ({"model": "m", "prompt": "x", "n": True}, "n"),
        ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "x", "seed": "1"}, "seed"),
        ({"model": "m", "prompt": "x", "seed": 2**70}, "seed"),
        ({"model": "m", "prompt": "x", "stop": 5}, "stop"),
        ({"model": "m", "prompt": "x", "stop": ["a", ""]}, "stop"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        (
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
        ({"model": "m", "prompt": "x", "user": 5}, "user"),
        ({"model": "m", "prompt": "x", "service_tier": 1}, "service_tier"),
        ({"model": "m", "prompt": "x", "presence_penalty": 2.01}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"model": "m", "prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
        ({"model": "m", "prompt": "x", "temperature": 10**400}, "temperature"),
        ({"model": "m", "prompt": "x", "logit_bias": [1]}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {" 5": 1}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"\u0665": 1}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"9" * 19: 1}}, "logit_bias"),
        # One token twice: which bias was meant cannot be told.
        ({"model": "m", "prompt": "x", "logit_bias": {"5": 1, "05": -1}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"5": None}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"5": 10**400}}, "logit_bias"),
        (
            {"model": "m", "prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}},
            "logit_bias",
        ),
        ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
        ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
        ({"model": "m", "prompt": "x", "logprobs": -1}, "logprobs"),
        ({"model": "m", "prompt": "x", "top_logprobs": 2}, "top_logprobs"),
        ({"model": "m", "prompt": "x", "top_k": -2}, "top_k"),
        ({"model": "m", "prompt": "x", "top_k": 1.5}, "top_k"),
        ({"model": "m", "prompt": "x", "min_p": 1.1}, "min_p"),
        ({"model": "m", "prompt": "x", "min_p": "0.1"}, "min_p"),
        ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": "m", "prompt": "x", "repetition_penalty": 1e-45}, "repetition_penalty"),
        ({"model": "m", "prompt": "x", "repetition_penalty": 2.5}, "repetition_penalty"),
        ({"model": "m", "prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
        ({"model": "m", "prompt": "x", "guided_json": {}}, "guided_json"),  # any JSON value
        ({"model": "m", "prompt": "x", "guided_choice": []}, "guided_choice"),
        ({"model": "m", "prompt": "x", "guided_regex": ""}, "guided_regex"),
        ({"model": "m", "prompt": "x", "typical_p": 0.5}, "typical_p"),
        ({"model": "m", "prompt": "x", "mirostat_mode": 1}, "mirostat_mode"),
        ({"model": "m", "prompt": "x", "dry_multiplier": 0.5}, "dry_multiplier"),
        ({"model": "m", "prompt": "x", "xtc_probability": 0.5}, "xtc_probability"),
        ({"model": "m", "prompt": "x", "top_a": 0.5}, "top_a"),
        ({"model": "m", "prompt": "x", "tfs": 0.5}, "tfs"),
        ({"model": "m", "prompt": "x", "no_repeat_ngram_size": 3}, "no_repeat_ngram_size"),
        ({"model": "m", "prompt": "x", "bad_words_ids": [[5]]}, "bad_words_ids"),
        ({"model": "m", "prompt": "x", "repetition_penalty_range": 64}, "repetition_penalty_range"),
        ({"model": "m", "prompt": "x", "smoothing_factor": 0.3}, "smoothing_factor"),
        ({"model": "m", "prompt": "x", "return_token_ids": True}, "return_token_ids"),
        ({"model": "m", "prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"model": "m", "prompt": "x", "grammar": {"type": "regex", "value": "a+"}}, "grammar"),
        ({"model": "m", "prompt": "x", "grammar": 'root ::= "a"'}, "grammar"),
        ({"model": "m", "prompt": "x", "json_schema": {"type": "object"}}, "json_schema"),
        ({"model": "m", "prompt": "x", "repeat_penalty": 1.5}, "repeat_penalty"),
        ({"model": "m", "prompt": "x", "dynatemp_range": 1.5}, "dynatemp_range"),
        ({"model": "m", "prompt": "x", "top_n_sigma": 1.0}, "top_n_sigma"),
        ({"model": "m", "prompt": "x", "n_probs": 3}, "n_probs"),
        ({"model": "m", "prompt": "x", "penalty_alpha": 0.6}, "penalty_alpha"),
        ({"model": "m", "prompt": "x", "guidance_scale": 1.5}, "guidance_scale"),
        ({"model": "m", "prompt": "x", "negative_prompt": "no"}, "negative_prompt"),
        ({"model": "m", "prompt": "x", "ban_eos_token": True}, "ban_eos_token"),
        ({"model": "m", "prompt": "x", "num_beams": 4}, "num_beams"),
        ({"model": "m", "prompt": "x", "do_sample": False}, "do_sample"),
        ({"model": "m", "prompt": "x", "rep_pen": 1.3}, "rep_pen"),
        ({"model": "m", "prompt": "x", "typical": 0.5}, "typical"),
        ({"model": "m", "prompt": "x", "watermark": True}, "watermark"),
        ({"model": "m", "prompt": "x", "top_n_tokens": 5}, "top_n_tokens"),
        ({"model": "m", "prompt": "x", "return_full_text": True}, "return_full_text"),
        ({"model": "m", "prompt": "x", "modalities": ["text", "audio"]}, "modalities"),
        ({"model": "m", "prompt": "x", "audio": {"voice": "alloy"}}, "audio"),
        ({"model": "m", "prompt": "x", "web_search_options": {"a": 1}}, "web_search_options"),
        ({"model": "m", "prompt": "x", "web_search_options": {}}, "web_search_options"),  # on
        ({"model": "m", "prompt": "x", "prediction": {}}, "prediction"),
        ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
        ({"model": "m", "prompt": "x", "stop_token_ids": 5}, "stop_token_ids"),
        ({"model": "m", "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"model": "m", "prompt": "x", "stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"model": "m", "prompt": "x", "stop_token_ids": [True]}, "stop_token_ids"),
        ({"model": "m", "prompt": "x", "stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"model": "m", "prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
        ({"model": "m", "prompt": "x", "skip_special_tokens": False}, "skip_special_tokens"),
        (
            {"model": "m", "prompt": "x", "include_stop_str_in_output": True},
            "include_stop_str_in_output",
        ),
        ({"model": "m", "prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"model": "m", "prompt": "x", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
        ({"model": "m", "prompt": "x", "min_p": -0.05}, "min_p"),
        ({"model": "m", "prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"model": "m", "prompt": "x", "min_tokens": 1.5}, "min_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"model": "m", "prompt": "x", "bad_words": ["x"]}, "bad_words"),
        ({"model": "m", "prompt": "x", "structured_outputs": {"json": {}}}, "structured_outputs"),
        ({"model": "m", "prompt": "x", "logits_processors": ["p"]}, "logits_processors"),
        ({"model": "m", "prompt": "x", "prompt_logprobs": 0}, "prompt_logprobs"),
        (
            {"model": "m", "prompt": "x", "return_tokens_as_token_ids": True},
            "return_tokens_as_token_ids",
        ),
        ({"model": "m", "prompt": "x", "priority": 5}, "priority"),
        ({"model": "m", "prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
        (
            {
                "model": "m",
                "prompt": "x",
                "stream": True,
                "stream_options": {"continuous_usage_stats": True},
            },
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_bad_completion_bodies_name_the_param(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request(json.dumps(body).encode())
    assert info.value.param == param


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ("hi", "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        # A tool message answers tool_calls, which are refused: no conversation holds one.
        (
            [
                {"role": "user", "content": "x"},
                {"role": "tool", "content": "4", "tool_call_id": "c"},
            ],
            "messages[1].role",
        ),
        ([{"role": "tool", "content": "42"}], "messages[0].role"),
    ],
)
def test_bad_chat_messages_name_the_param(messages: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(_body(model="m", messages=messages))
    assert info.value.param == param


def test_chat_max_completion_tokens_errors_name_it() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(
            _body(model="m", messages=[{"role": "user", "content": "x"}], max_completion_tokens=0)
        )
    assert info.value.param == "max_completion_tokens"
    # A null max_completion_tokens is not given: the bad value is max_tokens.
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(
            _body(model="m", messages=messages, max_tokens=0, max_completion_tokens=None)
        )
    assert info.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"\xff\xfe{}", "invalid_utf8"),
        (b'{"model": "m\xc3"}', "invalid_utf8"),
        (b"{", "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (b'"text"', "invalid_json"),
        (b'{"temperature": NaN}', "invalid_json"),
        (b'{"temperature": Infinity}', "invalid_json"),
    ],
)
def test_undecodable_bodies(raw: bytes, code: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_json_object(raw)
    assert info.value.code == code


def test_empty_body() -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        parse_json_object(b"  ")


def test_non_finite_number_from_overflow() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request(b'{"model": "m", "prompt": "x", "temperature": 1e999}')
    assert info.value.param == "temperature"


def test_vllm_stop_token_ids_and_ignore_eos_are_parsed() -> None:
    options = parse_completion_request(
        _body(model="m", prompt="x", stop_token_ids=[9, 2, 9], ignore_eos=True)
    ).options
    assert (options.stop_token_ids, options.ignore_eos) == ((2, 9), True)
    plain = parse_chat_request(
        _body(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            stop_token_ids=None,
            skip_special_tokens=True,
            include_stop_str_in_output=False,
        )
    ).options
    assert (plain.stop_token_ids, plain.ignore_eos) == ((), False)


def test_vllms_default_values_of_what_is_refused_are_accepted() -> None:
    # A client may send vLLM's whole default parameter set: its no-op values ask nothing.
    neutral = {
        "min_p": 0.0,
        "repetition_penalty": 1,
        "length_penalty": 1.0,
        "min_tokens": 0,
        "bad_words": [],
        "allowed_token_ids": None,
        "priority": 0,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "truncate_prompt_tokens": None,
        "prompt_logprobs": None,
        "structured_outputs": None,
        "guided_json": None,
        "detokenize": True,
        "return_token_ids": False,
        # Other servers' samplers at their no-op values.
        "typical_p": 1.0,
        "tfs": 1,
        "top_a": 0,
        "mirostat_mode": 0,
        "dry_multiplier": 0.0,
        "no_repeat_ngram_size": 0,
        "bad_words_ids": [],
        "grammar": "",
        "json_schema": None,
        "repeat_penalty": 1.0,
        "num_beams": 1,
        "do_sample": True,
        "top_n_sigma": -1.0,
        "n_probs": 0,
        "return_full_text": False,
    }
    parse_completion_request(_body(model="m", prompt="x", add_special_tokens=True, **neutral))
    chat = parse_chat_request(
        _body(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            add_special_tokens=False,
            add_generation_prompt=True,
            continue_final_message=False,
            **neutral,
        )
    )
    assert chat.options.n == 1
    for chat_only_field in ({"add_generation_prompt": False}, {"chat_template": "{{ x }}"}):
        with pytest.raises(InvalidRequestError):
            parse_chat_request(
                _body(model="m", messages=[{"role": "user", "content": "x"}], **chat_only_field)
            )


def test_vllm_samplers_are_parsed() -> None:
    options = parse_completion_request(
        _body(model="m", prompt="x", min_p=0.1, repetition_penalty=1.3, min_tokens=4)
    ).options
    assert (options.min_p, options.repetition_penalty, options.min_tokens) == (0.1, 1.3, 4)
    plain = parse_completion_request(_body(model="m", prompt="x")).options
    assert (plain.min_p, plain.repetition_penalty, plain.min_tokens) == (0.0, 1.0, 0)
