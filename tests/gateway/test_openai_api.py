"""The official openai client against a live server: completions, chat, streaming, usage."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from sqlalchemy import select

from gateway.db.models import UsageRow
from gateway.db.session import create_db_engine, create_sessionmaker

if TYPE_CHECKING:
    from tests.gateway.conftest import LiveServer

MODEL = "tiny-random"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]


def test_models_lists_the_served_model(live_server: LiveServer) -> None:
    models = live_server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = live_server.client().models.retrieve(MODEL)
    assert card.id == MODEL
    assert card.model_extra["max_model_len"] == live_server.max_model_len  # vLLM's field


def test_chat_completion_counts_usage(live_server: LiveServer) -> None:
    raw = live_server.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
    )
    assert raw.headers["x-request-id"].startswith("req_")
    reply = raw.parse()
    assert reply.object == "chat.completion"
    assert reply.id == "chatcmpl-" + raw.headers["x-request-id"].removeprefix("req_")
    assert reply.service_tier == "interactive"
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    expected_prompt = live_server.engine.tokenizer.apply_chat_template(MESSAGES)
    assert reply.usage.prompt_tokens == len(expected_prompt)
    assert 1 <= reply.usage.completion_tokens <= 6
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 6
    else:
        assert choice.finish_reason == "stop"


def test_text_completion_greedy_is_deterministic(live_server: LiveServer) -> None:
    client = live_server.client()
    first = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0)
    again = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0)
    assert first.object == "text_completion"
    assert first.choices[0].text == again.choices[0].text
    assert first.usage.prompt_tokens == len(live_server.engine.tokenizer.encode("Once upon"))
    assert first.choices[0].finish_reason in ("stop", "length")


def test_seeded_sampling_repeats_and_token_id_prompts_work(live_server: LiveServer) -> None:
    client = live_server.client()
    ids = live_server.engine.tokenizer.encode("hello there")
    texts = {
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=5, temperature=1.0, top_p=0.9, seed=1234
        )
        .choices[0]
        .text
        for _ in range(2)
    }
    assert len(texts) == 1
    by_text = client.completions.create(
        model=MODEL, prompt="hello there", max_tokens=5, temperature=1.0, top_p=0.9, seed=1234
    )
    assert by_text.choices[0].text in texts


def test_logit_bias_and_penalties_reach_the_engine(live_server: LiveServer) -> None:
    client = live_server.client()
    tokenizer = live_server.engine.tokenizer
    forced_id = tokenizer.encode(" the")[-1]
    forced = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=5, temperature=1.0, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].text == tokenizer.decode([forced_id] * 5)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logit_bias={forced_id: 100}
    )
    assert chat.choices[0].message.content == tokenizer.decode([forced_id] * 4)
    # Greedy decoding of the tiny model repeats no token in 16; a negative penalty
    # (a reward) on the tokens already out makes it repeat them.
    plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0)
    rewarded = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=16, temperature=0, frequency_penalty=-2.0
    )
    assert rewarded.choices[0].text != plain.choices[0].text
    ids = tokenizer.encode(rewarded.choices[0].text)
    assert len(set(ids)) < len(ids)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="abc", max_tokens=2, logit_bias={str(tokenizer.vocab_size): 1}
        )
    assert info.value.body["param"] == "logit_bias"


def test_text_completion_logprobs_streamed_and_not(live_server: LiveServer) -> None:
    client = live_server.client()
    whole = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=6, temperature=0, logprobs=2
    )
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == whole.usage.completion_tokens
    assert len(lp.top_logprobs) == len(lp.tokens)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2  # two ids may share a text
        assert logprob == max(top.values()) <= 0.0  # greedy: the top token
        assert top[token] == logprob
    # Where each token starts in the text the client got (special tokens and pieces of
    # a character add nothing to it).
    text = whole.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[0] == 0
    assert lp.text_offset[-1] <= len(text)
    # A longer greedy output of the tiny model holds special tokens and split characters.
    longer = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=60, temperature=0, logprobs=0
    ).choices[0]
    assert longer.logprobs.text_offset[-1] <= len(longer.text)
    # logprobs 0: the token's own entry alone (as OpenAI's legacy completions and vLLM).
    longer_lp = longer.logprobs
    scored = zip(longer_lp.tokens, longer_lp.token_logprobs, longer_lp.top_logprobs, strict=True)
    assert all(top == {token: value} for token, value, top in scored)
    streamed = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=6, temperature=0, logprobs=2, stream=True
    )
    tokens, logprobs, offsets = [], [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == lp.tokens
    assert logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert offsets == lp.text_offset
    plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_and_top_k(live_server: LiveServer) -> None:
    client = live_server.client()
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        raw = bytes(entry.bytes)  # a piece of a character: bytes:\\xNN, its raw bytes
        expected = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        assert entry.token in (raw.decode("utf-8", errors="replace"), expected)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    streamed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, stream=True
    )
    entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in entries)  # top_logprobs not given: none
    # top_k=1 (vLLM's extension, through the client's extra_body) samples greedily.
    hot = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=1.5, extra_body={"top_k": 1}
    )
    assert hot.choices[0].message.content == reply.choices[0].message.content


def test_stop_string_truncates_and_finishes_with_stop(live_server: LiveServer) -> None:
    client = live_server.client()
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0)
    text = full.choices[0].text
    candidates = [c for c in text[1:] if c.strip()]
    if not candidates:
        pytest.skip("greedy output has no printable character to stop on")
    stop = candidates[0]
    cut = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_ignore_eos_and_stop_token_ids(live_server: LiveServer) -> None:
    """vLLM's extensions, through the client's extra_body: ignore_eos generates through
    end-of-sequence to max_tokens (as load generators fix output lengths), and
    stop_token_ids end a choice on other tokens."""
    client = live_server.client()
    (eos, *_) = live_server.engine.tokenizer.eos_token_ids
    args = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "temperature": 0, "logprobs": 0}
    forced_eos = {str(eos): 100}  # the model's every next token is end-of-sequence
    ended = client.completions.create(**args, logit_bias=forced_eos)
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 1)
    through = client.completions.create(
        **args, logit_bias=forced_eos, extra_body={"ignore_eos": True}
    )
    assert (through.choices[0].finish_reason, through.usage.completion_tokens) == ("length", 6)
    # Token 42 forced at every step: a stop token when listed, nothing when not.
    forced_42 = {str(eos): -100, "42": 100}
    runs = client.completions.create(**args, logit_bias=forced_42)
    assert (runs.choices[0].finish_reason, runs.usage.completion_tokens) == ("length", 6)
    stopped = client.completions.create(
        **args, logit_bias=forced_42, extra_body={"stop_token_ids": [7, 42]}
    )
    assert (stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("stop", 1)
    assert stopped.choices[0].text == ""  # the stop token's text is not output (as vLLM)
    assert runs.choices[0].text  # though it has some
    other = client.completions.create(
        **args, logit_bias=forced_42, extra_body={"stop_token_ids": [43]}
    )
    assert other.choices[0].text == runs.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**args, extra_body={"stop_token_ids": [10**9]})
    assert refused.value.param == "stop_token_ids"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**args, extra_body={"skip_special_tokens": False})
    assert refused.value.param == "skip_special_tokens"


def test_min_p_repetition_penalty_and_min_tokens(live_server: LiveServer) -> None:
    """vLLM's samplers, through the client's extra_body, on the engine's real forward
    pass (their arithmetic is tested in tests/engine)."""
    client = live_server.client()
    (eos, *_) = live_server.engine.tokenizer.eos_token_ids
    # A prompt the tiny model's greedy decoding goes on repeating from.
    prompt = [*range(100, 160), *[7] * 20]
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "logprobs": 0}
    greedy = client.completions.create(**args, temperature=0, logit_bias={str(eos): -100})
    # min_p = 1 keeps only the likeliest token: sampling hot and seeded is greedy.
    floor = client.completions.create(
        **args, temperature=1.8, seed=4, logit_bias={str(eos): -100}, extra_body={"min_p": 1.0}
    )
    assert floor.choices[0].text == greedy.choices[0].text
    # A strong repetition penalty steers greedy decoding away from what it repeated.
    tokens = greedy.choices[0].logprobs.tokens
    penalized = client.completions.create(
        **args,
        temperature=0,
        logit_bias={str(eos): -100},
        extra_body={"repetition_penalty": 2.0},
    )
    assert len(set(tokens)) < len(tokens), "the plain greedy output repeats itself"
    assert penalized.choices[0].logprobs.tokens != tokens
    # With end-of-sequence forced, min_tokens holds it off for 4 tokens.
    ended = client.completions.create(
        **args, temperature=0, logit_bias={str(eos): 100}, extra_body={"min_tokens": 4}
    )
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 5)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="abc", extra_body={"min_tokens": 17})
    assert refused.value.param == "min_tokens"  # above max_tokens' default of 16


def test_chat_stream_with_usage_matches_the_whole_reply(live_server: LiveServer) -> None:
    client = live_server.client()
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason
    assert all(r is None for r in reasons[:-1])
    *body, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in body)


def test_text_stream_without_usage_ends_with_done(live_server: LiveServer) -> None:
    with httpx.stream(
        "POST",
        f"{live_server.base_url}/v1/completions",
        headers={"authorization": f"Bearer {live_server.keys['batch']}"},
        json={"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"].startswith("req_")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert all('"usage"' not in e for e in events[:-1])
    assert '"service_tier":"batch"' in events[0]


def test_service_tier_may_only_go_down(live_server: LiveServer) -> None:
    client = live_server.client(live_server.keys["interactive"])
    lower = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, extra_body={"service_tier": "batch"}
    )
    assert lower.service_tier == "batch"
    same = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, service_tier="auto"
    )
    assert same.service_tier == "interactive"
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, service_tier="priority"
        )
    assert denied.value.code == "tier_not_allowed"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"service_tier": "gold"}
        )
    assert unknown.value.param == "service_tier"
    # Another tier of the key's own rank is not lower: free of charge, it billed nothing.
    with live_server.admin() as admin:
        created = admin.post("/tiers", json={"name": "gold", "rank": 1})
        assert created.status_code in (200, 201), created.text
        try:
            with pytest.raises(openai.PermissionDeniedError) as sideways:
                client.completions.create(
                    model=MODEL, prompt="x", max_tokens=2, extra_body={"service_tier": "gold"}
                )
            assert sideways.value.code == "tier_not_allowed"
        finally:
            assert admin.delete("/tiers/gold").status_code == 200


def _usage_rows(database_url: str, request_ids: list[str]) -> dict[str, UsageRow]:
    async def read() -> dict[str, UsageRow]:
        engine = create_db_engine(database_url)
        try:
            async with create_sessionmaker(engine)() as session:
                rows = await session.scalars(
                    select(UsageRow).where(UsageRow.request_id.in_(request_ids))
                )
                return {row.request_id: row for row in rows}
        finally:
            await engine.dispose()

    return asyncio.run(read())


def _wait_for_usage(database_url: str, request_ids: list[str]) -> dict[str, UsageRow]:
    deadline = time.monotonic() + 10
    while True:
        rows = _usage_rows(database_url, request_ids)
        if len(rows) == len(request_ids) or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def test_every_request_leaves_a_usage_record(live_server: LiveServer) -> None:
    client = live_server.client(live_server.keys["priority"])
    ok = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=3)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=9)
    ok_id = ok.headers["x-request-id"]
    bad_id = bad.value.response.headers["x-request-id"]
    rows = _wait_for_usage(live_server.database_url, [ok_id, bad_id])
    good = rows[ok_id]
    assert good.outcome == "ok"
    assert good.tenant_id == live_server.tenant_ids["priority"]
    assert (good.tier, good.model) == ("priority", MODEL)
    assert good.prompt_tokens == ok.parse().usage.prompt_tokens
    assert good.completion_tokens == ok.parse().usage.completion_tokens
    assert good.ttft_ms is not None
    assert good.queue_wait_ms is not None
    assert 0 <= good.queue_wait_ms <= good.ttft_ms <= good.e2e_ms
    assert rows[bad_id].outcome == "invalid:invalid_request_error"


def test_a_streams_ttft_ends_when_its_first_text_is_sent(live_server: LiveServer) -> None:
    # A long stop string holds every character back until the end (none may be sent
    # before it is known not to begin the stop string): the first text the client gets
    # is in the last chunk, and that, not the first token made, ends the TTFT.
    headers = {"authorization": f"Bearer {live_server.keys['priority']}"}
    body = {
        "model": MODEL,
        "prompt": "go",
        "max_tokens": 24,
        "stream": True,
        "temperature": 0,
        "stop": ["\u2603" * 200],
    }
    started = time.monotonic()
    first_text_s = None
    with httpx.stream(
        "POST", f"{live_server.base_url}/v1/completions", headers=headers, json=body, timeout=60
    ) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first_text_s = first_text_s or time.monotonic() - started
    row = _wait_for_usage(live_server.database_url, [request_id])[request_id]
    assert first_text_s is not None
    assert row.completion_tokens == 24
    # Before, the TTFT was the first token made, several decode steps before any text.
    assert row.ttft_ms >= 0.9 * row.e2e_ms, (row.ttft_ms, row.e2e_ms)


def _assert_engine_freed(live_server: LiveServer) -> None:
    """The aborted request leaves the engine (within 5 s) and gives back every KV block."""
    deadline = time.monotonic() + 5
    while live_server.engine.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = live_server.engine.stats()
    assert stats.num_running == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_client_disconnect_aborts_and_frees_the_engine(live_server: LiveServer) -> None:
    headers = {"authorization": f"Bearer {live_server.keys['interactive']}"}
    body = {"model": MODEL, "prompt": "go", "max_tokens": 200, "stream": True, "temperature": 1}
    with httpx.stream(
        "POST", f"{live_server.base_url}/v1/completions", headers=headers, json=body, timeout=60
    ) as response:
        request_id = response.headers["x-request-id"]
        next(response.iter_lines())  # one event, then hang up
    rows = _wait_for_usage(live_server.database_url, [request_id])
    assert rows[request_id].outcome == "aborted"
    assert rows[request_id].completion_tokens < 200
    _assert_engine_freed(live_server)


def _aborted_request_ids(database_url: str, tenant_id: str) -> set[str]:
    async def read() -> set[str]:
        engine = create_db_engine(database_url)
        try:
            async with create_sessionmaker(engine)() as session:
                rows = await session.scalars(
                    select(UsageRow.request_id).where(
                        UsageRow.tenant_id == tenant_id, UsageRow.outcome == "aborted"
                    )
                )
                return set(rows)
        finally:
            await engine.dispose()

    return asyncio.run(read())


def test_client_disconnect_aborts_a_non_streaming_request(live_server: LiveServer) -> None:
    """No byte of the answer has been sent when the client hangs up: the request is still
    noticed as gone, its job aborted and its KV blocks freed."""
    tenant_id = live_server.tenant_ids["batch"]
    before = _aborted_request_ids(live_server.database_url, tenant_id)
    body = json.dumps({"model": MODEL, "prompt": "go", "max_tokens": 240, "temperature": 1})
    host, port = live_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {live_server.keys['batch']}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        deadline = time.monotonic() + 10
        while not live_server.engine.stats().num_running and time.monotonic() < deadline:
            time.sleep(0.005)
        assert live_server.engine.stats().num_running == 1, "the request never started"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        aborted = _aborted_request_ids(live_server.database_url, tenant_id) - before
        if aborted:
            break
        time.sleep(0.1)
    assert len(aborted) == 1
    _assert_engine_freed(live_server)


def test_health_and_readiness(live_server: LiveServer) -> None:
    health = httpx.get(f"{live_server.base_url}/healthz")
    assert health.status_code == 200
    assert health.headers["x-request-id"]
    ready = httpx.get(f"{live_server.base_url}/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"database": "ok", "queue": "ok", "worker": "ok"}
