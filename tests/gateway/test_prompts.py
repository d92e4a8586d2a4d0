"""Several prompts in one /v1/completions request, through the official openai client
against a live server, on the in-memory queue and on Redis: prompt i's choice j is
choice i x n + j and equals the same request with prompt i alone, streamed equals
whole, echo scores each prompt as its own request does (how evaluation harnesses batch
their scoring), usage bills every prompt once, limits count every choice, one unusable
prompt refuses the request, and Batch API lines take a list of prompts too."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gateway.batches.store import PendingLine
from tests.gateway.conftest import LiveServer, run_one_line_batch, wait_for_usage_rows

MODEL = "tiny-random"
TEXTS = ["Once upon a time", "Hello", "The capital of France is"]
ID_PROMPTS = [[301, 17, 240, 33], [501, 12], [9, 88, 77, 66, 55, 44]]


def test_each_prompts_choices_are_its_own_request(queue_server: LiveServer) -> None:
    client = queue_server.client()
    args = {"model": MODEL, "max_tokens": 6, "temperature": 1.0, "seed": 5}
    whole = client.completions.create(**args, prompt=TEXTS, n=2)
    assert [c.index for c in whole.choices] == list(range(6))
    singles = [client.completions.create(**args, prompt=text, n=2) for text in TEXTS]
    for i, single in enumerate(singles):
        for j, choice in enumerate(single.choices):
            assert whole.choices[i * 2 + j].text == choice.text
            assert whole.choices[i * 2 + j].finish_reason == choice.finish_reason
    # Each prompt is billed once, each choice's output in full.
    assert whole.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert whole.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert len({s.usage.prompt_tokens for s in singles}) > 1, "prompts of differing lengths"


def test_streamed_prompts_match_the_whole_reply(queue_server: LiveServer) -> None:
    client = queue_server.client()
    args = {
        "model": MODEL,
        "prompt": ID_PROMPTS,
        "max_tokens": 5,
        "seed": 21,
        "n": 2,
        "logprobs": 1,
    }
    whole = client.completions.create(**args)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    *body, last = chunks
    for chunk in body:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.logprobs is not None:
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
    assert sorted(texts) == list(range(6))
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens
    assert last.usage == whole.usage
    assert whole.usage.prompt_tokens == sum(len(p) for p in ID_PROMPTS)


def test_echo_scores_each_prompt_as_its_own_request(queue_server: LiveServer) -> None:
    # An evaluation harness's batched scoring: echo, logprobs, one token per prompt.
    client = queue_server.client()
    args = {"model": MODEL, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    whole = client.completions.create(**args, prompt=TEXTS)
    assert len(whole.choices) == len(TEXTS)
    for text, choice in zip(TEXTS, whole.choices, strict=True):
        (alone,) = client.completions.create(**args, prompt=text).choices
        assert choice.text == alone.text
        assert choice.text.startswith(text)
        assert choice.logprobs.tokens == alone.logprobs.tokens
        assert choice.logprobs.text_offset == alone.logprobs.text_offset
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            alone.logprobs.token_logprobs[1:]
        )


def test_prompts_leave_one_usage_record(queue_server: LiveServer) -> None:
    raw = queue_server.client().completions.with_raw_response.create(
        model=MODEL, prompt=TEXTS, max_tokens=4, n=2, temperature=1.0, seed=3
    )
    reply = raw.parse()
    request_id = raw.headers["x-request-id"]
    rows = wait_for_usage_rows(queue_server.database_url, [request_id])
    assert len(rows) == 1
    assert rows[0].outcome == "ok"
    assert rows[0].prompt_tokens == reply.usage.prompt_tokens
    assert rows[0].completion_tokens == reply.usage.completion_tokens
    assert rows[0].num_choices == len(TEXTS) * 2


def test_one_prompt_too_long_refuses_the_request(queue_server: LiveServer) -> None:
    client = queue_server.client()
    too_long = [5] * 300  # past the test server's 256-token context
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[[1, 2], too_long], max_tokens=2)
    assert (refused.value.param, refused.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[[1, 2], [3, 4]], max_tokens=255)
    assert (refused.value.param, refused.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[[1, 2], [10**9]], max_tokens=2)
    assert refused.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=["a", [1, 2]], max_tokens=2)
    assert refused.value.param == "prompt"


def test_limits_count_every_prompt_and_choice(queue_server: LiveServer) -> None:
    client = queue_server.client(queue_server.new_key(tpm=60, max_concurrency=4))
    # 3 prompts x 2 choices are six sequences at once: never allowed with four slots.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=ID_PROMPTS, max_tokens=2, n=2)
    assert (refused.value.param, refused.value.code) == ("prompt", "exceeds_concurrency_limit")
    # Every prompt once and every choice's max_tokens: 6 + 10 + 4 x 12 > 60.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model=MODEL, prompt=[ID_PROMPTS[2], ID_PROMPTS[1] * 5], max_tokens=12, n=2
        )
    assert refused.value.code == "exceeds_token_limit"
    assert "fewer prompts" in refused.value.message
    # 6 + 2 + 2 x 12 fits.
    fits = client.completions.create(
        model=MODEL, prompt=[ID_PROMPTS[2], ID_PROMPTS[1]], max_tokens=12
    )
    assert len(fits.choices) == 2


def test_a_batch_line_takes_a_list_of_prompts(queue_server: LiveServer) -> None:
    client = queue_server.client()
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": TEXTS[:2],
        "max_tokens": 4,
        "n": 2,
        "seed": 9,
        "temperature": 1.0,
    }
    result = run_one_line_batch(client, "/v1/completions", body)
    assert result["response"]["status_code"] == 200
    line = result["response"]["body"]
    live = client.completions.create(**body)
    assert [c["text"] for c in line["choices"]] == [c.text for c in live.choices]
    assert [c["index"] for c in line["choices"]] == [0, 1, 2, 3]
    assert line["usage"]["prompt_tokens"] == live.usage.prompt_tokens
    assert line["usage"]["completion_tokens"] == live.usage.completion_tokens


@pytest.mark.parametrize(
    ("body", "jobs"),
    [
        ({"prompt": "one", "n": 3}, 3),
        ({"prompt": [1, 2, 3], "n": 2}, 2),  # one prompt of token ids
        ({"prompt": ["a", "b"], "n": 3}, 6),
        ({"prompt": [[1], [2], [3]]}, 3),
        ({"prompt": ["a"] * 100, "n": 2}, 128),  # refused when it runs; counted at most
        ({"prompt": ["a", "b"], "n": "3"}, 2),
    ],
)
def test_a_batch_window_counts_each_prompts_choices(body: dict[str, Any], jobs: int) -> None:
    line = PendingLine(0, "c", json.dumps({"model": MODEL, **body}))
    assert line.num_choices == jobs
