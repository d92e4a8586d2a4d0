"""`echo` on /v1/completions through the official openai client, on the in-memory queue
and on Redis: the prompt before each choice's text, and with `logprobs` the prompt
tokens' log-probabilities before the completion's (how evaluation harnesses score a
text: echo, logprobs, one token), streamed as whole; chat refuses it."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import LiveServer, run_one_line_batch

MODEL = "tiny-random"
PROMPT_IDS = [301, 17, 240, 33, 501, 12, 9, 88]


def test_echo_puts_the_prompt_before_each_choice(queue_server: LiveServer) -> None:
    client = queue_server.client()
    args = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "seed": 3, "n": 2}
    echoed = client.completions.create(**args, echo=True)
    plain = client.completions.create(**args)
    for with_prompt, without in zip(echoed.choices, plain.choices, strict=True):
        assert with_prompt.text == "Once upon a time" + without.text
    assert echoed.usage == plain.usage  # the echoed prompt is not generated output


def test_echo_with_logprobs_scores_every_prompt_token(queue_server: LiveServer) -> None:
    client = queue_server.client()
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    (choice,) = reply.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) + 1 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None  # nothing predicts the first token
    assert lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    # The two likeliest tokens, and the token itself when it is not one of them (as
    # OpenAI's legacy completions and vLLM list it).
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    scored = zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)
    # (A token sharing its text with a likelier one shows the likelier's value.)
    assert all(top[token] >= value for token, value, top in scored)
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(0 <= offset <= len(choice.text) for offset in lp.text_offset)
    # Each prompt token's score is its log-probability where it is the next token: the
    # same as a request for the tokens before it whose one output is forced to it.
    for k in (1, 4, len(PROMPT_IDS) - 1):
        forced = client.completions.create(
            model=MODEL,
            prompt=PROMPT_IDS[:k],
            max_tokens=1,
            temperature=0,
            logprobs=0,
            logit_bias={str(PROMPT_IDS[k]): 100},
        )
        assert lp.token_logprobs[k] == pytest.approx(forced.choices[0].logprobs.token_logprobs[0])


def test_a_streamed_echo_is_the_whole_reply(queue_server: LiveServer) -> None:
    client = queue_server.client()
    args = {
        "model": MODEL,
        "prompt": "Count to three:",
        "max_tokens": 6,
        "seed": 8,
        "echo": True,
        "logprobs": 1,
    }
    whole = client.completions.create(**args)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    offsets: dict[int, list[int]] = {}
    for chunk in client.completions.create(**args, stream=True):
        (choice,) = chunk.choices
        if choice.index not in texts:  # each choice opens with the prompt
            assert choice.text == "Count to three:"
            assert choice.logprobs.token_logprobs[0] is None
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.logprobs is not None:
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
            offsets.setdefault(choice.index, []).extend(choice.logprobs.text_offset)
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens
        assert offsets[choice.index] == choice.logprobs.text_offset


def test_chat_refuses_echo(queue_server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        queue_server.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"echo": True},
        )
    assert refused.value.param == "echo"


def test_echo_scores_the_prompt_for_one_choice(queue_server: LiveServer) -> None:
    # n choices would each score the prompt again, for n copies of the same numbers.
    client = queue_server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, n=2, echo=True, logprobs=0
        )
    assert refused.value.param == "n"


def test_a_batch_line_takes_echo(queue_server: LiveServer) -> None:
    client = queue_server.client(queue_server.new_key("batch"))
    body = {"model": MODEL, "prompt": "Score me", "max_tokens": 1, "temperature": 0, "echo": True}
    body["logprobs"] = 0
    response = run_one_line_batch(client, "/v1/completions", body)["response"]
    (choice,) = response["body"]["choices"]
    live = queue_server.client().completions.create(**body)
    assert choice["text"] == live.choices[0].text
    assert choice["text"].startswith("Score me")
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["tokens"] == live.choices[0].logprobs.tokens


def test_a_long_prompts_echo_is_counted_off_the_loop_alike(
    queue_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.openai import routes

    args = {"model": MODEL, "prompt": "héllo wörld 🙂 again", "max_tokens": 1, "temperature": 0}
    on_loop = queue_server.client().completions.create(**args, echo=True, logprobs=1)
    monkeypatch.setattr(routes, "OFF_LOOP_MIN_ECHO_TOKENS", 1)  # every prompt is long
    off_loop = queue_server.client().completions.create(**args, echo=True, logprobs=1)
    assert off_loop.choices[0].text == on_loop.choices[0].text
    assert off_loop.choices[0].logprobs == on_loop.choices[0].logprobs


def test_echo_offsets_index_the_prompt_as_written(queue_server: LiveServer) -> None:
    """Special-token text in a text prompt is that many characters of the echoed text
    (the tokenizer reads it as one special token): the offsets must say so, or a harness
    looking for its continuation past the context's length finds nothing."""
    context, continuation = "<|im_start|>user\nCapital?<|im_end|>\n", " Paris"
    reply = queue_server.client().completions.create(
        model=MODEL,
        prompt=context + continuation,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=0,
    )
    (choice,) = reply.choices
    offsets = choice.logprobs.text_offset
    assert choice.text.startswith(context + continuation)
    assert offsets[:2] == [0, len("<|im_start|>")]  # the special token spans its text
    scored = [
        token
        for token, offset in zip(choice.logprobs.tokens, offsets, strict=True)
        if len(context) <= offset < len(context + continuation)
    ]
    assert "".join(scored).strip() == "Paris"
    assert offsets[-1] >= len(context + continuation)  # the completion's own token
