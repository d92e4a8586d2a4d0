"""A large prompt is tokenized off the event loop: other requests keep being served."""

from __future__ import annotations

import asyncio
import json
import random
import time

from engine.tokenizer import Tokenizer
from gateway.model_info import ModelCard
from gateway.openai.routes import OFF_LOOP_MIN_BODY_BYTES, OpenAIDeps, OpenAIRoutes
from gateway.openai.schemas import parse_completion_request


def _routes() -> OpenAIRoutes:
    # Only the model card is used on this path; a context long enough for the prompt.
    card = ModelCard("tiny-random", max_model_len=10_000_000, tokenizer=Tokenizer("tiny-random"))
    deps = OpenAIDeps(auth=None, tiers=None, model=card, dispatcher=None, usage=None, created_s=0)  # type: ignore[arg-type]
    return OpenAIRoutes(deps)


async def _longest_stall_s(work) -> tuple[float, object]:
    """The longest the event loop went without running a 1 ms ticker while `work` ran."""
    longest = 0.0
    done = False

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    try:
        result = await work
    finally:
        done = True
        await tick
    return longest, result


async def test_a_large_prompt_leaves_the_event_loop_free() -> None:
    routes = _routes()
    # A prompt whose tokenizing takes long enough to show a stall, however fast the
    # machine: doubled until it does.
    num_words = 20_000
    while True:
        words = [f"w{random.Random(i).randrange(10**6)}" for i in range(num_words)]
        body = json.dumps({"model": "tiny-random", "prompt": " ".join(words)}).encode()
        parsed = parse_completion_request(body)
        started = time.perf_counter()
        inline_ids = routes.prompt_token_ids(parsed)  # what the loop used to wait for
        inline_s = time.perf_counter() - started
        if inline_s > 0.1 or num_words >= 1_280_000:
            break
        num_words *= 2
    assert len(body) >= OFF_LOOP_MIN_BODY_BYTES
    assert inline_s > 0.1

    stall_s, ids = await _longest_stall_s(routes.prompt_token_ids_off_loop(parsed, len(body)))
    assert ids == inline_ids
    assert stall_s < inline_s / 3, (stall_s, inline_s)
