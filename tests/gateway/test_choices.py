"""`n` choices through the official openai client against a live server, on the
in-memory queue and on Redis: each choice is the seeded single request it stands for,
streamed equals whole, usage bills the prompt once, TPM counts every choice, a client
that hangs up stops every choice, and Batch API lines take `n` too."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.openai.choices import choice_job_id, choice_jobs, merge_choices
from scheduler.keys import KeySpace
from tests.conftest import REDIS_URL
from tests.gateway.conftest import (
    LiveServer,
    ServerThread,
    paced_tier,
    run_one_line_batch,
    wait_for_usage_rows,
)

MODEL = "tiny-random"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_each_choice_is_the_seeded_single_request(queue_server: LiveServer) -> None:
    client = queue_server.client()
    args = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0}
    whole = client.completions.create(**args, n=3, seed=7)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    singles = [client.completions.create(**args, seed=7 + i) for i in range(3)]
    for choice, single in zip(whole.choices, singles, strict=True):
        assert choice.text == single.choices[0].text
        assert choice.finish_reason == single.choices[0].finish_reason
    assert len({c.text for c in whole.choices}) > 1, "the choices should differ"
    # The prompt is billed once; the completion tokens of every choice add up.
    assert whole.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert whole.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_a_seed_at_the_end_of_the_range_wraps(queue_server: LiveServer) -> None:
    client = queue_server.client()
    args = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 1.0}
    whole = client.completions.create(**args, n=2, seed=2**63 - 1)
    wrapped = client.completions.create(**args, seed=-(2**63))
    assert whole.choices[1].text == wrapped.choices[0].text


def test_streamed_chat_choices_match_the_whole_reply(queue_server: LiveServer) -> None:
    client = queue_server.client()
    args = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 1.2,
        "seed": 11,
        "n": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    *body, last = chunks
    texts: dict[int, str] = {}
    roles: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    tokens: dict[int, list[str]] = {}
    for chunk in body:
        assert chunk.usage is None
        (choice,) = chunk.choices
        if choice.index not in roles:  # each choice opens with its role
            assert choice.delta.role == "assistant"
            roles[choice.index] = choice.delta.role
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason is not None:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
        if choice.logprobs is not None:
            tokens.setdefault(choice.index, []).extend(t.token for t in choice.logprobs.content)
    assert sorted(texts) == [0, 1, 2]
    for choice in whole.choices:
        assert texts[choice.index] == choice.message.content
        assert finishes[choice.index] == [choice.finish_reason]
        assert tokens[choice.index] == [t.token for t in choice.logprobs.content]
    assert last.choices == []
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.completion_tokens == sum(len(c.logprobs.content) for c in whole.choices)


def test_choices_leave_one_usage_record(queue_server: LiveServer) -> None:
    # Stops make the choices' lengths differ; logprobs count each choice's tokens.
    raw = queue_server.client().completions.with_raw_response.create(
        model=MODEL,
        prompt="Count",
        max_tokens=12,
        n=4,
        temperature=1.0,
        seed=12,
        logprobs=0,
        stop=["e", "a"],
    )
    reply = raw.parse()
    lengths = [len(c.logprobs.tokens) for c in reply.choices]
    request_id = raw.headers["x-request-id"]
    rows = wait_for_usage_rows(queue_server.database_url, [request_id])
    assert len(rows) == 1
    assert rows[0].outcome == "ok"
    assert rows[0].prompt_tokens == reply.usage.prompt_tokens
    assert rows[0].completion_tokens == reply.usage.completion_tokens == sum(lengths)
    assert rows[0].num_choices == 4
    # Its TPOT is its longest choice's (gateway.usage.UsageRecord.decode_tokens).
    assert rows[0].longest_choice_tokens == max(lengths)
    if queue_server.redis_prefix is not None:
        _assert_settled(queue_server.redis_prefix, request_id, 4, reply.usage.prompt_tokens)


def _assert_settled(prefix: str, request_id: str, n: int, prompt_tokens: int) -> None:
    """The request's jobs were queued with the prompt they bill, once, should the gateway
    die before billing them (gateway.usage_recovery), and were settled once its usage
    record was written: no gateway would bill them again."""
    keys = KeySpace(prefix)
    job_ids = [choice_job_id(request_id, i) for i in range(n)]
    with redis.Redis.from_url(REDIS_URL, decode_responses=True) as store:
        assert [store.hget(keys.job(j), "bp") for j in job_ids] == [str(prompt_tokens)] + ["0"] * (
            n - 1
        )
        deadline = time.monotonic() + 10  # settled at the gateway's next round (1 s)
        while True:
            gateways = store.smembers(keys.billing)
            unsettled = [
                j for gw in gateways for j in job_ids if store.sismember(keys.unbilled(gw), j)
            ]
            if not unsettled or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(gateways) == 1
        assert unsettled == []


def test_tpm_reserves_max_tokens_for_every_choice(queue_server: LiveServer) -> None:
    client = queue_server.client(queue_server.new_key(tpm=60))
    args = {"model": MODEL, "prompt": "hi", "max_tokens": 20}
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**args, n=4)  # 4 x 20 + the prompt > 60
    assert refused.value.code == "exceeds_token_limit"
    assert "(prompt + 4 x max_tokens)" in refused.value.message
    assert "lower n" in refused.value.message
    assert len(client.completions.create(**args, n=2).choices) == 2  # 2 x 20 + prompt fits


def test_each_choice_takes_a_concurrency_slot(queue_server: LiveServer) -> None:
    client = queue_server.client(queue_server.new_key(max_concurrency=4))
    args = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**args, n=5)  # five sequences at once, never allowed
    assert (refused.value.param, refused.value.code) == ("n", "exceeds_concurrency_limit")
    assert len(client.completions.create(**args, n=4).choices) == 4
    # A batch line is admitted as the live request is.
    batch_client = queue_server.client(queue_server.new_key("batch", max_concurrency=4))
    line = run_one_line_batch(batch_client, "/v1/completions", {**args, "n": 5})
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["code"] == "exceeds_concurrency_limit"


def test_slo_admission_judges_a_request_by_its_first_choice(queue_server: LiveServer) -> None:
    """Its TTFT is the first choice's first token: the later choices queued behind it are
    no reason to refuse it (an idle server refused this one every time)."""
    client = queue_server.client(queue_server.new_key("priority"))  # TTFT SLO 500 ms
    # Checked each, the last choice would see 31 x 240 tokens ahead: seconds of work.
    reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=240, n=32)
    assert [c.index for c in reply.choices] == list(range(32))


def test_a_client_gone_mid_stream_stops_every_choice(queue_server: LiveServer) -> None:
    headers = {"authorization": f"Bearer {queue_server.keys['interactive']}"}
    body = {
        "model": MODEL,
        "prompt": "go",
        "max_tokens": 240,
        "temperature": 1,
        "n": 3,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{queue_server.base_url}/v1/completions", headers=headers, json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        next(response.iter_lines())  # one event, then hang up
    rows = wait_for_usage_rows(queue_server.database_url, [request_id])
    assert rows[0].outcome == "aborted"
    assert rows[0].completion_tokens < 3 * 240
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = queue_server.engine.stats()
        if not stats.num_running and not stats.num_waiting:
            break
        time.sleep(0.05)
    stats = queue_server.engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.fixture
def one_seq_server(tmp_path) -> Iterator[LiveServer]:
    """A server whose engine runs one sequence at a time, with room for long outputs."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from gateway.app import build_app
    from gateway.settings import Settings

    settings = Settings(
        data_dir=tmp_path, admin_token=secrets.token_urlsafe(24), model=MODEL, device="cpu"
    )
    config = EngineConfig(
        model=MODEL, device="cpu", max_model_len=2048, max_num_seqs=1, kv_cache_bytes=32 * 2**20
    )
    engine = AsyncEngine(config)
    thread = ServerThread(build_app(settings, engine=engine))
    thread.start()
    server = LiveServer(
        f"http://127.0.0.1:{thread.port}", settings.admin_token or "", settings.db_url, engine
    )
    try:
        yield server
    finally:
        server.close_clients()
        thread.stop()


def test_a_later_choice_timed_out_in_the_queue_stops_the_first(
    one_seq_server: LiveServer,
) -> None:
    server = one_seq_server
    with server.admin() as admin:
        tier = admin.post("/tiers", json={"name": "short", "rank": 1, "max_queue_ms": 200})
        assert tier.status_code == 201, tier.text
    client = server.client(server.new_key("short"))
    # Choice 0 runs (seconds of tokens, end of sequence banned); the engine takes a few
    # more to wait for its only sequence slot, and the rest stay queued past the tier's
    # queue limit.
    no_eos = {str(token): -100 for token in server.engine.tokenizer.eos_token_ids}
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=MODEL, prompt="go", max_tokens=2000, n=8, logit_bias=no_eos)
    assert refused.value.code == "queue_timeout"
    deadline = time.monotonic() + 2  # alone, choice 0 would run for seconds more
    while server.engine.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.stats().num_running == 0, "a choice ran on for nobody"


def test_a_batch_line_takes_n(queue_server: LiveServer) -> None:
    client = queue_server.client(queue_server.new_key("batch"))
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "n": 3, "seed": 5}
    response = run_one_line_batch(client, "/v1/chat/completions", body)["response"]
    assert response["status_code"] == 200
    choices = response["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    live = queue_server.client().chat.completions.create(**body)
    assert [c["message"]["content"] for c in choices] == [c.message.content for c in live.choices]
    usage = response["body"]["usage"]
    assert usage["completion_tokens"] == live.usage.completion_tokens


def test_a_batch_runs_as_many_choices_at_once_as_its_window(queue_server: LiveServer) -> None:
    """The window counts jobs: lines of n=3 under a window of 4 run one line at a time
    (not four lines, twelve jobs, at once)."""
    with queue_server.admin() as admin:
        tier = paced_tier(admin, max_concurrency=4)
    client = queue_server.client(queue_server.new_key(tier))
    no_eos = {str(t): -100 for t in queue_server.engine.tokenizer.eos_token_ids}
    body = {"model": MODEL, "prompt": "go", "max_tokens": 40, "n": 3, "logit_bias": no_eos}
    lines = [
        {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": body}
        for i in range(4)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    most = 0
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        stats = queue_server.engine.stats()
        with queue_server.admin() as admin:
            queued = admin.get("/queues").json()["tiers"].get(tier, {}).get("queued_jobs", 0)
        most = max(most, stats.num_running + stats.num_waiting + queued)
        time.sleep(0.01)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 4
    assert 1 <= most <= 4  # seen running, never more than the window


# ------------------------------------------------------------------ the pieces alone
async def _outputs(items: list[Any], delay_s: float = 0.0) -> AsyncIterator[Any]:
    for item in items:
        await asyncio.sleep(delay_s)
        if isinstance(item, Exception):
            raise item
        yield item


async def test_merge_keeps_each_streams_order_and_ends_with_the_last() -> None:
    streams = [_outputs(["a1", "a2", "a3"], 0.001), _outputs(["b1", "b2"], 0.002)]
    merged = [pair async for pair in merge_choices(streams)]
    assert sorted(merged) == [(0, "a1"), (0, "a2"), (0, "a3"), (1, "b1"), (1, "b2")]
    assert [o for i, o in merged if i == 0] == ["a1", "a2", "a3"]
    assert [o for i, o in merged if i == 1] == ["b1", "b2"]


async def test_merge_raises_the_first_error_and_stops_reading() -> None:
    read_after_error: list[str] = []

    async def slow() -> AsyncIterator[str]:
        yield "s1"
        await asyncio.sleep(0.05)
        read_after_error.append("s2")
        yield "s2"

    seen: list[tuple[int, str]] = []

    async def read_all() -> None:
        async for pair in merge_choices([slow(), _outputs(["f1", ValueError("broken")])]):
            seen.append(pair)

    with pytest.raises(ValueError, match="broken"):
        await read_all()
    await asyncio.sleep(0.1)
    assert read_after_error == []  # the other reader was cancelled with the error
    assert (1, "f1") in seen


def test_choice_jobs_keep_the_request_id_for_the_first() -> None:
    from engine.request import SamplingParams
    from scheduler.job import Job

    job = Job("req_x", "t", "interactive", 1, 1.0, (1, 2), SamplingParams(seed=3), 0.0)
    jobs = choice_jobs(job, 3)
    assert [j.job_id for j in jobs] == ["req_x", choice_job_id("req_x", 1), "req_x.2"]
    assert [j.params.seed for j in jobs] == [3, 4, 5]
    unseeded = choice_jobs(Job("r", "t", "i", 1, 1.0, (1,), SamplingParams(), 0.0), 2)
    assert [j.params.seed for j in unseeded] == [None, None]
